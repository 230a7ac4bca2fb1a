"""Validated configuration: YAML file + dotted ``--set`` overrides -> frozen dataclasses.

Every bad value is rejected with a ConfigError naming the key, the value and what is allowed,
before any process is spawned or anything is written.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from cnr.errors import ConfigError
from cnr.types import TableSpec

SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd", "adam")
DENSE_OPTIMIZERS = ("adagrad", "sgd", "adam")
ARCHES = ("dlrm", "dcn")
DATA_SOURCES = ("synthetic", "tsv")
MALFORMED_POLICIES = ("reject", "skip")
BIT_POLICIES = ("fixed", "failures")
OVERLAP_MODES = ("wait", "abandon")
SEARCH_KERNELS = ("auto", "eager", "compiled")  # cnr.types.SearchKernel
ON_DAMAGE = ("fallback", "fail")  # cnr.restore.newest
COMPRESSIONS = ("zstd", "none")  # bytes->bytes stage over chunk payloads (cnr.codec.zstd)
MAX_READER_PROCESSES = 64  # per trainer rank; each is a process with its own copy of the reader
MAX_QUEUE_DEPTH = 1024  # batches buffered per reader process
PUBLISH_BITS = (4, 8, 32)


@dataclass(frozen=True)
class TableConfig:
    """One embedding table. ``features`` are the sparse feature names it serves.

    ``sharding_types`` constrains the planner for this table (empty: ``model.sharding_types``).
    """

    name: str
    rows: int
    features: List[str]
    sharding_types: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class ModelConfig:
    """DLRM shape. ``dense_arch[-1]`` must equal ``embedding_dim`` (DLRM's interaction)."""

    arch: str = "dlrm"
    embedding_dim: int = 16
    tables: List[TableConfig] = field(default_factory=list)
    dense_arch: List[int] = field(default_factory=lambda: [32, 16])
    over_arch: List[int] = field(default_factory=lambda: [32, 1])
    dcn_num_layers: int = 2
    dcn_low_rank_dim: int = 8
    sharding_types: List[str] = field(default_factory=lambda: ["table_wise", "column_wise"])


@dataclass(frozen=True)
class DataConfig:
    """Where batches come from. ``power_law_exponent`` > 0: larger means more skewed ids.

    The reader tier (``cnr.readers.tier``): ``reader_processes`` per trainer rank (0: read in the
    trainer's own process), each buffering at most ``queue_depth`` batches; the trainer waits
    at most ``reader_timeout_s`` seconds for any reader message before it fails naming the
    reader. ``trace_dir``: if set, each rank
    records the sample ids it trains per step there (``cnr.app.trace``); "" = off.
    """

    source: str = "synthetic"
    num_dense: int = 13
    ids_per_feature: int = 1
    power_law_exponent: float = 1.1
    tsv_paths: List[str] = field(default_factory=list)
    eval_tsv_paths: List[str] = field(default_factory=list)
    on_malformed: str = "reject"
    eval_batches: int = 8
    reader_processes: int = 1
    queue_depth: int = 4
    reader_timeout_s: float = 60.0
    trace_dir: str = ""


@dataclass(frozen=True)
class TrainConfig:
    """The training loop. ``batch_size`` is per rank; ``eval_interval`` 0 = eval only at the end."""

    steps: int = 100
    batch_size: int = 128
    seed: int = 0
    sparse_optimizer: str = "rowwise_adagrad"
    sparse_lr: float = 0.05
    dense_optimizer: str = "adagrad"
    dense_lr: float = 0.05
    eval_interval: int = 0


def _default_tolerated() -> Dict[int, int]:
    # From `bench accuracy` (README): 2-bit stays within the seed noise (about 0.5% logloss) up
    # to 3 restores and leaves it by 20; 3- and 4-bit stay within it up to 20, the most measured.
    return {2: 3, 3: 20, 4: 20}


# From `bench accuracy` at 2 bits (README): log8 Adagrad sums are within the seed noise after 1
# and 3 restores (-0.45%/-0.30% logloss, against -0.39%/-0.32% with fp32 sums), and cost about
# 0.2 points at 10 and 20.
LOG8_TOLERATED_RESTORES = 3


@dataclass(frozen=True)
class FailureConfig:
    """Inputs of ``checkpoint.bit_policy: failures`` (Check-N-Run §5.2.1).

    The failure rate is ``rate_per_node_hour``, or derived from ``log``: a plain file of failure
    timestamps (unix seconds or ISO-8601, one per line) observed over ``log_nodes`` nodes.
    ``nodes``: nodes of this job (0: the world size). ``step_seconds``: expected seconds per
    step (0: measured over the first interval). ``tolerated_restores``: bit-width (2, 3, 4) ->
    the most restores from checkpoints at that width the accuracy budget allows.
    ``log8_tolerated_restores``: the most expected failures at which ``checkpoint.optimizer_bits``
    0 stores fused optimizer state in 8 bits (log8); beyond them it stays fp32.
    """

    rate_per_node_hour: float = 0.0
    log: str = ""
    log_nodes: int = 0
    nodes: int = 0
    step_seconds: float = 0.0
    tolerated_restores: Dict[int, int] = field(default_factory=_default_tolerated)
    log8_tolerated_restores: int = LOG8_TOLERATED_RESTORES


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing. ``interval`` is in steps; ``chunk_bytes`` bounds one stored chunk.

    ``policy``: "full" (every checkpoint full), "one_shot" (one full baseline, then
    incrementals of the rows touched since it), "consecutive" (incrementals of the rows touched
    since the previous checkpoint; restore replays the chain) or "intermittent" (one-shot, with
    a new baseline whenever the history predictor expects it to pay off; cnr.policy.kinds).
    ``on_overlap``: what a boundary does while the
    previous checkpoint is still being written: "wait" (the wait counts as stall) or "abandon"
    (the older one is cancelled). ``upload_threads``: concurrent puts of the rank's background
    writer process; ``encode_threads``: chunks it encodes at once (each on one core: raise it
    where the host has cores training leaves idle, cnr.write.encode_pool); ``search_kernel``: how the
    writer runs the adaptive quantizer's range search, "auto", "eager" or "compiled"
    (cnr.types.SearchKernel; compiled needs a C++ compiler on the host); ``restore_threads``:
    objects a rank fetches, verifies and decodes at once on restore.
    ``bits``: embedding rows are stored at 2, 3, 4 or 8 bits (row-wise quantized
    by the writer, cnr.codec.quant.quantize) or 32 (fp32, bit-exact); ``quant_method``: "adaptive", "naive",
    "symmetric" or "" for the bit-width's default (adaptive below 8 bits, naive at 8);
    ``optimizer_bits``: 32, or 8 to store fused optimizer state in 8 bits too: 2-D state row-wise
    quantized, 1-D non-negative state (the row-wise Adagrad sum) on a log grid (cnr.codec.log8);
    0 (with ``bit_policy: failures``) lets the failure budget choose 8 or 32 (cnr.policy.kinds).
    ``compression``: "zstd" (lossless, over quantized and log8 chunks' payloads, at
    ``compression_level`` 1..19) or "none". ``small_table_rows``/``small_table_bits``: tables of
    at most ``small_table_rows`` rows (0: none) store their rows at no fewer than
    ``small_table_bits`` (3, 4, 8 or 32) whatever ``bits`` is: small tables are the hot ones
    (every row is looked up often) and cost few bytes (cnr.write.plan.quantized_bits).
    ``table_bits``: table name -> the width (2, 3, 4, 8, 32) its rows are stored at instead of
    ``bits`` and the small-table rule, e.g. a plan from ``bench tables``; after the fallback
    to 8 bits no table goes below 8. ``table_plan_width``: the uniform width that plan stands
    in for (0: any): checkpoints at another width (a failure decision for more failures, or
    the fallback) store every table at that width instead.
    ``bit_policy``: "fixed" (``bits``) or "failures" (chosen from the expected failures,
    ``failures``). ``commit_timeout_s``: how long rank 0's
    writer waits for every rank's data before it marks the checkpoint failed. ``keep_last``:
    after a commit, keep the newest ``keep_last`` checkpoints of the job's history whose chains
    verify and every checkpoint their chains need, delete older ones of that history
    (cnr.policy.retention; 0: keep everything). ``merge_every``: with the
    consecutive policy, merge the chain into a new full baseline in the background once this
    many increments followed the newest one (cnr.write.merge; 0: never). ``max_chain_ratio``: with
    the intermittent or consecutive policy, a new baseline whenever the next checkpoint's chain
    (what its restore reads) is predicted to exceed this many times its baseline's bytes (0: no
    cap; else > 1; cnr.policy.kinds.predicted_chain_ratio). ``lease_ttl_s``: a job holds
    its storage location's lease (cnr.write.lease), renewed every quarter of this; another machine may
    take over a crashed job's location this long after its last renewal. ``on_damage``: a
    ``--resume`` whose newest committed checkpoint does not verify restores the newest one that
    does ("fallback", with a warning) or stops ("fail"). ``local_dir``: a node-local directory
    (cnr.storage.tiered; "" none): each rank stores its chunks there first, the checkpoint
    commits there once every rank's data is durable, and a background flush then copies it to
    the storage and commits it there; give each node its own (jobs on different locations may
    share it: each location has its own subdirectory, cnr.write.local_tier). ``local_keep_last``: committed
    checkpoints (with their chains) the local tier keeps (0: all; what the storage does not hold
    yet is never deleted from it).
    """

    enabled: bool = True
    interval: int = 50
    chunk_bytes: int = 16 * 1024 * 1024
    policy: str = "intermittent"
    on_overlap: str = "wait"
    upload_threads: int = 2
    encode_threads: int = 1
    search_kernel: str = "auto"
    restore_threads: int = 2
    commit_timeout_s: float = 600.0
    bits: int = 32
    quant_method: str = ""
    optimizer_bits: int = 32
    compression: str = "zstd"
    compression_level: int = 3
    small_table_rows: int = 0
    small_table_bits: int = 8
    table_bits: Dict[str, int] = field(default_factory=dict)
    table_plan_width: int = 0
    bit_policy: str = "fixed"
    failures: FailureConfig = field(default_factory=FailureConfig)
    keep_last: int = 2
    merge_every: int = 0
    max_chain_ratio: float = 0.0
    lease_ttl_s: float = 60.0
    on_damage: str = "fallback"
    local_dir: str = ""
    local_keep_last: int = 1


@dataclass(frozen=True)
class PublishConfig:
    """Online-training publishing to inference (cnr.publish.publisher), independent of checkpoints.

    Every ``interval`` steps the embedding rows modified since the previous publish go to
    ``storage`` as a consecutive increment with the next sequence number; every
    ``full_every``-th publish (and the first of every run) is a full base instead. Dense
    parameters ride along every ``dense_interval`` steps (a multiple of ``interval``) and in
    every base. ``bits``: 4, 8 or 32 (fp32, exact); ``quant_method`` as checkpoint.quant_method.
    ``storage``: a URI of its own ("" = ``<--storage>/publish``). ``keep_bases``: after each
    commit keep the newest N bases and every publish after the oldest of them (0: keep all).
    """

    enabled: bool = False
    storage: str = ""
    interval: int = 20
    full_every: int = 10
    dense_interval: int = 100
    bits: int = 8
    quant_method: str = ""
    keep_bases: int = 2


@dataclass(frozen=True)
class Config:
    """The whole job configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)

    def table_specs(self) -> Tuple[TableSpec, ...]:
        """The tables as shared TableSpec values, in config order."""
        return tuple(
            TableSpec(t.name, t.rows, self.model.embedding_dim, tuple(t.features))
            for t in self.model.tables
        )

    def feature_rows(self) -> List[Tuple[str, int]]:
        """(feature name, rows of its table) for every sparse feature, in config order."""
        return [(f, t.rows) for t in self.model.tables for f in t.features]

    def to_dict(self) -> Dict[str, Any]:
        """Plain nested dict (JSON/YAML-serialisable) of every value."""
        return dataclasses.asdict(self)


MAX_SHOWN = 200  # characters of a bad value quoted in an error message
MAX_TABLE_ROWS = 2**31 - 1  # fbgemm's row indexes
MAX_EMBEDDING_DIM = 65536
MAX_TABLE_BYTES = 1 << 40  # fp32 weights of one table (1 TiB), far beyond any one machine's memory
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def shown(value: Any) -> str:
    """``repr(value)``, cut to MAX_SHOWN characters: an error never quotes a huge value whole."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a config needs none, and nested aliases expand
    exponentially (a few hundred bytes can stand for gigabytes)."""

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise _AliasFound(f"*{event.anchor}", event.start_mark.line + 1)
        return super().compose_node(parent, index)


class _AliasFound(Exception):
    pass


def _load_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except _AliasFound as e:
        alias, line = e.args
        raise ConfigError(f"{where}: YAML aliases ({shown(alias)}, line {line}) are not allowed in a cnr config; "
                          "write the value out") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: a 5000-digit integer
        raise ConfigError(f"{where} is not valid YAML: {shown(str(e))}") from None


def load_config(path: Optional[str], overrides: Sequence[str] = ()) -> Config:
    """Read ``path`` (YAML; None = defaults), apply ``key=value`` overrides, validate."""
    raw: Dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "r", encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        loaded = _load_yaml(text, f"config file {path!r}")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping at the top level")
        raw = loaded or {}
    for item in overrides:
        _apply_override(raw, item)
    from cnr.app.config_checks import validate  # the checks import this module's types

    config = _build(Config, raw, "")
    validate(config)
    return config


def _apply_override(raw: Dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r} is not allowed: use dotted.key=value, e.g. train.steps=200")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if any(not p for p in parts):
        raise ConfigError(f"--set key {key!r} is not allowed: use dotted.key=value")
    node = raw
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set key {key!r}: {p!r} is not a section")
        node = child
    node[parts[-1]] = _load_yaml(text, f"--set {shown(key)} value") if text.strip() else ""


def _build(cls: type, raw: Any, where: str) -> Any:
    """Build dataclass ``cls`` from ``raw``, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config section {where or '<top>'!r} must be a mapping, got {shown(raw)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted((set(raw) - set(names)), key=str)
    if unknown:
        prefix = where + "." if where else ""
        raise ConfigError(
            f"unknown config key {shown(prefix + str(unknown[0]))}; allowed keys in "
            f"{where or 'the top level'}: {', '.join(names)}"
        )
    values = {}
    for name in names:
        if name in raw:
            values[name] = _coerce(hints[name], raw[name], f"{where}.{name}" if where else name)
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    origin = typing.get_origin(hint)
    if origin in (list, List):
        (item_hint,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list, got {shown(value)}")
        return [_coerce(item_hint, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict):
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping, got {shown(value)}")
        return {_coerce(key_hint, k, f"{key} key {k!r}"): _coerce(value_hint, v, f"{key}[{k!r}]") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be true or false, got {shown(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {key!r} must be an integer, got {shown(value)}")
        return value
    if hint is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key {key!r} must be a number, got {shown(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"config key {key!r} = {shown(value)} is not allowed; it must be a finite number")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r} must be a string, got {shown(value)}")
        return value
    raise ConfigError(f"config key {key!r} has an unsupported type {hint!r}")  # a bug in cnr
