"""The checks of a cnr configuration (cnr.app.config's dataclasses): every bad value raises a
ConfigError naming the key, the value and what is allowed, before any work starts. The
``checkpoint`` and ``publish`` sections hold the library's settings, which those sections check
themselves on construction by the library's own path (cnr.options.check_checkpoint_settings,
check_publish_settings) under their config keys; what needs the whole config is checked here.

Below cnr.app.config (which imports it): its types are only named here, never imported.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

from cnr.errors import ConfigError
from cnr.options import Naming, shown
from cnr.types import ShardingKind

if TYPE_CHECKING:
    import torch

# cnr.app.config's dataclasses, named in annotations only: that module imports this one, so
# these are read duck-typed (the attributes each check names), never imported.
Config = Any
TableConfig = Any

SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd", "adam")
DENSE_OPTIMIZERS = ("adagrad", "sgd", "adam")
# fbgemm's fused CPU kernels implement only these (measured: adam asserts "not supported in CPU mode").
CPU_SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")
ARCHES = ("dlrm", "dcn")
DATA_SOURCES = ("synthetic", "tsv")
MALFORMED_POLICIES = ("reject", "skip")
MAX_READER_PROCESSES = 64  # per trainer rank; each is a process with its own copy of the reader
MAX_QUEUE_DEPTH = 1024  # batches buffered per reader process
MAX_TABLE_ROWS = 2**31 - 1  # fbgemm's row indexes
MAX_EMBEDDING_DIM = 65536
MAX_TABLE_BYTES = 1 << 40  # fp32 weights of one table (1 TiB), far beyond any one machine's memory
MAX_LEARNING_RATE = 3.4028234663852886e38  # the largest fp32 number: fbgemm and torch's optimizers take lr as fp32
SPARSE_STATE_FLOATS = {"rowwise_adagrad": 1, "adagrad": -1, "sgd": 0, "adam": -2}  # per row; -k: k x embedding_dim

KEYS = Naming("", config_keys=True, error=ConfigError)  # top-level keys: config key 'model.arch'
_require, _one_of, _positive = KEYS.require, KEYS.one_of, KEYS.positive


def validate(config: "Config") -> None:
    """Cross-field checks; raises ConfigError naming the offending key and value."""
    m, d, t, c = config.model, config.data, config.train, config.checkpoint
    _one_of("model.arch", m.arch, ARCHES)
    _positive("model.embedding_dim", m.embedding_dim)
    _require(m.embedding_dim <= MAX_EMBEDDING_DIM, f"config key 'model.embedding_dim' = {m.embedding_dim} is not "
             f"allowed; it must be at most {MAX_EMBEDDING_DIM}")
    for i, table in enumerate(m.tables):
        _require(table.rows * m.embedding_dim * 4 <= MAX_TABLE_BYTES,
                 f"table {table.name!r} (model.tables[{i}]) of {table.rows} rows x {m.embedding_dim} would need "
                 f"{table.rows * m.embedding_dim * 4 / 2**40:.1f} TiB of fp32 weights; at most 1 TiB per table is allowed")
    _require(bool(m.tables), "config key 'model.tables' is empty; at least one table is required")
    _validate_tables(m.tables, allowed_sharding=[k.value for k in ShardingKind])
    for key, sizes in (("model.dense_arch", m.dense_arch), ("model.over_arch", m.over_arch)):
        _require(bool(sizes) and all(s > 0 for s in sizes), f"config key {key!r} = {sizes!r} must be a non-empty list of positive sizes")
    _require(m.dense_arch[-1] == m.embedding_dim,
             f"config key 'model.dense_arch' ends with {m.dense_arch[-1]}, but DLRM needs it to equal model.embedding_dim = {m.embedding_dim}")
    _require(m.over_arch[-1] == 1, f"config key 'model.over_arch' ends with {m.over_arch[-1]}; it must end with 1 (one logit)")
    _positive("model.dcn_num_layers", m.dcn_num_layers)
    _positive("model.dcn_low_rank_dim", m.dcn_low_rank_dim)
    allowed_sharding = [k.value for k in ShardingKind]
    _require(bool(m.sharding_types), "config key 'model.sharding_types' is empty; allowed: " + ", ".join(allowed_sharding))
    for s in m.sharding_types:
        _one_of("model.sharding_types", s, allowed_sharding)
    _one_of("data.source", d.source, DATA_SOURCES)
    _positive("data.num_dense", d.num_dense)
    _positive("data.ids_per_feature", d.ids_per_feature)
    _positive("data.power_law_exponent", d.power_law_exponent)
    _positive("data.eval_batches", d.eval_batches)
    _one_of("data.on_malformed", d.on_malformed, MALFORMED_POLICIES)
    if d.source == "tsv":
        _require(bool(d.tsv_paths), "config key 'data.tsv_paths' is empty; data.source = 'tsv' needs at least one file")
    _require(0 <= d.reader_processes <= MAX_READER_PROCESSES,
             f"config key 'data.reader_processes' = {d.reader_processes} is not allowed; it must be in "
             f"[0, {MAX_READER_PROCESSES}] (0 reads in the trainer's process)")
    _require(1 <= d.queue_depth <= MAX_QUEUE_DEPTH,
             f"config key 'data.queue_depth' = {d.queue_depth} is not allowed; it must be in [1, {MAX_QUEUE_DEPTH}]")
    _require(math.isfinite(d.reader_timeout_s) and d.reader_timeout_s > 0,
             f"config key 'data.reader_timeout_s' = {d.reader_timeout_s} is not allowed; it must be a finite number > 0")
    _positive("train.steps", t.steps)
    _positive("train.batch_size", t.batch_size)
    _require(t.seed >= 0, f"config key 'train.seed' = {t.seed} is not allowed; it must be >= 0")
    _one_of("train.sparse_optimizer", t.sparse_optimizer, SPARSE_OPTIMIZERS)
    _one_of("train.dense_optimizer", t.dense_optimizer, DENSE_OPTIMIZERS)
    for key, lr in (("train.sparse_lr", t.sparse_lr), ("train.dense_lr", t.dense_lr)):
        _require(0 < lr <= MAX_LEARNING_RATE, f"config key {key!r} = {lr!r} is not allowed; it must be in "
                 f"(0, {MAX_LEARNING_RATE:.7g}] (the optimizers compute in fp32: a larger rate overflows it)")
    _require(t.eval_interval >= 0, f"config key 'train.eval_interval' = {t.eval_interval} is not allowed; it must be >= 0")
    _positive("checkpoint.interval", c.interval)
    names = [t.name for t in m.tables]
    unknown = sorted(set(c.table_bits) - set(names))
    _require(not unknown, f"config key 'checkpoint.table_bits' names {shown(unknown[0]) if unknown else ''}, which is "
             f"not a table of model.tables; tables: {shown(', '.join(names))}")


def check_device_support(config: "Config", device: "torch.device") -> None:
    """Reject combinations fbgemm cannot run on ``device``, before any work starts."""
    if device.type == "cpu" and config.train.sparse_optimizer not in CPU_SPARSE_OPTIMIZERS:
        raise ConfigError(
            f"train.sparse_optimizer = {config.train.sparse_optimizer!r} is not supported by fbgemm's fused "
            f"kernels on CPU; allowed on CPU: {', '.join(CPU_SPARSE_OPTIMIZERS)} (adam needs CUDA)"
        )


def _validate_tables(tables: Sequence["TableConfig"], allowed_sharding: Sequence[str]) -> None:
    seen_tables: set = set()
    seen_features: Dict[str, str] = {}
    for i, table in enumerate(tables):
        key = f"model.tables[{i}]"
        _require(bool(table.name) and table.name.replace("_", "").isalnum(),
                 f"config key '{key}.name' = {table.name!r} is not allowed; use letters, digits and '_'")
        _require(table.name not in seen_tables, f"config key '{key}.name' = {table.name!r} is used by two tables")
        seen_tables.add(table.name)
        _positive(f"{key}.rows", table.rows)
        _require(table.rows <= MAX_TABLE_ROWS,
                 f"config key '{key}.rows' = {table.rows} is not allowed; it must be at most {MAX_TABLE_ROWS}")
        for s in table.sharding_types:
            _one_of(f"{key}.sharding_types", s, allowed_sharding)
        _require(bool(table.features), f"table {table.name!r} ({key}.features) has no features; every table needs at least one")
        for feature in table.features:
            _require(bool(feature) and feature.replace("_", "").isalnum(),
                     f"feature {shown(feature)} of table {table.name!r} is not allowed; use letters, digits and '_'")
            _require(feature not in seen_features,
                     f"feature {feature!r} of table {table.name!r} is already served by table {seen_features.get(feature)!r}")
            seen_features[feature] = table.name


# ---- what the machine can hold (cnr.app.job.prepare_job, before any rank starts) -----------------

def host_memory_bytes() -> Tuple[int, str]:
    """The memory this machine lets the job use: physical memory, or a smaller cgroup limit; and
    where that figure comes from."""
    best = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = int(f.read().strip())
        except (OSError, ValueError):  # absent, or "max": no limit there
            continue
        if 0 < limit < best[0]:
            best = (limit, f"the cgroup limit in {path}")
    return best


def _host_bytes_per_row(config: "Config", on_cpu: bool) -> int:
    """Host bytes one embedding row needs at least: on CPU its fp32 weights and sparse optimizer
    state live there; with checkpoints on, a full snapshot copies both, and the row's id, into
    host buffers (cnr.track.snapshot.HostBuffers) on every device."""
    dim = config.model.embedding_dim
    state = SPARSE_STATE_FLOATS.get(config.train.sparse_optimizer, 0)
    row = 4 * dim + 4 * (state if state >= 0 else -state * dim)
    copies = int(on_cpu) + int(config.checkpoint.enabled)
    return copies * row + (8 if config.checkpoint.enabled else 0)


def check_host_memory(config: "Config", on_cpu: bool, node_share: float = 1.0,
                      memory: Optional[Tuple[int, str]] = None) -> None:
    """Refuse tables whose rows cannot fit in this machine's memory (``host_memory_bytes``),
    naming the largest table, its rows and the most it may have. ``node_share``: the part of
    every table this machine holds (1 for ``--nproc`` ranks on it; its ranks' share of the world
    under torchrun)."""
    per_row = _host_bytes_per_row(config, on_cpu)
    if per_row == 0:
        return
    limit, source = memory or host_memory_bytes()
    need = sum(t.rows for t in config.model.tables) * per_row * node_share
    if need <= limit:
        return
    i, table = max(enumerate(config.model.tables), key=lambda it: it[1].rows)
    others = (sum(t.rows for t in config.model.tables) - table.rows) * per_row * node_share
    most = int((limit - others) // (per_row * node_share))
    held = (["weights and optimizer state"] if on_cpu else []) + \
        (["a full snapshot's host buffers"] if config.checkpoint.enabled else [])
    allowed = (f"allowed: model.tables[{i}].rows in [1, {most}] with the other tables as they are" if most >= 1 else
               "the other tables alone need more: make them smaller, or spread the job over more machines (torchrun)")
    raise ConfigError(
        f"config key 'model.tables[{i}].rows' = {table.rows} is not allowed on this machine: the tables need at least "
        f"{need / 2**30:.1f} GiB of host memory ({per_row} bytes per row at embedding_dim "
        f"{config.model.embedding_dim} with {config.train.sparse_optimizer}: {' and '.join(held)}), more than its "
        f"{limit / 2**30:.1f} GiB ({source}); {allowed}"
    )
