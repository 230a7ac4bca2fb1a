"""The library's settings, each field with its default, meaning and rules written once here.

``CheckpointOptions`` (every knob of a checkpoint engine), ``FailureBudget`` (its
``bit_policy: failures`` inputs) and ``PublishOptions`` are validated when constructed; an error
names the setting as ``CheckpointOptions.<name>``. The checks themselves (``check_checkpoint``,
``check_failures``, ``check_publish``) take a ``Naming``, so that an application that reads the
same settings from its own configuration (``cnr train``'s ``checkpoint`` and ``publish``
sections) rejects a bad value with the same rule, naming its own key.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from cnr.errors import ConfigError
from cnr.types import CAPPED_POLICIES, POLICIES, STORED_QUANT_METHODS, BitPolicy, CodecSpec, Compression, OnDamage, OnOverlap, SearchKernel

MAX_SHOWN = 200  # characters of a bad value quoted in an error message
TABLE_WIDTHS = (2, 3, 4, 8, 32)  # what a table's rows may be stored at
PUBLISH_BITS = (4, 8, 32)
# most threads of one kind a rank may run (puts, encodes, restore workers): a restore decodes up to
# twice its workers' objects ahead, so a typo'd count would hold a whole chain in memory at once
MAX_THREADS = 256
# most checkpoints keep_last / local_keep_last may name, and the largest chunk_bytes: C int32's
# bound (fbgemm's row indexes are held to it too). Far past any real store's count or chunk, so a
# typo'd 99999999999999999999 is refused by name rather than silently taken as "keep everything".
MAX_KEEP_LAST = 2**31 - 1
MAX_CHUNK_BYTES = 2**31 - 1
COMPACTION_MODES = ("job", "external")  # who merges a consecutive chain: the job's own merge process, or `cnr compact`
# The chain-bytes trigger's default (CheckpointOptions.compact_at_chain_ratio): merge once the increments since the
# newest baseline hold a quarter of its bytes. A restore of the newest checkpoint reads about 1 + r + s * (1 + M)
# baselines' bytes (s: one increment's bytes over the baseline's, M: intervals a merge takes while increments
# land); with s = 0.25 (bench.yaml: a quarter of the rows touched per interval) and s = 0.30 (tiny.yaml at
# interval 10) this fires at the first increment after a merge, keeping the chain at about 0.5-0.6 baselines
# while merges finish within an interval: under the ~0.7 that restores within 2x of a baseline.
DEFAULT_COMPACT_RATIO = 0.25


class OptionsError(ConfigError, ValueError):
    """A CheckpointOptions value is not allowed (a ValueError too, as Python APIs raise)."""


def shown(value: Any) -> str:
    """``repr(value)``, cut to MAX_SHOWN characters: an error never quotes a huge value whole."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


def values_of(choices: "type[enum.Enum]") -> Tuple[str, ...]:
    """The string values an enum of choices accepts, in declaration order."""
    return tuple(m.value for m in choices)


@dataclass(frozen=True)
class Naming:
    """How a check names the settings in its errors: ``prefix`` + the setting's name, e.g.
    ``CheckpointOptions.bits``; with ``config_keys`` as a config file's key,
    ``config key 'checkpoint.bits'``. ``error``: the exception raised."""

    prefix: str
    config_keys: bool = False
    error: type = OptionsError

    def ref(self, name: str) -> str:
        """Another setting, mentioned in an error."""
        return self.prefix + name

    def subject(self, name: str) -> str:
        """The setting being rejected."""
        return f"config key {self.ref(name)!r}" if self.config_keys else self.ref(name)

    def require(self, ok: bool, message: str) -> None:
        if not ok:
            raise self.error(message)

    def one_of(self, name: str, value: Any, allowed: Sequence[str]) -> None:
        choices = ", ".join(a if a else "'' (the default)" for a in allowed)
        self.require(value in allowed, f"{self.subject(name)} = {shown(value)} is not allowed; allowed: {choices}")

    def positive(self, name: str, value: float) -> None:
        self.require(value > 0, f"{self.subject(name)} = {value!r} is not allowed; it must be > 0")


CHECKPOINT_OPTIONS = Naming("CheckpointOptions.")
PUBLISH_OPTIONS = Naming("PublishOptions.")


def _default_tolerated() -> Dict[int, int]:
    # From `bench accuracy` (docs/benchmarks.md): 2-bit stays within the seed noise (about 0.5% logloss) up
    # to 3 restores and leaves it by 20; 3- and 4-bit stay within it up to 20, the most measured.
    return {2: 3, 3: 20, 4: 20}


# From `bench accuracy` at 2 bits (docs/benchmarks.md): log8 Adagrad sums are within the seed noise after 1
# and 3 restores (-0.45%/-0.30% logloss, against -0.39%/-0.32% with fp32 sums), and cost about
# 0.2 points at 10 and 20.
LOG8_TOLERATED_RESTORES = 3


@dataclass(frozen=True)
class FailureBudget:
    """The inputs of ``bit_policy`` "failures" (Check-N-Run §5.2.1; cnr.policy.kinds.decide_bits).

    The failure rate is ``rate_per_node_hour``, or derived from ``log``: a plain file of failure
    timestamps (unix seconds or ISO-8601, one per line) observed over ``log_nodes`` nodes.
    ``nodes``: nodes of this job (0: the world size). ``step_seconds``: expected seconds per
    step (0: measured over the steps before the first checkpoint). ``tolerated_restores``:
    bit-width (2, 3, 4) -> the most restores from checkpoints at that width the accuracy budget
    allows. ``log8_tolerated_restores``: the most expected failures at which ``optimizer_bits``
    0 stores fused optimizer state in 8 bits (log8); beyond them it stays fp32.
    """

    rate_per_node_hour: float = 0.0
    log: str = ""
    log_nodes: int = 0
    nodes: int = 0
    step_seconds: float = 0.0
    tolerated_restores: Dict[int, int] = field(default_factory=_default_tolerated)
    log8_tolerated_restores: int = LOG8_TOLERATED_RESTORES

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], names: Naming = CHECKPOINT_OPTIONS) -> "FailureBudget":
        """A budget from a dict of its fields; an unknown field is refused, naming the allowed ones."""
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(allowed), key=str)
        names.require(not unknown, f"unknown setting {names.ref('failures.' + str(unknown[0])) if unknown else ''!r}; "
                                   f"allowed in {names.ref('failures')}: {', '.join(allowed)}")
        return cls(**values)


def _check_types(obj: Any, names: Naming) -> None:
    """The scalar fields of dataclass ``obj`` hold their declared type (bool is no number)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        want = {"int": int, "float": (int, float), "str": str}.get(str(f.type))
        if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
            names.require(False, f"{names.subject(f.name)} = {shown(value)} is not allowed; it must be {f.type}")


def check_failures(f: FailureBudget, bit_policy: str, names: Naming) -> None:
    """The failure budget's rules (``names`` names ``failures.<field>``)."""
    k = "failures."
    names.require(math.isfinite(f.rate_per_node_hour) and f.rate_per_node_hour >= 0,
                  f"{names.subject(k + 'rate_per_node_hour')} = {f.rate_per_node_hour!r} is not allowed; it must be >= 0")
    for name in ("log_nodes", "nodes"):
        names.require(getattr(f, name) >= 0, f"{names.subject(k + name)} = {getattr(f, name)} is not allowed; "
                                             "it must be >= 0")
    names.require(math.isfinite(f.step_seconds) and f.step_seconds >= 0, f"{names.subject(k + 'step_seconds')} = "
                  f"{f.step_seconds!r} is not allowed; it must be >= 0 (0: measured)")
    names.require(isinstance(f.tolerated_restores, dict) and bool(f.tolerated_restores)
                  and all(b in (2, 3, 4) and isinstance(n, int) and n >= 0 for b, n in f.tolerated_restores.items()),
                  f"{names.subject(k + 'tolerated_restores')} = {shown(f.tolerated_restores)} is not allowed; it maps "
                  "bit-widths 2, 3, 4 to restore counts >= 0, e.g. {2: 1, 3: 3, 4: 20}")
    names.require(f.log8_tolerated_restores >= 0, f"{names.subject(k + 'log8_tolerated_restores')} = "
                  f"{f.log8_tolerated_restores} is not allowed; it must be >= 0")
    if bit_policy == BitPolicy.FAILURES:
        names.require((f.rate_per_node_hour > 0) != bool(f.log),
                      f"{names.ref('bit_policy')} 'failures' needs exactly one of '{names.ref(k + 'rate_per_node_hour')}' "
                      f"(> 0) or '{names.ref(k + 'log')}', got rate {f.rate_per_node_hour!r} and log {f.log!r}")
        names.require(not f.log or f.log_nodes >= 1, f"{names.subject(k + 'log_nodes')} = {f.log_nodes} is not "
                      "allowed with a failure log; it must be the number of nodes (>= 1) the log covers")


def check_compaction(c: Any, names: Naming) -> None:
    """The rules of ``compaction``, ``compact_at_chain_ratio`` and ``merge_every``. The ratio left
    unset (None) is the policy's default (CheckpointOptions.compaction_ratio); a ratio set to
    anything but 0 needs ``policy: consecutive``, 0.25 included."""
    names.one_of("compaction", c.compaction, COMPACTION_MODES)
    ratio = c.compact_at_chain_ratio
    if ratio is not None:
        names.require(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio)
                      and ratio >= 0, f"{names.subject('compact_at_chain_ratio')} = {shown(ratio)} is not allowed; "
                      f"it must be >= 0 (0: no bytes trigger), e.g. {DEFAULT_COMPACT_RATIO}, or unset (the policy's default)")
        names.require(ratio == 0 or c.policy == "consecutive",
                      f"{names.subject('compact_at_chain_ratio')} = {ratio!r} needs {names.ref('policy')} 'consecutive', "
                      f"not {c.policy!r}: only consecutive increments form chains to merge")
    names.require(c.compaction == "job" or c.policy == "consecutive",
                  f"{names.subject('compaction')} = {c.compaction!r} needs {names.ref('policy')} 'consecutive', not "
                  f"{c.policy!r}: only consecutive increments form chains to compact")
    names.require(c.merge_every >= 0, f"{names.subject('merge_every')} = {c.merge_every} is not allowed; it must be "
                  ">= 0 (0 never merges)")
    names.require(c.merge_every == 0 or c.policy == "consecutive",
                  f"{names.subject('merge_every')} = {c.merge_every} needs {names.ref('policy')} 'consecutive', not "
                  f"{c.policy!r}: only consecutive increments form chains to merge")
    names.require(c.merge_every == 0 or c.compaction == "job",
                  f"{names.subject('merge_every')} = {c.merge_every} is not allowed with {names.ref('compaction')} "
                  "'external': that job runs no merges (`cnr compact` does); set it to 0")


def check_checkpoint(c: Any, names: Naming) -> None:
    """The rules of CheckpointOptions' fields, on ``c`` (CheckpointOptions, or an application's
    section holding the same fields); raises ``names.error`` naming the setting, its value and
    what is allowed."""
    names.one_of("policy", c.policy, POLICIES)
    names.one_of("on_overlap", c.on_overlap, values_of(OnOverlap))
    names.one_of("search_kernel", c.search_kernel, values_of(SearchKernel))
    for name in ("upload_threads", "encode_threads", "restore_threads"):
        value = getattr(c, name)
        names.require(0 < value <= MAX_THREADS, f"{names.subject(name)} = {value!r} is not allowed; allowed: 1.."
                      f"{MAX_THREADS}")
    names.require(0 < c.commit_timeout_s < math.inf, f"{names.subject('commit_timeout_s')} = {c.commit_timeout_s!r} is "
                  "not allowed; it must be a number of seconds > 0 (an endless wait would hang every later save "
                  "behind a checkpoint a dead rank never finishes)")
    names.require(c.bits in TABLE_WIDTHS, f"{names.subject('bits')} = {c.bits} is not allowed; allowed: 2, 3, 4, 8, 32")
    names.one_of("quant_method", c.quant_method, ("",) + STORED_QUANT_METHODS)
    names.require(c.optimizer_bits in (0, 8, 32), f"{names.subject('optimizer_bits')} = {c.optimizer_bits} is not "
                  "allowed; allowed: 8, 32, or 0 (chosen from the failure budget, with bit_policy 'failures')")
    names.require(c.optimizer_bits != 0 or c.bit_policy == BitPolicy.FAILURES, f"{names.subject('optimizer_bits')} = 0 "
                  f"(chosen from the failure budget) needs {names.ref('bit_policy')} 'failures', not {c.bit_policy!r}")
    names.one_of("compression", c.compression, values_of(Compression))
    names.require(c.compression_level in range(1, 20), f"{names.subject('compression_level')} = "
                  f"{c.compression_level} is not allowed; allowed: 1..19")
    names.require(c.small_table_rows >= 0, f"{names.subject('small_table_rows')} = {c.small_table_rows} is not "
                  "allowed; it must be >= 0 (0: no table is small)")
    names.require(c.small_table_bits in (3, 4, 8, 32), f"{names.subject('small_table_bits')} = "
                  f"{c.small_table_bits} is not allowed; allowed: 3, 4, 8, 32")
    names.require(isinstance(c.table_bits, dict) and all(isinstance(k, str) and k and v in TABLE_WIDTHS
                                                         and not isinstance(v, bool) for k, v in c.table_bits.items()),
                  f"{names.subject('table_bits')} = {shown(c.table_bits)} is not allowed; it maps table names to "
                  "bit-widths 2, 3, 4, 8 or 32, e.g. {t_0: 4, t_1: 2}")
    names.require(c.table_plan_width in (0, 2, 3, 4, 8), f"{names.subject('table_plan_width')} = "
                  f"{c.table_plan_width} is not allowed; allowed: 0 (the plan applies at any width), 2, 3, 4, 8")
    names.one_of("bit_policy", c.bit_policy, values_of(BitPolicy))
    names.require(0 <= c.keep_last <= MAX_KEEP_LAST, f"{names.subject('keep_last')} = {shown(c.keep_last)} is not "
                  f"allowed; it must be from 0 to {MAX_KEEP_LAST} (0 keeps everything)")
    check_compaction(c, names)
    names.require(c.max_chain_ratio == 0 or c.max_chain_ratio > 1, f"{names.subject('max_chain_ratio')} = "
                  f"{c.max_chain_ratio} is not allowed; it must be 0 (no cap) or > 1 (a chain reads its baseline at least)")
    names.require(c.max_chain_ratio == 0 or c.policy in CAPPED_POLICIES,
                  f"{names.subject('max_chain_ratio')} = {c.max_chain_ratio} needs {names.ref('policy')} "
                  f"{' or '.join(repr(p) for p in CAPPED_POLICIES)}, not {c.policy!r}: the others never choose a new baseline")
    check_failures(c.failures, c.bit_policy, names)
    names.require(4096 <= c.chunk_bytes <= MAX_CHUNK_BYTES, f"{names.subject('chunk_bytes')} = {shown(c.chunk_bytes)} "
                  f"is not allowed; it must be from 4096 to {MAX_CHUNK_BYTES}")
    names.one_of("on_damage", c.on_damage, values_of(OnDamage))
    names.require(isinstance(c.local_dir, str) and "://" not in c.local_dir, f"{names.subject('local_dir')} = "
                  f"{shown(c.local_dir)} is not allowed; give a node-local directory path, or '' for none")
    names.require(0 <= c.local_keep_last <= MAX_KEEP_LAST, f"{names.subject('local_keep_last')} = "
                  f"{shown(c.local_keep_last)} is not allowed; it must be from 0 to {MAX_KEEP_LAST} (0 keeps everything)")
    names.require(1.0 <= c.lease_ttl_s <= 86400.0, f"{names.subject('lease_ttl_s')} = {c.lease_ttl_s} is not "
                  "allowed; it must be from 1 to 86400 seconds")


def _plain(obj: Any) -> None:
    """Choices given as enum members (cnr.types) stored as their string values."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, enum.Enum) and isinstance(value, str):
            object.__setattr__(obj, f.name, value.value)


@dataclass(frozen=True)
class CheckpointOptions:
    """How checkpoints are taken, stored and kept. Times in seconds, sizes in bytes. A choice
    among strings (policy, on_damage, ...) takes the string or its cnr.types enum member.

    - ``policy``: "full" (every checkpoint full), "one_shot" (one full baseline, then
      incrementals of the rows touched since it), "consecutive" (incrementals of the rows touched
      since the previous checkpoint; restore replays the chain) or "intermittent" (one-shot, with
      a new baseline whenever the history predictor expects it to pay off; cnr.policy.kinds).
    - ``bits``: embedding rows stored at 2, 3, 4, 8 bits (row-wise quantized by the writer,
      cnr.codec.quant.quantize) or 32 (fp32, bit-exact); ``quant_method``: "adaptive", "naive",
      "symmetric" or "" for the width's default (adaptive below 8 bits, naive at 8);
      ``optimizer_bits``: 32, or 8 to store fused optimizer state in 8 bits too (2-D state
      row-wise quantized, the 1-D row-wise Adagrad sum on a log grid, cnr.codec.log8), or 0
      (with ``bit_policy`` "failures") to let the failure budget choose 8 or 32.
    - ``compression`` (cnr.types.Compression): "zstd" (lossless, over quantized and log8 chunks'
      payloads, at ``compression_level`` 1..19) or "none".
    - ``small_table_rows``/``small_table_bits``: tables of at most ``small_table_rows`` rows
      (0: none) are stored at no fewer than ``small_table_bits`` (3, 4, 8, 32) bits whatever
      ``bits`` is: small tables are the hot ones and cost few bytes (cnr.write.plan.quantized_bits).
    - ``table_bits``: table -> the width (2, 3, 4, 8, 32) its rows are stored at instead of
      ``bits`` and the small-table rule (a plan from ``bench tables``). A table is named by its id
      (as ``cnr inspect --tables`` shows it) or by torchrec's table name when that is unique; the
      Checkpointer refuses names that match no table or several. Never below 8 after the
      fallback to 8 bits. ``table_plan_width``: the uniform width the plan stands in for (0:
      any); at another width (chosen by the failure budget, or the fallback) every table is
      stored at it.
    - ``bit_policy`` (cnr.types.BitPolicy): "fixed" (``bits``) or "failures" (chosen from the
      expected failures over ``expected_steps`` steps within ``failures``: a FailureBudget or a
      dict of its fields).
    - ``keep_last``: after each commit, keep the newest ``keep_last`` states of the job's
      history whose restores verify (an increment and its merged baseline are one state) and
      every checkpoint their restores need, and older states while damage to one stored object
      could otherwise leave nothing restorable; delete older ones of that history
      (cnr.policy.retention; 0: keep everything; at most MAX_KEEP_LAST). ``merge_every``: with the
      consecutive policy, merge the chain into a new full baseline in the background once this
      many increments followed the newest one (cnr.write.merge; 0: never).
      ``compact_at_chain_ratio``: with the consecutive policy, merge it once the increments since
      the newest baseline (full or merged) store at least this many times its bytes (0: no bytes
      trigger; unset: 0.25 with the consecutive policy, see DEFAULT_COMPACT_RATIO, and none
      with the others; a value other than 0 needs the consecutive policy). Either trigger starts a merge; one
      runs at a time, off the training thread. ``compaction``: "job" (this job's rank 0 merges)
      or "external" (it merges nothing; ``python -m cnr compact URI`` run elsewhere does, for
      nodes with no spare CPU or uplink: cnr.write.compact).
    - ``max_chain_ratio``: with "intermittent" or "consecutive", a new baseline whenever the next
      chain (what a restore reads) is predicted to exceed this many times its baseline's bytes
      (0: no cap; else > 1; cnr.policy.kinds.predicted_chain_ratio).
    - ``chunk_bytes``: largest stored chunk (4096 to MAX_CHUNK_BYTES); ``upload_threads``: concurrent puts of the
      rank's background writer; ``encode_threads``: chunks it encodes at once (each keeps one
      core busy while a checkpoint is written: more than 1 only where training leaves cores
      idle, a GPU host; cnr.write.encode_pool); ``restore_threads``: workers a rank restores
      on: objects fetched, verified and decoded at once, sharing one object's chunks, the next
      links' objects fetched ahead (cnr.restore.workers). ``search_kernel`` (cnr.types.SearchKernel):
      "auto", "eager" or "compiled" (needs a C++ compiler on the host), how the writer runs the
      adaptive quantizer's range search.
    - ``on_overlap`` (cnr.types.OnOverlap): what a save does while the previous checkpoint is
      still being written: "wait" (the wait counts as stall) or "abandon" (the older one is
      cancelled). ``commit_timeout_s``: how long rank 0's writer waits for every rank's data
      before it marks the checkpoint failed.
    - ``on_damage`` (cnr.types.OnDamage): when the newest committed checkpoint does not verify on
      restore, "fallback" restores the newest one that does (with a warning; cnr.restore.newest),
      "fail" raises.
    - ``local_dir``: a node-local directory in front of the storage (cnr.storage.tiered; "" none):
      each rank stores its chunks there first, a checkpoint commits there once every rank's
      chunks are durable on its node, then is flushed to the storage in the background and
      commits there too; give each node its own (each storage location has its own
      subdirectory of it, cnr.write.local_tier, so jobs may share one). ``local_keep_last``:
      committed checkpoints (with their chains) the local tier keeps (0: all; what the storage
      does not hold yet is never deleted from it).
    - ``lease_ttl_s``: a job holds its storage location's lease (cnr.write.lease, one writing job
      per location), renewed every quarter of this; another machine may take over a crashed
      job's location this long after its last renewal (1 to 86400).
    - ``expected_steps``: the job's length in steps (with ``bit_policy`` "failures", >= 1).
    """

    policy: str = "intermittent"
    bits: int = 32
    quant_method: str = ""
    optimizer_bits: int = 32
    compression: str = Compression.ZSTD.value
    compression_level: int = 3
    small_table_rows: int = 0
    small_table_bits: int = 8
    table_bits: Dict[str, int] = field(default_factory=dict)
    table_plan_width: int = 0
    bit_policy: str = BitPolicy.FIXED.value
    failures: FailureBudget = field(default_factory=FailureBudget)
    expected_steps: int = 0
    keep_last: int = 2
    merge_every: int = 0
    compact_at_chain_ratio: Optional[float] = None
    compaction: str = "job"
    max_chain_ratio: float = 0.0
    chunk_bytes: int = 16 * 1024 * 1024
    upload_threads: int = 2
    encode_threads: int = 1
    search_kernel: str = SearchKernel.AUTO.value
    restore_threads: int = 2
    on_overlap: str = OnOverlap.WAIT.value
    commit_timeout_s: float = 600.0
    lease_ttl_s: float = 60.0
    on_damage: str = OnDamage.FALLBACK.value
    local_dir: str = ""
    local_keep_last: int = 1

    def __post_init__(self) -> None:
        names = CHECKPOINT_OPTIONS
        _plain(self)
        if isinstance(self.failures, Mapping):
            object.__setattr__(self, "failures", FailureBudget.from_mapping(self.failures, names))
        names.require(isinstance(self.failures, FailureBudget), f"{names.subject('failures')} = "
                      f"{shown(self.failures):.80} is not allowed; give a cnr.FailureBudget or a dict of its fields")
        _check_types(self, names)
        _check_types(self.failures, Naming(names.ref("failures.")))
        names.require(self.bit_policy != BitPolicy.FAILURES or self.expected_steps >= 1,
                      f"{names.subject('expected_steps')} = {self.expected_steps} is not allowed with bit_policy "
                      "'failures'; it must be the job's length in steps (>= 1)")
        check_checkpoint(self, names)

    @classmethod
    def from_config(cls, section: Any, expected_steps: int = 0) -> "CheckpointOptions":
        """The options a configuration's section holds (any object with these fields, e.g. cnr
        train's checkpoint section), for a job of ``expected_steps`` steps."""
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if f.name != "expected_steps"}
        return cls(**values, expected_steps=expected_steps)

    def compaction_ratio(self) -> float:
        """The bytes trigger in force: ``compact_at_chain_ratio`` when set, else DEFAULT_COMPACT_RATIO
        with the consecutive policy and 0 (none) with the others."""
        if self.compact_at_chain_ratio is not None:
            return float(self.compact_at_chain_ratio)
        return DEFAULT_COMPACT_RATIO if self.policy == "consecutive" else 0.0

    def compression_chain(self) -> Tuple[CodecSpec, ...]:
        """The bytes->bytes stage (at most one) of quantized and log8 chunks' payloads (cnr.codec)."""
        from cnr.codec.zstd import zstd_spec  # zstandard loads only in processes that encode

        return (zstd_spec(self.compression_level),) if self.compression == "zstd" else ()

    def to_dict(self) -> Dict[str, Union[str, int, float, Dict]]:
        return dataclasses.asdict(self)

    def may_search(self) -> bool:
        """Whether some checkpoint may store rows with the adaptive range search: the failure
        budget choosing widths, or a width below 32 whose method (cnr.codec.quant.quantize.stored_method)
        is adaptive."""
        from cnr.codec.quant.quantize import stored_method

        widths = [w for w in (self.bits, *self.table_bits.values()) if w < 32]
        return self.bit_policy == "failures" or any(
            stored_method(w, self.bits, self.quant_method) == "adaptive" for w in widths)

    def for_writer(self, rows_per_rank: int) -> "CheckpointOptions":
        """These options with ``search_kernel`` "auto" made definite for a writer about to start
        (cnr.codec.quant.range_search.writer_kernel): "compiled", built as the writer starts, when checkpoints
        may search at least AUTO_COMPILE_ROWS of this rank's table rows, else "eager"."""
        from cnr.codec.quant.range_search import writer_kernel

        kernel = writer_kernel(SearchKernel(self.search_kernel), rows_per_rank, self.may_search())
        return dataclasses.replace(self, search_kernel=kernel.value)


@dataclass(frozen=True)
class PublishOptions:
    """How ``Checkpointer.publish`` sends fresh rows to inference (cnr.publish.publisher). Steps are training steps.

    - ``uri``: the publish store; "" means ``<checkpoint uri>/publish``. It must not overlap the
      checkpoint store's ``checkpoints/`` layout.
    - ``full_every``: every N-th publish (and the first of every run) is a full base, the others
      hold the rows touched since the previous publish.
    - ``dense_interval``: dense parameters go with every base and with the first publish at or
      after each multiple of this many steps.
    - ``bits``: 4, 8 (row-wise quantized) or 32 (exact); ``quant_method`` as in CheckpointOptions.
    - ``keep_bases``: after each commit keep the newest N bases and the publishes after the
      oldest of them (0: keep all).
    """

    uri: str = ""
    full_every: int = 10
    dense_interval: int = 100
    bits: int = 8
    quant_method: str = ""
    keep_bases: int = 2

    def __post_init__(self) -> None:
        _check_types(self, PUBLISH_OPTIONS)
        check_publish(self, PUBLISH_OPTIONS)

    @classmethod
    def from_config(cls, section: Any, uri: str) -> "PublishOptions":
        """The options a configuration's section holds (any object with these fields but ``uri``,
        e.g. cnr train's publish section), publishing to ``uri``."""
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if f.name != "uri"}
        return cls(uri=uri, **values)


def check_publish(p: Any, names: Naming, interval: Optional[int] = None) -> None:
    """The rules of PublishOptions' fields, on ``p`` (PublishOptions, or an application's section
    holding the same fields). ``interval``: the steps between the caller's publishes, when it
    publishes at fixed boundaries: ``dense_interval`` must then be a multiple of it."""
    if interval is not None:
        names.positive("interval", interval)
    names.positive("full_every", p.full_every)
    if interval is None:
        names.positive("dense_interval", p.dense_interval)
    else:
        names.require(p.dense_interval > 0 and p.dense_interval % interval == 0,
                      f"{names.subject('dense_interval')} = {p.dense_interval} is not allowed; it must be a positive "
                      f"multiple of {names.ref('interval')} = {interval}")
    names.require(p.bits in PUBLISH_BITS, f"{names.subject('bits')} = {p.bits} is not allowed; allowed: "
                  + ", ".join(str(b) for b in PUBLISH_BITS))
    names.one_of("quant_method", p.quant_method, ("",) + STORED_QUANT_METHODS)
    names.require(p.keep_bases >= 0, f"{names.subject('keep_bases')} = {p.keep_bases} is not allowed; "
                  "it must be >= 0 (0 keeps everything)")
