"""Two torchrun agents on this machine stand in for two nodes (``--nnodes 2 --nproc-per-node 2``,
rendezvous on 127.0.0.1): a 2x2 job checkpoints to shared storage, resumes bit-exact at 2x2,
and its last checkpoint restores at 1x2 and 1x1 to the same state. The model is DCN with a
wide over-arch, so its dense part (2.6 MB and its Adagrad state) outweighs the tables: each
rank writes a share of it (cnr.track.shares), rank 0 no more than 1.2x the mean. Each node has its
own local tier (``checkpoint.local_dir``): it holds only that node's ranks' objects, the 1x2
restore reads node 0's tier and the remote store, the 1x1 restore (a node without the tier)
the remote store alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cli_helpers import MIXED_SHARDING, ROOT, TINY, train
from cnr.format.catalog import list_checkpoints
from cnr.storage.checkpoint_store import local_tier_root
from cnr.format.manifest import parse_rank_index, rank_index_key
from cnr.storage.local import LocalStorage
from torchrun_helpers import run_nodes

TIMEOUT_S = 300

MODEL = [*MIXED_SHARDING, "--set", "model.arch=dcn", "--set", "model.over_arch=[1024,512,1]"]


def _two_nodes(cwd: str, *extra: str, local_tier: bool = False) -> dict:
    """One job on two torchrun agents (nodes 0 and 1, two ranks each); rank 0's summary.
    ``local_tier``: node N's local tier is ``<cwd>/node-N``."""
    return run_nodes(cwd, 2, "--storage", "ck", *MODEL, *extra, local_tier=local_tier, timeout=TIMEOUT_S)


def test_two_nodes_resume_bit_exact_and_restore_on_one_node(tmp_path):
    cwd = str(tmp_path)
    full = _two_nodes(cwd, "--set", "train.steps=40", "--storage", "full")
    assert full["world_size"] == 4 and full["steps"] == 40
    first = _two_nodes(cwd, "--set", "train.steps=20", local_tier=True)
    assert first["steps"] == 20 and first["state_sha256"] != full["state_sha256"]
    storage = LocalStorage(os.path.join(cwd, "ck"))
    ckpt = list_checkpoints(storage)[-1].id
    for node in (0, 1):  # each node's tier holds its own ranks' objects and the manifest (cnr.write.peer_exchange)
        held = LocalStorage(local_tier_root(os.path.join(cwd, f"node-{node}"), storage)).list(f"checkpoints/{ckpt}")
        assert {k.split("/")[2][:10] for k in held} - {"manifest.j", "flushed.js"} == \
            {f"rank-{r:05d}" for r in (2 * node, 2 * node + 1)}
        assert f"checkpoints/{ckpt}/manifest.json" in held
        # rank 0's tier records that the manifest reached the storage (cnr.write.local_flush)
        assert (f"checkpoints/{ckpt}/flushed.json" in held) == (node == 0)
    per_rank = [sum(c.nbytes for t in parse_rank_index(storage.get(rank_index_key(ckpt, r))).tensors.values()
                    for c in t.chunks) for r in range(4)]
    assert per_rank[0] <= 1.2 * sum(per_rank) / 4, per_rank
    resumed = _two_nodes(cwd, "--set", "train.steps=40", "--resume", local_tier=True)
    for key in ("state_sha256", "eval_logloss", "steps", "samples"):
        assert resumed[key] == full[key], key
    # the 2x2 job's checkpoint of step 40 on one node: two ranks (1x2), then one (1x1)
    env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "cnr", "train",
         "--config", TINY, "--storage", "ck", *MODEL, "--set", "train.steps=40", "--resume",
         "--set", "checkpoint.local_dir=node-0"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    at_two = json.loads(proc.stdout.strip().splitlines()[-1])
    at_one = train(cwd, "ck", *MODEL, "--set", "train.steps=40", "--resume")
    for summary in (at_two, at_one):
        assert summary["steps"] == 40 and summary["state_sha256"] == full["state_sha256"]
    assert (at_two["world_size"], at_one["world_size"]) == (2, 1)
