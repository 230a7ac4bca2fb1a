"""``cnr report``: figures computed from manifests alone, on hand-computed sequences and real runs."""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

import pytest
from matplotlib.image import imread

from cnr.app.cli import main
from cnr.format.manifest import (
    Manifest, RankIndex, TensorEntry, object_key, failed_key, make_id, manifest_key, manifest_to_bytes,
    rank_index_key, rank_index_to_bytes,
)
from cnr.app.report import FIGURES, MARKDOWN, Entry, ReportData, compute, render_markdown
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.types import CheckpointKind, ChunkRef, Encoding, TableSpec, Role

TABLE = "model/sparse_arch.embedding_bags.t0.weight"
DENSE = "model/dense_arch.weight"
RNG = "rng/rank-00000"
FP32_BYTES = 4 * (100 * 2) + 4 * 50  # TABLE (100, 2) and DENSE (50,) as fp32; RNG state is not counted
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- a hand-computed sequence ----------------------------------------------------------------

def _entry(step: int, kind: str, base: Optional[str], data: int, meta: int, bits: int = 4) -> Entry:
    return Entry(id=f"c{step}", step=step, kind=kind, bits=bits, method="adaptive", base=base,
                 data_bytes=data, meta_bytes=meta, full_fp32_bytes=1000)


# Two baselines with increments (written bytes 400, 150, 250 | 420, 100; fp32 1000 each).
SEQUENCE = [
    _entry(10, "full", None, 300, 100), _entry(20, "incremental", "c10", 120, 30),
    _entry(30, "incremental", "c10", 220, 30), _entry(40, "full", None, 320, 100),
    _entry(50, "incremental", "c40", 80, 20),
]


def _md_rows(md: str) -> List[Dict[str, str]]:
    """The per-checkpoint table of report.md as dicts keyed by column header."""
    lines = md.split("## Per checkpoint", 1)[1].strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def _md_total(md: str, label: str) -> str:
    match = re.search(r"^\| \**" + re.escape(label) + r"\**[^|]* \| \**([^|*]+)\**\s*\|$", md, re.M)
    assert match, f"no totals row {label!r} in report.md"
    return match.group(1).strip()


def test_figures_on_a_hand_computed_sequence():
    points = compute(list(reversed(SEQUENCE)))  # order of the input does not matter: steps do
    assert [p.entry.step for p in points] == [10, 20, 30, 40, 50]
    assert [p.cum_written for p in points] == [400, 550, 800, 1220, 1320]
    assert [p.cum_fp32 for p in points] == [1000, 2000, 3000, 4000, 5000]
    assert [p.held for p in points] == [400, 550, 800, 1220, 1320]
    assert [p.needed for p in points] == [400, 550, 650, 420, 520]  # own bytes + its baseline's
    assert [round(p.bw_reduction, 4) for p in points] == [2.5, 3.6364, 3.75, 3.2787, 3.7879]
    # peak fp32 (1000) / peak needed so far: 400, 550, then 650 from step 30 on
    assert [round(p.capacity_reduction, 4) for p in points] == [2.5, 1.8182, 1.5385, 1.5385, 1.5385]


def test_markdown_numbers():
    md = render_markdown(ReportData("file:///x", compute(SEQUENCE), []))
    rows = _md_rows(md)
    assert [r["step"] for r in rows] == ["10", "20", "30", "40", "50"]
    third = rows[2]
    assert (third["kind"], third["bits"], third["chunk bytes"], third["metadata bytes"], third["bytes written"]) == \
        ("incremental", "4", "220", "30", "250")
    assert (third["cumulative written"], third["full fp32 bytes"], third["held after commit"],
            third["needed to restore"]) == ("800", "1,000", "800", "650")
    assert (third["bandwidth reduction"], third["capacity reduction"]) == ("3.75×", "1.54×")
    assert _md_total(md, "bytes written") == "1,320"
    assert _md_total(md, "full fp32 every interval would write") == "5,000"
    assert _md_total(md, "average bytes written per interval") == "264"
    assert _md_total(md, "write-bandwidth reduction") == "3.79×"
    assert _md_total(md, "peak storage needed to restore") == "650"
    assert _md_total(md, "capacity reduction") == "1.54×"
    assert _md_total(md, "peak storage held") == "1,320"
    for file in FIGURES.values():
        assert f"]({file})" in md  # embedded by relative path


def test_missing_baseline_after_retention():
    """Without the step-10 baseline its increments cannot be restored: no 'needed' for them."""
    points = compute(SEQUENCE[1:])
    assert [p.held for p in points] == [150, 400, 820, 920]
    assert [p.needed for p in points] == [None, None, 420, 520]
    assert [p.capacity_reduction for p in points][:2] == [None, None]
    assert round(points[-1].capacity_reduction, 4) == round(1000 / 520, 4)
    rows = _md_rows(render_markdown(ReportData("file:///x", points, [])))
    assert rows[0]["needed to restore"] == "—" and rows[0]["capacity reduction"] == "—"


def test_a_merged_baseline_is_written_bytes_but_no_interval():
    """Consecutive increments c10 <- c20 <- c30, then c20's chain merged (``c20.merged``, 500 B)."""
    merged = Entry(id="c20.merged", step=20, kind="full", bits=4, method="adaptive", base=None,
                   data_bytes=450, meta_bytes=50, full_fp32_bytes=1000)
    sequence = [_entry(10, "full", None, 300, 100), _entry(20, "incremental", "c10", 120, 30), merged,
                _entry(30, "incremental", "c20", 220, 30)]
    points = compute(sequence)
    assert [p.entry.id for p in points] == ["c10", "c20", "c20.merged", "c30"]
    assert [p.cum_written for p in points] == [400, 550, 1050, 1300]  # the merge's bytes were written
    assert [p.cum_fp32 for p in points] == [1000, 2000, 2000, 3000]  # the fp32 baseline wrote nothing for it
    # restoring c20 or c30 reads the merged baseline instead of c10 + c20
    assert [p.needed for p in points] == [400, 500, 500, 750]
    t = ReportData("file:///x", points, []).totals()
    assert (t["checkpoints"], t["full"], t["incremental"], t["merged"]) == (4, 1, 2, 1)
    assert t["avg_written_per_interval"] == 1300 / 3 and t["avg_fp32_per_interval"] == 1000
    assert round(t["bw_reduction"], 4) == round(3000 / 1300, 4)
    md = render_markdown(ReportData("file:///x", points, []))
    assert "(1 full, 2 incremental, 1 merged baselines)" in md


# ---- checkpoints written through the manifest API ----------------------------------------------

def _chunk(ckpt_id: str, n: int, tensor: str, rows: int, nbytes: int, bits: int) -> ChunkRef:
    quantized = bits < 32
    return ChunkRef(key=object_key(ckpt_id, 0, n), tensor_name=tensor, rows=rows, row_start=0, row_ids=False,
                    col_offset=0, cols=2 if tensor == TABLE else 0, nbytes=nbytes, crc32=0,
                    encoding=Encoding.QUANTIZED if quantized else Encoding.RAW, bits=bits,
                    method="adaptive" if quantized else "")


def _write_checkpoint(store: Storage, step: int, kind: CheckpointKind, base: Optional[str], table_bytes: int,
                      bits: int = 4, world_size: int = 2, commit: bool = True) -> str:
    """Chunks (junk payloads of the declared sizes), every rank's index, and the manifest."""
    ckpt_id = make_id(step, "feedbeef")
    tensors = {
        TABLE: TensorEntry((100, 2), "float32", False, (_chunk(ckpt_id, 0, TABLE, 100, table_bytes, bits),),
                           Role.TABLE_ROWS, TABLE),
        DENSE: TensorEntry((50,), "float32", True, (_chunk(ckpt_id, 1, DENSE, 50, 200, 32),)),
        RNG: TensorEntry((16,), "uint8", False, (_chunk(ckpt_id, 2, RNG, 16, 16, 32),), Role.RNG),
    }
    for entry in tensors.values():
        store.put(entry.chunks[0].key, b"\0" * entry.chunks[0].nbytes)
    for rank in range(world_size):
        store.put(rank_index_key(ckpt_id, rank),
                  rank_index_to_bytes(RankIndex(ckpt_id, rank, world_size, tensors if rank == 0 else {})))
    if commit:
        store.put(manifest_key(ckpt_id), manifest_to_bytes(Manifest(
            id=ckpt_id, step=step, kind=kind, base=base, world_size=world_size, created_unix=1.0, tables=(TableSpec("t0", 100, 2, ("f0",)),), tensors=tensors, counters={"step": step})))
    return ckpt_id


def _write_sequence(store: Storage) -> Dict[str, str]:
    """full@10, incremental@20, failed@30, incremental@40 (8-bit), uncommitted@50."""
    ids = {"full": _write_checkpoint(store, 10, CheckpointKind.FULL, None, 500)}
    ids["inc20"] = _write_checkpoint(store, 20, CheckpointKind.INCREMENTAL, ids["full"], 120)
    ids["failed"] = _write_checkpoint(store, 30, CheckpointKind.INCREMENTAL, ids["full"], 999, commit=False)
    store.put(failed_key(ids["failed"]), json.dumps({"error": "injected"}).encode())
    ids["inc40"] = _write_checkpoint(store, 40, CheckpointKind.INCREMENTAL, ids["full"], 330, bits=8)
    ids["open"] = _write_checkpoint(store, 50, CheckpointKind.INCREMENTAL, ids["full"], 777, commit=False)
    for key in store.list("checkpoints"):
        if key.endswith(".bin"):  # the report must not need chunk data
            store.delete(key)
    return ids


def _meta(store: Storage, ckpt_id: str) -> int:
    return store.size(manifest_key(ckpt_id)) + sum(store.size(rank_index_key(ckpt_id, r)) for r in range(2))


def _report(uri: str, out: str, capsys) -> Dict:
    assert main(["report", uri, "--out", out]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _check_report(store: Storage, uri: str, out: str, capsys) -> None:
    ids = _write_sequence(store)
    summary = _report(uri, out, capsys)
    md = open(os.path.join(out, MARKDOWN), encoding="utf-8").read()
    rows = _md_rows(md)
    assert [r["id"] for r in rows] == [f"`{ids[k]}`" for k in ("full", "inc20", "inc40")]  # failed, open excluded
    assert [r["bits"] for r in rows] == ["4", "4", "8"]
    assert [r["chunk bytes"] for r in rows] == ["716", "336", "546"]  # table + dense 200 + rng 16
    written = [d + _meta(store, ids[k]) for d, k in ((716, "full"), (336, "inc20"), (546, "inc40"))]
    assert [r["bytes written"] for r in rows] == [f"{w:,}" for w in written]
    assert [r["full fp32 bytes"] for r in rows] == [f"{FP32_BYTES:,}"] * 3
    assert rows[2]["needed to restore"] == f"{written[0] + written[2]:,}"
    assert _md_total(md, "bytes written") == f"{sum(written):,}"
    assert summary["bw_reduction"] == pytest.approx(3 * FP32_BYTES / sum(written))
    assert summary["excluded"] == 2 and ids["failed"] in md and "(failed)" in md and "(uncommitted)" in md
    for file in FIGURES.values():
        path = os.path.join(out, file)
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(path) > 20_000, f"{file} is suspiciously small"
        height, width = imread(path).shape[:2]
        assert width >= 800 and height >= 400


def test_report_local_from_manifests_alone(tmp_path, capsys):
    store = open_storage(str(tmp_path / "store"))
    _check_report(store, str(tmp_path / "store"), str(tmp_path / "out"), capsys)


def test_report_s3(tmp_path, s3_bucket, capsys):
    uri = f"s3://{s3_bucket}/jobs/run-1"
    store = open_storage(uri)
    try:
        _check_report(store, uri, str(tmp_path / "out"), capsys)
    finally:
        store.close()


# ---- errors -------------------------------------------------------------------------------------

def test_no_checkpoints_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 1  # a runtime failure
    assert "no committed checkpoint" in capsys.readouterr().err
    store = open_storage(str(tmp_path / "failed-only"))
    ckpt_id = _write_checkpoint(store, 10, CheckpointKind.FULL, None, 100, commit=False)
    store.put(failed_key(ckpt_id), b'{"error": "x"}')
    assert main(["report", str(tmp_path / "failed-only"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "no committed checkpoint" in err and "1 failed or uncommitted" in err


def test_unwritable_out_dir_is_a_clear_error(tmp_path, capsys):
    store = open_storage(str(tmp_path / "store"))
    _write_checkpoint(store, 10, CheckpointKind.FULL, None, 100)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for out in (blocker, blocker / "sub"):  # a file where the directory should be (root ignores modes)
        assert main(["report", str(tmp_path / "store"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: report directory") and "not writable" in err


# ---- a real training run ----------------------------------------------------------------------

def test_report_totals_match_the_train_summary(baseline_ws1, tmp_path, capsys):
    """Bytes written and fp32 bytes add up to exactly what the trainer reported writing."""
    summary, cwd, storage = baseline_ws1
    result = _report(os.path.join(cwd, storage), str(tmp_path / "out"), capsys)
    md = open(result["files"]["markdown"], encoding="utf-8").read()
    assert result["checkpoints"] == summary["checkpoints"]
    assert _md_total(md, "bytes written") == f"{summary['bytes_written']:,}"
    assert _md_total(md, "full fp32 every interval would write") == f"{summary['full_fp32_bytes']:,}"
    assert result["bw_reduction"] == pytest.approx(summary["full_fp32_bytes"] / summary["bytes_written"])
