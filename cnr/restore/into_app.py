"""Restore a committed checkpoint chain into an application's state (cnr.track.app_state.AppState).

Collective. The order: check that the checkpoint fits the application (placements, per-rank
state at another world size, each optimizer's param groups and their optimizers' classes, each
table's fused kernel and the values it was saved with) before anything is written; create
optimizer state the optimizers make lazily (Adam's; taken back if the attempt fails before its
JSON state is applied, so a fallback to an older checkpoint sees the optimizer as it was); fill
every tensor from the chain (cnr.restore.pieces) and this rank's RNG state; last, give each
optimizer its ``param_groups``, each Stateful object its state, and each fused table's fbgemm
kernel the lr, optimizer arguments and step counter it held (cnr.restore.kernels), read back and
checked.

Per-rank state (Stateful objects, RNG) at another world size: a Stateful object's state is
restored when every rank had saved the same state (an LR scheduler, say), else the restore fails
naming the key (a data loader's position is per rank: drop it from app_state and restore with
``partial=True``, or restore at the saved world size). RNG state is restored only at the same
world size.

Keys: by default app_state and the checkpoint must hold the same keys, or the restore fails naming
the keys missing on each side before anything is written (``check_keys``): an app_state entry
without saved state would silently keep its fresh values, saved state without an entry would be
silently dropped. ``partial=True`` restores the keys both hold and reports the others
(``RestoredChain.fresh`` and ``unused``). A mismatch is a property of the application, not damage:
cnr.restore.newest raises it rather than passing over the checkpoint.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from cnr.track.app_state import OPTIMIZER, STATEFUL, AppState, TableRef
from cnr.names import TensorName, stateful_name
from cnr.codec.chunk_format import DTYPES
from cnr.errors import CheckpointError
from cnr.format.documents import Manifest
from cnr.track.managed_collision import check_restore as check_managed_collisions
from cnr.format.catalog import resolve_chain
from cnr.restore.app_json import apply_json, check_fused_optimizers, owner_state, plan_groups, plan_table_values
from cnr.restore.chain import restore_chain
from cnr.restore.kernels import apply_kernels, plan_kernels
from cnr.restore.pieces import check_no_extra_tensors, check_shapes, restore_rng
from cnr.track.state import StatePiece, whole_piece
from cnr.track import agreement
from cnr.storage.base import Storage
from cnr.types import Role, TableSpec

logger = logging.getLogger(__name__)


@dataclass
class RestoredChain:
    """What a restore applied: the manifest, its chain (full first), rows its increments held
    per table id, and bytes this rank read."""

    manifest: Manifest
    chain: List[Manifest]
    increment_row_ids: Dict[str, torch.Tensor]
    bytes_read: int
    fresh: List[str] = field(default_factory=list)  # app_state keys the checkpoint held no state of
    unused: List[str] = field(default_factory=list)  # saved keys with no app_state entry

    @property
    def partial(self) -> bool:
        """Whether app_state and the checkpoint held different keys (only under ``partial=True``)."""
        return bool(self.fresh or self.unused)


def _source_rank(manifest: Manifest, key: str, rank: int, world_size: int) -> int:
    """Whose saved state of app_state[key] this rank takes (see the module docstring)."""
    if manifest.world_size == world_size:
        return rank
    if manifest.loaded is None or len(manifest.loaded) == manifest.world_size:  # every rank's state is here
        states = [a.get(key) for a in manifest.app_ranks]
        tensors = [[manifest.tensors[stateful_name(key, r, i)].chunks for i in range((s or {}).get("tensors", 0))]
                   if s else [] for r, s in enumerate(states)]
        crcs = [[[c.crc32 for c in chunks] for chunks in per_rank] for per_rank in tensors]
        alike = all(s == states[0] for s in states) and all(c == crcs[0] for c in crcs)
    elif manifest.app_agree is not None:  # recorded at commit (format version 8); rank 0's index read
        alike = key in manifest.app_agree
    else:
        raise CheckpointError(f"checkpoint {manifest.id}: restoring app_state[{key!r}] at world size {world_size} "
                              "needs every rank's saved state or the record of which keys agree; neither was read")
    if not alike:
        raise CheckpointError(
            f"app_state[{key!r}] saved a different state on each of {manifest.world_size} ranks in checkpoint "
            f"{manifest.id}; it cannot be given to {world_size} ranks. Restore at world size {manifest.world_size}, "
            f"or leave {key!r} out of app_state and restore with partial=True")
    return 0


def check_placements(manifest: Manifest, app: AppState) -> None:
    """Fail before anything is written when a table moved between data-parallel and sharded
    placements and its optimizer state cannot follow (dense optimizer state on one side, fused
    table state on the other)."""
    saved = {t.name: t.placement for t in manifest.tables}
    now = {t.id: table_placement(t) for t in app.tables}
    for table, placement in now.items():
        before = saved.get(table, "")
        if not before or not placement or (before == "data_parallel") == (placement == "data_parallel"):
            continue
        states = [(TensorName.parse(name), e.role) for name, e in manifest.tensors.items()
                  if e.role in (Role.OPTIMIZER, Role.TABLE_STATE)]
        had_fused = any(role == Role.TABLE_STATE and n.state is not None and n.parent == table for n, role in states)
        param = table.replace("/", ".", 1)  # a dense optimizer's state of it (a dense-kernel shard's is table_state)
        had_dense = any(n.path == param for n, _role in states)
        if had_fused or had_dense:
            raise CheckpointError(
                f"table {table!r} was {before} in checkpoint {manifest.id} but is {placement} now, and its optimizer "
                f"state ({'fused table state' if had_fused else 'dense optimizer state'}) cannot move to the other "
                "placement's optimizer. Give the table the same placement as when it was saved, e.g. torchrec "
                f"ParameterConstraints(sharding_types=['{before}']) for it in the planner")


def table_spec(table: TableRef) -> TableSpec:
    """The TableSpec a manifest records of ``table``: its id, this rank's view of its size (rows,
    dim), its features and its placement ("data_parallel" when its module has no plan for it)."""
    value = table.module.state_dict()[table.local_key]
    rows, dim = tuple(value.size())[:2]
    features = tuple(table.module._table_name_to_config[table.name].feature_names)
    return TableSpec(table.id, int(rows), int(dim), features, table_placement(table) or "data_parallel")


def table_placement(table) -> str:
    """The sharding type its module's sharding plan gives ``table`` (a cnr.track.app_state table),
    e.g. "row_wise" or "data_parallel"; "" when the module has no plan for it."""
    plan = getattr(table.module, "module_sharding_plan", None) or {}
    sharding = plan.get(table.name)
    return str(getattr(sharding, "sharding_type", "") or "")


Created = List[Tuple[Any, torch.Tensor, str]]  # (a state mapping, a parameter, a state key made for it there)


def _prepare_optimizers(manifest: Manifest, app: AppState) -> Created:
    """Create optimizer state tensors the checkpoint has and the optimizer has not made yet; return
    what was made (``_forget``: an attempt that fails takes it back)."""
    created: Created = []
    for key, kind in app.kinds.items():
        if kind != OPTIMIZER:
            continue
        opt = app.objects[key]
        params = dict(app.optimizer_params(opt))
        for name, entry in manifest.tensors.items():
            if entry.role not in (Role.OPTIMIZER, Role.TABLE_STATE):
                continue
            parts = TensorName.parse(name)
            if parts.key != key:
                continue
            param_name, state_key = parts.path, parts.state
            if state_key is None:
                raise CheckpointError(f"checkpoint {manifest.id} holds optimizer state {name!r} without a state key")
            param = params.get(param_name)
            if param is None:
                raise CheckpointError(f"checkpoint {manifest.id} has state of app_state[{key!r}] for parameter "
                                      f"{param_name!r}, which that optimizer does not hold now")
            shape = tuple(entry.shape)
            if entry.role == Role.TABLE_STATE:  # a dense-kernel table's: this rank's shard of it (cnr.track.dense_kernel)
                tp = app.table_params.get(id(param))
                if tp is None:
                    raise CheckpointError(f"checkpoint {manifest.id} has state of app_state[{key!r}] for the sharded "
                                          f"table {entry.table!r}, whose parameter {param_name!r} is not a sharded "
                                          "table's local shard now")
                if tp.region is None:
                    continue  # no shard of the table here: no state
                shape = tuple(param.shape)
            owner = owner_state(opt, param)
            state = owner[param] if param in owner else owner.setdefault(param, {})
            if state_key not in state:
                state[state_key] = torch.zeros(shape, dtype=DTYPES[entry.dtype], device=param.device if shape else "cpu")
                created.append((owner, param, state_key))
    return created


def _forget(created: Created) -> None:
    """Take back the optimizer state ``_prepare_optimizers`` made for an attempt that failed (and
    a parameter's state left empty): a fallback to an older checkpoint saved before the optimizer
    had state must find none."""
    for owner, param, state_key in created:
        state = owner.get(param)
        if state is not None:
            state.pop(state_key, None)
            if not state:
                del owner[param]


def _stateful_targets(manifest: Manifest, app: AppState, rank: int, world_size: int) -> Dict[str, Tuple[int, List[StatePiece]]]:
    """key -> (source rank, fresh tensors to restore its saved tensors into)."""
    out = {}
    for key, kind in app.kinds.items():
        if kind != STATEFUL:
            continue
        if not manifest.app_ranks or key not in manifest.app_ranks[0]:
            raise CheckpointError(f"checkpoint {manifest.id} holds no state of app_state[{key!r}] (it holds "
                                  f"{sorted(manifest.app_ranks[0]) if manifest.app_ranks else []})")
        src = _source_rank(manifest, key, rank, world_size)
        pieces = []
        for i in range(manifest.app_ranks[src][key].get("tensors", 0)):
            name = stateful_name(key, src, i)
            entry = manifest.tensors[name]
            pieces.append(whole_piece(name, torch.empty(tuple(entry.shape), dtype=DTYPES[entry.dtype]), Role.STATEFUL,
                                      replicated=False))
        out[key] = (src, pieces)
    return out


def _saved_keys(manifest: Manifest) -> Dict[str, str]:
    """app_state key -> kind ("" when not recorded) of everything ``manifest`` holds state of."""
    saved = {k: str(v.get("kind", "")) if isinstance(v, dict) else "" for k, v in
             (manifest.app_ranks[0] if manifest.app_ranks else {}).items()}
    for name, entry in manifest.tensors.items():
        if entry.role != Role.RNG:
            saved.setdefault(TensorName.parse(name).key, "")
    return saved


def check_keys(manifest: Manifest, app: AppState, partial: bool = False) -> Tuple[List[str], List[str]]:
    """(app_state keys the checkpoint holds no state of, saved keys app_state has no entry for).

    Raises CheckpointError when a key changed kind, or (unless ``partial``) when any key is
    missing on either side: a restore must not silently keep fresh values or drop saved state.
    A manifest that recorded only its Stateful keys' JSON (``all_keys_recorded`` False: version 1,
    cnr train's) has only those keys and its tensors matched."""
    saved = _saved_keys(manifest)
    changed = [f"app_state[{k!r}] is a {app.kinds[k]} now but was saved as a {saved[k]}"
               for k in app.kinds if saved.get(k) and saved[k] != app.kinds[k]]
    if changed:
        raise CheckpointError(f"checkpoint {manifest.id} does not fit app_state: " + "; ".join(changed))
    fresh = sorted(k for k in app.kinds if k not in saved and (manifest.all_keys_recorded or app.kinds[k] == STATEFUL))
    unused = sorted(k for k in saved if k not in app.kinds)
    if (fresh or unused) and not partial:
        raise CheckpointError(
            f"checkpoint {manifest.id} (step {manifest.step}) and app_state hold different keys: "
            f"app_state keys with no saved state: {fresh}; saved keys with no app_state entry: {unused} "
            f"(the checkpoint holds {sorted(saved)}, app_state {sorted(app.kinds)}). Give app_state the keys "
            "it was saved with, or call restore(partial=True) to restore the keys both hold and leave the "
            "others at their fresh values")
    return fresh, unused


def _only(app: AppState, keys: List[str]) -> AppState:
    """``app`` restricted to ``keys``; optimizer parameters keep the names every module gives them."""
    sub = copy.copy(app)
    sub.objects = {k: v for k, v in app.objects.items() if k in keys}
    sub.kinds = {k: app.kinds[k] for k in sub.objects}
    sub.tables = [t for t in app.tables if t.id.split("/", 1)[0] in sub.objects]
    return sub


def restore_app(storage: Storage, manifest: Manifest, app: AppState, rank: int, world_size: int,
                threads: int = 1, chain: Optional[List[Manifest]] = None, partial: bool = False) -> RestoredChain:
    """Restore ``manifest`` (and the chain it needs: ``chain`` when the caller resolved it
    already) into ``app`` on this rank (collective). ``partial``: see ``check_keys``. Its one
    collective, the agreement step "restore: checkpoint <id> fits the application", runs every
    check a rank can fail alone before it (a refusal raises the same RankAgreementError on
    every rank); what follows raises on this rank only, for the caller to agree on."""
    mine: Dict[str, Any] = {"created": []}

    def fits() -> List[str]:
        """This rank's checks; the names of the tensors it holds."""
        fresh, unused = check_keys(manifest, app, partial)
        sub = _only(app, [k for k in app.kinds if k not in fresh]) if fresh else app
        mine.update(fresh=fresh, unused=unused, app=sub,
                    chain=chain if chain is not None else resolve_chain(storage, manifest))
        check_placements(manifest, sub)
        check_managed_collisions(manifest, {k: sub.objects[k] for k in sub.runtime_keys if k in sub.kinds},
                                 rank, world_size)
        mine["targets"] = _stateful_targets(manifest, sub, rank, world_size)
        mine["created"] = _prepare_optimizers(manifest, sub)
        mine["pieces"] = [p for p in sub.pieces() if p.role != Role.STATEFUL]
        return sorted({p.name for p in mine["pieces"]})

    try:
        everyone = agreement.all_gather(f"restore: checkpoint {manifest.id} fits the application", fits)
        fresh, unused, app, chain = mine["fresh"], mine["unused"], mine["app"], mine["chain"]
        targets, pieces = mine["targets"], mine["pieces"]
        dropped = [n for n in manifest.tensors if TensorName.parse(n).key in unused]  # saved state no entry takes
        check_no_extra_tensors(manifest, sorted({n for names in everyone for n in names}) + dropped)
        check_shapes(manifest, pieces)
        groups = plan_groups(manifest, app, rank, world_size)
        table_values = plan_table_values(manifest, app)
        check_fused_optimizers(manifest, app)
        kernels = plan_kernels(manifest, app)
        pieces += [p for _src, stateful in targets.values() for p in stateful]
        nbytes, row_ids = restore_chain(storage, chain, pieces, threads)
        restore_rng(storage, manifest, rank, world_size)
    except BaseException:
        _forget(mine["created"])  # the next attempt (an older checkpoint) must see the optimizer as it was
        raise
    apply_json(manifest, app, targets, groups, table_values, rank, world_size)
    apply_kernels(manifest, kernels)  # after the groups: a checkpoint without kernel values gives their lr
    logger.info("read checkpoint %s into the application (step %d, chain of %d, %d bytes read by rank %d)",
                manifest.id, manifest.step, len(chain), nbytes, rank)
    if (fresh or unused) and rank == 0:
        logger.warning("partial restore of checkpoint %s: app_state keys left at their fresh values (no saved "
                       "state): %s; saved keys not restored (no app_state entry): %s", manifest.id, fresh, unused)
    return RestoredChain(manifest, chain, row_ids, nbytes, fresh, unused)

