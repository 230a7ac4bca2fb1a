"""Block codebook study kernels (cnr.codec.codebook): code range, decoded values are stored
levels, nearest-level coding, exactness on few distinct values, no worse than the float16 uniform
grid, determinism, encoded size and argument checking. Small inputs: the file runs in seconds."""

from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import pytest
import torch

from cnr.codec.codebook import (
    Codebooked,
    codebook_values,
    fit_codebooks,
    fit_normalized_codebooks,
    nbytes,
)

FITS: Dict[str, Callable[..., Codebooked]] = {"plain": fit_codebooks, "normalized": fit_normalized_codebooks}


def _rows(kind: str, rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn((rows, dim), generator=gen)
    if kind == "student_t3":
        chi2 = torch.randn((rows, dim, 3), generator=gen).square().sum(-1)
        return torch.randn((rows, dim), generator=gen) / (chi2 / 3).sqrt()
    if kind == "small":  # torchrec-like init scale
        return (torch.rand((rows, dim), generator=gen) * 2 - 1) * 1e-3
    if kind == "offset":  # rows far from zero, some constant
        x = torch.randn((rows, dim), generator=gen) * 0.1 + 20
        x[::3] = 20.5
        return x
    raise AssertionError(kind)


# (variant, bits, rows, dim, rows_per_block, data)
CASES = [
    ("plain", 2, 50, 64, 16, "normal"),
    ("plain", 3, 37, 5, 10, "student_t3"),
    ("plain", 4, 20, 64, 1, "normal"),
    ("plain", 8, 9, 64, 4, "small"),
    ("plain", 2, 12, 1, 100, "offset"),
    ("normalized", 2, 50, 64, 16, "normal"),
    ("normalized", 3, 37, 5, 10, "student_t3"),
    ("normalized", 4, 20, 64, 3, "small"),
    ("normalized", 8, 9, 64, 4, "normal"),
    ("normalized", 4, 12, 16, 5, "offset"),
]


def _block_of(rows: int, rows_per_block: int) -> torch.Tensor:
    return torch.arange(rows) // rows_per_block


def _candidates(cb: Codebooked) -> torch.Tensor:
    """float64 [rows, 1, 2**bits]: every value a row can decode to, computed independently."""
    block = _block_of(cb.codes.shape[0], cb.rows_per_block)
    lv = cb.levels.float()[block].unsqueeze(1)  # [rows, 1, k]
    if cb.scale is not None:
        lv = lv * cb.scale.float()[:, None, None] + cb.bias.float()[:, None, None]
    return lv.double()


@pytest.mark.parametrize("variant,bits,rows,dim,rpb,data", CASES)
def test_codes_levels_and_nearest(variant: str, bits: int, rows: int, dim: int, rpb: int, data: str) -> None:
    x = _rows(data, rows, dim)
    cb = FITS[variant](x, bits, rpb)
    k = 1 << bits
    assert cb.codes.dtype == torch.uint8 and tuple(cb.codes.shape) == (rows, dim)
    assert int(cb.codes.max()) < k
    assert cb.levels.dtype == torch.float16 and tuple(cb.levels.shape) == (math.ceil(rows / rpb), k)
    assert bool((cb.levels[:, 1:] >= cb.levels[:, :-1]).all()), "levels must be ascending"
    if variant == "normalized":
        assert cb.scale.dtype == cb.bias.dtype == torch.float16 and tuple(cb.scale.shape) == (rows,)
    else:
        assert cb.scale is None and cb.bias is None
    values = codebook_values(cb)
    assert values.dtype == torch.float32 and values.shape == x.shape
    cand = _candidates(cb)
    assert torch.equal(values.double(), cand.expand(-1, dim, -1).gather(2, cb.codes.long()[..., None])[..., 0])
    # every value is the nearest reachable one (float32 rounding of level * scale + bias aside)
    err = (x.double() - values.double()).abs()
    best = (x.double()[..., None] - cand).abs().min(-1).values
    slack = 0.0 if variant == "plain" else 1e-6 * (x.double().abs() + 1e-30)
    assert bool((err <= best + slack).all())


def _distinct_rows(rows: int, dim: int, rpb: int, bits: int) -> torch.Tensor:
    """Blocks of at most 2**bits distinct float16-exact values (a different set per block)."""
    gen = torch.Generator().manual_seed(3)
    k = 1 << bits
    x = torch.empty(rows, dim)
    for b, start in enumerate(range(0, rows, rpb)):
        count = [k, 1, 2, k - 1][b % 4]
        pool = (torch.randn(count, generator=gen) * 4).half().float()
        n = min(rpb, rows - start)
        x[start:start + n] = pool[torch.randint(count, (n, dim), generator=gen)]
    return x


@pytest.mark.parametrize("bits,rows,dim,rpb", [(2, 40, 8, 5), (3, 30, 16, 7), (4, 9, 64, 2), (8, 6, 64, 3)])
def test_plain_exact_with_few_distinct_values(bits: int, rows: int, dim: int, rpb: int) -> None:
    x = _distinct_rows(rows, dim, rpb, bits)
    assert torch.equal(codebook_values(fit_codebooks(x, bits, rpb)), x)


@pytest.mark.parametrize("bits,rpb", [(2, 4), (3, 1), (4, 7)])
def test_normalized_exact_on_shared_pattern(bits: int, rpb: int) -> None:
    """Rows ``a + b * p`` with p from one set of <= 2**bits values in [0, 1] and exact a, b (and
    constant rows) normalise to p exactly, so the shared codebook reproduces them exactly."""
    k = 1 << bits
    gen = torch.Generator().manual_seed(5)
    pattern = torch.linspace(0, 1, k) ** 2
    pattern = pattern.half().float()
    p = pattern[torch.randint(k, (20, 32), generator=gen)]
    p[:, 0], p[:, 1] = 0.0, 1.0  # each row reaches its min and max
    a = torch.randint(-8, 8, (20, 1), generator=gen).float()
    b = torch.randint(1, 5, (20, 1), generator=gen).float()
    x = a + b * p
    x[4] = 2.5  # constant row
    assert torch.equal(codebook_values(fit_normalized_codebooks(x, bits, rpb)), x)


def _uniform_grid_sq_error(x: torch.Tensor, bits: int, rpb: int, cb: Codebooked) -> torch.Tensor:
    """float64 [blocks]: squared error of the float16 uniform grid over each block's min/max
    (for the normalised variant: over the normalised values, with cb's scale and bias)."""
    k = 1 << bits
    xd = x.double()
    if cb.scale is not None:
        s, b = cb.scale.float()[:, None], cb.bias.float()[:, None]
        u = torch.where(s > 0, (x - b) / torch.where(s > 0, s, 1.0), 0.0).double()
    else:
        u = xd
    block = _block_of(x.shape[0], rpb)
    out = []
    for i in range(int(block.max()) + 1):
        ub = u[block == i]
        grid = (ub.min() + (ub.max() - ub.min()) * torch.arange(k, dtype=torch.float64) / (k - 1)).half().double()
        nearest = grid[(ub[..., None] - grid).abs().argmin(-1)]
        if cb.scale is not None:
            nearest = (nearest.float() * cb.scale.float()[block == i, None] + cb.bias.float()[block == i, None]).double()
        out.append((xd[block == i] - nearest).square().sum())
    return torch.stack(out)


def _block_sq_error(x: torch.Tensor, cb: Codebooked) -> torch.Tensor:
    per_row = (x.double() - codebook_values(cb).double()).square().sum(1)
    block = _block_of(x.shape[0], cb.rows_per_block)
    return torch.zeros(int(block.max()) + 1, dtype=torch.float64).index_add_(0, block, per_row)


# (variant, bits, rows_per_block, data, max ratio of total squared error vs the uniform grid)
GRID_CASES = [
    ("plain", 2, 64, "normal", 0.5),
    ("plain", 3, 64, "student_t3", 0.5),
    ("plain", 4, 16, "normal", 0.8),
    ("plain", 4, 64, "small", 1.0),
    ("normalized", 2, 64, "normal", 0.99),
    ("normalized", 3, 16, "student_t3", 0.99),
    ("normalized", 4, 64, "normal", 0.99),
    ("normalized", 4, 64, "offset", 1.0),
]


@pytest.mark.parametrize("variant,bits,rpb,data,max_ratio", GRID_CASES)
def test_no_worse_than_uniform_grid(variant: str, bits: int, rpb: int, data: str, max_ratio: float) -> None:
    """Per block never worse than the float16 uniform grid (Lloyd's best of inits includes it),
    and in total clearly better where the values are not uniform (k-means must have run)."""
    x = _rows(data, 200, 64, seed=1)
    cb = FITS[variant](x, bits, rpb)
    mine, grid = _block_sq_error(x, cb), _uniform_grid_sq_error(x, bits, rpb, cb)
    rtol = 1e-9 if variant == "plain" else 1e-5  # normalised: float32 rounding of level * scale + bias
    assert bool((mine <= grid * (1 + rtol) + 1e-30).all()), (mine / grid).max()
    assert float(mine.sum() / grid.sum()) <= max_ratio


@pytest.mark.parametrize("variant", sorted(FITS))
def test_deterministic_and_thread_independent(variant: str) -> None:
    x = _rows("student_t3", 300, 64, seed=2)
    first = FITS[variant](x, 3, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        second = FITS[variant](x.clone(), 3, 64)
    finally:
        torch.set_num_threads(threads)
    for field in ("levels", "codes", "scale", "bias"):
        a, b = getattr(first, field), getattr(second, field)
        assert (a is None and b is None) or torch.equal(a, b), field


@pytest.mark.parametrize("variant,rows,dim,bits,rpb,expected", [
    ("plain", 10, 64, 2, 4, 10 * 16 + 3 * 4 * 2),
    ("plain", 10, 5, 3, 10, 10 * 2 + 1 * 8 * 2),
    ("plain", 7, 64, 8, 100, 7 * 64 + 1 * 256 * 2),
    ("plain", 0, 64, 4, 3, 0),
    ("normalized", 10, 64, 2, 4, 10 * 16 + 3 * 4 * 2 + 10 * 4),
    ("normalized", 33, 64, 4, 16, 33 * 32 + 3 * 16 * 2 + 33 * 4),
])
def test_nbytes(variant: str, rows: int, dim: int, bits: int, rpb: int, expected: int) -> None:
    cb = FITS[variant](_rows("normal", rows, dim), bits, rpb)
    assert nbytes(cb, dim) == expected
    assert tuple(codebook_values(cb).shape) == (rows, dim)


def _with(value: float) -> torch.Tensor:
    x = torch.randn(6, 4)
    x[3, 2] = value
    return x


BAD: Tuple[Tuple[str, Dict[str, object], str], ...] = (
    ("bits 1", {"bits": 1}, r"bits=1 is not allowed; allowed: 2, 3, 4, 8"),
    ("bits 5", {"bits": 5}, r"bits=5 is not allowed; allowed: 2, 3, 4, 8"),
    ("bits True", {"bits": True}, r"bits=True is not allowed"),
    ("bits str", {"bits": "2"}, r"bits='2' is not allowed"),
    ("rpb 0", {"rows_per_block": 0}, r"rows_per_block=0 is not allowed; it must be an int >= 1"),
    ("rpb -3", {"rows_per_block": -3}, r"rows_per_block=-3 is not allowed"),
    ("rpb float", {"rows_per_block": 2.0}, r"rows_per_block=2.0 is not allowed"),
    ("iters -1", {"iters": -1}, r"iters=-1 is not allowed; it must be an int >= 0"),
    ("float64", {"x": torch.zeros(3, 4, dtype=torch.float64)}, r"torch.float64 \(3, 4\); it must be a 2-D torch.float32"),
    ("float16", {"x": torch.zeros(3, 4, dtype=torch.float16)}, r"torch.float16 .* must be a 2-D torch.float32"),
    ("1-D", {"x": torch.zeros(4)}, r"torch.float32 \(4,\); it must be a 2-D"),
    ("dim 0", {"x": torch.zeros(3, 0)}, r"\(3, 0\); it must be a 2-D torch.float32 tensor \[rows, dim >= 1\]"),
    ("list", {"x": [[1.0]]}, r"x is list; it must be"),
    ("nan", {"x": _with(float("nan"))}, r"x row 3 holds nan; allowed: finite values within \+-32752"),
    ("inf", {"x": _with(float("-inf"))}, r"x row 3 holds -inf; allowed: finite"),
    ("huge", {"x": _with(1e5)}, r"x row 3 holds 100000.0; allowed: finite values within \+-32752"),
)


@pytest.mark.parametrize("variant", sorted(FITS))
@pytest.mark.parametrize("label,override,message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments(variant: str, label: str, override: Dict[str, object], message: str) -> None:
    kwargs: Dict[str, object] = {"x": torch.randn(6, 4), "bits": 2, "rows_per_block": 2, "iters": 5}
    kwargs.update(override)
    with pytest.raises(ValueError, match=message):
        FITS[variant](**kwargs)


def test_the_codebook_benchmark_compares_every_variant_with_adaptive():
    from cnr.bench.codebook import run
    from cnr.errors import ConfigError

    out = run(["--rows", "300", "--dim", "16", "--bits", "2", "--blocks", "64", "300", "--train-steps", "0"])
    methods = {(e["set"], e["method"], e["rows_per_block"]) for e in out["table"]}
    for s in ("normal", "student_t3"):
        assert {(s, "adaptive", None), (s, "naive", None), (s, "plain", 64), (s, "plain", 300),
                (s, "normalized", 64), (s, "normalized", 300)} <= methods
        summary = out["summary"]["2bit"][s]
        # a plain codebook drops the 4 bytes of per-row scale and bias: fewer bytes than adaptive's 8
        assert summary["best_plain"]["bytes_ratio"] < 1 and summary["adaptive"]["bytes_per_row"] == 8.0
    with pytest.raises(ConfigError, match="--train-steps -1"):
        run(["--train-steps", "-1"])
