"""Compaction (#27): the bytes trigger and its options, merge claims, and ``python -m cnr compact``
beside a real ``cnr train`` job, on a local directory and once on S3 (moto)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from cli_helpers import ROOT, TINY, inspect, run_cnr, train
from cnr.app.config import load_config
from cnr.errors import CheckpointError, ConfigError
from cnr.format.catalog import newest_committed, read_manifest, resolve_chain
from cnr.format.layout import manifest_key, merged_id
from cnr.options import DEFAULT_COMPACT_RATIO, CheckpointOptions, OptionsError
from cnr.policy.kinds import compaction_due
from cnr.storage.local import LocalStorage
from cnr.storage.wrapper import WrapperStorage
from cnr.write.compact import ClaimHeldError, MergeSettings, claim_key, claim_space, compact_location, take_claim
from cnr.write.lease import ConditionalWriteError, Lease, LeaseHeldError, LeaseRecord, UnknownLeaseError, machine_id

EXTERNAL = ["--set", "checkpoint.policy=consecutive", "--set", "checkpoint.compaction=external"]


def test_the_bytes_trigger_and_the_count_trigger():
    assert not compaction_due([100, 30], 0, 0.25)  # no increment since the newest baseline
    assert compaction_due([100, 30], 1, 0.25) and not compaction_due([100, 20], 1, 0.25)
    assert compaction_due([100, 20, 10], 2, 0.25)  # 30 bytes since the baseline
    assert not compaction_due([100, 90, 10, 10], 2, 0.25)  # only the 2 increments since a merge count
    assert not compaction_due([100, 30], 1, 0.0) and compaction_due([100, 1, 1, 1], 3, 0.0, every=3)
    assert not compaction_due([0, 30], 1, 0.25)


def test_a_committed_merge_starts_the_recorded_byte_history_at_the_merged_baseline():
    """After a merge of c3 commits, rank 0's history (what the next manifests record, and what the
    triggers and the chain cap read) is the merged baseline's bytes, then the increments after c3."""
    from types import SimpleNamespace

    from cnr.write.engine import ChainState, CheckpointEngine

    def engine(report, last_full="f1"):
        return SimpleNamespace(merger=SimpleNamespace(reports=[report]), _merges_seen=0,
                               _merges_begun={"c3": (3, "f1")}, stats=SimpleNamespace(checkpoints=5),
                               chain=ChainState(last_full=last_full, chain_bytes=[100, 30, 30, 30, 30]))

    done = engine({"checkpoint": "c3", "merged": "c3.merged", "merged_bytes": 95})
    CheckpointEngine._absorb_merges(done)  # f1, c2, c3 committed when it began; c4, c5 since
    assert done.chain.chain_bytes == [95, 30, 30] and done._merges_seen == 1 and not done._merges_begun
    failed = engine({"checkpoint": "c3", "error": "CheckpointError: lost the lease"})
    CheckpointEngine._absorb_merges(failed)
    assert failed.chain.chain_bytes == [100, 30, 30, 30, 30]
    newer_full = engine({"checkpoint": "c3", "merged": "c3.merged", "merged_bytes": 95}, last_full="f4")
    CheckpointEngine._absorb_merges(newer_full)
    assert newer_full.chain.chain_bytes == [100, 30, 30, 30, 30]


@pytest.mark.parametrize("sets,message", [
    (["checkpoint.policy=consecutive", "checkpoint.compact_at_chain_ratio=-1"],
     "'checkpoint.compact_at_chain_ratio' = -1.0 is not allowed; it must be >= 0"),
    (["checkpoint.policy=consecutive", "checkpoint.compact_at_chain_ratio=.inf"], "= inf is not allowed"),
    (["checkpoint.compact_at_chain_ratio=0.5"], "= 0.5 needs checkpoint.policy 'consecutive', not 'intermittent'"),
    (["checkpoint.policy=consecutive", "checkpoint.compaction=cron"],
     "'checkpoint.compaction' = 'cron' is not allowed; allowed: job, external"),
    (["checkpoint.compaction=external"], "needs checkpoint.policy 'consecutive', not 'intermittent'"),
    (EXTERNAL[1::2] + ["checkpoint.merge_every=3"], "not allowed with checkpoint.compaction 'external'"),
])
def test_bad_compaction_settings_are_refused_naming_the_key(sets, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(TINY, sets)


def test_compaction_keys_load_from_yaml_and_the_default_leaves_other_policies_valid():
    config = load_config(TINY, ["checkpoint.policy=consecutive", "checkpoint.compact_at_chain_ratio=0.4"])
    assert config.checkpoint.options(60).compact_at_chain_ratio == 0.4
    assert load_config(TINY, EXTERNAL[1::2]).checkpoint.compaction == "external"
    assert CheckpointOptions(policy="consecutive").compaction_ratio() == DEFAULT_COMPACT_RATIO
    for policy in ("full", "one_shot", "intermittent"):  # unset: the policy's default (none: no chains to merge)
        assert CheckpointOptions(policy=policy).compaction_ratio() == 0.0
    assert CheckpointOptions(policy="one_shot", compact_at_chain_ratio=0).compaction_ratio() == 0
    assert load_config(TINY, ["checkpoint.policy=consecutive", "checkpoint.compact_at_chain_ratio=null"]
                       ).checkpoint.options(60).compaction_ratio() == DEFAULT_COMPACT_RATIO
    for ratio in (0.7, DEFAULT_COMPACT_RATIO):  # set explicitly, even to the consecutive default: refused
        with pytest.raises(OptionsError, match=f"CheckpointOptions.compact_at_chain_ratio = {ratio} needs"):
            CheckpointOptions(policy="full", compact_at_chain_ratio=ratio)
    with pytest.raises(ConfigError, match="checkpoint.compact_at_chain_ratio' = 0.25 needs checkpoint.policy 'consecutive'"):
        load_config(TINY, ["checkpoint.compact_at_chain_ratio=0.25"])
    with pytest.raises(OptionsError, match="compact_at_chain_ratio = 'x' is not allowed"):
        CheckpointOptions(policy="consecutive", compact_at_chain_ratio="x")


def test_one_claim_per_merged_id_and_a_dead_claimer_is_taken_over(tmp_path):
    storage = LocalStorage(str(tmp_path / "store"))
    first = take_claim(storage, "0000000010-aa.merged", ttl_s=30)
    with pytest.raises(ClaimHeldError, match=f"another process is merging into 0000000010-aa.merged on .*pid {os.getpid()}"):
        take_claim(storage, "0000000010-aa.merged", ttl_s=30)
    take_claim(storage, "0000000020-bb.merged", ttl_s=30).release(delete=True)  # another id: its own claim
    first.release(delete=True)
    assert storage.list("compact") == []
    # a claim whose process died on this machine is taken over at once; the old claimer may not commit
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    now = time.time()
    record = LeaseRecord(0, "killed", "here", machine_id(), int(dead.stdout), 1, now, now, 30.0)
    storage.put(claim_key("0000000030-cc.merged", 0), record.to_bytes())
    taker = take_claim(storage, "0000000030-cc.merged", ttl_s=30)
    assert taker.record.generation == 1
    taker.check()
    stale = Lease(storage, record, space=claim_space("0000000030-cc.merged"))
    with pytest.raises(CheckpointError, match="this merge lost the merge claim on 0000000030-cc.merged"):
        stale.check()
    stale.release(delete=True)  # not its record any more: the taker's stays
    assert storage.list("compact") == [claim_key("0000000030-cc.merged", 1)]
    taker.release(delete=True)
    assert storage.list("compact") == []


class _IgnoresIfNoneMatch(WrapperStorage):
    """A store that overwrites on a conditional create (as some S3-compatible stores do)."""

    def put_if_absent(self, key, data):
        self.inner.put(key, data)
        return True


def test_a_claim_on_a_store_that_ignores_conditional_writes_is_refused(tmp_path):
    """Two compactors on such a store would both "win" one merged id: the claim runs the lease's
    conditional-write probe, so the merge is refused before it writes anything."""
    storage = _IgnoresIfNoneMatch(LocalStorage(str(tmp_path / "store")))
    with pytest.raises(ConditionalWriteError, match="does not honour conditional writes"):
        take_claim(storage, "0000000010-aa.merged", ttl_s=30)
    assert storage.list("") == []


def test_a_damaged_claim_record_is_taken_over_and_an_unknown_key_refused(tmp_path):
    storage = LocalStorage(str(tmp_path / "store"))
    storage.put(claim_key("0000000010-aa.merged", 0), b"not json")
    claim = take_claim(storage, "0000000010-aa.merged", ttl_s=30)
    assert claim.record.generation == 1
    claim.release(delete=True)
    storage.put("compact/0000000010-aa.merged/other.txt", b"?")
    with pytest.raises(UnknownLeaseError, match="compact/0000000010-aa.merged/other.txt"):
        take_claim(storage, "0000000010-aa.merged", ttl_s=30)


@pytest.mark.parametrize("args,message", [
    (["--min-chain-ratio", "-1"], "--min-chain-ratio -1.0 is not allowed"),
    (["--min-chain-ratio", "nan"], "--min-chain-ratio nan is not allowed"),
    (["--keep-last", "-2"], "--keep-last -2 is not allowed; it must be from 0 to"),
    (["--keep-last", "99999999999999999999"], "--keep-last 99999999999999999999 is not allowed; it must be from 0 "
                                              "to 2147483647"),
    (["--chunk-bytes", "100"], "--chunk-bytes 100 is not allowed; it must be from 4096 to 2147483647"),
    (["--chunk-bytes", "99999999999999999999"], "--chunk-bytes 99999999999999999999 is not allowed"),
    (["--threads", "0"], "--threads 0 is not allowed; allowed: 1..256"),
    (["--threads", "257"], "--threads 257 is not allowed; allowed: 1..256"),
    (["--lease-ttl-s", "0.5"], "--lease-ttl-s 0.5 is not allowed; it must be from 1 to 86400"),
    (["--checkpoint", "a/b"], "--checkpoint 'a/b' is not allowed"),
    (["--checkpoint", ".."], "--checkpoint '..' is not allowed; give a checkpoint id"),
    (["--checkpoint", "."], "--checkpoint '.' is not allowed"),
])
def test_compact_refuses_bad_arguments_before_any_work(tmp_path, args, message):
    from cnr.app.cli import build_parser
    from cnr.app.compact import compact

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        compact(build_parser().parse_args(["compact", str(tmp_path / "store"), *args]))
    assert not os.path.exists(tmp_path / "store")


def test_compact_refuses_a_location_that_is_no_directory_or_a_checkpoints_folder(short_chain, tmp_path):
    """A cron compactor given a mistyped path would otherwise report nothing to merge forever."""
    (tmp_path / "file").write_text("x")
    cases = [(tmp_path / "missing", "no such directory"), (tmp_path / "file", "not a directory"),
             (f"{short_chain}/checkpoints", f"is the checkpoints folder of a location; give the location itself: {short_chain}")]
    for where, message in cases:
        rc, _out, err = run_cnr(["compact", str(where)], str(tmp_path))
        assert rc == 2 and message in err and err.count("\n") == 1, (where, err)
    assert not (tmp_path / "missing").exists()


def test_compact_cli_exits_2_with_one_error_line(tmp_path):
    rc, _out, err = run_cnr(["compact", str(tmp_path / "store"), "--keep-last", "-2"], str(tmp_path))
    assert rc == 2 and err.strip() == ("error: compact --keep-last -2 is not allowed; it must be from 0 to 2147483647 (0 "
                                       "deletes nothing)")
    assert not os.path.exists(tmp_path / "store")


@pytest.fixture(scope="module")
def short_chain(tmp_path_factory):
    """A consecutive chain of a job that compacts externally: full at 10, increments at 20 and 30."""
    cwd = str(tmp_path_factory.mktemp("compact"))
    train(cwd, "ck", *EXTERNAL, "--set", "checkpoint.interval=10", "--set", "train.steps=30",
          "--set", "checkpoint.keep_last=1")
    return f"{cwd}/ck"


def test_compacting_with_no_job_takes_the_lease_so_a_starting_job_is_refused(short_chain, tmp_path, monkeypatch):
    shutil.copytree(short_chain, tmp_path / "ck")
    storage = LocalStorage(str(tmp_path / "ck"))
    (tmp_path / "fresh").mkdir()  # an empty location: a job that has not committed yet
    rc, out, _err = run_cnr(["compact", str(tmp_path / "fresh")], str(tmp_path))
    assert rc == 0 and json.loads(out.splitlines()[-1])["reason"] == "no committed checkpoint"
    import cnr.write.compact as compact

    real, refused = compact.merge_chain, []

    def merging(*args, **kwargs):
        with pytest.raises(LeaseHeldError) as e:  # a job starting while the compactor merges
            Lease.acquire(storage, ttl_s=30)
        refused.append(str(e.value))
        return real(*args, **kwargs)

    monkeypatch.setattr(compact, "merge_chain", merging)
    chain = resolve_chain(storage, newest_committed(storage))
    summary = compact_location(storage, None, MergeSettings(65536, keep_last=1))
    assert refused and summary["lease"] == "held by this process"
    assert summary["merged"] == merged_id(chain[-1].id) and summary["chain_links"] == 3
    assert summary["bytes_read"] >= sum(m.bytes for m in chain) and summary["bytes_written"] >= summary["merged_bytes"]
    # after the commit, the chain it replaced stays: it is the only other copy of its state, so one damaged
    # object of the merged baseline must not leave nothing to restore (cnr.policy.retention)
    assert summary["retention"]["deleted"] == []
    assert [m.id for m in resolve_chain(storage, newest_committed(storage))] == [summary["merged"]]
    Lease.acquire(storage, ttl_s=30).release()  # and released at the end


def test_compact_against_s3(short_chain, tmp_path, moto, s3_bucket):
    from cnr.storage.s3 import S3Storage

    store = S3Storage(s3_bucket, "jobs/run-1")
    local = LocalStorage(short_chain)
    try:
        for key in local.list(""):
            if not key.startswith("lease/"):
                store.put(key, local.get(key))
        chain = resolve_chain(store, newest_committed(store))
        rc, out, err = run_cnr(["compact", f"s3://{s3_bucket}/jobs/run-1", "--keep-last", "0"], str(tmp_path),
                               env={"AWS_ENDPOINT_URL": moto.endpoint})
        assert rc == 0, err[-3000:]
        summary = json.loads(out.splitlines()[-1])
        assert summary["merged"] == merged_id(chain[-1].id) and summary["committed_now"]
        assert summary["bytes_read"] > 0 and summary["bytes_written"] > 0 and summary["retention"] is None
        assert [m.id for m in resolve_chain(store, read_manifest(store, chain[-1].id))] == [summary["merged"]]
        assert not store.list("compact")
    finally:
        store.close()


@pytest.mark.slow  # two cnr train runs beside a compactor: ~15 s on an idle 2-core machine
def test_compacting_beside_a_training_job_loses_neither_ones_work(tmp_path, baseline_ws1):
    """A real `cnr train` (compaction: external) writes while this process compacts the location over
    and over: the compactor commits merged baselines and deletes nothing, the job's own retention
    drops the superseded chains, and the job resumes bit-exact."""
    opts = [*EXTERNAL, "--set", "checkpoint.interval=5", "--set", "checkpoint.keep_last=1"]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    env.pop("CNR_FAULT_INJECT", None)
    job = subprocess.Popen([sys.executable, "-m", "cnr", "train", "--config", TINY, "--storage", "ck", *opts,
                            "--set", "train.steps=55"], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    storage = LocalStorage(str(tmp_path / "ck"))
    beside = []
    while job.poll() is None:
        if newest_committed(storage) is not None:
            summary = compact_location(storage, None, MergeSettings(65536, keep_last=1))
            if summary["merged"] and summary["lease"].startswith("held by a live job"):
                beside.append(summary)
        time.sleep(0.02)
    out, err = job.communicate()
    assert job.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1])["checkpoints"] == 11
    assert any(s["committed_now"] for s in beside), "no merge committed while the job ran"
    assert all(s["retention"] is None for s in beside)  # the compactor deleted nothing
    listed = inspect(str(tmp_path), "ck")
    assert all(not c["id"].startswith("0000000005-") for c in listed)  # the job's retention dropped the old chain
    resumed = train(str(tmp_path), "ck", *opts, "--resume")
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]
    assert not storage.exists(manifest_key("nothing")) and not storage.list("compact")
