"""A Checkpointer's life at its edges (issue #24, items 10-12): a program that exits without
``wait()``/``close()`` finishes (or names) its in-flight checkpoint; a script without the
``if __name__ == "__main__":`` guard is refused with what to do; the first ``save()`` neither
waits for the writer process to start nor allocates host buffers. Scripts run as subprocesses
(exit paths), the rest on real spawned gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cnr
from cnr.app.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A job at world size 1 on a plain module; ``BODY`` is what it does with its Checkpointer.
SCRIPT = textwrap.dedent('''
    import os, sys, threading
    import torch, torch.distributed as dist
    import cnr

    def main():
        workdir = sys.argv[1]
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=0, world_size=1)
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32)
        ckpt = cnr.Checkpointer(os.path.join(workdir, "ck"), {"model": model}, cnr.CheckpointOptions(policy="full"))
    BODY
''')


def _script(tmp_path, body: str, tail: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT.replace("BODY", textwrap.indent(textwrap.dedent(body), "    ")) + textwrap.dedent(tail))
    return str(path)


def _run(path: str, workdir, env: dict = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, path, str(workdir)], capture_output=True, text=True, timeout=timeout,
                          cwd=str(workdir), env=full_env)


GUARDED = '''
if __name__ == "__main__":
    main()
'''

SAVE_AND_LEAVE = '''
    pending = ckpt.save(5)
    torch.save(model.state_dict(), os.path.join(workdir, "saved.pt"))
    print("ID", pending.id, flush=True)
'''

SLOW_WRITE = {"CNR_FAULT_INJECT": "sleep=2:before_data@5"}  # surely still in flight at exit


def test_exit_without_wait_or_close_finishes_the_checkpoint(tmp_path):
    """Item 10: the atexit hook names the in-flight checkpoint and its step, waits for the writer
    (no collective is needed: rank 0's writer commits), and the checkpoint holds the saved state."""
    proc = _run(_script(tmp_path, SAVE_AND_LEAVE, GUARDED), tmp_path, SLOW_WRITE)
    assert proc.returncode == 0, proc.stderr
    ckpt_id = proc.stdout.split("ID ")[1].split()[0]
    head = f"checkpoint {ckpt_id} (step 5) was still being written when the program exited without"
    assert head in proc.stderr and f"checkpoint {ckpt_id} (step 5) committed at exit" in proc.stderr, proc.stderr
    stored = cnr.load_state_dict(str(tmp_path / "ck"), "model")
    saved = torch.load(tmp_path / "saved.pt")
    assert stored.keys() == saved.keys() and all(torch.equal(stored[k], saved[k]) for k in saved)


def test_exit_on_an_exception_abandons_the_checkpoint_by_name(tmp_path):
    """Item 10: an uncaught exception ends the program: the checkpoint is abandoned at once (the
    ranks may have parted ways), with a warning naming it; nothing is committed."""
    body = SAVE_AND_LEAVE + '''
    raise RuntimeError("the training loop failed")
'''
    proc = _run(_script(tmp_path, body, GUARDED), tmp_path, SLOW_WRITE)
    assert proc.returncode != 0 and "the training loop failed" in proc.stderr
    ckpt_id = proc.stdout.split("ID ")[1].split()[0]
    assert f"checkpoint {ckpt_id} (step 5) was still being written" in proc.stderr, proc.stderr
    assert "it was abandoned and not committed" in proc.stderr, proc.stderr
    with pytest.raises(Exception, match="no committed checkpoint|nothing is committed|No committed|not found"):
        cnr.load_state_dict(str(tmp_path / "ck"), "model")


def test_script_without_main_guard_is_refused_with_what_to_do(tmp_path):
    """Item 11: the Checkpointer is refused before any writer starts (spawn would re-run the
    script in it), naming the line and the guard; no hang, no writer death, no lease error."""
    proc = _run(_script(tmp_path, "    ckpt.save(1).wait()\n", "\nmain()\n"), tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "UnguardedMainError" in proc.stderr and "job.py:" in proc.stderr, proc.stderr
    assert 'Put the training code under `if __name__ == "__main__":`' in proc.stderr
    assert "writer process died" not in proc.stderr and "Lease" not in proc.stderr


def test_writer_rerunning_an_unguarded_script_names_the_cause(tmp_path):
    """Item 11: where the parent cannot see the unguarded call (a thread runs the job), the writer
    process that re-runs the script exits with its own code, and the trainer's error says why."""
    body = '''
    try:
        ckpt.save(1).wait()
    except cnr.CheckpointError as e:
        print("ERROR", e, flush=True)
        sys.exit(3)
'''
    tail = "\nthread = threading.Thread(target=main)\nthread.start()\nthread.join()\n"
    proc = _run(_script(tmp_path, body, tail), tmp_path, timeout=180)
    assert "ERROR" in proc.stdout, proc.stderr
    assert 'the script has no `if __name__ == "__main__":` guard' in proc.stdout, proc.stdout


def _first_save(rank: int, world_size: int, arg: dict) -> dict:
    import cnr.write.at_exit as at_exit
    from cnr.write.engine import pieces_to_write, rng_piece
    from examples.two_tower import build

    dmp, adam, sched = build(world_size)
    ckpt = cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": adam, "sched": sched},
                            cnr.CheckpointOptions(policy="intermittent"))
    assert id(ckpt) in at_exit._LIVE  # item 10: its atexit hook is registered while it is live
    buffers = ckpt.engine.buffers
    buffers.wait_prepared()
    pieces = pieces_to_write(ckpt.app.pieces(), rank, world_size) + [rng_piece(rank)]
    missing = [p.name for p in pieces if not buffers.holds(p)]
    pending = ckpt.save(1)
    writer_ready = ckpt.engine.writer.ready.is_set()
    info = pending.wait()
    ckpt.close()
    assert id(ckpt) not in at_exit._LIVE  # close() unregistered it
    return {"missing": missing, "allocations": buffers.allocations, "writer_ready": writer_ready,
            "committed": info.id == pending.id}


def test_first_save_waits_neither_for_the_writer_nor_for_buffers(tmp_path, monkeypatch):
    """Item 12: the host buffers of a full snapshot exist once the Checkpointer is built (the first
    save allocates none), and save() returns while the writer process is still starting (made
    slow here); the writer takes the job once up, and it commits."""
    monkeypatch.setenv("CNR_FAULT_INJECT", "sleep=8:writer_start@0")
    result = launch(_first_save, 2, {"uri": str(tmp_path / "ck")})
    assert result == {"missing": [], "allocations": 0, "writer_ready": False, "committed": True}


def _save_after_restore(rank: int, world_size: int, arg: dict) -> dict:
    from cnr.write.engine import pieces_to_write, rng_piece
    from examples.two_tower import build

    dmp, adam, sched = build(world_size)
    app = {"model": dmp, "optim": adam, "sched": sched}
    with cnr.Checkpointer(arg["uri"], app, cnr.CheckpointOptions(policy="full")) as first:
        first.save(1).wait()
    ckpt = cnr.Checkpointer(arg["uri"], app, cnr.CheckpointOptions(policy="full"))
    buffers = ckpt.engine.buffers
    pieces = pieces_to_write(ckpt.app.pieces(), rank, world_size) + [rng_piece(rank)]
    buffers.wait_prepared()
    before = sum(buffers.holds(p) for p in pieces)
    writer_before = ckpt.engine.writer.started
    ckpt.restore()
    writer_after = ckpt.engine.writer.started
    buffers.wait_prepared()
    missing = [p.name for p in pieces if not buffers.holds(p)]
    info = ckpt.save(2).wait()
    ckpt.close()
    # never restored: nothing started, and it closes all the same
    idle = cnr.Checkpointer(arg["uri"], app, cnr.CheckpointOptions(policy="full"))
    idle_started = idle.engine.writer.started
    idle.close()
    return {"held_before_restore": before, "writer_before_restore": writer_before, "writer_after": writer_after,
            "missing": missing, "allocations": buffers.allocations, "committed": info.step == 2,
            "idle_started": idle_started}


def test_where_checkpoints_stand_the_background_starts_after_restore(tmp_path):
    """#39 item 5: a Checkpointer over committed checkpoints must restore before it saves, and a job
    restores at once: the writer process's startup and faulting in a full snapshot's buffers
    would compete with the restore for the cores. Neither starts before restore(); both after
    it, so the first save allocates no buffer, and it commits."""
    result = launch(_save_after_restore, 1, {"uri": str(tmp_path / "ck")})
    assert result == {"held_before_restore": 0, "writer_before_restore": False, "writer_after": True,
                      "missing": [], "allocations": 0, "committed": True, "idle_started": False}
