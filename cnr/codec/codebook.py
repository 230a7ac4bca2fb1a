"""Study kernels: non-uniform codebooks shared by blocks of rows (Inshrinkerator §4.4's idea).

Not a registered codec. Two variants, both ``2**bits`` float16 levels per block of
``rows_per_block`` consecutive rows (the last block may be shorter):

* plain (:func:`fit_codebooks`): ``value = levels[block, code]``; no per-row parameters.
* normalised (:func:`fit_normalized_codebooks`): per row float16 ``bias = min`` and
  ``scale = max - bias``; ``value = levels[block, code] * scale + bias``, the levels fitted to
  ``u = (x - bias) / scale`` (in [0, 1] up to rounding), k-means weighted by ``scale**2`` so that
  it minimises the squared error in x's units, not u's.

Fit per block: Lloyd's k-means on the block's sorted values (cluster sums from float64 prefix
sums, so an iteration costs O(blocks * levels * log n)), run from two inits (quantiles and the
uniform grid over the block's min/max); of those two results and the plain uniform grid, the
block keeps the one with the least squared error after rounding to float16. So a block's error
never exceeds that of the float16 uniform grid over its min/max, and a block with at most
``2**bits`` distinct values gets exactly those (error 0 where they are float16 numbers).
Codes are the nearest stored level (ties to the upper). Deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from cnr.codec.quant.bitpack import packed_bytes_per_row
from cnr.errors import ConfigError

BITS: Tuple[int, ...] = (2, 3, 4, 8)
# Lloyd iterations per init. Measured, 100k N(0,1) rows x 64, 4-bit plain, 256-row blocks, mean
# l2 per row after 20/50/100/200/400: 0.8145/0.7727/0.7667/0.7662/0.7662 (2/3-bit: flat from 50);
# an iteration costs ~15 ms at 391 blocks, ~0.5 ms at 2 (fit ~1.8 s, mostly sorting).
ITERS = 100
MAX_ABS = 32752.0  # half float16's max, so levels, scale (max - min) and bias all fit float16


class CodebookError(ConfigError, ValueError):
    """A bad argument to a codebook kernel; the message names the value and what is allowed."""


@dataclass(frozen=True)
class Codebooked:
    """Rows coded against per-block codebooks.

    ``levels``: float16 ``[blocks, 2**bits]``, ascending; ``codes``: uint8 ``[rows, dim]``, each
    ``< 2**bits``, unpacked. ``scale``/``bias``: float16 ``[rows]`` for the normalised variant,
    None for the plain one.
    """

    bits: int
    rows_per_block: int
    levels: torch.Tensor
    codes: torch.Tensor
    scale: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None


def _check(x: object, bits: object, rows_per_block: object, iters: object) -> torch.Tensor:
    if isinstance(bits, bool) or bits not in BITS:
        raise CodebookError(f"bits={bits!r} is not allowed; allowed: {', '.join(map(str, BITS))}")
    for label, value, low in (("rows_per_block", rows_per_block, 1), ("iters", iters, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CodebookError(f"{label}={value!r} is not allowed; it must be an int >= {low}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] < 1:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise CodebookError(f"x is {got}; it must be a 2-D torch.float32 tensor [rows, dim >= 1]")
    bad = ~(x.abs() <= MAX_ABS)  # also true for nan
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise CodebookError(f"x row {row} holds {x[row][bad[row]][0].item()!r}; allowed: finite "
                            f"values within +-{MAX_ABS}")
    return x.detach().contiguous()


def _blocks(n: int, size: int) -> List[Tuple[int, int]]:
    """(start, count) of row ranges whose blocks all hold ``size`` rows (the tail its own)."""
    full = n // size * size
    return [(s, c) for s, c in ((0, full // size), (full, 1 if n > full else 0)) if c]


def _cluster(sv: torch.Tensor, cum: torch.Tensor, levels: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Per level, (weight, weighted sum, weighted sum of squares) of the sorted values ``sv``
    [B, n] nearest to it; ``cum`` [3, B, n + 1] holds their prefix sums."""
    mids = (levels[:, 1:] + levels[:, :-1]) * 0.5
    edge = torch.searchsorted(sv, mids)
    edge = torch.cat([torch.zeros_like(edge[:, :1]), edge, torch.full_like(edge[:, :1], sv.shape[1])], 1)
    at = cum.gather(2, edge.expand(3, -1, -1))
    return tuple(at[:, :, 1:] - at[:, :, :-1])


def _sq_error(sv: torch.Tensor, cum: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    w, s1, s2 = _cluster(sv, cum, levels)
    return (s2 - 2 * levels * s1 + levels * levels * w).sum(1)


def _fit(v: torch.Tensor, w: Optional[torch.Tensor], k: int, iters: int) -> torch.Tensor:
    """float16 [B, k] ascending levels for the values ``v`` [B, n] (weights ``w`` or 1)."""
    sv, order = v.double().sort(dim=1, stable=True)
    w = torch.ones_like(sv) if w is None else w.double().gather(1, order)
    cum = torch.stack([w, w * sv, w * sv * sv]).cumsum(2)  # float64 [3, B, n]
    cum = torch.cat([torch.zeros_like(cum[:, :, :1]), cum], 2)
    lo, hi, grid = sv[:, :1], sv[:, -1:], torch.arange(k, dtype=torch.float64)
    uniform = lo + (hi - lo) * grid / (k - 1)
    at = torch.searchsorted(cum[0, :, 1:].contiguous(), cum[0, :, -1:] * (grid + 0.5) / k)
    quantile = sv.gather(1, at.clamp(max=sv.shape[1] - 1))
    found = []
    for levels in (quantile, uniform):
        for _ in range(iters):
            cw, cs, _ = _cluster(sv, cum, levels)
            levels = torch.where(cw > 0, cs / cw.clamp(min=1e-300), levels)
        found.append(levels)
    found = [c.half().double().sort(1).values for c in found + [uniform]]
    err = torch.stack([_sq_error(sv, cum, c) for c in found])
    best = torch.stack(found).gather(0, err.argmin(0)[None, :, None].expand(1, -1, k))[0]
    # at most k distinct values: take them (their rank among the distinct values is the slot)
    new = torch.cat([torch.ones_like(sv[:, :1], dtype=torch.bool), sv[:, 1:] != sv[:, :-1]], 1)
    rank = new.cumsum(1) - 1
    few = rank[:, -1] < k
    distinct = hi.expand(-1, k).clone().scatter_(1, rank.clamp(max=k - 1), sv)
    best = torch.where(few[:, None], distinct, best)
    return best.half().sort(1).values


def _code(v: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """uint8 index of the nearest float16 level (ties to the upper) for values ``v`` [B, n]."""
    lv = levels.double()
    return torch.searchsorted((lv[:, 1:] + lv[:, :-1]) * 0.5, v.double(), right=True).to(torch.uint8)


def _run(x: torch.Tensor, u: torch.Tensor, w: Optional[torch.Tensor], bits: int,
         rows_per_block: int, iters: int) -> Tuple[torch.Tensor, torch.Tensor]:
    rows, dim = x.shape
    k = 1 << bits
    levels, codes = [torch.empty((0, k), dtype=torch.float16)], torch.empty((rows, dim), dtype=torch.uint8)
    for start, count in _blocks(rows, rows_per_block):
        n = min(rows_per_block, rows - start)
        end = start + count * n
        vb = u[start:end].reshape(count, n * dim)
        wb = None if w is None else w[start:end].reshape(count, n * dim)
        lv = _fit(vb, wb, k, iters)
        codes[start:end] = _code(vb, lv).view(-1, dim)
        levels.append(lv)
    return torch.cat(levels), codes


def fit_codebooks(x: torch.Tensor, bits: int, rows_per_block: int, iters: int = ITERS) -> Codebooked:
    """Plain variant: one float16 codebook of ``2**bits`` levels per block of float32 ``x [rows, dim]``."""
    x = _check(x, bits, rows_per_block, iters)
    levels, codes = _run(x, x, None, bits, rows_per_block, iters)
    return Codebooked(bits, rows_per_block, levels, codes)


def fit_normalized_codebooks(x: torch.Tensor, bits: int, rows_per_block: int, iters: int = ITERS) -> Codebooked:
    """Normalised variant: per-row float16 min/range, a shared codebook per block over [0, 1]."""
    x = _check(x, bits, rows_per_block, iters)
    bias = x.amin(1).half() if x.numel() else x.new_zeros(0, dtype=torch.float16)
    scale = (x.amax(1) - bias.float()).half() if x.numel() else bias.clone()
    s = scale.float()[:, None]
    u = torch.where(s > 0, (x - bias.float()[:, None]) / torch.where(s > 0, s, 1.0), 0.0)
    levels, codes = _run(x, u, (s * s).expand_as(x), bits, rows_per_block, iters)
    return Codebooked(bits, rows_per_block, levels, codes, scale, bias)


def codebook_values(cb: Codebooked) -> torch.Tensor:
    """float32 ``[rows, dim]`` decoded values: exactly a stored level (times scale, plus bias)."""
    rows, dim = cb.codes.shape
    block = (torch.arange(rows) // cb.rows_per_block)[:, None]
    out = cb.levels.float()[block, cb.codes.long()]
    if cb.scale is not None:
        out = out * cb.scale.float()[:, None] + cb.bias.float()[:, None]
    return out


def nbytes(cb: Codebooked, dim: int) -> int:
    """Encoded bytes: bit-packed codes, float16 levels, and float16 scale + bias if normalised."""
    extra = 0 if cb.scale is None else 4 * cb.codes.shape[0]
    return cb.codes.shape[0] * packed_bytes_per_row(dim, cb.bits) + 2 * cb.levels.numel() + extra
