"""The in-memory form of a checkpoint's manifest and rank indexes (cnr.format.manifest reads and
writes their JSON). Whatever format version a document was read from, it is upgraded to this form
as it is parsed: code that reads these records never asks which version was stored; what older
versions did not record is said by the fields below (``indexes_in_rank_folders``,
``names_match_indexes``, ``all_keys_recorded``, ``app_agree`` None, ``lineage`` "")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

from cnr.types import RNG_PREFIX, CheckpointKind, ChunkRef, Role, TableSpec

VERSION = 8  # the format version this cnr writes
"""What each version added. Version 8 records which Stateful app_state keys saved the same state
on every rank (``Manifest.app_agree``), so a restore at another world size reads rank 0's index
for them, not every rank's (issue #39); version 7 splits the manifest (issue #39): a sharded
tensor's chunks are listed only in the indexes of the ranks that wrote them, and the manifest
records, per tensor, each rank's extents (``TensorEntry.extents``), per rank its index's digest
(``Manifest.indexes``) and the chunk totals (``Manifest.summary``), so a rank restores from the
manifest and the few indexes its part overlaps (cnr.format.split); replicated tensors' chunks and
a merged baseline's stay in the manifest; version 6 stores each rank's index in its rank's folder
(cnr.format.layout.rank_index_key), beside its chunks, so the indexes of thousands of ranks are
not all written under one S3 prefix at once (issue #39); version 5 records the checkpoint's job
lineage (``lineage``, cnr.format.lineage); version 4 records each chunk's codec chain (``codecs``,
cnr.codec); version 3 seals every manifest and rank index with a SHA-256 of its bytes
(cnr.format.integrity); version 2 (the library API) records each tensor's role and table, the
application's state per rank (``app``) and opaque application metadata; versions 1 (cnr train
only) to 7 still read, upgraded as they are parsed (versions 1 to 4 with lineage "", none
recorded)."""
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
LINEAGE_VERSION = 5
RANK_FOLDER_VERSION = 6
SPLIT_VERSION = 7
AGREE_VERSION = 8


Extent = Tuple[int, int, int, int, int]
"""``(rank, row_lo, row_hi, col_lo, col_hi)``: the rows and columns of a tensor that ``rank`` wrote
(its shard, or its share of a replicated tensor); columns ``(0, 0)`` for a 0-d or 1-D tensor, whose
0-d form is the one row ``(0, 1)`` (as cnr.restore.spans.piece_span spans a piece)."""


@dataclass(frozen=True)
class TensorEntry:
    """A global tensor in a checkpoint: its shape, dtype, role, and the chunks that hold it.

    ``table``: for the table roles, the id of the table it belongs to (its weight's name).
    ``extents`` (version 7): where each rank's part of it lies. In a rank index, that rank's
    parts, and ``chunks`` are its chunks of them. In a manifest, a tensor with extents has its
    chunks listed in those ranks' indexes only (``chunks`` holds those of the indexes read so far,
    cnr.format.split); one without lists all of them in ``chunks``.
    """

    shape: Tuple[int, ...]
    dtype: str
    replicated: bool
    chunks: Tuple[ChunkRef, ...]
    role: Role = Role.DENSE
    table: Optional[str] = None
    extents: Tuple[Extent, ...] = ()


@dataclass(frozen=True)
class ChunkSummary:
    """A checkpoint's chunk totals: what ``Manifest.bytes``, ``rows``, ``bits`` and ``method`` say."""

    bytes: int
    rows: int
    bits: int
    method: str


def summarize_chunks(tensors: Mapping[str, TensorEntry]) -> ChunkSummary:
    """The totals of every chunk of ``tensors`` (see ``Manifest``'s properties)."""
    rows = [c for t in tensors.values() if t.role == Role.TABLE_ROWS for c in t.chunks]
    methods = sorted({c.method for c in rows if c.method})
    return ChunkSummary(bytes=sum(c.nbytes for t in tensors.values() for c in t.chunks), rows=sum(c.rows for c in rows),
                        bits=min((c.bits for c in rows), default=32), method=",".join(methods))


@dataclass(frozen=True)
class RankIndex:
    """What one rank wrote for one checkpoint. ``app``: its JSON state of app_state's objects."""

    id: str
    rank: int
    world_size: int
    tensors: Dict[str, TensorEntry]
    app: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. ``counters``: integers, ``step`` always among them.

    ``tables``: every embedding table of the model. ``metadata``: the application's own
    description of the job (opaque to cnr; ``cnr train`` stores its config there).
    ``app_ranks``: per rank, the JSON state of app_state's objects (cnr.track.app_state).
    ``chain_bytes``: chunk bytes of the newest full checkpoint of the job and of every committed
    checkpoint after it, this one last (what the intermittent predictor reads on resume).
    ``bit_width``: the bit-width decision in force (cnr.policy.kinds.BitDecision.to_dict()).
    ``lineage``: the job history it belongs to (cnr.format.lineage: 32 hex digits; "" when none is
    recorded, as in every manifest before version 5).
    ``version``: the format version it was read from (for display: the fields below say what
    an older version did not record).
    ``indexes`` (version 7, split): per rank, the SHA-256 its index is sealed with; empty when the
    manifest lists every chunk itself (before version 7, a merged baseline, a manifest read whole).
    ``summary``: a split manifest's chunk totals (None: computed from ``tensors``' chunks).
    ``loaded``: of a split manifest, the ranks whose indexes' chunks (and app state) it holds
    (cnr.format.split.load_ranks); None when it holds every chunk.
    ``app_agree`` (version 8, split): the Stateful app_state keys whose saved state (its JSON and
    its tensors' chunk checksums) was the same on every rank, as the commit found them
    (cnr.format.split.agreeing_keys); None when not recorded (the app states are then compared).
    ``indexes_in_rank_folders``: its rank indexes lie in the ranks' folders (cnr.format.layout
    .rank_index_key; False: beside the manifest, before version 6).
    ``names_match_indexes``: its tensor names are those its rank indexes list (False: version 1,
    whose names were upgraded as it was read while its indexes keep the old ones).
    ``all_keys_recorded``: the app state records every app_state key's kind (False: version 1,
    written by cnr train, recorded only its Stateful keys' JSON).
    """

    id: str
    step: int
    kind: CheckpointKind
    base: Optional[str]
    world_size: int
    created_unix: float
    tables: Tuple[TableSpec, ...]
    tensors: Dict[str, TensorEntry]
    counters: Dict[str, int]
    metadata: Dict[str, Any] = field(default_factory=dict)
    app_ranks: Tuple[Dict[str, Any], ...] = ()
    chain_bytes: Tuple[int, ...] = ()
    bit_width: Dict[str, Any] = field(default_factory=dict)
    version: int = VERSION
    lineage: str = ""
    indexes: Tuple[str, ...] = ()
    summary: Optional[ChunkSummary] = None
    loaded: Optional[FrozenSet[int]] = None
    app_agree: Optional[FrozenSet[str]] = None
    indexes_in_rank_folders: bool = True
    names_match_indexes: bool = True
    all_keys_recorded: bool = True

    def _summary(self) -> ChunkSummary:
        return self.summary if self.summary is not None else summarize_chunks(self.tensors)

    @property
    def bytes(self) -> int:
        """Bytes of every chunk this checkpoint stored (manifest and indexes excluded)."""
        return self._summary().bytes

    @property
    def full_fp32_bytes(self) -> int:
        """Bytes of all training state as raw fp32 (4 per element of every tensor but RNG state):
        what a full fp32 checkpoint of this state would store, whatever this one's kind and bits."""
        return sum(4 * math.prod(t.shape) for name, t in self.tensors.items() if not name.startswith(RNG_PREFIX))

    @property
    def rows(self) -> int:
        """Embedding rows stored (rows of table weight chunks)."""
        return self._summary().rows

    @property
    def bits(self) -> int:
        """Bit-width of the stored embedding rows (32 for fp32)."""
        return self._summary().bits

    @property
    def method(self) -> str:
        """Quantizer of the stored embedding rows ("" when they are raw)."""
        return self._summary().method
