"""Bit-vector trackers of the embedding rows each step touched, on every local shard.

torchrec's sharded embedding modules call ``post_lookup_tracker_fn(features, ...)`` right after
the lookup and before the output AlltoAll, with the ids each shard received from the input
AlltoAll. Those ids are local to the shard (row-wise and table-row-wise shards receive
``global row - shard row offset``; table-wise and column-wise shards start at row 0), so the
global row is ``id + row offset``. Data-parallel tables see only the rank's own batch, so their
bits are OR-reduced over ranks before they are read.

One bit per local row lives in a flat ``uint8`` bitmap (``current``) that the hot path writes.
Named *views* ("checkpoint", "baseline", "publish", ...) accumulate ``current`` when ``fold`` is
called at a snapshot. A snapshot ``capture``s a view: the captured bits are removed from the view
when ``clear`` is asked, and given back by ``release(committed=False)`` if that checkpoint never
commits. So bits are cleared only by a snapshot that captured those rows and committed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

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


@dataclass(frozen=True)
class Captured:
    """Bits a snapshot took from a view: given back unless that checkpoint commits."""

    view: str
    bits: torch.Tensor
    cleared: bool


def _set_bits(bits: torch.Tensor, ids: torch.Tensor) -> None:
    """OR the bits of ``ids`` into ``bits`` (uint8, little-endian bit order within a byte).

    A scatter with duplicate byte indices keeps one writer's value, so ids sharing a byte with a
    different bit may lose; each pass re-checks and repeats for those (at most 8 passes, since
    every pass sets at least one more bit of each contested byte).
    """
    byte = ids >> 3
    val = torch.bitwise_left_shift(torch.ones_like(ids), ids & 7).to(torch.uint8)
    while byte.numel():
        bits[byte] = bits[byte] | val
        missing = (bits[byte] & val) == 0
        if not bool(missing.any()):
            return
        byte, val = byte[missing], val[missing]


def _rows_of(bits: torch.Tensor, table: TrackedTable) -> torch.Tensor:
    """Global row ids (int64, ascending) whose bit is set for ``table``."""
    start = table.bit_start // 8
    chunk = bits[start:start + (table.rows + 7) // 8].numpy()
    flags = np.unpackbits(chunk, bitorder="little")[: table.rows]
    return torch.from_numpy(np.flatnonzero(flags).astype(np.int64)) + table.row_offset


class RowTracker:
    """Tracks touched rows of every embedding shard this rank holds, for a DMP model."""

    def __init__(self, model: torch.nn.Module, views: Sequence[str] = DEFAULT_VIEWS) -> None:
        self._modules = [m for _, m in model.named_modules() if hasattr(m, "register_post_lookup_tracker_fn")]
        self.tables: Dict[str, TrackedTable] = {}
        self._feature_table: Dict[str, str] = {}
        bit = 0
        for module in self._modules:
            for table, (row_offset, rows, dp) in sorted(_local_row_ranges(module).items()):
                self.tables[table] = TrackedTable(table, row_offset, rows, bit, dp)
                bit += (rows + 7) // 8 * 8
            for table, config in module._table_name_to_config.items():
                for feature in config.feature_names:
                    self._feature_table[feature] = table
        self.num_bits = bit
        self.current = torch.zeros(bit // 8, dtype=torch.uint8)
        self.views: Dict[str, torch.Tensor] = {v: torch.zeros_like(self.current) for v in views}
        self._bases: Dict[Tuple[str, ...], torch.Tensor] = {}
        self._installed = False

    # ---- hot path ------------------------------------------------------------------------

    def install(self) -> None:
        """Register the post-lookup hook on every sharded embedding module (one slot each)."""
        for module in self._modules:
            module.register_post_lookup_tracker_fn(self.record)
        self._installed = True

    def record(self, features, _embeddings=None, _module=None, _raw_ids=None) -> None:
        """The post-lookup hook: set the bits of every id this shard received."""
        keys = tuple(features.keys())
        if not keys:
            return
        base = self._bases.get(keys)
        if base is None:
            base = self._key_bases(keys)
            self._bases[keys] = base
        lengths = features.length_per_key()
        values = features.values()
        if values.numel() == 0:
            return
        flat = values.to(torch.int64).cpu() + torch.repeat_interleave(base, torch.tensor(lengths))
        _set_bits(self.current, flat)

    def _key_bases(self, keys: Tuple[str, ...]) -> torch.Tensor:
        bases = []
        for key in keys:
            table = self.tables.get(self._feature_table.get(key, ""))
            if table is None:
                raise RuntimeError(f"feature {key!r} arrived at a shard this rank does not hold")
            bases.append(table.bit_start)
        return torch.tensor(bases, dtype=torch.int64)

    # ---- views ---------------------------------------------------------------------------

    def fold(self) -> None:
        """Merge ``current`` into every view and clear it (call at a snapshot, on every rank).

        Collective when data-parallel tables exist: their bits are OR-reduced over ranks.
        """
        self._reduce_data_parallel()
        for bits in self.views.values():
            bits |= self.current
        self.current.zero_()

    def _reduce_data_parallel(self) -> None:
        dp = [t for t in self.tables.values() if t.data_parallel]
        if not dp or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        for t in dp:
            part = self.current[t.bit_start // 8:(t.bit_start + t.rows + 7) // 8]
            flags = torch.from_numpy(np.unpackbits(part.numpy(), bitorder="little"))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            part.copy_(torch.from_numpy(np.packbits(flags.numpy(), bitorder="little")))

    def capture(self, view: str, clear: bool) -> Captured:
        """Take a copy of ``view``'s bits for a snapshot; with ``clear`` the view is emptied."""
        bits = self.views[view]
        if clear:
            self.views[view] = torch.zeros_like(bits)
            return Captured(view, bits, True)
        return Captured(view, bits.clone(), False)

    def release(self, captured: Iterable[Captured], committed: bool) -> None:
        """After a checkpoint ends: keep the clears if it committed, else give the bits back."""
        if committed:
            return
        for c in captured:
            if c.cleared:
                self.views[c.view] |= c.bits

    def seed(self, view: str, rows: Dict[str, torch.Tensor]) -> None:
        """Set ``view``'s bits for global ``rows`` per table (those in this rank's row ranges).

        After a resume from an increment, the rows it held were touched since the baseline.
        """
        for name, ids in rows.items():
            table = self.tables.get(name)
            if table is None:
                continue
            inside = ids[(ids >= table.row_offset) & (ids < table.row_offset + table.rows)]
            _set_bits(self.views[view], inside - table.row_offset + table.bit_start)

    def rows(self, bits: torch.Tensor, table: str) -> torch.Tensor:
        """Global ids (ascending) of ``table``'s rows set in ``bits`` (a view or a capture)."""
        return _rows_of(bits, self.tables[table])

    def count(self, bits: torch.Tensor) -> int:
        """Number of set bits."""
        return int(np.unpackbits(bits.numpy()).sum())

    @property
    def nbytes(self) -> int:
        """Host bytes of the hot-path bitmap (``current``): one bit per local row, padded to bytes."""
        return self.current.numel()

    @property
    def total_nbytes(self) -> int:
        """Host bytes of ``current`` plus every view."""
        return self.current.numel() * (1 + len(self.views))

    @property
    def local_rows(self) -> int:
        return sum(t.rows for t in self.tables.values())


def _local_row_ranges(module: torch.nn.Module) -> Dict[str, Tuple[int, int, bool]]:
    """table -> (row offset, rows, data parallel) of the one row range this rank holds.

    Column-wise shards of a table share a row range; a rank never holds two row ranges of one
    table in torchrec's sharding types, which this checks.
    """
    out: Dict[str, Tuple[int, int, bool]] = {}
    for key, value in module.state_dict().items():
        if not key.endswith(".weight"):
            continue
        table = key.split(".")[-2]
        if hasattr(value, "local_shards"):
            ranges = {(s.metadata.shard_offsets[0], s.metadata.shard_sizes[0]) for s in value.local_shards()}
            if not ranges:
                continue
            if len(ranges) > 1:
                raise RuntimeError(f"table {table!r} has {len(ranges)} row ranges on one rank: {sorted(ranges)}")
            (offset, rows), = ranges
            out[table] = (offset, rows, False)
        else:
            out[table] = (0, int(value.shape[0]), True)
    return out


def table_of(tensor_name: str) -> Optional[str]:
    """The table a state tensor belongs to, or None for dense state.

    ``model/...embedding_bags.<t>.weight`` and ``model/...embeddings.<t>.weight`` -> t;
    ``sparse_optim/<t>.<state>`` -> t.
    """
    if tensor_name.startswith("sparse_optim/"):
        return tensor_name[len("sparse_optim/"):].split(".")[0]
    if tensor_name.startswith("model/") and tensor_name.endswith(".weight"):
        parts = tensor_name.split(".")
        if len(parts) >= 3 and parts[-3] in ("embedding_bags", "embeddings"):
            return parts[-2]
    return None

