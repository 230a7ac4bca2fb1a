"""The enums and frozen records that several of cnr's stages share; no logic.

A chunk's way from a snapshot to storage uses these (ChunkRef, Encoding, ByteRange, Role) and
types kept beside their one producer: touched rows (cnr.track.tracker.Captured) -> host rows
(cnr.track.snapshot.HostPiece) -> encoded chunk (cnr.codec.chunk_format) -> ChunkRef -> manifest (cnr.format.manifest).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

RNG_PREFIX = "rng/"
"""Tensor-name prefix of per-rank generator state: stored, but not training state (no digest,
no coverage, not counted in a checkpoint's full fp32 size)."""


STORED_QUANT_METHODS: Tuple[str, ...] = ("naive", "symmetric", "adaptive")
"""Row-wise quantization methods a stored chunk may use: every method of cnr.codec.quant.quantize."""


class Choice(str, enum.Enum):
    """A setting's choice among strings (cnr.options): a ``str`` equal to its value, whose ``str()``
    and ``format()`` are that value too, on every Python (as 3.11's ``enum.StrEnum``), so that a
    choice reads the same in messages and records whether it was given as a member or a string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Policy(Choice):
    """What each checkpoint holds (``CheckpointOptions.policy``; cnr.policy.kinds decides by it)."""

    FULL = "full"
    """Every checkpoint full."""
    ONE_SHOT = "one_shot"
    """One full baseline, then increments of the rows touched since it."""
    CONSECUTIVE = "consecutive"
    """Each increment on the previous checkpoint; a restore replays the chain."""
    INTERMITTENT = "intermittent"
    """One-shot, with a new baseline whenever the history predictor expects it to pay off
    (Check-N-Run's intermittent baseline)."""


POLICIES: Tuple[str, ...] = tuple(p.value for p in Policy)
"""The checkpoint policies' names, in Policy's order."""
CAPPED_POLICIES = (Policy.INTERMITTENT.value, Policy.CONSECUTIVE.value)
"""The policies whose chains ``CheckpointOptions.max_chain_ratio`` bounds."""


class Compaction(Choice):
    """Who merges a consecutive chain into a new baseline (``CheckpointOptions.compaction``)."""

    JOB = "job"
    """The job's own rank 0, in a background merge (cnr.write.merge)."""
    EXTERNAL = "external"
    """Nothing in the job; ``cnr compact`` run elsewhere does (cnr.write.compact)."""


class QuantMethod(Choice):
    """The row-wise quantization method of stored rows (``CheckpointOptions.quant_method``,
    ``PublishOptions.quant_method``; cnr.codec.quant.quantize.stored_method)."""

    DEFAULT = ""
    """The width's default: adaptive below 8 bits, naive at 8."""
    NAIVE = "naive"
    SYMMETRIC = "symmetric"
    ADAPTIVE = "adaptive"


class CheckpointKind(str, enum.Enum):
    """What a checkpoint holds."""

    FULL = "full"
    """Every row of every table, all optimizer state, dense state: restorable on its own."""
    INCREMENTAL = "incremental"
    """Only rows touched since its baseline; restore needs the baseline first."""


class Role(str, enum.Enum):
    """What a stored tensor is to the application; recorded per tensor in the manifest."""

    TABLE_ROWS = "table_rows"
    """An embedding table's weight: row-indexed, stored incrementally and possibly quantized."""
    TABLE_STATE = "table_state"
    """State of a table's fused optimizer, row-aligned with its weight (e.g. row-wise momentum)."""
    DENSE = "dense"
    """Any other tensor of a module's state_dict (dense parameters, buffers)."""
    OPTIMIZER = "optimizer"
    """Per-parameter state of an optimizer in app_state (not fused into a table)."""
    STATEFUL = "stateful"
    """A tensor inside a Stateful object's state; stored per rank."""
    RNG = "rng"
    """A rank's torch CPU generator state; stored per rank, not training state."""


TABLE_ROLES = (Role.TABLE_ROWS, Role.TABLE_STATE)
"""Roles whose tensors are row-aligned with an embedding table and may be stored incrementally."""


class CheckpointStatus(str, enum.Enum):
    """Lifecycle of a checkpoint as seen in storage."""

    COMMITTED = "committed"
    """Its manifest exists: every rank's data was durable before the commit."""
    UNCOMMITTED = "uncommitted"
    """Data without a manifest: still being written, abandoned, or its writer crashed."""
    FAILED = "failed"
    """Its writer recorded a failure marker; it is never used for restore."""
    DAMAGED = "damaged"
    """Its manifest exists but cannot be read or verified (altered, truncated, malformed); it is
    never used for restore, and retention leaves it for a person to look at."""


class ChainOrder(str, enum.Enum):
    """The order in which a restore applies a chain's links (cnr.restore.chain.restore_chain)."""

    NEWEST_FIRST = "newest_first"
    """Newest link first: each row is decoded and written once, from the newest link holding it;
    older copies are skipped before they are dequantized. Bit-identical to REPLAY."""
    REPLAY = "replay"
    """The baseline, then every increment on top in order: a row is written once per link holding it."""


class SearchKernel(Choice):
    """Which kernel runs the adaptive quantizer's greedy range search in a writer (cnr.codec.quant.range_search).
    Both walk the same path; they differ only in how fast."""

    AUTO = "auto"
    """COMPILED once a job asks for at least cnr.codec.quant.range_search.AUTO_COMPILE_ROWS searched rows
    (that job and any before it run EAGER while it compiles), EAGER before that: small jobs
    never pay for a compile."""
    EAGER = "eager"
    """torch ops, no compiler needed."""
    COMPILED = "compiled"
    """The search step fused by torch.compile, built on a thread of the writer as it starts
    (about 3x the eager rows/s on one core); EAGER until it is built, or if it cannot be."""


class OnOverlap(Choice):
    """What ``save`` does while the previous checkpoint is still being written
    (``CheckpointOptions.on_overlap``)."""

    WAIT = "wait"
    """Wait for it to commit or fail; the wait counts as stall."""
    ABANDON = "abandon"
    """Cancel it: the new checkpoint is taken at once, the older one never commits."""


class OnDamage(Choice):
    """What a restore does when the newest committed checkpoint does not verify
    (``CheckpointOptions.on_damage``, cnr.restore.newest)."""

    FALLBACK = "fallback"
    """Restore the newest committed checkpoint that verifies, with a warning naming what was passed over."""
    FAIL = "fail"
    """Raise on every rank; no older checkpoint is tried."""


class BitPolicy(Choice):
    """How the bit-width embedding rows are stored at is chosen (``CheckpointOptions.bit_policy``)."""

    FIXED = "fixed"
    """``CheckpointOptions.bits``, for every checkpoint."""
    FAILURES = "failures"
    """From the failures expected over the job (cnr.policy.kinds.decide_bits, Check-N-Run §5.2.1)
    within ``CheckpointOptions.failures``, the failure budget; 8 bits once more are observed."""


class Compression(Choice):
    """The lossless bytes->bytes stage over quantized and log8 chunks' payloads
    (``CheckpointOptions.compression``)."""

    ZSTD = "zstd"
    """zstandard at ``CheckpointOptions.compression_level`` (cnr.codec.zstd)."""
    NONE = "none"
    """Payloads are stored as encoded."""


class TrackerSource(Choice):
    """Where the rows each step touched come from (``CheckpointOptions.tracker``)."""

    CNR = "cnr"
    """cnr's own bit vectors, set by its hook in torchrec's post-lookup slot (cnr.track.tracker)."""
    TORCHREC = "torchrec"
    """torchrec's ModelDeltaTracker (ID_ONLY, consumer "cnr"), read at each snapshot (cnr.track.torchrec_source)."""


class WriteStatus(str, enum.Enum):
    """How a background writer ended one job (a checkpoint or a publish) on its rank."""

    COMMITTED = "committed"
    """Rank 0 only: every rank's data was durable and it wrote the manifest."""
    WRITTEN = "written"
    """Ranks other than 0: this rank's chunks and index are durable; rank 0 commits."""
    FAILED = "failed"
    """Writing failed; a failure marker names the error, and nothing is committed."""
    CANCELLED = "cancelled"
    """The trainer cancelled the job (overlap "abandon", or another rank failed)."""


class Encoding(str, enum.Enum):
    """How the values of a chunk's payload are stored."""

    RAW = "raw"
    """Little-endian values of the declared dtype, unchanged."""
    QUANTIZED = "quantized"
    """Row-wise quantized codes, densely bit-packed, with per-row scale and bias."""
    LOG8 = "log8"
    """Non-negative values as 8-bit codes on a logarithmic grid (cnr.codec.log8): row-wise
    optimizer accumulators such as the per-row Adagrad sum."""


@dataclass(frozen=True)
class CodecSpec:
    """One stage of a chunk's codec chain, as recorded in the chunk header and the manifest.

    ``name``: a registered codec (cnr.codec); ``params``: its parameters as sorted
    ``(name, value)`` pairs of ints and strings, so that a spec is hashable and compares by value.
    A chain is one array->bytes stage (raw, rowwise, log8) then at most one bytes->bytes stage
    (zstd; cnr.codec.base says why one).
    """

    name: str
    params: Tuple[Tuple[str, object], ...] = ()


class ShardingKind(str, enum.Enum):
    """torchrec sharding types a table may be placed with (planner constraint values)."""

    TABLE_WISE = "table_wise"
    """The whole table on one rank."""
    ROW_WISE = "row_wise"
    """Contiguous row ranges on every rank."""
    COLUMN_WISE = "column_wise"
    """Column ranges of the table on different ranks."""
    TABLE_ROW_WISE = "table_row_wise"
    """Row ranges across the ranks of one host."""
    DATA_PARALLEL = "data_parallel"
    """Replicated on every rank; gradients all-reduced."""


@dataclass(frozen=True)
class ByteRange:
    """A range of bytes in one stored object: ``length`` bytes starting at ``start`` (both >= 0)."""

    start: int
    length: int


@dataclass(frozen=True)
class ShardRegion:
    """Where a local shard (or a chunk) sits inside a global tensor.

    ``offsets`` and ``sizes`` have one entry per tensor dimension; dimension 0 is rows.
    """

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]


@dataclass(frozen=True)
class ChunkRef:
    """A chunk as recorded in a manifest: enough to fetch, verify and place it.

    Rows are either the contiguous range ``[row_start, row_start + rows)`` (``row_ids`` is False)
    or an explicit list of global row ids stored in the chunk payload (``row_ids`` is True).
    ``col_offset``/``cols`` give its columns for 2-D tensors (``cols`` is 0 for 1-D ones).
    ``crc32`` covers the chunk's payload, ``nbytes`` is the chunk's exact size in bytes.
    ``bits``/``method``: the values' bit-width and, for quantized chunks, the quantizer ("" if raw).
    ``offset``: where the chunk starts in the object ``key``; small chunks share one object
    (bytes ``[offset, offset + nbytes)`` of it), a large one is an object of its own (offset 0).
    ``tensor_name``: the stored tensor it is part of (``"tensor"`` in manifests and headers).
    ``codecs``: the chunk's codec chain (empty for chunks written before the codec seam, whose
    header alone describes them); ``encoding``/``bits``/``method`` summarise its first stage.
    """

    key: str
    tensor_name: str
    rows: int
    row_start: int
    row_ids: bool
    col_offset: int
    cols: int
    nbytes: int
    crc32: int
    encoding: Encoding = Encoding.RAW
    bits: int = 32
    method: str = ""
    offset: int = 0
    codecs: Tuple[CodecSpec, ...] = ()


@dataclass(frozen=True)
class TensorSpec:
    """A named piece of training state in its unsharded (global) form."""

    name: str
    shape: Tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TableSpec:
    """One embedding table: its name, rows, embedding dimension and the features it serves.

    ``name``: the table's id, the stored name of its weight (``<app key>/<module path>.weight``;
    a bare table name in manifests of version 1). ``placement``: torchrec's sharding type
    ("" when unknown).
    """

    name: str
    rows: int
    dim: int
    features: Tuple[str, ...]
    placement: str = ""


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as listed by ``inspect``: identity, kind and size. ``kind``, ``bits`` and
    ``rows`` are None where no readable manifest says them (an uncommitted, failed or damaged
    checkpoint in a listing): unknown, never guessed. ``bytes``: stored bytes."""

    id: str
    step: int
    kind: Optional[CheckpointKind]
    status: CheckpointStatus
    bits: Optional[int]
    rows: Optional[int]
    bytes: int
    base: Optional[str] = None
    error: Optional[str] = None
    method: str = ""
    lineage: str = ""  # the history it belongs to (cnr.format.lineage); "" when its manifest records none or is unread


@dataclass(frozen=True)
class RetentionScope:
    """Whose retention runs (cnr.policy.retention): ``lineage``, the job's history (cnr.format.lineage; "" for
    checkpoints that record none), the only one whose checkpoints it may delete; ``pinned``,
    checkpoint ids whose chains it keeps whatever is newer (what the job restored when that was
    not the newest committed one: a fallback past damage, or a restore by id)."""

    lineage: str = ""
    pinned: Tuple[str, ...] = ()


@dataclass(frozen=True)
class LeaseRef:
    """Which lease generation a job holds on its storage location (cnr.write.lease), and its owner
    token; rank 0's writer checks it is still the newest before it commits a manifest."""

    generation: int
    owner: str


@dataclass(frozen=True)
class ExchangeAddress:
    """Where rank 0's trainer serves the writers' exchange of commit objects (cnr.write.peer_exchange):
    a TCPStore at ``host``:``port`` for a job of ``world_size`` ranks."""

    host: str
    port: int
    world_size: int
