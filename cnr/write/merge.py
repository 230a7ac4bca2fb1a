"""Merging a chain of consecutive increments into a new full baseline (compaction).

With the consecutive policy a restore replays the baseline and every increment since it, and
retention has to keep them all. ``merge_chain`` reads such a chain once and writes one full
checkpoint holding, for every row, its newest stored form. Codes, scales and biases are copied as
stored, never re-quantized, so restoring the merged checkpoint gives bit for bit what replaying the
chain gives. When and where it runs (the job's background worker on ``compact_at_chain_ratio`` or
``merge_every``, or ``python -m cnr compact``), its claim, lease fence and retention are
cnr.write.compact's; training does not wait for it, only the end of training does
(``Checkpointer.finish``).

The merged checkpoint's id is the id of the increment it stands for plus ``MERGED_SUFFIX`` (see
cnr.format.layout.merged_id): it sorts right after that increment, chain resolution takes it in place
of that increment and everything before it, and retention can then drop the old chain. Its
manifest is written last, after every chunk is stored and only while the increment's chain still
resolves, so a merge cut off at any point leaves nothing a restore would read, and a re-run merges
again (or finds the merge committed). A committed merged baseline a re-run finds damaged (a chunk
that fails its check, an object gone) is merged again through the links it stands for, which
retention keeps while it does not verify (cnr.policy.retention), and re-committed.

Limits: one tensor is merged at a time, held in its stored form (quantized, not fp32; scales and
biases as float32) beside one fetched chunk. A chain whose rows of one tensor were stored at
different bit-widths (after the fallback to 8 bits) is not merged, since that would mean
re-quantizing: the merge fails with that reason and the chain stays as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from cnr.codec import array_codec, codec_for_encoding, exact_codec
from cnr.codec.base import ArrayCodec, DecodedValues, MergeRows
from cnr.codec.chunk_format import Compression, encode_chunk
from cnr.format.chunk_coverage import check_coverage
from cnr.errors import CheckpointError, KeyNotFoundError
from cnr.format.documents import Manifest, TensorEntry
from cnr.format.layout import checkpoint_prefix, manifest_key, merged_id
from cnr.format.manifest import manifest_to_bytes
from cnr.format.catalog import damaged_merges, read_manifest, resolve_chain
from cnr.policy.retention import forget_verified, verified
from cnr.format.chunks import fetch_chunk, fetch_chunk_bytes
from cnr.storage.base import Storage
from cnr.types import TABLE_ROLES, CheckpointKind, ChunkRef, Encoding
from cnr.write.faults import maybe_crash
from cnr.write.job import row_blocks
from cnr.write.puts import Packer, Uploader

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
            chunk = fetch_chunk(storage, ref, dequantize=False, tensor_rows=n)  # no id past the table
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


def _merge_tensors(storage: Storage, packer: Packer, target: Manifest, chain: List[Manifest], chunk_bytes: int,
                   compression: Compression) -> Dict[str, TensorEntry]:
    tensors: Dict[str, TensorEntry] = {}
    for name, entry in target.tensors.items():
        if entry.role not in TABLE_ROLES:
            tensors[name] = dataclasses.replace(entry, chunks=tuple(_copy_whole(storage, packer, entry)))
        else:
            tensors[name] = _merge_table(storage, packer, name, chain, chunk_bytes, compression)
            # a kill here leaves some chunks of the merged baseline stored (or in flight), no manifest
            maybe_crash("merge_mid_data", target.step, 0)
    return tensors


def _check_durable(storage: Storage, merged: Manifest) -> None:
    """Every object the just-committed ``merged`` names is in the store, else uncommit it and raise.
    A retention that took the uncommitted merged baseline for dead (cnr.policy.retention: a newer
    full checkpoint committed meanwhile) may have deleted objects before the commit."""
    stored = set(storage.list(checkpoint_prefix(merged.id)))
    missing = sorted({c.key for e in merged.tensors.values() for c in e.chunks} - stored)
    if missing:
        storage.delete(manifest_key(merged.id))
        raise CheckpointError(f"{len(missing)} objects of merged baseline {merged.id} (e.g. {missing[0]}) were "
                              "deleted while it was written (a retention took it for dead); it is not committed")


def merge_chain(storage: Storage, ckpt_id: str, chunk_bytes: int, threads: int = 2,
                compression: Compression = (), fence: Optional[Callable[[], None]] = None) -> Tuple[Manifest, bool]:
    """Write and commit the merged full checkpoint standing for committed increment ``ckpt_id``.

    Chunks are stored as the writer stores them (cnr.write.writer: small ones packed, ``threads``
    concurrent puts, re-encoded ones through ``compression``). ``fence`` is called right before the
    manifest is written and raises to stop the commit (the job's lease, a compactor's claim:
    cnr.write.compact). The commit also needs ``ckpt_id``'s chain to still resolve. Returns the
    merged manifest and whether this call committed it (False: it was committed already, a re-run).
    Raises CheckpointError when ``ckpt_id`` has no chain to merge or it cannot be merged without
    re-quantizing; nothing is committed then. Fault points (cnr.write.faults, at ``ckpt_id``'s step):
    ``merge_before_data``, ``merge_mid_data`` (after each tensor), ``merge_before_commit``.
    """
    skip: Set[str] = set()
    if storage.exists(manifest_key(merged_id(ckpt_id))):
        # committed already: done when it verifies (every chunk read back, once per process, as
        # retention reads it anyway: cnr.policy.retention.verified); damaged, merged again the long way
        if verified(storage, [merged_id(ckpt_id)])[merged_id(ckpt_id)]:
            return read_manifest(storage, merged_id(ckpt_id)), False
        logger.warning("merged baseline %s is committed but damaged; merging again through the links it stands for",
                       merged_id(ckpt_id))
        skip.add(merged_id(ckpt_id))
    target = read_manifest(storage, ckpt_id)
    while True:
        chain = resolve_chain(storage, target, frozenset(skip))
        if len(chain) < 2:
            raise CheckpointError(f"checkpoint {ckpt_id} restores from one full checkpoint; there is nothing to merge")
        try:
            tensors = _write_merged(storage, target, chain, chunk_bytes, threads, compression)
            break
        except (CheckpointError, KeyNotFoundError) as e:
            # an earlier merged baseline is a shortcut, never the only way (as for a restore,
            # cnr.restore.newest): found damaged, merge through the links it stands for instead,
            # or every later merge of this history would fail on it
            damaged = set(damaged_merges(chain, e)) - skip
            if not damaged:
                raise
            logger.warning("merging %s: its merged baseline %s is damaged (%s); merging through the links it "
                           "stands for", ckpt_id, ", ".join(sorted(damaged)), e)
            skip |= damaged
    check_coverage(tensors, CheckpointKind.FULL)
    merged = dataclasses.replace(target, id=merged_id(ckpt_id), kind=CheckpointKind.FULL, base=None,
                                 tensors=tensors, created_unix=time.time())
    merged = dataclasses.replace(merged, chain_bytes=(merged.bytes,))
    maybe_crash("merge_before_commit", target.step, 0)
    if fence is not None:
        fence()
    resolve_chain(storage, read_manifest(storage, ckpt_id), frozenset(skip))  # raises if the chain was deleted meanwhile
    storage.put(manifest_key(merged.id), manifest_to_bytes(merged))  # the commit: last
    forget_verified(storage, merged.id)  # a damaged one it replaced may be cached as such
    _check_durable(storage, merged)
    return merged, True


def _write_merged(storage: Storage, target: Manifest, chain: List[Manifest], chunk_bytes: int, threads: int,
                  compression: Compression) -> Dict[str, TensorEntry]:
    """Store the merged rows of ``chain`` (ending at ``target``) under ``merged_id(target.id)``,
    no manifest; return its tensors. A second call after a failed one overwrites the same keys."""
    maybe_crash("merge_before_data", target.step, 0)
    uploader = Uploader(storage, threads)
    try:
        packer = Packer(uploader, merged_id(target.id), 0, chunk_bytes)
        tensors = _merge_tensors(storage, packer, target, chain, chunk_bytes, compression)
        packer.flush()
        uploader.wait()
    finally:
        uploader.close()
    return tensors

