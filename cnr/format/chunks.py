"""Reading one stored chunk back by its reference: a ranged read of its object, verified and decoded.

Every reader of chunks (restore, verify, merge, the subscriber) goes through here, so a truncated
or replaced object is always reported as a damaged chunk (CorruptChunkError).
"""

from __future__ import annotations

from typing import Optional

from cnr.codec.chunk_format import DecodedChunk, decode_chunk
from cnr.errors import CorruptChunkError, InvalidKeyError
from cnr.storage.base import Storage, from_sources
from cnr.types import ByteRange, ChunkRef


def read_range(storage: Storage, key: str, byte_range: ByteRange) -> bytes:
    """``byte_range`` of ``key``. The range comes from a sealed manifest, so an object that does
    not hold it was truncated or replaced: that is a damaged chunk (CorruptChunkError, which a
    restore falls back past), not a storage failure."""
    try:
        return storage.get(key, byte_range)
    except InvalidKeyError as e:
        raise CorruptChunkError(f"chunk object {key!r} does not hold the bytes its manifest names "
                                f"(truncated or replaced): {e}") from e


def fetch_chunk(storage: Storage, ref: ChunkRef, dequantize: bool = True,
                tensor_rows: Optional[int] = None) -> DecodedChunk:
    """One chunk, fetched with a ranged read of its bytes in its object, verified and decoded
    (quantized rows kept as codes unless ``dequantize``; ``tensor_rows``: the rows of its
    tensor, which no row id it lists may pass, cnr.codec.chunk_format.decode_chunk)."""
    return from_sources(storage, ref.key, lambda source: decode_chunk(
        read_range(source, ref.key, ByteRange(ref.offset, ref.nbytes)), ref, dequantize=dequantize,
        tensor_rows=tensor_rows))


def fetch_chunk_bytes(storage: Storage, ref: ChunkRef) -> bytes:
    """One chunk's stored bytes, verified (decoded) before they are handed out: a copy (cnr.write.merge)
    must not carry a damaged chunk, or bytes damaged on their way, into a new checkpoint."""
    def read(source: Storage) -> bytes:
        blob = read_range(source, ref.key, ByteRange(ref.offset, ref.nbytes))
        decode_chunk(blob, ref, dequantize=False)
        return blob

    return from_sources(storage, ref.key, read)
