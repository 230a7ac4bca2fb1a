"""Per-row 1-D k-means with ``2**bits`` centroids: the quantize benchmark's loss reference (the
paper's per-vector k-means). Not a checkpoint codec: its per-row codebooks have no chunk encoding.

A row's values are stored as bit-packed codes and a float32 codebook, ``value = codebook[row, code]``.
A constant row (zero and single-element rows included) round-trips exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

import torch

from cnr.codec.base import StoredRows
from cnr.codec.quant.bitpack import pack, unpack, packed_bytes_per_row
from cnr.codec.quant.quantize import BLOCK_VALUES, checked_input
from cnr.codec.quant.rows import check_bits

ITERS = 15  # Lloyd iterations, as in the paper's per-vector k-means reference


@dataclass(frozen=True)
class KMeansRows(StoredRows):
    """``rows`` rows of ``dim`` values: ``codes`` uint8 ``[rows, packed_bytes_per_row(dim, bits)]``
    (cnr.codec.quant.bitpack's layout) and ``codebook`` float32 ``[rows, 2**bits]``, sorted per row."""

    bits: int
    rows: int
    dim: int
    codes: torch.Tensor
    codebook: torch.Tensor
    method: str = "kmeans"

    @property
    def nbytes(self) -> int:
        """Exact encoded size in bytes: packed codes plus the per-row codebooks."""
        return self.codes.numel() + self.codebook.numel() * self.codebook.element_size()

    def select(self, at: Union[slice, torch.Tensor]) -> "KMeansRows":
        """The rows at ``at``: a slice (views) or int64 local row indexes (copies)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[at] if isinstance(at, slice) else t.index_select(0, at)

        codes = pick(self.codes)
        return KMeansRows(self.bits, codes.shape[0], self.dim, codes, pick(self.codebook))

    def values(self) -> torch.Tensor:
        """float32 ``[rows, dim]``: each code's centroid."""
        return torch.gather(self.codebook, 1, unpack(self.codes, self.bits, self.dim).long())


def _kmeans_block(x: torch.Tensor, bits: int, iters: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row 1-D k-means of block ``x [B, D]``: (codes uint8 [B, D], codebook float32 [B, 2**bits]).

    Centroids start at the row's (k + 0.5) / K quantiles, so they are sorted; Lloyd updates keep
    them sorted in 1-D (a cluster is an interval; an empty one keeps its old centroid, which lies
    between its neighbours'), which lets nearest-centroid assignment be a batched searchsorted on
    the midpoints.
    """
    k = 1 << bits
    rows, dim = x.shape
    pos = ((torch.arange(k, dtype=torch.float64) + 0.5) * dim / k).long().clamp_(max=dim - 1)
    cent = x.sort(1).values[:, pos].contiguous()
    ones = torch.ones_like(x)
    for _ in range(iters):
        assign = torch.searchsorted((cent[:, 1:] + cent[:, :-1]) * 0.5, x)
        sums = torch.zeros_like(cent).scatter_add_(1, assign, x)
        counts = torch.zeros_like(cent).scatter_add_(1, assign, ones)
        cent = torch.where(counts > 0, sums / counts.clamp(min=1.0), cent)
    # A cluster mean of equal values can be off by rounding; constant rows must be exact.
    cent = torch.where((x.amin(1) == x.amax(1)).unsqueeze(1), x[:, :1], cent)
    assign = torch.searchsorted((cent[:, 1:] + cent[:, :-1]) * 0.5, x)
    return assign.to(torch.uint8), cent


def kmeans_rows(x: torch.Tensor, bits: int, *, name: str = "tensor", iters: int = ITERS) -> KMeansRows:
    """K-means codes of float32 ``x [rows, dim]`` at ``bits`` bits per value (one of
    cnr.codec.quant.rows.BITS). Raises ConfigError for bad arguments and rows with nan/inf, as
    cnr.codec.quant.quantize.quantize_rows does (``name`` prefixes the message)."""
    check_bits(bits)
    x, _xmin, _xmax = checked_input(x, name)
    rows, dim = x.shape
    codes = torch.empty((rows, packed_bytes_per_row(dim, bits)), dtype=torch.uint8)
    codebook = torch.empty((rows, 1 << bits), dtype=torch.float32)
    block_rows = max(1, BLOCK_VALUES // dim)  # per-row work; blocks bound the temporaries only
    for start in range(0, rows, block_rows):
        block = x[start:start + block_rows]
        end = start + block.shape[0]
        block_codes, codebook[start:end] = _kmeans_block(block, bits, iters)
        codes[start:end] = pack(block_codes, bits)
    return KMeansRows(bits, rows, dim, codes, codebook)
