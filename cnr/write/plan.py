"""How the writer stores each piece of a checkpoint: its bit-width, its codec chain, and the
finiteness check every block passes first. Pure functions of the job (a cnr.write.job.WriteJob)
and the piece, run in the writer process, never in the stall.

The plan picks the bits; the codecs decide whether they store a block at those bits: it asks the
array codecs of cnr.codec.plan_codecs in order and takes the first that encodes the block (raw,
last, takes anything). It knows no codec by name.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import torch

from cnr.codec import plan_codecs
from cnr.codec.base import Target
from cnr.codec.chunk_format import encode_chunk
from cnr.errors import NONFINITE, NonFiniteStateError
from cnr.track.snapshot import HostPiece
from cnr.types import TABLE_ROLES, ChunkRef, Role
from cnr.write.job import WriteJob


def resolve_table_bits(table_bits: Mapping[str, int], tables: Iterable[Tuple[str, str]],
                       what: str = "table_bits key") -> Dict[str, int]:
    """``table_bits`` keyed by table id. ``tables``: every table's (id, torchrec name). A key is a
    table's id, or the torchrec name of exactly one table; raises ValueError naming a key that
    matches no table or several (as ``what``)."""
    tables = list(tables)
    out: Dict[str, int] = {}
    for key, bits in table_bits.items():
        ids = [i for i, name in tables if key == i] or [i for i, name in tables if key == name]
        if len(ids) != 1:
            problem = "matches no table" if not ids else f"names {len(ids)} tables ({', '.join(sorted(ids))}); give the id"
            raise ValueError(f"{what} {key!r} {problem}; tables: {', '.join(i for i, _ in tables)}")
        out[ids[0]] = bits
    return out


def quantized_bits(job: WriteJob, piece: HostPiece) -> int:
    """Bit-width ``piece`` is stored at (``plan``: the job's CodecPlan): table weights at
    ``plan.table_bits[table]`` when the table has an entry, else at ``plan.bits``, or at least
    ``plan.small_table_bits`` for a table of at most ``plan.small_table_rows`` rows; fused
    optimizer state (2-D row-wise quantized, 1-D row-wise on cnr.codec.log8's grid) at
    ``plan.optimizer_bits``; everything else (dense state) at 32."""
    plan = job.plan
    if piece.data.dtype != torch.float32 or piece.role not in TABLE_ROLES:
        return 32
    if piece.role == Role.TABLE_STATE and piece.data.dim() in (1, 2):
        return plan.optimizer_bits
    if piece.data.dim() != 2:
        return 32
    if piece.table in plan.table_bits:
        return plan.table_bits[piece.table]
    if piece.global_shape[0] <= plan.small_table_rows:
        return max(plan.bits, plan.small_table_bits)
    return plan.bits


def check_finite(piece: HostPiece, block: torch.Tensor, first_row: int) -> None:
    """Raise NonFiniteStateError when a floating block holds NaN or inf (checked here, in the
    writer, where every byte is read anyway: never in the trainer's stall)."""
    if not block.is_floating_point() or bool(torch.isfinite(block.sum())):
        # NaN and inf propagate into the sum, so a finite sum proves every value finite; one
        # reduction costs 1/40 of an elementwise isfinite (0.27 ms against 11.7 ms per 16 MB chunk)
        return
    bad = int((~torch.isfinite(block)).sum())  # 0 when only the sum of large finite values overflowed
    if bad:
        raise NonFiniteStateError(f"tensor {piece.name!r} holds {bad} {NONFINITE} in its rows from {first_row} on: "
                                  "a diverged state is not checkpointed, the newest committed checkpoint stays the "
                                  "last finite one")


def _target(job: WriteJob, piece: HostPiece, search: Optional[Any]) -> Target:
    return Target(bits=quantized_bits(job, piece), job_bits=job.plan.bits, method=job.plan.method, search=search,
                  name=piece.name, serving_params=job.plan.serving_params and piece.role == Role.TABLE_ROWS)


def searched_rows(job: WriteJob) -> int:
    """Rows of ``job`` that the adaptive quantizer's range search will encode (cnr.codec.quant.range_search)."""
    return sum(codec.searched_rows(piece.data, _target(job, piece, None))
               for piece in job.pieces for codec in plan_codecs())


def encode_block(job: WriteJob, piece: HostPiece, key: str, lo: int, hi: int, row0: int,
                 col0: int, search: Optional[Any] = None) -> Tuple[bytes, ChunkRef]:
    """One chunk of rows ``lo..hi-1`` of ``piece``: at the bits quantized_bits gives, by the first
    codec of cnr.codec.plan_codecs that takes the block (row-wise quantized, log8, else raw: exact),
    then through the job's compression when the codec is ``compressible`` (raw is not).
    ``search``: the adaptive search's compiled kernels (cnr.codec.quant.range_search.Fused), or None
    for the eager ones.

    Why raw chunks (fp32 tables at 32 bits, dense state, a 1-D state log8 cannot code) skip
    the compression: zstd level 3 shrinks fp32 values by 7.6% at 587 MB/s of one core (``bench
    codecs``); on an fp32 full checkpoint of bench.yaml that made the writer's commit 1.57x a
    plain put of the same bytes (3.28 s against 2.07 s, ``bench upload``) instead of about
    1.0x. Quantized rows hold 8x fewer bytes per row to compress, for 5-13% saved.
    """
    ids = piece.row_ids[lo:hi] if piece.row_ids is not None else None
    start = row0 + lo if ids is None else 0
    block = piece.data[lo:hi]
    check_finite(piece, block, start)
    target = _target(job, piece, search)
    for codec in plan_codecs():
        encoded = codec.encode(block, target)
        if encoded is not None:
            compression = job.plan.compression if codec.compressible else ()
            return encode_chunk(key, piece.name, encoded, start, col0, row_ids=ids, compression=compression)
    raise ValueError(f"no codec stores the rows of {piece.name!r} at {target.bits} bits")
