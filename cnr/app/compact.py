"""``python -m cnr compact URI``: merge a consecutive chain into a new baseline from a separate process.

The choice for a job whose nodes have no spare CPU or uplink (``checkpoint.compaction: external``):
run this on another machine against the same store, e.g. every few minutes. It merges the chain
of the newest committed checkpoint (or ``--checkpoint ID``) the way the job's own merge would, and
shares the location with the job without losing either's work (cnr.write.compact: claims, the
lease). Its last stdout line is one JSON object (``merged``: the merged baseline's id, null when
there was nothing to do; ``bytes_read`` and ``bytes_written``: what the merge moved).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Callable, Dict

from cnr.app.console import moving
from cnr.errors import ConfigError
from cnr.options import MAX_CHUNK_BYTES, MAX_KEEP_LAST, MAX_THREADS, CheckpointOptions, shown
from cnr.format.manifest import ROOT, is_checkpoint_id
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.storage.local import LocalStorage
from cnr.write.compact import MergeSettings, compact_location


def add_parser(sub: Any, command: Callable[[Any, str, str], argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``compact`` on the subcommands ``sub`` with ``command(sub, name, help)`` (the CLI's
    cnr.app.cli.add_command: the options every command takes)."""
    defaults = CheckpointOptions()
    c = command(sub, "compact", "merge a consecutive chain into a new baseline from a separate process "
                "(for jobs with checkpoint.compaction: external); last stdout line is a JSON object")
    c.add_argument("uri", help="the job's storage: local path, file://PATH or s3://BUCKET/PREFIX")
    c.add_argument("--checkpoint", default=None, metavar="ID", help="the committed increment whose chain to merge "
                   "(default: the newest committed checkpoint)")
    c.add_argument("--min-chain-ratio", type=float, default=0.0, metavar="R", help="merge only when the chain's "
                   "increments store at least R times its baseline's bytes (default 0: any chain of 2+ links)")
    c.add_argument("--keep-last", type=int, default=defaults.keep_last, metavar="N", help="the retention after the "
                   "merge, when no job holds the location: keep N chains (give the job's checkpoint.keep_last; "
                   f"0 deletes nothing; at most {MAX_KEEP_LAST}; default {defaults.keep_last})")
    c.add_argument("--chunk-bytes", type=int, default=defaults.chunk_bytes, metavar="B",
                   help=f"largest stored chunk (4096 to {MAX_CHUNK_BYTES}; default {defaults.chunk_bytes})")
    c.add_argument("--threads", type=int, default=defaults.upload_threads, metavar="N", help="concurrent puts")
    c.add_argument("--lease-ttl-s", type=float, default=defaults.lease_ttl_s, metavar="S", help="ttl of the "
                   "location's lease taken while no job holds it, and of the merge's claim (1 to 86400)")
    c.set_defaults(func=run)
    return c


def check_args(args: argparse.Namespace) -> None:
    """Refuse a bad argument (ConfigError naming it, its value and what is allowed) before any work."""
    def need(ok: bool, flag: str, value: Any, allowed: str) -> None:
        if not ok:
            raise ConfigError(f"compact {flag} {shown(value)} is not allowed; {allowed}")

    need(math.isfinite(args.min_chain_ratio) and args.min_chain_ratio >= 0, "--min-chain-ratio", args.min_chain_ratio,
         "it must be a number >= 0")
    need(0 <= args.keep_last <= MAX_KEEP_LAST, "--keep-last", args.keep_last,
         f"it must be from 0 to {MAX_KEEP_LAST} (0 deletes nothing)")
    need(4096 <= args.chunk_bytes <= MAX_CHUNK_BYTES, "--chunk-bytes", args.chunk_bytes,
         f"it must be from 4096 to {MAX_CHUNK_BYTES}")
    need(1 <= args.threads <= MAX_THREADS, "--threads", args.threads, f"allowed: 1..{MAX_THREADS}")
    need(math.isfinite(args.lease_ttl_s) and 1.0 <= args.lease_ttl_s <= 86400.0, "--lease-ttl-s", args.lease_ttl_s,
         "it must be from 1 to 86400 seconds")
    need(args.checkpoint is None or is_checkpoint_id(args.checkpoint, merged=True), "--checkpoint", args.checkpoint,
         "give a checkpoint id as `cnr inspect` lists it (<step>-<nonce>, maybe with .merged)")


def check_location(storage: Storage) -> None:
    """Refuse a local location that is no directory, or that is a location's ``checkpoints/``
    folder (ConfigError): a compactor run from cron would otherwise find nothing to merge there
    forever, without a word. An S3 prefix holding nothing is a job that has not committed yet."""
    if not isinstance(storage, LocalStorage):
        return
    root = storage.root
    if not os.path.isdir(root):
        raise ConfigError(f"compact {storage.uri}: {'no such directory' if not os.path.exists(root) else 'not a directory'}; "
                          "give the job's storage location (its --storage)")
    if os.path.basename(os.path.normpath(root)) == ROOT and any(is_checkpoint_id(n, merged=True) for n in os.listdir(root)):
        raise ConfigError(f"compact {storage.uri} is the checkpoints folder of a location; give the location "
                          f"itself: {os.path.dirname(os.path.normpath(root))}")


def compact(args: argparse.Namespace) -> Dict[str, Any]:
    """Check the arguments, then compact (cnr.write.compact.compact_location); the JSON summary."""
    check_args(args)
    settings = MergeSettings(args.chunk_bytes, args.threads, args.keep_last, CheckpointOptions().compression_chain(),
                             args.lease_ttl_s)
    storage = open_storage(args.uri)
    try:
        check_location(storage)
        with moving(storage, "compact") as moved:  # a bar of the bytes the merge reads and writes
            return compact_location(moved, args.checkpoint, settings, args.min_chain_ratio, args.lease_ttl_s)
    finally:
        storage.close()


def run(args: argparse.Namespace) -> int:
    import json

    print(json.dumps(compact(args), sort_keys=True), flush=True)
    return 0
