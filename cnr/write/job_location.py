"""A job's protocol with its checkpoint location: the lease, the history (lineage) it writes, the
records of what a restore passed over, and which steps it may save at.

cnr.api.Checkpointer calls, in this order (collective: every rank of the default process group
calls it, and when rank 0's part fails every rank raises the same error, inside the
RankAgreementError of the named agreement step when there is more than one rank):

1. ``JobLocation.open`` (collective): rank 0 takes the location's lease and renews it from now
   on, lists the newest committed checkpoint of the current history, and draws a lineage id; when
   nothing is committed there, or the job starts a new history on purpose, rank 0 records that
   lineage as the location's current history.
2. After a restore, ``restored`` (collective): rank 0 records the checkpoints the restore passed
   over as abandoned (no later restore takes them back), the job continues the restored
   checkpoint's history, which rank 0 records as current, and saves must go above its step.
3. Before each save, ``check_save`` (not collective; the same answer on every rank): refuses a
   second history beside committed checkpoints, and a step at or below the newest committed,
   restored or saved one; then ``saved``.
4. ``release`` (not collective): rank 0 releases the lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from cnr.errors import CheckpointError, CnrError
from cnr.format.abandoned import record_abandoned
from cnr.format.catalog import restore_ids
from cnr.format.lineage import new_lineage_id, record_activation
from cnr.format.documents import Manifest
from cnr.format.layout import step_of
from cnr.storage.base import Storage
from cnr.track import agreement
from cnr.types import LeaseRef, RetentionScope
from cnr.write.lease import Lease


@dataclass
class JobLocation:
    """What a job holds of its location. ``newest``: (id, step) of the committed checkpoint a
    restore tries first when the job opened it (None: nothing committed). ``lineage``: the history
    its checkpoints join. ``pinned``: what retention keeps for this job whatever is newer (a
    checkpoint restored past damage or by id). ``step_floor``: (step, what) a save must be above."""

    storage: Storage
    lease: Optional[Lease]  # rank 0's; None elsewhere
    lease_ref: LeaseRef  # which generation holds it, on every rank
    newest: Optional[Tuple[str, int]]
    lineage: str
    new_history: bool
    restored: bool = False
    pinned: Tuple[str, ...] = ()
    step_floor: Optional[Tuple[int, str]] = None

    @classmethod
    def open(cls, storage: Storage, lease_storage: Storage, ttl_s: float, new_history: bool) -> "JobLocation":
        """Step 1 (collective): take ``lease_storage``'s lease (the remote store's, under a
        node-local tier), then list ``storage``'s newest committed checkpoint and draw a lineage;
        the lease is released again when a later part fails."""
        lease, ref = take_lease(lease_storage, ttl_s)
        try:
            newest = _newest_on_rank0(storage)  # after the lease: a job that committed before it was taken is seen
            lineage: str = agreement.rank0_decides("open: a new lineage id", new_lineage_id)
            if newest is None or new_history:  # a new history: the location's current one from now on
                _activate_on_rank0(storage, "open", lineage, "", newest is not None)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        # ids sort by step, so a save at a lower step would never be the newest of its history (a new
        # history's steps start afresh: restores prefer it, cnr.format.lineage)
        floor = (newest[1], f"the newest committed checkpoint {newest[0]} in {storage.uri}") \
            if newest is not None and not new_history else None
        return cls(storage, lease, ref, newest, lineage, bool(new_history), step_floor=floor)

    def restored_into(self, manifest: Manifest, skipped: Sequence[Any], by_id: bool) -> None:
        """Step 2 (collective): ``manifest`` was restored; ``skipped``: the newer checkpoints the
        restore passed over as damaged (cnr.restore.newest.Skipped); ``by_id``: it was named by id."""
        _abandon_on_rank0(self.storage, list(skipped), manifest.id)  # before saves may go past them
        self.restored = True
        self.lineage = manifest.lineage  # the job continues the restored checkpoint's history
        # not the newest committed (a fallback past damage, or one named by id): retention keeps it
        passed_over = bool(skipped) or (by_id and (self.newest is None or manifest.id != self.newest[0]))
        self.pinned = (manifest.id,) if passed_over else ()
        # newer checkpoints a fallback passed over are damaged: saves may go past them; one named
        # by id leaves the newer ones standing, and a restore takes the highest step
        floor = (manifest.step, f"the restored checkpoint {manifest.id}")
        self.step_floor = max(floor, self.step_floor) if by_id and self.step_floor else floor
        # a checkpoint of a history that is not the current one: it is again (cnr.format.lineage)
        _activate_on_rank0(self.storage, "restore", self.lineage, manifest.id, False)

    def check_history(self, what_to_do: str = "") -> None:
        """CheckpointError unless the job may save here: it restored a checkpoint, starts a new
        history on purpose, or the location held no committed checkpoint when it took the lease
        (rank 0 listed it then: the same on every rank). ``what_to_do``: the remedy to name."""
        if self.restored or self.new_history or self.newest is None:
            return
        newest, step = self.newest
        raise CheckpointError(
            f"{self.storage.uri} already holds committed checkpoints (newest {newest}, step {step}) and this "
            "Checkpointer restored none: its checkpoints would start a second history there. "
            + (what_to_do or "Call restore() first to continue from it, pass Checkpointer(..., new_history=True) to "
               "start a new history there on purpose (the old one is kept), or give an empty location"))

    def check_save(self, step: int) -> None:
        """Step 3 (not collective): refuse a save at ``step`` before anything is snapshotted
        (``check_history``'s CheckpointError; ValueError at or below the step floor)."""
        self.check_history()
        if self.step_floor is not None and step <= self.step_floor[0]:
            raise ValueError(f"step {step} is not allowed: it must be above {self.step_floor[0]}, the step of "
                             f"{self.step_floor[1]} (a restore takes the checkpoint with the highest step)")

    def saved(self, step: int) -> None:
        self.step_floor = (step, "the previous save()")

    def retention(self) -> RetentionScope:
        """What this job's retention may delete: its history's checkpoints, never the pinned ones."""
        return RetentionScope(self.lineage, self.pinned)

    def release(self) -> None:
        """Step 4: rank 0 releases the lease (not collective)."""
        if self.lease is not None:
            self.lease.release()


def take_lease(storage: Storage, ttl_s: float) -> Tuple[Optional[Lease], LeaseRef]:
    """Rank 0 takes the storage location's lease (cnr.write.lease) and renews it from now on; when
    it cannot, every rank raises (collective; rank 0's LeaseHeldError or storage error, inside the
    RankAgreementError every rank raises when there is more than one). Returns rank 0's Lease (None
    elsewhere) and, on every rank, which generation it is: every rank's writer checks it before
    flushing after a remote outage (cnr.storage.tiered)."""
    taken: List[Lease] = []

    def acquire() -> Tuple[int, str]:
        taken.append(Lease.acquire(storage, ttl_s))
        return taken[0].ref.generation, taken[0].ref.owner

    held = agreement.rank0_decides(f"open: take the lease on {storage.uri}", acquire)
    lease = taken[0] if taken else None
    if lease is not None:
        lease.start_renewing()
    return lease, LeaseRef(*held)


def _record_on_rank0(storage: Storage, step: str, record: Callable[[], Any], what: str) -> None:
    """Rank 0 runs ``record`` (it stores ``what`` under the lease); when it could not, every rank
    raises (collective): a CheckpointError naming ``what``, inside the RankAgreementError of the
    agreement step ``"<step>: record <what>"`` when there is more than one rank."""
    def attempt() -> None:
        try:
            record()
        except CnrError as e:
            raise CheckpointError(f"could not record {what} at {storage.uri}: {type(e).__name__}: {e}") from e

    agreement.rank0_decides(f"{step}: record {what}", attempt)


def _activate_on_rank0(storage: Storage, step: str, lineage: str, restored_from: str, beside_others: bool) -> None:
    """Rank 0 makes ``lineage`` the location's current history (cnr.format.lineage.record_activation)."""
    _record_on_rank0(storage, step, lambda: record_activation(storage, lineage, restored_from, beside_others),
                     "this job's history (lineage)")


def _abandon_on_rank0(storage: Storage, skipped: List[Any], restored_id: str) -> None:
    """Rank 0 records each checkpoint a restore passed over as abandoned (cnr.format.abandoned;
    nothing to do when none was)."""
    if skipped:
        _record_on_rank0(storage, "restore", lambda: [record_abandoned(storage, s.id, restored_id, s.reason)
                                                      for s in skipped],
                         "the checkpoints this restore passed over as abandoned (a later restore could take them back)")


def _newest_on_rank0(storage: Storage) -> Optional[Tuple[str, int]]:
    """(id, step) of the committed checkpoint a restore tries first under ``storage`` (the
    current history's newest, cnr.format.lineage), listed by rank 0 and the same on every rank
    (collective); None when nothing is committed."""
    ids = agreement.rank0_decides("open: find the newest committed checkpoint", lambda: restore_ids(storage)[:1])
    return (ids[0], step_of(ids[0])) if ids else None
