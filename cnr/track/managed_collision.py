"""torchrec's managed-collision modules (MC-EC, MC-EBC with MCH) as cnr sees them.

A sharded ``ManagedCollisionEmbeddingCollection`` / ``...BagCollection`` (torchrec 1.8,
``BaseShardedManagedCollisionEmbeddingCollection``) holds two children:
- ``_embedding_module``: an ordinary sharded EC/EBC (row-wise only) with the tables and their
  fused optimizer; its state_dict keys are ``<path>._embedding_module.embeddings|embedding_bags.
  <table>.weight``, so cnr finds the tables there (cnr.track.app_state.sharded_modules);
- ``_managed_collision_collection``: one ``MCHManagedCollisionModule`` per table, whose remapping
  buffers (``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``, eviction metadata such as
  ``_mch_counts``) are row-wise ShardedTensors of the module's state_dict, one shard per rank of
  ``zch_size / world_size`` slots, plus replicated ``_current_iter_tensor`` and
  ``_output_segments_tensor``. cnr stores them as Role.DENSE: whole in every checkpoint, full or
  incremental (an eviction re-sorts the whole shard, and every hit moves its counters, so the
  rows changed since a checkpoint are most of them anyway; 8 bytes per slot and buffer).

Three things the state_dict does not cover, handled here:
- **Lookups**: the wrapper calls the inner module's ``compute`` directly, which does not call
  torchrec's post-lookup hook (only ``compute_and_output_dist`` does), so cnr's tracker would see
  nothing. ``patch_lookup`` makes the inner ``compute`` call the hook slot with the ids it looked
  up: the *remapped* ids, local to the shard, as for any table.
- **Evictions**: when MCH evicts, torchrec re-initializes the evicted slots' embedding rows (and
  row-wise optimizer state) without a lookup of them; the patched ``compute`` reports those slots
  (``ctx.evictions_per_table``) to the hook as well, so increments hold them.
- **Runtime state** outside the state_dict: the id history accumulated since the last eviction
  (``_history_accumulator`` and its metadata buffers), its fill offset, and the iteration of the
  last eviction. Without them a resumed job evicts at other steps with other ids.
  ``RuntimeState`` is a Stateful object for them, per rank; cnr.track.app_state adds it to the app
  state under ``<key>.managed_collision``.

Resharding is refused: which raw ids a rank's shard holds follows from the world size (ids are
routed by bucket), so the saved shards mean nothing at another world size or row split.
Other managed-collision modules (torchrec's hash ZCH, custom ones) are refused at construction.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from cnr.track.json_tree import decode_tree
from cnr.track.modules import embedding_modules, is_managed_collision
from cnr.errors import CheckpointError

logger = logging.getLogger(__name__)

RUNTIME_SUFFIX = ".managed_collision"
_PATCHED = "_cnr_tracks_lookups"


def mc_modules(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(path in state_dict keys, sharded MC module) for every sharded MC module in ``module``."""
    return [(path, m) for path, m in embedding_modules(module) if is_managed_collision(m)]


def tables(mc: torch.nn.Module) -> Dict[str, torch.nn.Module]:
    """Table name -> its managed-collision module (this rank's shard of it)."""
    return dict(mc._managed_collision_collection._managed_collision_modules.items())


def check_supported(key: str, module: torch.nn.Module) -> None:
    """ValueError naming every managed-collision module cnr cannot checkpoint exactly."""
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    for path, mc in mc_modules(module):
        for table, mcm in tables(mc).items():
            if type(mcm) is not MCHManagedCollisionModule:
                hash_zch = type(mcm).__name__ == "HashZchManagedCollisionModule"
                raise ValueError(
                    f"app_state[{key!r}]: the managed-collision module of table {table!r} in {path or 'the model'} "
                    f"is a {type(mcm).__module__}.{type(mcm).__qualname__}; cnr checkpoints only torchrec's "
                    "MCHManagedCollisionModule exactly (its runtime state outside the state_dict is known to cnr)"
                    + (". The hash ZCH module does not train on CPU in torchrec 1.8 (fbgemm's zero_collision_hash "
                       "is read-only there) and cnr has not been checked with it elsewhere" if hash_zch else ""))


# ---- lookups and evictions reach the hook slot -------------------------------------------------------

def patch_lookup(mc: torch.nn.Module) -> None:
    """Make the inner module's ``compute`` call its post-lookup hook slot (idempotent).

    Per lookup: the features (remapped, shard-local ids) of each sharding; then, when MCH evicted
    this step, one feature per table holding the evicted slots (their rows were re-initialized).
    """
    inner = mc._embedding_module
    if getattr(inner, _PATCHED, False):
        return
    original: Callable[..., List[torch.Tensor]] = inner.compute
    first_feature = {name: cfg.feature_names[0] for name, cfg in inner._table_name_to_config.items()}

    def compute(ctx: Any, dist_input: Any) -> List[torch.Tensor]:
        out = original(ctx, dist_input)
        hook = getattr(inner, "post_lookup_tracker_fn", None)
        if hook is not None:
            for features, embs in zip(dist_input, out):
                hook(features, embs, inner, None)
            evicted = _evicted_features(getattr(ctx, "evictions_per_table", None), first_feature)
            if evicted is not None:
                hook(evicted, torch.empty(0), inner, None)
        return out

    inner.compute = compute
    setattr(inner, _PATCHED, True)


def _evicted_features(evictions: Optional[Dict[str, Optional[torch.Tensor]]], first_feature: Dict[str, str]):
    """A KeyedJaggedTensor of one sample per table holding its evicted (shard-local) slots."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if not evictions:
        return None
    keys, values = [], []
    for table, slots in evictions.items():
        if slots is not None and slots.numel():
            keys.append(first_feature[table])
            values.append(slots.reshape(-1).to(torch.int64))
    if not keys:
        return None
    lengths = torch.tensor([v.numel() for v in values], dtype=torch.int64, device=values[0].device)
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=lengths)


# ---- runtime state outside the state_dict ------------------------------------------------------------

def _shard(mc: torch.nn.Module, table: str) -> List[int]:
    """[shard offset, shard slots, global slots] of this rank's part of ``table``'s remapping."""
    return [int(x) for x in mc._managed_collision_collection._mc_module_name_shard_metadata[table]]


def _mch_state(mcm: torch.nn.Module, shard: List[int]) -> Dict[str, Any]:
    size = int(mcm._input_history_buffer_size)
    return {
        "shard": shard,
        "current_iter": int(mcm._current_iter),
        "last_eviction_iter": int(mcm._last_eviction_iter),
        "history_size": size,
        "history_offset": int(mcm._current_history_buffer_offset),
        # whole buffers (fixed shapes); only [:history_offset] is ever read
        "history": mcm._history_accumulator.detach().clone() if size >= 0 else None,
        "history_metadata": {k: v.detach().clone() for k, v in mcm._history_metadata.items()} if size >= 0 else {},
        "evicted": bool(mcm._evicted),
        "evicted_slots": mcm._evicted_emb_indices.detach().clone() if mcm._evicted else None,
    }


def _load_mch(mcm: torch.nn.Module, state: Dict[str, Any], where: str, shard: List[int]) -> None:
    if list(state["shard"]) != shard:
        raise CheckpointError(f"{where}: its remapping shard was {state['shard']} (offset, slots, total) when "
                              f"saved and is {shard} now; managed-collision state cannot be resharded")
    size = int(state["history_size"])
    if size >= 0:
        mcm._input_history_buffer_size = size
        mcm._history_accumulator = state["history"].to(mcm.device).clone()
        for name, saved in state["history_metadata"].items():
            buffer = saved.to(mcm.device).clone()
            mcm.register_buffer("_history_" + name, buffer, persistent=False)
            mcm._history_metadata[name] = buffer
    mcm._current_iter = int(state["current_iter"])
    mcm._last_eviction_iter = int(state["last_eviction_iter"])
    mcm._current_history_buffer_offset = int(state["history_offset"])
    mcm._evicted = bool(state["evicted"])
    if mcm._evicted:
        mcm._evicted_emb_indices = state["evicted_slots"].to(mcm.device).clone()


class RuntimeState:
    """The Stateful object of one app_state module's MCH runtime state on this rank: for each MC
    module path and table, the id history since the last eviction, the iteration counters and
    the shard it belongs to (checked at load: a reshard is refused)."""

    def __init__(self, key: str, module: torch.nn.Module) -> None:
        self.key = key
        self.modules = mc_modules(module)

    def state_dict(self) -> Dict[str, Any]:
        return {path: {table: _mch_state(mcm, _shard(mc, table)) for table, mcm in tables(mc).items()}
                for path, mc in self.modules}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for path, mc in self.modules:
            saved = state.get(path)
            if saved is None:
                raise CheckpointError(f"the checkpoint holds no managed-collision state of app_state[{self.key!r}] "
                                      f"module {path!r}")
            for table, mcm in tables(mc).items():
                if table not in saved:
                    raise CheckpointError(f"the checkpoint holds no managed-collision state of table {table!r} in "
                                          f"app_state[{self.key!r}] module {path!r}")
                _load_mch(mcm, saved[table], f"table {table!r} of app_state[{self.key!r}] module {path!r}",
                          _shard(mc, table))


def adapt(key: str, module: torch.nn.Module) -> Optional[RuntimeState]:
    """Check ``module``'s MC modules, route their lookups to the hook slot, and return the
    Stateful object of their runtime state (None when there are none)."""
    check_supported(key, module)
    found = mc_modules(module)
    for path, mc in found:
        patch_lookup(mc)
        logger.debug("app_state[%r] %s: tracking the slots of lookups and evictions of its MCH tables %s",
                     key, path, sorted(tables(mc)))
    return RuntimeState(key, module) if found else None


def check_restore(manifest: Any, runtimes: Dict[str, "RuntimeState"], rank: int, world_size: int) -> None:
    """Refuse, before anything is written, a restore of managed-collision state onto another
    world size or another row split of a table's remapping (the saved shards would be wrong).
    ``runtimes``: app_state key -> the RuntimeState restored there."""
    for key, runtime in runtimes.items():
        if manifest.world_size != world_size:
            raise CheckpointError(
                f"checkpoint {manifest.id} was saved at world size {manifest.world_size} and holds managed-collision "
                f"state ({key}: the MCH remapping of raw ids to slots, sharded by rows); it cannot be restored at "
                f"world size {world_size}, because which raw ids a rank's slots hold follows from the world size. "
                f"Restore at world size {manifest.world_size}")
        # decoded: a dict whose keys are out of sorted order is stored tagged (cnr.track.json_tree)
        saved = decode_tree(((manifest.app_ranks[rank].get(key) or {}).get("state") or {}) if manifest.app_ranks else {})
        for path, mc in runtime.modules:
            for table in tables(mc):
                shard = (saved.get(path) or {}).get(table, {}).get("shard")
                if shard is not None and list(shard) != _shard(mc, table):
                    raise CheckpointError(
                        f"checkpoint {manifest.id}: the remapping of table {table!r} in app_state[{runtime.key!r}] "
                        f"module {path!r} had shard {list(shard)} (offset, slots, total) on rank {rank} when saved "
                        f"and has {_shard(mc, table)} now; managed-collision state cannot be resharded")
