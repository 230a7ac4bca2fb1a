"""Subscriber: exact fp32 application in sequence order, concurrent reading, gaps, reloads,
broken chains, idempotency, resumable state, serving from torchrec's quantized EBC (int8, int4), and the CLI.

One deterministic publish history is made once per module: tiny.yaml trained in this process for
60 steps with a real Publisher (its own writer process) publishing fp32 every 10 steps and waiting
for each commit, so the sequence is fixed: seq 1 full, 2, 3, 4 full, 5, 6 (dense at steps 10, 20,
40, 60). What a subscriber should hold at every sequence number is saved: the trainer's tables at
that step and its dense parameters at the last dense publish. Meanwhile a
subscriber thread polls the same store every 20 ms and records a digest of what it holds after
every apply.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from typing import Dict

import pytest
import torch

from cli_helpers import TINY, run_cnr
from cnr.app.config import load_config
from cnr.app.data import make_reader
from cnr.app.evaluate import evaluate
from cnr.app.inference import InferenceModel
from cnr.app.launch import launch
from cnr.format.layout import manifest_key
from cnr.format.catalog import read_manifest
from cnr.app.parallel import build_sharded_model
from cnr.app.train import make_publisher
from cnr.storage import open_storage
from cnr.storage.wrapper import WrapperStorage
from cnr.track.app_state import collect_state
from cnr.track.state import gather_global
from cnr.storage.local import LocalStorage
from cnr.publish.subscriber import Subscriber, committed_publishes
from cli_helpers import table_of

SETTINGS = ["checkpoint.enabled=false", "publish.enabled=true", "publish.bits=32", "publish.interval=10",
            "publish.full_every=3", "publish.dense_interval=20", "publish.keep_bases=0"]
KINDS = {1: "full", 2: "incremental", 3: "incremental", 4: "full", 5: "incremental", 6: "incremental"}


def digest(tensors: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()


def _watch(model: InferenceModel, uri: str, stop: threading.Event, seen: Dict[int, str], errors: list) -> None:
    sub = Subscriber(uri, model)
    while not stop.is_set():
        if sub.poll():
            seen[sub.applied.seq] = digest(model.snapshot())
        stop.wait(0.02)
    errors.extend(sub.stats.errors)
    sub.close()


def _make_history(rank: int, world_size: int, arg: Dict) -> Dict:
    from cnr.app.parallel import train_step

    config = load_config(TINY, SETTINGS + [f"publish.storage={arg['store']}"])
    sharded = build_sharded_model(config, torch.device("cpu"))
    publisher = make_publisher("unused", config, rank, world_size, sharded.model)
    seen: Dict[int, str] = {}
    errors: list = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(InferenceModel(config), arg["store"], stop, seen, errors))
    watcher.start()
    reader = make_reader(config, rank, world_size, None, split="train")
    expected = {}
    state: Dict[str, torch.Tensor] = {}
    try:
        for step in range(1, config.train.steps + 1):
            train_step(sharded, reader.next_batch())
            if publisher.due(step):
                pieces = collect_state(sharded.model, sharded.dense_optimizer)
                publisher.publish(step, pieces)
                publisher.wait()
                # what a subscriber should hold now: today's tables, the dense of the last dense publish
                dense = publisher.stats.records[-1]["dense"]
                names = sorted({p.name for p in pieces if p.name.startswith("model/") and "/" not in p.name[6:]})
                state.update({n: gather_global(pieces, n) for n in names if dense or table_of(n) is not None})
                torch.save(state, os.path.join(arg["dir"], f"expected-{publisher.chain.seq}.pt"))
                expected[publisher.chain.seq] = digest(state)
        publisher.finish(config.train.steps, collect_state(sharded.model, sharded.dense_optimizer))
    finally:
        stop.set()
        watcher.join()
    return {"expected": expected, "seen": seen, "errors": errors, "records": publisher.stats.records,
            "eval": evaluate(config, sharded.model, rank, world_size, torch.device("cpu"))}


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish_history")
    store = str(root / "pub")
    out = launch(_make_history, 1, {"store": store, "dir": str(root)})
    for key in ("expected", "seen"):  # JSON made the sequence numbers strings
        out[key] = {int(seq): value for seq, value in out[key].items()}
    config = load_config(TINY, SETTINGS + [f"publish.storage={store}"])
    return {"root": root, "store": store, "config": config, **out}


def expected(history, seq: int) -> Dict[str, torch.Tensor]:
    return torch.load(os.path.join(history["root"], f"expected-{seq}.pt"), weights_only=True)


def ids_by_seq(store: str) -> Dict[int, str]:
    return dict(committed_publishes(LocalStorage(store)))


def copy_store(history, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(history["store"], dst)
    return dst


def test_publish_sequence_is_consecutive(history):
    records = history["records"]
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {r["seq"]: r["kind"] for r in records} == KINDS
    assert [r["dense"] for r in records] == [True, True, False, True, False, True]
    assert all(r["status"] == "committed" for r in records)


def test_concurrent_subscriber_only_saw_whole_publishes(history):
    # every state the polling thread held matched the trainer at that sequence number exactly:
    # a partially written publish would have shown up as a digest the trainer never had
    assert history["errors"] == []
    assert len(history["seen"]) >= 2, f"the subscriber thread saw only {sorted(history['seen'])}"
    for seq, got in history["seen"].items():
        assert got == history["expected"][seq], f"subscriber state at seq {seq} differs from the trainer's"
    assert max(history["seen"]) == 6


def test_in_order_application_is_exact_at_every_seq(history):
    model = InferenceModel(history["config"])
    sub = Subscriber(history["store"], model)
    for seq, pub_id in sorted(ids_by_seq(history["store"]).items()):
        assert sub.apply(pub_id)
        assert digest(model.snapshot()) == history["expected"][seq]
    assert (sub.stats.bases, sub.stats.increments, sub.stats.reloads) == (2, 4, 0)
    # the published model evaluates exactly like the trainer at its last step
    assert model.evaluate() == pytest.approx(history["eval"], rel=1e-9)


def test_reapplying_is_a_noop(history):
    model = InferenceModel(history["config"])
    sub = Subscriber(history["store"], model)
    ids = ids_by_seq(history["store"])
    assert sub.poll() == [ids[4], ids[5], ids[6]]  # a fresh subscriber loads the newest chain
    before = digest(model.snapshot())
    for seq in (6, 5, 1):
        assert sub.apply(ids[seq]) is False
    assert sub.poll() == []
    assert digest(model.snapshot()) == before and sub.stats.skipped == 3


def test_gap_reloads_from_newest_base(history, tmp_path):
    store = copy_store(history, tmp_path)
    ids = ids_by_seq(store)
    model = InferenceModel(history["config"])
    sub = Subscriber(store, model)
    assert sub.apply(ids[1])
    os.remove(os.path.join(store, manifest_key(ids[2])))  # seq 2 lost: 3 no longer follows 1
    applied = sub.poll()
    assert applied == [ids[4], ids[5], ids[6]] and sub.stats.reloads == 1
    assert digest(model.snapshot()) == history["expected"][6]
    assert sub.applied.base == ids[4]


def test_garbage_collected_base_is_replaced_by_newer_base(history, tmp_path):
    store = copy_store(history, tmp_path)
    ids = ids_by_seq(store)
    model = InferenceModel(history["config"])
    sub = Subscriber(store, model)
    assert sub.apply(ids[1]) and sub.apply(ids[2])
    storage = LocalStorage(store)
    for seq in (1, 2, 3):  # what retention with keep_bases 1 removes once base 4 commits
        for key in storage.list(f"checkpoints/{ids[seq]}"):
            storage.delete(key)
    assert sub.poll() == [ids[4], ids[5], ids[6]] and sub.stats.reloads == 0  # base 4 applies as it comes
    assert digest(model.snapshot()) == history["expected"][6]


def test_broken_or_corrupt_publish_is_never_half_applied(history, tmp_path):
    store = copy_store(history, tmp_path)
    ids = ids_by_seq(store)
    model = InferenceModel(history["config"])
    sub = Subscriber(store, model)
    for seq in (1, 2, 3, 4):
        assert sub.apply(ids[seq])
    storage = LocalStorage(store)
    chunk = next(k for k in storage.list(f"checkpoints/{ids[5]}") if k.endswith(".bin"))
    blob = bytearray(storage.get(chunk))
    blob[-1] ^= 0xFF
    storage.put(chunk, bytes(blob))
    base_bytes = read_manifest(storage, ids[4]).bytes
    for _poll in range(2):  # 5 fails its CRC, every poll; chain 4-5-6 starts at the base held
        before = sub.stats.bytes_read
        assert sub.poll() == []
        assert sub.stats.bytes_read - before < base_bytes  # so that base is not fetched again
    assert sub.applied.seq == 4 and digest(model.snapshot()) == history["expected"][4]
    assert sub.stats.errors and "CRC" in sub.stats.errors[-1] and sub.stats.reloads == 0
    os.remove(os.path.join(store, manifest_key(ids[5])))  # now the newest chain cannot resolve
    fresh = Subscriber(store, InferenceModel(history["config"]))
    assert fresh.poll() == [] and fresh.applied is None and "needs" in fresh.stats.errors[-1]


def test_state_file_resumes_after_restart(history, tmp_path):
    ids = ids_by_seq(history["store"])
    path = str(tmp_path / "sub.state")
    first = Subscriber(history["store"], InferenceModel(history["config"]), state_path=path)
    for seq in (1, 2, 3):
        first.apply(ids[seq])
    first.save_state(path)
    first.close()
    model = InferenceModel(history["config"])
    second = Subscriber(history["store"], model, state_path=path)
    assert second.applied.seq == 3 and digest(model.snapshot()) == history["expected"][3]
    assert second.poll() == [ids[4], ids[5], ids[6]] and second.stats.reloads == 0
    assert digest(model.snapshot()) == history["expected"][6]
    other = Subscriber(history["store"] + "-elsewhere", InferenceModel(history["config"]), state_path=None)
    with pytest.raises(Exception, match="follows"):
        other._load_state(path)


@pytest.mark.parametrize("quantized,bits", [(True, 8), ("int8", 8), ("int4", 4)])
def test_quantized_inference_model_serves_fbgemm_rows_of_the_published_tables(history, quantized, bits):
    """A quantized InferenceModel holds torchrec's quantized EBC only; 32-bit publishes are
    converted once by fbgemm's quantizer (the one torchrec's from_float uses)."""
    from cnr.codec.quant.bitpack import unpack

    model, fp32 = InferenceModel(history["config"], quantized=quantized), InferenceModel(history["config"])
    ids = ids_by_seq(history["store"])
    for target in (model, fp32):
        sub = Subscriber(history["store"], target)
        sub.apply(ids[1])
        sub.poll()  # a full base, then increments: both paths convert rows
        assert sub.applied.seq == 6
    assert model.bits == bits and fp32.bits == 32
    assert model.served_table_bytes() <= fp32.fp32_table_bytes() * (0.3 if bits == 4 else 0.5)
    for name in fp32.ebc.embedding_bags:
        x = fp32.table(name)
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, bits)
        width = fused.shape[1] - 4
        params = fused[:, width:].contiguous().view(torch.float16).float()
        expected = unpack(fused[:, :width], bits, x.shape[1]).float() * params[:, :1] + params[:, 1:]
        assert torch.equal(model.table(name), expected), name
        # fbgemm's rows: error <= half a (fp16) step, plus fp16 rounding of the bias
        bound = 0.5 * params[:, :1] + 2e-3 * x.abs().amax(dim=1, keepdim=True) + 1e-7
        assert bool(((model.table(name) - x).abs() <= bound).all()), name
    served, exact = model.evaluate(), fp32.evaluate()
    assert served["logloss"] == pytest.approx(exact["logloss"], rel=0.01 if bits == 8 else 0.05)


def test_quantized_must_name_a_serving_width(history):
    with pytest.raises(ValueError, match="quantized='int2' is not allowed; allowed: False, True \\(int8\\), 'int8', 'int4'"):
        InferenceModel(history["config"], quantized="int2")


def test_the_serving_snippet_of_the_docs_runs(history, tmp_path, monkeypatch):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "publishing.md").read_text()
    section = text[text.index("## Serving from torchrec's quantized tables"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace('"./ck/publish"', repr(history["store"])).replace('"configs/tiny.yaml"', repr(TINY))
    monkeypatch.chdir(tmp_path)
    namespace: Dict = {}
    exec(compile(code, "docs/publishing.md", "exec"), namespace)
    assert namespace["subscriber"].applied.seq == 6 and namespace["subscriber"].stats.errors == []
    assert namespace["pooled"]["f0"].shape == (1, 16) and bool(namespace["pooled"]["f0"].abs().sum() > 0)
    assert (tmp_path / "serving.pt").exists()


def test_cli_subscribe_serves_int4_tables(history, tmp_path):
    rc, out, err = run_cnr(["subscribe", history["store"], "--config", TINY, *sum((["--set", s] for s in SETTINGS), []),
                            "--once", "--eval", "--quantized", "int4"], str(tmp_path))
    assert rc == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["applied"]["seq"] == 6 and summary["serving"]["bits"] == 4
    assert summary["serving"]["table_bytes"] <= 0.3 * summary["serving"]["fp32_table_bytes"]
    assert summary["eval"]["logloss"] == pytest.approx(history["eval"]["logloss"], rel=0.05)


def test_cli_subscribe_once_with_eval(history, tmp_path):
    rc, out, err = run_cnr(["subscribe", history["store"], "--config", TINY, *sum((["--set", s] for s in SETTINGS), []),
                            "--once", "--eval"], str(tmp_path))
    assert rc == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["applied"]["seq"] == 6 and summary["applied"]["step"] == 60 and summary["reloads"] == 1
    assert summary["eval"]["logloss"] == pytest.approx(history["eval"]["logloss"], rel=1e-9)


def test_a_store_that_went_back_is_reloaded_not_skipped_behind_the_stale_seq(history, tmp_path):
    """The store loses the publish the model holds and everything after it (reset, rolled back,
    another trainer publishing from seq 1 again): the subscriber, running or restarted from its
    state file, reloads the newest listed chain instead of skipping every publish at or below its
    old seq for good; a store that holds nothing leaves the model as it is, with an error."""
    store = copy_store(history, tmp_path)
    ids = ids_by_seq(store)
    path = str(tmp_path / "sub.state")
    model = InferenceModel(history["config"])
    sub = Subscriber(store, model, state_path=path)
    assert sub.poll() == [ids[4], ids[5], ids[6]]
    storage = LocalStorage(store)
    for seq in (4, 5, 6):
        for key in storage.list(f"checkpoints/{ids[seq]}"):
            storage.delete(key)
    shutil.copy(path, str(tmp_path / "copy.state"))
    restarted_model = InferenceModel(history["config"])
    restarted = Subscriber(store, restarted_model, state_path=str(tmp_path / "copy.state"))
    assert restarted.applied.seq == 6
    for s, m in ((sub, model), (restarted, restarted_model)):
        assert s.poll() == [ids[1], ids[2], ids[3]] and s.applied.id == ids[3]
        assert digest(m.snapshot()) == history["expected"][3]
    for key in storage.list(""):
        storage.delete(key)
    assert sub.poll() == [] and sub.applied.id == ids[3]
    assert "holds no committed publish" in sub.stats.errors[-1]
    assert digest(model.snapshot()) == history["expected"][3]


class _SlowChunkReads(WrapperStorage):
    """Each ranged read (a chunk) takes 50 ms, as an object store's first byte does; counts how
    many are in flight at once."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def get(self, key, byte_range=None, *, limit=None):
        if byte_range is None:
            return self.inner.get(key, byte_range, limit=limit)
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.05)
            return self.inner.get(key, byte_range, limit=limit)
        finally:
            with self.lock:
                self.now -= 1


def test_chunks_are_fetched_several_at_once_and_applied_in_order(history):
    slow = _SlowChunkReads(open_storage(history["store"]))
    model = InferenceModel(history["config"])
    sub = Subscriber(slow, model, fetch_threads=4)
    ids = ids_by_seq(history["store"])
    for seq in sorted(ids):
        assert sub.apply(ids[seq])
        assert digest(model.snapshot()) == history["expected"][seq]
    assert slow.most > 1  # one fetch at a time would wait out every object's latency in turn
    serial = _SlowChunkReads(open_storage(history["store"]))
    Subscriber(serial, InferenceModel(history["config"]), fetch_threads=1).poll()
    assert serial.most == 1
    with pytest.raises(ValueError, match="fetch_threads=0 is not allowed; it must be an integer from 1 to 64"):
        Subscriber(history["store"], model, fetch_threads=0)
