"""cnr.write.proc: a SIGTERM is held off while a rank's bounded error path runs, then acted on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DEFERRED = """
import os, signal, sys, time
from cnr.write.proc import sigterm_deferred
with sigterm_deferred():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)  # the release a launcher's SIGTERM used to cut short
    open(sys.argv[1], "w").write("released")
print("not reached: the SIGTERM is acted on when the block ends")
"""

# A Checkpointer whose lease release is interrupted by a SIGTERM (torchrun's agent stopping a
# node's workers once another of them exited): the release runs to its end, then the process goes.
_ABORT = """
import json, os, signal, sys
if __name__ == "__main__":
    import cnr
    from cnr.storage.local import LocalStorage
    from cnr.write.lease import holder

    class Counter:
        def __init__(self): self.n = 0
        def state_dict(self): return {"n": self.n}
        def load_state_dict(self, sd): self.n = sd["n"]

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}.pg", rank=0, world_size=1)
    ckpt = cnr.Checkpointer(sys.argv[1], {"counter": Counter()}, cnr.CheckpointOptions(policy="full"))
    release = ckpt.location.release

    def interrupted_release():
        os.kill(os.getpid(), signal.SIGTERM)
        release()
        record = holder(LocalStorage(sys.argv[1]))
        print(json.dumps({"released": bool(record and record.released)}), flush=True)

    ckpt.location.release = interrupted_release
    ckpt.abort()
    print("not reached", flush=True)
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_a_sigterm_waits_for_the_block_then_ends_the_process(tmp_path):
    marker = tmp_path / "marker"
    proc = _run(_DEFERRED, str(marker))
    assert proc.returncode == -15, proc.stderr[-2000:]
    assert marker.read_text() == "released" and "not reached" not in proc.stdout


def test_an_abort_releases_the_lease_before_a_sigterm_ends_the_rank(tmp_path):
    proc = _run(_ABORT, str(tmp_path / "store"))
    assert proc.returncode == -15, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == {"released": True}, proc.stdout
