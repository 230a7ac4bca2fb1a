"""SyntheticReader: determinism, cursor/world-size protocol, id distribution, teacher signal."""

from __future__ import annotations

import json
from typing import Dict, List

import numpy as np
import pytest
import torch

from cnr.errors import ConfigError
from cnr.readers import Batch, SyntheticReader
from cnr.readers.synthetic import power_law_ranks

FEATURES = [("a", 1000), ("b", 50), ("c", 1), ("d", 3_000_000)]
B = 32


def make(rank: int = 0, world_size: int = 1, cursor=None, **kw) -> SyntheticReader:
    args = dict(features=FEATURES, num_dense=4, batch_size=B, rank=rank, world_size=world_size,
                cursor=cursor, seed=7, power_law_exponent=1.1)
    args.update(kw)
    return SyntheticReader(**args)


def same(x: Batch, y: Batch) -> bool:
    return (torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
            and torch.equal(x.sample_ids, y.sample_ids)
            and x.sparse.keys() == y.sparse.keys()
            and torch.equal(x.sparse.values(), y.sparse.values())
            and torch.equal(x.sparse.lengths(), y.sparse.lengths()))


def gb(batch: Batch) -> int:
    """Global batch index of a batch, from its sample ids."""
    return int(batch.sample_ids[0]) // batch.batch_size


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank-based (Mann-Whitney) AUC; scores are continuous so ties are negligible."""
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_same_seed_same_batches():
    r1, r2 = make(), make()
    for _ in range(3):
        assert same(r1.next_batch(), r2.next_batch())


@pytest.mark.parametrize("change", [{"seed": 8}, {"split": "eval"}, {"power_law_exponent": 1.5}])
def test_other_seed_split_or_exponent_differs(change):
    x, y = make().next_batch(), make(**change).next_batch()
    assert not torch.equal(x.sparse.values(), y.sparse.values())
    if "power_law_exponent" not in change:  # the exponent only shapes the ids
        assert not torch.equal(x.dense, y.dense)
    # Same global position: sample ids do not depend on seed or split.
    assert torch.equal(x.sample_ids, y.sample_ids)


def test_eval_split_shares_the_teacher():
    train, ev = make(), make(split="eval")
    batch = ev.next_batch()
    assert torch.equal(train.teacher_logits(batch), ev.teacher_logits(batch))
    assert not torch.equal(make(seed=8).teacher_logits(batch), ev.teacher_logits(batch))


def test_cursor_round_trip_and_json():
    ref = make()
    for _ in range(5):
        ref.next_batch()
    expected = [ref.next_batch() for _ in range(3)]
    r = make()
    for _ in range(5):
        r.next_batch()
    cursor = json.loads(json.dumps(r.cursor()))
    assert cursor == {"kind": "synthetic", "next_batch": 5}
    resumed = make(cursor=cursor)
    for e in expected:
        assert same(resumed.next_batch(), e)


def test_cursor_is_a_pure_getter():
    r, ref = make(rank=1, world_size=3), make(rank=1, world_size=3)
    r.next_batch()
    ref.next_batch()
    assert r.cursor() == r.cursor() == {"kind": "synthetic", "next_batch": 3}
    assert same(r.next_batch(), ref.next_batch())


def test_ranks_partition_the_stream_like_world_size_one():
    k = 3
    one = make()
    single = {gb(b): b for b in (one.next_batch() for _ in range(2 * k))}
    assert sorted(single) == list(range(2 * k))
    seen: Dict[int, Batch] = {}
    for rank in range(2):
        r = make(rank=rank, world_size=2)
        for step in range(k):
            b = r.next_batch()
            assert gb(b) == rank + 2 * step
            assert gb(b) not in seen
            seen[gb(b)] = b
    assert sorted(seen) == sorted(single)
    for g, b in seen.items():
        assert same(b, single[g])
        assert torch.equal(b.sample_ids, torch.arange(g * B, (g + 1) * B))


@pytest.mark.parametrize("w_before,w_after", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_resume_across_world_sizes(w_before, w_after):
    ref = make()
    read: List[Batch] = []
    readers = [make(rank=r, world_size=w_before) for r in range(w_before)]
    for _ in range(2):
        read += [r.next_batch() for r in readers]
    cursors = [r.cursor() for r in readers]
    assert all(c == cursors[0] for c in cursors)  # every rank describes the global position
    resumed = [make(rank=r, world_size=w_after, cursor=cursors[0]) for r in range(w_after)]
    for _ in range(2):
        read += [r.next_batch() for r in resumed]
    ids = sorted(gb(b) for b in read)
    assert ids == list(range(2 * w_before + 2 * w_after))  # each global batch exactly once
    for b in read:
        assert same(b, ref.global_batch(gb(b)))


def test_batch_layout_and_bounds():
    r = make(ids_per_feature=3)
    r.next_batch()
    b = r.next_batch()
    kjt = b.sparse
    assert kjt.keys() == [n for n, _ in FEATURES]
    assert kjt.values().dtype == torch.int64 and kjt.lengths().dtype == torch.int32
    assert kjt.lengths().shape == (len(FEATURES) * B,) and bool((kjt.lengths() == 3).all())
    assert kjt.stride() == B
    for name, rows in FEATURES:
        v = kjt[name].values()
        assert v.numel() == 3 * B and int(v.min()) >= 0 and int(v.max()) < rows
    assert b.dense.shape == (B, 4) and b.dense.dtype == torch.float32
    assert bool((b.dense >= 0).all())
    assert b.labels.dtype == torch.float32 and set(b.labels.tolist()) <= {0.0, 1.0}
    assert torch.equal(b.sample_ids, torch.arange(B, 2 * B))
    assert same(b.to("cpu"), b)


@pytest.mark.parametrize("a", [0.5, 1.0, 1.2, 2.0])
def test_power_law_rank_probabilities(a):
    n = 1000
    u = np.random.default_rng(0).random(200_000)
    ranks = power_law_ranks(u, np.array([n], dtype=np.uint64), a)
    assert ranks.min() >= 0 and ranks.max() < n
    freq = np.bincount(ranks, minlength=n) / u.size
    k = np.arange(3, dtype=np.float64)
    if a == 1.0:
        expect = np.log((k + 2) / (k + 1)) / np.log(n + 1)
    else:
        expect = ((k + 2) ** (1 - a) - (k + 1) ** (1 - a)) / ((n + 1) ** (1 - a) - 1)
    np.testing.assert_allclose(freq[:3], expect, atol=0.005)


def test_hot_rows_are_skewed_and_spread():
    rows = 10_000
    r = SyntheticReader([("x", rows)], 1, 4096, 0, 1, seed=3, power_law_exponent=1.2)
    ids = torch.cat([r.next_batch().sparse.values() for _ in range(2)]).numpy()
    counts = np.sort(np.bincount(ids, minlength=rows))[::-1]
    top_share = counts[: rows // 100].sum() / ids.size
    assert top_share > 0.6  # uniform ids would give 0.01; the exact law gives ~0.72
    hottest = np.argsort(np.bincount(ids, minlength=rows))[::-1][:100]
    assert hottest.max() - hottest.min() > rows // 2  # not clustered at row 0
    flat = SyntheticReader([("x", rows)], 1, 4096, 0, 1, seed=3, power_law_exponent=0.3)
    flat_ids = flat.next_batch().sparse.values().numpy()
    flat_counts = np.sort(np.bincount(flat_ids, minlength=rows))[::-1]
    assert flat_counts[: rows // 100].sum() / flat_ids.size < top_share / 3


def test_teacher_logit_predicts_labels():
    feats = [(f"C{i}", 10 ** (2 + i % 5)) for i in range(26)]
    r = SyntheticReader(feats, 13, 1024, 0, 1, seed=11, power_law_exponent=1.2)
    scores, labels = [], []
    for _ in range(4):
        b = r.next_batch()
        scores.append(r.teacher_logits(b).numpy())
        labels.append(b.labels.numpy())
    y, s = np.concatenate(labels), np.concatenate(scores)
    assert 0.15 < y.mean() < 0.6
    assert auc(s, y) > 0.7
    assert 0.45 < auc(np.random.default_rng(0).random(y.size), y) < 0.55  # the helper is sane


BAD_ARGS = [
    ({"batch_size": 0}, "batch_size=0"),
    ({"world_size": 0}, "world_size=0"),
    ({"rank": 2, "world_size": 2}, "rank=2"),
    ({"rank": -1}, "rank=-1"),
    ({"num_dense": -1}, "num_dense=-1"),
    ({"power_law_exponent": 0.0}, "power_law_exponent=0.0"),
    ({"power_law_exponent": -1.2}, "power_law_exponent=-1.2"),
    ({"power_law_exponent": float("nan")}, "power_law_exponent=nan"),
    ({"ids_per_feature": 0}, "ids_per_feature=0"),
    ({"split": "test"}, "split='test'"),
    ({"features": []}, "features=[]"),
    ({"features": [("a", 5), ("a", 6)]}, "'a'"),
    ({"features": [("a", 0)]}, "table_rows of feature 'a'"),
    ({"features": [("a", 2 ** 33)]}, str(2 ** 33)),
    ({"cursor": {"kind": "tsv", "next_batch": 0}}, "'tsv'"),
    ({"cursor": {"kind": "synthetic", "next_batch": -1}}, "next_batch']=-1"),
    ({"cursor": {"kind": "synthetic", "next_batch": "3"}}, "next_batch']='3'"),
    ({"cursor": {"kind": "synthetic"}}, "next_batch"),
    ({"cursor": {"kind": "synthetic", "next_batch": 1, "x": 1}}, "['x']"),
    ({"cursor": [1]}, "cursor=[1]"),
]


@pytest.mark.parametrize("change,needle", BAD_ARGS)
def test_bad_arguments_raise_config_error(change, needle):
    with pytest.raises(ConfigError) as info:
        make(**change)
    assert needle in str(info.value)
