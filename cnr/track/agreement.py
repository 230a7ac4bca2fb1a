"""Rank agreement: every step the ranks take together goes through one of these helpers.

A step's local part runs inside a try on every rank that has one; the ranks then exchange what
each got (its value or its exception), and when any rank failed, every rank raises the same
``RankAgreementError`` naming the step and each failing rank's error (on a failing rank its own
exception is the ``__cause__``). So no rank is left waiting in a collective that a failed rank
never reaches, and no rank goes on alone. (The shape of torch.distributed.checkpoint's
``_DistWrapper``.)

- ``all_gather(step, local)``: ``local()`` on every rank; every rank gets every rank's value.
- ``rank0_decides(step, decide)``: ``decide()`` on rank 0 alone, its value broadcast; rank 0's
  exception reaches every rank.
- ``barrier(step, local)``: ``local()`` on every rank, each keeping its own value; only "did any
  rank fail" is exchanged (one small all-reduce; the errors are gathered only when some failed).

Every helper is collective over the default process group: every rank must call the same helper
with the same ``step`` in the same order. With no process group, or a world of one rank, there is
no one to agree with: the local part runs and its own exception propagates unchanged (a
single-process job keeps each call's documented error type).

Step names say what is agreed, as ``"<operation>: <what>"`` (operations: open, save, commit,
restore, publish, train), e.g. ``"restore: checkpoint X fits the application"``.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

from cnr.errors import CnrError, RankAgreementError
from cnr.track.collectives import all_reduce_host

T = TypeVar("T")


class RankError(CnrError):
    """Another rank's exception that could not be sent as itself (it does not pickle): its type
    name and message."""


def world() -> Tuple[int, int]:
    """(this rank, world size) of the default process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_and_world(who: str) -> Tuple[int, int]:
    """(this rank, world size) of the default process group, which ``who`` needs: RuntimeError
    naming it when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who} needs torch.distributed's default process group "
                           "(dist.init_process_group), as torchrec's DistributedModelParallel does")
    return dist.get_rank(), dist.get_world_size()


def portable(error: BaseException) -> BaseException:
    """``error`` itself when it survives pickling, else a RankError naming its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception type may refuse to pickle
        return RankError(f"{type(error).__name__}: {error}")


# What a rank sends: (True, its value pickled) or (False, its exception). The value is pickled
# inside the try, so a value that does not pickle fails this rank's step, not the collective.
_Outcome = Tuple[bool, Any]


def _run(local: Callable[[], Any]) -> Tuple[_Outcome, Optional[BaseException]]:
    try:
        return (True, pickle.dumps(local())), None
    except Exception as e:  # noqa: BLE001 - every rank raises it below
        return (False, portable(e)), e


def _raise_failures(step: str, outcomes: List[_Outcome], own: Optional[BaseException]) -> None:
    failures: Dict[int, BaseException] = {r: v for r, (ok, v) in enumerate(outcomes) if not ok}
    if failures:
        raise RankAgreementError(step, failures) from own


def all_gather(step: str, local: Callable[[], T]) -> List[T]:
    """``local()`` on every rank; every rank gets the list of every rank's value, in rank order,
    or raises RankAgreementError(step, ...) when ``local`` raised on any rank (collective)."""
    rank, size = world()
    if size == 1:
        return [local()]
    mine, own = _run(local)
    everyone: List[Any] = [None] * size
    dist.all_gather_object(everyone, mine)
    _raise_failures(step, everyone, own)
    return [pickle.loads(value) for _ok, value in everyone]


def rank0_decides(step: str, decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0 alone; every rank gets its value, or raises RankAgreementError(step,
    {0: its exception}) when it raised (collective)."""
    rank, size = world()
    if size == 1:
        return decide()
    own: Optional[BaseException] = None
    box: List[Any] = [None]
    if rank == 0:
        box[0], own = _run(decide)
    dist.broadcast_object_list(box, src=0)
    _raise_failures(step, [box[0]], own)  # index 0: rank 0's outcome
    return pickle.loads(box[0][1])


def barrier(step: str, local: Callable[[], T]) -> T:
    """``local()`` on every rank, which keeps its own value; raises RankAgreementError(step, ...)
    on every rank when ``local`` raised on any (collective). Cheap when none failed: a one-element
    all-reduce, with the errors gathered only after it says some rank failed."""
    rank, size = world()
    if size == 1:
        return local()
    value: Optional[T] = None
    own: Optional[BaseException] = None
    try:
        value = local()
    except Exception as e:  # noqa: BLE001 - every rank raises it below
        own = e
    failed = torch.tensor([0 if own is None else 1], dtype=torch.int64)
    all_reduce_host(failed, op=dist.ReduceOp.MAX)
    if int(failed[0]):
        everyone: List[Any] = [None] * size
        dist.all_gather_object(everyone, None if own is None else portable(own))
        raise RankAgreementError(step, {r: e for r, e in enumerate(everyone) if e is not None}) from own
    return value  # type: ignore[return-value]
