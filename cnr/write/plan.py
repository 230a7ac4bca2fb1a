"""How the writer stores each piece of a checkpoint: its bit-width, its codec chain, and the
finiteness check every block passes first. Pure functions of the job and the piece (the job is
a cnr.write.writer.WriteJob), run in the writer process, never in the stall."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, Mapping, Optional, Tuple

import torch

from cnr.codec.log8 import log8_applies
from cnr.codec.chunk_format import encode_log8_chunk, encode_quantized_chunk, encode_raw_chunk
from cnr.errors import NONFINITE, NonFiniteStateError
from cnr.codec.quant.quantize import quantize_rows, stored_method
from cnr.codec.quant.range_search import Fused
from cnr.track.snapshot import HostPiece
from cnr.types import TABLE_ROLES, ChunkRef, Role

if TYPE_CHECKING:  # cnr.write.writer imports this module
    from cnr.write.writer import WriteJob


def resolve_table_bits(table_bits: Mapping[str, int], tables: Iterable[Tuple[str, str]]) -> Dict[str, int]:
    """``table_bits`` keyed by table id. ``tables``: every table's (id, torchrec name). A key is a
    table's id, or the torchrec name of exactly one table; raises ValueError naming a key that
    matches no table or several."""
    tables = list(tables)
    out: Dict[str, int] = {}
    for key, bits in table_bits.items():
        ids = [i for i, name in tables if key == i] or [i for i, name in tables if key == name]
        if len(ids) != 1:
            what = "matches no table" if not ids else f"names {len(ids)} tables ({', '.join(sorted(ids))}); give the id"
            raise ValueError(f"table_bits key {key!r} {what}; tables: {', '.join(i for i, _ in tables)}")
        out[ids[0]] = bits
    return out


def quantized_bits(job: "WriteJob", piece: HostPiece) -> int:
    """Bit-width ``piece`` is stored at: table weights at ``job.table_bits[table]`` when the
    table has an entry, else at ``job.bits``, or at least ``job.small_table_bits`` for a table
    of at most ``job.small_table_rows`` rows; fused optimizer state (2-D row-wise quantized,
    1-D row-wise on cnr.codec.log8's grid) at ``job.optimizer_bits``; everything else (dense
    state) at 32."""
    if piece.data.dtype != torch.float32 or piece.role not in TABLE_ROLES:
        return 32
    if piece.role == Role.TABLE_STATE and piece.data.dim() in (1, 2):
        return job.optimizer_bits
    if piece.data.dim() != 2:
        return 32
    if piece.table in job.table_bits:
        return job.table_bits[piece.table]
    if piece.global_shape[0] <= job.small_table_rows:
        return max(job.bits, job.small_table_bits)
    return job.bits


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


def searched_rows(job: "WriteJob") -> int:
    """Rows of ``job`` that the adaptive quantizer's range search will encode (cnr.codec.quant.range_search)."""
    total = 0
    for piece in job.pieces:
        bits = quantized_bits(job, piece)
        if bits != 32 and piece.data.dim() == 2 and stored_method(bits, job.bits, job.method) == "adaptive":
            total += piece.data.shape[0]
    return total


def encode_block(job: "WriteJob", piece: HostPiece, key: str, lo: int, hi: int, row0: int,
                 col0: int, search: Optional[Fused] = None) -> Tuple[bytes, ChunkRef]:
    """One chunk of rows ``lo..hi-1`` of ``piece``: row-wise quantized or log8 (see
    quantized_bits), then through the job's compression; or raw, exact and uncompressed.
    ``search``: the adaptive search's compiled kernels (cnr.codec.quant.range_search), or None for the eager ones.

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
    bits = quantized_bits(job, piece)
    if bits != 32 and block.dim() == 2:
        q = quantize_rows(block, bits, method=stored_method(bits, job.bits, job.method), name=piece.name, search=search)
        return encode_quantized_chunk(key, piece.name, q, start, col0, row_ids=ids, compression=job.compression)
    if bits != 32 and log8_applies(block):  # a 1-D state with negative values stays raw, exact
        return encode_log8_chunk(key, piece.name, block, start, col0, row_ids=ids, compression=job.compression)
    return encode_raw_chunk(key, piece.name, block, start, col0, row_ids=ids)
