"""``python -m cnr bench codecs``: the zstd level table, measured on the chunks of real checkpoints.

``cnr train`` (world size 1) runs ``--config`` (default configs/bench.yaml) for two checkpoint
intervals with the consecutive policy at ``--bits``, 8-bit optimizer state and no compression:
a full checkpoint, then an increment of the rows touched in the second interval. Every chunk's
stored payload (row ids, packed codes, scales and biases, log8 codes or raw values, exactly as
cnr.codec.chunk_format lays them out) is then compressed at each ``--levels`` and decompressed again, in
this process, on one thread. Per level and per chunk kind (full or incremental x encoding):
payload bytes, zstd bytes, ``ratio`` (payload / zstd) and encode / decode MB/s of payload.

The headline (``chosen_level``) is the level with the best total ratio among those that encode
at least ``--min-encode-mb-s`` (default 200 MB/s of payload on one core: a 16 MiB chunk in
under 0.1 s, so the writer's encoding stays far below its uploads): what
``checkpoint.compression_level`` defaults to (cnr.codec.zstd.DEFAULT_LEVEL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import zstandard

from cnr.bench.common import ROOT, argv_list, base_parser, number_arg
from cnr.codec.chunk_format import decode_chunk, stored_payload
from cnr.errors import CnrError, ConfigError
from cnr.format.catalog import newest_committed, resolve_chain
from cnr.storage import open_storage
from cnr.types import ByteRange

LEVELS = (1, 3, 6, 9, 19)


def _parse(argv: List[str]):
    p = base_parser("zstd level table on the chunks of a full checkpoint and an increment")
    p.add_argument("--bits", type=int, default=2, choices=(2, 3, 4, 8), help="embedding bit-width")
    p.add_argument("--interval", type=int, default=100, help="steps per checkpoint interval")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="comma-separated zstd levels (1..19)")
    p.add_argument("--min-encode-mb-s", type=number_arg("--min-encode-mb-s", 0.0, low_in=True), default=200.0,
                   help="the chosen level encodes at least this many MB/s of payload")
    args = p.parse_args(argv_list(argv))
    try:
        args.levels = [int(v) for v in args.levels.split(",")]
    except ValueError:
        raise ConfigError(f"--levels {args.levels!r} must be comma-separated integers in 1..19") from None
    if not args.levels or any(not 1 <= v <= 19 for v in args.levels):
        raise ConfigError(f"--levels {args.levels!r} is not allowed; each must be in 1..19")
    if args.interval < 1:
        raise ConfigError(f"--interval {args.interval} is not allowed; it must be >= 1")
    return args


def _write_chain(args, workdir: str) -> str:
    """Train two intervals with ``cnr train``; return the storage directory of the chain."""
    store = os.path.join(workdir, "store")
    cmd = [sys.executable, "-m", "cnr", "train", "--config", os.path.abspath(args.config), "--storage", store,
           "--set", f"train.steps={2 * args.interval}", "--set", f"checkpoint.interval={args.interval}",
           "--set", "checkpoint.policy=consecutive", "--set", f"checkpoint.bits={args.bits}",
           "--set", "checkpoint.optimizer_bits=8", "--set", "checkpoint.compression=none",
           "--set", "checkpoint.keep_last=0", "--set", "checkpoint.compact_at_chain_ratio=0",  # the writer's chunks
           "--set", "publish.enabled=false"]
    for extra in args.set:
        cmd += ["--set", extra]
    done = subprocess.run(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        raise CnrError(f"cnr train for the chain failed (exit {done.returncode}): {lines[-1] if lines else ''}")
    return store


def _payloads(store: str) -> List[Tuple[str, bytes]]:
    """(kind, payload) of every chunk of the newest chain: kind is "full/<encoding>" or
    "incremental/<encoding>"; each chunk is decoded (verified) before its payload is taken."""
    storage = open_storage(store)
    out = []
    for manifest in resolve_chain(storage, newest_committed(storage)):
        for entry in manifest.tensors.values():
            for ref in entry.chunks:
                blob = storage.get(ref.key, ByteRange(ref.offset, ref.nbytes))
                decode_chunk(blob, ref, dequantize=False)  # verified: a real chunk of this kind
                out.append((f"{manifest.kind.value}/{ref.encoding.value}", bytes(stored_payload(blob))))
    return out


def _measure(payloads: List[Tuple[str, bytes]], level: int) -> Dict[str, Dict[str, float]]:
    """Per kind and in total: payload and zstd bytes, encode and decode seconds."""
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    decompressor = zstandard.ZstdDecompressor()
    sums: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for kind, payload in payloads:
        t0 = time.perf_counter()
        frame = compressor.compress(payload)
        t1 = time.perf_counter()
        back = decompressor.decompress(frame)
        t2 = time.perf_counter()
        if back != payload:
            raise AssertionError(f"zstd level {level} did not round-trip a {kind} payload")
        for name in (kind, "total"):
            s = sums[name]
            s["payload_bytes"] += len(payload)
            s["zstd_bytes"] += len(frame)
            s["encode_s"] += t1 - t0
            s["decode_s"] += t2 - t1
    return {name: _rates(s) for name, s in sums.items()}


def _rates(s: Dict[str, float]) -> Dict[str, float]:
    mb = s["payload_bytes"] / 1e6
    return {"payload_mb": round(mb, 3), "zstd_mb": round(s["zstd_bytes"] / 1e6, 3),
            "ratio": round(s["payload_bytes"] / s["zstd_bytes"], 4),
            "encode_mb_s": round(mb / s["encode_s"], 1), "decode_mb_s": round(mb / s["decode_s"], 1)}


def run(argv: List[str]) -> Dict[str, Any]:
    args = _parse(argv)
    with tempfile.TemporaryDirectory(prefix="cnr-codecs-", dir=args.workdir) as workdir:
        started = time.perf_counter()
        payloads = _payloads(_write_chain(args, workdir))
        train_s = time.perf_counter() - started
        table = {level: _measure(payloads, level) for level in args.levels}
    fast = [lv for lv in args.levels if table[lv]["total"]["encode_mb_s"] >= args.min_encode_mb_s]
    chosen = max(fast, key=lambda lv: table[lv]["total"]["ratio"]) if fast else None
    return {"config": {"config": args.config, "bits": args.bits, "interval": args.interval, "levels": args.levels,
                       "chunks": len(payloads), "train_and_write_s": round(train_s, 1)},
            "levels": {str(lv): t for lv, t in table.items()},
            "min_encode_mb_s": args.min_encode_mb_s, "chosen_level": chosen,
            "chosen_ratio": table[chosen]["total"]["ratio"] if fast else None,
            "chosen_encode_mb_s": table[chosen]["total"]["encode_mb_s"] if fast else None}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:]), sort_keys=True))
