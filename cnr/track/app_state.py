"""The application's state: an ``app_state`` dict -> named, role-tagged state pieces and JSON, and back.

``app_state`` maps a key (no "/") to one of (torch.distributed.checkpoint's conventions):
- a module (a DistributedModelParallel, or any module holding torchrec sharded
  EmbeddingBagCollection / EmbeddingCollection modules): every tensor of its ``state_dict()``
  and the state of its tables' fused optimizers. A module holding managed-collision modules
  (MC-EC / MC-EBC) also gets a Stateful entry ``<key>.managed_collision`` for their runtime
  state outside the state_dict (cnr.track.managed_collision);
- an optimizer (``torch.optim.Optimizer``, torchrec ``KeyedOptimizer`` / ``CombinedOptimizer``):
  per-parameter state tensors and ``param_groups``; state already stored with a module's
  tables (fused, ShardedTensor) is skipped;
- any other object with ``state_dict()`` / ``load_state_dict()`` (the Stateful protocol): its
  state, a tree of dicts, lists, tuples, JSON scalars and tensors, stored per rank.

Stored names (``/`` separates what a state_dict key never contains; cnr.names.TensorName parses them):
  ``<key>/<state_dict key>``                          module tensors (role table_rows or dense)
  ``<key>/<table weight key>/<fused state key>``       e.g. ``model/ebc.embedding_bags.t0.weight/t0.momentum1``
  ``<key>/<module key>.<parameter path>/<state key>``  optimizer state, e.g. ``optim/model.over.0.weight/sum``;
                                                      of a dense-kernel table's shard: role table_state, the
                                                      table's shape (cnr.track.dense_kernel)
  ``<key>/rank-<r>/t<i>``                             the i-th tensor of a Stateful object's state on rank r
A table's id is the stored name of its weight, so two modules may both name a table ``t0``.
Nothing is pickled: the JSON parts go into the manifest (in cnr.track.json_tree's form, which
keeps dict key order and OrderedDict), tensors into chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from cnr.track.dense_kernel import check_optimizer, split_state, table_params
from cnr.track.fused_kernel import fused_table_kernels, fused_table_optimizers, leaf_optimizers
from cnr.track.json_tree import encode_tree, is_sharded
from cnr.track.optimizer_groups import dense_groups, fused_table_groups, group_classes, group_values_json
from cnr.track.managed_collision import RUNTIME_SUFFIX, adapt
from cnr.track.modules import embedding_modules, is_managed_collision
from cnr.names import stateful_name
from cnr.track.state import StatePiece, pieces_of, whole_piece
from cnr.types import Role

MODULE, OPTIMIZER, STATEFUL = "module", "optimizer", "stateful"
_TABLE_PARENTS = ("embedding_bags", "embeddings")


def kind_of(key: str, value: Any) -> str:
    """What ``app_state[key]`` is to cnr; TypeError for a value cnr cannot checkpoint."""
    if isinstance(value, torch.nn.Module):
        return MODULE
    if isinstance(value, torch.optim.Optimizer):
        return OPTIMIZER
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return STATEFUL
    raise TypeError(f"app_state[{key!r}] is a {type(value).__name__}; allowed: a torch.nn.Module, a torch optimizer, "
                    "or an object with state_dict() and load_state_dict()")


def check_app_state(app_state: Mapping[str, Any]) -> Dict[str, str]:
    """Key -> kind for every entry; TypeError/ValueError naming a bad key or value."""
    if not isinstance(app_state, Mapping) or not app_state:
        raise TypeError(f"app_state must be a non-empty dict of key -> module/optimizer/Stateful, got {app_state!r:.80}")
    kinds = {}
    for key, value in app_state.items():
        if not isinstance(key, str) or not key or "/" in key or key != key.strip():
            raise ValueError(f"app_state key {key!r} is not allowed; use a non-empty string without '/' or "
                             "surrounding spaces")
        kinds[key] = kind_of(key, value)
    return kinds


# ---- embedding tables of a module -----------------------------------------------------------------

# wrappers of a sharded EC/EBC: torchrec's managed-collision modules (cnr.track.managed_collision) and
# its feature-processed EBC, whose compute_and_output_dist is the wrapped EBC's (so its hook runs)
_WRAPPED = ("_embedding_module", "_embedding_bag_collection")


def _wrapped(module: torch.nn.Module) -> Optional[str]:
    """The attribute holding the sharded EC/EBC that ``module`` wraps, or None."""
    if is_managed_collision(module):
        return _WRAPPED[0]
    inner = getattr(module, _WRAPPED[1], None)
    return _WRAPPED[1] if hasattr(inner, "register_post_lookup_tracker_fn") else None


def sharded_modules(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(path as in ``module.state_dict()`` keys, sharded EBC/EC) for every module holding tables
    inside ``module``: a wrapper (managed collisions, feature processing) stands for the EC/EBC
    it wraps."""
    out = []
    for path, child in embedding_modules(module):
        attr = _wrapped(child)
        if attr is not None:
            path, child = (f"{path}.{attr}" if path else attr), getattr(child, attr)
        out.append((path, child))
    return out


@dataclass(frozen=True)
class TableRef:
    """One embedding table of an app_state module. ``id``: the stored name of its weight;
    ``local_key``: the weight's key in ``module.state_dict()``; ``name``: torchrec's table name;
    ``path``: the sharded module's path in the app module's state_dict keys."""

    id: str
    module: torch.nn.Module
    path: str
    local_key: str
    name: str


def tables_of(key: str, module: torch.nn.Module) -> List[TableRef]:
    """Every embedding table of ``module`` (app_state[key]), in its modules' order."""
    refs = []
    for path, sharded in sharded_modules(module):
        for local_key in sharded.state_dict():
            parts = local_key.split(".")
            if len(parts) == 3 and parts[0] in _TABLE_PARENTS and parts[2] == "weight":
                full = f"{path}.{local_key}" if path else local_key
                refs.append(TableRef(f"{key}/{full}", sharded, path, local_key, parts[1]))
    return refs


def app_tables(app_state: Mapping[str, Any]) -> List[TableRef]:
    """Every embedding table of every module in ``app_state``."""
    return [t for key, value in app_state.items() if isinstance(value, torch.nn.Module) for t in tables_of(key, value)]


# ---- the app state -----------------------------------------------------------------------------------

class AppState:
    """An app_state dict, validated, with its pieces and per-rank JSON.

    ``whole_tables``: nothing here decides it; see cnr.api (tables stored whole in increments).
    """

    def __init__(self, app_state: Mapping[str, Any], rank: int = 0) -> None:
        self.objects = dict(app_state)
        self.kinds = check_app_state(self.objects)
        self.rank = rank
        self.runtime_keys = self._add_managed_collision_state()
        self.tables = app_tables(self.objects)
        self.param_names = self._param_names()
        # id(parameter) -> the sharded table whose local shard it is (torchrec's dense kernel)
        self.table_params = table_params(self.tables)

    def _add_managed_collision_state(self) -> List[str]:
        """Add a Stateful entry ``<key>.managed_collision`` per module holding managed-collision
        modules: their runtime state outside the state_dict (cnr.track.managed_collision). ValueError
        for managed-collision modules cnr cannot checkpoint."""
        added = []
        for key, kind in list(self.kinds.items()):
            runtime = adapt(key, self.objects[key]) if kind == MODULE else None
            if runtime is not None:
                name = key + RUNTIME_SUFFIX
                if name in self.objects:
                    raise ValueError(f"app_state key {name!r} is taken by cnr for the managed-collision state of "
                                     f"app_state[{key!r}]; rename that key")
                self.objects[name], self.kinds[name] = runtime, STATEFUL
                added.append(name)
        return added

    def _param_names(self) -> Dict[int, str]:
        """id(parameter) -> ``<module key>.<parameter path>`` over the modules of app_state."""
        names: Dict[int, str] = {}
        for key, value in self.objects.items():
            if self.kinds[key] == MODULE:
                for path, param in value.named_parameters():
                    names.setdefault(id(param), f"{key}.{path}")
        return names

    def optimizer_params(self, opt: torch.optim.Optimizer) -> List[Tuple[str, torch.Tensor]]:
        """(stored name, parameter) of every parameter of ``opt`` not owned by a fused table."""
        out = []
        for g, group in enumerate(opt.param_groups):
            for i, param in enumerate(group["params"]):
                if not is_sharded(param):
                    out.append((self.param_names.get(id(param), f"group{g}.param{i}"), param))
        return out

    def group_param_names(self, opt: torch.optim.Optimizer, group: Dict[str, Any]) -> List[str]:
        """The stored names (``optimizer_params``) of ``group``'s parameters not owned by a fused table."""
        ids = {id(p) for p in group["params"]}
        return [name for name, param in self.optimizer_params(opt) if id(param) in ids]

    # ---- save side -------------------------------------------------------------------------------

    def pieces(self) -> List[StatePiece]:
        """Every tensor piece this rank holds, Stateful tensors included, in name order."""
        return self.collect()[0]

    def collect(self) -> Tuple[List[StatePiece], Dict[str, Any]]:
        """(pieces, this rank's JSON of every object). TypeError names state cnr cannot store."""
        pieces: List[StatePiece] = []
        app: Dict[str, Any] = {}
        for key, value in self.objects.items():
            kind = self.kinds[key]
            if kind == MODULE:
                app[key] = self._module(key, value, pieces)
            elif kind == OPTIMIZER:
                app[key] = self._optimizer(key, value, pieces)
            else:
                app[key] = self._stateful(key, value, pieces)
        pieces.sort(key=lambda p: (p.name, p.region.offsets))
        return pieces, app

    def _module(self, key: str, module: torch.nn.Module, pieces: List[StatePiece]) -> Dict[str, Any]:
        tables = {t.id for t in self.tables}
        state_dict = module.state_dict()
        for sd_key, value in state_dict.items():
            name = f"{key}/{sd_key}"
            pieces += pieces_of(name, value, Role.TABLE_ROWS if name in tables else Role.DENSE,
                                name if name in tables else None)
        fused_groups: Dict[str, Any] = {}  # table id -> its fused param group's values
        kernels: Dict[str, str] = {}  # table id -> its fused kernel's optimizer
        kernel_values: Dict[str, Any] = {}  # table id -> what its kernel holds apart from the groups
        for path, sharded in sharded_modules(module):
            fused = getattr(sharded, "fused_optimizer", None)
            if fused is None:
                continue
            for param_key, states in fused.state_dict()["state"].items():
                weight_key = f"{path}.{param_key}" if path else param_key
                weight = f"{key}/{weight_key}"
                for state_key, value in states.items():
                    pieces += table_state_pieces(f"{weight}/{state_key}", value, weight, state_dict.get(weight_key))
            fused_groups.update(fused_table_groups(key, path, fused))
            kernels.update(fused_table_optimizers(key, path, fused))
            kernel_values.update(fused_table_kernels(key, path, fused))
        return {"kind": MODULE, "fused_table_groups": fused_groups, "fused_table_optimizers": kernels,
                "fused_table_kernels": kernel_values}

    def _optimizer(self, key: str, opt: torch.optim.Optimizer, pieces: List[StatePiece]) -> Dict[str, Any]:
        other: Dict[str, Any] = {}
        table_values: Dict[str, Any] = {}  # parameter name -> its shard's region and per-parameter values
        check_optimizer(f"app_state[{key!r}]", opt, leaf_optimizers(opt), self.table_params)
        for name, param in self.optimizer_params(opt):
            tp = self.table_params.get(id(param))
            if tp is not None:  # a sharded table's local shard: its state is the table's (cnr.track.dense_kernel)
                where = f"app_state[{key!r}].state[{name!r}]"
                tensors, values = split_state(where, tp, param, opt.state.get(param, {}))
                pieces += [StatePiece(f"{key}/{name}/{k}", tp.global_shape, tp.region, v, False, Role.TABLE_STATE,
                                      tp.table) for k, v in tensors.items()]
                if values and tp.region is not None:
                    table_values[name] = {"region": [list(tp.region.offsets), list(tp.region.sizes)],
                                          "values": group_values_json(values, where)}
                continue
            for state_key, value in opt.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and not is_sharded(value):
                    pieces.append(whole_piece(f"{key}/{name}/{state_key}", value, Role.OPTIMIZER))
                else:
                    path, nested = f"app_state[{key!r}].state[{name!r}][{state_key!r}]", []
                    other.setdefault(name, {})[state_key] = encode_tree(value, path, nested)
                    if nested:  # only a state value that is a tensor is stored as one
                        raise TypeError(f"{path} holds tensors inside a {type(value).__name__}; cnr stores an "
                                        "optimizer's per-parameter state tensors when they are the values themselves")
        groups = dense_groups(opt)
        return {"kind": OPTIMIZER, "state": other, "table_values": table_values,
                "param_groups": [group_values_json(g, f"app_state[{key!r}].param_groups[{i}]") for i, g in enumerate(groups)],
                # each group's parameters by name and its optimizer's class: a restore checks both, group by group
                "group_params": [self.group_param_names(opt, g) for g in groups],
                "group_classes": group_classes(opt, groups)}

    def _stateful(self, key: str, obj: Any, pieces: List[StatePiece]) -> Dict[str, Any]:
        tensors: List[torch.Tensor] = []
        tree = encode_tree(obj.state_dict(), f"app_state[{key!r}].state_dict()", tensors)
        for i, t in enumerate(tensors):
            # a detached CPU copy: the object may reuse its tensors before the writer reads them
            pieces.append(whole_piece(stateful_name(key, self.rank, i), t.detach().cpu().clone(), Role.STATEFUL,
                                      replicated=False))
        return {"kind": STATEFUL, "state": tree, "tensors": len(tensors)}


def table_state_pieces(name: str, value: Any, table: str, weight: Any) -> List[StatePiece]:
    """The pieces of one fused optimizer state tensor of ``table``, each tied to the table rows
    it holds (``StatePiece.row_origin``).

    torchrec builds a table's state shards in the order of its weight shards, and a state shard
    holds state for the rows of its weight shard: pointwise state has the weight's shape, row-wise
    state one value per row. The pairing is checked by row count. State that does not pair (a
    single value per shard, as some GPU optimizers keep) is refused: an increment stores the
    rows a lookup touched, and such state has no rows.
    """
    pieces = pieces_of(name, value, Role.TABLE_STATE, table)
    if not is_sharded(value):
        return pieces
    shards = weight.local_shards() if is_sharded(weight) else []
    paired = len(shards) == len(pieces) and all(
        p.region.sizes[0] == s.metadata.shard_sizes[0] for p, s in zip(pieces, shards))
    if not paired:
        raise ValueError(
            f"fused optimizer state {name!r} has shards of {[p.region.sizes for p in pieces]} that do not hold "
            f"the rows of the table's shards ({[tuple(s.metadata.shard_sizes) for s in shards]}); cnr checkpoints "
            "state kept per table row or per element, and cannot store this optimizer's state exactly")
    return [p if p.region.offsets[0] == s.metadata.shard_offsets[0] else replace(p, row_origin=s.metadata.shard_offsets[0])
            for p, s in zip(pieces, shards)]


def _sparse_safe(opt: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether ``opt`` leaves a row untouched when its gradient is zero (plain SGD, Adagrad
    without weight decay). Anything else (momentum, Adam's moments, weight decay, wrappers
    cnr cannot see into) may move rows that no lookup touched."""
    group = next(g for g in opt.param_groups if any(p is param for p in g["params"]))
    if type(opt) is torch.optim.SGD:
        return not group.get("momentum") and not group.get("weight_decay")
    if type(opt) is torch.optim.Adagrad:
        return not group.get("weight_decay")
    return False


def whole_tables(app: AppState) -> List[str]:
    """Tables whose rows may change without a lookup: stored whole in increments.

    A table trained by a dense optimizer (a data-parallel table, or a sharded one in torchrec's
    dense kernel, whose local shard is a parameter) is safe to track only when every optimizer
    holding its weight, in app_state or applied in backward, is sparse-safe; one not in
    app_state is unknown. A sharded table's fused kernel optimizer (applied in backward) updates
    looked-up rows only.
    """
    out = []
    optimizers = [o for k, o in app.objects.items() if app.kinds[k] == OPTIMIZER]
    for table in app.tables:
        param = dict(table.module.named_parameters()).get(table.local_key)
        holders = [o for o in optimizers if param is not None and any(p is param for g in o.param_groups for p in g["params"])]
        in_backward = list(getattr(param, "_in_backward_optimizers", []) or [])
        if hasattr(table.module.state_dict()[table.local_key], "local_shards"):
            if param is None or (in_backward and not holders):
                continue  # the fused kernel's optimizer alone
        else:
            holders += in_backward
        if not holders or not all(_sparse_safe(o, param) for o in holders):
            out.append(table.id)
    return out


def collect_state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> List[StatePiece]:
    """Every piece of the training state of ``{"model": model, "optim": optimizer}`` (the keys
    cnr train uses) that this rank holds, in canonical name order."""
    return AppState({"model": model, "optim": optimizer} if optimizer is not None else {"model": model}).pieces()
