"""Fault injection for tests: act at a named point of a checkpoint's write, a training step,
or a reader process's read.

``CNR_FAULT_INJECT=[action:]<point>@<step>[@<rank>]`` makes the process that reaches ``point``
at ``step`` (on trainer rank ``rank``, default any) do ``action``. Points: the checkpoint write
of ``step`` (``before_data`` ... ``after_commit``, in the background writer; with a local tier
``before_remote_commit``: between the local and the remote commit, in the writer's flusher); ``after_step``: the
trainer, right after training step ``step`` (and recording it in the sample trace); ``after_save``: ``cnr
train``'s loop right after the Checkpointer's ``save`` of step ``step`` returned (an exception in the user's
loop, bench chaos's ``user_exception_s3``); ``read_batch``:
the reader process that reads the batch for training step ``step``; ``writer_start``: a background
writer process once started, before it takes its first job (step 0, any rank: ``sleep=5:writer_start@0``);
``merge_before_data``, ``merge_mid_data``, ``merge_before_commit``, ``merge_after_commit``: a merge
(cnr.write.merge, cnr.write.compact) of the chain ending at the increment of ``step``, in the process merging it;
``retention``: the retention rank 0's writer runs after the commit of ``step`` (the newest step
listed; cnr.policy.retention.retain_after_commit), rank 0.
Actions:
  ``kill`` (default)  SIGKILL itself, like a machine failure: no cleanup, no handlers. In the
                      background writer the trainer is killed too (it is the same machine).
  ``raise``           raise InjectedFault (a storage or encoding error).
  ``sleep=S``         sleep S seconds (a slow store), e.g. to make the next boundary overlap;
                      cut short when the checkpoint is abandoned, as a write between chunks is.
Unset in normal runs.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

ENV = "CNR_FAULT_INJECT"
POINTS = ("before_data", "mid_data", "after_data", "before_commit", "after_commit", "before_remote_commit", "after_step",
          "after_save", "read_batch", "writer_start", "retention")

# Set in the background writer: its points run there, and a machine failure takes the trainer too.
KILL_PARENT = False


class InjectedFault(RuntimeError):
    """The failure a test asked for with ``raise:``."""


def maybe_crash(point: str, step: int, rank: int, cancel: Optional[Any] = None) -> None:
    """Do what CNR_FAULT_INJECT asks if it names ``point`` at ``step`` (and ``rank``).

    ``cancel`` (an Event) ends an injected sleep early once set.
    """
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, _, target = spec.rpartition(":")
    parts = target.split("@")
    if parts[0] != point or len(parts) < 2 or int(parts[1]) != step:
        return
    if len(parts) > 2 and int(parts[2]) != rank:
        return
    if action == "raise":
        raise InjectedFault(f"injected failure at {point} of step {step}")
    if action.startswith("sleep="):
        deadline = time.monotonic() + float(action[len("sleep="):])
        while time.monotonic() < deadline and not (cancel is not None and cancel.is_set()):
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return
    if KILL_PARENT:
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def retention_fault(infos: Any) -> None:
    """Fault point ``retention`` (rank 0) for a retention about to plan over the listing ``infos``
    (CheckpointInfos): its step is the newest listed (cnr.policy.retention.retain_after_commit's ``before``)."""
    maybe_crash("retention", max((i.step for i in infos), default=0), 0)
