"""Shared fixtures: ``STORAGE_BACKENDS`` (local, S3 on the test server, tiered) for the tests that
run a case against every store (test_lease, test_reads, test_local_tier)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cnr.storage.local import LocalStorage  # noqa: E402
from s3_server import moto_s3, stop_moto_s3  # noqa: E402

MiB = 1024 * 1024


def _local(tmp_path):
    return LocalStorage(str(tmp_path / "store"))


def _s3(tmp_path):
    # A fresh bucket on the session's moto server (127.0.0.1); 5 MiB parts, so the contract's
    # 10 MiB object goes up as a multipart upload.
    from cnr.storage.s3 import S3Storage

    return S3Storage(moto_s3().new_bucket(), "jobs/run-1", part_size=5 * MiB, max_concurrency=4,
                     backoff_base=0.01, backoff_max=0.05)


def _tiered(tmp_path):
    # A node-local tier in front of a second directory (cnr.storage.tiered): reads see a put at once.
    from cnr.storage.tiered import TieredStorage

    return TieredStorage(LocalStorage(str(tmp_path / "local-tier")), LocalStorage(str(tmp_path / "store")),
                         commit_timeout_s=10)


# The stores tests run a case against (the storage contract has its own list, with a test-only wrapper).
STORAGE_BACKENDS = {"local": _local, "s3": _s3, "tiered": _tiered}


@pytest.fixture(params=sorted(STORAGE_BACKENDS))
def storage(request, tmp_path):
    backend = STORAGE_BACKENDS[request.param](tmp_path)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def moto():
    """The session's moto S3 server (started on first use, stopped at session end)."""
    return moto_s3()


@pytest.fixture
def s3_bucket(moto):
    """A fresh, empty bucket for one test."""
    return moto.new_bucket()


def pytest_sessionfinish(session, exitstatus):
    stop_moto_s3()


# ---- shared training runs (each costs seconds of process start-up, so they are made once, and
# the two below once for both of make test's xdist workers: tests/session_once.py) ----

@pytest.fixture(scope="session")
def baseline_ws1(tmp_path_factory):
    """tiny.yaml trained uninterrupted at world size 1: (summary, cwd, storage name).

    Its sample trace is in ``<cwd>/trace``.
    """
    from cli_helpers import train
    from session_once import once

    def make(cwd):
        return train(str(cwd), "ck", "--set", "data.trace_dir=trace"), str(cwd), "ck"

    return tuple(once(tmp_path_factory, "baseline_ws1", make))  # once for both xdist workers


@pytest.fixture(scope="session")
def runs_ws2(tmp_path_factory):
    """World size 2, one sharding type per table: uninterrupted (60 steps; its sample trace in
    ``<cwd>/trace-full2``) and stopped at step 40."""
    from cli_helpers import MIXED_SHARDING, train
    from session_once import once

    def make(path):
        cwd = str(path)
        return {"full": train(cwd, "full2", *MIXED_SHARDING, "--set", "data.trace_dir=trace-full2", nproc=2),
                "at40": train(cwd, "split2", *MIXED_SHARDING, "--set", "train.steps=40", nproc=2), "cwd": cwd}

    return once(tmp_path_factory, "runs_ws2", make)  # once for both xdist workers


@pytest.fixture(scope="session")
def tsv_data(tmp_path_factory):
    """Criteo TSV files for tiny.yaml: {"dir", "opts"}; 2000 + 6000 training lines (world size 2
    needs 7680 for 60 steps; world size 1 crosses the file boundary), 600 eval lines."""
    from cli_helpers import write_tsv

    d = tmp_path_factory.mktemp("tsv_data")
    write_tsv(d / "day0.tsv", 2000, 1)
    write_tsv(d / "day1.tsv", 6000, 2)
    write_tsv(d / "eval.tsv", 600, 3)
    opts = ["--set", "data.source=tsv", "--set", f"data.tsv_paths=[{d / 'day0.tsv'}, {d / 'day1.tsv'}]",
            "--set", f"data.eval_tsv_paths=[{d / 'eval.tsv'}]"]
    return {"dir": str(d), "opts": opts}


@pytest.fixture(scope="session")
def tsv_full(tmp_path_factory, tsv_data):
    """tiny.yaml on the TSV files, uninterrupted, reading in the trainer's process (no reader
    processes): {nproc: (summary, cwd)} for world size 1 and 2, sample traces in ``<cwd>/trace``."""
    from cli_helpers import train

    out = {}
    for nproc in (1, 2):
        cwd = str(tmp_path_factory.mktemp(f"tsv_full_ws{nproc}"))
        out[nproc] = (train(cwd, "ck", *tsv_data["opts"], "--set", "data.reader_processes=0",
                            "--set", "data.trace_dir=trace", nproc=nproc), cwd)
    return out


# The slow tier: `make test` leaves these out, `make test-slow` runs them, CI runs both. Each is an
# end-to-end job trained, killed and resumed several times over; the comment names the cheaper
# test of the same behaviour that stays in `make test`.
SLOW_TESTS = {
    # reader position exactly once: test_api's kill_and_resume[intermittent] restores the loader
    "tests/test_exactly_once.py::test_exactly_once_synthetic",
    "tests/test_exactly_once.py::test_exactly_once_tsv[2]",
    "tests/test_train_tsv.py::test_tsv_training_resumes_bit_exact",  # test_readers_tsv
    # multi-node and cross-world-size resumes: test_train_resume ws2 -> ws1
    "tests/test_multinode.py::test_two_nodes_resume_bit_exact_and_restore_on_one_node",
    "tests/test_eight_ranks.py::test_eight_ranks_on_four_nodes_resume_bit_exact_and_move_to_four_ranks_and_back",
    "tests/test_train_policies.py::test_consecutive_chain_restores_across_world_sizes",
    "tests/test_api.py::test_kill_and_resume_at_world_size_1_then_restore_at_2[full]",
    "tests/test_api.py::test_kill_and_resume_at_world_size_1_then_restore_at_2[consecutive]",
    "tests/test_api.py::test_kill_and_resume_at_world_size_1_then_restore_at_2[one_shot]",
    "tests/test_train_resume.py::test_resume_is_bit_exact_world_size_1[dcn-adagrad-adam]",
    # kills: test_train_crash's sigkill_during_checkpoint[before_commit-20] (the same kill at step 40,
    # later in the checkpoint: its partial data is listed and never used)
    "tests/test_train_crash.py::test_sigkill_during_checkpoint[before_data-20]",
    "tests/test_train_crash.py::test_sigkill_of_one_rank_at_world_size_2",
    "tests/test_train_crash.py::test_sigkill_during_checkpoint[mid_data-20]",
    "tests/test_train_crash.py::test_sigkill_during_checkpoint[after_data-20]",
    "tests/test_api_lifecycle.py::test_writer_rerunning_an_unguarded_script_names_the_cause",
    "tests/test_train_background.py::test_overlap_waits_and_counts_the_wait_as_stall",
    # benches: their own unit tests and `python -m cnr bench ...` (figures in docs/benchmarks.md);
    # bench restore's --run mode and bench full_checkpoint stay in, end to end
    "tests/test_bench_restore.py::test_tiny_run",
    "tests/test_bench_snapshot.py::test_bench_snapshot_tiny",
    "tests/test_bench_chaos.py::test_short_chaos_run_loses_nothing",
    "tests/test_bench_chaos.py::test_short_chaos_run_with_a_damaged_merged_baseline_then_an_exception_after_a_save",
    "tests/test_bench_upload.py::test_bench_upload_tiny_on_s3_and_local",
    "tests/test_bench_conformance.py::test_managed_collision_cells_are_exact_or_refused_never_wrong",
    "tests/test_bench_accuracy.py::test_bench_accuracy_tiny_control_is_exact",
    "tests/test_bench_policies.py::test_bench_policies_runs_real_training",
    "tests/test_bench_restore_ranks.py::test_two_ranks_one_round",  # test_bench_restore's tiny run at world size 1
    # bench publish's ranked/all-rows comparison: its compare() stays in, and test_api_publish_ranked
    "tests/test_bench_publish.py::test_the_comparison_runs_both_publishers_on_the_same_training",
    # conformance: test_conformance's other cells and test_managed_collision[one_shot-1]
    "tests/test_managed_collision.py::test_managed_collision_modules_resume_exactly[consecutive-2]",
    "tests/test_conformance.py::test_column_split_tables_resume_exactly_and_restore_at_one_rank",
    "tests/test_conformance.py::test_another_plan_at_the_same_world_size_restores_exactly",
    # examples: test_pipeline resumes a TrainPipelineSparseDist bit-exact
    "tests/test_examples.py::test_dlrm_criteo_pipeline_killed_and_resumed_is_bit_exact",
    "tests/test_examples.py::test_two_tower_killed_and_resumed_is_bit_exact",
    # S3 end to end: test_storage_s3 (errors, retries) and test_lease on S3
    "tests/test_train_s3.py::test_train_and_resume_on_s3_bit_exact[2]",
    "tests/test_train_s3.py::test_bucket_failing_for_good_mid_run[bucket_gone-NoSuchBucket]",
    "tests/test_train_s3.py::test_bucket_failing_for_good_mid_run[deny_writes-AccessDenied]",
    "tests/test_publish.py::test_two_ranks_on_s3_publish_8bit_within_the_bound",
    # policies and quantized resumes: test_policy, test_train_quantized[4-adaptive,naive-extra0]
    "tests/test_train_policies.py::test_bit_width_from_failures_falls_back_to_8_bits_and_survives_restarts",
    "tests/test_train_quantized.py::test_quantized_checkpoints_resume_close_to_fp32[8-naive-extra1]",
    # retention and the local tier: the other case of each file; the local tier's inspect listing
    # and its retention: test_local_tier's kill_between_local_and_remote_commit (inspect --local-dir
    # before and after a resume whose retention drops step 40's local copy) and
    # local_retention_never_deletes_what_the_remote_lacks; two jobs sharing a local_dir:
    # test_two_locations_sharing_a_local_dir_never_see_each_other (the same keyed tiers, a writer's
    # and a reader's)
    "tests/test_local_tier.py::test_inspect_shows_the_tiers_and_local_retention_keeps_fewer",
    "tests/test_local_tier.py::test_two_jobs_sharing_a_local_dir_as_users_run_them",
    "tests/test_retention_verified.py::test_retention_after_a_fallback_past_a_damaged_baseline_then_a_crash",
    "tests/test_local_tier.py::test_lost_or_damaged_local_tier_resumes_from_remote[deleted]",
    # a node-only branch beside a newer S3 history (three jobs): test_storage_tiered's commit that
    # cannot get its base fails at once, and test_local_tier_branches' resume without a checkpoint
    "tests/test_local_tier_branches.py::test_a_node_only_branch_beside_a_newer_remote_history_is_flushed_and_the_job_ends",
    "tests/test_retention.py::test_training_keeps_only_the_newest_chain_and_failure_markers",  # test_retention_verified
    # background work: test_merge's merged baseline, test_publish's other jobs, the failed increment
    "tests/test_merge.py::test_training_merges_in_the_background_and_resumes_bit_exact",
    # a damaged merged baseline: test_restore_fallback's [chunk] case, and test_single_damage's
    # [merged chunk] resume past damage to the newest state's merged form
    "tests/test_restore_fallback.py::test_a_damaged_merged_baseline_is_passed_over_for_the_links_it_merged[manifest]",
    "tests/test_single_damage.py::test_a_resume_past_damage_to_the_newest_state_restores_it_or_the_one_before[merged manifest]",
    # cnr compact on an incremental location: test_single_damage's [intermittent] case (the issue's)
    "tests/test_single_damage.py::test_compact_on_an_incremental_location_keeps_what_single_damage_needs[one_shot]",
    # cnr train --resume past a damaged link: test_retention_verified's fallback test (cnr train,
    # fallbacks named) and test_restore_fallback's [deleted] case (the loader at the restored step)
    "tests/test_restore_fallback.py::test_cnr_train_resumes_past_a_damaged_middle_link_exactly_once",
    # fused kernels at two ranks: test_conformance's fused lr reaching ranks new after a reshard,
    # and test_fused_kernel's one-rank cases of the same check
    "tests/test_fused_kernel.py::test_two_ranks_each_kernel_of_each_sharding_type",
    "tests/test_publish.py::test_publishing_continues_across_a_resume",
    "tests/test_train_background.py::test_failed_baseline_makes_the_next_checkpoint_full",
    "tests/test_train_crash.py::test_sigkill_during_checkpoint[after_commit-40]",
    # dense-kernel tables: the table-wise and column-wise plans and Adam's increments stay in
    "tests/test_dense_kernel.py::test_dense_kernel_tables_and_their_adam_state_restore_at_another_world_size_and_plan[rw]",
    "tests/test_dense_kernel.py::test_dense_kernel_tables_and_their_adam_state_restore_at_another_world_size_and_plan[twrw]",
    "tests/test_dense_kernel.py::test_increments_of_dense_kernel_tables_restore_exactly[adagrad]",
    # older formats: the same test of versions 6 and 7 stays in; S3 at exit: the endpoint killed
    # mid-upload stays in (this one: the endpoint stops answering)
    "tests/test_integrity.py::test_checkpoints_of_older_versions_still_verify_list_and_restore[5]",
    # tracker='torchrec' on a pipeline and a feature-processed EBC: the ebc-family and managed-collision
    # cases of the same comparison stay in
    "tests/test_torchrec_source.py::test_torchrec_source_captures_the_same_rows_as_cnrs_hook_at_every_checkpoint[pipelined]",
    "tests/test_torchrec_source.py::test_another_consumer_keeps_its_rows_after_cnr_read[pipelined]",
    "tests/test_torchrec_source.py::test_torchrec_source_captures_the_same_rows_as_cnrs_hook_at_every_checkpoint"
    "[feature-processed]",
    "tests/test_torchrec_source.py::test_another_consumer_keeps_its_rows_after_cnr_read[feature-processed]",
    "tests/test_at_exit_s3.py::test_endpoint_lost_mid_upload_exits_within_the_bound[hang]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
