"""Validated configuration: YAML file + dotted ``--set`` overrides -> frozen dataclasses.

Every bad value is rejected with a ConfigError naming the key, the value and what is allowed,
before any process is spawned or anything is written (cnr.app.config_checks). The ``checkpoint``
and ``publish`` sections are the library's CheckpointOptions and PublishOptions (cnr.options:
their fields, defaults, meaning and rules) plus what only ``cnr train`` has, checked on
construction by the library's own path under their config keys.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import yaml

from cnr.app.config_checks import validate
from cnr.errors import ConfigError
from cnr.options import (CheckpointOptions, FailureBudget, Naming, PublishOptions, check_checkpoint_settings,
                         check_publish_settings, flat_settings, shown)
from cnr.types import TableSpec

FailureConfig = FailureBudget  # checkpoint.failures: the library's failure budget (cnr.options.FailureBudget)


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


def _checkpoint_post_init(self: Any) -> None:
    check_checkpoint_settings(self, CHECKPOINT_KEYS, skip=("expected_steps",))


def _checkpoint_options(self: Any, expected_steps: int) -> CheckpointOptions:
    """The library's options this section holds, for a job of ``expected_steps`` steps."""
    return CheckpointOptions.from_config(self, expected_steps)


CHECKPOINT_KEYS = Naming("checkpoint.", config_keys=True, error=ConfigError)
PUBLISH_KEYS = Naming("publish.", config_keys=True, error=ConfigError)

# Flat, as its YAML keys are, with the library's own fields (cnr.options.flat_settings) so that the
# two cannot drift apart; its values stay as the file spelt them (what a manifest records).
CheckpointConfig = dataclasses.make_dataclass(
    "CheckpointConfig", [*flat_settings(), ("enabled", bool, True), ("interval", int, 50)], frozen=True,
    namespace={
        "__module__": __name__, "NOT_KEYS": ("expected_steps",), "RECORDED_IF_SET": ("tracker",),
        "__post_init__": _checkpoint_post_init,
        "options": _checkpoint_options,
        "__doc__": """The ``checkpoint`` section: every setting of cnr.options.CheckpointOptions, flat,
    under its own name (meaning, default and rules are written there; ``checkpoint.failures`` is its
    FailureBudget), but ``expected_steps``, which is ``train.steps``; plus what only ``cnr train``
    has: ``enabled`` (false: no checkpoint is written) and ``interval``, the steps between
    checkpoints. Keys in RECORDED_IF_SET (settings added after stores were written) are recorded
    only when they differ from their default, so a job at the defaults stores the same bytes as before.
    Checked on construction by the library's own path
    (cnr.options.check_checkpoint_settings), naming config keys; the table names of ``table_bits``
    with the whole config (cnr.app.config_checks.validate).
    """})


@dataclass(frozen=True)
class PublishConfig(PublishOptions):
    """The ``publish`` section (online training, cnr.publish.publisher; independent of checkpoints):
    the fields of cnr.options.PublishOptions but ``uri``, plus ``enabled``, ``storage`` (the
    publish store, a URI of its own; "" = ``<--storage>/publish``, cnr.publish.location) and
    ``interval``: every ``interval`` steps the rows modified since the previous publish go out
    (``dense_interval`` must be a multiple of it). Checked on construction, naming config keys.
    """

    NOT_KEYS: ClassVar[Tuple[str, ...]] = ("uri",)
    # keys newer than the configs checkpoints record: recorded only when set away from their
    # default, so a job that leaves them alone writes the manifests it wrote before they existed
    RECORDED_IF_SET: ClassVar[Tuple[str, ...]] = ("serving_params", "max_rows", "max_bytes", "max_delay")

    enabled: bool = False
    storage: str = ""
    interval: int = 20

    def __post_init__(self) -> None:
        """Checked by the library's own path (cnr.options.check_publish_settings), naming config keys."""
        check_publish_settings(self, PUBLISH_KEYS, interval=self.interval)

    def options(self, uri: str) -> PublishOptions:
        """The library's options this section holds, publishing to ``uri``."""
        return PublishOptions.from_config(self, uri)


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
        """Plain nested dict (JSON/YAML-serialisable) of every value, keyed as the YAML is (a section's
        RECORDED_IF_SET keys only where not at their default)."""
        return _keys_only(self)


def config_keys(cls: type) -> List[str]:
    """The keys a section of dataclass ``cls`` takes: its fields, but those it marks NOT_KEYS."""
    return [f.name for f in dataclasses.fields(cls) if f.name not in getattr(cls, "NOT_KEYS", ())]


def _default_of(cls: type, name: str) -> Any:
    """Dataclass ``cls``'s default of field ``name`` (a plain default: RECORDED_IF_SET fields have one)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _keys_only(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        quiet = getattr(type(value), "RECORDED_IF_SET", ())
        return {k: _keys_only(getattr(value, k)) for k in config_keys(type(value))
                if k not in quiet or getattr(value, k) != _default_of(type(value), k)}
    if isinstance(value, (list, tuple)):
        return [_keys_only(v) for v in value]
    if isinstance(value, dict):
        return {k: _keys_only(v) for k, v in value.items()}
    return value


_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


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
    names = config_keys(cls)
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
    if origin is typing.Union and type(None) in typing.get_args(hint):  # Optional[X]: null, or an X
        if value is None:
            return None
        (inner,) = [h for h in typing.get_args(hint) if h is not type(None)]
        return _coerce(inner, value, key)
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
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # a choice: kept as spelt, checked by its section
        if not isinstance(value, str):
            raise ConfigError(f"config key {key!r} must be a string, got {shown(value)}")
        return value
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
