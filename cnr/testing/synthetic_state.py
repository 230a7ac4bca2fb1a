"""The synthetic state of a production-shaped job (``bench scale`` and tests): its tables, sharding and chunks.

No tensor is allocated: the state is described by shards (which rank holds which rows of which
table) and by the rank indexes cnr's writers would store for it, built from cnr's own types
(``RankIndex``, ``TensorEntry``, ``ChunkRef``), so the control-plane code under test (commit,
manifests, retention, restore planning) handles exactly what a real job would hand it.

Shape (defaults): 1,000 embedding tables of dimension 128 in fp32, 4 TB of embeddings in all,
table sizes falling as a Zipf law (a few huge tables, many small ones), sharded over N ranks as
torchrec's planner would: a table larger than half a rank's share is split row-wise over as many
ranks as it fills, the others are placed whole (table-wise) on the least loaded rank. Each table
has a row-wise optimizer state (one fp32 per row, as row-wise Adagrad keeps). A rank stores its
rows in about ``chunks_per_rank`` objects (at least one per table shard it holds), and a share of
the replicated dense part (``dense_tensors`` tensors, cut as cnr.track.shares cuts them: shares of
at least ``MIN_SHARE_BYTES``, by as many ranks as that allows).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from cnr.format.documents import RankIndex, TensorEntry
from cnr.format.layout import object_key
from cnr.track.shares import share_of, share_writers
from cnr.types import ChunkRef, Encoding, Role, TableSpec

DIM = 128
ROW_BYTES = DIM * 4
DENSE_COLS = 256  # columns of each replicated dense tensor (fp32)


@dataclass(frozen=True)
class ScaleShape:
    """What the synthetic job holds. ``embedding_bytes``: fp32 bytes of every table's weights."""

    tables: int = 1000
    embedding_bytes: int = 4 * 10 ** 12
    chunks_per_rank: int = 64
    dense_tensors: int = 40
    dense_rows: int = 1024

    def __post_init__(self) -> None:
        for name in ("tables", "embedding_bytes", "chunks_per_rank", "dense_tensors", "dense_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ScaleShape.{name} = {value!r} is not allowed: it must be an integer >= 1")


@dataclass(frozen=True)
class Shard:
    """Rows ``[row_start, row_start + rows)`` of table ``table`` (all its columns) on ``rank``."""

    table: int
    rank: int
    row_start: int
    rows: int


def table_name(t: int) -> str:
    return f"model/sparse.embedding_bags.t{t:04d}.weight"


def state_name(t: int) -> str:
    return f"optim/sparse.embedding_bags.t{t:04d}.weight/momentum1"


def dense_name(d: int) -> str:
    return f"model/dense.layer{d:03d}.weight"


def table_rows(shape: ScaleShape) -> List[int]:
    """Rows of each table: Zipf-distributed sizes (exponent 1) summing to about ``embedding_bytes``."""
    weights = [1.0 / (t + 1) for t in range(shape.tables)]
    total_rows = shape.embedding_bytes // ROW_BYTES
    scale = total_rows / sum(weights)
    return [max(1, int(w * scale)) for w in weights]


def table_specs(shape: ScaleShape, ranks: int) -> Tuple[TableSpec, ...]:
    rows = table_rows(shape)
    split = {s.table for s in shard_tables(shape, ranks) if s.rows != rows[s.table]}
    return tuple(TableSpec(table_name(t), n, DIM, (f"f{t}",), "row_wise" if t in split else "table_wise")
                 for t, n in enumerate(rows))


def shard_tables(shape: ScaleShape, ranks: int) -> List[Shard]:
    """Every table's shards over ``ranks`` ranks (see the module docstring), in table order."""
    rows = table_rows(shape)
    per_rank = sum(rows) / ranks
    loads = [(0, r) for r in range(ranks)]  # (rows held, rank): a min-heap, the least loaded rank first
    heapq.heapify(loads)
    shards: List[Shard] = []
    for t in sorted(range(shape.tables), key=lambda t: -rows[t]):  # largest first, as a planner packs
        parts = max(1, min(ranks, math.ceil(rows[t] / per_rank))) if rows[t] > per_rank / 2 else 1
        chosen = [heapq.heappop(loads) for _ in range(parts)]
        start = 0
        for i, (load, rank) in enumerate(chosen):
            n = rows[t] // parts + (1 if i < rows[t] % parts else 0)
            shards.append(Shard(t, rank, start, n))
            start += n
            heapq.heappush(loads, (load + n, rank))
    return sorted(shards, key=lambda s: (s.table, s.row_start))


def _chunk(key: str, tensor: str, row_start: int, rows: int, cols: int, row_bytes: int) -> ChunkRef:
    return ChunkRef(key=key, tensor_name=tensor, rows=rows, row_start=row_start, row_ids=False, col_offset=0,
                    cols=cols, nbytes=rows * row_bytes, crc32=0, encoding=Encoding.RAW, bits=32)


def rank_indexes(shape: ScaleShape, ranks: int, ckpt_id: str) -> List[RankIndex]:
    """The index each of ``ranks`` ranks stores for a full fp32 checkpoint ``ckpt_id`` of the state."""
    rows = table_rows(shape)
    by_rank: Dict[int, List[Shard]] = {r: [] for r in range(ranks)}
    for shard in shard_tables(shape, ranks):
        by_rank[shard.rank].append(shard)
    dense_rows = shape.dense_tensors * shape.dense_rows
    writers = share_writers(dense_rows * DENSE_COLS * 4, ranks)
    out = []
    for rank in range(ranks):
        held = by_rank[rank]
        rank_rows = sum(s.rows for s in held) or 1
        per_chunk = max(1, math.ceil(rank_rows / shape.chunks_per_rank))
        tensors: Dict[str, TensorEntry] = {}
        n = 0
        for s in held:
            refs, state = [], []
            for lo in range(s.row_start, s.row_start + s.rows, per_chunk):
                count = min(per_chunk, s.row_start + s.rows - lo)
                refs.append(_chunk(object_key(ckpt_id, rank, n), table_name(s.table), lo, count, DIM, ROW_BYTES))
                state.append(_chunk(object_key(ckpt_id, rank, n), state_name(s.table), lo, count, 0, 4))
                n += 1
            span = (rank, s.row_start, s.row_start + s.rows)
            tensors[table_name(s.table)] = TensorEntry((rows[s.table], DIM), "float32", False, tuple(refs),
                                                       Role.TABLE_ROWS, table_name(s.table), (span + (0, DIM),))
            tensors[state_name(s.table)] = TensorEntry((rows[s.table],), "float32", False, tuple(state),
                                                       Role.TABLE_STATE, table_name(s.table), (span + (0, 0),))
        # this rank's share of the dense part, if it writes one: rows [lo, hi) of the dense tensors laid end to end
        mine = share_of(rank, ranks, writers)
        lo, hi = (dense_rows * mine // writers, dense_rows * (mine + 1) // writers) if mine is not None else (0, 0)
        for d in range(shape.dense_tensors):
            a, b = max(lo, d * shape.dense_rows), min(hi, (d + 1) * shape.dense_rows)
            if a < b:
                name = dense_name(d)
                ref = _chunk(object_key(ckpt_id, rank, n), name, a - d * shape.dense_rows, b - a, DENSE_COLS,
                             DENSE_COLS * 4)
                extent = (rank, ref.row_start, ref.row_start + ref.rows, 0, DENSE_COLS)
                tensors[name] = TensorEntry((shape.dense_rows, DENSE_COLS), "float32", True, (ref,), Role.DENSE, None,
                                            (extent,))
        out.append(RankIndex(ckpt_id, rank, ranks, tensors, app_state(rank, [table_name(s.table) for s in held])))
    return out


def app_state(rank: int, tables: List[str]) -> Dict[str, Any]:
    """The JSON app state a rank of such a job saves (cnr.track.app_state): its reader's position
    and training progress, its dense optimizer's param groups, and the values of the fused
    optimizer of each table it holds."""
    group = {"lr": 0.01, "eps": 1e-08, "weight_decay": 0.0, "initial_lr": 0.01}
    return {
        "reader": {"kind": "stateful", "state": {"next_batch": 120000 + rank, "epoch": 3, "rank": rank}},
        "progress": {"kind": "stateful", "state": {"samples": 983040000, "steps": 120000}},
        "optim": {"kind": "optimizer", "param_groups": [group], "group_params": [["dense.weight"]],
                  "group_classes": ["Adagrad"], "state": {}},
        "model": {"kind": "module", "fused_table_groups": {t: group for t in tables},
                  "fused_table_optimizers": {t: "ROWWISE_ADAGRAD" for t in tables}},
    }


def objects_of(index: RankIndex) -> List[str]:
    """The distinct object keys ``index`` lists, in order: what its rank puts."""
    return sorted({c.key for t in index.tensors.values() for c in t.chunks})
