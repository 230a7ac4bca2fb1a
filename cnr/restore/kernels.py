"""A restore's last step for fused tables: give each fbgemm kernel the values the saved job's
kernel trained with (cnr.track.fused_kernel), then read them back.

Per table, not per kernel: a kernel trains the tables of one group of one sharding type on one
rank, so another plan or world size has other kernels; each takes the values saved for its
tables, whichever ranks saved them, and those must agree. Checkpoints saved before the kernels'
values were recorded give each kernel the lr of its restored param group (what torchrec's next
``step()`` or ``zero_grad()`` would give it) and leave the rest as built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from cnr.errors import CheckpointError
from cnr.format.documents import Manifest
from cnr.track.app_state import MODULE, AppState, sharded_modules
from cnr.track.fused_kernel import (differing, fp32, fused_kernels, is_kernel, kernel_values, leaf_optimizers,
                                    relevant, set_kernel, structural_differences)

logger = logging.getLogger(__name__)


@dataclass
class KernelPlan:
    """One kernel, the tables it trains, and the values to give it (None: a checkpoint that
    recorded none; the lr of ``group`` then)."""

    kernel: Any
    tables: List[str]
    values: Optional[Dict[str, Any]]
    group: Dict[str, Any]


def _saved(manifest: Manifest, key: str) -> Dict[str, List[Dict[str, Any]]]:
    """Table id -> the distinct kernel values every rank saved for it."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for ranks in manifest.app_ranks:
        for table, values in ((ranks.get(key) or {}).get("fused_table_kernels") or {}).items():
            if values not in out.setdefault(table, []):
                out[table].append(values)
    return out


def plan_kernels(manifest: Manifest, app: AppState) -> List[KernelPlan]:
    """Every fused kernel of app's modules with the values it takes, checked before anything is
    written: CheckpointError when the tables a kernel trains now were saved with different
    values (name the fields), when some of them have values saved and some not, or when the
    saved values differ in a field that decides the kernel's state (``STRUCTURAL``)."""
    plan: List[KernelPlan] = []
    for key, kind in app.kinds.items():
        if kind != MODULE:
            continue
        saved = _saved(manifest, key)
        for path, sharded in sharded_modules(app.objects[key]):
            fused = getattr(sharded, "fused_optimizer", None)
            if fused is None:
                continue
            leaves = {id(getattr(leaf, "_emb_module", None)): leaf for leaf in leaf_optimizers(fused)}
            for kernel, tables in fused_kernels(key, path, fused):
                if not is_kernel(kernel) or not tables:
                    continue
                group = leaves[id(kernel)].param_groups[0]
                plan.append(KernelPlan(kernel, tables, _values(manifest, saved, kernel, tables), group))
    return plan


def _values(manifest: Manifest, saved: Dict[str, List[Dict[str, Any]]], kernel: Any,
            tables: List[str]) -> Optional[Dict[str, Any]]:
    if not saved:
        return None  # saved before kernel values were recorded
    recorded = [t for t in tables if t in saved]
    missing = [t for t in tables if t not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {manifest.id} holds no fused kernel values (lr, eps, ...) of tables "
                              f"{missing}, which one fbgemm kernel trains now with tables {recorded}")
    values = [v for t in tables for v in saved[t]]
    for other in values[1:]:
        diff = differing(other, values[0])
        if diff:
            raise CheckpointError(
                f"tables {tables} are trained by one fbgemm kernel now, but checkpoint {manifest.id} saved them "
                f"from kernels holding different values ({_fields(diff, 'one held', 'another')}); one kernel "
                "holds one value of each: restore with the plan that saved them (the same sharding types, "
                "ranks and fused_params per table)")
    structural = structural_differences(kernel, values[0])
    if structural:
        raise CheckpointError(
            f"the fbgemm kernel of tables {tables} is built with {_fields(structural, 'now', 'saved')} in "
            f"checkpoint {manifest.id}: these decide what its optimizer state means (None: this fbgemm's kernel "
            "has no such argument). Build the kernel with the fused_params and fbgemm it was saved with")
    return relevant(kernel, values[0])


def _fields(diff: Dict[str, Any], now: str, expected: str) -> str:
    return "; ".join(f"{k}: {now} {a!r}, {expected} {b!r}" for k, (a, b) in sorted(diff.items()))


def apply_kernels(manifest: Manifest, plan: List[KernelPlan]) -> None:
    """Give every planned kernel its values, then read each back: CheckpointError naming the
    tables, the field, the kernel's value and the expected one when a kernel holds another value
    (training on would update rows with values the saved job never used)."""
    old = 0
    for item in plan:
        expected = item.values if item.values is not None else {"lr": fp32(item.group["lr"])}
        old += item.values is None
        before = kernel_values(item.kernel)
        set_kernel(item.kernel, expected)
        changed = {k: d for k, d in differing(before, expected).items() if k not in ("lr", "iter")}
        if changed:  # hyper-parameters the job was built with, not a schedule's: worth a line
            logger.warning("restore of checkpoint %s set the fbgemm kernel of tables %s to the values it was saved "
                           "with: %s", manifest.id, item.tables, _fields(changed, "built with", "saved"))
        wrong = differing(kernel_values(item.kernel), expected)
        if wrong:
            raise CheckpointError(
                f"the fbgemm kernel of tables {item.tables} does not hold the values restored from checkpoint "
                f"{manifest.id} after they were set ({_fields(wrong, 'kernel', 'expected')}); it would train "
                "those tables otherwise than the saved job")
    if old:
        logger.info("checkpoint %s recorded no fused kernel values: %d kernels took their param group's lr",
                    manifest.id, old)
