"""Merging a chain of consecutive increments into a new full baseline, in the background.

With the consecutive policy a restore replays the baseline and every increment since it, and
retention has to keep them all. ``checkpoint.merge_every: N`` makes rank 0 start a merge once N
increments followed the newest baseline: a separate process reads that chain once and writes one
full checkpoint holding, for every row, its newest stored form. Codes, scales and biases are
copied as stored, never re-quantized, so restoring the merged checkpoint gives bit for bit what
replaying the chain gives. Training does not wait for it.

The merged checkpoint's id is the id of the increment it stands for plus ``MERGED_SUFFIX`` (see
cnr.manifest.merged_id): it sorts right after that increment, chain resolution takes it in place
of that increment and everything before it, and retention can then drop the old chain. Its
manifest is written last, so a merge cut off leaves nothing a restore would read.

Limits: one tensor is merged at a time, holding its chunks as fetched and the merged rows (about
twice its stored size, quantized, not fp32); a
chain whose rows of one tensor were stored at different bit-widths (after the fallback to 8
bits) is not merged, since that would mean re-quantizing: the merge fails with that reason and
the chain stays as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from cnr.commit import check_coverage
from cnr.encode import DTYPES, DecodedChunk, decode_chunk, encode_quantized_chunk, encode_raw_chunk
from cnr.errors import CheckpointError
from cnr.manifest import (Manifest, TensorEntry, chunk_key, manifest_key, manifest_to_bytes, merged_id,
                          read_manifest, resolve_chain)
from cnr.quantize import QuantizedRows
from cnr.retention import retain_checkpoints
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.tracker import table_of
from cnr.types import ByteRange, CheckpointKind, ChunkRef, Encoding

logger = logging.getLogger(__name__)

_Columns = Tuple[int, int]  # (col_offset, cols) of a column slice of a 2-D tensor; (0, 0) whole


class _Sink:
    """Writes the merged checkpoint's chunks, one object each, and names their keys."""

    def __init__(self, storage: Storage, ckpt_id: str) -> None:
        self.storage = storage
        self.ckpt_id = ckpt_id
        self.objects = 0
        self.bytes = 0

    def next_key(self) -> str:
        self.objects += 1
        return chunk_key(self.ckpt_id, 0, self.objects - 1)

    def put(self, key: str, blob: bytes) -> None:
        self.storage.put(key, blob)
        self.bytes += len(blob)


@dataclass
class _Rows:
    """One column slice of a tensor, every row in its stored form: raw ``data``, or ``codes``,
    ``scale`` and ``bias`` of a uniform quantizer with ``bits``/``method``."""

    data: Optional[torch.Tensor] = None
    codes: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    bits: int = 32
    method: str = ""


def _fetch(storage: Storage, ref: ChunkRef) -> DecodedChunk:
    return decode_chunk(storage.get(ref.key, ByteRange(ref.offset, ref.nbytes)), ref, dequantize=False)


def _encoding_of(refs: List[ChunkRef], name: str) -> Tuple[Encoding, int, str]:
    kinds = sorted({(r.encoding.value, r.bits, r.method) for r in refs})
    if len(kinds) != 1:
        raise CheckpointError(f"tensor {name!r} is stored as {kinds} along the chain; merging it would mean "
                              "re-quantizing, so the chain is left as it is")
    encoding, bits, method = kinds[0]
    return Encoding(encoding), bits, method


def _widest(a: Optional[torch.dtype], b: torch.dtype) -> torch.dtype:
    # float16 scales widen to float32 exactly; a chain may mix them (cnr.quantize picks per chunk)
    return b if a is None or a == b else torch.float32


def _place(rows: _Rows, chunk: DecodedChunk, at) -> None:
    """Write ``chunk``'s rows at ``at`` (a slice for a contiguous chunk, ids for a listed one)."""
    if chunk.quantized is None:
        rows.data[at] = chunk.data
        return
    q = chunk.quantized
    rows.codes[at] = q.codes
    rows.scale[at] = q.scale.to(rows.scale.dtype)
    rows.bias[at] = q.bias.to(rows.bias.dtype)


def _merged_rows(storage: Storage, name: str, entry: TensorEntry, links: List[List[ChunkRef]]) -> _Rows:
    """Every row of one column slice: the baseline's, overwritten by each increment in order."""
    refs = [r for chunks in links for r in chunks]
    encoding, bits, method = _encoding_of(refs, name)
    decoded = [[_fetch(storage, r) for r in chunks] for chunks in links]
    n = entry.shape[0]
    if encoding == Encoding.RAW:
        row_shape = tuple(decoded[0][0].data.shape[1:])
        rows = _Rows(data=torch.empty((n,) + row_shape, dtype=DTYPES[entry.dtype]), bits=bits)
    else:
        qs = [c.quantized for chunks in decoded for c in chunks]
        scale_dtype = bias_dtype = None
        for q in qs:
            scale_dtype, bias_dtype = _widest(scale_dtype, q.scale.dtype), _widest(bias_dtype, q.bias.dtype)
        rows = _Rows(codes=torch.empty((n, qs[0].codes.shape[1]), dtype=torch.uint8),
                     scale=torch.empty(n, dtype=scale_dtype), bias=torch.empty(n, dtype=bias_dtype),
                     bits=bits, method=method)
    covered = torch.zeros(n, dtype=torch.bool)
    for chunk in decoded[0]:
        at = slice(chunk.ref.row_start, chunk.ref.row_start + chunk.ref.rows)
        _place(rows, chunk, at)
        covered[at] = True
    if not bool(covered.all()):
        raise CheckpointError(f"the baseline covers {int(covered.sum())} of {n} rows of {name!r}")
    for chunks in decoded[1:]:
        for chunk in chunks:
            _place(rows, chunk, chunk.row_ids)
    return rows


def _write_rows(sink: _Sink, name: str, rows: _Rows, columns: _Columns, chunk_bytes: int) -> List[ChunkRef]:
    """Encode ``rows`` as contiguous chunks of at most about ``chunk_bytes`` and store them."""
    col0, cols = columns
    if rows.data is not None:
        n, row_bytes = rows.data.shape[0], max(1, rows.data[:1].numel() * rows.data.element_size())
    else:
        n, row_bytes = rows.codes.shape[0], rows.codes.shape[1] + rows.scale.element_size() + rows.bias.element_size()
    step = max(1, chunk_bytes // row_bytes)
    refs = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        key = sink.next_key()
        if rows.data is not None:
            blob, ref = encode_raw_chunk(key, name, rows.data[lo:hi], lo, col0)
        else:
            q = QuantizedRows(bits=rows.bits, method=rows.method, rows=hi - lo, dim=cols,
                              codes=rows.codes[lo:hi], scale=rows.scale[lo:hi], bias=rows.bias[lo:hi])
            blob, ref = encode_quantized_chunk(key, name, q, lo, col0)
        sink.put(key, blob)
        refs.append(ref)
    return refs


def _copy_whole(storage: Storage, sink: _Sink, entry: TensorEntry) -> List[ChunkRef]:
    """A tensor every checkpoint stores whole (dense state, RNG): the newest link's chunks, copied
    byte for byte into objects of the merged checkpoint."""
    refs = []
    for ref in entry.chunks:
        blob = storage.get(ref.key, ByteRange(ref.offset, ref.nbytes))
        key = sink.next_key()
        sink.put(key, blob)
        refs.append(dataclasses.replace(ref, key=key, offset=0))
    return refs


def _by_columns(chunks: Tuple[ChunkRef, ...]) -> Dict[_Columns, List[ChunkRef]]:
    out: Dict[_Columns, List[ChunkRef]] = {}
    for ref in chunks:
        out.setdefault((ref.col_offset, ref.cols), []).append(ref)
    return out


def _merge_table(storage: Storage, sink: _Sink, name: str, chain: List[Manifest], chunk_bytes: int) -> TensorEntry:
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
        rows = _merged_rows(storage, name, entries[0], links)
        refs += _write_rows(sink, name, rows, columns, chunk_bytes)
    head = entries[-1]
    return TensorEntry(head.shape, head.dtype, head.replicated, tuple(refs))


def merge_chain(storage: Storage, ckpt_id: str, chunk_bytes: int) -> Manifest:
    """Write and commit the merged full checkpoint standing for committed increment ``ckpt_id``.

    Returns its manifest. Raises CheckpointError when ``ckpt_id`` has no chain to merge or its
    chain cannot be merged without re-quantizing; nothing is committed then.
    """
    target = read_manifest(storage, ckpt_id)
    chain = resolve_chain(storage, target)
    if len(chain) < 2:
        raise CheckpointError(f"checkpoint {ckpt_id} restores from one full checkpoint; there is nothing to merge")
    sink = _Sink(storage, merged_id(ckpt_id))
    tensors: Dict[str, TensorEntry] = {}
    for name, entry in target.tensors.items():
        if table_of(name) is None:
            tensors[name] = TensorEntry(entry.shape, entry.dtype, entry.replicated, tuple(_copy_whole(storage, sink, entry)))
        else:
            tensors[name] = _merge_table(storage, sink, name, chain, chunk_bytes)
    check_coverage(tensors, CheckpointKind.FULL)
    merged = dataclasses.replace(target, id=sink.ckpt_id, kind=CheckpointKind.FULL, base=None, tensors=tensors,
                                 created_unix=time.time(), chain_bytes=(sum(c.nbytes for t in tensors.values() for c in t.chunks),))
    storage.put(manifest_key(merged.id), manifest_to_bytes(merged))  # the commit: last
    return merged


def merge_main(storage_uri: str, ckpt_id: str, chunk_bytes: int, keep_last: int) -> None:
    """The merge process: merge, commit, run retention; exit 1 with the error logged on failure."""
    from cnr.upload import die_with_parent

    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    storage = open_storage(storage_uri)
    try:
        start = time.perf_counter()
        merged = merge_chain(storage, ckpt_id, chunk_bytes)
        logger.info("merged the chain of %s into full checkpoint %s (%d bytes) in %.1f s",
                    ckpt_id, merged.id, merged.bytes, time.perf_counter() - start)
        retain_checkpoints(storage, keep_last)
    except Exception as e:  # noqa: BLE001 - reported to the log; the chain stays valid
        logger.error("merging the chain of %s failed; it stays as it is: %s: %s", ckpt_id, type(e).__name__, e)
        raise SystemExit(1) from None
    finally:
        storage.close()


class Merger:
    """Rank 0's background merges: at most one process at a time."""

    def __init__(self, storage_uri: str, chunk_bytes: int, keep_last: int) -> None:
        self.storage_uri = storage_uri
        self.chunk_bytes = chunk_bytes
        self.keep_last = keep_last
        self._process: Optional[mp.process.BaseProcess] = None
        self._ckpt_id = ""
        self.started: List[str] = []
        self.failed: List[str] = []

    @property
    def running(self) -> bool:
        """Whether a merge process is still at work (does not reap it; see ``poll``)."""
        return self._process is not None and self._process.is_alive()

    def poll(self) -> None:
        """Reap a finished merge and record its outcome."""
        if self._process is None or self._process.is_alive():
            return
        self._process.join()
        if self._process.exitcode != 0:
            self.failed.append(self._ckpt_id)
            logger.error("the merge of %s ended with exit code %s; its chain stays valid", self._ckpt_id,
                         self._process.exitcode)
        self._process = None

    def start(self, ckpt_id: str) -> bool:
        """Start merging the chain of committed ``ckpt_id``; False if a merge is still running."""
        self.poll()
        if self._process is not None:
            return False
        ctx = mp.get_context("spawn")
        self._process = ctx.Process(target=merge_main, name="cnr-merge", daemon=True,
                                    args=(self.storage_uri, ckpt_id, self.chunk_bytes, self.keep_last))
        self._process.start()
        self._ckpt_id = ckpt_id
        self.started.append(ckpt_id)
        logger.info("merging the chain of %s into a new baseline in the background", ckpt_id)
        return True

    def wait(self) -> None:
        """Block until the running merge (if any) ends."""
        if self._process is not None:
            self._process.join()
        self.poll()
