"""bench policies: the headline figures from a policy table, and a real (tiny) run end to end."""

from __future__ import annotations

import json

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench import policies as policies_bench
from cnr.bench.policies import summarize
from cnr.errors import ConfigError

TOLERATED = {2: 3, 3: 20, 4: 20}


def _row(policy, bits, bw, cap, data, background=1.0, mean=0.5):
    return {"policy": policy, "bits": bits, "bw_reduction": bw, "capacity_reduction": cap,
            "avg_data_bytes_per_interval": data, "max_background_s": background, "mean_background_s": mean}


def test_summary_picks_the_best_policy_at_the_bit_width_for_one_failure():
    table = [_row("one_shot", 2, 20.0, 6.0, 100), _row("consecutive", 2, 30.0, 3.0, 80),
             _row("intermittent", 2, 22.0, 7.5, 95), _row("one_shot", 8, 9.0, 3.0, 300),
             _row("intermittent", 8, 8.0, 2.0, 310, background=4.0)]
    s = summarize(table, TOLERATED, 5.0)
    assert s["bits_for_1_failure"] == 2
    assert (s["bw_reduction_best"], s["bw_reduction_best_policy"]) == (30.0, "consecutive")
    assert (s["capacity_reduction_best"], s["capacity_reduction_best_policy"]) == (7.5, "intermittent")
    assert s["intermittent_not_worse_than_one_shot"] == {"2": True, "8": False}
    assert (s["max_background_s"], s["interval_train_s"]) == (4.0, 5.0)
    assert s["targets_met"] == {"bw_reduction_best>=40": False, "capacity_reduction_best>=10": False,
                                "intermittent<=one_shot": False, "writer_keeps_up": True}
    assert summarize(table, {2: 0, 3: 0, 4: 5}, 5.0)["bits_for_1_failure"] == 4
    # one checkpoint written slower than an interval trains: the writer falls behind at that one,
    # and catches up on average
    behind = summarize(table, TOLERATED, 3.9)
    assert behind["targets_met"]["writer_keeps_up"] is False and behind["writer_keeps_up_on_average"] is True
    assert summarize(table, TOLERATED, 0.4)["writer_keeps_up_on_average"] is False


def test_bench_policies_runs_real_training(tmp_path):
    rc, out, err = run_cnr(["bench", "policies", "--config", TINY, "--intervals", "3", "--bits", "2",
                            "--policies", "one_shot,consecutive,intermittent", "--max-chain-ratio", "1.01",
                            "--set", "checkpoint.table_bits={t0: 8}", "--workdir", str(tmp_path / "w")],
                           str(tmp_path), timeout=600)
    assert rc == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    rows = {r["policy"]: r for r in result["policy_table"]}
    assert set(rows) == {"one_shot", "consecutive", "intermittent", "intermittent<=1.01"} and result["intervals"] == 3
    # the cap just above one baseline: a new baseline as soon as there is an increment to predict from
    capped = rows.pop("intermittent<=1.01")
    assert capped["kinds"] == "FiF" and capped["peak_storage_bytes"] < rows["intermittent"]["peak_storage_bytes"]
    for r in rows.values():
        assert r["checkpoints"] == 3 and r["kinds"] == "Fii" and r["bits"] == 2 and r["failed"] == 0
        # the report, from manifests, agrees with what the writers counted
        assert abs(r["avg_bytes_per_interval"] * 3 - r["bytes_written_by_writer"]) < 3
    # compaction's traffic beside the trainer's writes, as the catalog says: consecutive chains are merged by
    # default (checkpoint.compact_at_chain_ratio: tiny's increments hold about 0.3 of a baseline), the others never
    for name, r in rows.items():
        catalog = _catalog_traffic(str(tmp_path / "w" / f"{name}-2"))
        assert (r["merges"], r["compaction_read_bytes"], r["compaction_write_bytes"]) == \
            (catalog["merges"], catalog["read"], catalog["write"])
        assert r["total_storage_bytes"] == catalog["trainer"] + catalog["read"] + catalog["write"]
        assert r["bw_reduction"] >= r["total_traffic_reduction"] > 0
    assert rows["consecutive"]["merges"] >= 1 and rows["consecutive"]["compaction_read_bytes"] > 0
    assert rows["one_shot"]["merges"] == rows["intermittent"]["merges"] == 0
    assert rows["one_shot"]["total_traffic_reduction"] == rows["one_shot"]["bw_reduction"]
    # a merged chain needs less than the whole chain; one-shot keeps only the baseline and the newest increment
    assert rows["consecutive"]["peak_storage_bytes"] < rows["consecutive"]["bytes_written_by_writer"]
    assert rows["one_shot"]["peak_storage_bytes"] < rows["one_shot"]["bytes_written_by_writer"]
    # the one-shot increments hold every row since the baseline, so more than the consecutive ones
    assert rows["one_shot"]["avg_data_bytes_per_interval"] > rows["consecutive"]["avg_data_bytes_per_interval"]
    assert result["bw_reduction_best"] == max(r["bw_reduction"] for r in rows.values())
    assert 0 < result["max_background_s"] == max(r["max_background_s"] for r in result["policy_table"])
    for r in rows.values():
        assert 0 < r["mean_background_s"] <= r["max_background_s"]
    # a table plan reaches the engines: t0 at 8 bits, the others at the cell's 2
    from cnr.format.catalog import list_checkpoints, read_manifest
    from cnr.storage.local import LocalStorage

    store = LocalStorage(str(tmp_path / "w" / "consecutive-2"))
    first = read_manifest(store, list_checkpoints(store)[0].id)
    widths = {t.table.split(".")[-2]: {c.bits for c in t.chunks} for t in first.tensors.values()
              if t.role.value == "table_rows"}
    assert widths == {"t0": {8}, "t1": {2}, "t2": {2}, "t3": {2}}


def _entry(ckpt_id, base, written, fp32=1000):
    from cnr.app.report_points import Entry

    kind = "incremental" if base else "full"
    fp32 = 0 if ckpt_id.endswith(".merged") else fp32
    return Entry(ckpt_id, int(ckpt_id[:2]), kind, 2, "", base, written - 1, 1, fp32)


def test_storage_traffic_counts_each_merge_against_the_chain_it_replaced():
    from cnr.bench.common import storage_traffic

    entries = [_entry("01", None, 100), _entry("02", "01", 20), _entry("03", "02", 30), _entry("03.merged", None, 90),
               _entry("04", "03", 10), _entry("05", "04", 40), _entry("05.merged", None, 95), _entry("06", "05", 5)]
    t = storage_traffic(entries)
    # 03.merged read 01, 02, 03; 05.merged read 03.merged (its baseline by then), 04, 05
    assert (t["merges"], t["compaction_read_bytes"], t["compaction_write_bytes"]) == (2, 150 + 140, 185)
    assert (t["checkpoints"], t["trainer_written_bytes"], t["full_fp32_bytes"]) == (6, 205, 6000)
    assert t["total_storage_bytes"] == 205 + 290 + 185
    assert t["bw_reduction"] == round(6000 / 205, 3) and t["total_traffic_reduction"] == round(6000 / 680, 3)
    no_merge = storage_traffic(entries[:3])
    assert no_merge["compaction_read_bytes"] == no_merge["compaction_write_bytes"] == 0
    assert no_merge["total_traffic_reduction"] == no_merge["bw_reduction"]
    with pytest.raises(ValueError, match="03.merged"):  # its chain deleted before it was counted
        storage_traffic([e for e in entries if e.id != "02"])


def _catalog_traffic(uri):
    """Compaction traffic as the catalog says it, apart from the bench's code (tests/test_bench_restore)."""
    from test_bench_restore import _catalog_traffic as catalog

    return catalog(uri)


def test_bad_arguments_are_refused_before_any_run(tmp_path, monkeypatch):
    started = []  # in-process: the refusal comes before any rank is started
    monkeypatch.setattr(policies_bench, "launch", lambda *a, **k: started.append("launch"))
    with pytest.raises(ConfigError, match="sometimes"):
        policies_bench.run(["--config", TINY, "--workdir", str(tmp_path / "w"), "--policies", "sometimes"])
    with pytest.raises(ConfigError, match="--max-chain-ratio 0.5"):
        policies_bench.run(["--config", TINY, "--workdir", str(tmp_path / "w"), "--max-chain-ratio", "0.5"])
    assert started == [] and not (tmp_path / "w").exists()
