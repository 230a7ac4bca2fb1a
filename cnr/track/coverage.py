"""What cnr can checkpoint exactly, decided before training: every piece of state is classified
when a Checkpointer is built, and what cannot be stored and given back bit for bit is refused
there, naming the key and why.

Each module's ``state_dict()`` value must be a tensor or a torchrec ShardedTensor (table rows,
their fused optimizer state, dense parameters and buffers, sharded buffers such as remapping
state); its tables must be held by a kernel whose rows live in the table tensor (not a key-value
store); its fused optimizer state must be tensors tied to the table's rows or elements. A value
that is not a tensor would be dropped without a word, so it is refused instead. Every tensor,
Stateful ones included, must be of a dtype cnr stores (cnr.codec.base.DTYPES); another would
make every checkpoint fail in the background writer.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch

from cnr.errors import CnrError
from cnr.codec.base import DTYPE_NAMES, DTYPES
from cnr.track.app_state import MODULE, OPTIMIZER, STATEFUL, AppState, sharded_modules
from cnr.track.json_tree import is_sharded
from cnr.track.state import StatePiece
from cnr.types import Role

# torchrec's EmbeddingComputeKernel values whose rows live in the table tensors cnr copies
# (UVM-cached tables flush their cache in state_dict(), which every snapshot calls)
SUPPORTED_KERNELS = frozenset({"dense", "fused", "fused_uvm", "fused_uvm_caching"})
_DMP_COLLECTION = ("2D parallel (DMPCollection) keeps one copy of each table per replica group, which cnr's "
                   "per-rank pieces do not tell apart (and torchrec builds it on CUDA only, where this is untested); "
                   "train with DistributedModelParallel")


class UnsupportedStateError(CnrError, TypeError):
    """app_state holds state cnr cannot checkpoint exactly (raised when a Checkpointer is built); a
    TypeError too, as it was before it joined cnr's errors."""


def _value_problem(where: str, value: Any) -> List[str]:
    if is_sharded(value):
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


def _tensors_in(value: Any, path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(key path, tensor) of every tensor in a Stateful's state tree, as cnr.track.json_tree walks it."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors_in(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors_in(v, f"{path}[{k!r}]")


def _dtype_problems(app: AppState, pieces: List[StatePiece]) -> List[str]:
    """Every tensor of a dtype cnr does not store (cnr.codec.base.DTYPES): the writer would fail
    on it at every checkpoint, in the background."""
    allowed = f"cnr stores the dtypes {', '.join(DTYPES)}"
    out: List[str] = []
    walked: Dict[str, List[str]] = {}  # Stateful key -> its tensors of such dtypes, by their place in its state
    for piece in pieces:
        if piece.tensor.dtype in DTYPE_NAMES:
            continue
        key = piece.name.split("/", 1)[0]
        if piece.role == Role.STATEFUL and app.kinds.get(key) == STATEFUL and key not in walked:
            # named by their place in the state rather than their stored names <key>/rank-<r>/t<i>
            walked[key] = [f"{path} has dtype {t.dtype}; {allowed}" for path, t in
                           _tensors_in(app.objects[key].state_dict(), f"app_state[{key!r}].state_dict()")
                           if t.dtype not in DTYPE_NAMES]
        found = walked.get(key) if piece.role == Role.STATEFUL else None
        for problem in found or [f"tensor {piece.name!r} of app_state[{key!r}] has dtype {piece.tensor.dtype}; {allowed}"]:
            if problem not in out:  # once per tensor, not per shard or per Stateful piece
                out.append(problem)
    return out


def _free_parameters(key: str, app: AppState) -> List[str]:
    """Parameters the optimizer app_state[key] trains that no module in app_state holds: their
    values would not be stored (a module stores them) while their optimizer state would, named by
    position only."""
    opt = app.objects[key]
    return [f"app_state[{key!r}] trains param_groups[{g}]['params'][{i}] (shape {list(p.shape)}), which no module in "
            "app_state holds: cnr stores a parameter's values with its module; put that module in app_state"
            for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])
            if not is_sharded(p) and id(p) not in app.param_names][:3]


def check_supported(app: AppState) -> None:
    """Raise UnsupportedStateError naming every piece of ``app``'s state that cnr cannot
    checkpoint exactly (nothing is opened or written before this)."""
    problems: List[str] = []
    for key, kind in app.kinds.items():
        if kind == MODULE:
            problems += _module_problems(key, app.objects[key])
        elif kind == OPTIMIZER:
            problems += _free_parameters(key, app)
    try:
        pieces = app.collect()[0]  # the pieces themselves: fused state tied to rows, Stateful trees cnr can store
    except (TypeError, ValueError) as e:
        problems.append(str(e))
    else:
        problems += _dtype_problems(app, pieces)
    if problems:
        raise UnsupportedStateError("cnr cannot checkpoint this app_state exactly, so it refuses it before training: "
                                    + "; ".join(problems))
