"""tracker="torchrec": the touched rows from torchrec's ModelDeltaTracker (cnr.track.torchrec_source).

Two spawned gloo ranks train the same job twice over the same batches, once tracked by cnr's hook
and once by torchrec's delta tracker (built by the user with a second consumer "other"), and
compare the rows each table's checkpoint view captured at every checkpoint: an EBC, a weighted EBC
and an EC with every sharding type torchrec allows on CPU, the managed-collision job (MC-EC,
MC-EBC with MCH evictions), a job under TrainPipelineSparseDist and a feature-processed EBC. Then a Checkpointer with tracker="torchrec" saves increments and
restores them exactly, and what is refused is refused by name before any step.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import cnr
from cnr import api as cnr_api
from cnr.app.launch import RankFailed, launch
from cnr.errors import ConfigError
from cnr.testing.jobs import ALL_KINDS, EC_KINDS, JobSpec, batch, build, differing, gathered, schedule, train_step
from cnr.track.app_state import AppState
from cnr.track.torchrec_source import check_torchrec_tracker, open_row_tracker
from cnr.track.tracker import DEFAULT_VIEWS
from cnr.types import TrackerSource

STEPS, SAVES = 6, (2, 4, 6)
FAMILY = JobSpec(tables=ALL_KINDS, weighted=ALL_KINDS, sequence=EC_KINDS)
SMALL = JobSpec(tables=("row_wise", "table_wise"))
PIPELINED = JobSpec(tables=("table_wise", "column_wise", "row_wise", "data_parallel"), pipelined=True)


def _captures(tracker, train) -> dict:
    """Step -> table -> the global row ids the checkpoint view captured at that save (cleared,
    committed), every table (data-parallel ones too)."""
    out = {}
    for step in range(1, STEPS + 1):
        train(step)
        if step in SAVES:
            tracker.fold()
            cap = tracker.capture("checkpoint", clear=True)
            out[str(step)] = {t: tracker.row_ids(cap.bitmap, t).tolist() for t in tracker.tables}
            tracker.release([cap], committed=True)
    return out


def _equal_worker(rank: int, world_size: int, arg: dict) -> dict:
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    if arg["model"] == "ebc-family":
        make = lambda: build(FAMILY, world_size)  # noqa: E731
        step_of = lambda dmp, opt: lambda s: train_step(FAMILY, dmp, opt, s, rank)  # noqa: E731
    elif arg["model"] == "pipelined":  # TrainPipelineSparseDist: batch s+1's input dist runs in step s
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        make = lambda: build(PIPELINED, world_size)  # noqa: E731

        def step_of(dmp, opt):
            pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
            batches = iter([batch(PIPELINED, s, rank) for s in range(1, STEPS + 3)])
            return lambda s: (schedule(dmp, s), pipeline.progress(batches))
    elif arg["model"] == "no-dmp-forward":  # the model run past DMP.forward, which advances torchrec's batch index
        make = lambda: build(SMALL, world_size)  # noqa: E731

        def step_of(dmp, opt):
            def step(s: int) -> None:
                schedule(dmp, s)
                loss = dmp.module(batch(SMALL, s, rank))
                opt.zero_grad()
                loss.backward()
                opt.step()
            return step
    elif arg["model"] == "feature-processed":  # position-weighted FP-EBC: the hook is the wrapped EBC's
        from test_feature_processed import batch as fp_batch, build as fp_build

        make = lambda: fp_build(world_size)  # noqa: E731

        def step_of(dmp, opt):
            def step(s: int) -> None:
                loss = dmp(fp_batch(s, rank))
                opt.zero_grad()
                loss.backward()
                opt.step()
            return step
    else:
        from cnr.testing import mc_jobs as mc

        make = lambda: mc.build(world_size)  # noqa: E731
        step_of = lambda dmp, opt: lambda s: mc.train_step(dmp, opt, s, rank)  # noqa: E731
    dmp_a, opt_a = make()
    dmp_b, opt_b = make()
    ours = open_row_tracker(AppState({"model": dmp_a}, rank), TrackerSource.CNR, DEFAULT_VIEWS)
    ours.install()
    # the user's own tracker, with a consumer of its own beside cnr's
    delta = dmp_b.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY,
                                                                 consumers=["other", "cnr"]))
    theirs = open_row_tracker(AppState({"model": dmp_b}, rank), TrackerSource.TORCHREC, DEFAULT_VIEWS)
    a = _captures(ours, step_of(dmp_a, opt_a))
    b = _captures(theirs, step_of(dmp_b, opt_b))
    # "other" never read: it still gets every id of the run, though cnr read three times
    fqn_of = {t.name: fqn for fqn, t in theirs.sources[0].tables.items()}
    other = delta.get_unique_ids(consumer="other")
    other_rows, union = {}, {}
    for name, table in theirs.tables.items():
        ids = other.get(fqn_of[name], torch.empty(0, dtype=torch.int64))
        other_rows[name] = sorted((ids.to(torch.int64) + table.row_offset).tolist())
        union[name] = sorted({r for step in a.values() for r in step[name]})
    theirs.uninstall()
    tables = {n: {"offset": t.row_offset, "rows": t.rows, "dp": t.data_parallel} for n, t in theirs.tables.items()}
    mine = {"a": a, "b": b, "other": other_rows, "union": union, "tables": tables,
            "user_tracker_kept": dmp_b.get_delta_tracker() is delta}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return everyone


@pytest.fixture(scope="module", params=["ebc-family", "managed-collision", "pipelined", "feature-processed", "no-dmp-forward"])
def equal_run(request):
    return request.param, launch(_equal_worker, 2, {"model": request.param})


def test_torchrec_source_captures_the_same_rows_as_cnrs_hook_at_every_checkpoint(equal_run):
    model, ranks = equal_run
    for rank, r in enumerate(ranks):
        assert r["a"] == r["b"], (model, rank)
        assert r["user_tracker_kept"]  # cnr leaves a tracker it did not build where it was
    for step in SAVES:  # every checkpoint captured rows: clearing and the consumer's window both ran
        assert sum(len(ids) for r in ranks for ids in r["a"][str(step)].values()) > 0, (model, step)
    if model in ("ebc-family", "pipelined"):  # shards that start past row 0 (their ids are offset) on some rank
        assert any(t["offset"] > 0 and not t["dp"] for r in ranks for t in r["tables"].values())
        assert any(t["dp"] for r in ranks for t in r["tables"].values())


def test_another_consumer_keeps_its_rows_after_cnr_read(equal_run):
    model, ranks = equal_run
    for rank, r in enumerate(ranks):
        for name, t in r["tables"].items():
            if not t["dp"]:  # cnr's data-parallel rows are OR-reduced over ranks; "other"'s are this rank's
                assert r["other"][name] == r["union"][name], (model, rank, name)
    assert any(r["other"][name] for r in ranks for name in r["other"]), model


# ---- a Checkpointer with tracker="torchrec", end to end ---------------------------------------------

E2E = JobSpec(tables=("row_wise", "table_wise", "data_parallel", "column_wise"))


def _job(rank: int, world_size: int, arg: dict) -> dict:
    dmp, opt = build(E2E, world_size)
    app_state = {"model": dmp, "optim": opt}
    options = cnr.CheckpointOptions(policy="consecutive", keep_last=0, tracker="torchrec")
    kinds, rows = [], []
    with cnr.Checkpointer(arg["uri"], app_state, options) as ckpt:
        assert dmp.get_delta_tracker() is not None and ckpt.tracker.sources
        info = ckpt.restore()
        state = gathered(app_state)
        if rank == 0 and info is not None:
            torch.save(state, arg["restored"])
        for step in range(1, 5 if info is None else 0):
            train_step(E2E, dmp, opt, step, rank)
            if step in (2, 4):
                done = ckpt.save(step).wait()
                kinds.append(done.kind.value)
                rows.append(done.rows)
        if info is None:
            state = gathered(app_state)
            if rank == 0:
                torch.save(state, arg["saved"])
    return {"kinds": kinds, "rows": rows, "left": dmp.get_delta_tracker() is None}


def test_checkpointer_with_torchrec_tracker_restores_exactly(tmp_path):
    uri = str(tmp_path / "ck")
    saved = launch(_job, 2, {"uri": uri, "saved": str(tmp_path / "saved.pt")})
    assert saved["kinds"] == ["full", "incremental"], saved
    assert saved["left"]  # the delta tracker cnr built left the model at close
    restored = launch(_job, 2, {"uri": uri, "restored": str(tmp_path / "restored.pt")})
    assert restored["left"]
    assert differing(torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "restored.pt")) == []


# ---- refusals ------------------------------------------------------------------------------------------

def _refusals(rank: int, world_size: int, arg: dict) -> dict:
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    out = {}
    options = cnr.CheckpointOptions(policy="consecutive", tracker="torchrec")

    def refused(name: str, app_state: dict) -> None:
        try:
            cnr.Checkpointer(arg["uri"] + "/" + name, app_state, options).close()
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)

    dmp, opt = build(JobSpec(), world_size)
    refused("not_dmp", {"model": dmp.module, "optim": opt})
    dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["other"]))
    refused("no_consumer", {"model": dmp, "optim": opt})
    dmp, opt = build(JobSpec(), world_size)
    first = cnr.Checkpointer(arg["uri"] + "/cnr", {"model": dmp, "optim": opt}, cnr.CheckpointOptions(policy="consecutive"))
    refused("slot_taken", {"model": dmp, "optim": opt})  # the first Checkpointer's hook holds the slots
    first.close()
    out["no_tracker_left"] = dmp.get_delta_tracker() is None
    dmp, opt = build(JobSpec(), world_size)
    opened = cnr_api.JobLocation.open

    def held(*_args, **_kwargs):
        raise ConfigError("the lease is held")

    cnr_api.JobLocation.open = held  # the location cannot be opened after the delta tracker was built
    try:
        refused("lease_held", {"model": dmp, "optim": opt})
    finally:
        cnr_api.JobLocation.open = opened
    out["no_tracker_left_after_open_failed"] = dmp.get_delta_tracker() is None and all(
        m.post_lookup_tracker_fn is None for m in (dmp.module.ebc,))
    refused("same_table_name", {"model": _two_modules_one_table_name(dense=True)})
    refused("no_dense", {"model": _two_modules_one_table_name(dense=False)})
    return out


def _two_modules_one_table_name(dense: bool):
    """Two EBCs, each with a table named "t" (cnr keys tables by their stored name; torchrec by
    name), and with ``dense`` a linear layer (DistributedModelParallel wraps only dense parameters in DDP)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, feature in (("one", "a"), ("two", "b")):
                setattr(self, name, EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                    name="t", embedding_dim=4, num_embeddings=10, feature_names=[feature])], device=torch.device("meta")))
            self.head = torch.nn.Linear(4, 1) if dense else None

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.one(kjt).values().sum() + self.two(kjt).values().sum()

    return DistributedModelParallel(Two(), device=torch.device("cpu"))


def test_unsupported_uses_are_refused_by_name_before_any_step(tmp_path):
    out = launch(_refusals, 1, {"uri": str(tmp_path)})
    assert "DistributedModelParallel itself" in out["not_dmp"]
    assert "consumers ['other']" in out["no_consumer"] and "consumers=[..., 'cnr']" in out["no_consumer"]
    assert "already holds cnr.track.hook_slot.LookupHooks" in out["slot_taken"] and "tracker='cnr'" in out["slot_taken"]
    assert out["no_tracker_left"]
    assert out["lease_held"] == "the lease is held" and out["no_tracker_left_after_open_failed"]
    assert ("table model/one.embedding_bags.t.weight exactly: it keys rows by table name, and "
            "model/two.embedding_bags.t.weight is named 't' too") in out["same_table_name"], out["same_table_name"]
    assert "this model has none" in out["no_dense"] and "tracker='cnr'" in out["no_dense"]


def test_a_torchrec_without_the_delta_tracker_is_refused_naming_its_version(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchrec.distributed.model_tracker", None)  # its import fails
    with pytest.raises(ConfigError, match=r"needs torchrec >= 1\.8\.0 with ModelDeltaTracker .*installed: 1\.8\.0"):
        check_torchrec_tracker()


def test_tracker_option_is_a_choice_flat_and_in_the_schedule_group():
    assert cnr.CheckpointOptions(tracker="torchrec").schedule.tracker is TrackerSource.TORCHREC
    assert cnr.CheckpointOptions().tracker == "cnr"
    with pytest.raises(cnr.OptionsError, match="CheckpointOptions.tracker = 'delta' is not allowed; allowed: cnr, torchrec"):
        cnr.CheckpointOptions(tracker="delta")


def test_config_key_is_recorded_only_when_set():
    from cli_helpers import TINY
    from cnr.app.config import load_config

    assert "tracker" not in load_config(TINY).to_dict()["checkpoint"]  # stores at the default stay as they were
    config = load_config(TINY, ["checkpoint.tracker=torchrec"])
    assert config.checkpoint.options(10).tracker is TrackerSource.TORCHREC
    assert config.to_dict()["checkpoint"]["tracker"] == "torchrec"
    with pytest.raises(ConfigError, match="config key 'checkpoint.tracker' = 'x' is not allowed; allowed: cnr, torchrec"):
        load_config(TINY, ["checkpoint.tracker=x"])


def test_rank_failures_are_named(tmp_path):
    """At world size 2 a refusal reaches every rank (one agreement step), naming the cause."""
    with pytest.raises(RankFailed, match="DistributedModelParallel itself"):
        launch(_not_dmp, 2, {"uri": str(tmp_path)})


def _not_dmp(rank: int, world_size: int, arg: dict) -> None:
    dmp, opt = build(JobSpec(), world_size)
    cnr.Checkpointer(arg["uri"], {"model": dmp.module, "optim": opt},
                     cnr.CheckpointOptions(policy="consecutive", tracker="torchrec"))


def _idle_table(rank: int, world_size: int, arg: dict) -> dict:
    """Tables looked up in one interval, then in none (a save and a publish at one step both fold),
    then one table in the next (its feature has no ids)."""
    from torchrec import KeyedJaggedTensor

    dmp, opt = build(SMALL, world_size)
    tracker = open_row_tracker(AppState({"model": dmp}, rank), TrackerSource.TORCHREC, DEFAULT_VIEWS)
    captured = []
    for lengths in ([1, 1, 1, 1], None, [1, 1, 0, 0]):
        if lengths is not None:
            kjt = KeyedJaggedTensor(keys=["f_0", "f_1"], values=torch.tensor([3, 5, 7, 9][:sum(lengths)]),
                                    lengths=torch.tensor(lengths, dtype=torch.int32))
            loss = dmp(kjt)
            opt.zero_grad()
            loss.backward()
            opt.step()
        tracker.fold()
        cap = tracker.capture("checkpoint", clear=True)
        captured.append({t.split(".")[-2]: tracker.row_ids(cap.bitmap, t).tolist() for t in tracker.tables})
        tracker.release([cap], committed=True)
    tracker.uninstall()
    return {"captured": captured}


def test_an_interval_without_lookups_reads_as_no_rows():
    out = launch(_idle_table, 1, None)
    assert out["captured"] == [{"t_0": [3, 5], "t_1": [7, 9]}, {"t_0": [], "t_1": []}, {"t_0": [3, 5], "t_1": []}]
