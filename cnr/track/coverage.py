"""What cnr can checkpoint exactly, decided before training: every piece of state is classified
when a Checkpointer is built, and what cannot be stored and given back bit for bit is refused
there, naming the key and why.

Each module's ``state_dict()`` value must be a tensor or a torchrec ShardedTensor (table rows,
their fused optimizer state, dense parameters and buffers, sharded buffers such as remapping
state); its tables must be held by a kernel whose rows live in the table tensor (not a key-value
store); its fused optimizer state must be tensors tied to the table's rows or elements. A value
that is not a tensor would be dropped without a word, so it is refused instead.
"""

from __future__ import annotations

from typing import Any, List

import torch

from cnr.track.app_state import MODULE, AppState, sharded_modules

# torchrec's EmbeddingComputeKernel values whose rows live in the table tensors cnr copies
# (UVM-cached tables flush their cache in state_dict(), which every snapshot calls)
SUPPORTED_KERNELS = frozenset({"dense", "fused", "fused_uvm", "fused_uvm_caching"})
_DMP_COLLECTION = ("2D parallel (DMPCollection) keeps one copy of each table per replica group, which cnr's "
                   "per-rank pieces do not tell apart (and torchrec builds it on CUDA only, where this is untested); "
                   "train with DistributedModelParallel")


class UnsupportedStateError(TypeError):
    """app_state holds state cnr cannot checkpoint exactly (raised when a Checkpointer is built)."""


def _is_sharded(value: Any) -> bool:
    return hasattr(value, "local_shards")


def _value_problem(where: str, value: Any) -> List[str]:
    if _is_sharded(value):
        return []
    if type(value).__name__ == "DTensor":
        return [f"{where} is a DTensor; cnr stores torch tensors and torchrec ShardedTensors"]
    if isinstance(value, torch.Tensor):
        return []
    return [f"{where} is a {type(value).__name__}, not a tensor: a module's state_dict() values are stored as "
            "tensors, and this one would be lost"]


def _kernel_problems(key: str, path: str, sharded: torch.nn.Module) -> List[str]:
    plan = getattr(sharded, "module_sharding_plan", None) or {}
    out = []
    for table, sharding in plan.items():
        kernel = str(getattr(sharding, "compute_kernel", "") or "")
        if kernel and kernel not in SUPPORTED_KERNELS:
            out.append(f"table {table!r} of app_state[{key!r}].{path} uses compute kernel {kernel!r}, whose rows live "
                       f"outside the table tensor; cnr checkpoints the kernels {sorted(SUPPORTED_KERNELS)}")
    return out


def _module_problems(key: str, module: torch.nn.Module) -> List[str]:
    from torchrec.distributed.model_parallel import DMPCollection

    out = [f"app_state[{key!r}] holds a DMPCollection: {_DMP_COLLECTION}"
           for m in module.modules() if isinstance(m, DMPCollection)][:1]
    if out:
        return out
    for sd_key, value in module.state_dict().items():
        out += _value_problem(f"app_state[{key!r}].state_dict()[{sd_key!r}]", value)
    for path, sharded in sharded_modules(module):
        out += _kernel_problems(key, path, sharded)
        fused = getattr(sharded, "fused_optimizer", None)
        if fused is None:
            continue
        for param_key, states in fused.state_dict()["state"].items():
            for state_key, value in states.items():
                out += _value_problem(f"the fused optimizer state {state_key!r} of {path}.{param_key} in "
                                      f"app_state[{key!r}]", value)
    return out


def check_supported(app: AppState) -> None:
    """Raise UnsupportedStateError naming every piece of ``app``'s state that cnr cannot
    checkpoint exactly (nothing is opened or written before this)."""
    problems: List[str] = []
    for key, kind in app.kinds.items():
        if kind == MODULE:
            problems += _module_problems(key, app.objects[key])
    try:
        app.collect()  # the pieces themselves: fused state tied to rows, Stateful trees cnr can store
    except (TypeError, ValueError) as e:
        problems.append(str(e))
    if problems:
        raise UnsupportedStateError("cnr cannot checkpoint this app_state exactly, so it refuses it before training: "
                                    + "; ".join(problems))
