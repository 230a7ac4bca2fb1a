"""What fbgemm's fused kernels hold apart from the param groups, saved per table and set back.

A fused table trains inside backward, in an fbgemm TBE (``SplitTableBatchedEmbeddingBagsCodegen``)
that keeps its own copy of the optimizer's values: the learning rate (an fp32 tensor, which
torchrec's ``EmbeddingFusedOptimizer`` copies from ``param_groups[0]["lr"]`` only in its
``step()`` and ``zero_grad()``; a step trains at the value the kernel held at its forward,
measured on CPU), ``optimizer_args`` (eps, betas, weight decay, momentum, gradient
clipping, ...: set when the kernel is built, never from a param group), the step counter ``iter``
(Adam's and LAMB's bias correction, the EMA and ensemble steps, counter-based and global weight
decay) and the EMA / ensemble modes. A restore that gives back only the param groups leaves the
kernel training with the values it was built with until the loop's next ``step()`` or
``zero_grad()``, and the ones no param group holds for ever.

So a module's JSON records, per table, its kernel's values (``kernel_values``), and a restore
sets them (``set_kernel``) and reads them back (``kernel_differences``): the restored kernel trains
exactly as the saved one would have, whatever the loop calls and in what order.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

# optimizer_args fields that decide which state buffers the kernel has and what they mean: they
# are never changed in a built kernel; a checkpoint saved under other ones is refused
STRUCTURAL = ("regularization_mode", "weight_decay_mode", "use_rowwise_bias_correction")
# optimizer_args fields that describe which rows the kernel holds, not how it trains them
NOT_RECORDED = ("total_hash_size",)
# the kernel attribute (a dict of floats) of the optimizers that read one
MODES = {"EMAINPLACE_ROWWISE_ADAGRAD": "_emainplace_mode", "ENSEMBLE_ROWWISE_ADAGRAD": "_ensemble_mode"}


def leaf_optimizers(opt: Any) -> List[Any]:
    """The optimizers doing the work under torchrec's wrappers (CombinedOptimizer's parts,
    KeyedOptimizerWrapper's and OptimizerWrapper's inner one), in order; ``opt`` itself if none."""
    parts = getattr(opt, "optimizers", None)
    if isinstance(parts, list):
        return [leaf for _name, part in parts for leaf in leaf_optimizers(part)]
    inner = getattr(opt, "_optimizer", None)
    return leaf_optimizers(inner) if isinstance(inner, torch.optim.Optimizer) else [opt]


def is_kernel(module: Any) -> bool:
    """Whether ``module`` is a training fbgemm TBE with an optimizer (not OptimType.NONE)."""
    kind = getattr(module, "optimizer", None)
    return (hasattr(module, "learning_rate_tensor") and hasattr(module, "optimizer_args")
            and kind is not None and str(getattr(kind, "name", kind)).upper() != "NONE")


def fused_kernels(key: str, path: str, fused: Any) -> List[Tuple[Any, List[str]]]:
    """(fbgemm kernel, the table ids it trains) for every kernel under the fused optimizer of
    the sharded module at ``path`` of app_state[key], in the optimizer's order. A kernel appears
    once however many torchrec optimizers share it."""
    names = {id(p): name for name, p in fused.params.items()}
    out: Dict[int, Tuple[Any, List[str]]] = {}
    for leaf in leaf_optimizers(fused):
        kernel = getattr(leaf, "_emb_module", None)
        if kernel is None:
            continue
        tables = out.setdefault(id(kernel), (kernel, []))[1]
        for group in leaf.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    continue
                table = f"{key}/{path}.{names[id(p)]}" if path else f"{key}/{names[id(p)]}"
                if table not in tables:
                    tables.append(table)
    return list(out.values())


def fused_table_optimizers(key: str, path: str, fused: Any) -> Dict[str, str]:
    """Table id -> the fused kernel's optimizer (fbgemm's OptimType, e.g. "exact_row_wise_adagrad")
    for every table the fused optimizer of ``path`` trains on this rank. Two kernels may keep
    state of one shape that means something else (row-wise Adagrad's sum, EMA row-wise Adagrad's
    average): a restore checks the kind, not just the shapes."""
    out: Dict[str, str] = {}
    for kernel, tables in fused_kernels(key, path, fused):
        kind = getattr(kernel, "optimizer", None)
        if kind is not None:
            out.update({table: str(kind) for table in tables})
    return out


def kernel_values(kernel: Any) -> Dict[str, Any]:
    """What ``kernel`` trains with apart from the param groups, as JSON scalars: ``lr`` (the fp32
    value it holds, as a Python float: exact), every ``optimizer_args`` field but
    ``NOT_RECORDED``, ``iter`` where fbgemm keeps it as state (a persistent buffer: the optimizers
    that read it), ``gwd_lower_bound``, and the EMA / ensemble modes as ``<mode>.<name>``."""
    out: Dict[str, Any] = {"lr": float(kernel.learning_rate_tensor.item())}
    out.update({k: v for k, v in kernel.optimizer_args._asdict().items() if k not in NOT_RECORDED})
    buffers = dict(kernel.named_buffers(recurse=False))
    if "iter" in buffers and "iter" not in kernel._non_persistent_buffers_set:
        out["iter"] = int(buffers["iter"].reshape(-1)[0].item())
    if getattr(kernel, "_used_rowwise_adagrad_with_global_weight_decay", False):
        out["gwd_lower_bound"] = float(kernel.gwd_lower_bound)
    mode = _mode(kernel)
    for name, value in (getattr(kernel, mode, None) or {}).items() if mode else ():
        out[f"{mode.lstrip('_')}.{name}"] = value
    return out


def _mode(kernel: Any) -> str:
    """The attribute holding the EMA / ensemble mode ``kernel``'s optimizer reads ("" if none)."""
    kind = getattr(kernel, "optimizer", None)
    return MODES.get(str(getattr(kind, "name", kind)).upper(), "")


def fused_table_kernels(key: str, path: str, fused: Any) -> Dict[str, Dict[str, Any]]:
    """Table id -> ``kernel_values`` of the kernel training it, for every table the fused
    optimizer of ``path`` trains on this rank."""
    out: Dict[str, Dict[str, Any]] = {}
    for kernel, tables in fused_kernels(key, path, fused):
        if is_kernel(kernel):
            values = kernel_values(kernel)
            out.update({table: values for table in tables})
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN (a value JSON gave back)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def differing(now: Dict[str, Any], expected: Dict[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """Field -> (value now, expected value) for each field of ``expected`` that ``now`` lacks or
    holds another value of."""
    return {k: (now.get(k), v) for k, v in expected.items() if k not in now or not _same(now[k], v)}


def structural_differences(kernel: Any, expected: Dict[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """The ``STRUCTURAL`` fields of ``expected`` that ``kernel`` holds other values of, and the
    ``optimizer_args`` fields it does not have (a checkpoint of another fbgemm version)."""
    now = kernel_values(kernel)
    return {k: d for k, d in differing(now, expected).items() if k in STRUCTURAL or k not in now and k != "lr"
            and not _optional(k)}


def _optional(field: str) -> bool:
    """Whether ``kernel_values`` records ``field`` only for the optimizers that read it."""
    return field in ("iter", "gwd_lower_bound") or any(field.startswith(m.lstrip("_") + ".") for m in MODES.values())


def relevant(kernel: Any, values: Dict[str, Any]) -> Dict[str, Any]:
    """``values`` without the optional fields ``kernel``'s optimizer does not read (saved from a
    kernel that recorded them, or by an older cnr that recorded them for every kernel)."""
    now = kernel_values(kernel)
    return {k: v for k, v in values.items() if k in now or not _optional(k)}


def set_kernel(kernel: Any, values: Dict[str, Any]) -> None:
    """Give ``kernel`` ``values`` (``kernel_values``' fields; those absent stay as they are).
    Structural fields are not set (``structural_differences`` refuses them first)."""
    if "lr" in values:
        kernel.set_learning_rate(float(values["lr"]))
    fields = kernel.optimizer_args._fields
    args = {k: v for k, v in values.items() if k in fields and k not in STRUCTURAL and k not in NOT_RECORDED}
    if args:
        kernel.optimizer_args = kernel.optimizer_args._replace(**args)
    if "iter" in values:
        # ``iter`` is the state; ``iter_cpu`` the copy forward counts with (it reloads from
        # ``iter`` only while 0, so a kernel that trained already would keep its own count)
        kernel.iter.fill_(int(values["iter"]))
        if isinstance(getattr(kernel, "iter_cpu", None), torch.Tensor):
            kernel.iter_cpu.fill_(int(values["iter"]))
    if "gwd_lower_bound" in values and hasattr(kernel, "gwd_lower_bound"):
        kernel.gwd_lower_bound = values["gwd_lower_bound"]
    mode = _mode(kernel)
    held = getattr(kernel, mode, None) if mode else None
    if isinstance(held, dict):
        prefix = mode.lstrip("_") + "."
        held.update({k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)})


def fp32(lr: Any) -> float:
    """``lr`` (a float or a 0-d tensor) as the kernel holds it: rounded to fp32."""
    return float(torch.tensor(float(lr), dtype=torch.float32).item())
