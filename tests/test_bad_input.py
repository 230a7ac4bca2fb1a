"""Bad input on every command (issue #25, item 12): one ``error:`` line naming the value and what
is allowed, exit status 2, no traceback, and nothing written: no storage, no lease file, no
directory the command was asked to create. Each case runs through ``cnr.app.cli.main`` in this process
and is refused before any work starts."""

from __future__ import annotations

import os

import pytest

from cli_helpers import TINY
from cnr.app.cli import main


def _tree(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


HUGE_TABLE = "model.tables=[{name: t0, rows: 2000000000, features: [f0, f1, f2, f3, f4]}]"

# (argv with {tmp} for the test's directory, a fragment of the error line)
CASES = {
    "dense_lr_1e300": (["train", "--config", TINY, "--storage", "{tmp}/ck", "--set", "train.dense_lr=1e300"],
                       "'train.dense_lr' = 1e+300 is not allowed; it must be in (0, 3.402823e+38]"),
    "sparse_lr_1e39": (["train", "--config", TINY, "--storage", "{tmp}/ck", "--set", "train.sparse_lr=1e39"],
                       "'train.sparse_lr' = 1e+39 is not allowed"),
    "trace_dir_proc": (["train", "--config", TINY, "--storage", "{tmp}/ck", "--set", "data.trace_dir=/proc/x"],
                       "config key 'data.trace_dir' = '/proc/x' is not allowed: it cannot be created"),
    "table_2e9_rows": (["train", "--config", TINY, "--storage", "{tmp}/ck", "--set", HUGE_TABLE],
                       "config key 'model.tables[0].rows' = 2000000000 is not allowed on this machine"),
    "export_proc": (["export", "{store}", "--format", "dcp", "/proc/x"],
                    "export target = '/proc/x' is not allowed: it cannot be created"),
    "subscribe_poll_inf": (["subscribe", "{tmp}/pub", "--config", TINY, "--poll-s", "inf", "--once"],
                           "--poll-s inf is not allowed; it must be in (0, 86400] seconds"),
    "subscribe_poll_nan": (["subscribe", "{tmp}/pub", "--config", TINY, "--poll-s", "nan", "--once"],
                           "--poll-s nan is not allowed"),
    "subscribe_state_proc": (["subscribe", "{tmp}/pub", "--config", TINY, "--state", "/proc/x", "--once"],
                             "--state = '/proc/x' is not allowed: its directory '/proc' is not writable"),
    "subscribe_state_missing_dir": (["subscribe", "{tmp}/pub", "--config", TINY, "--state", "{tmp}/no/state.pt",
                                     "--once"], "its directory '{tmp}/no' does not exist"),
    "bench_snapshot_scales": (["bench", "snapshot", "--workdir", "{tmp}/wd", "--scales", "abc"],
                              "--scales 'abc' is not allowed; give comma-separated finite numbers > 0"),
    "bench_snapshot_scales_inf": (["bench", "snapshot", "--workdir", "{tmp}/wd", "--scales", "1,inf"],
                                  "--scales '1,inf' is not allowed"),
    "bench_chaos_workdir": (["bench", "chaos", "--workdir", "/proc/x"],
                            "--workdir = '/proc/x' is not allowed: it cannot be created"),
    "bench_chaos_budget_nan": (["bench", "chaos", "--workdir", "{tmp}/wd", "--budget-s", "nan"],
                               "--budget-s nan is not allowed; it must be a finite number > 0"),
    "bench_snapshot_workdir": (["bench", "snapshot", "--workdir", "/proc/x"],
                               "--workdir = '/proc/x' is not allowed"),
    # #38.8: non-finite, non-positive and out-of-range numbers of every bench's float options
    "bench_conformance_timeout_nan": (["bench", "conformance", "--workdir", "{tmp}/wd", "--timeout-s", "nan"],
                                      "bench conformance: --timeout-s nan is not allowed; it must be in (0, 86400]"),
    "bench_conformance_timeout_inf": (["bench", "conformance", "--workdir", "{tmp}/wd", "--timeout-s", "inf"],
                                      "--timeout-s inf is not allowed"),
    "bench_conformance_timeout_negative": (["bench", "conformance", "--workdir", "{tmp}/wd", "--timeout-s", "-5"],
                                           "--timeout-s -5.0 is not allowed"),
    "bench_codecs_min_encode_nan": (["bench", "codecs", "--workdir", "{tmp}/wd", "--min-encode-mb-s", "nan"],
                                    "--min-encode-mb-s nan is not allowed; it must be a finite number >= 0"),
    "bench_policies_chain_ratio_inf": (["bench", "policies", "--workdir", "{tmp}/wd", "--max-chain-ratio", "inf"],
                                       "--max-chain-ratio inf is not allowed"),
    "bench_publish_poll_inf": (["bench", "publish", "--workdir", "{tmp}/wd", "--poll-s", "inf"],
                               "bench publish: --poll-s inf is not allowed; it must be in (0, 86400]"),
    "bench_tables_fraction_nan": (["bench", "tables", "--workdir", "{tmp}/wd", "--impact-fraction", "nan"],
                                  "--impact-fraction nan is not allowed; it must be in (0, 1]"),
    "bench_upload_link_nan": (["bench", "upload", "--workdir", "{tmp}/wd", "--link-mb-s", "nan"],
                              "--link-mb-s nan is not allowed; it must be a finite number >= 0"),
    "bench_upload_link_inf": (["bench", "upload", "--workdir", "{tmp}/wd", "--link-mb-s", "inf"],
                              "--link-mb-s inf is not allowed"),
    "bench_chaos_budget_inf": (["bench", "chaos", "--workdir", "{tmp}/wd", "--budget-s", "inf"],
                               "--budget-s inf is not allowed"),
    # #38.8: integers past what the library takes
    "compact_keep_last_huge": (["compact", "{tmp}/store", "--keep-last", "99999999999999999999"],
                               "compact --keep-last 99999999999999999999 is not allowed; it must be from 0 to "
                               "2147483647 (0 deletes nothing)"),
    "compact_chunk_bytes_huge": (["compact", "{tmp}/store", "--chunk-bytes", "99999999999999999999"],
                                 "compact --chunk-bytes 99999999999999999999 is not allowed; it must be from 4096 to "
                                 "2147483647"),
    "subscribe_until_seq_huge": (["subscribe", "{tmp}/pub", "--config", TINY, "--until-seq", "99999999999999999999"],
                                 "--until-seq 99999999999999999999 is not allowed; sequence numbers are from 1 to "
                                 "9007199254740992"),
    "train_keep_last_huge": (["train", "--config", TINY, "--storage", "{tmp}/ck", "--set",
                              "checkpoint.keep_last=99999999999999999999"],
                             "'checkpoint.keep_last' = 99999999999999999999 is not allowed; it must be from 0 to "
                             "2147483647"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_error_line_exit_2_and_writes_nothing(tmp_path, capsys, baseline_ws1, monkeypatch, name):
    argv, message = CASES[name]
    # the host memory the 2e9-row table is judged against: fixed, so no machine of the suite passes it
    monkeypatch.setattr("cnr.app.config_checks.host_memory_bytes", lambda: (128 << 30, "physical memory"), raising=False)
    _summary, cwd, storage = baseline_ws1
    store = os.path.join(cwd, storage)
    before = _tree(store)
    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{store}", store)

    rc = main([fill(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(lines) == 1 and fill(message) in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == [], _tree(tmp_path)  # no storage, lease, publish store or work directory
    assert not os.path.exists("/proc/x")
    assert _tree(store) == before  # export read nothing into, and wrote nothing next to, the store


def test_the_memory_bound_names_the_most_rows_allowed():
    """The largest table is blamed, with the most rows it may have next to the others."""
    from cnr.app.config import load_config
    from cnr.app.config_checks import check_host_memory
    from cnr.errors import ConfigError

    config = load_config(TINY, [HUGE_TABLE])
    with pytest.raises(ConfigError) as e:
        check_host_memory(config, on_cpu=True, memory=(64 << 30, "physical memory"))
    # rowwise_adagrad on CPU with checkpoints: 2 x (16 x 4 + 4) + 8 bytes a row
    assert f"[1, {(64 << 30) // 144}]" in str(e.value) and "144 bytes per row" in str(e.value)
    check_host_memory(config, on_cpu=True, node_share=1 / 8, memory=(64 << 30, "x"))  # 36 GB a node of 8 fits
