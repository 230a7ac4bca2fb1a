"""The JSON half of restoring an application's state: each optimizer's param groups and
per-parameter values (Adam's step), each fused table optimizer's param groups, and Stateful
objects' state. Planned and checked before anything is written (``plan_groups``,
``plan_table_values``, ``check_fused_optimizers``), applied after every tensor is in place
(``apply_json``). cnr.restore.into_app runs the whole restore in that order.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from cnr.errors import CheckpointError
from cnr.format.documents import Manifest
from cnr.track.app_state import MODULE, OPTIMIZER, STATEFUL, AppState, sharded_modules
from cnr.track.fused_kernel import fused_table_optimizers
from cnr.track.json_tree import decode_tree
from cnr.track.optimizer_groups import dense_groups, fused_group_tables, group_classes, group_values
from cnr.track.dense_kernel import saved_values
from cnr.track.state import StatePiece

def owner_state(opt: Any, param: torch.Tensor) -> Any:
    """The state mapping (param -> its state dict) of the optimizer under ``opt`` that trains
    ``param``: a torchrec CombinedOptimizer builds its ``state`` anew at every access, so its part
    holding ``param`` is asked."""
    parts = getattr(opt, "optimizers", None)
    if isinstance(parts, list):
        for _name, part in parts:
            if any(p is param for g in part.param_groups for p in g["params"]):
                return owner_state(part, param)
        raise CheckpointError(f"no part of {type(opt).__name__} holds the parameter cnr restores state into")
    return opt.state


def _param_state(opt: Any, param: torch.Tensor) -> Dict[str, Any]:
    """The optimizer's own state dict of ``param``, made if it has none yet."""
    state = owner_state(opt, param)
    if param not in state:
        state[param] = {}
    return state[param]


def _assign(group: Dict[str, Any], values: Dict[str, Any]) -> None:
    """Give ``group`` the saved ``values`` (not its parameters); a 0-d tensor value it holds now is
    written in place, keeping its device and whoever holds it."""
    for k, v in values.items():
        if k == "params":
            continue
        now = group.get(k)
        if isinstance(now, torch.Tensor) and isinstance(v, torch.Tensor) and now.dim() == 0:
            now.copy_(v)
        else:
            group[k] = v


def _set_groups(groups: List[Dict[str, Any]], saved: List[Any], where: str) -> None:
    """By position: manifests before ``group_params``, and the fused optimizers' groups of
    checkpoints before ``fused_table_groups``."""
    _check_count(saved, groups, where)
    for group, values in zip(groups, saved):
        _assign(group, group_values(values))


GroupPlan = Dict[str, List[Tuple[Dict[str, Any], Any]]]  # optimizer key -> (its group, the saved values)


def _saved_json(manifest: Manifest, key: str, rank: int, world_size: int) -> Optional[Dict[str, Any]]:
    """What ``manifest`` saved of app_state[key] for this rank (rank 0's at another world size)."""
    if not manifest.app_ranks:
        return None
    return manifest.app_ranks[rank if manifest.world_size == world_size else 0].get(key)


def plan_groups(manifest: Manifest, app: AppState, rank: int, world_size: int) -> GroupPlan:
    """Each optimizer's dense param groups with their saved values, checked before anything is
    written: group i must hold the parameters saved group i held (``group_params``) and be
    trained by an optimizer of the class that trained it (``group_classes``). Group by group, in
    order: an LR scheduler's state (a Stateful) follows group positions, so groups listed in
    another order would take the right lr now and the wrong one at the scheduler's next step.
    CheckpointError names what differs."""
    plan: GroupPlan = {}
    for key, kind in app.kinds.items():
        saved = _saved_json(manifest, key, rank, world_size) if kind == OPTIMIZER else None
        if saved is None:
            continue  # version 1 stored no param_groups
        opt, where = app.objects[key], f"app_state[{key!r}]"
        if "group_params" not in saved:  # saved before group_params: by position
            _check_count(saved["param_groups"], opt.param_groups, where)
            plan[key] = list(zip(opt.param_groups, saved["param_groups"]))
            continue
        groups = dense_groups(opt)
        now = [sorted(app.group_param_names(opt, g)) for g in groups]
        was = [sorted(names) for names in saved["group_params"]]
        if now != was:
            raise CheckpointError(
                f"{where} holds other parameters in its param groups than checkpoint {manifest.id} saved (group by "
                f"group, saved: {was}; now: {now}): the groups' lr and other values, and an LR scheduler's state, "
                "which follows group positions, would go to other parameters. Build the optimizer's groups as "
                "they were, in the same order")
        classes = group_classes(opt, groups)
        if saved.get("group_classes", classes) != classes:
            raise CheckpointError(f"{where}'s param groups are trained by {classes} now but checkpoint {manifest.id} "
                                  f"saved them from {saved['group_classes']}: another optimizer's state does not "
                                  "mean the same")
        plan[key] = list(zip(groups, saved["param_groups"]))
    return plan


ValuePlan = Dict[str, List[Tuple[torch.Tensor, Any]]]  # optimizer key -> (a table parameter, its saved values)


def plan_table_values(manifest: Manifest, app: AppState) -> ValuePlan:
    """The per-parameter optimizer values (Adam's step) of each dense-kernel table shard this
    rank holds, from the saved shards overlapping its rows, whichever ranks saved them
    (cnr.track.dense_kernel.saved_values), checked before anything is written."""
    plan: ValuePlan = {}
    for key, kind in app.kinds.items():
        if kind != OPTIMIZER:
            continue
        saved: Dict[str, List[Dict[str, Any]]] = {}
        for ranks in manifest.app_ranks:
            for name, shard in ((ranks.get(key) or {}).get("table_values") or {}).items():
                saved.setdefault(name, []).append(shard)
        for name, param in app.optimizer_params(app.objects[key]):
            tp = app.table_params.get(id(param))
            if tp is None or name not in saved:
                continue
            try:
                values = saved_values(saved[name], tp, name, f"checkpoint {manifest.id}, app_state[{key!r}]")
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            if values is not None:
                plan.setdefault(key, []).append((param, group_values(values)))
    return plan



def check_fused_optimizers(manifest: Manifest, app: AppState) -> None:
    """CheckpointError when a table this rank holds is trained by another fused kernel optimizer
    than the one that saved its state (``fused_table_optimizers``; checkpoints before it recorded
    none: not checked)."""
    saved: Dict[str, str] = {}
    for ranks in manifest.app_ranks:
        for key in app.kinds:
            saved.update(((ranks.get(key) or {}).get("fused_table_optimizers") or {}))
    if not saved:
        return
    for key, kind in app.kinds.items():
        if kind != MODULE:
            continue
        for path, sharded in sharded_modules(app.objects[key]):
            fused = getattr(sharded, "fused_optimizer", None)
            now = fused_table_optimizers(key, path, fused) if fused is not None else {}
            changed = {t: (saved[t], k) for t, k in now.items() if t in saved and saved[t] != k}
            if changed:
                raise CheckpointError(
                    f"the fused optimizer of tables {sorted(changed)} is "
                    f"{sorted({k for _s, k in changed.values()})} now but checkpoint {manifest.id} saved their state "
                    f"under {sorted({s for s, _k in changed.values()})}: that state does not mean the same there")


def _check_count(saved: List[Any], groups: List[Dict[str, Any]], where: str) -> None:
    if len(saved) != len(groups):
        raise CheckpointError(f"{where} had {len(saved)} param_groups when saved, {len(groups)} now")


def apply_json(manifest: Manifest, app: AppState, targets: Dict[str, Tuple[int, List[StatePiece]]],
                groups: GroupPlan, table_values: ValuePlan, rank: int, world_size: int) -> None:
    for key, kind in app.kinds.items():
        obj = app.objects[key]
        if kind == STATEFUL:
            src, pieces = targets[key]
            obj.load_state_dict(decode_tree(manifest.app_ranks[src][key]["state"], [p.tensor for p in pieces]))
            continue
        saved = _saved_json(manifest, key, rank, world_size)
        if saved is None:
            continue  # version 1 stored no param_groups
        if kind == OPTIMIZER:
            for group, values in groups[key]:
                _assign(group, group_values(values))
            params = dict(app.optimizer_params(obj))
            for name, states in saved.get("state", {}).items():
                if name in params:
                    _param_state(obj, params[name]).update({k: decode_tree(v, []) for k, v in states.items()})
            for param, values in table_values.get(key, []):
                _assign(_param_state(obj, param), values)  # a 0-d step it holds now is written in place
        elif kind == MODULE:
            by_table = _saved_table_groups(manifest, key)
            for path, sharded in sharded_modules(obj):
                if getattr(sharded, "fused_optimizer", None) is None:
                    continue
                if by_table:
                    _set_table_groups(manifest, key, path, sharded.fused_optimizer, by_table)
                    continue
                # not ``groups``: that is the optimizers' plan, which a later optimizer key still needs
                fused_groups = _fused_groups(manifest, key, path, rank, world_size,
                                             len(sharded.fused_optimizer.param_groups))
                if fused_groups is not None:
                    _set_groups(sharded.fused_optimizer.param_groups, fused_groups, f"the fused optimizer of {path!r}")


def _saved_table_groups(manifest: Manifest, key: str) -> Dict[str, List[Any]]:
    """Table id -> the distinct fused param group values every rank saved for it."""
    out: Dict[str, List[Any]] = {}
    for saved in manifest.app_ranks:
        for table, values in (saved.get(key) or {}).get("fused_table_groups", {}).items():
            if values not in out.setdefault(table, []):
                out[table].append(values)
    return out


def _set_table_groups(manifest: Manifest, key: str, path: str, fused: Any, saved: Dict[str, List[Any]]) -> None:
    """Give each param group of ``fused`` the values saved for its tables, whichever ranks held
    them: a group (one per table a rank holds now) takes its tables' values, which must agree."""
    for group, tables in zip(fused.param_groups, fused_group_tables(key, path, fused)):
        missing = [t for t in tables if t not in saved]
        if missing:
            raise CheckpointError(f"checkpoint {manifest.id} holds no fused optimizer values (lr, ...) of tables "
                                  f"{missing}")
        values = [v for t in tables for v in saved[t]]
        if any(v != values[0] for v in values):
            raise CheckpointError(
                f"tables {tables} share one fused optimizer param group now, but checkpoint {manifest.id} holds "
                f"different values for them ({[decode_tree(v, []) for v in values]}); give them separate groups "
                "(the plan that saved them) to restore each one's values")
        _assign(group, group_values(values[0]))


def _fused_groups(manifest: Manifest, key: str, path: str, rank: int, world_size: int, count: int):
    """Checkpoints before fused_table_groups: the saved param_groups of a sharded module's fused
    optimizer for this rank; at another world size the first rank that saved as many groups as
    this one has now (or None: the lrs stay as they are)."""
    saved = [a.get(key, {}).get("fused_param_groups", {}).get(path) for a in manifest.app_ranks]
    if manifest.world_size == world_size:
        return saved[rank]
    return next((g for g in saved if g is not None and len(g) == count), None)
