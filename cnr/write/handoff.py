"""The sequence checkpoints and publishes share: rank 0 decides, every rank snapshots into host
buffers and hands the job to its background writer, then all agree on how it ended.

``HandOff`` owns one rank's writer, host buffers and the tracker bits the in-flight job took;
one job is in flight at a time. Rank 0's writer commits, so rank 0's report is the outcome every
rank acts on: a committed job keeps the tracker views it cleared, any other gives their bits
back so the rows go out with the next job. cnr.write.engine (CheckpointEngine) and cnr.publish.publisher
(Publisher) differ only in what they decide and record around it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar, Union

import torch

from cnr.track import agreement
from cnr.track.snapshot import HostBuffers, HostPiece
from cnr.track.state import StatePiece
from cnr.track.tracker import Captured, RowTracker
from cnr.errors import CnrError
from cnr.types import WriteStatus
from cnr.write.job import Pending, WriteJob, WriteResult
from cnr.write.writer import Writer

T = TypeVar("T")  # the owner's token of a job in flight


class SettleMode(enum.Enum):
    """How ``HandOff.settle`` ends the in-flight job."""

    WAIT = "wait"
    """Every rank waits for its own writer to finish the job."""
    ABANDON = "abandon"
    """Every rank cancels its writer's job unless it has already finished."""
    POLL = "poll"
    """Rank 0 looks without waiting; while its writer runs nothing is settled (``RUNNING``)."""


RUNNING = Pending.RUNNING
"""What ``settle(SettleMode.POLL)`` returns while rank 0's writer is still busy."""


@dataclass(frozen=True)
class Settled(Generic[T]):
    """How the in-flight job ended, the same on every rank.

    ``status``: rank 0's writer's report. ``rows``/``nbytes``: the rows and stored bytes rank 0's
    commit recorded (0 unless committed). ``result``: this rank's own writer's report (None when
    its writer had nothing in flight). ``token``: what the owner passed to ``submit``.
    """

    status: WriteStatus
    rows: int
    nbytes: int
    result: Optional[WriteResult]
    token: T

    @property
    def committed(self) -> bool:
        return self.status == WriteStatus.COMMITTED

    @property
    def error(self) -> str:
        """Why it did not commit, as this rank knows it."""
        if self.result is not None and self.result.error:
            return self.result.error
        return "another rank's writer failed"

    @property
    def failure(self) -> Optional[CnrError]:
        """This rank's writer's error as an object (cnr.errors.portable), None when it had none."""
        return self.result.failure if self.result is not None else None


class HandOff(Generic[T]):
    """One rank's writer, host buffers and in-flight job (see the module docstring)."""

    def __init__(self, writer: Writer, tracker: Optional[RowTracker], rank: int, step: str = "commit",
                 what: str = "checkpoint") -> None:
        """``step``/``what``: the operation and the job's noun in its agreement step's name."""
        self.writer = writer
        self.tracker = tracker
        self.rank = rank
        self.world_size = agreement.world()[1]
        self.step, self.what = step, what
        self.buffers = HostBuffers()
        self._captured: List[Captured] = []
        self._token: Optional[T] = None

    @property
    def in_flight(self) -> Optional[T]:
        """The token of the job in flight, else None."""
        return self._token

    def submit(self, pieces: Sequence[StatePiece], row_ids: Optional[Dict[str, torch.Tensor]],
               captured: List[Captured], make_job: Callable[[List[HostPiece]], WriteJob], token: T) -> float:
        """The snapshot (copy ``pieces``, only ``row_ids`` of the tables when given, into host
        buffers) and the hand-off of ``make_job(host pieces)`` to the writer. ``captured``: the
        tracker bits this job took. Returns the snapshot's seconds."""
        if self._token is not None:
            raise RuntimeError(f"{self._token!r} is still in flight; settle it first")
        host, seconds = self.buffers.capture(list(pieces), row_ids)
        self.writer.submit(make_job(host))
        self._captured, self._token = list(captured), token
        return seconds

    def settle(self, mode: SettleMode) -> Union[Settled[T], Pending, None]:
        """End the in-flight job as ``mode`` says and agree on its outcome (collective).

        Returns a Settled, None when nothing was in flight, or RUNNING (POLL while rank 0's
        writer is busy: nothing changes).
        """
        ended: List[Optional[WriteResult]] = [None]

        def end() -> Tuple[Union[WriteStatus, Pending], int, int]:
            """This rank's part: how its writer's job ended, and the rows and bytes rank 0 committed."""
            result: Optional[WriteResult] = None
            if mode == SettleMode.POLL:
                if self.rank == 0 and self.writer.in_flight is not None:
                    result = self.writer.wait(timeout=0.0)
                    state = result.status if result is not None else Pending.RUNNING
                else:
                    state = Pending.NOTHING
            else:
                if self.writer.in_flight is not None:
                    result = self.writer.wait(timeout=0.0) if mode == SettleMode.ABANDON else None
                    if result is None:
                        result = self.writer.cancel() if mode == SettleMode.ABANDON else self.writer.wait()
                state = result.status if result is not None else Pending.NOTHING
            ended[0] = result
            if result is None or self.rank != 0:
                return state, 0, 0
            return state, result.rows, result.nbytes

        # rank 0's writer commits, so its report is the outcome
        state, rows, nbytes = agreement.all_gather(f"{self.step}: how the in-flight {self.what} ended", end)[0]
        if state is Pending.RUNNING:
            return RUNNING
        if state is Pending.NOTHING and self._token is None:
            return None
        status = state if isinstance(state, WriteStatus) else WriteStatus.FAILED
        if mode == SettleMode.POLL and self.world_size > 1:
            def follow() -> None:
                """Rank 0 has settled: this rank's part is stored already if it committed."""
                if self.rank != 0 and self.writer.in_flight is not None:
                    ended[0] = self.writer.wait(timeout=0.0) or (
                        self.writer.wait() if status == WriteStatus.COMMITTED else self.writer.cancel())

            agreement.barrier(f"{self.step}: every rank's writer ended the {self.what} as rank 0's did", follow)
        if self.tracker is not None:
            self.tracker.release(self._captured, status == WriteStatus.COMMITTED)
        settled = Settled(status, rows, nbytes, ended[0], self._token)
        self._captured, self._token = [], None
        return settled

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Stop the writer (``timeout_s``: Writer.close's) and free the host buffers."""
        self.writer.close(timeout_s)
        self.buffers.close()

