"""Eight real ranks on this machine (issue #39): four torchrun agents x two ranks stand in for
four nodes, each with its own local tier (``checkpoint.local_dir``), checkpointing fp32 to S3 on
the session's moto server. tiny.yaml's four tables are spread over the ranks by MIXED_SHARDING
(row-wise over all eight, table-row-wise within a node, column-wise, table-wise), and every commit
goes through the writers' exchange on rank 0's TCPStore with eight writers counting themselves in.

- A rank killed in the middle of its data (rank 5, on node 2) leaves the step-40 checkpoint
  uncommitted; the job resumed at 4x2 ends bit-exact with the uninterrupted 4x2 run.
- 8 -> 4: the 8-rank checkpoint of step 60 restored on two agents x two ranks is the same state
  (``state_sha256`` does not depend on world size or sharding); 4 -> 8: the 4-rank job trains on to
  step 80 and its checkpoint restored at 4x2 is again the same state.

The jobs' wall time and peak memory (summed Pss of every process of a job) are measured; the
memory must stay well inside this machine's 24 GB.
"""

from __future__ import annotations

import json
import os

import pytest

from cli_helpers import MIXED_SHARDING
from cnr.format.catalog import list_checkpoints
from cnr.storage.s3 import S3Storage
from cnr.types import CheckpointStatus
from torchrun_helpers import Nodes, run_nodes

OPTS = [*MIXED_SHARDING, "--set", "checkpoint.bits=32", "--set", "checkpoint.interval=20"]
PEAK_MB_LIMIT = 12_000  # half the machine: room for the test runner, moto and a second job
KILL = "mid_data@40@5"  # cnr.write.faults: rank 5's writer dies mid-data at step 40, its trainer with it


def _listed(bucket: str, prefix: str) -> list:
    storage = S3Storage(bucket, prefix)
    try:
        return [(i.step, i.status) for i in list_checkpoints(storage)]
    finally:
        storage.close()


# six jobs of 4 and 8 ranks: about 4 minutes alone on 2 cores, more beside other work
@pytest.mark.timeout(900)
def test_eight_ranks_on_four_nodes_resume_bit_exact_and_move_to_four_ranks_and_back(tmp_path, s3_bucket):
    cwd = str(tmp_path)
    job = f"s3://{s3_bucket}/job"
    full = run_nodes(cwd, 4, "--storage", f"s3://{s3_bucket}/full", *OPTS, "--set", "train.steps=60",
                     local_tier=True, name="full")
    assert (full["world_size"], full["steps"], full["checkpoints"]) == (8, 60, 3)

    killed = Nodes(cwd, 4, ["--storage", job, *OPTS, "--set", "train.steps=60"], local_tier=True,
                   env={"CNR_FAULT_INJECT": KILL}, name="killed")
    codes = killed.wait()
    assert codes[2] != 0, codes  # node 2 holds rank 5
    listed = _listed(s3_bucket, "job")
    assert listed[0] == (20, CheckpointStatus.COMMITTED), listed
    assert all(status != CheckpointStatus.COMMITTED for step, status in listed if step > 20), listed
    for node in range(4):  # each node's tier holds its own two ranks' objects
        tier = os.path.join(cwd, f"node-{node}")
        held = {d for _root, dirs, _files in os.walk(tier) for d in dirs if d.startswith("rank-")}
        assert held == {f"rank-{r:05d}" for r in (2 * node, 2 * node + 1)}, (node, held)

    resumed = run_nodes(cwd, 4, "--storage", job, *OPTS, "--set", "train.steps=60", "--resume", local_tier=True,
                        name="resumed")
    assert resumed["restored_checkpoint"].startswith("0000000020-"), resumed["restored_checkpoint"]
    for key in ("state_sha256", "eval_logloss", "eval_auc", "steps", "samples"):
        assert resumed[key] == full[key], key

    # 8 -> 4: the step-60 checkpoint on two nodes, no step trained: the same state
    at_four = run_nodes(cwd, 2, "--storage", job, *OPTS, "--set", "train.steps=60", "--resume", local_tier=True,
                        name="at-four")
    assert (at_four["world_size"], at_four["steps"]) == (4, 60)
    assert at_four["restored_checkpoint"].startswith("0000000060-")
    assert at_four["state_sha256"] == full["state_sha256"]
    # 4 -> 8: the 4-rank job trains on to step 80; its checkpoint restored on four nodes is its state
    on_four = run_nodes(cwd, 2, "--storage", job, *OPTS, "--set", "train.steps=80", "--resume", local_tier=True,
                        name="on-four")
    assert (on_four["world_size"], on_four["steps"]) == (4, 80) and on_four["state_sha256"] != full["state_sha256"]
    at_eight = run_nodes(cwd, 4, "--storage", job, *OPTS, "--set", "train.steps=80", "--resume", local_tier=True,
                         name="at-eight")
    assert (at_eight["world_size"], at_eight["steps"]) == (8, 80)
    assert at_eight["restored_checkpoint"].startswith("0000000080-")
    assert at_eight["state_sha256"] == on_four["state_sha256"]

    runs = {"full": full, "resumed": resumed, "at_four": at_four, "on_four": on_four, "at_eight": at_eight}
    figures = {name: {"seconds": s["job_seconds"], "peak_mb": s["job_peak_mb"], "processes": s["job_peak_processes"]}
               for name, s in runs.items()}
    figures["killed"] = {"seconds": round(killed.seconds, 1), "peak_mb": round(killed.memory.peak_mb)}
    print("eight-rank jobs:", json.dumps(figures))
    assert max(f["peak_mb"] for f in figures.values()) < PEAK_MB_LIMIT, figures
