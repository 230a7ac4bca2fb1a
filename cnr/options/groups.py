"""The groups CheckpointOptions' settings come in, one frozen record per component, each field
with its default and meaning written once here (the rules across fields: cnr.options.checks).

``schedule`` (what each checkpoint holds and at how many bits), ``encoding`` (how rows are
stored), ``writer`` (the threads and waits of writing and restoring), ``tier`` (the node-local
tier), ``retention`` (what is kept and merged) and ``lease`` (one writing job per location). A
group checks its fields' types on construction (cnr.options.fields; a choice's string is made its
cnr.types enum member), naming each ``CheckpointOptions.<field>``: a field's name is unique
across the groups, so CheckpointOptions takes it flat too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from cnr.options.fields import check_record, strict_init
from cnr.options.naming import CHECKPOINT_OPTIONS, Naming
from cnr.types import (BitPolicy, Compaction, Compression, OnDamage, OnOverlap, Policy, QuantMethod, SearchKernel,
                       TrackerSource)


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


def _group(cls: type) -> type:
    """A frozen group of settings whose fields are type-checked (and choices made enum members)
    on construction, and whose constructor names a keyword of another group as such."""
    def __post_init__(self: Any) -> None:
        check_record(self, CHECKPOINT_OPTIONS)

    cls.__post_init__ = __post_init__  # type: ignore[attr-defined]  # before the decorator: its __init__ calls it
    cls = dataclass(frozen=True)(cls)
    return strict_init(cls, lambda key: f"it is {FIELD_GROUP[key].__name__}.{key}" if key in FIELD_GROUP else "")


@_group
class ScheduleOptions:
    """What each checkpoint holds and at how many bits (the policy group).

    - ``policy`` (cnr.types.Policy): "full" (every checkpoint full), "one_shot" (one full
      baseline, then incrementals of the rows touched since it), "consecutive" (incrementals of
      the rows touched since the previous checkpoint; restore replays the chain) or
      "intermittent" (one-shot, with a new baseline whenever the history predictor expects it to
      pay off; cnr.policy.kinds).
    - ``max_chain_ratio``: with "intermittent" or "consecutive", a new baseline whenever the next
      chain (what a restore reads) is predicted to exceed this many times its baseline's bytes
      (0: no cap; else > 1; cnr.policy.kinds.predicted_chain_ratio).
    - ``bit_policy`` (cnr.types.BitPolicy): "fixed" (``bits``) or "failures" (chosen from the
      expected failures over ``expected_steps`` steps within ``failures``: a FailureBudget or a
      dict of its fields).
    - ``expected_steps``: the job's length in steps (with ``bit_policy`` "failures", >= 1).
    - ``tracker`` (cnr.types.TrackerSource): where an increment's touched rows come from: "cnr" (cnr's
      bit vectors, set by its hook in each sharded module's post-lookup slot) or "torchrec" (torchrec's
      ModelDeltaTracker in ID_ONLY mode, read as consumer "cnr" at each snapshot; the model must be a
      DistributedModelParallel; refusals: cnr.track.torchrec_source).
    """

    policy: Policy = Policy.INTERMITTENT
    bit_policy: BitPolicy = BitPolicy.FIXED
    failures: FailureBudget = field(default_factory=FailureBudget)
    expected_steps: int = 0
    max_chain_ratio: float = 0.0
    tracker: TrackerSource = TrackerSource.CNR


@_group
class EncodingOptions:
    """How rows and state are stored.

    - ``bits``: embedding rows stored at 2, 3, 4, 8 bits (row-wise quantized by the writer,
      cnr.codec.quant.quantize) or 32 (fp32, bit-exact); ``quant_method`` (cnr.types.QuantMethod):
      "adaptive", "naive", "symmetric" or "" for the width's default (adaptive below 8 bits,
      naive at 8); ``optimizer_bits``: 32, or 8 to store fused optimizer state in 8 bits too (2-D
      state row-wise quantized, the 1-D row-wise Adagrad sum on a log grid, cnr.codec.log8), or 0
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
    - ``chunk_bytes``: largest stored chunk (4096 to MAX_CHUNK_BYTES).
    - ``search_kernel`` (cnr.types.SearchKernel): "auto", "eager" or "compiled" (needs a C++
      compiler on the host), how the writer runs the adaptive quantizer's range search.
    """

    bits: int = 32
    quant_method: QuantMethod = QuantMethod.DEFAULT
    optimizer_bits: int = 32
    compression: Compression = Compression.ZSTD
    compression_level: int = 3
    small_table_rows: int = 0
    small_table_bits: int = 8
    table_bits: Dict[str, int] = field(default_factory=dict)
    table_plan_width: int = 0
    chunk_bytes: int = 16 * 1024 * 1024
    search_kernel: SearchKernel = SearchKernel.AUTO


@_group
class WriterOptions:
    """The threads and waits of writing and restoring. Times in seconds.

    - ``upload_threads``: concurrent puts of the rank's background writer; ``encode_threads``:
      chunks it encodes at once (each keeps one core busy while a checkpoint is written: more
      than 1 only where training leaves cores idle, a GPU host; cnr.write.encode_pool);
      ``restore_threads``: workers a rank restores on: objects fetched, verified and decoded at
      once, sharing one object's chunks, the next links' objects fetched ahead
      (cnr.restore.workers). Each 1 to MAX_THREADS.
    - ``on_overlap`` (cnr.types.OnOverlap): what a save does while the previous checkpoint is
      still being written: "wait" (the wait counts as stall) or "abandon" (the older one is
      cancelled). ``commit_timeout_s``: how long rank 0's writer waits for every rank's data
      before it marks the checkpoint failed.
    - ``on_damage`` (cnr.types.OnDamage): when the newest committed checkpoint does not verify on
      restore, "fallback" restores the newest one that does (with a warning; cnr.restore.newest),
      "fail" raises.
    """

    upload_threads: int = 2
    encode_threads: int = 1
    restore_threads: int = 2
    on_overlap: OnOverlap = OnOverlap.WAIT
    commit_timeout_s: float = 600.0
    on_damage: OnDamage = OnDamage.FALLBACK


@_group
class TierOptions:
    """The node-local tier in front of the storage (cnr.storage.tiered).

    - ``local_dir``: a node-local directory ("" none): each rank stores its chunks there first, a
      checkpoint commits there once every rank's chunks are durable on its node, then is flushed
      to the storage in the background and commits there too; give each node its own (each
      storage location has its own subdirectory of it, cnr.storage.checkpoint_store, so jobs may share
      one). ``local_keep_last``: committed checkpoints (with their chains) the local tier keeps
      (0: all; what the storage does not hold yet is never deleted from it).
    """

    local_dir: str = ""
    local_keep_last: int = 1


@_group
class RetentionOptions:
    """What is kept, and when chains are merged.

    - ``keep_last``: after each commit, keep the newest ``keep_last`` states of the job's
      history whose restores verify (an increment and its merged baseline are one state) and
      every checkpoint their restores need, and older states while damage to one stored object
      could otherwise leave nothing restorable; delete older ones of that history
      (cnr.policy.retention; 0: keep everything; at most MAX_KEEP_LAST).
    - ``merge_every``: with the consecutive policy, merge the chain into a new full baseline in
      the background once this many increments followed the newest one (cnr.write.merge; 0: never).
    - ``compact_at_chain_ratio``: with the consecutive policy, merge it once the increments since
      the newest baseline (full or merged) store at least this many times its bytes (0: no bytes
      trigger; unset: 0.25 with the consecutive policy, see DEFAULT_COMPACT_RATIO, and none with
      the others; a value other than 0 needs the consecutive policy). Either trigger starts a
      merge; one runs at a time, off the training thread.
    - ``compaction`` (cnr.types.Compaction): "job" (this job's rank 0 merges) or "external" (it
      merges nothing; ``python -m cnr compact URI`` run elsewhere does, for nodes with no spare
      CPU or uplink: cnr.write.compact).
    """

    keep_last: int = 2
    merge_every: int = 0
    compact_at_chain_ratio: Optional[float] = None
    compaction: Compaction = Compaction.JOB


@_group
class LeaseOptions:
    """One writing job per storage location (cnr.write.lease).

    - ``lease_ttl_s``: a job holds its location's lease, renewed every quarter of this; another
      machine may take over a crashed job's location this long after its last renewal (1 to
      86400 seconds).
    """

    lease_ttl_s: float = 60.0


GROUPS: Dict[str, type] = {"schedule": ScheduleOptions, "encoding": EncodingOptions, "writer": WriterOptions,
                           "tier": TierOptions, "retention": RetentionOptions, "lease": LeaseOptions}
"""CheckpointOptions' attribute -> the group it holds."""
FIELD_GROUP: Dict[str, type] = {f.name: g for g in GROUPS.values() for f in dataclasses.fields(g)}
"""A setting's name -> its group."""
GROUP_ATTR: Dict[type, str] = {g: name for name, g in GROUPS.items()}

# The settings in the order cnr train's checkpoint section (and so a manifest's recorded config)
# has always listed them: a record's key order is part of what is stored.
FIELD_ORDER: Tuple[str, ...] = (
    "policy", "bits", "quant_method", "optimizer_bits", "compression", "compression_level", "small_table_rows",
    "small_table_bits", "table_bits", "table_plan_width", "bit_policy", "failures", "expected_steps", "keep_last",
    "merge_every", "compact_at_chain_ratio", "compaction", "max_chain_ratio", "chunk_bytes", "upload_threads",
    "encode_threads", "search_kernel", "restore_threads", "on_overlap", "commit_timeout_s", "lease_ttl_s",
    "on_damage", "local_dir", "local_keep_last", "tracker")
assert sorted(FIELD_ORDER) == sorted(FIELD_GROUP), "every setting is in exactly one group and in FIELD_ORDER"
