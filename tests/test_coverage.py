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
from cnr.bench.conformance_jobs import JobSpec, build


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
