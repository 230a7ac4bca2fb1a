"""Snapshot into host buffers: exact copies, row gathers with global ids, buffers reused."""

from __future__ import annotations

import torch

from cnr.track.snapshot import HostBuffers
from cnr.track.state import StatePiece
from cnr.types import ShardRegion, Role

W = "model/sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
M = W + "/t0.momentum1"


def _pieces(weight, momentum, row0=100):
    return [
        StatePiece(W, (1000, weight.shape[1]), ShardRegion((row0, 0), tuple(weight.shape)), weight, False, Role.TABLE_ROWS, W),
        StatePiece(M, (1000,), ShardRegion((row0,), (momentum.shape[0],)), momentum, False, Role.TABLE_STATE, W),
        StatePiece("model/dense.bias", (3,), ShardRegion((0,), (3,)), torch.arange(3.0), True),
        StatePiece("dense_optim/dense.bias/step", (), ShardRegion((), ()), torch.tensor(7.0), True),
    ]


def test_full_capture_copies_everything_into_shared_reused_buffers():
    weight, momentum = torch.randn(50, 4), torch.rand(50)
    buffers = HostBuffers()
    host, seconds = buffers.capture(_pieces(weight, momentum))
    assert seconds >= 0 and all(h.row_ids is None for h in host)
    by_name = {h.name: h for h in host}
    assert torch.equal(by_name[W].data, weight) and torch.equal(by_name[M].data, momentum)
    assert float(by_name["dense_optim/dense.bias/step"].data[0]) == 7.0
    assert all(h.data.is_shared() for h in host)  # the writer process maps them, no copy
    ptrs = {h.name: h.data.data_ptr() for h in host}
    weight += 1  # training moved on: the next snapshot must see it, in the same buffers
    host2, _ = buffers.capture(_pieces(weight, momentum))
    assert {h.name: h.data.data_ptr() for h in host2} == ptrs
    assert torch.equal({h.name: h for h in host2}[W].data, weight)


def test_incremental_capture_gathers_rows_with_global_ids():
    weight, momentum = torch.randn(50, 4), torch.rand(50)
    rows = {W: torch.tensor([7, 100, 103, 149, 200], dtype=torch.int64)}  # 7 and 200 are not held here
    host, _ = HostBuffers().capture(_pieces(weight, momentum, row0=100), rows)
    by_name = {h.name: h for h in host}
    assert by_name[W].row_ids.tolist() == [100, 103, 149]
    assert torch.equal(by_name[W].data, weight[[0, 3, 49]])
    assert torch.equal(by_name[M].data, momentum[[0, 3, 49]])
    assert by_name["model/dense.bias"].row_ids is None  # dense state is always whole


def test_empty_increment():
    weight, momentum = torch.randn(5, 2), torch.rand(5)
    host, _ = HostBuffers().capture(_pieces(weight, momentum, row0=0), {W: torch.empty(0, dtype=torch.int64)})
    by_name = {h.name: h for h in host}
    assert by_name[W].data.shape == (0, 2) and by_name[W].row_ids.numel() == 0


def _add_one(queue, done):
    buf = queue.get()
    buf.add_(1)
    done.put(True)


def test_unpinned_host_buffers_are_shared_memory_that_torch_did_not_allocate_holding_the_gil(monkeypatch):
    """#39 item 5: torch's _new_shared allocates the pages holding the GIL (0.7-0.9 s on rank 0 of
    bench restore --api-ranks 8), stopping the trainer's thread while the buffers are prepared in
    the background. On Linux under the file_descriptor strategy a buffer that is not to be pinned
    comes from a memfd that os.posix_fallocate filled without the GIL: zeroed, shared, and the
    writer process writes into the same pages. A buffer to be pinned for CUDA keeps torch's."""
    import os

    import pytest
    import torch.multiprocessing as mp

    from cnr.track.snapshot import _alloc

    if not hasattr(os, "memfd_create") or mp.get_sharing_strategy() != "file_descriptor":
        pytest.skip("torch's own allocation there")
    torch_alloc = torch.UntypedStorage._new_shared
    asked = []

    def counted(nbytes, *args, **kwargs):
        asked.append(nbytes)
        return torch_alloc(nbytes, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", counted)
    buf = _alloc((1000, 8), torch.float32, touch=True)
    assert asked == [] and buf.shape == (1000, 8) and buf.is_shared() and not buf.any()
    assert _alloc((0, 8), torch.float32).shape == (0, 8) and asked == [0]  # nothing to allocate: torch's path
    pinned = _alloc((10, 8), torch.float32, pin=True)
    assert asked == [0, 320] and pinned.is_shared()
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_add_one, args=(queue, done))
    child.start()
    try:
        queue.put(buf)
        assert done.get(timeout=60)
    finally:
        child.join(30)
    assert bool((buf == 1).all())
