"""``bench chaos``: its fault proxy against the real S3 backend, its event plan, the damage it
does, and one short real run (a kill of the job and a damaged chunk, on moto through the proxy)."""

from __future__ import annotations

import random

import pytest

from cnr.bench import chaos, chaos_job
from cnr.bench.chaos_proxy import ChaosProxy
from cnr.errors import StorageError
from cnr.storage.s3 import S3Storage
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus


@pytest.fixture
def proxied(moto, s3_bucket):
    proxy = ChaosProxy(moto.endpoint, seed=3)
    storage = S3Storage(s3_bucket, "job", endpoint_url=proxy.endpoint, request_attempts=1, op_attempts=8,
                        backoff_base=0.01, backoff_max=0.02)
    yield proxy, storage
    storage.close()
    proxy.close()


def test_proxy_faults_are_injected_and_retried_through(proxied):
    proxy, storage = proxied
    proxy.fault_rate = 0.3
    for i in range(20):
        storage.put(f"k{i}", f"v{i}".encode())
        assert storage.get(f"k{i}") == f"v{i}".encode()
    injected = {k: v for k, v in proxy.counts.items() if k not in ("forwarded", "outage")}
    assert all(v > 0 for v in injected.values()), proxy.counts


def test_proxy_outage_fails_requests_until_it_ends(proxied):
    proxy, storage = proxied
    storage.put("k", b"v")
    proxy.down(30)
    with pytest.raises(StorageError):
        storage.get("k")
    assert proxy.counts["outage"] >= 8
    proxy.up()
    assert storage.get("k") == b"v"


def test_plan_has_every_kind_once_then_random():
    plan = chaos.plan_events(11, random.Random(0))
    assert len(plan) == 11 and set(plan) == set(chaos.EVENTS)
    assert plan == chaos.plan_events(11, random.Random(0))  # seeded
    assert sorted(chaos.plan_events(2, random.Random(1), ("kill_trainer", "s3_outage"))) == ["kill_trainer", "s3_outage"]


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        chaos.parse_args(["--kinds", "kill_everything"])
    with pytest.raises(SystemExit):
        chaos.parse_args(["--fault-rate", "1.5"])


def _info(ckpt_id: str, step: int, base=None) -> CheckpointInfo:
    kind = CheckpointKind.INCREMENTAL if base else CheckpointKind.FULL
    return CheckpointInfo(ckpt_id, step, kind, CheckpointStatus.COMMITTED, 32, 1, 1, base)


def test_newest_intact_skips_damaged_links():
    infos = [_info("a", 10), _info("b", 20, "a"), _info("c", 30, "b"), _info("d", 40)]
    newest = chaos.StoreWatch.newest_intact
    assert newest(None, infos, set()).id == "d"
    assert newest(None, infos, {"d"}).id == "c"
    assert newest(None, infos, {"d", "b"}).id == "a"  # c's chain goes through b
    assert newest(None, infos[:3], {"a"}) is None


def test_corruption_changes_exactly_the_target(tmp_path):
    from cnr.storage.local import LocalStorage

    storage = LocalStorage(str(tmp_path))
    storage.put("checkpoints/x/rank-00000/chunk-000000.bin", bytes(range(64)))
    storage.put("checkpoints/x/rank-00000.json", b"{}")
    storage.put("checkpoints/x/manifest.json", b'{"id": "x"}')
    rng = random.Random(0)
    key = chaos_job.corrupt_chunk(storage, "x", rng)
    assert key == "checkpoints/x/rank-00000/chunk-000000.bin"
    diff = [i for i, (a, b) in enumerate(zip(storage.get(key), bytes(range(64)))) if a != b]
    assert len(diff) == 1
    chaos_job.corrupt_manifest(storage, "x", rng)
    flipped = sum(bin(a ^ b).count("1") for a, b in zip(storage.get("checkpoints/x/manifest.json"), b'{"id": "x"}'))
    assert flipped == 1
    assert storage.get("checkpoints/x/rank-00000.json") == b"{}"


def test_short_chaos_run_loses_nothing(tmp_path):
    """The job is killed and a chunk of its newest checkpoint damaged, at world size 1: the
    restart falls back to the chain before it, trains every sample once and ends equal to the
    uninterrupted run."""
    result = chaos.run(["--events", "1", "--kinds", "corrupt_chunk", "--steps", "80", "--interval", "10",
                        "--delay-s", "0.3,0.5", "--nproc", "1", "--seed", "4", "--workdir", str(tmp_path)])
    assert result["events_by_kind"] == {"corrupt_chunk": 1}, result["events"]
    assert "damaged" in result["events"][0], result["events"]
    assert result["restores"] == 1 and result["fallbacks"] == 1, result["attempts"]
    assert result["lost_commits"] == 0, result["lost_commit_details"]
    assert result["samples_duplicated"] == 0 and result["samples_skipped"] == 0
    assert result["trace_equals_reference"] and result["final_state_equal"] and result["final_steps"] == 80
