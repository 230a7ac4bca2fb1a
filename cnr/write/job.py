"""What the trainer hands its writer and gets back (cnr.write.writer), and how a piece's rows split
into chunks: shared by the writer process, the per-chunk plan (cnr.write.plan) and the merge
(cnr.write.merge), none of which needs the others for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from cnr.errors import CnrError
from cnr.track.snapshot import HostPiece
from cnr.types import CheckpointKind, CodecSpec, ExchangeAddress, LeaseRef, RetentionScope, WriteStatus


@dataclass(frozen=True)
class CodecPlan:
    """How a job's rows are stored, resolved by the trainer for this job (its bit-width decision
    can change between jobs); the writer reads nothing else of the codecs' settings (cnr.write.plan).

    ``bits``/``method``: how embedding rows are stored (32: raw fp32); ``optimizer_bits``: 8 to
    store fused optimizer state in 8 bits as well; ``compression``: the bytes->bytes stage (empty or
    one, cnr.codec.zstd) of the chunks of compressible codecs, quantized and log8 ones (raw chunks
    are stored as they are); ``small_table_rows``/``small_table_bits``: wider rows for tables of
    at most that many rows; ``table_bits``: table id -> its rows' width, over both.
    ``serving_params``: table rows below 32 bits keep a float16 scale and bias whatever their width,
    the parameters of fbgemm's fused rows (a publish that torchrec's quantized inference tables
    take as stored, cnr.codec.quant.quantize.quantize_serving_rows); checkpoints leave it False.
    """

    bits: int = 32
    method: str = ""
    optimizer_bits: int = 32
    compression: Tuple[CodecSpec, ...] = ()
    small_table_rows: int = 0
    small_table_bits: int = 8
    table_bits: Dict[str, int] = field(default_factory=dict)
    serving_params: bool = False


@dataclass(frozen=True)
class WriteJob:
    """One rank's share of one checkpoint. ``manifest_fields`` is set on rank 0 only.

    ``plan``: how its rows are stored (CodecPlan).
    ``lease``: the job's lease on the storage (cnr.write.lease, held by rank 0), which rank 0 checks
    right before the commit, and every rank's local tier before it flushes to the remote store
    after an outage (cnr.storage.tiered); None when the job holds none (benchmarks). ``lease_uri``:
    where ``lease`` is held when that is not the store this job writes to (a publish store: the
    job's checkpoint location, so a job that lost its location publishes nothing either); "": this
    store. ``exchange``:
    rank 0's store for the writers' commit objects (cnr.write.peer_exchange; with a local tier on
    several ranks), else None. ``retention``: the job's lineage and pinned checkpoints (set by
    cnr.Checkpointer; rank 0's manifest names the lineage, and its retention uses both,
    cnr.policy.retention); None: lineage "", nothing pinned.
    """

    ckpt_id: str
    step: int
    kind: CheckpointKind
    base: Optional[str]
    rank: int
    world_size: int
    pieces: List[HostPiece]
    manifest_fields: Optional[Dict[str, Any]] = None
    plan: CodecPlan = field(default_factory=CodecPlan)
    app: Dict[str, Any] = field(default_factory=dict)
    lease: Optional[LeaseRef] = None
    lease_uri: str = ""
    exchange: Optional[ExchangeAddress] = None
    retention: Optional[RetentionScope] = None


class Control(enum.Enum):
    """A message on a writer's job queue that is not a job (cnr.write.writer)."""

    STOP = "stop"
    """Finish (a local tier flushes first) and exit."""


class Pending(enum.Enum):
    """What ``HandOff.settle`` (cnr.write.handoff) agrees on when there is no outcome to settle."""

    NOTHING = "nothing"
    """No job was in flight on this rank."""
    RUNNING = "running"
    """Rank 0's writer is still busy (a poll): nothing is settled."""


@dataclass(frozen=True)
class CheckpointToken:
    """What the engine (cnr.write.engine) remembers of its in-flight checkpoint until it settles."""

    ckpt_id: str
    step: int
    kind: CheckpointKind
    bits: int
    base: Optional[str]


@dataclass
class WriteResult:
    """What the writer reports for a job; it crosses the process boundary, so every field pickles.

    ``bytes_written``: stored bytes (rank 0's include the manifest); ``seconds``: the job's wall
    time in the writer. ``error``: why it did not commit, the text users see (redacted); ``failure``:
    the same as an object, the CnrError the writer raised (cnr.write.failure; None when it
    committed). Rank 0's commit only: ``rows``/``nbytes``: the rows and stored bytes the
    manifest records, ``chain_bytes``: the manifest's chain history (None elsewhere), ``stored_at``:
    wall clock (time.time s) of the commit. ``objects``: the upload timeline, one tuple per object
    (cnr.write.puts); ``search``: the range search kernel it ran (cnr.types.SearchKernel value).
    """

    ckpt_id: str
    status: WriteStatus
    bytes_written: int = 0
    full_fp32_bytes: int = 0
    seconds: float = 0.0
    error: Optional[str] = None
    failure: Optional[CnrError] = None
    rows: int = 0
    nbytes: int = 0
    chain_bytes: Optional[Tuple[int, ...]] = None
    stored_at: Optional[float] = None
    objects: List[Tuple[Any, ...]] = field(default_factory=list)
    search: str = ""


def row_blocks(rows: int, row_bytes: int, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Row ranges of at most ``chunk_bytes`` each (at least one row each); one (0, 0) when empty."""
    step = max(1, chunk_bytes // max(1, row_bytes))
    return [(s, min(rows, s + step)) for s in range(0, max(1, rows), step)]
