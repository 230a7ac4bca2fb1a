"""Stored tensor names (cnr.names): one type formats and parses them, and refuses malformed ones."""

from __future__ import annotations

import pytest

from cnr.errors import CheckpointError
from cnr.names import TensorName, parse_rank_label, rank_label, rng_name, stateful_name


@pytest.mark.parametrize("name, key, path, state", [
    ("model/over.0.weight", "model", "over.0.weight", None),
    ("model/ebc.embedding_bags.t0.weight/t0.momentum1", "model", "ebc.embedding_bags.t0.weight", "t0.momentum1"),
    ("optim/model.over.0.weight/exp_avg", "optim", "model.over.0.weight", "exp_avg"),
    ("sched/rank-00003/t1", "sched", "rank-00003", "t1"),
    ("rng/rank-00000", "rng", "rank-00000", None),
])
def test_round_trip(name, key, path, state):
    parts = TensorName.parse(name)
    assert (parts.key, parts.path, parts.state) == (key, path, state)
    assert str(parts) == name and TensorName.parse(str(parts)) == parts
    assert parts.parent == f"{key}/{path}"


@pytest.mark.parametrize("name", ["", "model", "model/", "/x", "a//b", "a/b/", "a/b/c/d", "a/b/c/"])
def test_malformed_names_are_refused_naming_the_name(name):
    with pytest.raises(CheckpointError, match="malformed") as e:
        TensorName.parse(name)
    assert repr(name) in str(e.value)


@pytest.mark.parametrize("parts", [("", "x"), ("a/b", "x"), ("a", ""), ("a", "x/y"), ("a", "x", ""), ("a", "x", "s/t")])
def test_parts_holding_a_separator_or_empty_are_refused(parts):
    with pytest.raises(ValueError, match="non-empty string without '/'"):
        TensorName(*parts)


def test_per_rank_names():
    assert stateful_name("loader", 7, 2) == "loader/rank-00007/t2"
    assert TensorName.parse(stateful_name("loader", 7, 2)).rank == 7
    assert rng_name(12) == "rng/rank-00012" and TensorName.parse(rng_name(12)).rank == 12
    assert rank_label(123456) == "rank-123456" and parse_rank_label("rank-123456") == 123456
    assert TensorName.parse("model/over.0.weight").rank is None
    assert parse_rank_label("rank-12") is None and parse_rank_label("rank-00012x") is None
