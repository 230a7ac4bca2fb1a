"""cnr.track.coverage: state cnr cannot give back exactly is refused when the Checkpointer is built,
naming the key and why, before anything is opened or written."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import cnr
from cnr.track.app_state import AppState
from cnr.track.coverage import UnsupportedStateError, check_supported
from cnr.app.launch import RankFailed, launch
from cnr.testing.jobs import JobSpec, build


class _ExtraState(torch.nn.Module):
    """A module whose state_dict holds a non-tensor (torch's extra state)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))

    def get_extra_state(self):
        return {"seen": 3}

    def set_extra_state(self, state) -> None:
        pass


def test_a_non_tensor_in_a_modules_state_dict_is_refused():
    with pytest.raises(UnsupportedStateError, match=r"app_state\['model'\].state_dict\(\)\['_extra_state'\] is a "
                                                    r"dict, not a tensor"):
        check_supported(AppState({"model": _ExtraState()}))


def test_a_dmp_collection_is_refused():
    from torchrec.distributed.model_parallel import DMPCollection

    wrapper = DMPCollection.__new__(DMPCollection)  # torchrec builds one on CUDA only
    torch.nn.Module.__init__(wrapper)
    wrapper._dmp_wrapped_module = torch.nn.Linear(2, 1)
    holder = torch.nn.Module()
    holder.dmp = wrapper
    with pytest.raises(UnsupportedStateError, match="holds a DMPCollection: 2D parallel"):
        check_supported(AppState({"model": holder}))


def _key_value(rank, world_size, arg):
    dmp, opt = build(JobSpec(**arg["spec"]), world_size)
    sharded = dmp.module.ebc
    sharded.module_sharding_plan["t_1"] = dataclasses.replace(sharded.module_sharding_plan["t_1"],
                                                              compute_kernel="key_value")
    cnr.Checkpointer(arg["uri"], {"model": dmp, "optim": opt}, cnr.CheckpointOptions())


def test_a_table_in_a_key_value_kernel_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    uri = tmp_path / "ck"
    with pytest.raises(RankFailed, match=r"table 't_1' of app_state\['model'\].ebc uses compute kernel 'key_value'"):
        launch(_key_value, 2, {"spec": dataclasses.asdict(JobSpec()), "uri": str(uri)})
    assert not os.path.exists(uri)


class _Flags(torch.nn.Module):
    """A module with bool and int8 buffers beside its parameter."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(3, generator=g))
        self.register_buffer("mask", torch.rand(5, generator=g) > 0.5)
        self.register_buffer("q", torch.randint(-128, 128, (2, 3), generator=g, dtype=torch.int8))


class _Holder:
    def __init__(self, state) -> None:
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


def _bool_int8_state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"seen": torch.rand(4, 2, generator=g) > 0.5, "done": torch.tensor(bool(seed % 2)),
            "codes": torch.randint(-128, 128, (6,), generator=g, dtype=torch.int8),
            "extremes": torch.tensor([-128, -1, 0, 127], dtype=torch.int8) * seed}


def _bytes(t: torch.Tensor):
    return [str(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).tolist()]


def _bool_int8_job(rank, world_size, arg):
    seed = 1 if arg["save"] else 0  # the restoring job starts from other values
    model, holder = _Flags(seed), _Holder(_bool_int8_state(seed))
    app_state = {"model": model, "thing": holder}
    with cnr.Checkpointer(arg["uri"], app_state, cnr.CheckpointOptions(policy="full")) as ckpt:
        if arg["save"]:
            ckpt.save(1).wait()
        else:
            ckpt.restore()
    return {"model": {k: _bytes(v) for k, v in model.state_dict().items()},
            "thing": {k: _bytes(v) for k, v in holder.state.items()}}


def test_bool_and_int8_buffers_and_stateful_tensors_restore_bit_exact(tmp_path):
    uri = str(tmp_path / "ck")
    saved = launch(_bool_int8_job, 1, {"uri": uri, "save": True})
    restored = launch(_bool_int8_job, 1, {"uri": uri, "save": False})
    assert restored == saved
    assert saved["thing"]["extremes"][2] == [128, 255, 0, 127] and saved["thing"]["done"][2] == [1]
    assert saved["model"]["mask"][0] == "torch.bool" and saved["model"]["q"][0] == "torch.int8"


def test_a_tensor_of_a_dtype_cnr_does_not_store_is_refused_naming_where_it_is():
    model = torch.nn.Linear(2, 1)
    model.register_buffer("counts", torch.zeros(3, dtype=torch.int16))
    thing = _Holder({"ok": torch.zeros(2, dtype=torch.bool), "nested": [{"z": torch.zeros(2, dtype=torch.complex64)}]})
    with pytest.raises(UnsupportedStateError) as e:
        check_supported(AppState({"model": model, "thing": thing}))
    message = str(e.value)
    assert "tensor 'model/counts' of app_state['model'] has dtype torch.int16" in message
    assert "app_state['thing'].state_dict()['nested'][0]['z'] has dtype torch.complex64" in message
    assert "cnr stores the dtypes float32, float16, bfloat16, float64, int64, int32, int8, uint8, bool" in message
    assert "['ok']" not in message
