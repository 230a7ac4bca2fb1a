"""A dense optimizer's state of sharded tables in torchrec's dense compute kernel, stored like the
table rows it belongs to.

Under the dense kernel (``EmbeddingComputeKernel.DENSE``, torchrec's ``table_wise()`` /
``row_wise()`` default) no optimizer is fused into the table: the sharded module's
``named_parameters()`` yields, per table, this rank's local weight shard (a view of the rows and
columns the shard holds) or, on a rank holding no shard, an empty placeholder ``Parameter`` of
shape (0,). An optimizer over those parameters (``torch.optim.Adam(dmp.parameters())``) keeps
per-rank state of the local shard's shape, for the shard's rows and columns only: the same
elements as the weight shard, under the same name on every rank. Stored as whole tensors, those
per-rank values would be taken for copies of one tensor.

So each such state tensor is stored as ``Role.TABLE_STATE`` of the table: global shape the
table's, region the weight shard's, stored and resharded like the rows (every world size and
plan, increments included: cnr.track.app_state.whole_tables stores the table whole in increments
unless its optimizers move only looked-up rows). Per-parameter values that are not per element
(Adam's ``step``, a 0-d tensor) are stored as JSON with the shard's region, and on restore each
shard takes the value that the saved shards overlapping its rows agree on. A placeholder's state
holds no element and is not stored.

Invariants: a table parameter pairs with exactly one local weight shard of its shape; its
per-element state has that shape; its optimizer is one of ``ELEMENTWISE`` (state per element,
or per parameter). Anything else is refused when the Checkpointer is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from cnr.types import ShardRegion

# torch optimizers whose state is per element of the parameter (or one value per parameter):
# such state splits and joins with the weight's rows and columns exactly. Adafactor keeps row and
# column factors of the whole shard, LBFGS a history of the flattened parameters: neither does.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD")
_ELEMENTWISE_CLASSES = frozenset(getattr(torch.optim, n) for n in ELEMENTWISE)  # exactly these: a subclass may keep more
_USE_FUSED = ("shard the table with the fused kernel instead (compute_kernel='fused', torchrec's planner's "
              "default), whose optimizer state cnr stores with the table")


@dataclass(frozen=True)
class TableParam:
    """The parameter a dense optimizer sees for a sharded table on this rank.

    ``table``: the table id; ``global_shape``: the table's; ``region``: the weight shard the
    parameter is (None: this rank holds no shard, the parameter is torchrec's empty placeholder);
    ``problem``: why its state cannot be tied to the table's elements (then it is refused)."""

    table: str
    global_shape: Tuple[int, ...]
    region: Optional[ShardRegion]
    problem: Optional[str] = None


def _kernel(ref: Any) -> str:
    plan = getattr(ref.module, "module_sharding_plan", None) or {}
    return str(getattr(plan.get(ref.name), "compute_kernel", "") or "")


def table_params(refs: Sequence[Any]) -> Dict[int, TableParam]:
    """id(parameter) -> its TableParam, for every sharded table of ``refs`` (cnr.track.app_state
    TableRefs) whose module yields a parameter for it. Data-parallel tables (a plain weight,
    replicated) are not here: their optimizer state is whole and the same on every rank."""
    out: Dict[int, TableParam] = {}
    for ref in refs:
        weight = ref.module.state_dict().get(ref.local_key)
        param = dict(ref.module.named_parameters()).get(ref.local_key)
        if param is None or not hasattr(weight, "local_shards"):
            continue
        shape, shards = tuple(weight.size()), weight.local_shards()
        if not shards:
            out[id(param)] = TableParam(ref.id, shape, None)
            continue
        sizes = [tuple(s.metadata.shard_sizes) for s in shards]
        if len(shards) != 1 or sizes[0] != tuple(param.shape):
            problem = (f"table {ref.id!r} (compute kernel {_kernel(ref)!r}): its parameter of shape "
                       f"{tuple(param.shape)} is not the one local weight shard of this rank (shards {sizes}), so "
                       f"its optimizer state cannot be tied to the table's rows; {_USE_FUSED}")
            out[id(param)] = TableParam(ref.id, shape, None, problem)
            continue
        region = ShardRegion(tuple(shards[0].metadata.shard_offsets), sizes[0])
        out[id(param)] = TableParam(ref.id, shape, region)
    return out


def check_optimizer(where: str, opt: Any, leaves: Sequence[Any], params: Mapping[int, TableParam]) -> None:
    """TypeError naming the first table parameter of ``opt`` that cnr cannot store the state of:
    one that does not pair with its weight shard, or one trained by an optimizer outside
    ``ELEMENTWISE`` (``leaves``: the optimizers doing the work under ``opt``'s wrappers).
    Checked before any state exists: Adam makes its state at its first step."""
    for leaf in leaves:
        known = type(leaf) in _ELEMENTWISE_CLASSES
        for group in leaf.param_groups:
            for param in group["params"]:
                tp = params.get(id(param))
                if tp is None:
                    continue
                if tp.problem:
                    raise TypeError(f"{where} trains {tp.problem}")
                if not known and tp.region is not None:
                    raise TypeError(
                        f"{where} trains table {tp.table!r} (a sharded table in torchrec's dense compute kernel) with "
                        f"{type(leaf).__module__}.{type(leaf).__qualname__}, whose state cnr cannot tie to the table's "
                        f"elements (it stores the state of torch.optim's {', '.join(ELEMENTWISE)} there); {_USE_FUSED}")


def split_state(where: str, tp: TableParam, param: torch.Tensor,
                states: Mapping[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(per-element state tensors, per-parameter values) of one table parameter's optimizer
    state; both empty on a rank holding no shard (a placeholder's state holds no element).
    TypeError for a tensor of another shape than the parameter's (not tied to its elements)."""
    if tp.region is None:
        return {}, {}
    tensors: Dict[str, torch.Tensor] = {}
    values: Dict[str, Any] = {}
    for key, value in states.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if tuple(value.shape) != tuple(param.shape):
                raise TypeError(
                    f"{where}[{key!r}] of table {tp.table!r} (a sharded table in torchrec's dense compute kernel) has "
                    f"shape {tuple(value.shape)}, not its shard's {tuple(param.shape)}: cnr stores such state per "
                    f"element of the table; {_USE_FUSED}")
            tensors[key] = value
        else:
            values[key] = value
    return tensors, values


def _overlaps(a: Sequence[Sequence[int]], b: ShardRegion) -> bool:
    (offsets, sizes) = a
    return all(o < bo + bs and bo < o + s for o, s, bo, bs in zip(offsets, sizes, b.offsets, b.sizes))


def saved_values(saved: List[Dict[str, Any]], tp: TableParam, name: str, where: str) -> Optional[Any]:
    """The per-parameter values (JSON) for this rank's shard of ``tp`` among every rank's saved
    ``table_values[name]`` (``{"region": [offsets, sizes], "values": ...}``): those of the saved
    shards overlapping its region, which must agree. None when none was saved (the optimizer had
    no state yet). ValueError naming the table when they differ: this shard's rows had different
    steps (say) in different saved shards, and no one value is exact for all of them."""
    if tp.region is None:
        return None
    found = [s["values"] for s in saved if _overlaps(s["region"], tp.region)]
    distinct = [v for i, v in enumerate(found) if v not in found[:i]]
    if len(distinct) > 1:
        raise ValueError(f"{where}: the optimizer values of parameter {name!r} (table {tp.table!r}) differ between "
                         f"the saved shards holding the rows of this rank's shard {tp.region}: {distinct}; restore "
                         "with the plan that saved them")
    return distinct[0] if distinct else None
