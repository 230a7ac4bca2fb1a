"""The checks of a cnr configuration (cnr.app.config's dataclasses): every bad value raises a
ConfigError naming the key, the value and what is allowed, before any work starts.
``validate_checkpoint`` is shared with cnr.options.CheckpointOptions."""

from __future__ import annotations

import math
import os
from typing import Dict, Optional, Sequence, Tuple

from cnr.app.config import (
    ARCHES, BIT_POLICIES, COMPRESSIONS, DATA_SOURCES, DENSE_OPTIMIZERS, MALFORMED_POLICIES, MAX_EMBEDDING_DIM,
    MAX_QUEUE_DEPTH, MAX_READER_PROCESSES, MAX_TABLE_BYTES, MAX_TABLE_ROWS, ON_DAMAGE, OVERLAP_MODES, PUBLISH_BITS,
    SEARCH_KERNELS, SPARSE_OPTIMIZERS, CheckpointConfig, Config, FailureConfig, PublishConfig, TableConfig, shown,
)
from cnr.errors import ConfigError
from cnr.policy.kinds import CAPPED_POLICIES, POLICIES
from cnr.types import STORED_QUANT_METHODS, ShardingKind


MAX_LEARNING_RATE = 3.4028234663852886e38  # the largest fp32 number: fbgemm and torch's optimizers take lr as fp32
SPARSE_STATE_FLOATS = {"rowwise_adagrad": 1, "adagrad": -1, "sgd": 0, "adam": -2}  # per row; -k: k x embedding_dim


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, allowed: Sequence[str]) -> None:
    choices = ", ".join(a if a else "'' (the default)" for a in allowed)
    _require(value in allowed, f"config key {key!r} = {shown(value)} is not allowed; allowed: {choices}")


def _positive(key: str, value: float) -> None:
    _require(value > 0, f"config key {key!r} = {value!r} is not allowed; it must be > 0")


def validate(config: Config) -> None:
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
    validate_checkpoint(c)
    names = [t.name for t in m.tables]
    unknown = sorted(set(c.table_bits) - set(names))
    _require(not unknown, f"config key 'checkpoint.table_bits' names {shown(unknown[0]) if unknown else ''}, which is "
             f"not a table of model.tables; tables: {shown(', '.join(names))}")
    _validate_publish(config.publish)


def validate_checkpoint(c: CheckpointConfig) -> None:
    """The checkpoint section's checks (cnr.options.CheckpointOptions shares them)."""
    _one_of("checkpoint.policy", c.policy, POLICIES)
    _one_of("checkpoint.on_overlap", c.on_overlap, OVERLAP_MODES)
    _one_of("checkpoint.search_kernel", c.search_kernel, SEARCH_KERNELS)
    _positive("checkpoint.upload_threads", c.upload_threads)
    _positive("checkpoint.encode_threads", c.encode_threads)
    _positive("checkpoint.restore_threads", c.restore_threads)
    _positive("checkpoint.commit_timeout_s", c.commit_timeout_s)
    _require(c.bits in (2, 3, 4, 8, 32), f"config key 'checkpoint.bits' = {c.bits} is not allowed; allowed: 2, 3, 4, 8, 32")
    _one_of("checkpoint.quant_method", c.quant_method, ("",) + STORED_QUANT_METHODS)
    _require(c.optimizer_bits in (0, 8, 32), f"config key 'checkpoint.optimizer_bits' = {c.optimizer_bits} is not "
             "allowed; allowed: 8, 32, or 0 (chosen from the failure budget, with bit_policy 'failures')")
    _require(c.optimizer_bits != 0 or c.bit_policy == "failures", "config key 'checkpoint.optimizer_bits' = 0 "
             f"(chosen from the failure budget) needs checkpoint.bit_policy 'failures', not {c.bit_policy!r}")
    _one_of("checkpoint.compression", c.compression, COMPRESSIONS)
    _require(c.compression_level in range(1, 20), f"config key 'checkpoint.compression_level' = "
             f"{c.compression_level} is not allowed; allowed: 1..19")
    _require(c.small_table_rows >= 0, f"config key 'checkpoint.small_table_rows' = {c.small_table_rows} is not "
             "allowed; it must be >= 0 (0: no table is small)")
    _require(c.small_table_bits in (3, 4, 8, 32), f"config key 'checkpoint.small_table_bits' = "
             f"{c.small_table_bits} is not allowed; allowed: 3, 4, 8, 32")
    _require(isinstance(c.table_bits, dict) and all(isinstance(k, str) and k and v in (2, 3, 4, 8, 32)
                                                    and not isinstance(v, bool) for k, v in c.table_bits.items()),
             f"config key 'checkpoint.table_bits' = {shown(c.table_bits)} is not allowed; it maps table names to "
             "bit-widths 2, 3, 4, 8 or 32, e.g. {t_0: 4, t_1: 2}")
    _require(c.table_plan_width in (0, 2, 3, 4, 8), f"config key 'checkpoint.table_plan_width' = "
             f"{c.table_plan_width} is not allowed; allowed: 0 (the plan applies at any width), 2, 3, 4, 8")
    _one_of("checkpoint.bit_policy", c.bit_policy, BIT_POLICIES)
    _require(c.keep_last >= 0, f"config key 'checkpoint.keep_last' = {c.keep_last} is not allowed; it must be >= 0 (0 keeps everything)")
    _require(c.merge_every >= 0, f"config key 'checkpoint.merge_every' = {c.merge_every} is not allowed; it must be >= 0 (0 never merges)")
    _require(c.merge_every == 0 or c.policy == "consecutive",
             f"config key 'checkpoint.merge_every' = {c.merge_every} needs checkpoint.policy 'consecutive', not "
             f"{c.policy!r}: only consecutive increments form chains to merge")
    _require(c.max_chain_ratio == 0 or c.max_chain_ratio > 1, f"config key 'checkpoint.max_chain_ratio' = "
             f"{c.max_chain_ratio} is not allowed; it must be 0 (no cap) or > 1 (a chain reads its baseline at least)")
    _require(c.max_chain_ratio == 0 or c.policy in CAPPED_POLICIES,
             f"config key 'checkpoint.max_chain_ratio' = {c.max_chain_ratio} needs checkpoint.policy "
             f"{' or '.join(repr(p) for p in CAPPED_POLICIES)}, not {c.policy!r}: the others never choose a new baseline")
    _validate_failures(c.failures, c.bit_policy)
    _require(c.chunk_bytes >= 4096, f"config key 'checkpoint.chunk_bytes' = {c.chunk_bytes} is not allowed; it must be >= 4096")
    _one_of("checkpoint.on_damage", c.on_damage, ON_DAMAGE)
    _require(isinstance(c.local_dir, str) and "://" not in c.local_dir, f"config key 'checkpoint.local_dir' = "
             f"{shown(c.local_dir)} is not allowed; give a node-local directory path, or '' for none")
    _require(c.local_keep_last >= 0, f"config key 'checkpoint.local_keep_last' = {c.local_keep_last} is not "
             "allowed; it must be >= 0 (0 keeps everything)")
    _require(1.0 <= c.lease_ttl_s <= 86400.0, f"config key 'checkpoint.lease_ttl_s' = {c.lease_ttl_s} is not allowed; "
             "it must be from 1 to 86400 seconds")


def _validate_publish(p: PublishConfig) -> None:
    _positive("publish.interval", p.interval)
    _positive("publish.full_every", p.full_every)
    _require(p.dense_interval > 0 and p.dense_interval % p.interval == 0,
             f"config key 'publish.dense_interval' = {p.dense_interval} is not allowed; it must be a positive "
             f"multiple of publish.interval = {p.interval}")
    _require(p.bits in PUBLISH_BITS, f"config key 'publish.bits' = {p.bits} is not allowed; allowed: "
             + ", ".join(str(b) for b in PUBLISH_BITS))
    _one_of("publish.quant_method", p.quant_method, ("",) + STORED_QUANT_METHODS)
    _require(p.keep_bases >= 0, f"config key 'publish.keep_bases' = {p.keep_bases} is not allowed; "
             "it must be >= 0 (0 keeps everything)")


def _validate_failures(f: FailureConfig, bit_policy: str) -> None:
    k = "checkpoint.failures"
    _require(math.isfinite(f.rate_per_node_hour) and f.rate_per_node_hour >= 0,
             f"config key '{k}.rate_per_node_hour' = {f.rate_per_node_hour!r} is not allowed; it must be >= 0")
    for name in ("log_nodes", "nodes"):
        _require(getattr(f, name) >= 0, f"config key '{k}.{name}' = {getattr(f, name)} is not allowed; it must be >= 0")
    _require(math.isfinite(f.step_seconds) and f.step_seconds >= 0,
             f"config key '{k}.step_seconds' = {f.step_seconds!r} is not allowed; it must be >= 0 (0: measured)")
    _require(bool(f.tolerated_restores) and all(b in (2, 3, 4) and n >= 0 for b, n in f.tolerated_restores.items()),
             f"config key '{k}.tolerated_restores' = {f.tolerated_restores!r} is not allowed; it maps bit-widths "
             "2, 3, 4 to restore counts >= 0, e.g. {2: 1, 3: 3, 4: 20}")
    _require(f.log8_tolerated_restores >= 0, f"config key '{k}.log8_tolerated_restores' = "
             f"{f.log8_tolerated_restores} is not allowed; it must be >= 0")
    if bit_policy == "failures":
        _require((f.rate_per_node_hour > 0) != bool(f.log),
                 f"checkpoint.bit_policy 'failures' needs exactly one of '{k}.rate_per_node_hour' (> 0) or "
                 f"'{k}.log', got rate {f.rate_per_node_hour!r} and log {f.log!r}")
        _require(not f.log or f.log_nodes >= 1, f"config key '{k}.log_nodes' = {f.log_nodes} is not allowed with a "
                 "failure log; it must be the number of nodes (>= 1) the log covers")


def _validate_tables(tables: Sequence[TableConfig], allowed_sharding: Sequence[str]) -> None:
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


def _host_bytes_per_row(config: Config, on_cpu: bool) -> int:
    """Host bytes one embedding row needs at least: on CPU its fp32 weights and sparse optimizer
    state live there; with checkpoints on, a full snapshot copies both, and the row's id, into
    host buffers (cnr.track.snapshot.HostBuffers) on every device."""
    dim = config.model.embedding_dim
    state = SPARSE_STATE_FLOATS.get(config.train.sparse_optimizer, 0)
    row = 4 * dim + 4 * (state if state >= 0 else -state * dim)
    copies = int(on_cpu) + int(config.checkpoint.enabled)
    return copies * row + (8 if config.checkpoint.enabled else 0)


def check_host_memory(config: Config, on_cpu: bool, node_share: float = 1.0,
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
