"""Config validation: every bad value is a ConfigError naming the key and what is allowed."""

from __future__ import annotations

import os

import pytest

from cnr.app.config import load_config
from cnr.errors import ConfigError

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")


def test_tiny_and_bench_load():
    tiny = load_config(TINY)
    assert tiny.train.steps == 60 and tiny.checkpoint.interval == 20
    assert [f for f, _ in tiny.feature_rows()] == ["f0", "f1", "f2", "f3", "f4"]
    bench = load_config(os.path.join(os.path.dirname(TINY), "bench.yaml"))
    assert bench.model.embedding_dim == 64 and len(bench.model.tables) == 26
    assert sum(t.rows for t in bench.model.tables) * 64 * 4 > 300e6  # "a few hundred MB"


def test_overrides_apply():
    c = load_config(TINY, ["train.steps=7", "checkpoint.enabled=false", "model.arch=dcn", "data.power_law_exponent=2"])
    assert (c.train.steps, c.checkpoint.enabled, c.model.arch, c.data.power_law_exponent) == (7, False, "dcn", 2.0)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.stepz=3", "unknown config key 'train.stepz'"),
        ("bogus.x=1", "unknown config key 'bogus'"),
        ("train.steps=abc", "'train.steps' must be an integer"),
        ("train.steps=1.5", "'train.steps' must be an integer"),
        ("checkpoint.enabled=3", "'checkpoint.enabled' must be true or false"),
        ("train.steps=0", "'train.steps' = 0"),
        ("train.steps=-5", "'train.steps' = -5"),
        ("checkpoint.interval=0", "'checkpoint.interval' = 0"),
        ("checkpoint.interval=-1", "'checkpoint.interval' = -1"),
        ("train.batch_size=0", "'train.batch_size' = 0"),
        ("model.arch=transformer", "'model.arch' = 'transformer' is not allowed; allowed: dlrm, dcn"),
        ("train.sparse_optimizer=lamb", "allowed: rowwise_adagrad, adagrad, sgd, adam"),
        ("model.sharding_types=[row_wize]", "'model.sharding_types' = 'row_wize'"),
        ("model.dense_arch=[32,8]", "ends with 8, but DLRM needs it to equal model.embedding_dim = 16"),
        ("model.over_arch=[8,2]", "must end with 1"),
        ("model.tables=[]", "'model.tables' is empty"),
        ("model.tables=[{name: a, rows: 10, features: []}]", "table 'a' (model.tables[0].features) has no features"),
        ("model.tables=[{name: a, rows: 0, features: [x]}]", "'model.tables[0].rows' = 0"),
        ("model.tables=[{name: a, rows: 5, features: [x]}, {name: a, rows: 5, features: [y]}]", "used by two tables"),
        ("model.tables=[{name: a, rows: 5, features: [x]}, {name: b, rows: 5, features: [x]}]", "already served by table 'a'"),
        ("model.tables=[{name: a, rows: 5, feature: [x]}]", "unknown config key 'model.tables[0].feature'"),
        ("data.source=parquet", "'data.source' = 'parquet'"),
        ("data.source=tsv", "'data.tsv_paths' is empty"),
        ("checkpoint.chunk_bytes=10", "'checkpoint.chunk_bytes' = 10"),
        ("data.reader_processes=-1", "'data.reader_processes' = -1 is not allowed; it must be in [0, 64]"),
        ("data.reader_processes=65", "'data.reader_processes' = 65"),
        ("data.queue_depth=0", "'data.queue_depth' = 0 is not allowed; it must be in [1, 1024]"),
        ("data.reader_timeout_s=0", "'data.reader_timeout_s' = 0.0 is not allowed; it must be a finite number > 0"),
        ("data.reader_timeout_s=.inf", "'data.reader_timeout_s' = inf"),
        ("data.trace_dir=3", "'data.trace_dir' must be a string"),
        ("trainsteps", "use dotted.key=value"),
        ("checkpoint.policy=sometimes", "allowed: full, one_shot, consecutive, intermittent"),
        ("checkpoint.bit_policy=guess", "'checkpoint.bit_policy' = 'guess' is not allowed; allowed: fixed, failures"),
        ("checkpoint.keep_last=-1", "'checkpoint.keep_last' = -1"),
        ("checkpoint.keep_last=99999999999999999999", "'checkpoint.keep_last' = 99999999999999999999 is not allowed; "
                                                      "it must be from 0 to 2147483647"),
        ("checkpoint.local_keep_last=2147483648", "'checkpoint.local_keep_last' = 2147483648 is not allowed"),
        ("checkpoint.chunk_bytes=2147483648", "'checkpoint.chunk_bytes' = 2147483648 is not allowed; it must be from "
                                              "4096 to 2147483647"),
        ("checkpoint.encode_threads=0", "'checkpoint.encode_threads' = 0 is not allowed; allowed: 1..256"),
        ("checkpoint.upload_threads=257", "'checkpoint.upload_threads' = 257 is not allowed; allowed: 1..256"),
        ("checkpoint.commit_timeout_s=.inf", "'checkpoint.commit_timeout_s' = inf is not allowed"),
        ("checkpoint.encode_threads=true", "'checkpoint.encode_threads' must be an integer"),
        ("checkpoint.search_kernel=fused", "'checkpoint.search_kernel' = 'fused' is not allowed; allowed: auto, eager, compiled"),
        ("checkpoint.compression=lz4", "'checkpoint.compression' = 'lz4' is not allowed; allowed: zstd, none"),
        ("checkpoint.compression_level=20", "'checkpoint.compression_level' = 20 is not allowed; allowed: 1..19"),
        ("checkpoint.optimizer_bits=4", "'checkpoint.optimizer_bits' = 4 is not allowed; allowed: 8, 32, or 0"),
        ("checkpoint.table_bits={t0: 5}", "'checkpoint.table_bits' = {'t0': 5} is not allowed; it maps table names to bit-widths 2, 3, 4, 8 or 32"),
        ("checkpoint.table_bits=[t0]", "'checkpoint.table_bits' must be a mapping"),
        ("checkpoint.table_bits={t0: true}", "table_bits['t0']\" must be an integer, got True"),
        ("checkpoint.table_bits={t9: 4}", "'checkpoint.table_bits' names 't9', which is not a table of model.tables; tables: 't0, t1, t2, t3'"),
        ("checkpoint.table_plan_width=32", "'checkpoint.table_plan_width' = 32 is not allowed; allowed: 0 (the plan"),
        ("checkpoint.optimizer_bits=0", "'checkpoint.optimizer_bits' = 0 (chosen from the failure budget) needs "
                                        "checkpoint.bit_policy 'failures', not 'fixed'"),
        ("checkpoint.failures={log8_tolerated_restores: -1}", "'checkpoint.failures.log8_tolerated_restores' = -1"),
        ("checkpoint.small_table_rows=-1", "'checkpoint.small_table_rows' = -1 is not allowed; it must be >= 0"),
        ("checkpoint.small_table_bits=2", "'checkpoint.small_table_bits' = 2 is not allowed; allowed: 3, 4, 8, 32"),
        ("checkpoint.merge_every=-1", "'checkpoint.merge_every' = -1 is not allowed; it must be >= 0"),
        ("checkpoint.merge_every=2", "needs checkpoint.policy 'consecutive', not 'intermittent'"),
        ("checkpoint.max_chain_ratio=1", "'checkpoint.max_chain_ratio' = 1.0 is not allowed; it must be 0 (no cap) or > 1"),
        ("checkpoint.max_chain_ratio=-2", "'checkpoint.max_chain_ratio' = -2.0 is not allowed"),
        ("checkpoint.max_chain_ratio=.nan", "'checkpoint.max_chain_ratio' = nan is not allowed"),
        ("checkpoint.max_chain_ratio=x", "'checkpoint.max_chain_ratio' must be a number"),
        ("checkpoint.bit_policy=failures", "needs exactly one of 'checkpoint.failures.rate_per_node_hour'"),
        ("checkpoint.failures={rate_per_node_hour: -0.5}", "'checkpoint.failures.rate_per_node_hour' = -0.5"),
        ("checkpoint.failures={tolerated_restores: {5: 1}}", "maps bit-widths 2, 3, 4 to restore counts"),
        ("checkpoint.failures={tolerated_restores: {2: x}}", "must be an integer"),
        ("checkpoint.failures={tolerated_restores: [1, 2]}", "'checkpoint.failures.tolerated_restores' must be a mapping"),
        ("checkpoint.failures={step_seconds: -1}", "'checkpoint.failures.step_seconds' = -1.0"),
    ],
)
def test_bad_values_rejected(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert message in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(str(top))


_TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")


@pytest.mark.parametrize("text,value", [("1e-3", 1e-3), ("1E+2", 100.0), (".5e1", 5.0), ("2", 2.0), ("+3.5", 3.5)])
def test_numbers_yaml_reads_as_strings_are_numbers(text, value):
    """Issue #13: YAML 1.1 reads 1e-3 (no dot) as a string; a float key takes it as a number."""
    assert load_config(_TINY, [f"train.sparse_lr={text}"]).train.sparse_lr == value


@pytest.mark.parametrize("text", ["1e-3x", "e5", "one", "1.2.3"])
def test_other_strings_are_still_not_numbers(text):
    with pytest.raises(ConfigError, match="'train.sparse_lr' must be a number"):
        load_config(_TINY, [f"train.sparse_lr={text}"])


def test_chain_cap_needs_a_policy_that_takes_new_baselines():
    with pytest.raises(ConfigError, match="'checkpoint.max_chain_ratio' = 1.5 needs checkpoint.policy 'intermittent' "
                                          "or 'consecutive', not 'one_shot'"):
        load_config(TINY, ["checkpoint.policy=one_shot", "checkpoint.max_chain_ratio=1.5"])
    assert load_config(TINY, ["checkpoint.policy=consecutive", "checkpoint.max_chain_ratio=1.5"]).checkpoint.max_chain_ratio == 1.5


def test_an_application_section_handed_to_the_checkpointer_is_refused_or_checked(tmp_path):
    # cnr train's sections hold the library's settings (checked by the library's path as they are
    # built) and carry settings the Checkpointer does not take (enabled, interval, storage): handed
    # straight to a Checkpointer they are refused, naming those settings; a subclass of the
    # library's options with no settings of its own, its checks switched off, is checked as the
    # library's type
    import dataclasses

    from cnr.api import Checkpointer
    from cnr.app.config import CheckpointConfig, PublishConfig
    from cnr.options import CheckpointOptions, OptionsError

    with pytest.raises(ConfigError, match="config key 'checkpoint.bits' = 5 is not allowed"):
        dataclasses.replace(CheckpointConfig(), bits=5)
    with pytest.raises(TypeError, match=r"got a CheckpointConfig with settings .*\(enabled, interval\)"):
        Checkpointer(str(tmp_path / "store"), {}, dataclasses.replace(CheckpointConfig(), bits=4))
    with pytest.raises(TypeError, match=r"got a PublishConfig with settings .*interval, storage"):
        Checkpointer(str(tmp_path / "store"), {}, None, publish=PublishConfig(enabled=True, storage="s3://b/p"))

    @dataclasses.dataclass(frozen=True)
    class Unchecked(CheckpointOptions):
        def __post_init__(self) -> None:
            """skips the library's checks"""

    with pytest.raises(OptionsError, match="bits = 5 is not allowed"):
        Checkpointer(str(tmp_path / "store"), {}, Unchecked(bits=5))
    assert not (tmp_path / "store").exists()


def test_newer_keys_are_recorded_only_when_set_away_from_their_default(tmp_path):
    # a checkpoint records the job's config: a job that leaves publish.serving_params alone writes
    # the manifests it wrote before the key existed
    tiny = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml")
    assert "serving_params" not in load_config(tiny, []).to_dict()["publish"]
    assert load_config(tiny, ["publish.serving_params=true"]).to_dict()["publish"].get("serving_params") is None
    off = load_config(tiny, ["publish.serving_params=false"])
    assert off.publish.serving_params is False and off.to_dict()["publish"]["serving_params"] is False
    assert off.publish.options("u").serving_params is False
