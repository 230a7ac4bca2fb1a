"""cnr's CUDA paths at world size 1, each with a CPU twin that runs everywhere.

Every test is parametrized over the device: "cpu" runs in CI (gloo), "cuda" only where a GPU is
(NCCL, one rank on cuda:0) and is skipped elsewhere. The model is tiny.yaml's DLRM through
cnr.app.parallel.build_sharded_model: torchrec's planner, the FUSED kernel and fused row-wise Adagrad.
- the tracker (on CUDA: the device bitmap, cnr.track.tracker.RowTracker._record_cuda) reports exactly
  the ids the batches looked up, before and after a checkpoint boundary;
- a snapshot (on CUDA: pinned host buffers, a side stream, non-blocking copies, one event) holds
  the values at save() even when training changes them in place the moment save() returns;
- a resume from a full + incremental chain restores every tensor and lr bit for bit on the
  device, and both models then train on identically.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

import cnr
from cli_helpers import TINY
from cnr.track.app_state import AppState
from cnr.app.config import load_config
from cnr.app.data import make_reader, to_device
from cnr.app.parallel import build_sharded_model, train_step
from cnr.track.snapshot import HostBuffers
from cnr.track.tracker import RowTracker
from test_api import _assert_same, _gathered
from test_snapshot import M, W, _pieces

CUDA = torch.cuda.is_available()
ON_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
DEVICES = ["cpu", pytest.param("cuda", marks=ON_CUDA)]


@contextlib.contextmanager
def _process_group(device: torch.device, workdir):
    """The default process group at world size 1: NCCL on CUDA, gloo on the CPU (a CPU model under
    NCCL cannot run, so the CPU twins use gloo on a GPU machine too); destroyed on the way out."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{workdir}/store",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def device(request, tmp_path):
    """The parametrized device, with the default process group up for the test."""
    dev = torch.device("cuda", 0) if request.param == "cuda" else torch.device("cpu")
    with _process_group(dev, tmp_path):
        yield dev
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _config(device: torch.device, big: bool = False):
    overrides = ["train.batch_size=64"]
    if big and device.type == "cuda":
        # 1 M rows x 16 floats = 64 MB in t0: its device-to-host copy lasts milliseconds, long after
        # an in-place add queued behind save() has run if the snapshot did not wait for its copies
        overrides.append("model.tables=[{name: t0, rows: 1000000, features: [f0]}, {name: t1, rows: 2000, "
                         "features: [f1, f2]}, {name: t2, rows: 1000, features: [f3]}, {name: t3, rows: 500, "
                         "features: [f4]}]")
    return load_config(TINY, overrides)


def _model(config, device: torch.device):
    sharded = build_sharded_model(config, device)
    kernels = {name: ps.compute_kernel for plan in sharded.model.plan.plan.values() for name, ps in plan.items()}
    assert kernels and set(kernels.values()) == {"fused"}, kernels  # torchrec's default on CUDA, as cnr trains
    return sharded


def _app(sharded) -> dict:
    return {"model": sharded.model, "optim": sharded.dense_optimizer}


def _short(table_id: str) -> str:
    """``t0`` for ``model/sparse_arch.embedding_bag_collection.embedding_bags.t0.weight``."""
    return table_id.split(".")[-2]


def _table_tensors(sharded) -> List[torch.Tensor]:
    """The live local shards of every table's weight (views into the fused kernel's weights)."""
    return [shard.tensor for key, value in sharded.model.state_dict().items() if key.endswith(".weight")
            and hasattr(value, "local_shards") for shard in value.local_shards()]


def _batches(reader, device: torch.device, n: int) -> list:
    return [to_device(reader.next_batch(), device) for _ in range(n)]


def _looked_up(config, batches) -> Dict[str, torch.Tensor]:
    """table -> the ascending unique ids the batches look up in it (its features' values)."""
    out = {}
    for table in config.model.tables:
        ids = [b.sparse[f].values().cpu().to(torch.int64) for b in batches for f in table.features]
        out[table.name] = torch.unique(torch.cat(ids))
    return out


def _assert_view(tracker: RowTracker, view: str, expected: Dict[str, torch.Tensor]) -> None:
    for table_id in tracker.tables:
        got = tracker.row_ids(tracker.views[view], table_id)
        want = expected[_short(table_id)]
        assert torch.equal(got, want), (view, table_id, got.numel(), want.numel(),
                                        sorted(set(got.tolist()) ^ set(want.tolist()))[:10])


# ---- the tracker ------------------------------------------------------------------------------

@pytest.mark.parametrize("device, device_bitmap", [("cpu", False), ("cpu", True), pytest.param("cuda", True, marks=ON_CUDA)],
                         indirect=["device"], ids=["cpu", "cpu-device-bitmap", "cuda"])
def test_tracker_reports_exactly_the_looked_up_rows(device, device_bitmap, tmp_path, monkeypatch):
    """The Checkpointer's own tracker (installed in torchrec's post-lookup hook slots) against the
    ids in the batches: equal per table after 3 steps, after a full checkpoint (both views
    cleared) and after an increment (its view cleared, the baseline view kept). "cpu-device-bitmap"
    runs the CUDA path's bitmap code (``_record_cuda``, ``set_bits_torch``) on CPU tensors."""
    if device.type == "cpu" and device_bitmap:
        monkeypatch.setattr(RowTracker, "_apply", lambda self, values, lengths, base:
                            self._record_cuda(values, lengths, base))
    config = _config(device)
    sharded = _model(config, device)
    reader = make_reader(config, 0, 1, None, "train")
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0, compact_at_chain_ratio=0)  # chains, not merges
    with cnr.Checkpointer(str(tmp_path / "ck"), _app(sharded), options) as ckpt:
        tracker = ckpt.tracker
        assert sorted(_short(t) for t in tracker.tables) == sorted(t.name for t in config.model.tables)
        first = _batches(reader, device, 3)
        for batch in first:
            train_step(sharded, batch)
        # ids that reached the hook on the device were recorded in the device bitmap
        assert (tracker._device_current is not None) == device_bitmap
        if device_bitmap:
            assert tracker._device_current.device == device and int(tracker._device_current.count_nonzero()) > 0
        tracker.fold()  # what a snapshot folds; save() folds again and finds nothing new
        _assert_view(tracker, "checkpoint", _looked_up(config, first))
        _assert_view(tracker, "baseline", _looked_up(config, first))
        assert ckpt.save(3).wait().kind.value == "full"
        for view in ("checkpoint", "baseline"):  # a committed full checkpoint clears both views
            assert tracker.count(tracker.views[view]) == 0, view
        tracker.fold()  # nothing was looked up since: the device bitmap was emptied at the snapshot
        assert tracker.count(tracker.views["checkpoint"]) == 0
        second = _batches(reader, device, 2)
        for batch in second:
            train_step(sharded, batch)
        tracker.fold()
        expected = _looked_up(config, second)
        _assert_view(tracker, "checkpoint", expected)
        _assert_view(tracker, "baseline", expected)
        info = ckpt.save(5).wait()
        assert info.kind.value == "incremental"
        assert info.rows == sum(ids.numel() for ids in expected.values())  # the increment stored exactly them
        assert tracker.count(tracker.views["checkpoint"]) == 0
        _assert_view(tracker, "baseline", expected)
        third = _batches(reader, device, 2)
        for batch in third:
            train_step(sharded, batch)
        tracker.fold()
        _assert_view(tracker, "checkpoint", _looked_up(config, third))
        _assert_view(tracker, "baseline", _looked_up(config, second + third))


# ---- the snapshot -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_snapshot_holds_the_values_at_save_when_training_changes_them_at_once(device, tmp_path):
    """save(), then at once an in-place add to every table and dense parameter on the device (what
    the next training step does): the committed checkpoint holds the values at save() bit for
    bit. On CUDA the copies run on a side stream into pinned buffers; had save() returned before
    they completed, the add queued behind it would have reached the 64 MB copy of t0."""
    config = _config(device, big=True)
    sharded = _model(config, device)
    reader = make_reader(config, 0, 1, None, "train")
    for batch in _batches(reader, device, 2):
        train_step(sharded, batch)
    app = _app(sharded)
    saved = _gathered(app)
    uri = str(tmp_path / "ck")
    with cnr.Checkpointer(uri, app, cnr.CheckpointOptions(policy="full")) as ckpt:
        pending = ckpt.save(2)
        with torch.no_grad():
            for t in _table_tensors(sharded) + list(sharded.dense_optimizer.param_groups[0]["params"]):
                t.add_(1.0)
        if device.type == "cuda":  # the host buffers of the device's pieces are pinned
            on_device = [p for p in AppState(app, 0).pieces() if p.tensor.is_cuda]
            assert on_device and all(ckpt.engine.buffers.pinned(p) for p in on_device), on_device
        assert pending.wait().kind.value == "full"
    changed = _gathered(app)
    t0 = next(n for n in saved if n.endswith("t0.weight"))
    assert torch.equal(changed[t0], saved[t0] + 1)  # the add reached the model itself
    # the committed checkpoint, read back unsharded on the CPU (restoring onto the device: the resume test)
    loaded = cnr.load_state_dict(uri, "model")
    modules = {n for n in saved if n.startswith("model/") and "/" not in n[len("model/"):]}
    assert {"model/" + k for k in loaded} == modules
    for key, value in loaded.items():
        assert torch.equal(value, saved["model/" + key]), key


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_host_buffers_capture_device_state_into_pinned_shared_memory(device):
    """HostBuffers.capture of table pieces on the device and dense pieces on the CPU (one call
    takes both paths on CUDA): full copies equal the sources, land in shared (and on CUDA pinned)
    buffers, and do not follow a change made once capture returned; a row gather takes the
    listed rows with their global ids; the prepared buffers are the ones captures use."""
    weight = torch.randn(50, 4, device=device)
    momentum = torch.rand(50, device=device)
    buffers = HostBuffers()
    buffers.prepare(_pieces(weight, momentum))
    host, _ = buffers.capture(_pieces(weight, momentum))
    assert buffers.allocations == 0
    by_name = {h.name: h for h in host}
    assert torch.equal(by_name[W].data, weight.cpu()) and torch.equal(by_name[M].data, momentum.cpu())
    assert all(h.data.device.type == "cpu" and h.data.is_shared() for h in host)
    if device.type == "cuda":
        assert by_name[W].data.is_pinned() and by_name[M].data.is_pinned()
    before = by_name[W].data.clone()
    weight.add_(1.0)
    assert torch.equal(by_name[W].data, before)
    rows = {W: torch.tensor([7, 100, 103, 149, 200], dtype=torch.int64)}
    inc, _ = buffers.capture(_pieces(weight, momentum), rows)
    by_name = {h.name: h for h in inc}
    assert by_name[W].row_ids.tolist() == [100, 103, 149]
    assert torch.equal(by_name[W].data, weight[[0, 3, 49]].cpu())
    assert torch.equal(by_name[M].data, momentum[[0, 3, 49]].cpu())


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_host_buffers_made_again_in_one_process_capture_exactly(device):
    """Buffers closed (or collected) and made again, of the same sizes and so at the addresses
    just freed: every capture equals its source. A CUDA registration that outlived its buffer's
    memory would be found again at that address and take the next buffer's copy elsewhere (seen
    on an H200: the second Checkpointer of a process failed its first snapshot)."""
    for round_ in range(4):
        weight = torch.randn(800, 16, device=device) + round_
        momentum = torch.rand(800, device=device) + round_
        buffers = HostBuffers()
        host, _ = buffers.capture(_pieces(weight, momentum))
        by_name = {h.name: h for h in host}
        assert torch.equal(by_name[W].data, weight.cpu()) and torch.equal(by_name[M].data, momentum.cpu())
        assert all(buffers.pinned(p) == p.tensor.is_cuda for p in _pieces(weight, momentum))  # dense ones: host
        if round_ % 2:
            buffers.close()
            assert not any(buffers.pinned(p) for p in _pieces(weight, momentum))
        del buffers, host, by_name
        gc.collect()


class _FakeStream:
    def wait_stream(self, other):
        pass


class _FakeEvent:
    def record(self, stream):
        pass

    def synchronize(self):
        pass


def test_capture_cuda_logic_on_cpu_tensors(monkeypatch):
    """HostBuffers._capture_cuda's copies and gathers, run on CPU tensors with torch.cuda's stream
    and event calls stubbed: the same host pieces as the CPU path (the CUDA twin above runs it
    for real)."""
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    weight, momentum = torch.randn(50, 4), torch.rand(50)
    rows = {W: torch.tensor([7, 100, 103, 149, 200], dtype=torch.int64)}
    for row_ids in (None, rows):
        pieces = _pieces(weight, momentum)
        via_cpu, _ = HostBuffers().capture(pieces, row_ids)
        device_path = HostBuffers()
        plan = [(p, device_path._local_rows(p, row_ids or {}, {})) for p in pieces]
        via_cuda = device_path._capture_cuda(plan)
        for a, b in zip(via_cpu, via_cuda):
            assert a.name == b.name and torch.equal(a.data, b.data), a.name
            assert (a.row_ids is None and b.row_ids is None) or torch.equal(a.row_ids, b.row_ids)


# ---- resume -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_resume_from_an_incremental_chain_is_exact_and_trains_on_identically(device, tmp_path):
    """6 steps with a full then two incremental checkpoints (the tracker on the device); a fresh
    model on the device, scribbled over, restores the newest: every tensor of the model, the
    fused and dense optimizer state and the lrs equal the trained model's bit for bit; then 2
    more identical steps on both keep them equal."""
    config = _config(device)
    trained = _model(config, device)
    reader = make_reader(config, 0, 1, None, "train")
    uri = str(tmp_path / "ck")
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0, compact_at_chain_ratio=0)  # chains, not merges
    kinds = []
    with cnr.Checkpointer(uri, _app(trained), options) as ckpt:
        for step in range(1, 7):
            train_step(trained, to_device(reader.next_batch(), device))
            if step % 2 == 0:
                kinds.append(ckpt.save(step).wait().kind.value)
    assert kinds == ["full", "incremental", "incremental"]
    saved = _gathered(_app(trained))
    fresh = _model(config, device)
    with torch.no_grad():  # restore must write every element, not find the same init
        for piece in AppState(_app(fresh), 0).pieces():
            if piece.tensor.is_floating_point() and piece.tensor.numel():
                piece.tensor.add_(0.5)
    assert not torch.equal(_gathered(_app(fresh))[next(n for n in saved if n.endswith("t0.weight"))],
                           saved[next(n for n in saved if n.endswith("t0.weight"))])
    with cnr.Checkpointer(uri, _app(fresh), options) as ckpt:
        info = ckpt.restore()
        assert (info.step, info.kind.value) == (6, "incremental")
        restored = _gathered(_app(fresh))
        _assert_same(restored, saved)
        assert any("momentum" in n or "sum" in n for n in restored), sorted(restored)  # optimizer state compared
        for b in _batches(reader, device, 2):
            train_step(trained, b)
            train_step(fresh, b)
        _assert_same(_gathered(_app(fresh)), _gathered(_app(trained)))
        on_device = [p for p in AppState(_app(fresh), 0).pieces() if p.table is not None]
        assert on_device and all(p.tensor.device.type == device.type for p in on_device)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_quantized_chain_restores_on_the_device_from_several_threads_as_on_the_host(device, tmp_path):
    """A 2-bit chain (a full and an increment; optimizer state 8-bit) stored in small chunks, so a
    restore has many blocks for its 4 worker threads: restored onto the device (quantized blocks
    decoded on the host, then copied: ``values_into`` takes the copy for a device target), every
    table's rows equal bit for bit what ``cnr.load_state_dict`` decodes on the host from the same
    checkpoint, and a restore with one thread gives the same state as with four."""
    config = _config(device, big=True)
    trained = _model(config, device)
    reader = make_reader(config, 0, 1, None, "train")
    uri = str(tmp_path / "ck")
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0, compact_at_chain_ratio=0, bits=2,
                                    optimizer_bits=8, chunk_bytes=256 * 1024, restore_threads=4)
    with cnr.Checkpointer(uri, _app(trained), options) as ckpt:
        kinds = []
        for step in range(1, 5):
            train_step(trained, to_device(reader.next_batch(), device))
            if step % 2 == 0:
                kinds.append(ckpt.save(step).wait().kind.value)
    assert kinds == ["full", "incremental"]
    on_host = cnr.load_state_dict(uri, "model")
    states = []
    for threads in (4, 1):
        fresh = _model(config, device)
        with torch.no_grad():
            for piece in AppState(_app(fresh), 0).pieces():
                if piece.tensor.is_floating_point() and piece.tensor.numel():
                    piece.tensor.add_(0.5)
        opts = cnr.CheckpointOptions(policy="consecutive", keep_last=0, compact_at_chain_ratio=0, bits=2,
                                     optimizer_bits=8, chunk_bytes=256 * 1024, restore_threads=threads)
        with cnr.Checkpointer(uri, _app(fresh), opts) as ckpt:
            assert ckpt.restore().step == 4
        states.append(_gathered(_app(fresh)))
    weights = {k: v for k, v in on_host.items() if k.endswith(".weight") and "embedding" in k}
    assert len(weights) == len(config.model.tables), sorted(on_host)
    for key, want in weights.items():
        name = next(n for n in states[0] if n.endswith(key))
        got = states[0][name]
        assert got.device.type == "cpu" and torch.equal(got, want), key
    assert states[0].keys() == states[1].keys()
    for name in states[0]:
        assert torch.equal(states[0][name], states[1][name]), name
