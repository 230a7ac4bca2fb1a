"""CheckpointOptions (every knob of a checkpoint engine, in groups) and PublishOptions, each checked
on construction by one path: every field's type (cnr.options.fields), then the rules across fields
(cnr.options.checks); an error names the setting as ``CheckpointOptions.<name>``. An application
reading the same settings from its own configuration checks them by the same path, naming its own
keys (``check_checkpoint_settings``, ``check_publish_settings``).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from cnr.options.checks import DEFAULT_COMPACT_RATIO, check_checkpoint, check_publish
from cnr.options.fields import check_record, hints_of
from cnr.options.groups import (FIELD_GROUP, FIELD_ORDER, GROUP_ATTR, GROUPS, EncodingOptions, LeaseOptions,
                                RetentionOptions, ScheduleOptions, TierOptions, WriterOptions)
from cnr.options.naming import CHECKPOINT_OPTIONS, PUBLISH_OPTIONS, Naming, shown
from cnr.types import BitPolicy, CodecSpec, Compression, Policy, QuantMethod, SearchKernel


@dataclass(frozen=True, init=False)
class CheckpointOptions:
    """How checkpoints are taken, stored and kept, as six groups (cnr.options.groups, where every
    setting's default and meaning is written): ``schedule`` (ScheduleOptions: policy, bit_policy,
    failures, expected_steps, max_chain_ratio, tracker), ``encoding`` (EncodingOptions: bits,
    quant_method, optimizer_bits, compression, compression_level, small_table_rows,
    small_table_bits, table_bits, table_plan_width, chunk_bytes, search_kernel), ``writer``
    (WriterOptions: upload_threads, encode_threads, restore_threads, on_overlap,
    commit_timeout_s, on_damage), ``tier`` (TierOptions: local_dir, local_keep_last),
    ``retention`` (RetentionOptions: keep_last, merge_every, compact_at_chain_ratio, compaction)
    and ``lease`` (LeaseOptions: lease_ttl_s).

    Keywords only. Each setting is taken flat too, ``CheckpointOptions(policy="intermittent",
    bits=4)``, and read flat, ``options.bits`` (the same as ``options.encoding.bits``); a flat
    setting given with its group, ``CheckpointOptions(encoding=EncodingOptions(bits=8), bits=4)``,
    overrides the group's value. A choice (policy, compression, on_damage, ...) takes its cnr.types
    enum member or its string, and holds the member (a ``str`` equal to the string). A misspelt
    keyword, or one given to the wrong group, is refused naming it and the allowed ones.
    """

    SETTINGS: ClassVar[Tuple[str, ...]] = FIELD_ORDER

    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    encoding: EncodingOptions = field(default_factory=EncodingOptions)
    writer: WriterOptions = field(default_factory=WriterOptions)
    tier: TierOptions = field(default_factory=TierOptions)
    retention: RetentionOptions = field(default_factory=RetentionOptions)
    lease: LeaseOptions = field(default_factory=LeaseOptions)

    def __init__(self, *, schedule: Optional[ScheduleOptions] = None, encoding: Optional[EncodingOptions] = None,
                 writer: Optional[WriterOptions] = None, tier: Optional[TierOptions] = None,
                 retention: Optional[RetentionOptions] = None, lease: Optional[LeaseOptions] = None,
                 **settings: Any) -> None:
        names = CHECKPOINT_OPTIONS
        unknown = sorted((k for k in settings if k not in FIELD_GROUP), key=str)
        names.require(not unknown, f"unknown setting {names.ref(str(unknown[0])) if unknown else ''!r}; allowed: "
                      f"{', '.join(FIELD_ORDER)}, or the groups {', '.join(GROUPS)}")
        given = {"schedule": schedule, "encoding": encoding, "writer": writer, "tier": tier, "retention": retention,
                 "lease": lease}
        for attr, cls in GROUPS.items():
            group = given[attr]
            names.require(group is None or isinstance(group, cls), f"{names.subject(attr)} = {shown(group):.80} is "
                          f"not allowed; give a cnr.options.{cls.__name__}")
            flat = {k: v for k, v in settings.items() if GROUP_ATTR[FIELD_GROUP[k]] == attr}
            if group is None:
                group = cls(**flat)
            elif flat:
                group = dataclasses.replace(group, **flat)
            object.__setattr__(self, attr, group)
        self.__post_init__()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # a dataclass subclass keeps these keywords: the decorator writes no __init__ over one the
        # class holds itself
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:
            cls.__init__ = CheckpointOptions.__init__  # type: ignore[misc]

    def __post_init__(self) -> None:
        names = CHECKPOINT_OPTIONS
        names.require(self.bit_policy != BitPolicy.FAILURES or self.expected_steps >= 1,
                      f"{names.subject('expected_steps')} = {self.expected_steps} is not allowed with bit_policy "
                      "'failures'; it must be the job's length in steps (>= 1)")
        check_checkpoint(self, names)

    @classmethod
    def from_config(cls, section: Any, expected_steps: int = 0) -> "CheckpointOptions":
        """The options a configuration's section holds (any object with these settings, e.g. cnr
        train's checkpoint section), for a job of ``expected_steps`` steps."""
        values = {name: getattr(section, name) for name in FIELD_ORDER if name != "expected_steps"}
        return cls(**values, expected_steps=expected_steps)

    def compaction_ratio(self) -> float:
        """The bytes trigger in force: ``compact_at_chain_ratio`` when set, else DEFAULT_COMPACT_RATIO
        with the consecutive policy and 0 (none) with the others."""
        if self.compact_at_chain_ratio is not None:
            return float(self.compact_at_chain_ratio)
        return DEFAULT_COMPACT_RATIO if self.policy == Policy.CONSECUTIVE else 0.0

    def compression_chain(self) -> Tuple[CodecSpec, ...]:
        """The bytes->bytes stage (at most one) of quantized and log8 chunks' payloads (cnr.codec)."""
        from cnr.codec.zstd import zstd_spec  # zstandard loads only in processes that encode

        return (zstd_spec(self.compression_level),) if self.compression == Compression.ZSTD else ()

    def to_dict(self) -> Dict[str, Any]:
        """Every setting flat, in FIELD_ORDER, choices as their strings and ``failures`` as a dict."""
        return {name: _plain(getattr(self, name)) for name in FIELD_ORDER}

    def may_search(self) -> bool:
        """Whether some checkpoint may store rows with the adaptive range search: the failure
        budget choosing widths, or a width below 32 whose method (cnr.codec.quant.quantize.stored_method)
        is adaptive."""
        from cnr.codec.quant.quantize import stored_method

        widths = [w for w in (self.bits, *self.table_bits.values()) if w < 32]
        return self.bit_policy == BitPolicy.FAILURES or any(
            stored_method(w, self.bits, self.quant_method) == "adaptive" for w in widths)

    def for_writer(self, rows_per_rank: int) -> "CheckpointOptions":
        """These options with ``search_kernel`` "auto" made definite for a writer about to start
        (cnr.codec.quant.range_search.writer_kernel): "compiled", built as the writer starts, when checkpoints
        may search at least AUTO_COMPILE_ROWS of this rank's table rows, else "eager"."""
        from cnr.codec.quant.range_search import writer_kernel

        kernel = writer_kernel(SearchKernel(self.search_kernel), rows_per_rank, self.may_search())
        return dataclasses.replace(self, search_kernel=kernel)


def _flat_reader(name: str) -> property:
    attr = GROUP_ATTR[FIELD_GROUP[name]]
    return property(lambda self: getattr(getattr(self, attr), name),
                    doc=f"``{attr}.{name}`` (cnr.options.groups.{FIELD_GROUP[name].__name__}).")


for _name in FIELD_ORDER:  # options.bits reads options.encoding.bits
    setattr(CheckpointOptions, _name, _flat_reader(_name))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def flat_settings() -> List[Tuple[str, Any, Any]]:
    """``(name, type, dataclasses.field)`` of every CheckpointOptions setting in FIELD_ORDER, with
    its group's default (a choice's as its string): the fields of a flat record holding them all,
    e.g. an application's config section (cnr train's ``checkpoint``)."""
    out = []
    for name in FIELD_ORDER:
        group = FIELD_GROUP[name]
        f = next(f for f in dataclasses.fields(group) if f.name == name)
        made = (field(default=_plain(f.default)) if f.default is not dataclasses.MISSING
                else field(default_factory=f.default_factory))
        out.append((name, hints_of(group)[name], made))
    return out


def as_library_options(value: Any, cls: type, name: str) -> Any:
    """``value`` as exactly ``cls`` (CheckpointOptions or PublishOptions), checked on construction.
    An object with settings of its own (an application's config section: ``enabled``,
    ``interval``, ...) is refused: the Checkpointer would ignore them without a word. A subclass of
    ``cls``, or a dataclass holding only ``cls``'s settings, is rebuilt as ``cls``. ``name``: the
    argument, for the TypeError's message."""
    if type(value) is cls:
        return value
    takes = {f.name for f in dataclasses.fields(cls)} | set(getattr(cls, "SETTINGS", ()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        own = sorted({f.name for f in dataclasses.fields(value)} - takes)
        if own:
            raise TypeError(f"{name} must be a cnr.{cls.__name__}, got a {type(value).__name__} with settings the "
                            f"Checkpointer does not take ({', '.join(own)}); pass the library's options it holds "
                            "(e.g. its .options(...))")
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a cnr.{cls.__name__}, got {type(value).__name__}")
    return cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(cls)})


def check_checkpoint_settings(section: Any, names: Naming, skip: Tuple[str, ...] = ()) -> None:
    """CheckpointOptions' check of ``section``, any object holding its settings flat (an
    application's config section), naming them by ``names``: every setting's type but those in
    ``skip``, then the rules across them. Values are not converted."""
    for cls in GROUPS.values():
        check_record(section, names, convert=False, cls=cls, skip=skip)
    check_checkpoint(section, names)


@dataclass(frozen=True)
class PublishOptions:
    """How ``Checkpointer.publish`` sends fresh rows to inference (cnr.publish.publisher). Steps are training steps.

    - ``uri``: the publish store; "" means ``<checkpoint uri>/publish``. It must not overlap the
      checkpoint store's ``checkpoints/`` layout.
    - ``full_every``: every N-th publish (and the first of every run) is a full base, the others
      hold the rows touched since the previous publish.
    - ``dense_interval``: dense parameters go with every base and with the first publish at or
      after each multiple of this many steps.
    - ``bits``: 4, 8 (row-wise quantized) or 32 (exact); ``quant_method`` (cnr.types.QuantMethod)
      as in CheckpointOptions.
    - ``keep_bases``: after each commit keep the newest N bases and the publishes after the
      oldest of them (0: keep all).
    - ``serving_params``: quantized table rows carry a float16 scale and bias at every width,
      as fbgemm's fused rows do, so a serving subscriber (cnr.publish.serving) copies them into
      torchrec's quantized inference tables as stored; False: the quantizer's own precision
      (float32 at 8 bits), which such a subscriber converts.
    - ``max_rows`` / ``max_bytes``: freshness ranking (cnr.publish.freshness). An increment holds
      at most this many table rows / stored bytes of table rows (packed codes plus scale and bias,
      before compression), over all ranks: the touched rows that moved most since the subscriber
      last received them; the rest wait for a later publish. 0: no limit (every touched row).
      Bases, tables kept whole (data-parallel ones) and a job's last publish (``wait=True``)
      are not limited.
    - ``max_delay``: with a limit, every touched row is sent within this many publishes (1..255):
      a row deferred ``max_delay - 1`` times goes out with the next publish past the budget.
    """

    uri: str = ""
    full_every: int = 10
    dense_interval: int = 100
    bits: int = 8
    quant_method: QuantMethod = QuantMethod.DEFAULT
    keep_bases: int = 2
    serving_params: bool = True
    max_rows: int = 0
    max_bytes: int = 0
    max_delay: int = 4

    @property
    def ranked(self) -> bool:
        """Whether increments are freshness-ranked (a row or byte limit is set)."""
        return bool(self.max_rows or self.max_bytes)

    def __post_init__(self) -> None:
        check_record(self, PUBLISH_OPTIONS, cls=PublishOptions)
        check_publish(self, PUBLISH_OPTIONS)

    @classmethod
    def from_config(cls, section: Any, uri: str) -> "PublishOptions":
        """The options a configuration's section holds (any object with these fields but ``uri``,
        e.g. cnr train's publish section), publishing to ``uri``."""
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if f.name != "uri"}
        return cls(uri=uri, **values)


def check_publish_settings(section: Any, names: Naming, interval: Optional[int] = None) -> None:
    """PublishOptions' check of ``section`` (an application's config section holding its fields
    but ``uri``), naming them by ``names``; ``interval`` as in cnr.options.checks.check_publish."""
    check_record(section, names, convert=False, cls=PublishOptions, skip=("uri",))
    check_publish(section, names, interval)

