"""Bit-vector trackers of the embedding rows each step touched, on every local shard.

torchrec's sharded embedding modules call ``post_lookup_tracker_fn(features, ...)`` right after
the lookup and before the output AlltoAll, with the ids each shard received from the input
AlltoAll. Those ids are local to the shard (row-wise and table-row-wise shards receive
``global row - shard row offset``; table-wise and column-wise shards start at row 0), so the
global row is ``id + row offset``. Data-parallel tables see only the rank's own batch, so their
bits are OR-reduced over ranks before they are read. torchrec has one hook slot per module: cnr's
trackers share it through a dispatcher (cnr.track.hook_slot), and a hook that is not cnr's is refused.

One bit per local row lives in a flat ``uint8`` bitmap (``current``) that the hot path writes.
Named *views* ("checkpoint", "baseline", "publish", ...) accumulate ``current`` when ``fold`` is
called at a snapshot. A snapshot ``capture``s a view: the captured bits are removed from the view
when ``clear`` is asked, and given back by ``release(committed=False)`` if that checkpoint never
commits. So bits are cleared only by a snapshot that captured those rows and committed.
With ``sources`` (``CheckpointOptions(tracker="torchrec")``, cnr.track.torchrec_source) cnr installs no
hook: ``fold`` sets the bits of the rows each source reports, and the rest is the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from cnr.track.app_state import app_tables
from cnr.track.bits import Scratch, set_bits, set_bits_torch
from cnr.track.collectives import all_reduce_host
from cnr.track.hook_slot import TrackerHookError, attach, describe, detach, foreign, holds, occupant, refusal

logger = logging.getLogger(__name__)

DEFAULT_VIEWS = ("checkpoint", "baseline")


@dataclass(frozen=True)
class TrackedTable:
    """One table's local row range on this rank and where its bits start in the flat bitmap.

    ``bit_start`` is a multiple of 8, so the table's bits are a whole-byte slice.
    """

    name: str
    row_offset: int
    rows: int
    bit_start: int
    data_parallel: bool


class RowSource(Protocol):
    """Where ``fold`` takes touched rows from instead of cnr's hook (cnr.track.torchrec_source)."""

    def collect(self, current: np.ndarray) -> None:
        """Set in ``current`` the bits of the rows touched since the last call (a table's bit_start + local id)."""

    def close(self) -> None:
        """Stop the source (idempotent)."""


@dataclass(frozen=True)
class Captured:
    """Bits a snapshot took from a view: given back unless that checkpoint commits."""

    view: str
    bitmap: np.ndarray
    cleared: bool


def checked_row_ids(rows: Union[torch.Tensor, Sequence[int]], size: int, table: str) -> torch.Tensor:
    """``rows`` (global row ids of ``table``, which has ``size`` rows) as a 1-D int64 CPU tensor;
    ValueError names a value that is no row id (not 1-D integers, or outside 0..size-1)."""
    ids = torch.as_tensor(rows)
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"rows must be a 1-D sequence of integer row ids, got {ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64).cpu()
    bad = ids[(ids < 0) | (ids >= size)]
    if bad.numel():
        raise ValueError(f"row {int(bad[0])} of table {table!r} is not allowed; its rows are 0..{size - 1}")
    return ids


def _rows_of(bits: np.ndarray, table: TrackedTable) -> torch.Tensor:
    """Global row ids (int64, ascending) whose bit is set for ``table``."""
    start = table.bit_start // 8
    chunk = bits[start:start + (table.rows + 7) // 8]
    flags = np.unpackbits(chunk, bitorder="little")[: table.rows]
    # this runs in the stall: numpy's nonzero on a bool view is vectorised, 1.3 ms for 3M rows at
    # 25% density on one core, against 4.4 ms for torch's nonzero on 2 cores (and 11 ms per save
    # on 16 of an H100 host's) and 9-15 ms for numpy's on the uint8 flags
    rows = torch.from_numpy(np.flatnonzero(flags.view(np.bool_)))
    return rows.add_(table.row_offset) if table.row_offset else rows


class RowTracker:
    """Tracks touched rows of every embedding shard this rank holds.

    ``app``: a module (taken as ``{"model": module}``) or an app_state dict; its tables are
    keyed by table id (cnr.track.app_state: the stored name of the weight), so any number of embedding
    modules may use the same table names. ``whole``: table ids whose rows can change without a
    lookup; they are left out of ``capture_row_ids`` (stored whole in every checkpoint).
    ``sources``: set before ``install`` to take the rows from them (RowSource) instead of a hook.
    """

    def __init__(self, app: Union[torch.nn.Module, Mapping[str, Any]], views: Sequence[str] = DEFAULT_VIEWS,
                 whole: Iterable[str] = ()) -> None:
        refs = app_tables({"model": app} if isinstance(app, torch.nn.Module) else app)
        self.tables: Dict[str, TrackedTable] = {}
        self._feature_table: Dict[int, Dict[str, str]] = {}  # id(sharded module) -> feature -> table id
        self._modules: Dict[int, torch.nn.Module] = {}
        self._names: Dict[int, str] = {}  # id(sharded module) -> its name in errors ("model/tower.ebc")
        bit = 0
        for ref in refs:
            row_offset, rows, dp = _local_row_range(ref)
            if rows is None:
                continue  # this rank holds no shard of the table
            self.tables[ref.id] = TrackedTable(ref.id, row_offset, rows, bit, dp)
            bit += (rows + 7) // 8 * 8
            self._modules[id(ref.module)] = ref.module
            for feature in ref.module._table_name_to_config[ref.name].feature_names:
                self._feature_table.setdefault(id(ref.module), {})[feature] = ref.id
        for ref in refs:  # modules whose tables are all elsewhere still get the hook (it ignores nothing)
            self._modules.setdefault(id(ref.module), ref.module)
            self._names.setdefault(id(ref.module), ref.id[:ref.id.index("/")] + (f"/{ref.path}" if ref.path else ""))
        self._installed = False
        self._lost: Optional[str] = None  # why rows were missed, once a foreign hook took a slot (sticky)
        self.whole = frozenset(t for t in whole if t in self.tables)
        self.current = np.zeros(bit // 8, dtype=np.uint8)
        self.views: Dict[str, np.ndarray] = {v: np.zeros_like(self.current) for v in views}
        self._device_current: Optional[torch.Tensor] = None  # the bitmap on CUDA, when ids arrive there
        self._bases: Dict[Tuple[int, Tuple[str, ...], int], np.ndarray] = {}
        self._scratch = Scratch()
        self.sources: Tuple[RowSource, ...] = ()

    # ---- hot path ------------------------------------------------------------------------

    def install(self) -> None:
        """Join cnr's dispatcher in the post-lookup hook slot of every sharded embedding module
        (cnr.track.hook_slot): several cnr trackers share the slot. A slot held by a hook that is not
        cnr's raises TrackerHookError naming the module, before any slot is touched. With ``sources``, nothing is
        attached."""
        if self.sources:
            return
        self.check_slots()
        for key, module in self._modules.items():
            attach(module, self._names[key], self)
        self._installed = True

    def check_slots(self) -> None:
        """Raise TrackerHookError when a module's slot holds a hook that is not cnr's."""
        for key, module in self._modules.items():
            fn = foreign(module)
            if fn is not None:
                raise TrackerHookError(refusal(self._names[key], fn))

    def uninstall(self) -> None:
        """Leave every module's slot; the last cnr tracker out empties it. Sources are closed. Idempotent."""
        for source in self.sources:
            source.close()
        for module in self._modules.values():
            detach(module, self)
        self._installed = False

    def _check_installed(self) -> None:
        """Raise when a slot no longer calls this installed tracker (a hook registered after cnr's
        replaced the dispatcher): the rows looked up since were not recorded, so no increment
        may be built from these bits. Sticky: those rows stay unknown."""
        if not self._installed:
            return
        lost = [(key, module) for key, module in self._modules.items() if not holds(module, self)]
        if lost and self._lost is None:
            key, module = lost[0]
            fn = occupant(module)
            now = "emptied" if fn is None else "taken by " + describe(fn)
            self._lost = (f"the post-lookup hook slot of the sharded module {self._names[key]} no longer holds cnr's "
                          f"tracker ({now}); torchrec gives each module one slot and cnr cannot share it with "
                          "another hook, so the rows looked up since were not tracked and a checkpoint built on "
                          "them would miss rows")
        if self._lost is not None:
            raise TrackerHookError(self._lost)

    def record(self, features, _embeddings=None, module=None, _raw_ids=None) -> None:
        """The post-lookup hook: set the bits of every id the shards of ``module`` received."""
        keys = tuple(features.keys())
        values = features.values()
        if not keys or values.numel() == 0:
            return
        lengths = features.lengths()
        base = self._sample_bases(id(module), keys, lengths.numel())  # each sample's table start bit
        if values.is_cuda:
            self._record_cuda(values, lengths, base)
            return
        # ~50k random reads of a cache-cold bitmap per step. Done right here: a helper thread was
        # measured at +12% step time (it preempts OpenMP workers, and every parallel region then
        # waits for the straggler), against ~2% for this synchronous path.
        self._apply(values, lengths, base)

    def _apply(self, values: torch.Tensor, lengths: torch.Tensor, base: np.ndarray) -> None:
        n = values.numel()
        # One id per (feature, sample) slot needs no repeat: as many ids as slots is not enough
        # (lengths 0 and 2 add up the same), so the slots must all hold 1, which, with that
        # total, is max == 1.
        one_each = lengths.numel() == n and int(lengths.max()) == 1
        offsets = base if one_each else np.repeat(base, lengths.numpy())
        ids = self._scratch.ensure(n).ids[:n]
        np.add(values.numpy(), offsets, out=ids)
        set_bits(self.current, ids, self._scratch)

    def _record_cuda(self, values: torch.Tensor, lengths: torch.Tensor, base: np.ndarray) -> None:
        if self._device_current is None:
            self._device_current = torch.zeros(self.current.shape, dtype=torch.uint8, device=values.device)
        offsets = torch.repeat_interleave(torch.from_numpy(base).to(values.device), lengths.to(torch.int64),
                                          output_size=values.numel())
        set_bits_torch(self._device_current, values.to(torch.int64) + offsets)

    def _sample_bases(self, module: int, keys: Tuple[str, ...], samples: int) -> np.ndarray:
        cached = self._bases.get((module, keys, samples))
        if cached is None:
            features = self._feature_table.get(module, {})
            per_key = []
            for key in keys:
                table = self.tables.get(features.get(key, ""))
                if table is None:
                    raise RuntimeError(f"feature {key!r} arrived at a shard this rank does not hold")
                per_key.append(table.bit_start)
            # lengths are key-major: every sample of key 0, then key 1, ...
            cached = np.repeat(np.array(per_key, dtype=np.int64), samples // len(keys))
            self._bases[(module, keys, samples)] = cached
        return cached

    # ---- views ---------------------------------------------------------------------------

    def fold(self) -> None:
        """Merge ``current`` into every view and clear it (call at a snapshot, on every rank).

        Collective when data-parallel tables exist: their bits are OR-reduced over ranks.
        Raises TrackerHookError, before any collective, when an installed tracker lost its slot.
        """
        self._check_installed()
        if self._device_current is not None:
            self.current |= self._device_current.cpu().numpy()
            self._device_current.zero_()
        for source in self.sources:  # before the OR-reduce: a source's data-parallel rows are this rank's
            source.collect(self.current)
        self._reduce_data_parallel()
        for bits in self.views.values():
            bits |= self.current
        self.current.fill(0)

    def _reduce_data_parallel(self) -> None:
        dp = [t for t in self.tables.values() if t.data_parallel]
        if not dp or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        for t in dp:
            part = self.current[t.bit_start // 8:(t.bit_start + t.rows + 7) // 8]
            flags = torch.from_numpy(np.unpackbits(part, bitorder="little"))
            all_reduce_host(flags, op=dist.ReduceOp.MAX)
            part[:] = np.packbits(flags.numpy(), bitorder="little")

    def capture(self, view: str, clear: bool) -> Captured:
        """Take a copy of ``view``'s bits for a snapshot; with ``clear`` the view is emptied."""
        bits = self.views[view]
        if clear:
            self.views[view] = np.zeros_like(bits)
            return Captured(view, bits, True)
        return Captured(view, bits.copy(), False)

    def release(self, captured: Iterable[Captured], committed: bool) -> None:
        """After a checkpoint ends: keep the clears if it committed, else give the bits back."""
        if committed:
            return
        for c in captured:
            if c.cleared:
                self.views[c.view] |= c.bitmap

    def seed(self, view: str, row_ids: Dict[str, torch.Tensor]) -> None:
        """Set ``view``'s bits for global ``row_ids`` per table (those in this rank's row ranges).

        After a resume from an increment, the rows it held were touched since the baseline.
        In numpy, as ``set_bits``: torch's masks on 2 intra-op threads took 0.32 s for a 4-bit
        increment's 756k rows where the cores were shared (an OpenMP barrier waits for a thread
        that is not running), against about 30 ms here.
        """
        for name, ids in row_ids.items():
            table = self.tables.get(name)
            if table is None:
                continue
            rows = ids.detach().cpu().numpy()
            inside = rows[(rows >= table.row_offset) & (rows < table.row_offset + table.rows)]
            set_bits(self.views[view], inside - table.row_offset + table.bit_start)

    def mark(self, table: str, ids: torch.Tensor) -> None:
        """Set the bits of ``table``'s global rows ``ids`` (int64) that lie in this rank's row range,
        as a lookup of them would: rows the application wrote outside a lookup. Others are ignored
        (another rank holds them)."""
        t = self.tables.get(table)
        if t is None:
            return
        inside = ids[(ids >= t.row_offset) & (ids < t.row_offset + t.rows)]
        set_bits(self.current, (inside - t.row_offset + t.bit_start).numpy())

    def row_ids(self, bits: np.ndarray, table: str) -> torch.Tensor:
        """Global ids (ascending) of ``table``'s rows set in ``bits`` (a view or a capture)."""
        return _rows_of(bits, self.tables[table])

    def capture_row_ids(self, bits: np.ndarray) -> Dict[str, torch.Tensor]:
        """Global row ids to store per table for ``bits``; tables in ``whole`` are absent (stored whole)."""
        return {t: _rows_of(bits, table) for t, table in self.tables.items() if t not in self.whole}

    def count(self, bits: np.ndarray) -> int:
        """Number of set bits."""
        return int(np.unpackbits(bits).sum())

    @property
    def nbytes(self) -> int:
        """Host bytes of the hot-path bitmap (``current``): one bit per local row, padded to bytes."""
        return self.current.size

    @property
    def total_nbytes(self) -> int:
        """Host bytes of ``current`` plus every view."""
        return self.current.size * (1 + len(self.views))

    @property
    def buffer_nbytes(self) -> int:
        """Fixed host bytes of set_bits' scratch, sized by the largest step's ids (not per row)."""
        return self._scratch.size * (8 + 8 + 8 + 1 + 1 + 1)

    @property
    def local_rows(self) -> int:
        return sum(t.rows for t in self.tables.values())


def _local_row_range(ref) -> Tuple[int, Optional[int], bool]:
    """(row offset, rows or None if this rank holds none, data parallel) of table ``ref``
    (a cnr.track.app_state.TableRef) on this rank.

    Column-wise shards of a table share a row range; a rank never holds two row ranges of one
    table in torchrec's sharding types, which this checks.
    """
    value = ref.module.state_dict()[ref.local_key]
    if not hasattr(value, "local_shards"):
        return 0, int(value.shape[0]), True
    ranges = {(s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]) for s in value.local_shards()}
    if not ranges:
        return 0, None, False
    if len(ranges) > 1:
        raise RuntimeError(f"table {ref.id!r} has {len(ranges)} row ranges on one rank: {sorted(ranges)}")
    (offset, rows), = ranges
    return offset, rows, False
