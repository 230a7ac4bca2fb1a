"""Optimizer param groups as cnr stores them: a group's values (lr, betas, ...) as JSON and back,
which groups a checkpoint stores by position (a dense optimizer's) and which by table (a sharded
module's fused optimizer makes one group per table a rank holds, so another world size or plan
has other groups), and the optimizer class owning each group inside a torchrec CombinedOptimizer.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

from cnr.track.fused_kernel import leaf_optimizers
from cnr.track.json_tree import decode_tree, encode_tree, is_sharded


def group_values_json(group: Dict[str, Any], path: str) -> Any:
    """A param group's values (lr, betas, ...; not its parameters) as JSON. A 0-d tensor (torch
    takes ``lr=torch.tensor(0.01)``) stands as ``{"__scalar__": [value, dtype]}``, exact (a
    Python float holds any float32 or float64); TypeError names any other tensor."""
    found: List[torch.Tensor] = []
    tree = encode_tree({k: v for k, v in group.items() if k != "params"}, path, found)
    for t in found:
        if t.dim() != 0:
            raise TypeError(f"{path} holds a tensor of shape {tuple(t.shape)}; cnr stores a param group's values "
                            "as numbers, strings, lists and 0-d tensors")

    def scalar(node: Dict[str, Any]) -> Any:
        t = found[node["__tensor__"]]
        return {"__scalar__": [t.item(), str(t.dtype).replace("torch.", "")]}

    return _replace_tagged(tree, "__tensor__", scalar)


def _replace_tagged(node: Any, tag: str, replace: Callable[[Dict[str, Any]], Any]) -> Any:
    """``node`` (JSON) with every dict whose only key is ``tag`` replaced by ``replace(it)``."""
    if isinstance(node, list):
        return [_replace_tagged(v, tag, replace) for v in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {tag}:
        return replace(node)
    return {k: _replace_tagged(v, tag, replace) for k, v in node.items()}


def group_values(tree: Any) -> Any:
    """The inverse of ``group_values_json``: JSON back to values, 0-d tensors made on the CPU."""
    def tensor(node: Dict[str, Any]) -> torch.Tensor:
        value, dtype = node["__scalar__"]
        return torch.tensor(value, dtype=getattr(torch, dtype))

    return decode_tree(_replace_tagged(tree, "__scalar__", tensor), [])


def dense_groups(opt: Any) -> List[Dict[str, Any]]:
    """The param groups of ``opt`` holding a parameter not owned by a fused table (all of a plain
    torch optimizer's). The groups of a fused table optimizer inside a torchrec CombinedOptimizer
    are the sharded module's (one per table a rank holds): they are stored and restored by table
    with the module (``fused_table_groups``), never by their position here, which changes with
    the plan and world size."""
    return [g for g in opt.param_groups if not g["params"] or not all(is_sharded(p) for p in g["params"])]


def group_classes(opt: Any, groups: List[Dict[str, Any]]) -> List[str]:
    """The class (``module.QualName``) of the optimizer under ``opt`` (``leaf_optimizers``) that
    owns each of ``groups``: inside a torchrec CombinedOptimizer each group is trained by one part,
    and two parts swapped between groups would hand one's state to the other."""
    owner = {id(g): f"{type(o).__module__}.{type(o).__qualname__}" for o in leaf_optimizers(opt) for g in o.param_groups}
    return [owner.get(id(g), f"{type(opt).__module__}.{type(opt).__qualname__}") for g in groups]


def fused_group_tables(key: str, path: str, fused: Any) -> List[List[str]]:
    """The table ids each param group of a sharded module's fused optimizer trains."""
    names = {id(p): k for k, p in fused.params.items()}
    out = []
    for i, group in enumerate(fused.param_groups):
        unknown = [j for j, p in enumerate(group["params"]) if id(p) not in names]
        if unknown:
            raise ValueError(f"param group {i} of the fused optimizer of {path or key!r} holds parameters {unknown} "
                             "that the optimizer does not name; cnr cannot tell which tables its lr belongs to")
        out.append([f"{key}/{path}.{names[id(p)]}" if path else f"{key}/{names[id(p)]}" for p in group["params"]])
    return out


def fused_table_groups(key: str, path: str, fused: Any) -> Dict[str, Any]:
    """Table id -> the values of its fused param group (lr, eps, ...; JSON), for every table the
    fused optimizer of ``path`` trains on this rank. Keyed by table, not group: torchrec makes a
    group per table a rank holds, so another world size or plan has other groups."""
    out: Dict[str, Any] = {}
    for group, tables in zip(fused.param_groups, fused_group_tables(key, path, fused)):
        values = group_values_json(group, f"the fused optimizer of app_state[{key!r}].{path}.param_groups")
        out.update({table: values for table in tables})
    return out
