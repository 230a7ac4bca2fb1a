"""Background merges of consecutive chains (cnr.write.merge): same state as the chain, committed last,
refused when it would re-quantize (rows stored two ways), and retention then drops the old chain."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from typing import Dict, List

import pytest
import torch

from cli_helpers import MIXED_SHARDING, inspect, run_cnr, train
from cnr.codec.zstd import zstd_spec
from cnr.errors import CheckpointError
from cnr.format.documents import Manifest
from cnr.format.layout import checkpoint_prefix, manifest_key, merged_id
from cnr.format.catalog import newest_committed, read_manifest, resolve_chain
from cnr.format.verify import check_objects
from cnr.write.compact import Merger, MergeSettings, compact_location, merge_and_retain
from cnr.write.lease import Lease, check_held
from cnr.write.merge import _encoding_of, merge_chain
from cnr.restore.chain import restore_chain
from cnr.track.state import StatePiece
from cnr.storage.local import LocalStorage
from cli_helpers import table_of
from cnr.types import ChunkRef, Encoding, ShardRegion

CONSECUTIVE = ["--set", "checkpoint.policy=consecutive", "--set", "checkpoint.interval=10",
               "--set", "checkpoint.keep_last=0", "--set", "checkpoint.compact_at_chain_ratio=0"]  # the chain stays


def _whole_pieces(manifest: Manifest) -> List[StatePiece]:
    """One zeroed tensor per checkpointed tensor, each holding all of it."""
    from cnr.codec.chunk_format import DTYPES

    pieces = []
    for name, entry in sorted(manifest.tensors.items()):
        shape = tuple(entry.shape)
        tensor = torch.zeros(shape, dtype=DTYPES[entry.dtype])
        pieces.append(StatePiece(name, shape, ShardRegion((0,) * len(shape), shape), tensor, True, entry.role,
                                 entry.table))
    return pieces


def _restored(storage: LocalStorage, chain: List[Manifest]) -> Dict[str, torch.Tensor]:
    pieces = _whole_pieces(chain[-1] if chain[-1].kind.value == "incremental" else chain[0])
    restore_chain(storage, chain, pieces)
    return {p.name: p.tensor for p in pieces}


@pytest.fixture(scope="module")
def quantized_chain(tmp_path_factory):
    """A 4-bit consecutive chain at world size 2, one sharding type per table: full + 3 increments,
    the row-wise Adagrad sums log8-coded (optimizer_bits 8), every chunk zstd-compressed."""
    cwd = str(tmp_path_factory.mktemp("merge"))
    train(cwd, "ck", *CONSECUTIVE, *MIXED_SHARDING, "--set", "checkpoint.bits=4", "--set", "checkpoint.optimizer_bits=8",
          "--set", "train.steps=40", nproc=2)
    return cwd


def test_merged_baseline_restores_exactly_what_the_chain_restores(quantized_chain, monkeypatch):
    storage = LocalStorage(f"{quantized_chain}/ck")
    target = newest_committed(storage)
    chain = resolve_chain(storage, target)
    assert [m.kind.value for m in chain] == ["full"] + ["incremental"] * 3
    expected = _restored(storage, chain)
    baseline = _restored(storage, chain[:1])
    changed = [n for n in expected if not torch.equal(expected[n], baseline[n])]
    assert any(table_of(n) is not None for n in changed), "the increments changed no table row"
    # a failing put half-way: nothing is committed and the chain still resolves as before
    real_put, puts = LocalStorage.put, []

    def failing_put(self, key, data):
        puts.append(key)
        if len(puts) == 5:
            raise OSError("injected: disk full")
        return real_put(self, key, data)

    monkeypatch.setattr(LocalStorage, "put", failing_put)
    with pytest.raises(OSError, match="disk full"):
        merge_chain(storage, target.id, chunk_bytes=4096)
    monkeypatch.setattr(LocalStorage, "put", real_put)
    assert not storage.exists(manifest_key(merged_id(target.id)))
    assert [m.id for m in resolve_chain(storage, target)] == [m.id for m in chain]

    assert {c.encoding for e in target.tensors.values() for c in e.chunks} >= {Encoding.LOG8, Encoding.QUANTIZED}
    chunks = [c for e in target.tensors.values() for c in e.chunks]
    assert all([s.name for s in c.codecs] == ([c.codecs[0].name, "zstd"] if c.encoding != Encoding.RAW else ["raw"])
               for c in chunks)  # quantized and log8 chunks compressed, raw ones stored as they are
    merged, fresh = merge_chain(storage, target.id, chunk_bytes=4096, compression=(zstd_spec(),))  # many chunks per tensor
    assert fresh and merge_chain(storage, target.id, chunk_bytes=4096) == (merged, False)  # a re-run finds it
    assert merged.id == merged_id(target.id) and merged.kind.value == "full" and merged.base is None
    assert (merged.step, merged.app_ranks, merged.counters) == (target.step, target.app_ranks, target.counters)
    assert (merged.metadata, merged.tables) == (target.metadata, target.tables)
    assert merged.bits == 4 and len(merged.chain_bytes) == 1
    assert {n: (e.role, e.table) for n, e in merged.tensors.items()} == {n: (e.role, e.table) for n, e in target.tensors.items()}
    # resolving the increment now stops at the merged baseline, which restores the same state
    assert [m.id for m in resolve_chain(storage, target)] == [merged.id]
    got = _restored(storage, [read_manifest(storage, merged.id)])
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # and it is about the size of a 4-bit full checkpoint, far below the fp32 state
    assert merged.bytes < 0.6 * merged.full_fp32_bytes


def _ref(bits: int, method: str = "adaptive", encoding: Encoding = Encoding.QUANTIZED) -> ChunkRef:
    return ChunkRef("k", "t", 4, 0, False, 0, 8, 100, 0, encoding, bits, method)


@pytest.mark.parametrize("refs,ok", [
    ([_ref(4), _ref(4), _ref(4)], True),
    ([_ref(32, "", Encoding.RAW)] * 2, True),
    ([_ref(4), _ref(8, "naive")], False),  # the fallback to 8 bits mid-chain
    ([_ref(4), _ref(4, "naive")], False),
    ([_ref(32, "", Encoding.RAW), _ref(8, "naive")], False),
    ([_ref(8, "log8", Encoding.LOG8), _ref(32, "", Encoding.RAW)], True),  # log8 rows a merge stored raw
])
def test_a_chain_stored_two_ways_is_not_merged(refs, ok):
    if ok:
        assert _encoding_of(refs, "t")[1] == refs[0].bits
        assert _encoding_of(refs, "t")[0] == refs[0].encoding
    else:
        with pytest.raises(CheckpointError, match="re-quantizing"):
            _encoding_of(refs, "t")


def test_training_merges_in_the_background_and_resumes_bit_exact(tmp_path, baseline_ws1):
    """The default bytes trigger (compact_at_chain_ratio 0.25; each tiny.yaml increment at interval 5
    holds ~0.2 of the baseline's bytes): merges run in the job's worker while it trains."""
    opts = ["--set", "checkpoint.policy=consecutive", "--set", "checkpoint.interval=5", "--set", "checkpoint.keep_last=1"]
    first = train(str(tmp_path), "ck", *opts, "--set", "train.steps=55")
    assert first["checkpoints"] == 11
    listed = inspect(str(tmp_path), "ck")
    # the first merge starts once the increments since the baseline hold a quarter of its bytes; how
    # many follow depends on how fast each one runs, and retention may have dropped the older merged baselines since
    assert any(c["id"].endswith(".merged") and c["committed"] for c in listed)
    storage = LocalStorage(f"{tmp_path}/ck")
    chain = resolve_chain(storage, newest_committed(storage))
    assert chain[0].id.endswith(".merged") and chain[0].kind.value == "full"
    assert all(not c["id"].startswith("0000000005-") for c in listed)  # the old chain was deleted
    resumed = train(str(tmp_path), "ck", *opts, "--resume")
    assert resumed["state_sha256"] == baseline_ws1[0]["state_sha256"]


# ---- kill safety: a merge killed at any point (cnr.write.merge's and cnr.write.compact's fault points) ----

KILL_POINTS = ["merge_before_data", "merge_mid_data", "merge_before_commit", "merge_after_commit"]


def _copy_store(src: str, dst: str) -> LocalStorage:
    """A copy of the fixture's store without its merged baseline (the first test merges there)."""
    shutil.copytree(src, dst, ignore=lambda _d, names: [n for n in names if n.endswith(".merged")])
    for key in [k for k in LocalStorage(dst).list("lease")]:
        os.remove(os.path.join(dst, key))  # the training job's lease record: no job holds this copy
    return LocalStorage(dst)


def _objects(storage: LocalStorage, ckpt_id: str) -> List[str]:
    return storage.list(checkpoint_prefix(ckpt_id))


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_merge_killed_anywhere_leaves_a_chain_that_restores_exactly(quantized_chain, tmp_path, point):
    """SIGKILL of a real `cnr compact` process at each point: the newest committed checkpoint restores
    bit for bit what replaying its chain gives, a half-written merged baseline is never resolved,
    the chain is deleted only after the commit, and a re-run merge succeeds."""
    storage = _copy_store(f"{quantized_chain}/ck", str(tmp_path / "ck"))
    target = newest_committed(storage)
    chain = resolve_chain(storage, target)
    expected = _restored(storage, chain)
    merged = merged_id(target.id)
    rc, out, err = run_cnr(["compact", storage.root, "--keep-last", "1", "--chunk-bytes", "4096"], str(tmp_path),
                           env={"CNR_FAULT_INJECT": f"kill:{point}@{target.step}"})
    assert rc == -signal.SIGKILL, f"rc {rc}: {err[-2000:]}"
    committed = storage.exists(manifest_key(merged))
    assert committed == (point == "merge_after_commit")
    if point == "merge_before_commit":
        assert _objects(storage, merged), "the kill came before any chunk was stored"
    assert all(_objects(storage, m.id) for m in chain), "a link was deleted before the merge committed"
    resolved = resolve_chain(storage, newest_committed(storage))
    assert [m.id for m in resolved] == ([merged] if committed else [m.id for m in chain])
    got = _restored(storage, resolved)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    # the re-run (its claim taken over at once: the killed process is gone) commits, then retention
    # runs; it keeps the chain the merge replaced beside the merged baseline, the only other copy of its state
    summary = compact_location(storage, None, MergeSettings(4096, keep_last=1))
    assert summary["merged"] == merged and summary["committed_now"] == (not committed)
    assert summary["lease"] == "held by this process" and not storage.list("compact")
    assert [m.id for m in resolve_chain(storage, newest_committed(storage))] == [merged]
    got = _restored(storage, [read_manifest(storage, merged)])
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert all(_objects(storage, m.id) for m in chain)  # one damaged object of the merged baseline must not be fatal


def test_a_merge_commits_and_deletes_only_while_the_lease_is_held(quantized_chain, tmp_path):
    storage = _copy_store(f"{quantized_chain}/ck", str(tmp_path / "ck"))
    target = newest_committed(storage)
    chain_ids = [m.id for m in resolve_chain(storage, target)]
    lost = Lease.acquire(storage, ttl_s=30)
    lost.release()
    Lease.acquire(storage, ttl_s=30)  # another job took the location
    with pytest.raises(CheckpointError, match="lost the lease"):
        merge_and_retain(storage, target.id, MergeSettings(4096, keep_last=1), lambda: check_held(storage, lost.ref),
                         retain=True)
    assert not storage.exists(manifest_key(merged_id(target.id))) and not storage.list("compact")
    # the lease lost between the commit and retention: committed, nothing deleted
    calls = []

    def fence() -> None:
        calls.append(1)
        if len(calls) > 1:
            raise CheckpointError("this job lost the lease (injected)")

    with pytest.raises(CheckpointError, match="injected"):
        merge_and_retain(storage, target.id, MergeSettings(4096, keep_last=1), fence, retain=True)
    assert storage.exists(manifest_key(merged_id(target.id))) and len(calls) == 2
    assert all(_objects(storage, i) for i in chain_ids)


def test_the_job_merger_hands_over_without_a_stall_and_survives_a_killed_worker(quantized_chain, tmp_path, monkeypatch):
    storage = _copy_store(f"{quantized_chain}/ck", str(tmp_path / "ck"))
    target = newest_committed(storage)
    merger = Merger(storage.uri, MergeSettings(4096, keep_last=0))
    monkeypatch.setenv("CNR_FAULT_INJECT", f"kill:merge_before_commit@{target.step}")  # the worker inherits it
    spawned_on = []  # the threads that spawned a worker process: never the caller's (no stall)
    spawn = Merger._spawn

    def recording_spawn(self):
        spawned_on.append(threading.current_thread())
        spawn(self)

    monkeypatch.setattr(Merger, "_spawn", recording_spawn)
    assert merger.start(target.id)
    deadline = time.time() + 120
    while not merger.reports and time.time() < deadline:
        time.sleep(0.05)
    assert spawned_on and threading.current_thread() not in spawned_on
    assert "merge worker died" in merger.reports[-1]["error"]
    assert not storage.exists(manifest_key(merged_id(target.id)))
    monkeypatch.delenv("CNR_FAULT_INJECT")
    merger.start(target.id)  # a fresh worker
    merger.wait()
    merger.start(target.id)  # a new thread and worker after wait(); the merge is found committed
    merger.wait()
    assert [r.get("committed_now") for r in merger.reports[1:]] == [True, False], merger.reports
    assert storage.exists(manifest_key(merged_id(target.id))) and not merger.running


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_a_later_merge_goes_the_long_way_past_a_damaged_merged_baseline(quantized_chain, tmp_path, damage):
    """An earlier merged baseline whose chunk was damaged: the next merge reads the links it stood
    for instead (as a restore does), so compaction goes on for the rest of the run (`bench chaos`
    seed 2 saw every later merge fail on one damaged merged chunk); the new merged baseline holds
    exactly the chain's state."""
    storage = _copy_store(f"{quantized_chain}/ck", str(tmp_path / "ck"))
    target = newest_committed(storage)
    chain = resolve_chain(storage, target)
    expected = _restored(storage, chain)
    earlier, _fresh = merge_chain(storage, chain[-2].id, chunk_bytes=4096)  # the merge before the newest link
    assert [m.id for m in resolve_chain(storage, target)] == [earlier.id, target.id]
    # one byte flipped in its largest table chunk (a merge copies dense tensors from the newest link)
    ref = max((c for e in earlier.tensors.values() if e.table is not None for c in e.chunks), key=lambda c: c.nbytes)
    path = os.path.join(storage.root, ref.key)
    if damage == "deleted":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.seek(ref.offset + ref.nbytes - 1)
            last = f.read(1)
            f.seek(ref.offset + ref.nbytes - 1)
            f.write(bytes([last[0] ^ 0xFF]))
    merged, fresh = merge_chain(storage, target.id, chunk_bytes=4096)
    assert fresh and merged.id == merged_id(target.id)
    got = _restored(storage, [read_manifest(storage, merged.id)])
    assert all(torch.equal(got[n], expected[n]) for n in expected)


def _damage(storage: LocalStorage, ref: ChunkRef, how: str) -> None:
    """Flip the last byte of chunk ``ref`` in place, or delete its object."""
    path = os.path.join(storage.root, ref.key)
    if how == "deleted":
        os.remove(path)
        return
    with open(path, "r+b") as f:
        f.seek(ref.offset + ref.nbytes - 1)
        last = f.read(1)
        f.seek(ref.offset + ref.nbytes - 1)
        f.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_compact_merges_again_a_committed_merged_baseline_found_damaged(quantized_chain, tmp_path, damage):
    """`cnr compact` of a checkpoint whose own merged baseline is committed but damaged: it is not
    taken as done (stop 32 returned it as merged, and the chain stayed long for good); it is merged
    again through the links it stands for, re-committed, and then restores exactly the chain's
    state; nothing the long way needs was deleted while it was damaged."""
    storage = _copy_store(f"{quantized_chain}/ck", str(tmp_path / "ck"))
    target = newest_committed(storage)
    chain = resolve_chain(storage, target)
    expected = _restored(storage, chain)
    merged, fresh = merge_chain(storage, target.id, chunk_bytes=4096)
    assert fresh
    ref = max((c for e in merged.tensors.values() if e.table is not None for c in e.chunks), key=lambda c: c.nbytes)
    _damage(storage, ref, damage)
    summary = compact_location(storage, None, MergeSettings(4096, keep_last=1))
    assert summary["merged"] == merged.id and summary["committed_now"], summary
    assert check_objects(storage, read_manifest(storage, merged.id)) == []
    got = _restored(storage, [read_manifest(storage, merged.id)])
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    # the links stay beside it (the only other copy of its state); a second run commits nothing new
    assert all(_objects(storage, m.id) for m in chain)
    again = compact_location(storage, None, MergeSettings(4096, keep_last=1))
    assert again["merged"] == merged.id and not again["committed_now"], again


def test_retention_keeps_the_links_of_a_damaged_merged_baseline(quantized_chain, tmp_path):
    """While a committed merged baseline is damaged, retention does not count its chain: the
    links it stands for stay, and the newest checkpoint restores the long way."""
    from cnr.policy.retention import retain_checkpoints
    from cnr.types import RetentionScope

    storage = _copy_store(f"{quantized_chain}/ck", str(tmp_path / "ck"))
    target = newest_committed(storage)
    chain = resolve_chain(storage, target)
    expected = _restored(storage, chain)
    merged, _fresh = merge_chain(storage, target.id, chunk_bytes=4096)
    ref = max((c for e in merged.tensors.values() if e.table is not None for c in e.chunks), key=lambda c: c.nbytes)
    _damage(storage, ref, "flipped")
    retain_checkpoints(storage, 1, RetentionScope(target.lineage))
    assert all(_objects(storage, m.id) for m in chain), "a link of the long way was deleted"
    long_way = resolve_chain(storage, target, frozenset({merged.id}))
    assert [m.id for m in long_way] == [m.id for m in chain]
    got = _restored(storage, long_way)  # and it restores what the chain held before the merge
    assert all(torch.equal(got[n], expected[n]) for n in expected)
