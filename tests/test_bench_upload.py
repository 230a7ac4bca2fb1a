"""bench upload: the pipeline figures from a timeline, and a real (tiny) run on moto and a directory."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from cli_helpers import TINY, run_cnr
from cnr.bench import upload as upload_bench
from cnr.bench.link import Link, LinkedStorage
from cnr.bench.upload_stats import pipeline_stats
from cnr.errors import ConfigError
from cnr.storage.local import LocalStorage


def _row(key, nbytes, put_start, put_end, *encodes):
    return (key, nbytes, encodes[0][0], encodes[-1][1], put_start, put_end, encodes)


def test_pipeline_stats_from_a_timeline():
    # (key, bytes, put start, put end, chunk encodings): object 0 uploads during all of object 1's
    # encoding and half of object 2's; object 2's put never started
    timeline = [_row("a", 10, 1.0, 3.5, (0.0, 1.0)), _row("b", 20, 2.0, 4.0, (1.0, 2.0)),
                _row("c", 5, 0.0, 0.0, (3.0, 5.0))]
    s = pipeline_stats(timeline)
    assert s["objects"] == 3 and s["encode_s"] == pytest.approx(4.0)
    assert s["upload_busy_s"] == pytest.approx(3.0)  # the union of [1, 3.5] and [2, 4]
    assert s["overlap_fraction"] == pytest.approx(2.0 / 4.0)  # encodes overlapped by a put: [1, 2] and [3, 4]
    assert s["objects_stored_while_encoding"] == 2  # both stored before the last encoding ended at 5
    assert s["pipeline_s"] == pytest.approx(5.0)
    serial = pipeline_stats([_row("a", 1, 1.0, 2.0, (0.0, 1.0)), _row("b", 1, 3.0, 4.0, (2.0, 3.0))])
    assert serial["overlap_fraction"] == 0.0 and serial["objects_stored_while_encoding"] == 1
    assert pipeline_stats([])["objects"] == 0


def test_a_packed_object_counts_only_its_own_chunks_encoding():
    # the packed object "p" holds chunks encoded at [0, 1] and [5, 6]; the big chunk "b" was
    # encoded at [1, 2] and uploaded at [2, 5], while the writer waited with nothing to encode
    timeline = [_row("b", 100, 2.0, 5.0, (1.0, 2.0)), _row("p", 10, 6.0, 7.0, (0.0, 1.0), (5.0, 6.0))]
    s = pipeline_stats(timeline)
    assert s["encode_s"] == pytest.approx(3.0)  # not the packed object's 6 s span
    assert s["overlap_fraction"] == 0.0  # no chunk was encoded while "b" uploaded
    assert s["pipeline_s"] == pytest.approx(7.0)


def test_link_queues_transfers_at_its_rate(tmp_path):
    link = Link(rate=1000.0)  # bytes/s
    long_ago = time.monotonic() - 100.0  # transfers that would have arrived already: no sleeping
    link.carry(500, long_ago)
    link.carry(1000, long_ago)  # queued behind the first on the shared link
    assert link._free_at == pytest.approx(long_ago + 1.5)
    store = LinkedStorage(LocalStorage(str(tmp_path)), link)
    store.put("a/b", b"xyz")
    assert store.get("a/b") == b"xyz" and store.list("a") == ["a/b"] and store.size("a/b") == 3
    with pytest.raises(ValueError, match="link rate 0"):
        Link(0)


def test_uplink_carries_writes_and_its_spec_pickles(tmp_path):
    import pickle

    from cnr.bench.link import linked_spec
    from cnr.storage import open_storage

    spec = pickle.loads(pickle.dumps(linked_spec(str(tmp_path), 1e9)))  # as a writer process gets it
    store = open_storage(spec)
    assert isinstance(store, LinkedStorage) and isinstance(store.inner, LocalStorage)
    before = time.monotonic()
    store.put("a/b", b"x" * 4000)
    assert store.uplink._free_at >= before + 4000 / 1e9 and store.link is None
    assert store.get("a/b") == b"x" * 4000


def test_a_writer_process_opens_its_store_over_the_bench_uplink(tmp_path):
    """The bench's uplink needs no hook in the writer: the spawned writer opens the linked spec
    (unpickling it imports cnr.bench.link, which registers the scheme there) and commits."""
    import torch

    from cnr.bench.link import linked_spec
    from cnr.format.manifest import manifest_key
    from cnr.options import CheckpointOptions
    from cnr.track.snapshot import HostPiece
    from cnr.types import CheckpointKind, ShardRegion, WriteStatus
    from cnr.write.job import WriteJob
    from cnr.write.writer import Writer

    piece = HostPiece("model/w", (8, 8), ShardRegion((0, 0), (8, 8)), True, torch.ones(8, 8), None)
    job = WriteJob("0000000001-cafe", 1, CheckpointKind.FULL, None, 0, 1, [piece], manifest_fields={})
    writer = Writer(linked_spec(str(tmp_path), 1e9), CheckpointOptions(keep_last=0))
    writer.submit(job)
    result = writer.wait()
    writer.close()  # not in a finally: a writer left by a failure above is a daemon, it dies with the test
    committed = LocalStorage(str(tmp_path)).exists(manifest_key(job.ckpt_id))
    assert (result.status, committed) == (WriteStatus.COMMITTED, True), result.error


def test_bench_upload_tiny_on_s3_and_local(tmp_path):
    rc, out, err = run_cnr(["bench", "upload", "--config", TINY, "--repeats", "1", "--link-mb-s", "100"], str(tmp_path),
                           timeout=600)
    assert rc == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "upload" and result["headline_backend"] == "s3"
    for key in ("commit_over_raw_put", "restore_over_full_download", "overlap_fraction", "link_restore_over_full_download"):
        assert result[key] == result["s3"][key]
    assert result["link_mb_s"] == 100
    for backend in ("s3", "local"):
        r = result[backend]
        for key in ("commit_over_raw_put", "restore_over_full_download", "restore_fp32_over_full_download",
                    "link_restore_over_full_download", "link_restore_fp32_over_full_download"):
            assert math.isfinite(r[key]) and r[key] > 0, (backend, key, r[key])
        assert r["bytes"] == r["full_download_bytes"] > 0  # the raw puts and the download moved the same bytes
        assert 1 <= r["objects"] and 0 <= r["objects_stored_while_encoding"] <= r["objects"]
        assert 0.0 <= r["overlap_fraction"] <= 1.0
        assert r["chain_kinds"] == ["full", "incremental"] and r["bits"] == 4
        assert 1 <= r["chain_objects"] <= r["chain_chunks"]
        assert 0 < r["touched_fraction"] <= 1 and r["increment_steps"] >= 1
        assert r["baseline_bytes"] < r["bytes"]  # 4-bit rows take less than fp32 ones
        assert r["repeats"] == 1
        t = r["local_tier"]  # a local tier in front of the backend (cnr.bench.tier)
        assert 0 < t["local_commit_s"] <= t["remote_commit_s"], t
        assert 0 < t["link_local_commit_s"] <= t["link_remote_commit_s"], t
        for key in ("restore_local_s", "restore_remote_s", "link_restore_remote_s", "restore_local_over_remote",
                    "link_restore_local_over_remote", "link_remote_over_local_commit"):
            assert math.isfinite(t[key]) and t[key] > 0, (backend, key, t)
    assert result["tier_local_commit_s"] == result["s3"]["local_tier"]["local_commit_s"]


@pytest.mark.parametrize("args,message", [
    (["--backends", "gcs"], "--backends 'gcs'"),
    (["--rows-scale", "0"], "--rows-scale 0.0"),
    (["--repeats", "0"], "--repeats 0"),
    (["--bits", "5"], "--bits 5"),
    (["--touched", "1.5"], "--touched 1.5"),
    (["--link-mb-s", "-1"], "--link-mb-s -1.0"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, args, message, monkeypatch):
    started = []  # in-process: the refusal comes before any server or rank is started
    monkeypatch.setattr("cnr.testing.moto_server.MotoS3", lambda *a, **k: started.append("moto"))
    monkeypatch.setattr(upload_bench, "launch", lambda *a, **k: started.append("launch"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        upload_bench.run(["--config", TINY, "--workdir", str(tmp_path / "w"), *args])
    assert started == [] and not (tmp_path / "w").exists()
