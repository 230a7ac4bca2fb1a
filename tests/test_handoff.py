"""cnr.write.handoff on its own: a stand-in writer and tracker, one in-process gloo rank; table-driven
over how the writer ends the job and how it is settled."""

from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from cnr.track import agreement
from cnr.write.handoff import RUNNING, HandOff, SettleMode
from cnr.app.launch import launch
from cnr.track.state import whole_piece
from cnr.types import Role, WriteStatus
from cnr.write.job import WriteResult


class FakeWriter:
    """Finishes the job with ``status`` once ``done`` is set; ``wait(0)`` before that is None."""

    def __init__(self, status: WriteStatus, done: bool) -> None:
        self.status, self.done = status, done
        self.in_flight = None
        self.calls: List[str] = []

    def submit(self, job) -> None:
        self.in_flight = job

    def wait(self, timeout: Optional[float] = None):
        self.calls.append(f"wait({timeout})")
        if timeout == 0.0 and not self.done:
            return None
        self.in_flight = None
        return WriteResult("id", self.status, bytes_written=10, rows=3, nbytes=7)

    def cancel(self):
        self.calls.append("cancel")
        self.in_flight = None
        return WriteResult("id", WriteStatus.CANCELLED, error="cancelled by the trainer")

    def close(self) -> None:
        self.calls.append("close")


class FakeTracker:
    def __init__(self) -> None:
        self.released: List[tuple] = []

    def release(self, captured, committed: bool) -> None:
        self.released.append((tuple(captured), committed))


CASES = {
    # name: (writer status, writer finished, mode, expected status or "running", writer calls, committed)
    "wait_committed": (WriteStatus.COMMITTED, True, SettleMode.WAIT, WriteStatus.COMMITTED, ["wait(None)"], True),
    "wait_failed": (WriteStatus.FAILED, True, SettleMode.WAIT, WriteStatus.FAILED, ["wait(None)"], False),
    "abandon_running": (WriteStatus.COMMITTED, False, SettleMode.ABANDON, WriteStatus.CANCELLED,
                        ["wait(0.0)", "cancel"], False),
    "abandon_already_done": (WriteStatus.COMMITTED, True, SettleMode.ABANDON, WriteStatus.COMMITTED, ["wait(0.0)"], True),
    "poll_running": (WriteStatus.COMMITTED, False, SettleMode.POLL, "running", ["wait(0.0)"], None),
    "poll_done": (WriteStatus.COMMITTED, True, SettleMode.POLL, WriteStatus.COMMITTED, ["wait(0.0)"], True),
}


def _case(rank, world_size, name):
    status, done, mode, expected, calls, committed = CASES[name]
    writer, tracker = FakeWriter(status, done), FakeTracker()
    handoff = HandOff(writer, tracker, rank)
    assert handoff.settle(SettleMode.WAIT) is None  # nothing in flight
    piece = whole_piece("model/w", torch.arange(4.0), Role.DENSE)
    seconds = handoff.submit([piece], None, ["bits"], lambda host: ("job", len(host)), token="plan-1")
    assert seconds >= 0 and writer.in_flight == ("job", 1) and handoff.in_flight == "plan-1"
    with pytest.raises(RuntimeError, match="still in flight"):
        handoff.submit([piece], None, [], lambda host: "again", token="plan-2")
    settled = handoff.settle(mode)
    assert writer.calls == calls
    if expected == "running":
        assert settled is RUNNING and handoff.in_flight == "plan-1" and tracker.released == []
        return {}
    assert settled.status == expected and settled.token == "plan-1" and settled.committed == committed
    assert tracker.released == [(("bits",), committed)]  # bits kept only by a commit
    assert handoff.in_flight is None
    if committed:
        assert (settled.rows, settled.nbytes) == (3, 7)
    else:
        assert settled.error
    assert agreement.rank0_decides("test: a decision", lambda: ("decided", rank)) == ("decided", 0)
    return {}


@pytest.mark.parametrize("name", sorted(CASES))
def test_settle(name):
    launch(_case, 1, name)
