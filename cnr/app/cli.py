"""Command line: ``python -m cnr [-q|-v] {train,inspect,report,subscribe,export,compact,bench} ...``.

An error is one clear line on stderr; the exit code says which kind (cnr.app.console: 1 a runtime
failure, 2 a usage error). Every command that reports takes ``--json``: its last stdout line is then
one JSON object (train, report, subscribe, export, compact and bench print it always).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any, List, Optional

from cnr.app.console import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_NOT_COMMITTED, NORMAL, QUIET, VERBOSE, exit_code,
                             moving, set_verbosity)
from cnr.errors import CnrError, redact, redact_logging

BENCHMARKS = ("full_checkpoint", "snapshot", "tracking", "accuracy", "quantize", "policies", "reader", "upload",
              "publish", "chaos", "codecs", "codebook", "delta", "tables", "restore", "conformance", "scale")  # each with run(argv) -> dict
SYSTEM_TESTS = ("chaos", "conformance")  # cnr/systest/<name>.py, system tests with verdicts; the rest cnr/bench/<name>.py
EXPORT_FORMATS = ("dcp",)  # cnr/app/export.py
MAX_POLL_S = 86400.0  # subscribe --poll-s: a day between polls at most
UNKNOWN = "?"  # inspect's text for what no readable manifest says (kind, bits, rows of an uncommitted checkpoint)


def _train(args: argparse.Namespace) -> int:
    from cnr.app.config import load_config
    from cnr.app.launch import launch
    from cnr.app.job import prepare_job
    from cnr.app.rank_entry import run_job_rank

    config = load_config(args.config, args.set)
    job = prepare_job(config, args.storage, args.resume, args.nproc, new_history=args.new_history,
                      verbosity=args.verbosity)
    summary = launch(run_job_rank, args.nproc, job)
    if summary is not None:  # under torchrun only rank 0 has the summary
        print(json.dumps(summary, sort_keys=True), flush=True)
        if summary.get("commit_failure"):  # trained to the end, but its newest checkpoints did not commit
            print(f"error: {redact(summary['commit_failure'])}", file=sys.stderr)
            return EXIT_NOT_COMMITTED
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from cnr.format.abandoned import abandoned_ids, is_abandoned
    from cnr.format.catalog import list_checkpoints
    from cnr.storage.checkpoint_store import open_checkpoint_store
    from cnr.write.local_tier import committed_in, tier_for
    from cnr.options import CheckpointOptions

    options = CheckpointOptions(local_dir=args.local_dir or "")
    storage = open_checkpoint_store(args.uri, options.local_dir, tier=tier_for(options))
    if args.verify:
        return _inspect_verify(storage, args.json)
    if args.tables:
        return _inspect_tables(storage, args.checkpoint, args.json)
    infos = list_checkpoints(storage)
    if not infos and not storage.list(""):  # a typo, a regular file: say so rather than list nothing
        error = (f"no checkpoint store at {redact(args.uri)}: nothing is stored there (give the location "
                 "cnr train --storage or cnr.Checkpointer wrote to)")
        if args.json:  # the JSON object stays the last stdout line
            print(json.dumps({"uri": storage.uri, "checkpoints": [], "error": error}, sort_keys=True))
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILURE
    abandoned = abandoned_ids(storage)
    rows = [
        {"id": i.id, "step": i.step, "kind": i.kind.value if i.kind is not None else None, "bits": i.bits,
         "rows": i.rows, "bytes": i.bytes,
         "committed": i.status.value == "committed", "status": i.status.value, "base": i.base, "error": i.error, "method": i.method,
         "lineage": i.lineage, "abandoned": is_abandoned(i.id, abandoned)}
        for i in infos
    ]
    tiers = committed_in(storage, infos)
    for r in rows:
        r["committed_in"] = tiers[r["id"]]
    if args.json:
        print(json.dumps({"uri": storage.uri, "checkpoints": rows}, sort_keys=True))
    else:
        width = max([22] + [len(r["id"]) for r in rows])  # merged baselines have longer ids
        print(f"{'id':<{width}} {'step':>8} {'kind':<12} {'bits':>4} {'method':<9} {'rows':>10} {'bytes':>12}  status")
        for r in rows:
            where = f" ({'+'.join(r['committed_in'])})" if r["committed"] and args.local_dir else ""
            kind, bits, nrows = (UNKNOWN if r[k] is None else r[k] for k in ("kind", "bits", "rows"))
            print(f"{r['id']:<{width}} {r['step']:>8} {kind:<12} {bits:>4} {r['method'] or '-':<9} "
                  f"{nrows:>10} {r['bytes']:>12}  {r['status']}{where}{', abandoned' if r['abandoned'] else ''}")
    return 0


def _inspect_verify(storage, as_json: bool) -> int:
    """Read back every object of every committed checkpoint; exit 0 when a chain restores, else 1."""
    from cnr.format.abandoned import abandoned_ids, is_abandoned
    from cnr.format.verify import verify_store

    with moving(storage, "verify") as read:  # every object is read back: a bar of the bytes so far
        results = verify_store(read)
    abandoned = abandoned_ids(storage)  # a restore passes over them, whatever their objects
    rows = [{"id": v.id, "step": v.step, "intact": not v.damage, "abandoned": is_abandoned(v.id, abandoned),
             "restorable": v.restorable, "chain": list(v.chain), "damage": list(v.damage)} for v in results]
    for r in rows:
        r["restorable"] = r["restorable"] and not r["abandoned"]
    restorable = [r["id"] for r in rows if r["restorable"]]
    if as_json:
        print(json.dumps({"uri": storage.uri, "checkpoints": rows, "restorable": restorable}, sort_keys=True))
    else:
        for r in rows:
            state = ("restorable" if r["restorable"] else "abandoned (a restore passed over it)" if r["abandoned"]
                     else "intact, chain broken" if r["intact"] else "DAMAGED")
            print(f"{r['id']}  step {r['step']}  {state}")
            for line in r["damage"]:
                print(f"    {line}")
        print(f"{len(restorable)} of {len(rows)} committed checkpoints restore" +
              (f"; newest: {restorable[-1]}" if restorable else ""))
    return 0 if restorable else EXIT_FAILURE


def _inspect_tables(storage, checkpoint: Optional[str], as_json: bool) -> int:
    """The embedding tables (every EBC and EC table of every module) a checkpoint holds."""
    from cnr.errors import CheckpointError
    from cnr.format.catalog import newest_committed, read_manifest

    manifest = read_manifest(storage, checkpoint) if checkpoint else newest_committed(storage)
    if manifest is None:
        raise CheckpointError(f"no committed checkpoint in {storage.uri}")
    from cnr.types import Role

    widths = {}  # table -> the bit-widths its rows are stored at in this checkpoint (not its chain)
    for entry in manifest.tensors.values():
        if entry.role == Role.TABLE_ROWS:
            widths.setdefault(entry.table, set()).update(c.bits for c in entry.chunks)
    tables = [{"name": t.name, "rows": t.rows, "dim": t.dim, "features": list(t.features), "placement": t.placement,
               "bits": sorted(widths.get(t.name, ()))} for t in manifest.tables]
    if as_json:
        print(json.dumps({"uri": storage.uri, "checkpoint": manifest.id, "tables": tables}, sort_keys=True))
        return 0
    width = max([5] + [len(t["name"]) for t in tables])
    print(f"checkpoint {manifest.id} (step {manifest.step}): {len(tables)} tables, "
          f"{sum(t['rows'] for t in tables)} rows")
    print(f"{'table':<{width}} {'rows':>10} {'dim':>5} {'bits':>5} {'placement':<18} features")
    for t in tables:
        bits = ",".join(map(str, t["bits"])) or "-"
        print(f"{t['name']:<{width}} {t['rows']:>10} {t['dim']:>5} {bits:>5} {t['placement'] or '-':<18} "
              f"{','.join(t['features'])}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from cnr.app.report import write_report

    print(json.dumps(write_report(args.uri, args.out), sort_keys=True), flush=True)
    return 0


def _check_subscribe_args(args: argparse.Namespace) -> None:
    from cnr.errors import ConfigError
    from cnr.format.integrity import MAX_STEP
    from cnr.options import shown

    if not 0 < args.poll_s <= MAX_POLL_S:
        raise ConfigError(f"--poll-s {args.poll_s} is not allowed; it must be in (0, {MAX_POLL_S:.0f}] seconds")
    if not args.timeout_s >= 0:
        raise ConfigError(f"--timeout-s {args.timeout_s} is not allowed; it must be >= 0 seconds (0: no limit)")
    if args.until_seq is not None and not 1 <= args.until_seq <= MAX_STEP:
        raise ConfigError(f"--until-seq {shown(args.until_seq)} is not allowed; sequence numbers are from 1 to "
                          f"{MAX_STEP} (a publish's sequence number is stored as a step)")
    if args.state is not None:
        from cnr.write.local_paths import check_writable_file

        check_writable_file(args.state, "--state")


def _subscribe(args: argparse.Namespace) -> int:
    from cnr.app.config import load_config
    from cnr.app.inference import InferenceModel
    from cnr.storage import open_storage
    from cnr.publish.subscriber import Subscriber

    _check_subscribe_args(args)
    config = load_config(args.config, args.set)
    model = InferenceModel(config, quantized=args.quantized or False)
    subscriber = Subscriber(open_storage(args.uri), model, args.state)
    try:
        try:
            if args.once:
                subscriber.poll()
            else:
                subscriber.follow(args.until_seq, args.timeout_s, args.poll_s)
        except KeyboardInterrupt:  # a follower is stopped by hand: report where it stands
            pass
        out = subscriber.summary()
        out["serving"] = {"bits": model.bits, "table_bytes": model.served_table_bytes(),
                          "fp32_table_bytes": model.fp32_table_bytes()}
        if args.eval and subscriber.applied is not None:
            out["eval"] = model.evaluate()
    finally:
        subscriber.close()
    print(json.dumps(out, sort_keys=True), flush=True)
    return 0


def _export(args: argparse.Namespace) -> int:
    from cnr.app.export import export_dcp

    print(json.dumps(export_dcp(args.uri, args.out, args.checkpoint, args.key), sort_keys=True), flush=True)
    return 0


def _bench(args: argparse.Namespace) -> int:
    package = "cnr.systest" if args.name in SYSTEM_TESTS else "cnr.bench"
    module = importlib.import_module(f"{package}.{args.name}")
    result = module.run(args.args)
    print(json.dumps(result, sort_keys=True), flush=True)
    return 1 if result.get("ok") is False else 0  # a run that could not measure says why in its JSON


def _version() -> str:
    """The installed distribution's version ("unknown" when cnr runs from a source tree not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cnr")
    except PackageNotFoundError:
        return "unknown"


def add_verbosity(parser: argparse.ArgumentParser, default: Any = argparse.SUPPRESS) -> None:
    """-q/-v on ``parser``: before the command or after it (a subcommand's default is SUPPRESS,
    so that it does not undo the top-level flag)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=QUIET, default=default,
                       help="warnings and errors only, no progress bars")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=VERBOSE, default=default,
                       help="debug messages too")


def add_json(parser: argparse.ArgumentParser, always: bool = True) -> None:
    """``--json`` on a command that reports (``always``: it prints its JSON object anyway)."""
    parser.add_argument("--json", action="store_true", help="last stdout line: one JSON object" +
                        (" (printed with or without this flag)" if always else " instead of a table"))


def add_command(sub: Any, name: str, summary: str, always_json: bool = True) -> argparse.ArgumentParser:
    """The subcommand ``name`` (``summary``: its help line), taking -q/-v and --json."""
    parser = sub.add_parser(name, help=summary)
    add_verbosity(parser)
    add_json(parser, always_json)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cnr", description="Check-N-Run checkpointing for torchrec; exit "
                                     "codes: 0 done, 1 a runtime failure, 2 a usage error (docs/cli.md)")
    parser.add_argument("--version", action="version", version=f"cnr {_version()}")
    add_verbosity(parser, NORMAL)
    sub = parser.add_subparsers(dest="command", required=True)
    t = add_command(sub, "train", "train a DLRM with Check-N-Run checkpoints; last stdout line is a JSON summary")
    t.add_argument("--config", required=True, help="YAML config file, e.g. configs/tiny.yaml")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (dotted path)")
    t.add_argument("--storage", default="./checkpoints", help="local path, file://PATH or s3://BUCKET/PREFIX")
    t.add_argument("--resume", action="store_true", help="restore the newest committed checkpoint first")
    t.add_argument("--new-history", action="store_true", help="start a new history of checkpoints where committed "
                   "ones are (they are kept: this job's retention never deletes them, and --resume later continues "
                   "the new history)")
    t.add_argument("--nproc", type=int, default=1, help="local ranks to spawn, at most one per GPU (CUDA) or twice "
                   "the usable CPU cores; they die with this launcher (ignored under torchrun)")
    t.set_defaults(func=_train)
    i = add_command(sub, "inspect", "list the checkpoints under a storage URI", always_json=False)
    i.add_argument("uri")
    i.add_argument("--tables", action="store_true", help="list the embedding tables of a checkpoint instead")
    i.add_argument("--checkpoint", default=None, metavar="ID", help="with --tables: this checkpoint (default: newest)")
    i.add_argument("--verify", action="store_true", help="read back and check every object of every committed "
                   "checkpoint; exit 1 when no chain restores")
    i.add_argument("--local-dir", default=None, metavar="DIR", help="the job's node-local tier "
                   "(checkpoint.local_dir): list its checkpoints too, with the tiers each is committed in")
    i.set_defaults(func=_inspect)
    r = add_command(sub, "report", "write report.md and PNG figures of the checkpoints under a storage URI; last "
                    "stdout line is a JSON object")
    r.add_argument("uri", help="local path, file://PATH or s3://BUCKET/PREFIX")
    r.add_argument("--out", default="cnr-report", help="directory for report.md and the PNGs (created if missing)")
    r.set_defaults(func=_report)
    s = add_command(sub, "subscribe", "apply publishes from a publish store to an inference model; last stdout "
                    "line is a JSON object")
    s.add_argument("uri", help="the publish store: local path, file://PATH or s3://BUCKET/PREFIX")
    s.add_argument("--config", required=True, help="the trainer's YAML config (tables and dense shape)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    s.add_argument("--state", default=None, help="file keeping the applied publish and its tensors across restarts")
    s.add_argument("--once", action="store_true", help="apply what is committed now and exit")
    s.add_argument("--until-seq", type=int, default=None, help="stop once this sequence number is applied")
    s.add_argument("--timeout-s", type=float, default=0.0, help="stop following after this many seconds (0: never)")
    s.add_argument("--poll-s", type=float, default=1.0, help="seconds between polls")
    s.add_argument("--quantized", nargs="?", const="int8", choices=("int8", "int4"), default=None,
                   help="serve from torchrec's quantized inference EBC, int8 (alone) or int4, instead of fp32 tables")
    s.add_argument("--eval", action="store_true", help="report eval logloss/AUC of the served model at the end")
    s.set_defaults(func=_subscribe)
    e = add_command(sub, "export", "write a committed checkpoint's modules in another format; last stdout line "
                    "is a JSON object")
    e.add_argument("uri", help="local path, file://PATH or s3://BUCKET/PREFIX")
    e.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="dcp: a torch.distributed.checkpoint directory")
    e.add_argument("out", help="new directory to write (must be missing or empty)")
    e.add_argument("--checkpoint", default=None, metavar="ID", help="checkpoint id (default: the newest committed)")
    e.add_argument("--key", action="append", default=None, metavar="KEY",
                   help="app_state key of a module to export (repeatable; default: every module)")
    e.set_defaults(func=_export)
    from cnr.app.compact import add_parser as add_compact  # cnr/app/compact.py

    add_compact(sub, add_command)
    # -q/-v/--json go before NAME: what follows it is the benchmark's own
    b = add_command(sub, "bench", "run a benchmark; last stdout line is a JSON object")
    b.add_argument("name", choices=BENCHMARKS)
    b.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    b.set_defaults(func=_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line ``argv``; its exit code (cnr.app.console; argparse exits 2 itself)."""
    args = build_parser().parse_args(argv)
    ours = not logging.getLogger().handlers  # else a host (pytest, an embedding program) set logging up
    if ours:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    set_verbosity(args.verbosity, ours or args.verbosity != NORMAL)
    redact_logging()
    try:
        return args.func(args)
    except CnrError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return exit_code(e)
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT); the job was stopped, its committed checkpoints are intact", file=sys.stderr)
        return EXIT_INTERRUPTED
