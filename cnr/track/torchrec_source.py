"""torchrec's ModelDeltaTracker as the source of the rows each step touched (``CheckpointOptions(tracker="torchrec")``).

cnr's RowTracker keeps everything downstream (views, capture, release, seed, mark, the data-parallel
OR-reduce); only ``current`` is filled another way. torchrec's delta tracker, in ID_ONLY mode, sits
in each sharded module's post-lookup hook slot and records the ids each shard received, the same
shard-local ids cnr's own hook would get from the same slot. At each ``RowTracker.fold`` cnr reads the
ids its consumer has not read yet (``get_unique_ids(consumer="cnr")``, keyed by table FQN) and sets
the bits ``bit_start + id`` of the table that FQN names. Other consumers keep their own windows.

The delta tracker lives in torchrec's DistributedModelParallel: cnr takes the one
``get_delta_tracker()`` returns, or builds one with ``init_torchrec_delta_tracker`` (ID_ONLY,
consumer "cnr") and takes it out again at ``close``. Refused when the Checkpointer is built
(ConfigError naming the module or table and why): a torchrec without ``model_tracker``; tables
in a module that is not a DistributedModelParallel; an existing tracker not in ID_ONLY mode or
without the consumer "cnr"; a hook slot another hook holds; tables or features the tracker cannot
tell apart (it keys rows by table FQN and features by name across the whole model), or skips; a
model without dense parameters (torchrec 1.8's tracker reads the DDP wrapper DMP puts around them).
Covered row for row (tests/test_torchrec_source.py): EBC, weighted EBC, EC, every sharding type
torchrec runs on CPU, data-parallel tables, MC-EC/MC-EBC (their lookups and evictions reach the
slot through cnr.track.managed_collision's patch), TrainPipelineSparseDist, FP-EBC.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from cnr.errors import ConfigError
from cnr.track import agreement
from cnr.track.app_state import AppState, TableRef, tables_of, whole_tables
from cnr.track.bits import set_bits
from cnr.track.hook_slot import SLOT, TrackerHookError, describe, occupant
from cnr.track.tracker import RowTracker, TrackedTable
from cnr.types import TrackerSource

logger = logging.getLogger(__name__)

CONSUMER = "cnr"  # cnr's consumer of the delta tracker: its reads leave other consumers' ids in place
TESTED_TORCHREC = "1.8.0"  # the torchrec tracker='torchrec' is proven on (tests/test_torchrec_source.py)
_FIX = ("dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, "
        "consumers=[..., 'cnr']))")


def check_torchrec_tracker() -> None:
    """ConfigError naming the installed torchrec where it lacks the delta tracker cnr reads
    (``torchrec.distributed.model_tracker`` and ``DistributedModelParallel.init_torchrec_delta_tracker``)."""
    try:
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.model_tracker import types

        missing = next((f"{owner.__name__}.{name}" for owner, name in (
            (DistributedModelParallel, "init_torchrec_delta_tracker"), (types, "DeltaTrackerConfig"))
            if not hasattr(owner, name)), None)
    except ImportError as e:
        missing = str(e)
    if missing is not None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("torchrec")
        except PackageNotFoundError:
            installed = "none"
        raise ConfigError(f"tracker='torchrec' needs torchrec >= {TESTED_TORCHREC} with ModelDeltaTracker "
                          f"(torchrec.distributed.model_tracker, DistributedModelParallel.init_torchrec_delta_tracker);"
                          f" installed: {installed} (missing: {missing}). Use tracker='cnr'")


class TorchrecSource:
    """The rows one DistributedModelParallel's delta tracker recorded, as a RowSource of cnr's RowTracker.

    ``tables``: the tracker's table FQN -> cnr's TrackedTable on this rank; ``modules``: the
    sharded modules whose slots must keep holding the tracker's hook; ``created``: cnr built the
    tracker, so ``close`` takes it out of the DMP again.
    """

    def __init__(self, key: str, dmp: torch.nn.Module, delta: Any, tables: Dict[str, TrackedTable],
                 modules: Dict[str, torch.nn.Module], created: bool) -> None:
        self.key, self.dmp, self.delta = key, dmp, delta
        self.tables, self.modules, self.created = tables, modules, created
        self._lost: Optional[str] = None  # sticky: rows were missed once another hook took a slot

    def check_slots(self) -> None:
        """Raise TrackerHookError when a module's slot no longer holds the delta tracker's hook
        (sticky: the rows looked up since were recorded by nobody)."""
        if self._lost is None:
            for name, module in self.modules.items():
                fn = occupant(module)
                if fn != self.delta.record_lookup:
                    now = "emptied" if fn is None else "taken by " + describe(fn)
                    self._lost = (f"the post-lookup hook slot of the sharded module {self.key}/{name} no longer holds "
                                  f"torchrec's delta tracker, which tracker='torchrec' reads ({now}): the rows looked "
                                  "up since were not tracked and a checkpoint built on them would miss rows")
                    break
        if self._lost is not None:
            raise TrackerHookError(self._lost)

    def collect(self, current: np.ndarray) -> None:
        """Set the bits of every id consumer "cnr" has not read yet (shard-local ids + the table's bit_start)."""
        self.check_slots()
        # torchrec 1.8's read concatenates each table's lookups inside the window and fails on a
        # table with none there (looked up before, not since): an empty one keeps every table's list non-empty
        store = self.delta.store
        for fqn in list(store.per_fqn_lookups):
            store.append(batch_idx=self.delta.curr_batch_idx, fqn=fqn, ids=torch.empty(0, dtype=torch.int64))
        unique = self.delta.get_unique_ids(consumer=CONSUMER)
        # lookups after this read land in the next window even where nothing calls DMP.forward
        # (which advances the batch index): a lookup recorded at the index just read would be lost
        self.delta.step()
        for fqn, ids in unique.items():
            if not ids.numel():
                continue
            table = self.tables.get(fqn)
            local = ids.to(torch.int64).cpu().numpy()
            low, high = int(local.min()), int(local.max())
            if table is None or low < 0 or high >= table.rows:
                where = "a table cnr does not hold on this rank" if table is None else f"{table.rows} local rows"
                raise RuntimeError(f"torchrec's delta tracker reported ids {low}..{high} of {fqn!r}, {where}")
            set_bits(current, local + table.bit_start)

    @property
    def store_nbytes(self) -> int:
        """Bytes of the tensors the delta tracker's store holds now (ids, and states in other modes)."""
        lookups = [lookup for per in self.delta.store.per_fqn_lookups.values() for lookup in per]
        return sum(t.numel() * t.element_size() for lookup in lookups for t in (lookup.ids, lookup.states)
                   if t is not None)

    def close(self) -> None:
        """Take out the delta tracker cnr built (its hook leaves the slots); a user's stays. Idempotent."""
        if not self.created:
            return
        self.created = False
        trackers = getattr(self.dmp, "model_trackers", {})
        for name, tracker in list(trackers.items()):
            if tracker is self.delta:
                del trackers[name]
        for module in self.modules.values():
            if occupant(module) == self.delta.record_lookup:
                setattr(module, SLOT, None)


def open_row_tracker(app: AppState, source: TrackerSource, views: Sequence[str]) -> RowTracker:
    """The Checkpointer's row tracker over ``app``'s tables, its rows from ``source`` (collective).

    "cnr": a slot held by a hook that is not cnr's is refused now (install attaches later);
    "torchrec": the tracker's sources are every module's delta tracker. A refusal on any rank
    raises on every rank (cnr.track.agreement) and leaves no delta tracker of cnr's behind.
    """
    tracker = RowTracker(app.objects, views=views, whole=whole_tables(app))
    if source != TrackerSource.TORCHREC:
        agreement.barrier("open: torchrec's hook slots are free for the row tracker", tracker.check_slots)
        return tracker

    def local() -> None:
        tracker.sources = tuple(torchrec_sources(app.objects, tracker))

    try:
        agreement.barrier("open: torchrec's delta tracker serves the row tracker", local)
    except BaseException:
        tracker.uninstall()  # closes this rank's sources when another rank refused
        raise
    return tracker


def torchrec_sources(objects: Mapping[str, Any], tracker: RowTracker) -> List[TorchrecSource]:
    """A TorchrecSource per app_state module holding tables (refusals: ConfigError, see the module's doc)."""
    check_torchrec_tracker()
    sources: List[TorchrecSource] = []
    try:
        for key, value in objects.items():
            refs = tables_of(key, value) if isinstance(value, torch.nn.Module) else []
            if refs:
                sources.append(_source(key, value, refs, tracker))
    except BaseException:
        for source in sources:
            source.close()
        raise
    return sources


def _source(key: str, dmp: torch.nn.Module, refs: List[TableRef], tracker: RowTracker) -> TorchrecSource:
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    if not isinstance(dmp, DistributedModelParallel):
        raise ConfigError(f"tracker='torchrec': app_state[{key!r}] is a {type(dmp).__name__} holding embedding tables; "
                          "torchrec's delta tracker lives in its DistributedModelParallel, so put the "
                          "DistributedModelParallel itself in app_state, or use tracker='cnr'")
    modules = {ref.path or key: ref.module for ref in refs}
    delta = dmp.get_delta_tracker()
    created = delta is None
    if created:
        for name, module in modules.items():
            if occupant(module) is not None:  # init would overwrite it, and that hook would lose rows
                raise ConfigError(f"tracker='torchrec': the post-lookup hook slot of the sharded module {key}/{name} "
                                  f"already holds {describe(occupant(module))}; torchrec's delta tracker needs that "
                                  "slot (one per module). Remove that hook, or use tracker='cnr'")
        try:
            delta = dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY,
                                                                       consumers=[CONSUMER]))
        except AttributeError as e:  # torchrec 1.8 logs ``model.module``: only a DDP-wrapped model has one
            raise ConfigError(f"tracker='torchrec': torchrec's ModelDeltaTracker cannot be built on app_state[{key!r}] "
                              f"({e}): it reads the DistributedDataParallel wrapper that DistributedModelParallel puts "
                              "around dense parameters, and this model has none. Use tracker='cnr'") from None
    source = TorchrecSource(key, dmp, delta, {}, modules, created)
    try:
        _check_existing(key, delta, TrackingMode.ID_ONLY)
        source.tables = _table_fqns(delta, refs, tracker)
        source.check_slots()
    except TrackerHookError as e:
        source.close()
        raise ConfigError(f"tracker='torchrec': {e}") from None
    except BaseException:
        source.close()
        raise
    logger.info("app_state[%r]: touched rows from torchrec's delta tracker (%s, consumer %r) for %d tables",
                key, "built by cnr" if created else "the model's own", CONSUMER, len(source.tables))
    return source


def _check_existing(key: str, delta: Any, id_only: Any) -> None:
    """An existing delta tracker must record every lookup's ids (ID_ONLY) and know consumer "cnr"."""
    mode = getattr(delta, "_mode", None)
    consumers = sorted(getattr(delta, "per_consumer_batch_idx", {}))
    if mode != id_only or CONSUMER not in consumers:
        raise ConfigError(f"tracker='torchrec': the delta tracker of app_state[{key!r}] has tracking_mode "
                          f"{getattr(mode, 'name', mode)} and consumers {consumers}; cnr reads it as consumer "
                          f"{CONSUMER!r} in ID_ONLY mode (its own window, so other consumers keep their rows): build "
                          f"it with {_FIX}, or use tracker='cnr'")


def _table_fqns(delta: Any, refs: List[TableRef], tracker: RowTracker) -> Dict[str, TrackedTable]:
    """The delta tracker's key of each table -> cnr's TrackedTable, for every table this rank holds.

    torchrec keys a table's rows by the path of the first module found named after the table
    (for managed collisions, the remapping module's), and each feature by name: exact wherever
    every table gets a key of its own and every feature of it goes to that key. ConfigError for a
    table whose module it does not track (``fqns_to_skip``) or whose key or feature it shares."""
    tracked = {id(m) for m in delta.tracked_modules.values()}
    named: Dict[str, List[str]] = {}
    for ref in refs:
        named.setdefault(ref.name, []).append(ref.id)
    owner: Dict[str, str] = {}  # key -> the table id it stands for
    out: Dict[str, TrackedTable] = {}
    for ref in refs:
        fqn = delta.table_to_fqn.get(ref.name)
        features = ref.module._table_name_to_config[ref.name].feature_names
        others = [f for f in features if delta.feature_to_fqn.get(f) != fqn]
        twin = [t for t in named[ref.name] if t != ref.id]
        why = ("it does not track the module holding it (fqns_to_skip?)" if id(ref.module) not in tracked else
               f"it keys rows by table name, and {twin[0]} is named {ref.name!r} too" if twin else
               f"it has no key for table {ref.name!r}" if fqn is None or fqn in owner else
               f"it gives feature {others[0]!r} to {delta.feature_to_fqn.get(others[0])!r}: another table reads a "
               "feature of that name" if others else None)
        if why is not None:
            raise ConfigError(f"tracker='torchrec': torchrec's delta tracker cannot report the rows of table {ref.id} "
                              f"exactly: {why}. Use tracker='cnr'")
        owner[fqn] = ref.id
        if ref.id in tracker.tables:
            out[fqn] = tracker.tables[ref.id]
    return out
