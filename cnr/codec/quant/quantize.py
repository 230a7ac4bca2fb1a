"""Row-wise quantization of embedding rows (Check-N-Run §4.2).

Uniform methods store, per row, ``value = code * scale + bias`` with unsigned codes in
``[0, 2**bits - 1]``, ``bias`` the row's chosen ``xmin`` and ``scale = (xmax - xmin) / (2**bits - 1)``:

* ``naive``: ``[xmin, xmax]`` is the row's ``[min, max]`` (the paper's "asymmetric").
* ``symmetric``: ``[-a, a]`` with ``a = max |x|``; same storage, fixed zero point at mid-range.
* ``adaptive``: the greedy range search of Guan et al. 2019 (paper §4.2.3), vectorised over rows.

Invariants: codes are computed from the stored (rounded) scale and bias, and dequantization
uses exactly those stored values, so ``|x - deq| <= scale / 2`` (plus float rounding) for every
element inside the chosen range. A row whose chosen range is empty (constant rows, including
zero and single-element rows) gets ``scale = 0`` and ``bias = `` its value, and round-trips
exactly with every method.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Dict, Optional, Tuple

import torch

from cnr.codec.base import StoredRows
from cnr.codec.quant.bitpack import pack, packed_bytes_per_row
from cnr.codec.quant.dequantize import dequantize_rows  # noqa: F401  (callers take it from here)
from cnr.codec.quant.range_search import Fused, greedy_range, rounded
from cnr.codec.quant.rows import BITS, METHODS, QuantizedRows, check_bits, check_method  # noqa: F401
from cnr.errors import ConfigError

logger = logging.getLogger(__name__)


# Greedy search defaults: 2/3/4-bit bins and 2/3-bit ratios are the paper's (§4.2.3); 8-bit
# adaptive (only when asked for; 8-bit's default method is naive) uses torch's reference 200/0.16.
# ``ratio`` has torch.choose_qparams_optimized's meaning: the search may remove up to ``ratio`` of
# the row's range (it stops once the range is <= num_bins * (1 - ratio) steps), so the number of
# search steps, and the run time, grow with it.
# 4-bit ratio, measured (45 bins; mean l2 per row of adaptive / naive; 20k rows at dim 64, 80k
# at 16, 2.5k at 128 and 1.25k at 256; t3 = Student-t with 3 dof, t1 = Cauchy):
#   ratio           0.05     0.1      0.2      0.3      0.5
#   dim 64  normal  0.92154  0.92035  0.92035  0.92035  0.92035
#   dim 64  t3      0.92121  0.92046  0.92046  0.92046  0.92046
#   dim 64  t1      0.64140  0.64121  0.64121  0.64121  0.64121
#   dim 16  t3      0.918484 0.918484 0.918484 0.918484 0.918484
#   dim 128 normal  0.923898 0.917971 0.917665 0.917665 0.917665
#   dim 256 normal  0.925595 0.909703 0.904654 0.904654 0.904654
#   dim 256 t3      0.915029 0.898531 0.891883 0.891870 0.891870
# 0.1 already reaches the plateau at dim <= 64 but loses ~0.5% at dim 256, where 0.2 is within
# 2e-5 of it; larger ratios buy nothing and cost steps. So 0.2 (9 steps at 45 bins).
DEFAULT_NUM_BINS: Dict[int, int] = {2: 25, 3: 25, 4: 45, 8: 200}
DEFAULT_RATIO: Dict[int, float] = {2: 0.5, 3: 0.2, 4: 0.2, 8: 0.16}
MAX_NUM_BINS = 4096  # the search runs ~num_bins * ratio steps; more bins buy nothing measurable

# Per-row parameter precision. Bias is float16 at 2/3/4 bits when that is harmless for every row
# of the call (_bias_dtype: constant rows stay exact, and rounding moves no row's grid by more
# than 1/128 of its step), float32 otherwise: rows far from zero relative to their spread, and
# every 8-bit call. Scale is float16 at 2/3/4 bits and
# float32 at 8 bits (and at any width when some row's scale is not a normal float16 number, see
# _scale_dtype). Measured with cnr.bench.quantize --param-study (20k rows x 64; mean l2 per row
# relative to float32 scale + float32 bias; "s16b32" = float16 scale + float32 bias; bytes per
# row s16b16/s16b32/s32b32: 20/22/24 at 2 bits, 36/38/40 at 4, 68/70/72 at 8):
#   rows           bits   naive: s16b16  s16b32   adaptive: s16b16  s16b32
#   N(0,1)         2             1.0000  1.0000             1.0000  1.0000
#   N(0,1)         4             1.0000  1.0000             1.0000  0.9998
#   N(0,1)         8             1.0004  1.0004             1.0002  0.9955
#   Student-t(3)   8             1.0002  1.0002             1.0002  0.9958
#   U(+-1e-4)      4             1.0001  1.0001             1.0002  1.0000
#   U(+-1e-4)      8             1.4654  1.4649             1.2642  1.2598  (float16 subnormal scale)
#   N(20,1)        4             1.0000  1.0000             1.0001  0.9991
#   N(20,1)        8             1.0064  1.0004             1.0041  0.9850
# (adaptive s16b32 can beat s32b32: it also tries torch's fp16-rounded bias, _adaptive_params.)
# So float16 scales cost nothing measurable below 8 bits and save 2 bytes per row (8% of a
# 64-dim 2-bit row); at 8 bits they hurt small-valued rows (torchrec initialises huge tables
# with values ~1e-4), and 2 bytes are only 3% of the row.
BIAS_DTYPE: torch.dtype = torch.float32  # the bias precision whenever _bias_dtype's test fails
_FP16_HALF_ULP = 2.0 ** -11  # relative rounding error of a normal float16
_FP16_HALF_SUBNORMAL = 2.0 ** -25  # absolute rounding error below float16's normal range
_BIAS_SHIFT_OF_STEP = 1.0 / 128  # the grid shift a float16 bias may cause, as a fraction of the step
_FP16_NORMAL = (torch.finfo(torch.float16).tiny, torch.finfo(torch.float16).max)

_MAX_ABS = torch.finfo(torch.float32).max / 2  # so that xmax - xmin and 2 * max|x| stay finite
# Values per vectorised block (rows per block = BLOCK_VALUES // dim). Each search step makes ~6
# passes over a [2, 2, rows, dim] float32 work buffer (4 MiB at 4096 x 64) plus ~35 small
# per-row ops. Measured on this 2-core machine while idle, 65k rows x 64, adaptive rows/s with
# blocks of 2048 / 4096 / 8192 / 16384 rows: 2-bit 654k / 678k / 652k / 661k, 4-bit 718k /
# 723k / 676k / 681k: flat, so the smaller, cache-friendlier block.
BLOCK_VALUES = 4096 * 64
# The compiled search's blocks: its fused step makes one pass per step, so what a larger block
# amortises is the per-call overhead (dynamo's guards, ~0.2 ms a call). A whole full 2-bit
# checkpoint of 3.0M rows x 64 through write_rank_data, one core: 5.2-5.3 s at 16k-row blocks,
# 4.4 s at 64k, 4.5 s at 256k (eager: 11.3 s). A 16 MiB chunk of 64-dim rows is one 64k block.
COMPILED_BLOCK_VALUES = 65536 * 64


def default_method(bits: int) -> str:
    """The paper's method for a bit-width: naive asymmetric at 8 bits, adaptive below."""
    check_bits(bits)
    return "naive" if bits == 8 else "adaptive"


def stored_method(width: int, bits: int, method: str) -> str:
    """The method rows stored at ``width`` bits (2..8) use when a checkpoint asks for ``bits``
    with ``method`` ("" for the default): ``method`` applies at ``bits`` only, every other width
    (a table plan's, a small table's) takes its default."""
    return (method if width == bits and method else "") or default_method(width)


def _resolve_search(bits: int, method: str, num_bins: object, ratio: object) -> Tuple[int, float]:
    """Validated (num_bins, ratio) for the adaptive search; defaults come from the bit-width."""
    if method != "adaptive":
        if num_bins is not None or ratio is not None:
            raise ConfigError(
                f"num_bins={num_bins!r}, ratio={ratio!r} given for method {method!r}; "
                "they are allowed only with method 'adaptive' (use None otherwise)"
            )
        return 0, 0.0
    if num_bins is None:
        num_bins = DEFAULT_NUM_BINS[bits]
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or not 1 <= num_bins <= MAX_NUM_BINS:
        raise ConfigError(f"num_bins={num_bins!r} is not allowed; it must be an int in 1..{MAX_NUM_BINS}")
    if ratio is None:
        ratio = DEFAULT_RATIO[bits]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ConfigError(f"ratio={ratio!r} is not allowed; it must be a number in (0, 1]")
    return num_bins, float(ratio)


def checked_input(x: object, name: object) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``x`` contiguous, row min, row max) after checking type, dtype, shape and finiteness."""
    if not isinstance(name, str):
        raise ConfigError(f"name={name!r} is not allowed; it must be a str")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        got = f"{x.dtype} with shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ConfigError(f"{name} is {got}; it must be a 2-D torch.float32 tensor [rows, dim]")
    if x.shape[1] < 1:
        raise ConfigError(f"{name} has dim {x.shape[1]}; rows must have at least 1 value")
    if x.device.type != "cpu":
        raise ConfigError(f"{name} is on {x.device}; quantization runs on cpu tensors only")
    x = x.detach().contiguous()  # parameters come with requires_grad; out= ops reject those
    # Row min/max find nan (it propagates and compares false), inf, and finite values so large
    # that a row's range (up to twice the largest magnitude) would overflow float32.
    xmin, xmax = (x.amin(1), x.amax(1)) if x.numel() else (x.new_zeros(0), x.new_zeros(0))
    ok = (xmax <= _MAX_ABS) & (xmin >= -_MAX_ABS)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten()
        row = int(bad[0])
        values = x[row]
        kind = "nan" if bool(values.isnan().any()) else "inf" if bool(values.isinf().any()) else (
            f"a value beyond +-{_MAX_ABS:.3g}, whose range would overflow float32")
        raise ConfigError(
            f"{name} row {row} contains {kind}; only finite values within +-{_MAX_ABS:.3g} can be "
            f"quantized ({bad.numel()} row(s) rejected)"
        )
    return x, xmin, xmax


def _scale_dtype(bits: int, xmin: torch.Tensor, xmax: torch.Tensor) -> torch.dtype:
    """Scale precision for one call: float16 at <= 4 bits when every row's full-range scale is
    0 or a normal float16 number, float32 otherwise. An adaptive range is never wider, so its
    scale cannot overflow; it can at worst become a float16 subnormal, whose absolute spacing
    (6e-8) bounds the extra error per value by ``qmax * 3e-8``."""
    if bits == 8:
        return torch.float32
    scale = (xmax - xmin) / float((1 << bits) - 1)
    fits = (scale == 0) | ((scale >= _FP16_NORMAL[0]) & (scale <= _FP16_NORMAL[1]))
    if bool(fits.all()):
        return torch.float16
    logger.info("%d of %d rows have a scale outside float16's normal range; storing float32 scales",
                int((~fits).sum()), fits.numel())
    return torch.float32


def _bias_dtype(bits: int, xmin: torch.Tensor, xmax: torch.Tensor) -> torch.dtype:
    """Bias precision for one call: float16 at <= 4 bits when every row either is constant with a
    value float16 holds exactly, or has its values within float16's range and a step
    ``(xmax - xmin) / qmax`` at least 128 times the float16 rounding error of a bias in its
    range; float32 otherwise. An adaptive range is at most ``ratio`` narrower (<= 0.5), so the
    grid shift stays below 1/64 of the stored step: far inside the step / 2 rounding error."""
    if bits == 8 or xmin.numel() == 0:
        return torch.float16 if bits != 8 and xmin.numel() == 0 else BIAS_DTYPE
    magnitude = torch.maximum(xmin.abs(), xmax.abs())
    if bool((magnitude > _FP16_NORMAL[1]).any()):
        return BIAS_DTYPE
    step = (xmax - xmin) / float((1 << bits) - 1)
    rounding = magnitude * _FP16_HALF_ULP + _FP16_HALF_SUBNORMAL
    constant = xmin == xmax
    ok = torch.where(constant, xmin.half().float() == xmin, rounding <= step * _BIAS_SHIFT_OF_STEP)
    return torch.float16 if bool(ok.all()) else BIAS_DTYPE


def _serving_dtypes(bits: int, xmin: torch.Tensor, xmax: torch.Tensor, name: str) -> Tuple[torch.dtype, torch.dtype]:
    """(float16, float16) when float16 holds every row's values and full-range scale (within
    +-65504), else the default choice (_scale_dtype, _bias_dtype), logged: such rows are not
    squeezed into float16 parameters."""
    limit = _FP16_NORMAL[1]
    fits = (xmin >= -limit) & (xmax <= limit) & ((xmax - xmin) / float((1 << bits) - 1) <= limit)
    if bool(fits.all()):
        return torch.float16, torch.float16
    logger.warning("%s: %d of %d rows hold values or ranges beyond float16's +-%g; stored with the quantizer's own "
                   "scale and bias precision, not the serving form", name, int((~fits).sum()), fits.numel(), limit)
    return _scale_dtype(bits, xmin, xmax), _bias_dtype(bits, xmin, xmax)


def _params(lo: torch.Tensor, hi: torch.Tensor, qmax: float, scale_dtype: torch.dtype,
            bias_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored (rounded) scale and bias for ranges ``[lo, hi]``, plus the inverse scale.

    The scale is derived from the *rounded* bias, as torch does, so the range the codes cover
    starts exactly at the stored bias. A zero scale, or one so small (subnormal) that its inverse
    overflows, becomes scale 0 with inverse 0: every code is 0 and the row dequantizes to its
    bias, which is within the (tiny) range of every value.
    """
    bias = rounded(lo, bias_dtype)
    scale = rounded((hi - bias) / qmax, scale_dtype)
    inv = 1.0 / scale
    usable = torch.isfinite(inv)
    zero = torch.zeros_like(scale)
    return torch.where(usable, scale, zero), bias, torch.where(usable, inv, zero)


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, inv: torch.Tensor,
                qmax: float, out: torch.Tensor) -> torch.Tensor:
    """Write ``dequantize(quantize(x))`` into ``out`` and return it.

    ``x`` is ``[B, D]``; scale/bias/inv are ``[..., B]`` (one set per candidate) and ``out`` is
    ``[..., B, D]``. The operation order (sub, mul by inverse, round half-even, clamp, mul, add)
    is the one torch's reference uses and the one encoding and :func:`dequantize_rows` use, so
    an error computed from this output is the error of the stored encoding.
    """
    torch.sub(x, bias.unsqueeze(-1), out=out)
    out.mul_(inv.unsqueeze(-1)).round_().clamp_(0.0, qmax)
    return out.mul_(scale.unsqueeze(-1)).add_(bias.unsqueeze(-1))


def _loss64(x: torch.Tensor, x64: torch.Tensor, params: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            qmax: float, out: torch.Tensor) -> torch.Tensor:
    """Per-row l2 error of encoding ``x`` (``x64`` = x as float64) with (scale, bias, inv),
    accumulated in float64 as :func:`l2_per_row` does."""
    deq = _fake_quant(x, *params, qmax, out)
    return torch.linalg.vector_norm(torch.sub(x64, deq), dim=1)  # float64 - float32: exact, one pass


def _adaptive_params(x: torch.Tensor, bounds: Tuple[torch.Tensor, torch.Tensor], bits: int, num_bins: int,
                     ratio: float, dtypes: Tuple[torch.dtype, torch.dtype], torch_scoring: bool,
                     search: Optional[Fused]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored (scale, bias, inv) per row of block ``x`` (its rows' (min, max): ``bounds``) for
    the adaptive method.

    With ``torch_scoring`` the search scores candidates with torch's fp16 scale and bias, so it
    walks exactly torch's greedy path and lands on torch's range or a better one. The stored
    encoding is then the best, by float64 error, of: the full range (naive's encoding), the
    chosen range with its bias stored exactly, and (with ``torch_scoring``) the chosen range
    with the bias rounded to fp16 as torch stores it. Float64 scoring settles near-ties that
    float32 sums can misorder (~1e-7), so on every row the error is at most naive's and, with
    ``torch_scoring``, at most torch's greedy op's with the same bins and ratio.
    """
    qmax = float((1 << bits) - 1)
    scale_dtype, bias_dtype = dtypes
    lo, hi = greedy_range(x, bits, num_bins, ratio, (torch.float16, torch.float16) if torch_scoring else dtypes,
                          compiled=search, bounds=bounds)
    options = [_params(*bounds, qmax, *dtypes), _params(lo, hi, qmax, *dtypes)]
    if torch_scoring and bias_dtype != torch.float16:
        options.append(_params(lo, hi, qmax, scale_dtype, torch.float16))
    if search is None:
        work, x64 = torch.empty_like(x), x.double()
        score = functools.partial(_loss64, x, x64, qmax=qmax, out=work)
    else:  # the same math in one fused pass per option
        qmax_t = torch.tensor(qmax)
        score = lambda params: search.loss64(x, *params, qmax_t)  # noqa: E731
    chosen, chosen_loss = torch.stack(options[0]), score(options[0])
    for option in options[1:]:
        loss = score(option)
        better = loss < chosen_loss  # ties keep the earlier option
        chosen, chosen_loss = torch.where(better, torch.stack(option), chosen), torch.minimum(loss, chosen_loss)
    return chosen[0], chosen[1], chosen[2]


def _block_params(x: torch.Tensor, bounds: Tuple[torch.Tensor, torch.Tensor], bits: int, method: str,
                  num_bins: int, ratio: float, dtypes: Tuple[torch.dtype, torch.dtype], torch_scoring: bool,
                  search: Optional[Fused]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stored (scale, bias, inv) per row of block ``x`` (its rows' (min, max): ``bounds``) for
    the uniform methods."""
    qmax = float((1 << bits) - 1)
    if method == "adaptive":
        return _adaptive_params(x, bounds, bits, num_bins, ratio, dtypes, torch_scoring, search)
    xmin, xmax = bounds
    if method == "naive":
        return _params(xmin, xmax, qmax, *dtypes)
    a = torch.maximum(xmax, -xmin)
    # A constant row keeps its empty range (scale 0) so that it round-trips exactly.
    const = xmin == xmax
    return _params(torch.where(const, xmin, -a), torch.where(const, xmax, a), qmax, *dtypes)


def quantize_rows_with_dtypes(
    x: torch.Tensor, bits: int, method: str = "adaptive", num_bins: Optional[int] = None,
    ratio: Optional[float] = None, *, name: str = "tensor", scale_dtype: Optional[torch.dtype] = None,
    bias_dtype: Optional[torch.dtype] = None, search: Optional[Fused] = None, serving: bool = False,
) -> QuantizedRows:
    """:func:`quantize_rows` with a chosen per-row parameter precision (float16 or float32;
    None: the default choice, or with ``serving`` float16 where it fits, _serving_dtypes). For
    measurements (cnr.bench.quantize), torch comparisons and :func:`quantize_serving_rows`; the
    checkpoint path uses :func:`quantize_rows`. When the scale is float16 and every value
    fits float16, the adaptive search scores candidates with torch's float16 scale and bias
    (see _adaptive_params); otherwise with the parameters rounded to these dtypes.
    """
    check_bits(bits)
    check_method(method)
    num_bins, ratio = _resolve_search(bits, method, num_bins, ratio)
    for label, dtype in (("scale_dtype", scale_dtype), ("bias_dtype", bias_dtype)):
        if dtype not in (None, torch.float16, torch.float32):
            raise ConfigError(f"{label}={dtype!r} is not allowed; allowed: torch.float16, torch.float32")
    x, xmin, xmax = checked_input(x, name)
    if serving and scale_dtype is None and bias_dtype is None:
        scale_dtype, bias_dtype = _serving_dtypes(bits, xmin, xmax, name)
    scale_dtype = scale_dtype or _scale_dtype(bits, xmin, xmax)
    bias_dtype = bias_dtype or _bias_dtype(bits, xmin, xmax)
    # torch's fp16 scoring only where its fp16 scale and bias are meaningful for every row.
    fp16_max = _FP16_NORMAL[1]
    torch_scoring = scale_dtype == torch.float16 and bool((xmin >= -fp16_max).all() & (xmax <= fp16_max).all())
    rows, dim = x.shape
    started = time.perf_counter()
    codes = torch.empty((rows, packed_bytes_per_row(dim, bits)), dtype=torch.uint8)
    scale = torch.empty(rows, dtype=scale_dtype)
    bias = torch.empty(rows, dtype=bias_dtype)
    qmax = float((1 << bits) - 1)
    block_rows = max(1, (BLOCK_VALUES if search is None else COMPILED_BLOCK_VALUES) // dim)
    for start in range(0, rows, block_rows):
        block = x[start:start + block_rows]
        end = start + block.shape[0]
        s, b, inv = _block_params(block, (xmin[start:end], xmax[start:end]), bits, method, num_bins, ratio,
                                  (scale_dtype, bias_dtype), torch_scoring, search)
        block_codes = torch.sub(block, b.unsqueeze(1)).mul_(inv.unsqueeze(1)).round_()
        block_codes = block_codes.clamp_(0.0, qmax).to(torch.uint8)
        scale[start:end], bias[start:end] = s, b
        codes[start:end] = pack(block_codes, bits)
    logger.debug("%s: quantized %d rows x %d with %s at %d bits in %.3f s", name, rows, dim, method,
                 bits, time.perf_counter() - started)
    return QuantizedRows(bits, method, rows, dim, codes, scale=scale, bias=bias)


def quantize_rows(
    x: torch.Tensor, bits: int, method: str = "adaptive", num_bins: Optional[int] = None,
    ratio: Optional[float] = None, *, name: str = "tensor", search: Optional[Fused] = None,
) -> QuantizedRows:
    """Quantize float32 ``x [rows, dim]`` row by row to ``bits`` bits per value.

    ``method``: one of METHODS; ``bits``: one of BITS. ``num_bins``/``ratio`` tune the adaptive
    search only (None: DEFAULT_NUM_BINS / DEFAULT_RATIO for the bit-width). ``name`` prefixes
    error messages, e.g. "table t3 row 17 contains nan". Raises ConfigError for bad arguments
    and for rows with nan/inf. Scale and bias are float16 at 2/3/4 bits unless some row needs
    float32 (see _scale_dtype and _bias_dtype), float32 at 8 bits. ``search``: the adaptive
    search's compiled kernels (cnr.codec.quant.range_search.CompiledSearch.get()), or None for the eager ones.
    """
    return quantize_rows_with_dtypes(x, bits, method, num_bins, ratio, name=name, search=search)


def quantize_serving_rows(
    x: torch.Tensor, bits: int, method: str = "adaptive", *, name: str = "tensor", search: Optional[Fused] = None,
) -> QuantizedRows:
    """:func:`quantize_rows` with a float16 scale and bias on every row at every width: the form of
    fbgemm's fused n-bit rows, which torchrec's quantized inference tables hold, so a subscriber
    copies the rows in as stored (cnr.publish.serving).

    Codes are computed from the rounded parameters, as always, so float16 costs accuracy only
    through the grid it stores: a bias rounded above a row's minimum clamps the values below it
    (by at most half a float16 ulp of the bias), and a scale below float16's normal range (6.1e-5:
    8-bit rows spanning less than 0.016, such as torchrec's initial values of ~1e-4) is subnormal,
    with an absolute spacing of 6e-8 that adds up to ``qmax * 3e-8`` per value (7.6e-6 at 8
    bits); a scale that rounds to 0 stores the row as its bias. fbgemm's own quantizer
    (FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf) rounds its parameters the same way: at 8 bits
    with the naive method the rows are its rows, and the adaptive method's are at most its error
    per row. A call holding a row float16 cannot represent (a value or a full-range scale
    beyond +-65504) keeps quantize_rows's parameters, logged: those chunks are converted by a
    serving subscriber rather than silently rounded here.
    """
    return quantize_rows_with_dtypes(x, bits, method, name=name, search=search, serving=True)


def l2_per_row(x: torch.Tensor, q: StoredRows) -> torch.Tensor:
    """float64 ``[rows]``: ``||x_i - q.values()_i||_2`` per row, accumulated in float64 (any stored
    rows: the bench's k-means rows too)."""
    err = x.double() - q.values().double()
    return torch.linalg.vector_norm(err, dim=1)
