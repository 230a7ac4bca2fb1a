"""Whether a ``cnr train`` run's checkpoints ended committed: the summary's commit fields and the
one line for the CLI, which then exits 3 (cnr.app.console.EXIT_NOT_COMMITTED)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List, Optional

from cnr.api import Checkpointer
from cnr.format.manifest import step_of
from cnr.types import CheckpointStatus


def commit_status(saving: Optional[Checkpointer], restored_step: Optional[int]) -> Dict[str, Any]:
    """Whether this run's checkpoints ended committed: ``last_committed_step`` (the newest committed
    checkpoint's step, this run's or the restored one; None: none), and, when the checkpoints
    taken after it all failed, ``no_commit_since_step`` (that step, 0 for none) and
    ``commit_failure`` (one line for the CLI, which then exits 3). Both None otherwise.

    With a local tier, ``local_only_checkpoints`` names the checkpoints committed only on the node,
    this run's and those an earlier run left there, that its writer could not flush (the remote
    store was unreachable until the job's bounded end, a remote write failed, or another job took
    the lease), and ``last_remote_step`` the newest step the storage holds committed, as listed
    after the flush (None when it holds none or could not be listed: then this run's flushed
    checkpoints' newest). When the newest committed checkpoint (this run's, or the restored one)
    is among them, the storage lacks the job's newest state: ``commit_failure`` says so (exit 3
    too) and how to resume from the node, and ``no_commit_since_step`` is the remote step."""
    outcomes = saving.outcomes if saving is not None else []
    last = max((i.step for i in outcomes if i.status == CheckpointStatus.COMMITTED), default=restored_step)
    since = last if last is not None else 0
    failed = [i for i in outcomes if i.status != CheckpointStatus.COMMITTED and (last is None or i.step > last)]
    out: Dict[str, Any] = {"last_committed_step": last, "no_commit_since_step": None, "commit_failure": None}
    if failed:
        newest = failed[-1]
        out["no_commit_since_step"] = since
        out["commit_failure"] = (f"no checkpoint committed since step {since}: the {len(failed)} checkpoint(s) taken "
                                 f"after it failed, the newest ({newest.id}, step {newest.step}) with: "
                                 f"{(newest.error or 'no reason given')[:500]}")
    report = saving.flush_report if saving is not None else None
    if report is None:
        return out
    local_ids = list(report.local_only)
    local_only = [SimpleNamespace(id=i, step=step_of(i)) for i in local_ids]
    remote = [i.step for i in outcomes if i.status == CheckpointStatus.COMMITTED and i.id not in set(local_ids)]
    out["local_only_checkpoints"] = local_ids
    # what the storage holds, as listed after the flush; unknown (None) when it could not be listed
    out["last_remote_step"] = report.remote_newest if report.remote_listed else max(remote, default=None)
    if local_only and (failed or last is None or local_only[-1].step >= last):  # the newest state is not there
        out["no_commit_since_step"] = out["last_remote_step"] or 0
        line = _local_only_line(saving, local_only, out["last_remote_step"], report.fenced_out)
        if failed:  # after a lost lease, every later checkpoint fails
            line += (f"; the {len(failed)} checkpoint(s) taken after them failed, the newest ({failed[-1].id}, step "
                     f"{failed[-1].step}) with: {(failed[-1].error or 'no reason given')[:300]}")
        out["commit_failure"] = line
    return out


def _local_only_line(saving: Checkpointer, local_only: List[Any], remote_step: Optional[int],
                     fenced_out: Optional[str]) -> str:
    """The final line for checkpoints committed only on the node-local tier (issue #25, item 8; an
    older branch than the storage's newest, issue #38): ``remote_step``, the storage's newest step
    (None: none, or unknown)."""
    ids = ", ".join(f"{i.id} (step {i.step})" for i in local_only) if len(local_only) <= 3 else \
        f"{len(local_only)} checkpoints, {local_only[0].id} (step {local_only[0].step}) to {local_only[-1].id} (step " \
        f"{local_only[-1].step}),"
    where = saving.options.local_dir
    if fenced_out:
        why = (f"they were not flushed because another job holds the storage's lease now ({fenced_out[:300]}); "
               "nothing of theirs was written there")
        todo = f"they stay in {where}; resuming from them would flush them into that job's location"
    else:
        why = ("they had not reached the storage when the job ended, after its bounded wait for the flush (it was "
               "unreachable, or their flush failed: the warnings above say why)")
        todo = (f"they stay in {where}: resume on this node with --resume and the same checkpoint.local_dir, and "
                "the resumed job flushes them to the storage first")
    since = remote_step or 0
    if remote_step is None or local_only[-1].step > remote_step:
        head = f"no checkpoint committed to the storage {saving.uri} since step {since}: {ids} committed only on the " \
               "node-local tier"
    else:  # the storage holds a newer step of another branch: this node's is not there
        head = f"{ids} committed only on the node-local tier, not on the storage {saving.uri} (which holds step " \
               f"{remote_step} of another branch)"
    return f"{head}; {why}; {todo}"
