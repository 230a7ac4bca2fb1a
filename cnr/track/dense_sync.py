"""Dense gradients averaged the same way in every run, so that a resumed job is bit-exact at any
world size.

DDP all-reduces gradient buckets: flat buffers of several parameters' gradients. With three or
more ranks a float sum depends on the order its terms are added in, and a ring all-reduce adds
each element in an order set by its offset in the buffer. DDP lays buckets out in reverse
parameter order for its first iteration and rebuilds them in the order gradients became ready
after it, so a job resumed at step k sums its first step's gradients in another layout than
the uninterrupted job summed step k+1's: a 4-rank resume of tiny.yaml drifted by about 1e-9 in
eval logloss (2 ranks stayed exact: a + b = b + a). The hook below all-reduces each parameter's
gradient on its own, so an element's order depends only on its place in its own parameter,
which no rebuild changes. It costs one all-reduce per dense parameter per step, so it is
installed only at 3 or more ranks; at 2 DDP's own bucketed sum is already exact (and it divides
each gradient by the world size before summing, as the hook does, so the values are the same).
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper


def per_parameter_allreduce(group: Optional[dist.ProcessGroup], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the mean over ranks of each parameter's gradient in ``bucket``, each
    all-reduced on its own (divided by the world size first, as DDP's default hook does)."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    works, offset = [], 0
    for param in bucket.parameters():
        part = buffer[offset:offset + param.numel()]
        works.append(dist.all_reduce(part, group=group, async_op=True))
        offset += param.numel()
    for work in works:
        work.wait()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class DeterministicDataParallel(DefaultDataParallelWrapper):
    """torchrec's default data-parallel wrapper (DDP over the unsharded modules) with
    :func:`per_parameter_allreduce` as DDP's comm hook at 3 or more ranks."""

    def wrap(self, dmp: Any, env: Any, device: torch.device) -> None:
        super().wrap(dmp, env, device)
        ddp = dmp._dmp_wrapped_module
        if isinstance(ddp, DistributedDataParallel) and dist.get_world_size(env.process_group) >= 3:
            ddp.register_comm_hook(env.process_group, per_parameter_allreduce)
