"""Merging a chain of consecutive increments into a new full baseline, in the background.

With the consecutive policy a restore replays the baseline and every increment since it, and
retention has to keep them all. ``checkpoint.merge_every: N`` makes rank 0 start a merge once N
increments followed the newest baseline: a separate process reads that chain once and writes one
full checkpoint holding, for every row, its newest stored form. Codes, scales and biases are
copied as stored, never re-quantized, so restoring the merged checkpoint gives bit for bit what
replaying the chain gives. Training does not wait for it; only the end of training does
(``Checkpointer.finish``).

The merged checkpoint's id is the id of the increment it stands for plus ``MERGED_SUFFIX`` (see
cnr.format.manifest.merged_id): it sorts right after that increment, chain resolution takes it in place
of that increment and everything before it, and retention can then drop the old chain. Its
manifest is written last, so a merge cut off leaves nothing a restore would read.

Limits: one tensor is merged at a time, held in its stored form (quantized, not fp32; scales and
biases as float32) beside one fetched chunk. A chain whose rows of one tensor were stored at
different bit-widths (after the fallback to 8 bits) is not merged, since that would mean
re-quantizing: the merge fails with that reason and the chain stays as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import time
from typing import Dict, List, Optional, Tuple

import torch

from cnr.codec import array_codec, codec_for_encoding, exact_codec
from cnr.codec.base import ArrayCodec, DecodedValues, MergeRows
from cnr.codec.chunk_format import Compression, encode_chunk
from cnr.format.chunk_coverage import check_coverage
from cnr.errors import CheckpointError
from cnr.format.manifest import Manifest, TensorEntry, manifest_key, manifest_to_bytes, merged_id
from cnr.format.catalog import read_manifest, resolve_chain
from cnr.format.chunks import fetch_chunk, fetch_chunk_bytes
from cnr.policy.retention import retain_checkpoints
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.types import TABLE_ROLES, CheckpointKind, ChunkRef, Encoding, RetentionScope
from cnr.write.job import row_blocks
from cnr.write.puts import Packer, Uploader
from cnr.write.proc import MERGER, die_with_spawner, name_this_process

logger = logging.getLogger(__name__)

_Columns = Tuple[int, int]  # (col_offset, cols) of a column slice of a 2-D tensor; (0, 0) whole


def _encoding_of(refs: List[ChunkRef], name: str) -> Tuple[Encoding, int, str]:
    kinds = sorted({(r.encoding.value, r.bits, r.method) for r in refs})
    raw = (Encoding.RAW.value, 32, "")
    if len(kinds) == 2 and raw in kinds:
        other = kinds[0] if kinds[1] == raw else kinds[1]
        if _codec_of(refs, other).plain:  # e.g. log8 rows a merge stored raw: both decode to exact values
            return Encoding(other[0]), other[1], other[2]
    if len(kinds) != 1:
        raise CheckpointError(f"tensor {name!r} is stored as {kinds} along the chain; merging it would mean "
                              "re-quantizing, so the chain is left as it is")
    encoding, bits, method = kinds[0]
    return Encoding(encoding), bits, method


def _codec_of(refs: List[ChunkRef], kind: Tuple[str, int, str]) -> ArrayCodec:
    """The array codec of the chunks of ``kind`` (encoding, bits, method): the one their chain
    names, or for chunks recorded before codec chains the one of their encoding."""
    for r in refs:
        if (r.encoding.value, r.bits, r.method) == tuple(kind) and r.codecs:
            return array_codec(r.codecs[0].name)
    return codec_for_encoding(Encoding(kind[0]))


def _decoded(chunk) -> DecodedValues:
    return DecodedValues(data=chunk.data, stored=chunk.quantized)


def _merged_rows(storage: Storage, name: str, entry: TensorEntry,
                 links: List[List[ChunkRef]]) -> Tuple[ArrayCodec, MergeRows]:
    """Every row of one column slice: the baseline's, overwritten by each increment in order, and
    the codec to store them with. Chunks are fetched and placed one at a time, so only the merged
    rows stay in memory, in their decoded form (cnr.codec.base.ArrayCodec.merge_rows)."""
    refs = [r for chunks in links for r in chunks]
    encoding, bits, method = _encoding_of(refs, name)
    codec = _codec_of(refs, (encoding.value, bits, method))
    n = entry.shape[0]
    rows: Optional[MergeRows] = None
    covered = torch.zeros(n, dtype=torch.bool)
    for ref in links[0]:
        chunk = _decoded(fetch_chunk(storage, ref, dequantize=False))
        rows = rows or codec.merge_rows(chunk, n, entry.dtype)
        at = slice(ref.row_start, ref.row_start + ref.rows)
        rows.place(at, chunk)
        covered[at] = True
    if rows is None or not bool(covered.all()):
        raise CheckpointError(f"the baseline covers {int(covered.sum())} of {n} rows of {name!r}")
    for chunks in links[1:]:
        for ref in chunks:
            chunk = fetch_chunk(storage, ref, dequantize=False)
            rows.place(chunk.row_ids, _decoded(chunk))
    return codec, rows


def _write_rows(packer: Packer, name: str, codec: ArrayCodec, rows: MergeRows, columns: _Columns, chunk_bytes: int,
                compression: Compression) -> List[ChunkRef]:
    """Encode ``rows`` as contiguous chunks of at most about ``chunk_bytes`` and store them: each
    block re-encoded by ``codec`` so that it decodes to the same values (codes, scales and biases
    copied as stored), else stored exactly (cnr.codec.exact_codec); through ``compression`` when
    the codec storing it is compressible, as the writer stores chunks (cnr.write.plan.encode_block)."""
    col0, _cols = columns
    refs = []
    for lo, hi in row_blocks(rows.rows, rows.row_bytes(), chunk_bytes):
        start = time.time()
        block = rows.block(lo, hi)
        used, encoded = codec, codec.reencode(block)
        if encoded is None:
            if block.data is None:  # a stored form its own codec cannot re-encode: no exact copy possible
                raise CheckpointError(f"merging {name!r}: codec {codec.name!r} cannot re-encode rows {lo}-{hi} "
                                      "it decoded, and they have no plain values to store exactly")
            used = exact_codec()
            encoded = used.encode(block.data)
        blob, ref = encode_chunk("", name, encoded, lo, col0,
                                 compression=compression if used.compressible else ())
        refs.append(packer.add(blob, ref, start, time.time()))  # the packer names its object
    return refs


def _copy_whole(storage: Storage, packer: Packer, entry: TensorEntry) -> List[ChunkRef]:
    """A tensor every checkpoint stores whole (dense state, RNG): the newest link's chunks, copied
    byte for byte into objects of the merged checkpoint."""
    refs = []
    for ref in entry.chunks:
        start = time.time()
        blob = fetch_chunk_bytes(storage, ref)  # verified: the copy must not carry damage
        refs.append(packer.add(blob, ref, start, time.time()))
    return refs


def _by_columns(chunks: Tuple[ChunkRef, ...]) -> Dict[_Columns, List[ChunkRef]]:
    out: Dict[_Columns, List[ChunkRef]] = {}
    for ref in chunks:
        out.setdefault((ref.col_offset, ref.cols), []).append(ref)
    return out


def _merge_table(storage: Storage, packer: Packer, name: str, chain: List[Manifest], chunk_bytes: int,
                 compression: Compression) -> TensorEntry:
    entries = [m.tensors.get(name) for m in chain]
    if any(e is None for e in entries):
        raise CheckpointError(f"tensor {name!r} is missing from a link of the chain")
    per_link = [_by_columns(e.chunks) for e in entries]
    for m, link in zip(chain[1:], per_link[1:]):
        if not set(link) <= set(per_link[0]):
            raise CheckpointError(f"{m.id} splits the columns of {name!r} as {sorted(link)}, its baseline "
                                  f"{chain[0].id} as {sorted(per_link[0])}")
    refs: List[ChunkRef] = []
    for columns, base_chunks in sorted(per_link[0].items()):
        links = [base_chunks] + [link.get(columns, []) for link in per_link[1:]]
        codec, rows = _merged_rows(storage, name, entries[0], links)
        refs += _write_rows(packer, name, codec, rows, columns, chunk_bytes, compression)
    return dataclasses.replace(entries[-1], chunks=tuple(refs))


def merge_chain(storage: Storage, ckpt_id: str, chunk_bytes: int, threads: int = 2,
                compression: Compression = ()) -> Manifest:
    """Write and commit the merged full checkpoint standing for committed increment ``ckpt_id``.

    Chunks are stored as the writer stores them (cnr.write.writer: small ones packed, ``threads``
    concurrent puts, re-encoded ones through ``compression``). Returns its manifest. Raises CheckpointError when ``ckpt_id`` has no chain
    to merge or its chain cannot be merged without re-quantizing; nothing is committed then.
    """
    target = read_manifest(storage, ckpt_id)
    chain = resolve_chain(storage, target)
    if len(chain) < 2:
        raise CheckpointError(f"checkpoint {ckpt_id} restores from one full checkpoint; there is nothing to merge")
    uploader = Uploader(storage, threads)
    try:
        packer = Packer(uploader, merged_id(ckpt_id), 0, chunk_bytes)
        tensors: Dict[str, TensorEntry] = {}
        for name, entry in target.tensors.items():
            if entry.role not in TABLE_ROLES:
                tensors[name] = dataclasses.replace(entry, chunks=tuple(_copy_whole(storage, packer, entry)))
            else:
                tensors[name] = _merge_table(storage, packer, name, chain, chunk_bytes, compression)
        packer.flush()
        uploader.wait()
    finally:
        uploader.close()
    check_coverage(tensors, CheckpointKind.FULL)
    merged = dataclasses.replace(target, id=merged_id(ckpt_id), kind=CheckpointKind.FULL, base=None,
                                 tensors=tensors, created_unix=time.time())
    merged = dataclasses.replace(merged, chain_bytes=(merged.bytes,))
    storage.put(manifest_key(merged.id), manifest_to_bytes(merged))  # the commit: last
    return merged


def merge_main(storage_uri: str, ckpt_id: str, chunk_bytes: int, threads: int, keep_last: int,
               compression: Compression = (), scope: Optional[RetentionScope] = None) -> None:
    """The merge process: merge, commit, run retention (``scope``: the job's, cnr.policy.retention; its
    lineage is the merged chain's); exit 1 with the error logged on failure."""
    die_with_spawner()
    name_this_process(MERGER)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    storage = open_storage(storage_uri)
    try:
        start = time.perf_counter()
        merged = merge_chain(storage, ckpt_id, chunk_bytes, threads, compression)
        logger.info("merged the chain of %s into full checkpoint %s (%d bytes) in %.1f s",
                    ckpt_id, merged.id, merged.bytes, time.perf_counter() - start)
        retain_checkpoints(storage, keep_last, scope or RetentionScope(merged.lineage))
    except Exception as e:  # noqa: BLE001 - reported to the log; the chain stays valid
        logger.error("merging the chain of %s failed; it stays as it is: %s: %s", ckpt_id, type(e).__name__, e)
        raise SystemExit(1) from None
    finally:
        storage.close()


class Merger:
    """Rank 0's background merges: at most one process at a time. A failed merge is logged (the
    merge process names its error, this its exit code); its chain stays valid."""

    def __init__(self, storage_uri: str, chunk_bytes: int, threads: int, keep_last: int,
                 compression: Compression = ()) -> None:
        self._args = (storage_uri, chunk_bytes, threads, keep_last, tuple(compression))
        self._process: Optional[mp.process.BaseProcess] = None
        self._ckpt_id = ""

    def _reap(self) -> None:
        """Forget a finished merge, logging a failure."""
        if self._process is None or self._process.is_alive():
            return
        self._process.join()
        if self._process.exitcode != 0:
            logger.error("the merge of %s ended with exit code %s; its chain stays valid", self._ckpt_id,
                         self._process.exitcode)
        self._process = None

    def start(self, ckpt_id: str, scope: Optional[RetentionScope] = None) -> bool:
        """Start merging the chain of committed ``ckpt_id`` (``scope``: the job's retention scope);
        False if a merge is still running."""
        self._reap()
        if self._process is not None:
            return False
        uri, chunk_bytes, threads, keep_last, compression = self._args
        self._process = mp.get_context("spawn").Process(
            target=merge_main, name="cnr-merge", daemon=True,
            args=(uri, ckpt_id, chunk_bytes, threads, keep_last, compression, scope))
        self._process.start()
        self._ckpt_id = ckpt_id
        logger.info("merging the chain of %s into a new baseline in the background", ckpt_id)
        return True

    def wait(self) -> None:
        """Block until the running merge (if any) ends."""
        if self._process is not None:
            self._process.join()
        self._reap()
