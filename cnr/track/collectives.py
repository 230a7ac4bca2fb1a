"""Control collectives on host tensors (flags, counters, totals) over any process group.

NCCL has no CPU backend: a host tensor in a collective on an NCCL-only group fails with "No
backend type associated with device type cpu". cnr's control tensors are small host tensors;
these helpers run their collective on the device the group can use (the current CUDA device for
NCCL alone, else the host) and write the result back into the host tensor in place. A group made
with a CPU backend (gloo, or a device map such as ``cpu:gloo,cuda:nccl``) keeps them on the host.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


def control_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a control tensor of a collective on ``group`` (default: the world) must live."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run_on_control_device(tensor: torch.Tensor, collective: Callable[[torch.Tensor], None],
                           group: Optional[dist.ProcessGroup]) -> None:
    """``collective(t)`` on ``tensor`` where ``group`` can run it; the result lands in ``tensor``."""
    device = control_device(group)
    if device.type == "cpu":
        collective(tensor)
        return
    moved = tensor.to(device)
    collective(moved)
    tensor.copy_(moved.cpu())


def all_reduce_host(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                    group: Optional[dist.ProcessGroup] = None) -> None:
    """``dist.all_reduce`` of the host tensor ``tensor``, in place, on any group."""
    _run_on_control_device(tensor, lambda t: dist.all_reduce(t, op=op, group=group), group)


def broadcast_host(tensor: torch.Tensor, src: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """``dist.broadcast`` of the host tensor ``tensor`` from global rank ``src``, in place."""
    _run_on_control_device(tensor, lambda t: dist.broadcast(t, src=src, group=group), group)
