"""The adaptive quantizer's greedy range search, in both kernels: step for step torch's
reference, the same path eager and compiled, the compiled one shared by threads, and the
writer's choice of kernel per job."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch

from cnr.write.plan import searched_rows
from cnr.options import CheckpointOptions
from cnr.codec.quant.quantize import quantize_rows_with_dtypes
from cnr.codec.quant.range_search import AUTO_COMPILE_ROWS, Fused, WriterSearch, compiled_search, greedy_range, min_bins
from cnr.storage.local import LocalStorage
from cnr.types import SearchKernel, WriteStatus
from cnr.write.writer import Writer
from cnr.write.writer_process import write_rank_data
from cnr.write.puts import Uploader
from test_encode_pool import _job
from test_quantize import DISTRIBUTIONS, SEARCHES, _rows

F16, F32 = torch.float16, torch.float32
HAS_COMPILER = any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
COMPILE_TIMEOUT_S = 600.0


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def compiled() -> Fused:
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this host: torch.compile's CPU backend cannot build the fused step")
    search = compiled_search(1)
    assert search.wait(COMPILE_TIMEOUT_S), f"the compiled search failed to build: {search.error}"
    step = search.get()
    assert step is not None
    return step


@pytest.fixture(params=["eager", "compiled"])
def kernel(request) -> Optional[Fused]:
    return None if request.param == "eager" else request.getfixturevalue("compiled")


@pytest.mark.parametrize("bits, num_bins, ratio", SEARCHES + [(3, 25, 0.2), (4, 45, 0.1), (8, 200, 0.16)])
def test_search_is_torch_choose_qparams_optimized_step_for_step(bits: int, num_bins: int, ratio: float,
                                                                kernel: Optional[Fused]) -> None:
    """Scored with torch's fp16 parameters and without the extra final candidate, both kernels
    return exactly torch's serial (xmin, xmax) for every row."""
    x = torch.cat([_rows(kind, n=150, seed=bits + num_bins) for kind in DISTRIBUTIONS])
    lo, hi = greedy_range(x, bits, num_bins, ratio, (F16, F16), score_last=False, compiled=kernel)
    pairs = [torch.choose_qparams_optimized(row, x.shape[1], num_bins, ratio, bits) for row in x]
    assert torch.equal(lo, torch.cat([p[1] for p in pairs]))
    assert torch.equal(hi, torch.cat([p[0] for p in pairs]))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtypes", [(F16, F16), (F16, F32), (F32, F32)])
def test_the_compiled_kernel_stores_the_eager_kernels_bytes(bits: int, dtypes, compiled: Fused) -> None:
    """Every width and parameter precision through one compiled graph (its width and float16
    rounding are tensor inputs): codes, scale and bias equal the eager kernel's, on every
    distribution and on blocks of odd shapes (1 x 37, 77 x 37). The kernels sum a row's squared
    errors in different orders, so a row where two candidates tie within float32 rounding may
    go either way (3 rows in 4.8M measured); these sets hold none."""
    sets = [_rows(kind, n=300, seed=bits) for kind in DISTRIBUTIONS] + [_rows("small", n=1, dim=37),
                                                                       _rows("normal", n=77, dim=37) * 1e3]
    for x in sets:
        eager = quantize_rows_with_dtypes(x, bits, "adaptive", scale_dtype=dtypes[0], bias_dtype=dtypes[1])
        fused = quantize_rows_with_dtypes(x, bits, "adaptive", scale_dtype=dtypes[0], bias_dtype=dtypes[1],
                                          search=compiled)
        assert torch.equal(fused.codes, eager.codes)
        assert torch.equal(fused.scale, eager.scale) and torch.equal(fused.bias, eager.bias)


def test_threads_share_the_compiled_step(compiled: Fused) -> None:
    """Two threads calling the compiled step at once get what one thread gets, block by block."""
    x = _rows("student_t", n=4000, seed=3)
    blocks = [x[i:i + 500] for i in range(0, 4000, 500)]
    alone = [greedy_range(b, 2, 25, 0.5, (F16, F16), compiled=compiled) for b in blocks]
    shared: list = [None] * len(blocks)

    def work(first: int) -> None:
        for i in range(first, len(blocks), 2):
            shared[i] = greedy_range(blocks[i], 2, 25, 0.5, (F16, F16), compiled=compiled)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (lo, hi), (lo2, hi2) in zip(alone, shared):
        assert torch.equal(lo, lo2) and torch.equal(hi, hi2)


@pytest.mark.parametrize(
    "num_bins, ratio, expected",
    [(45, 0.2, 36.0), (25, 0.5, 12.5), (25, 0.2, 20.0), (200, 0.16, 168.0), (45, 0.1, 40.5), (10, 1.0, 0.0)],
)
def test_min_bins_follows_torch_float_semantics(num_bins: int, ratio: float, expected: float) -> None:
    assert min_bins(num_bins, ratio) == expected


# --- the writer's choice ------------------------------------------------------------------------


def test_eager_never_compiles() -> None:
    search = WriterSearch(SearchKernel.EAGER, threads=5)
    assert search.for_job(10 * AUTO_COMPILE_ROWS) is None
    assert search.compiled._thread is None


def test_auto_compiles_only_for_a_large_job() -> None:
    search = WriterSearch(SearchKernel.AUTO, threads=2)  # no other test of this process builds 2 threads
    assert search.for_job(AUTO_COMPILE_ROWS - 1) is None
    assert search.compiled._thread is None, "a small job started a compile"
    search.for_job(AUTO_COMPILE_ROWS)  # starts the build; this job runs eager unless it is already built
    assert search.compiled._thread is not None
    if HAS_COMPILER:
        assert search.compiled.wait(COMPILE_TIMEOUT_S), search.compiled.error
        assert search.for_job(1) is search.compiled.get() is not None  # once built, every job uses it


def test_a_job_counts_the_rows_the_adaptive_search_encodes() -> None:
    """Of test_encode_pool's job: the 2-bit table (3000 rows) and the 2-bit increment (700
    rows) search; the 8-bit small table (naive), the 1-D log8 sums and dense state do not."""
    job = _job()
    assert searched_rows(job) == 3000 + 700

    def planned(**changes):
        return dataclasses.replace(job, plan=dataclasses.replace(job.plan, **changes))

    assert searched_rows(planned(method="naive")) == 0
    assert searched_rows(planned(bits=32, table_bits={"small": 4})) == 50
    assert searched_rows(planned(bits=8)) == 0


def test_a_bad_kernel_name_is_refused() -> None:
    with pytest.raises(ValueError, match="'fused'"):
        WriterSearch("fused", threads=1)  # type: ignore[arg-type]


def _full_job():
    full = _job()  # every kind of chunk: 2-bit rows, an 8-bit small table, log8 sums, dense state
    return dataclasses.replace(full, pieces=[p for p in full.pieces if p.row_ids is None])


def test_a_writer_on_the_compiled_kernel_stores_what_the_eager_kernel_stores(tmp_path: Path) -> None:
    """``search_kernel: compiled`` reaches the writer process, which builds the step as it
    starts and runs jobs eager until it is built (each result says which kernel it used); the
    first compiled job's chunks and rank index are byte for byte those of an eager write."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler on this host")
    options = CheckpointOptions(keep_last=0, chunk_bytes=16 * 1024, search_kernel="compiled")
    writer = Writer(str(tmp_path / "compiled"), options)
    kernels = []
    try:
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        while not kernels or kernels[-1] != "compiled":
            assert time.monotonic() < deadline, f"the writer never used the compiled kernel: {kernels}"
            step = len(kernels) + 1
            job = dataclasses.replace(_full_job(), ckpt_id=f"{step:010d}-enc", step=step, manifest_fields={})
            writer.submit(job)
            result = writer.wait()
            assert result.status == WriteStatus.COMMITTED, result.error
            kernels.append(result.search)
            time.sleep(0.5)
    finally:
        writer.close()
    assert set(kernels) <= {"eager", "compiled"}
    eager_root = tmp_path / "eager"
    store = LocalStorage(str(eager_root))
    uploader = Uploader(store, 2)
    try:
        write_rank_data(store, uploader, job, chunk_bytes=16 * 1024)
    finally:
        uploader.close()
    eager = {p.relative_to(eager_root): p.read_bytes() for p in eager_root.rglob("*") if p.is_file()}
    compiled_root = tmp_path / "compiled"
    assert len(eager) >= 4
    for path, blob in eager.items():
        assert (compiled_root / path).read_bytes() == blob, path


M = 1_000_000


@pytest.mark.parametrize("fields, rows_per_rank, kernel", [
    ({"bits": 2}, AUTO_COMPILE_ROWS, "compiled"),
    ({"bits": 2}, AUTO_COMPILE_ROWS - 1, "eager"),  # a small job never pays for a compile
    ({"bits": 4, "quant_method": "adaptive"}, 5 * M, "compiled"),
    ({"bits": 32}, 5 * M, "eager"),  # nothing searches
    ({"bits": 8}, 5 * M, "eager"),  # 8 bits' default method is naive
    ({"bits": 8, "quant_method": "adaptive"}, 5 * M, "compiled"),
    ({"bits": 2, "quant_method": "naive"}, 5 * M, "eager"),
    ({"bits": 2, "quant_method": "naive", "table_bits": {"t": 4}}, 5 * M, "compiled"),  # t's default method
    ({"bits": 32, "table_bits": {"t": 3}}, 5 * M, "compiled"),
    ({"bits": 32, "bit_policy": "failures", "expected_steps": 100, "failures": {"rate_per_node_hour": 0.1}}, 5 * M,
     "compiled"),  # the budget may pick 2 bits
    ({"bits": 32, "search_kernel": "compiled"}, 10, "compiled"),  # asked for: kept
    ({"bits": 2, "search_kernel": "eager"}, 5 * M, "eager"),
])
def test_auto_is_made_definite_for_a_writer_from_its_rows_and_widths(fields, rows_per_rank: int, kernel: str) -> None:
    options = CheckpointOptions(**fields)
    assert options.search_kernel == fields.get("search_kernel", "auto")
    assert options.for_writer(rows_per_rank).search_kernel == kernel
    assert dataclasses.replace(options.for_writer(rows_per_rank), search_kernel=options.search_kernel) == options


def test_bench_quantize_times_the_compiled_search_beside_the_eager_one(compiled: Fused, tmp_path: Path) -> None:
    from cnr.bench.quantize import run

    path = tmp_path / "rows.f32"
    _rows("student_t", n=300, dim=16).numpy().astype("<f4").tofile(path)
    out = run(["--rows-file", str(path), "--dim", "16", "--rows", "300", "--repeat", "1", "--bits", "2", "4",
               "--methods", "naive", "adaptive", "--train-steps", "0", "--threads", "1", "--compiled"])
    entries = {(e["set"], e["method"], e["bits"]): e for e in out["table"]}
    for (set_name, method, bits), e in entries.items():
        if method != "adaptive_compiled":
            continue
        eager = entries[(set_name, "adaptive", bits)]
        assert e["rows_differing"] <= 1  # a float32 tie at most, on 300 rows (cnr.codec.quant.range_search)
        assert e["l2_mean"] == pytest.approx(eager["l2_mean"], rel=1e-3)
        assert e["stored_bytes_per_row"] == pytest.approx(eager["stored_bytes_per_row"], rel=1e-2)
    assert {m for _, m, _ in entries} == {"naive", "adaptive", "adaptive_compiled", "torch_greedy"}
    assert out["speedup_compiled_vs_eager_2bit"] > 0 and out["speedup_compiled_vs_eager_4bit"] > 0
