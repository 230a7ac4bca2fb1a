"""Row-wise quantization: error bounds, the adaptive search against torch's reference, edge rows,
encoded size and argument checking. Row counts are small so the whole file runs in seconds."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import pytest
import torch

from cnr.codec.quant.bitpack import packed_bytes_per_row
import cnr.codec.quant.quantize as quantize
from cnr.errors import ConfigError
from cnr.types import STORED_QUANT_METHODS
from cnr.codec.quant.quantize import (
    BITS,
    DEFAULT_NUM_BINS,
    DEFAULT_RATIO,
    METHODS,
    QuantizedRows,
    default_method,
    dequantize_rows,
    l2_per_row,
    quantize_rows,
    quantize_rows_with_dtypes,
    quantize_serving_rows,
)

F16, F32 = torch.float16, torch.float32


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    """Correctness needs no intra-op threads, and on a busy shared 2-core machine lockstep
    threads stall for whole scheduler slices; test_thread_count_does_not_change_the_result
    covers the default thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(kind: str, n: int = 800, dim: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, dim, generator=gen)
    if kind == "student_t":  # heavy tails: a few large elements per row
        z = torch.randn(n, dim, generator=gen)
        chi2 = torch.randn(n, dim, 3, generator=gen).square().sum(-1)
        return z / (chi2 / 3).sqrt()
    if kind == "lognormal":
        return torch.randn(n, dim, generator=gen).exp()
    if kind == "uniform":
        return torch.rand(n, dim, generator=gen) * 2 - 1
    if kind == "small":  # torchrec-like init of a huge table
        return (torch.rand(n, dim, generator=gen) * 2 - 1) * 1e-4
    raise AssertionError(kind)


DISTRIBUTIONS = ("normal", "student_t", "lognormal", "uniform")


def _torch_greedy(x: torch.Tensor, bits: int, num_bins: int, ratio: float) -> Tuple[torch.Tensor, ...]:
    """torch's greedy op: (codes bytes, fp16 scale, fp16 bias) per row from its fused layout
    ``| packed codes | scale fp16 | bias fp16 |``."""
    op = {2: torch.ops.quantized.embedding_bag_2bit_prepack,
          4: torch.ops.quantized.embedding_bag_4bit_prepack}[bits]
    fused = op(x, optimized_qparams=True, nbins=num_bins, ratio=ratio)
    ncode = packed_bytes_per_row(x.shape[1], bits)
    params = fused[:, ncode:].contiguous().view(torch.float16)
    return fused[:, :ncode].contiguous(), params[:, 0].contiguous(), params[:, 1].contiguous()


def _torch_l2(x: torch.Tensor, bits: int, num_bins: int, ratio: float) -> torch.Tensor:
    codes, scale, bias = _torch_greedy(x, bits, num_bins, ratio)
    q = QuantizedRows(bits, "adaptive", x.shape[0], x.shape[1], codes, scale=scale, bias=bias)
    return l2_per_row(x, q)


# --- error bounds -------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ("normal", "student_t", "small"))
def test_naive_error_is_at_most_half_a_step(bits: int, kind: str) -> None:
    x = _rows(kind, n=500)
    q = quantize_rows(x, bits, "naive")
    err = (x - dequantize_rows(q)).abs()
    scale, bias = q.scale.float().unsqueeze(1), q.bias.float().unsqueeze(1)
    # float32 rounding of (x - bias) * (1 / scale) and of code * scale + bias: a few ulps
    tol = 1e-6 * (x.abs() + bias.abs() + ((1 << bits) - 1) * scale)
    assert bool((err <= scale / 2 + tol).all()), float((err - scale / 2 - tol).max())


@pytest.mark.parametrize("bits", BITS)
def test_symmetric_range_is_plus_minus_max_abs(bits: int) -> None:
    x = _rows("lognormal", n=300) - 1.0
    q = quantize_rows(x, bits, "symmetric")
    a = x.abs().amax(1)
    assert torch.equal(q.bias, (-a).to(q.bias.dtype))  # the bias is stored rounded to its dtype
    qmax = (1 << bits) - 1
    torch.testing.assert_close(q.scale.float() * qmax, 2 * a, rtol=2e-3, atol=0)
    err = (x - dequantize_rows(q)).abs()
    assert bool((err <= q.scale.float().unsqueeze(1) * (0.5 + 2e-3) + 1e-6).all())


@pytest.mark.parametrize("bits", (2, 3, 4, 8))
@pytest.mark.parametrize("kind", DISTRIBUTIONS + ("small",))
def test_adaptive_never_worse_than_naive_on_any_row(bits: int, kind: str) -> None:
    x = _rows(kind, n=1000, seed=bits)
    naive = l2_per_row(x, quantize_rows(x, bits, "naive"))
    adaptive = l2_per_row(x, quantize_rows(x, bits, "adaptive"))
    assert bool((adaptive <= naive).all()), float((adaptive - naive).max())
    if bits < 8 and kind != "uniform":
        assert float(adaptive.mean()) < 0.97 * float(naive.mean())  # and it actually helps


# --- agreement with torch's greedy reference ---------------------------------------------------


SEARCHES = [(2, 25, 0.5), (4, 45, 0.2), (2, 200, 0.16), (4, 200, 0.16)]


@pytest.mark.parametrize("bits, num_bins, ratio", SEARCHES)
@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_float16_mode_matches_torch_prepack_or_beats_it(bits: int, num_bins: int, ratio: float, kind: str) -> None:
    """With fp16 parameters the stored scale, bias and codes equal torch's greedy op's; rows
    where they differ are rows where the final position (which torch never scores) won, and
    there the error is lower."""
    x = _rows(kind, seed=bits + num_bins)
    codes_t, scale_t, bias_t = _torch_greedy(x, bits, num_bins, ratio)
    q = quantize_rows_with_dtypes(x, bits, "adaptive", num_bins, ratio, scale_dtype=F16, bias_dtype=F16)
    same = (q.scale == scale_t) & (q.bias == bias_t)
    assert torch.equal(q.codes[same], codes_t[same])
    ours, theirs = l2_per_row(x, q), _torch_l2(x, bits, num_bins, ratio)
    assert bool((ours[~same] <= theirs[~same]).all())
    assert bool((ours[~same] < theirs[~same]).float().mean() > 0.99) if (~same).any() else True


@pytest.mark.parametrize("bits, num_bins, ratio", SEARCHES)
@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_default_precision_agrees_with_torch_and_is_no_worse(
    bits: int, num_bins: int, ratio: float, kind: str
) -> None:
    """With the stored precision (fp16 scale; fp16 bias where _bias_dtype allows it, else fp32)
    the search still walks torch's path, and with an fp32 bias each row stores the better of the
    exact and the fp16-rounded bias: so every row's range
    agrees with torch's within fp16 rounding or is a strictly better one, and no row's error is
    above torch's."""
    x = _rows(kind, seed=7 * bits + num_bins)
    _, scale_t, bias_t = _torch_greedy(x, bits, num_bins, ratio)
    q = quantize_rows(x, bits, "adaptive", num_bins, ratio)
    assert q.scale.dtype == F16 and q.bias.dtype in (F16, F32)
    half_ulp = 2.0 ** -11
    close_bias = (q.bias - bias_t.float()).abs() <= half_ulp * bias_t.float().abs() + 1e-7
    close_scale = (q.scale.float() - scale_t.float()).abs() <= 3 * half_ulp * scale_t.float().abs()
    ours, theirs = l2_per_row(x, q), _torch_l2(x, bits, num_bins, ratio)
    assert bool((ours <= theirs * (1 + 1e-12)).all()), float((ours / theirs).max())
    assert bool(((close_bias & close_scale) | (ours < theirs)).all())
    assert float(ours.mean()) <= float(theirs.mean())


# --- edge rows ----------------------------------------------------------------------------------

ALL = [(bits, method) for bits in BITS for method in METHODS]


def _edge_inputs() -> Dict[str, torch.Tensor]:
    constant = torch.tensor([0.1, -3.7, 1e-30, 123456.789, -2.5e30, 7.0]).unsqueeze(1).repeat(1, 33)
    return {
        "constant rows": constant,
        "zero rows": torch.zeros(4, 64),
        "single-element rows": torch.tensor([[0.1], [-5.25], [0.0], [3e20], [1e-40]]),
        "mixed": torch.cat([torch.zeros(1, 9), torch.full((1, 9), -0.3), torch.randn(3, 9)]),
    }


@pytest.mark.parametrize("bits, method", ALL)
def test_constant_zero_and_single_element_rows_round_trip_exactly(bits: int, method: str) -> None:
    for label, x in _edge_inputs().items():
        q = quantize_rows(x, bits, method)
        deq = dequantize_rows(q)
        exact = x.amin(1) == x.amax(1)
        assert exact.any(), label
        assert torch.equal(deq[exact], x[exact]), (label, deq[exact], x[exact])
        assert (q.rows, q.dim) == tuple(x.shape)


@pytest.mark.parametrize("bits, method", ALL)
def test_empty_input(bits: int, method: str) -> None:
    q = quantize_rows(torch.zeros(0, 16), bits, method)
    assert (q.rows, q.dim, q.codes.shape[0]) == (0, 16, 0)
    assert dequantize_rows(q).shape == (0, 16)
    assert q.nbytes == 0


@pytest.mark.parametrize("method", METHODS)
def test_parameters_and_strided_views_are_accepted(method: str) -> None:
    weight = torch.nn.Parameter(_rows("normal", n=40, dim=12))
    q = quantize_rows(weight, 4, method)
    assert torch.equal(dequantize_rows(q), dequantize_rows(quantize_rows(weight.detach().clone(), 4, method)))
    view = weight.detach().t()  # [12, 40], not contiguous
    assert dequantize_rows(quantize_rows(view, 4, method)).shape == (12, 40)


def test_thread_count_does_not_change_the_result() -> None:
    x = _rows("student_t", n=3000, dim=32)  # big enough for torch to split ops across threads
    single = [quantize_rows(x, bits) for bits in (2, 4)]
    torch.set_num_threads(2)
    try:
        multi = [quantize_rows(x, bits) for bits in (2, 4)]
    finally:
        torch.set_num_threads(1)
    for a, b in zip(single, multi):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("method", METHODS)
def test_block_boundaries_do_not_change_the_result(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _rows("student_t", n=300, dim=20)
    whole = quantize_rows(x, 3, method)
    monkeypatch.setattr(quantize, "BLOCK_VALUES", 7 * 20)  # 7-row blocks, the last one partial
    blocked = quantize_rows(x, 3, method)
    assert torch.equal(whole.codes, blocked.codes)
    for field in ("scale", "bias"):
        assert torch.equal(getattr(whole, field), getattr(blocked, field)), field


# --- encoded size and parameter precision ---------------------------------------------------------


@pytest.mark.parametrize("bits, method", ALL)
@pytest.mark.parametrize("dim", (1, 7, 64, 130))
def test_nbytes_is_codes_plus_params(bits: int, method: str, dim: int) -> None:
    rows = 11
    q = quantize_rows(_rows("normal", n=rows, dim=dim), bits, method)
    codes = rows * math.ceil(dim * bits / 8)
    # fp16 scale below 8 bits; fp16 bias too, except for 1-value (constant) rows, which stay exact
    params = rows * ((2 if bits <= 4 else 4) + (2 if bits <= 4 and dim > 1 else 4))
    assert q.codes.numel() == codes
    assert q.nbytes == codes + params


@pytest.mark.parametrize("bits", (2, 3, 4))
@pytest.mark.parametrize("values", ([0.0, 1e6], [1.0, 1.0 + 2 ** -20], [0.0, 1e-9]))
def test_scale_falls_back_to_float32_outside_float16_normal_range(bits: int, values: List[float]) -> None:
    x = torch.cat([_rows("normal", n=3, dim=8), torch.tensor(values).repeat(1, 4)])
    q = quantize_rows(x, bits, "naive")
    assert q.scale.dtype == F32
    err = (x - dequantize_rows(q)).abs()
    assert bool((err <= q.scale.unsqueeze(1) * (0.5 + 1e-5) + 1e-6 * x.abs()).all())


def _fbgemm_rows(x: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fbgemm's fused n-bit rows of ``x`` (torchrec's from_float): (codes, fp16 scale, fp16 bias)."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, bits)
    params = fused[:, -4:].contiguous().view(torch.float16)
    return fused[:, :-4], params[:, 0], params[:, 1]


@pytest.mark.parametrize("kind", ("normal", "student_t", "small"))
def test_serving_rows_at_8_bits_are_fbgemms_rows(kind: str) -> None:
    # "small" rows (torchrec's initial values) have float16-subnormal scales, as fbgemm's do
    x = _rows(kind)
    q = quantize_serving_rows(x, 8, "naive")
    codes, scale, bias = _fbgemm_rows(x, 8)
    assert q.scale.dtype == q.bias.dtype == F16
    assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale) and torch.equal(q.bias, bias)


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
def test_serving_rows_at_4_bits_are_no_worse_than_fbgemms_on_any_row(kind: str) -> None:
    x = _rows(kind)
    q = quantize_serving_rows(x, 4, "adaptive")
    codes, scale, bias = _fbgemm_rows(x, 4)
    theirs = l2_per_row(x, QuantizedRows(4, "naive", x.shape[0], x.shape[1], codes, scale=scale, bias=bias))
    assert q.scale.dtype == q.bias.dtype == F16
    assert bool((l2_per_row(x, q) <= theirs * (1 + 1e-6)).all())
    if kind in ("normal", "student_t"):  # rows whose tails the search trims
        assert float(l2_per_row(x, q).square().sum()) < float(theirs.square().sum())


def test_serving_rows_float16_cannot_hold_keep_the_quantizers_params(caplog: pytest.LogCaptureFixture) -> None:
    x = _rows("normal", n=10)
    x[3, 5] = 1e5  # beyond float16's 65504
    q = quantize_serving_rows(x, 8, "naive", name="table t")
    assert q.scale.dtype == q.bias.dtype == F32
    assert "table t: 1 of 10 rows hold values or ranges beyond float16's" in caplog.text
    assert bool(((dequantize_rows(q) - x).abs() <= q.scale.unsqueeze(1) / 2 * 1.001).all())


def test_dequantize_formula_on_hand_made_rows() -> None:
    codes = torch.tensor([[0b11100100], [0b00011011]], dtype=torch.uint8)  # codes 0,1,2,3 / 3,2,1,0
    q = QuantizedRows(2, "naive", 2, 4, codes, scale=torch.tensor([0.5, 2.0], dtype=F16),
                      bias=torch.tensor([-1.0, 10.0]))
    assert dequantize_rows(q).tolist() == [[-1.0, -0.5, 0.0, 0.5], [16.0, 14.0, 12.0, 10.0]]


# --- rejected input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, kind", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "inf"),
                                       (3e38, "a value beyond")])
@pytest.mark.parametrize("method", METHODS)
def test_non_finite_rows_are_rejected_with_their_index(bad: float, kind: str, method: str) -> None:
    x = torch.randn(40, 8)
    x[17, 3] = bad
    x[30, 0] = bad
    with pytest.raises(ConfigError, match=f"table t3 row 17 contains {kind}"):
        quantize_rows(x, 4, method, name="table t3")


BAD_CALLS: Dict[str, Tuple[Callable[[], object], str]] = {
    "method": (lambda: quantize_rows(torch.randn(2, 4), 4, "uniform"), "'uniform'"),
    "bits 5": (lambda: quantize_rows(torch.randn(2, 4), 5), "bits=5"),
    "bits bool": (lambda: quantize_rows(torch.randn(2, 4), True), "bits=True"),
    "bits float": (lambda: quantize_rows(torch.randn(2, 4), 4.0), "bits=4.0"),
    "num_bins 0": (lambda: quantize_rows(torch.randn(2, 4), 4, num_bins=0), "num_bins=0"),
    "num_bins float": (lambda: quantize_rows(torch.randn(2, 4), 4, num_bins=25.0), "num_bins=25.0"),
    "num_bins huge": (lambda: quantize_rows(torch.randn(2, 4), 4, num_bins=10**6), "num_bins=1000000"),
    "ratio 0": (lambda: quantize_rows(torch.randn(2, 4), 4, ratio=0.0), "ratio=0.0"),
    "ratio > 1": (lambda: quantize_rows(torch.randn(2, 4), 4, ratio=1.5), "ratio=1.5"),
    "ratio nan": (lambda: quantize_rows(torch.randn(2, 4), 4, ratio=float("nan")), "ratio=nan"),
    "ratio str": (lambda: quantize_rows(torch.randn(2, 4), 4, ratio="0.5"), "ratio='0.5'"),
    "bins for naive": (lambda: quantize_rows(torch.randn(2, 4), 4, "naive", num_bins=25), "num_bins=25"),
    "ratio for symmetric": (lambda: quantize_rows(torch.randn(2, 4), 4, "symmetric", ratio=0.5), "ratio=0.5"),
    "kmeans": (lambda: quantize_rows(torch.randn(2, 4), 4, "kmeans"), "'kmeans'"),  # a bench reference only
    "float64": (lambda: quantize_rows(torch.randn(2, 4, dtype=torch.float64), 4), "torch.float64"),
    "1-D": (lambda: quantize_rows(torch.randn(4), 4), r"shape \(4,\)"),
    "3-D": (lambda: quantize_rows(torch.randn(2, 2, 2), 4), r"shape \(2, 2, 2\)"),
    "list": (lambda: quantize_rows([[1.0, 2.0]], 4), "list"),
    "dim 0": (lambda: quantize_rows(torch.zeros(3, 0), 4), "dim 0"),
    "name": (lambda: quantize_rows(torch.randn(2, 4), 4, name=3), "name=3"),
    "dtype": (lambda: quantize_rows_with_dtypes(torch.randn(2, 4), 4, scale_dtype=torch.bfloat16), "bfloat16"),
    "codes shape": (lambda: QuantizedRows(4, "naive", 2, 4, torch.zeros(2, 3, dtype=torch.uint8),
                                          scale=torch.ones(2), bias=torch.zeros(2)), r"\(2, 2\)"),
    "kmeans rows": (lambda: QuantizedRows(2, "kmeans", 1, 4, torch.zeros(1, 1, dtype=torch.uint8),
                                          scale=torch.ones(1), bias=torch.zeros(1)), "'kmeans'"),
    "scale missing": (lambda: QuantizedRows(2, "naive", 1, 4, torch.zeros(1, 1, dtype=torch.uint8),
                                            scale=None, bias=torch.zeros(1)), "scale is NoneType"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_are_rejected(case: str) -> None:
    call, fragment = BAD_CALLS[case]
    with pytest.raises(ConfigError, match=fragment):
        call()


def test_defaults() -> None:
    assert (DEFAULT_NUM_BINS[2], DEFAULT_NUM_BINS[3], DEFAULT_NUM_BINS[4]) == (25, 25, 45)
    assert (DEFAULT_RATIO[2], DEFAULT_RATIO[3]) == (0.5, 0.2)
    assert [default_method(b) for b in BITS] == ["adaptive", "adaptive", "adaptive", "naive"]


def test_benchmark_runs_on_a_rows_file(tmp_path: Path) -> None:
    from cnr.bench.quantize import run

    path = tmp_path / "rows.f32"
    _rows("student_t", n=300, dim=16).numpy().astype("<f4").tofile(path)
    out = run(["--rows-file", str(path), "--dim", "16", "--rows", "300", "--repeat", "1", "--bits", "2", "4",
               "--train-steps", "0"])
    assert {e["method"] for e in out["table"]} == set(METHODS) | {"kmeans", "torch_greedy"}
    assert {e["set"] for e in out["table"]} == {"rows_file", "normal", "student_t3"}
    assert out["l2_ratio_vs_torch_2bit"] <= 1.0 and out["l2_ratio_vs_torch_4bit"] <= 1.0
    assert out["adaptive_beats_naive"] == {2: True, 4: True}
    for e in out["table"]:  # what a checkpoint spends: the stored chunk (zstd, header) of the storable methods
        if e["method"] in STORED_QUANT_METHODS + ("torch_greedy",):  # torch's rows store as adaptive ones
            assert 0 < e["stored_bytes_per_row"] < e["bytes_per_row"] + 3  # zstd, plus a header over 300 rows
        else:
            assert e["stored_bytes_per_row"] is None
    with pytest.raises(ConfigError, match="multiple of"):
        run(["--rows-file", str(path), "--dim", "17"])  # rejected before any training starts
    with pytest.raises(ConfigError, match="--train-steps -1"):
        run(["--train-steps", "-1"])
