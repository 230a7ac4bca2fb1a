"""The adaptive quantizer's greedy range search (Guan et al. 2019; Check-N-Run §4.2.3), vectorised
over rows, in two kernels that walk the same path, and the writer's choice between them:

- ``eager``: torch ops on reused buffers, six passes over the candidates' values per step;
- ``compiled``: the same math fused by ``torch.compile`` (inductor's C++ backend): one loop per
  search step, and one per final candidate that cnr.codec.quant.quantize scores in float64. It needs a C++
  compiler when first built in a process (3.6 s with inductor's on-disk cache warm, ~15 s cold,
  on 2 cores); :class:`CompiledSearch` builds it on a thread of its own and falls back to
  ``eager`` (with one warning) when it cannot.

Both round candidate parameters to their stored precision exactly (inductor is told to emulate
the float16 casts), so the kernels differ only in the order each row's squared errors are summed:
a path can differ only where two candidates' errors tie within that rounding. The torch
agreement tests run on both, and the stored bytes of both are compared.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from cnr.types import SearchKernel

logger = logging.getLogger(__name__)

Dtypes = Tuple[torch.dtype, torch.dtype]  # (scale, bias) precision the candidates are scored with

_FLOAT32_TINY = torch.finfo(torch.float32).tiny


def min_bins(num_bins: int, ratio: float) -> float:
    """Steps of range the search keeps, as torch >= 2.x computes it: ``float32(num_bins *
    (1 - ratio))`` with the product in double and no truncation (e.g. 45 bins at ratio 0.1 keep
    40.5 steps, so the search stops after 5 moves)."""
    return torch.tensor(float(num_bins) * (1.0 - ratio), dtype=torch.float32).item()


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (float32) rounded to what ``dtype`` stores, as float32."""
    return t if dtype == torch.float32 else t.to(dtype).float()


def range_loss(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: float, dtypes: Dtypes,
               work: torch.Tensor) -> torch.Tensor:
    """l2 error ``||x - deq||_2`` per row for candidate ranges ``lo, hi`` of shape ``[K, B]``.

    ``work`` is a ``[2, K, B, D]`` float32 buffer. The error is formed as ``(x - bias) - code *
    scale`` (6 passes over the data instead of 8 for ``x - (code * scale + bias)``); the two
    differ by an ulp per element, below the float32 summation noise the search already has.
    A zero scale gets a huge finite inverse rather than 0: cheaper, and the same error, since a
    zero scale dequantizes every code to the bias.
    """
    bias = rounded(lo, dtypes[1]).unsqueeze(-1)
    scale = rounded((hi - bias.squeeze(-1)) / qmax, dtypes[0])
    inv = scale.clamp_min(_FLOAT32_TINY).reciprocal_().unsqueeze(-1)
    diff, code = work[0], work[1]
    torch.sub(x, bias, out=diff)
    torch.mul(diff, inv, out=code).round_().clamp_(0.0, qmax)
    diff.addcmul_(code, scale.unsqueeze(-1), value=-1.0)
    return torch.linalg.vector_norm(diff, dim=-1)  # one fused pass; float32 sums


def _fused_loss(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qmax: torch.Tensor, half_scale: torch.Tensor,
                half_bias: torch.Tensor) -> torch.Tensor:
    """:func:`range_loss` out of place for ``torch.compile``, with the bit-width (``qmax``) and the
    float16 rounding of scale and bias (``half_*``) as 0-d tensors, so that one compiled graph
    serves every width and precision instead of one per Python constant."""
    bias = torch.where(half_bias, lo.half().float(), lo)
    raw_scale = (hi - bias) / qmax
    scale = torch.where(half_scale, raw_scale.half().float(), raw_scale)
    inv = scale.clamp_min(_FLOAT32_TINY).reciprocal()
    diff = x - bias.unsqueeze(-1)
    code = torch.minimum((diff * inv.unsqueeze(-1)).round().clamp_min(0.0), qmax)
    return torch.linalg.vector_norm(diff - code * scale.unsqueeze(-1), dim=-1)


def _move(active: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, loss: torch.Tensor, step: torch.Tensor,
          cur: torch.Tensor, best_lo: torch.Tensor, best_hi: torch.Tensor,
          best: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """One step's bookkeeping for every row, given ``loss [2, B]`` of the candidates (raise lo,
    lower hi): torch's local-optimum test (better than both moves and than the best so far),
    then the move to the lower-error candidate (ties lower hi). Rows not ``active`` stay."""
    moved = torch.minimum(loss[0], loss[1])
    optimum = active & (cur < moved) & (cur < best)
    best_lo, best_hi = torch.where(optimum, lo, best_lo), torch.where(optimum, hi, best_hi)
    best = torch.where(optimum, cur, best)
    go_up = loss[0] < loss[1]
    lo, hi = torch.where(active & go_up, lo + step, lo), torch.where(active & ~go_up, hi - step, hi)
    return lo, hi, torch.where(active, moved, cur), best_lo, best_hi, best


def _fused_step(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, cur: torch.Tensor, best_lo: torch.Tensor,
                best_hi: torch.Tensor, best: torch.Tensor, step: torch.Tensor, thr: torch.Tensor,
                qmax: torch.Tensor, half_scale: torch.Tensor, half_bias: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """One step of :func:`greedy_range`'s loop for every row, out of place for ``torch.compile``;
    the last output tells whether any row was still active."""
    active = lo + thr < hi
    loss = _fused_loss(x, torch.stack((lo + step, lo)), torch.stack((hi, hi - step)), qmax, half_scale, half_bias)
    return _move(active, lo, hi, loss, step, cur, best_lo, best_hi, best) + (active.any(),)


def _fused_loss64(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, inv: torch.Tensor,
                  qmax: torch.Tensor) -> torch.Tensor:
    """Per-row l2 error of encoding ``x [B, D]`` with stored (scale, bias, inv), accumulated in
    float64: cnr.codec.quant.quantize's eager scoring of a final candidate (fake-quantize, then the float64
    norm of the difference) in one pass."""
    code = torch.minimum(((x - bias.unsqueeze(1)) * inv.unsqueeze(1)).round().clamp_min(0.0), qmax)
    deq = code * scale.unsqueeze(1) + bias.unsqueeze(1)
    return torch.linalg.vector_norm(x.double() - deq.double(), dim=1)


@dataclass(frozen=True)
class Fused:
    """The compiled kernels: ``loss`` (:func:`_fused_loss`), ``step`` (:func:`_fused_step`) and
    ``loss64`` (:func:`_fused_loss64`)."""

    loss: Callable[..., torch.Tensor]
    step: Callable[..., Tuple[torch.Tensor, ...]]
    loss64: Callable[..., torch.Tensor]


class CompiledSearch:
    """The fused kernels, compiled once per process and thread count on first demand.

    ``threads``: the OpenMP threads each fused loop runs on. A compiled kernel holds the GIL
    while it runs, so Python threads that share one take turns on it (the writer encodes with
    it on one thread, cnr.write.writer); its own threads are what makes it use several cores (2-bit
    search, 65k rows x 64, 16k-row blocks: 1.12M rows/s on 1 thread, 1.59M on 2).

    ``get()`` never blocks: it returns the compiled kernels once built and warmed up, else
    None (not asked for yet, still compiling, or it failed: then the eager kernel serves).
    ``start()`` begins the build on a daemon thread; ``wait(timeout)`` is for tests and benchmarks.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._fused: Optional[Fused] = None
        self.error: Optional[str] = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, name="cnr-compile-search", daemon=True)
                self._thread.start()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Start the build if needed and wait for it; True when the compiled kernels are usable."""
        self.start()
        self._ready.wait(timeout)
        return self._fused is not None

    def get(self) -> Optional[Fused]:
        return self._fused if self._ready.is_set() else None

    def _build(self) -> None:
        try:
            options = {"emulate_precision_casts": True, "compile_threads": 1, "cpp.threads": self.threads}
            fused = Fused(*(torch.compile(fn, dynamic=True, options=options)
                            for fn in (_fused_loss, _fused_step, _fused_loss64)))
            # Warm up at sizes above 1 (size-1 dimensions get graphs of their own): later calls
            # reuse the graphs without compiling.
            x = torch.linspace(-1.0, 1.0, 7 * 5).reshape(7, 5)
            lo, hi = x.amin(1), x.amax(1)
            step_size, qmax, flag = (hi - lo) / 25.0, torch.tensor(3.0), torch.tensor(True)
            fused.loss(x, lo.unsqueeze(0), hi.unsqueeze(0), qmax, flag, ~flag)
            fused.step(x, lo, hi, hi - lo, lo, hi, hi - lo, step_size, step_size * 12.5, qmax, flag, ~flag)
            fused.loss64(x, step_size, lo, 1.0 / step_size, qmax)
            self._fused = fused
        except Exception as e:  # no compiler, an unsupported platform: the eager kernel serves
            self.error = f"{type(e).__name__}: {e}"
            logger.warning("the compiled range search is unavailable (%s); the eager one is used",
                           self.error.splitlines()[0][:300])
        finally:
            self._ready.set()


_COMPILED: Dict[int, CompiledSearch] = {}
_COMPILED_LOCK = threading.Lock()


def compiled_search(threads: int = 1) -> CompiledSearch:
    """This process's compiled search for ``threads`` OpenMP threads (built on first ``start``)."""
    with _COMPILED_LOCK:
        return _COMPILED.setdefault(threads, CompiledSearch(threads))


# SearchKernel.AUTO compiles once a job searches this many rows: the build costs 3-15 s of one
# core once per process, about what the eager kernel spends on 1-5M rows (340k rows/s eager,
# 1.1M compiled, one core), and a writer that saw one such job will see more.
AUTO_COMPILE_ROWS = 1_000_000
# How long a COMPILED writer's job waits for the build it started with the writer: 3.6 s with a
# warm inductor cache, up to ~15 s cold, on this 2-core machine; beyond this the job runs eager.
COMPILE_WAIT_S = 60.0


def writer_kernel(kernel: SearchKernel, rows_per_rank: int, searches: bool) -> SearchKernel:
    """``kernel`` for a writer about to start: AUTO becomes COMPILED when its checkpoints may run
    the search (``searches``) over at least AUTO_COMPILE_ROWS rows, so that the build overlaps
    training up to the first checkpoint; else EAGER. EAGER and COMPILED stay."""
    if kernel != SearchKernel.AUTO:
        return kernel
    return SearchKernel.COMPILED if searches and rows_per_rank >= AUTO_COMPILE_ROWS else SearchKernel.EAGER


class WriterSearch:
    """A writer's choice of kernel for each job (cnr.types.SearchKernel)."""

    def __init__(self, kernel: SearchKernel, threads: int) -> None:
        self.kernel = SearchKernel(kernel)
        self.compiled = compiled_search(threads)
        if self.kernel == SearchKernel.COMPILED:
            self.compiled.start()  # at the writer's start: built while training runs to its first checkpoint

    def for_job(self, searched_rows: int) -> Optional[Fused]:
        """The step for a job that searches ``searched_rows`` rows: the compiled one when it is
        wanted and built, else None (eager). One kernel serves all of a job's chunks.

        COMPILED: a job that searches waits for a build still running, up to COMPILE_WAIT_S (the
        build started with the writer, so this is what is left of it: less than the eager search
        of a large job). AUTO starts the build at its first large job and never waits for it."""
        if self.kernel == SearchKernel.EAGER:
            return None
        if self.kernel == SearchKernel.COMPILED and searched_rows:
            self.compiled.wait(COMPILE_WAIT_S)
        if self.kernel == SearchKernel.AUTO and searched_rows >= AUTO_COMPILE_ROWS:
            self.compiled.start()
        return self.compiled.get()


def greedy_range(x: torch.Tensor, bits: int, num_bins: int, ratio: float, dtypes: Dtypes, score_last: bool = True,
                 compiled: Optional[Fused] = None, bounds: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy (xmin, xmax) search of Guan et al. 2019 for every row of ``x [B, D]`` at once.

    Follows torch.choose_qparams_optimized step for step in float32: step = range / num_bins;
    while ``lo + min_bins * step < hi``, score raising lo by one step and lowering hi by one
    step, and move to the lower-error one (ties lower hi); a position whose error is below both
    candidates' and below the best so far becomes the best. Rows step in lockstep; a row whose
    stop test fails is frozen (float rounding gives some rows one step more than others).
    torch never scores the position its last move reaches; with ``score_last`` (the default)
    that position competes too, so the result is torch's or a strictly better range.
    ``compiled``: the fused kernels (:class:`CompiledSearch`), or None for the eager ones.
    ``bounds``: the rows' (min, max) when the caller has them.
    """
    qmax = float((1 << bits) - 1)
    xmin, xmax = bounds if bounds is not None else (x.amin(1), x.amax(1))
    step = (xmax - xmin) / float(num_bins)
    thr = step * min_bins(num_bins, ratio)  # float32 * float32-representable value, as torch
    if compiled is None:
        work = torch.empty((2, 2) + tuple(x.shape), dtype=torch.float32)
        cur = range_loss(x, xmin.unsqueeze(0), xmax.unsqueeze(0), qmax, dtypes, work[:, :1])[0]
    else:
        flags = (torch.tensor(qmax), torch.tensor(dtypes[0] == torch.float16), torch.tensor(dtypes[1] == torch.float16))
        cur = compiled.loss(x, xmin.unsqueeze(0), xmax.unsqueeze(0), *flags)[0]
    lo, hi, best_lo, best_hi, best = xmin, xmax, xmin, xmax, cur
    # ceil(num_bins - min_bins) steps in exact arithmetic; +1 for float rounding of the stop test.
    # The bound also ends rows whose step is absorbed by float rounding (lo + step == lo), on
    # which torch's while-loop never terminates.
    for _ in range(math.ceil(num_bins - min_bins(num_bins, ratio)) + 1):
        if compiled is not None:
            *state, any_active = compiled.step(x, lo, hi, cur, best_lo, best_hi, best, step, thr, *flags)
        else:
            active = lo + thr < hi
            any_active = active.any()
            if bool(any_active):
                loss = range_loss(x, torch.stack((lo + step, lo)), torch.stack((hi, hi - step)), qmax, dtypes, work)
                state = _move(active, lo, hi, loss, step, cur, best_lo, best_hi, best)
        if not bool(any_active):
            break
        lo, hi, cur, best_lo, best_hi, best = state
    if score_last:
        last = cur < best
        best_lo, best_hi = torch.where(last, lo, best_lo), torch.where(last, hi, best_hi)
    return best_lo, best_hi
