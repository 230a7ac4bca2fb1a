"""The JSON part of app_state's state (cnr.track.json_tree) comes back exactly: dict key order and
OrderedDict across a checkpoint, in Stateful objects and in optimizers' param groups and
non-tensor state, and one tensor a Stateful names twice as one tensor; manifests stay
deterministic, and those written before order was kept read as they always did."""

from __future__ import annotations

import json
from collections import OrderedDict
from types import SimpleNamespace

import torch

import cnr
from cnr.app.launch import launch
from cnr.app.train import check_reader_position
from cnr.errors import CheckpointError
from cnr.format.catalog import list_checkpoints, read_manifest
from cnr.format.documents import Manifest
from cnr.format.manifest import manifest_to_bytes, parse_manifest
from cnr.storage.local import LocalStorage
from cnr.track.managed_collision import check_restore
from cnr.track.json_tree import decode_tree, encode_tree
from cnr.types import CheckpointKind

FIFO = {"shard-9": 3, "shard-10": 1, "shard-2": 7}  # oldest first: not the sorted order


def _through_json(tree):
    """encode_tree, then the manifest writer's json.dumps(sort_keys=True) and a parse, then decode."""
    tensors: list = []
    encoded = encode_tree(tree, "$", tensors)
    return decode_tree(json.loads(json.dumps(encoded, sort_keys=True)), tensors)


def _exact(a, b) -> bool:
    """Equal, with dict key order and every container's type equal too."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_exact(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_exact(x, y) for x, y in zip(a, b))
    return a == b


def test_key_order_and_ordered_dict_survive_sorted_json():
    tree = {"pending": FIFO, "od": OrderedDict([("z", 1), ("a", [OrderedDict(b=2, a=1)])]),
            "ids": {10: "x", 2: "y", -1: None}, "nested": [({"b": 1, "a": {"d": 0, "c": 1}},)],
            "__tuple__": 1, "sorted": {"a": 1, "b": 2}, "empty": {}, "empty_od": OrderedDict()}
    back = _through_json(tree)
    assert _exact(back, tree)
    assert list(back["pending"]) == ["shard-9", "shard-10", "shard-2"]
    assert type(back["od"]) is OrderedDict and type(back["od"]["a"][0]) is OrderedDict


def test_a_dict_already_in_sorted_order_stays_a_plain_json_object():
    assert encode_tree({"kind": "synthetic", "next_batch": 4}, "$", []) == {"kind": "synthetic", "next_batch": 4}
    assert encode_tree({"b": 1, "a": 2}, "$", []) == {"__dict__": [["b", 1], ["a", 2]]}
    assert encode_tree(OrderedDict(a=1), "$", []) == {"__odict__": [["a", 1]]}


def test_state_written_before_order_was_kept_reads_as_before():
    # an older writer stored every str-keyed dict as a plain object, written with sorted keys
    old = json.loads(json.dumps({"pending": FIFO, "t": {"__tuple__": [1, 2]}, "i": {"__dict__": [[1, 2]]}},
                                sort_keys=True))
    back = decode_tree(old, [])
    assert back == {"pending": FIFO, "t": (1, 2), "i": {1: 2}}
    assert list(back["pending"]) == sorted(FIFO) and type(back["pending"]) is dict


def test_one_tensor_in_two_places_is_stored_once():
    t, other = torch.arange(3.0), torch.arange(3.0)
    tensors: list = []
    encoded = encode_tree({"a": t, "b": [t, (other, t)]}, "$", tensors)
    assert len(tensors) == 2 and tensors[0] is t and tensors[1] is other
    back = decode_tree(json.loads(json.dumps(encoded, sort_keys=True)), [t.clone(), other.clone()])
    assert back["a"] is back["b"][0] is back["b"][1][1] and back["b"][1][0] is not back["a"]


def _manifest(app) -> Manifest:
    return Manifest(id="0000000007-ab", step=7, kind=CheckpointKind.FULL, base=None, world_size=1, created_unix=1.0,
                    tables=(), tensors={}, counters={"step": 7}, app_ranks=(app,))


def test_manifests_keep_the_order_and_stay_deterministic():
    app = {"queue": {"kind": "stateful", "state": encode_tree({"pending": FIFO, "od": OrderedDict(FIFO)}, "$", []),
                     "tensors": 0}}
    blob = manifest_to_bytes(_manifest(app))
    assert blob == manifest_to_bytes(_manifest(json.loads(json.dumps(app))))  # same state, same bytes
    state = decode_tree(parse_manifest(blob).app_ranks[0]["queue"]["state"], [])
    assert list(state["pending"]) == list(FIFO) and state["od"] == OrderedDict(FIFO)
    assert type(state["od"]) is OrderedDict


def test_cnr_train_reads_a_reader_cursor_stored_in_order():
    def app(next_batch):
        cursor = {"next_batch": next_batch, "kind": "tsv"}  # not sorted: stored tagged
        return {"reader": {"kind": "stateful", "state": encode_tree(cursor, "$", []), "tensors": 0},
                "progress": {"kind": "stateful", "state": {"samples": 640}, "tensors": 0}}

    check_reader_position(_manifest(app(10)), 64)
    try:
        check_reader_position(_manifest(app(11)), 64)
    except CheckpointError as e:
        assert "its data position is damaged" in str(e)
    else:
        raise AssertionError("a cursor one batch off was not caught")


def test_a_reshard_of_managed_collision_state_stored_in_order_is_still_refused():
    # the MCH state of a table is a dict in its own (unsorted) key order: stored tagged
    saved = {"ec": {"t0": {"shard": [0, 10, 20], "current_iter": 3, "history_size": -1}}}
    app = {"model.managed_collision": {"kind": "stateful", "state": encode_tree(saved, "$", []), "tensors": 0}}
    collection = SimpleNamespace(_managed_collision_modules={"t0": None}, _mc_module_name_shard_metadata={"t0": [0, 5, 20]})
    runtime = SimpleNamespace(key="model.managed_collision", modules=[("ec", SimpleNamespace(_managed_collision_collection=collection))])
    try:
        check_restore(_manifest(app), {"model.managed_collision": runtime}, 0, 1)
    except CheckpointError as e:
        assert "had shard [0, 10, 20]" in str(e) and "cannot be resharded" in str(e)
    else:
        raise AssertionError("a changed remapping shard was not caught")


class Queue:
    """A loader-like Stateful: work pending in FIFO order, and an OrderedDict."""

    def __init__(self, pending=None) -> None:
        self.pending = dict(pending or {})

    def state_dict(self):
        return {"pending": self.pending, "od": OrderedDict(self.pending)}

    def load_state_dict(self, state) -> None:
        self.pending, self.od = state["pending"], state["od"]


class Shared:
    """A Stateful whose state names one tensor twice (a buffer and a view of the same object)."""

    def __init__(self) -> None:
        buf = torch.arange(4.0)
        self.state = {"buf": buf, "alias": buf}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


def _objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def _save_then_restore(rank, world_size, arg):
    model, opt = _objects()
    queue = Queue(FIFO if arg["save"] else None)
    app_state = {"model": model, "optim": opt, "queue": queue, "shared": Shared()}
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="full")) as ckpt:
        if arg["save"]:
            opt.param_groups[0]["schedule"] = {"warmup": 5, "decay": OrderedDict(b=1, a=2)}
            opt.state[model.weight]["meta"] = {"z": 1, "a": (2, {"y": 0, "x": 1})}
            ckpt.save(1).wait()
            return {}
        ckpt.restore()
    out = {"pending": list(queue.pending), "od": [type(queue.od).__name__, list(queue.od)]}
    schedule = opt.param_groups[0]["schedule"]
    out["schedule"] = [list(schedule), type(schedule["decay"]).__name__, list(schedule["decay"])]
    meta = opt.state[model.weight]["meta"]
    out["meta"] = [list(meta), type(meta["a"]).__name__, list(meta["a"][1])]
    shared = app_state["shared"].state
    out["aliased"] = shared["buf"] is shared["alias"] and shared["buf"].tolist() == [0.0, 1.0, 2.0, 3.0]
    return out


def test_a_checkpoint_gives_back_key_order_and_ordered_dicts(tmp_path):
    uri = str(tmp_path / "ck")
    launch(_save_then_restore, 1, {"uri": uri, "save": True})
    out = launch(_save_then_restore, 1, {"uri": uri, "save": False})
    assert out["pending"] == ["shard-9", "shard-10", "shard-2"]  # the next item served is the oldest
    assert out["od"] == ["OrderedDict", ["shard-9", "shard-10", "shard-2"]]
    assert out["schedule"] == [["warmup", "decay"], "OrderedDict", ["b", "a"]]
    assert out["meta"] == [["z", "a"], "tuple", ["y", "x"]]
    assert out["aliased"]  # one tensor named twice comes back as one tensor ...
    stored = [n for n in read_manifest(LocalStorage(uri), list_checkpoints(LocalStorage(uri))[0].id).tensors
              if n.startswith("shared/")]
    assert stored == ["shared/rank-00000/t0"]  # ... stored once
