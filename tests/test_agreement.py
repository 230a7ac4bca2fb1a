"""cnr.track.agreement: each helper's value, and its error on every rank when one rank's part
raises. One process without a process group, and real spawned gloo ranks under a deadline (a
rank still running after it is a hang, and fails the test).

``run_ranks`` is the spawner tests/test_rank_agreement.py uses too: unlike cnr.app.launch, which
stops every rank once one fails, it lets each rank record its own outcome, so a rank left waiting
in a collective shows as a hang."""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import cnr
from cnr.errors import CheckpointError, CnrError, RankAgreementError
from cnr.track import agreement

RankFn = Callable[[int, int, Any], Dict[str, Any]]


def _entry(rank: int, world_size: int, fn: RankFn, arg: Any, workdir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
    out = fn(rank, world_size, arg)
    with open(os.path.join(workdir, f"out-{rank}.json"), "w") as f:
        json.dump(out, f)
    # a rank that is done lives on (as a job's would) until every rank is: a peer left waiting
    # in a collective then waits until the deadline, instead of erring when this process exits
    while len([n for n in os.listdir(workdir) if n.startswith("out-")]) < world_size:
        time.sleep(0.1)
    os._exit(0)  # no teardown: gloo's threads may still hold work objects (cnr.app.launch)


def run_ranks(fn: RankFn, arg: Any, timeout_s: float, world_size: int = 2) -> List[Dict[str, Any]]:
    """``fn(rank, world_size, arg)`` on ``world_size`` spawned gloo ranks; every rank's returned
    dict, in rank order. AssertionError when a rank is still running after ``timeout_s`` seconds
    (the ranks are killed): a rank waiting in a collective another rank left is a hang."""
    with tempfile.TemporaryDirectory(prefix="cnr-agree-") as workdir:
        context = mp.start_processes(_entry, args=(world_size, fn, arg, workdir), nprocs=world_size, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                        p.join()
                done = sorted(n for n in os.listdir(workdir) if n.startswith("out-"))
                raise AssertionError(f"a hang: ranks still running after {timeout_s} s (finished: {done})")
        outs = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"out-{rank}.json")) as f:
                outs.append(json.load(f))
        return outs


def outcome(call: Callable[[], Any]) -> Dict[str, Any]:
    """What ``call()`` did, as JSON: its value, or its error's type, step, failing ranks and message."""
    try:
        return {"value": call()}
    except RankAgreementError as e:
        return {"error": type(e).__name__, "step": e.step, "ranks": sorted(e.failures),
                "kinds": [type(f).__name__ for _r, f in sorted(e.failures.items())], "message": str(e)}
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        return {"error": type(e).__name__, "message": str(e)}


class _Unpicklable(Exception):
    def __init__(self, lock: Any) -> None:
        super().__init__("holds a lock")
        self.lock = lock


def _fail(message: str) -> Any:
    raise ValueError(message)


def _each_helper(rank: int, world_size: int, arg: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    out["gather"] = outcome(lambda: agreement.all_gather("test: gather", lambda: rank * 10))
    out["gather_one_fails"] = outcome(lambda: agreement.all_gather(
        "test: gather", lambda: _fail("rank 1's part") if rank == 1 else rank))
    out["gather_all_fail"] = outcome(lambda: agreement.all_gather("test: gather", lambda: _fail(f"rank {rank}")))
    out["gather_value_does_not_pickle"] = outcome(lambda: agreement.all_gather(
        "test: gather", lambda: threading.Lock() if rank == 1 else rank))
    out["decide"] = outcome(lambda: agreement.rank0_decides("test: decide", lambda: ("rank 0 decided", rank)))
    out["decide_fails"] = outcome(lambda: agreement.rank0_decides("test: decide", lambda: _fail("rank 0's decision")))
    out["barrier"] = outcome(lambda: agreement.barrier("test: barrier", lambda: rank + 100))
    out["barrier_one_fails"] = outcome(lambda: agreement.barrier(
        "test: barrier", lambda: _fail("rank 0's part") if rank == 0 else rank))
    out["error_does_not_pickle"] = outcome(lambda: agreement.barrier(
        "test: barrier", lambda: (_ for _ in ()).throw(_Unpicklable(threading.Lock())) if rank == 1 else rank))
    out["after"] = outcome(lambda: agreement.all_gather("test: still in step", lambda: rank))
    return out


def test_one_process_runs_the_local_part_and_keeps_its_error():
    """No process group: the value is the local one, and the local error propagates unchanged."""
    assert not dist.is_initialized()
    assert agreement.all_gather("test: gather", lambda: 3) == [3]
    assert agreement.rank0_decides("test: decide", lambda: "d") == "d"
    assert agreement.barrier("test: barrier", lambda: 4) == 4
    with pytest.raises(ValueError, match="mine"):
        agreement.barrier("test: barrier", lambda: _fail("mine"))
    with pytest.raises(ValueError, match="mine"):
        agreement.rank0_decides("test: decide", lambda: _fail("mine"))


def test_the_error_names_the_step_and_the_failing_ranks_and_pickles():
    error = RankAgreementError("save: collect app_state", {1: TypeError("bad key 'x'"), 0: ValueError("v")})
    assert isinstance(error, CheckpointError) and isinstance(error, CnrError)
    assert str(error).startswith("save: collect app_state failed on ranks 0, 1")
    assert "rank 0: ValueError: v" in str(error) and "rank 1: TypeError: bad key 'x'" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is RankAgreementError and again.step == error.step and str(again) == str(error)
    assert sorted(again.failures) == [0, 1]
    assert cnr.RankAgreementError is RankAgreementError


def test_an_exception_that_does_not_pickle_travels_as_its_type_and_message():
    sent = agreement.portable(_Unpicklable(threading.Lock()))
    assert isinstance(sent, agreement.RankError) and str(sent) == "_Unpicklable: holds a lock"
    plain = ValueError("x")
    assert agreement.portable(plain) is plain


def test_two_ranks_raise_the_same_error_when_one_rank_fails_and_stay_in_step():
    """Each helper at 2 ranks: its values when no rank fails; when one rank's part raises (or its
    value does not pickle), every rank raises RankAgreementError naming the step and that rank;
    the ranks stay in step afterwards (a later all-gather agrees)."""
    outs = run_ranks(_each_helper, None, timeout_s=120)
    for rank, out in enumerate(outs):
        assert out["gather"] == {"value": [0, 10]}
        assert out["decide"] == {"value": ["rank 0 decided", 0]}
        assert out["barrier"] == {"value": rank + 100}
        assert out["after"] == {"value": [0, 1]}
    expected = {"gather_one_fails": ("test: gather", [1]), "gather_all_fail": ("test: gather", [0, 1]),
                "gather_value_does_not_pickle": ("test: gather", [1]), "decide_fails": ("test: decide", [0]),
                "barrier_one_fails": ("test: barrier", [0]), "error_does_not_pickle": ("test: barrier", [1])}
    for case, (step, ranks) in expected.items():
        got = [out[case] for out in outs]
        assert got[0] == got[1], case  # the same error on every rank
        assert got[0]["error"] == "RankAgreementError" and got[0]["step"] == step and got[0]["ranks"] == ranks, got
        assert got[0]["message"].startswith(f"{step} failed on rank")
    assert "rank 1's part" in outs[0]["gather_one_fails"]["message"]
    assert outs[0]["error_does_not_pickle"]["kinds"] == ["RankError"]
