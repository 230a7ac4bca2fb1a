"""bench restore: its summary (pure) and a real tiny run, where newest-first equals replay."""

from __future__ import annotations

import json
import re
import time

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench.restore import _summary


def _runs(seconds):
    return [{"seconds": s, "bytes": 100, "rows_from_increments": 7} for s in seconds]


def test_the_summary_takes_medians_and_reads_the_longest_chain_against_the_target():
    out = {"runs": {"baseline": _runs([1.0, 9.0, 2.0]), "chain5": _runs([2.5, 2.4, 2.6]),
                    "replay_chain5": _runs([6.0, 6.0, 6.0])},
           "exact": {"5": True}, "chain_bytes": {"5": [10, 2, 3, 4, 5, 6]},
           "chain_rows": {"0": [100], "5": [100, 5, 5, 5, 5, 5]}}
    got = _summary(out, [5])
    assert got["baseline_s"] == 2.0 and got["chain5_over_baseline"] == 1.25 and got["replay_chain5_over_baseline"] == 3.0
    assert got["chain5_stored_bytes"] == 30 and got["bit_exact"] == {"5": True}
    # 2.5 s for 30 bytes against 2.0 s for the baseline's 10: 0.0833 s/byte over 0.2
    assert got["chain5_s_per_byte_over_baseline"] == pytest.approx(2.5 / 30 / (2.0 / 10), abs=1e-4)
    assert (got["baseline_rows"], got["chain5_increment_rows"], got["chain5_rows_from_increments"]) == (100, 25, 7)
    # #27's targets: seconds per stored byte <= 1.3 at every length (0.42 here), a 1-link chain <= 1.35
    assert got["targets_met"] == {"chain5_s_per_byte_over_baseline<=1.3": True, "newest_first_equals_replay": True}
    out["exact"]["5"] = False
    assert not _summary(out, [5])["targets_met"]["newest_first_equals_replay"]
    out["runs"]["chain1"], out["chain_bytes"]["1"], out["chain_rows"]["1"] = _runs([2.8, 2.8, 2.8]), [10, 2], [100, 5]
    out["runs"]["replay_chain1"], out["exact"]["1"] = _runs([3.0, 3.0, 3.0]), True
    met = _summary(out, [1, 5])["targets_met"]
    # 1.4x the baseline for 1.2x its bytes: per byte 1.17 (met), the 1-link target not
    assert met["chain1_over_baseline<=1.35"] is False and met["chain1_s_per_byte_over_baseline<=1.3"] is True


def test_tiny_run(tmp_path):
    rc, out, err = run_cnr(["bench", "restore", "--config", TINY, "--links", "1,3", "--repeats", "2",
                            "--peer-steps", "5", "--api-repeats", "2", "--set", "checkpoint.interval=5"], str(tmp_path))
    assert rc == 0, err[-3000:]
    got = json.loads(out)
    assert got["bit_exact"] == {"1": True, "3": True}
    # the chains are measured as written: every compaction trigger off (cnr.bench.restore.no_compaction)
    assert (got["merges"], got["compaction_read_bytes"], got["compaction_write_bytes"]) == (0, 0, 0)
    assert got["total_storage_bytes"] >= got["chain3_stored_bytes"]
    # the 3-link chain: newest-first reads less than replay (older dense copies, superseded baseline chunks)
    assert got["chain3_bytes_read"] < got["replay_chain3_bytes_read"]
    assert got["chain3_stored_bytes"] > got["chain1_stored_bytes"] > 0
    # the increments' distinct rows: at most the rows they store, and at most the table's
    for k in (1, 3):
        assert 0 < got[f"chain{k}_rows_from_increments"] <= min(got[f"chain{k}_increment_rows"], got["baseline_rows"])
    assert got["chain1_rows_from_increments"] == got["chain1_increment_rows"]  # one link: every row is distinct
    assert set(got["targets_met"]) == {"chain1_over_baseline<=1.35", "chain1_s_per_byte_over_baseline<=1.3",
                                       "chain3_s_per_byte_over_baseline<=1.3", "newest_first_equals_replay",
                                       "peer_bit_exact", "full32_over_dcp_load<=1.0", "int4_chain_over_dcp_load<=1.0",
                                       "restore_api_over_dcp<=1.0", "restore_api_exact"}
    # against dcp.load: both restores gave back the state saved, the 4-bit chain the same state twice
    assert got["peer_bit_exact"] is True and got["peer_steps"] == 5
    assert got["full32_restore_s"] > 0 and got["dcp_load_s"] > 0 and got["int4_chain_restore_s"] > 0
    # of the unrounded seconds: those printed are rounded to ms, which moves a ratio of tiny times by ~1%
    assert got["full32_over_dcp_load"] == pytest.approx(got["full32_restore_s"] / got["dcp_load_s"], rel=0.01, abs=0.01)
    baseline_bytes, increment_bytes = got["int4_chain_bytes"]
    assert 0 < increment_bytes < baseline_bytes < got["full32_bytes"]  # 4-bit rows, fewer of them in the increment
    # Checkpointer.restore() as users call it (cnr.bench.restore_api): every restore gave the saved state back
    assert got["restore_api_exact"] is True
    for kind in ("fresh", "settled", "dcp", "int4"):
        spread = got[f"restore_api_{kind}_s"]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert got["restore_api_over_dcp"] == pytest.approx(
        got["restore_api_fresh_s"]["median"] / got["restore_api_dcp_s"]["median"], rel=0.01, abs=1e-3)
    for kind in ("fresh", "settled", "int4"):
        phases = got["restore_api_phases_s"][kind]
        # each link's manifest read as stored and its rank indexes read once (cnr.format.split), and
        # for the 4-bit chain's increment the look for a merged baseline of each link (none); the
        # data path entered once; the phases and the rest add up to the restore
        reads = 2 if kind != "int4" else 2 * 2 + 2
        assert phases["calls"]["manifest"] == reads and phases["calls"]["data"] == 1, (kind, phases["calls"])
        assert phases["calls"]["verify_rank_indexes"] == (2 if kind == "int4" else 1)  # a link each
        assert 0 < phases["data"] < got[f"restore_api_{kind}_s"]["max"]
        assert phases["outside_data"] > 0


@pytest.mark.parametrize("args,message", [
    (["--links", "0,5"], "--links '0,5' is not allowed"),
    (["--links", "x"], "--links 'x' is not allowed"),
    (["--bits", "5"], "--bits 5 is not allowed"),
    (["--repeats", "0"], "--repeats 0 is not allowed"),
    (["--peer-steps", "-1"], "--peer-steps -1 is not allowed"),
    (["--api-repeats", "-1"], "--api-repeats -1 is not allowed"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, monkeypatch, args, message):
    from cnr.bench import restore as restore_bench
    from cnr.bench import restore_run
    from cnr.errors import ConfigError

    # in-process, as test_bad_run_values_are_refused_before_any_work: no rank is started (a
    # ConfigError is what `cnr bench` turns into exit status 2 and its message: test_bad_input)
    started = []
    monkeypatch.setattr(restore_bench, "launch", lambda *a, **k: started.append("launch"))
    monkeypatch.setattr(restore_run, "launch", lambda *a, **k: started.append("launch"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        restore_bench.run(["--config", TINY, "--workdir", str(tmp_path / "w"), *args])
    assert started == [] and not (tmp_path / "w").exists()


def _catalog_traffic(uri):
    """Compaction traffic as the catalog says it, apart from the bench's code: each merged baseline
    writes its stored bytes and reads the chain resolve_chain gives for the increment it stands for
    before it existed (that increment's base's chain, then the increment)."""
    from cnr.app.report import collect
    from cnr.format.catalog import read_manifest, resolve_chain
    from cnr.format.layout import MERGED_SUFFIX
    from cnr.storage import open_storage

    store = open_storage(uri)
    try:
        written = {p.entry.id: p.entry.written for p in collect(store).points}
        merged = [i for i in written if i.endswith(MERGED_SUFFIX)]
        read = 0
        for m in merged:
            increment = read_manifest(store, m[: -len(MERGED_SUFFIX)])
            chain = resolve_chain(store, read_manifest(store, increment.base)) + [increment]
            read += sum(written[link.id] for link in chain)
        trainer = sum(n for i, n in written.items() if i not in merged)
        return {"merges": len(merged), "read": read, "write": sum(written[m] for m in merged), "trainer": trainer}
    finally:
        store.close()


def test_a_run_restores_after_every_interval_and_counts_compaction_from_the_store(tmp_path):
    # keep_last 0: everything stays in the store, for the catalog's count; merge_every 2: merges
    rc, out, err = run_cnr(["bench", "restore", "--config", TINY, "--run", "4", "--workdir", str(tmp_path / "w"),
                            "--set", "checkpoint.interval=5", "--set", "checkpoint.policy=consecutive",
                            "--set", "checkpoint.merge_every=2", "--set", "checkpoint.keep_last=0"], str(tmp_path))
    assert rc == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["policy"] == "consecutive" and got["run_intervals"] == 4 and got["run_checkpoints"] == 4
    assert len(got["run_restore_s"]) == 4 and all(s > 0 for s in got["run_restore_s"])
    assert got["run_chain_links"][0] == 1  # the first interval's checkpoint is the baseline
    worst = got["run_worst_over_baseline"]
    assert 0 < worst < float("inf") and worst == pytest.approx(
        max(got["run_restore_s"]) / got["run_baseline_restore_s"], rel=0.01)
    assert got["run_median_over_baseline"] <= worst
    # every restore checked: 3 baseline restores and one per interval; the replay on the first increment and the last
    assert got["run_restores_checked"] == 4 + 3 and got["targets_met"]["every_restore_checked"] is True
    assert got["run_replay_checked_intervals"] == [2, 4] and got["run_fallbacks"] == 0
    assert 0 < got["run_max_row_rel_l2"] <= 0.7
    # compaction: at least one merge, and its bytes as the catalog says
    catalog = _catalog_traffic(str(tmp_path / "w" / "run"))
    assert got["run_merges"] == catalog["merges"] >= 1
    assert got["run_compaction_read_bytes"] == catalog["read"] > 0
    assert got["run_compaction_write_bytes"] == catalog["write"] > 0
    assert got["run_trainer_written_bytes"] == catalog["trainer"]
    assert got["run_total_storage_bytes"] == catalog["trainer"] + catalog["read"] + catalog["write"]
    assert got["run_bw_reduction"] == pytest.approx(got["run_full_fp32_bytes"] / catalog["trainer"], abs=1e-3)
    assert got["run_total_traffic_reduction"] < got["run_bw_reduction"]


def test_the_run_summary_reads_every_interval_against_the_baseline_median():
    from cnr.bench.restore_run import summarize_run

    traffic = {"bw_reduction": 42.0, "total_traffic_reduction": 20.0, "trainer_written_bytes": 10,
               "full_fp32_bytes": 420, "compaction_read_bytes": 7, "compaction_write_bytes": 4,
               "total_storage_bytes": 21, "merges": 2, "checkpoints": 4}
    out = {"baseline_s": [1.0, 3.0, 2.0], "restore_s": [2.0, 5.0, 3.0, 2.2], "links": [1, 2, 1, 2],
           "merged": [False, False, True, True], "merging": [False, True, False, False], "fallbacks": 0,
           "replay_checked": [2, 4], "check_s": 1.0, "max_row_l2": 0.3, "train_s": 9.0, "wall_s": 12.0,
           "traffic": traffic, "gc_s": [0.0, 0.17, 0.0, 0.0], "baseline_gc_s": [0.0, 0.0, 0.16]}
    got = summarize_run(out, 4)
    assert got["run_restore_full_gc_s"] == {"2": 0.17} and got["run_baseline_full_gc_s"] == [0.0, 0.0, 0.16]
    assert (got["run_baseline_restore_s"], got["run_worst_over_baseline"], got["run_worst_interval"]) == (2.0, 2.5, 2)
    assert got["run_median_over_baseline"] == pytest.approx((1.1 + 1.5) / 2)
    assert got["run_restores_during_merge"] == [2] and got["run_worst_over_baseline_no_merge_running"] == 1.5
    assert (got["run_restores_from_merged"], got["run_restores_checked"], got["run_merges"]) == (2, 7, 2)
    assert (got["run_bw_reduction"], got["run_compaction_read_bytes"], got["run_total_storage_bytes"]) == (42.0, 7, 21)
    assert got["targets_met"] == {"run_worst_over_baseline<=2.0": False, "run_bw_reduction>=40": True,
                                  "every_restore_checked": True}


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "x"])
def test_bad_run_values_are_refused_before_any_work(tmp_path, monkeypatch, value):
    from cnr.bench import restore as restore_bench
    from cnr.bench import restore_run
    from cnr.errors import ConfigError

    started = []  # in-process: the refusal comes before any rank is started
    monkeypatch.setattr(restore_bench, "launch", lambda *a, **k: started.append("launch"))
    monkeypatch.setattr(restore_run, "launch", lambda *a, **k: started.append("launch"))
    with pytest.raises(ConfigError, match=f"--run '{value}' is not allowed; give a number of checkpoint intervals, "
                                          "an integer >= 1"):
        restore_bench.run(["--config", TINY, "--workdir", str(tmp_path / "w"), "--run", value])
    assert started == [] and not (tmp_path / "w").exists()


def test_a_run_restore_stops_the_merge_worker_and_the_writer_as_a_crash_would():
    """While a ``--run`` restore is timed, the job's merge worker and writer are stopped (neither
    shares the cores with it, as after a crash) and both go on after it, also when it fails."""
    import subprocess
    from types import SimpleNamespace

    from cnr.bench.restore_run import _background_stopped

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def running(pid: int) -> bool:  # SIGCONT is delivered asynchronously too
        deadline = time.monotonic() + 5
        while state(pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.001)
        return state(pid) != "T"

    merge, writer = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        ckpt = SimpleNamespace(engine=SimpleNamespace(merger=SimpleNamespace(worker_pid=merge.pid),
                                                      handoff=SimpleNamespace(writer=SimpleNamespace(pid=writer.pid))))
        with pytest.raises(RuntimeError, match="the restore failed"):
            with _background_stopped(ckpt):
                assert (state(merge.pid), state(writer.pid)) == ("T", "T")
                raise RuntimeError("the restore failed")
        assert running(merge.pid) and running(writer.pid)
        ckpt.engine.merger = None  # no merge configured: the writer alone
        with _background_stopped(ckpt):
            assert state(writer.pid) == "T"
        assert running(writer.pid)
    finally:
        for p in (merge, writer):
            p.kill()
            p.wait()


def test_gc_pauses_count_the_full_collections_inside_and_none_after():
    """``GcPauses`` adds up the seconds of each generation's collections while it is open, and
    leaves ``gc.callbacks`` as it found them."""
    import gc

    from cnr.bench.restore_run import GcPauses

    before = list(gc.callbacks)
    gc.disable()  # only the collections asked for below (callbacks still see explicit ones)
    try:
        with GcPauses() as pauses:
            gc.collect(2)
            gc.collect(0)
    finally:
        gc.enable()
    assert pauses.seconds[2] > 0 and pauses.seconds[0] > 0 and pauses.seconds[1] == 0
    assert gc.callbacks == before
    full = pauses.seconds[2]
    gc.collect(2)
    assert pauses.seconds[2] == full


def test_a_run_compares_with_the_replay_before_the_background_goes_on(monkeypatch):
    """The replay check reads the restored chain while the job's merge worker and writer are still
    stopped: once they go on, a merge that commits lets the writer's retention delete its links
    (a 60-interval run failed so, reading a baseline just deleted). Not timed."""
    import subprocess
    from types import SimpleNamespace

    from cnr.bench import restore_run

    def state(pid: int) -> str:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    merge, writer = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    seen = {}
    try:
        chain = ["baseline", "increment"]
        restored = SimpleNamespace(chain=chain)
        monkeypatch.setattr(restore_run, "restore_newest", lambda *a, **k: (restored, []))

        def replay(model, storage, replayed, threads):
            seen["states"] = (state(merge.pid), state(writer.pid))
            seen["chain"] = replayed
            time.sleep(0.05)
            return True

        monkeypatch.setattr(restore_run, "_replay_equal", replay)
        ckpt = SimpleNamespace(engine=SimpleNamespace(merger=SimpleNamespace(worker_pid=merge.pid),
                                                      handoff=SimpleNamespace(writer=SimpleNamespace(pid=writer.pid))),
                               storage="store", app={}, rank=0, world_size=1, uri="uri",
                               options=SimpleNamespace(restore_threads=2, on_damage="fallback"))
        timed = restore_run._restore(ckpt, model=object(), replay=True)
        assert seen == {"states": ("T", "T"), "chain": chain}
        assert timed.replay_equal is True and timed.replay_s >= 0.05 > timed.seconds  # the replay is not timed
        assert restore_run._restore(ckpt, object()).replay_equal is None  # no replay asked: none made
    finally:
        for p in (merge, writer):
            p.kill()
            p.wait()
