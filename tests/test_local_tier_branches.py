"""Issue #38, defect 6: node-only checkpoints on S3 (a moto server) are flushed by every resume,
also one that takes no checkpoint, and also when another node advanced the storage meanwhile.

Two nodes are two ``checkpoint.local_dir`` values (node-0, node-1) over one S3 location. A
node-only checkpoint is committed on node-0's tier and not on S3 (its writer was killed, or
held up, before the remote commit).
"""

from __future__ import annotations

import json
from typing import Dict, List, Tuple

from cli_helpers import TINY, run_cnr

NODE_0 = ["--set", "checkpoint.local_dir=node-0"]
NODE_1 = ["--set", "checkpoint.local_dir=node-1"]


def _train(cwd: str, uri: str, *extra: str, env=None, timeout: int = 120) -> Tuple[int, Dict, str]:
    """``cnr train`` on tiny.yaml; a hang fails the test (subprocess.TimeoutExpired after ``timeout`` s)."""
    rc, out, err = run_cnr(["train", "--config", TINY, "--storage", uri, *extra], cwd, env=env, timeout=timeout)
    return rc, json.loads(out.strip().splitlines()[-1]) if out.strip() else {}, err


def _on_s3(cwd: str, uri: str) -> List[Tuple[str, str]]:
    """(id, status) of every checkpoint S3 itself holds."""
    rc, out, err = run_cnr(["inspect", uri, "--json"], cwd)
    assert rc == 0, err[-2000:]
    return [(c["id"], c["status"]) for c in json.loads(out.strip().splitlines()[-1])["checkpoints"]]


def _committed_on_s3(cwd: str, uri: str) -> List[str]:
    return [i for i, status in _on_s3(cwd, uri) if status == "committed"]


def test_a_resume_that_takes_no_checkpoint_flushes_the_node_only_ones(tmp_path, s3_bucket):
    cwd, uri = str(tmp_path), f"s3://{s3_bucket}/jobs/run-1"
    rc, _s, _err = _train(cwd, uri, *NODE_0, "--set", "train.steps=40",
                          env={"CNR_FAULT_INJECT": "before_remote_commit@40"})
    assert rc == -9
    node_only = [i for i, status in _on_s3(cwd, uri) if i.startswith("0000000040-")]
    assert len(node_only) == 1 and node_only[0] not in _committed_on_s3(cwd, uri)
    # resumed on node-0 at step 40 already: it trains nothing and takes no checkpoint; on b845da5 it
    # exited 0 with step 40 still only on node-0
    rc, resumed, err = _train(cwd, uri, *NODE_0, "--set", "train.steps=40", "--resume")
    assert rc == 0, err[-3000:]
    assert resumed["restored_checkpoint"] == node_only[0] and resumed["checkpoints"] == 0
    assert node_only[0] in _committed_on_s3(cwd, uri), err[-3000:]
    assert (resumed["last_remote_step"], resumed["local_only_checkpoints"]) == (40, [])
    # a new node (an empty local tier) restores step 40 from S3, not step 20
    rc, other, err = _train(cwd, uri, *NODE_1, "--set", "train.steps=40", "--resume")
    assert rc == 0 and other["restored_checkpoint"] == node_only[0], err[-3000:]


def test_a_node_only_branch_beside_a_newer_remote_history_is_flushed_and_the_job_ends(tmp_path, s3_bucket):
    cwd, uri = str(tmp_path), f"s3://{s3_bucket}/jobs/run-1"
    chain = ["--set", "checkpoint.policy=consecutive", "--set", "checkpoint.compact_at_chain_ratio=0",
             "--set", "checkpoint.keep_last=0"]  # nothing deleted: the test sees every branch
    # node-0: steps 40 and 60 commit on its tier while the remote commit of step 40 is held up;
    # its close gives up on the flush after commit_timeout_s (exit 3, both named local only)
    rc, first, err = _train(cwd, uri, *NODE_0, *chain, "--set", "train.steps=60", "--set",
                            "checkpoint.commit_timeout_s=3", env={"CNR_FAULT_INJECT": "sleep=20:before_remote_commit@40"})
    assert rc == 3, err[-3000:]
    branch = first["local_only_checkpoints"]
    assert [int(i.split("-")[0]) for i in branch] == [40, 60]
    # node-1 resumes from S3 (step 20) and advances it past node-0's step 40: 30, 40', 50
    rc, other, err = _train(cwd, uri, *NODE_1, *chain, "--set", "train.steps=50", "--set", "checkpoint.interval=10",
                            "--resume")
    assert rc == 0 and other["last_committed_step"] == 50, err[-3000:]
    remote_history = _committed_on_s3(cwd, uri)
    assert remote_history[-1].startswith("0000000050-") and not set(branch) & set(remote_history)
    # node-0 resumes from its own step 60 (the newest of either tier). On b845da5 its flush
    # skipped step 40 (older than S3's 50), step 60's commit waited for it, and the job hung
    # after its last step (here: TimeoutExpired)
    rc, resumed, err = _train(cwd, uri, *NODE_0, *chain, "--set", "train.steps=80", "--resume", timeout=150)
    assert rc == 0, err[-3000:]
    assert resumed["restored_checkpoint"] == branch[-1]
    on_s3 = _committed_on_s3(cwd, uri)
    assert set(branch) <= set(on_s3) and set(remote_history) <= set(on_s3)  # both branches; nothing deleted
    newest = max(on_s3, key=lambda i: int(i.split("-")[0]))
    assert newest == resumed["last_checkpoint"] and newest.startswith("0000000080-")
    assert (resumed["last_remote_step"], resumed["local_only_checkpoints"]) == (80, [])
