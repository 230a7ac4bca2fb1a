"""``python -m cnr bench scale``: cnr's control plane at N simulated ranks against S3's costs.

No model and no tensor data: N threads act as N ranks' writers and write the rank indexes and
object stubs of a production-shaped job (cnr.testing.synthetic_state), against a store that answers as
S3 does (cnr.bench.scale_store: per-request latency, per-prefix request limits, ``SlowDown`` and
cnr's retries). Everything else is cnr's own code, run as a job runs it:

1. rank 0 takes the job's lease (cnr.write.lease) and renews it once per checkpoint;
2. per checkpoint (``--checkpoints``, full fp32 ones), every rank stores its objects and then its
   rank index, as a writer does (cnr.write.writer: objects, then ``storage.commit`` of the index);
   meanwhile rank 0's writer runs the commit (cnr.write.commit.commit_checkpoint: wait for every
   rank's index summary on the writers' exchange, join them, manifest under the lease fence);
3. retention (cnr.policy.retention) after the last commit, ``keep_last`` 1, with every checkpoint
   counted as verifying; what verifying one checkpoint reads is counted from its objects: each
   writer reads back its own objects and index (cnr.write.writer), rank 0 the manifest;
4. one rank's restore planning: rank 0's listing (cnr.format.catalog.restore_ids), then on a middle
   rank what cnr.restore.newest reads (the manifest as stored, the chain, the rank indexes its
   pieces overlap and rank 0's, its share of the rank index check) and the plan of which chunks
   land in its pieces (cnr.restore.pieces.plan_restore): its table shards and the whole dense part;
   then what a middle rank of the job restarted at half the world size reads (``resized_*``).

Figures per N: commit latency (last rank's index stored -> manifest committed), requests by
rank 0 and by an average other rank per checkpoint, ``SlowDown`` answers, metadata bytes a rank
reads to restore and its planning seconds, retention's requests; DCP's metadata bytes and planning
seconds for the same state (cnr.bench.scale_dcp) and cnr's figures over DCP's (``OVER_DCP``);
then each figure's growth exponent against N (the slope of log figure over log N between the
smallest and largest N).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from cnr.bench.common import number_arg
from cnr.bench.scale_dcp import dcp_figures
from cnr.testing.synthetic_state import (
    DENSE_COLS, DIM, ScaleShape, dense_name, objects_of, rank_indexes, shard_tables, state_name, table_name, table_rows, table_specs,
)
from cnr.bench.scale_store import SimulatedS3
from cnr.testing.memory_storage import MemoryStorage
from cnr.errors import ConfigError
from cnr.format.catalog import restore_ids
from cnr.format.layout import make_id, rank_index_key
from cnr.format.manifest import rank_index_to_bytes, read_head
from cnr.format.split import summarize, summary_to_bytes
from cnr.policy.retention import retain_after_commit
from cnr.policy.retention_plan import plan_with
from cnr.restore.newest import _read_chain, _spans_of
from cnr.restore.pieces import plan_restore
from cnr.track.state import StatePiece
from cnr.types import CheckpointKind, RetentionScope, Role, ShardRegion
from cnr.write.commit import commit_checkpoint
from cnr.write.job import WriteJob
from cnr.write.lease import Lease
from cnr.write.peer_exchange import PeerExchange, host_exchange

logger = logging.getLogger(__name__)

DEFAULT_RANKS = (8, 64, 512, 4096)
MAX_RANKS = 16384
_STUB = b"\0" * 16  # an object's bytes: the figures are requests, not bytes moved
_COMMIT_TIMEOUT_S = 3600.0
_STACK_BYTES = 256 * 1024  # per simulated rank's thread: thousands of them


@dataclass
class CheckpointRun:
    """One checkpoint of the simulated job: when each rank's index was stored and the commit."""

    ckpt_id: str
    index_stored: List[float]
    committed: float
    objects_per_rank: float  # objects each rank stored, mean over ranks
    commit_error: Optional[BaseException] = None

    @property
    def commit_latency_s(self) -> float:
        return self.committed - max(self.index_stored)


class Exchange:
    """The writers' exchange of the simulated job (cnr.write.peer_exchange): a real TCPStore, and a
    few clients the simulated writers share (a client serves one request at a time)."""

    CLIENTS = 16

    def __init__(self, ranks: int) -> None:
        self.server, self.address = host_exchange(0, 1)
        self.address = type(self.address)(self.address.host, self.address.port, ranks)
        self.clients = [PeerExchange(self.address) for _ in range(self.CLIENTS)]
        self.locks = [threading.Lock() for _ in self.clients]
        self.rank0 = PeerExchange(self.address)  # rank 0's writer's own

    def publish_stored(self, ckpt_id: str, rank: int, blob: bytes) -> None:
        i = rank % len(self.clients)
        with self.locks[i]:
            self.clients[i].publish_stored(ckpt_id, rank, blob)


def _write_rank(store: SimulatedS3, blobs: Tuple[bytes, bytes], objects: Sequence[str], rank: int, ckpt_id: str,
                stored: List[float], exchange: Optional[Exchange]) -> None:
    """Rank ``rank``'s writer: its objects, then its index (a commit object, as cnr.write.writer
    stores it), then counted in on the exchange with the index's summary. ``blobs``: (the index,
    its summary)."""
    with store.acting_as(rank):
        for key in objects:
            store.put(key, _STUB)
        store.commit(rank_index_key(ckpt_id, rank), blobs[0])
    stored[rank] = time.monotonic()
    if exchange is not None:
        exchange.publish_stored(ckpt_id, rank, blobs[1])


def _run_checkpoint(store: SimulatedS3, shape: ScaleShape, ranks: int, step: int, lease: Lease,
                    exchange: Optional[Exchange]) -> CheckpointRun:
    """One full checkpoint: every rank writes, rank 0's writer commits (see the module docstring)."""
    ckpt_id = make_id(step, f"{step:08x}")
    indexes = rank_indexes(shape, ranks, ckpt_id)
    blobs = [(blob, summary_to_bytes(summarize(i, blob))) for i, blob in ((i, rank_index_to_bytes(i)) for i in indexes)]
    objects = [objects_of(i) for i in indexes]
    job = WriteJob(ckpt_id, step, CheckpointKind.FULL, None, 0, ranks, [],
                   manifest_fields={"tables": table_specs(shape, ranks), "counters": {}, "metadata": {}},
                   app=indexes[0].app, lease=lease.ref, retention=RetentionScope())
    stored = [math.inf] * ranks
    run = CheckpointRun(ckpt_id, stored, math.inf, sum(map(len, objects)) / ranks)

    def commit() -> None:
        with store.acting_as(0):
            try:
                commit_checkpoint(store, job, _COMMIT_TIMEOUT_S, exchange=exchange.rank0 if exchange else None)
                run.committed = time.monotonic()  # the manifest is committed; the exchange's clean-up is after
                if exchange is not None:
                    exchange.rank0.forget_indexes(ckpt_id)
            except BaseException as e:  # noqa: BLE001 - reported in the figures
                run.commit_error = e

    threads = [threading.Thread(target=commit, name="cnr-scale-commit")]
    threads += [threading.Thread(target=_write_rank, args=(store, blobs[r], objects[r], r, ckpt_id, stored, exchange),
                                 name=f"cnr-scale-rank-{r}") for r in range(ranks)]
    # The other ranks' state lives in their own processes in a job; here it shares rank 0's heap,
    # where each full collection would scan it (0.5 s at 4,096 ranks, several per checkpoint, hitting
    # rank 0's commit at random). Frozen, as cnr.app.heap freezes a trainer's: the collections scan
    # only what the checkpoint allocates.
    gc.collect()
    gc.freeze()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.unfreeze()
    if run.commit_error is not None:
        raise RuntimeError(f"the commit of {ckpt_id} at {ranks} ranks failed: {run.commit_error}")
    return run


def _rank_pieces(shape: ScaleShape, ranks: int, rank: int) -> List[StatePiece]:
    """The pieces ``rank`` restores into under the same plan, as meta tensors: its table shards,
    and every dense tensor whole (replicated: every rank holds it)."""
    rows = table_rows(shape)
    pieces = [StatePiece(dense_name(d), (shape.dense_rows, DENSE_COLS), ShardRegion((0, 0), (shape.dense_rows, DENSE_COLS)),
                         torch.empty((shape.dense_rows, DENSE_COLS), dtype=torch.float32, device="meta"), True,
                         Role.DENSE, None) for d in range(shape.dense_tensors)]
    for s in shard_tables(shape, ranks):
        if s.rank != rank:
            continue
        for name, cols, role in ((table_name(s.table), DIM, Role.TABLE_ROWS), (state_name(s.table), 0, Role.TABLE_STATE)):
            global_shape = (rows[s.table], cols) if cols else (rows[s.table],)
            region = ShardRegion((s.row_start, 0) if cols else (s.row_start,), (s.rows, cols) if cols else (s.rows,))
            tensor = torch.empty(region.sizes, dtype=torch.float32, device="meta")
            pieces.append(StatePiece(name, global_shape, region, tensor, False, role, table_name(s.table)))
    return pieces


def _restore_plan(store: SimulatedS3, shape: ScaleShape, ranks: int, rank: int) -> Dict[str, float]:
    """Rank 0's part of a restore (the listing of what to restore), then ``rank``'s: the manifest,
    the chain, its share of the rank index check (cnr.restore.newest) and its plan."""
    start = time.monotonic()
    with store.acting_as(0):
        newest = restore_ids(store)[0]
    rank0_s = time.monotonic() - start
    pieces = _rank_pieces(shape, ranks, rank)
    start = time.monotonic()
    with store.acting_as(rank, alone=True):
        _manifest, chain = _read_chain(store, newest, rank, ranks, frozenset(), (), _spans_of(pieces))
        plan = plan_restore(chain[0], pieces)
    plan_s = time.monotonic() - start
    counts = store.counts[rank]
    figures = {"restore_plan_s": plan_s, "restore_rank0_s": rank0_s, "restore_metadata_bytes_per_rank": counts.document_bytes,
               "restore_requests_per_rank": counts.requests, "restore_requests_rank0": store.counts[0].requests,
               "restore_objects_per_rank": len(plan.objects)}
    figures.update(_resized_restore_plan(store, shape, newest, ranks))
    return figures


def _resized_restore_plan(store: SimulatedS3, shape: ScaleShape, newest: str, ranks: int) -> Dict[str, float]:
    """What a middle rank of a job restarted at half the world size reads and plans (the job
    lost nodes): before format version 8, every rank's index, to compare their app states."""
    if ranks < 2:
        return {}
    world, rank = ranks // 2, ranks // 4
    pieces = _rank_pieces(shape, world, rank)
    before = dataclasses.replace(store.counts[rank])
    start = time.monotonic()
    with store.acting_as(rank, alone=True):
        _read_chain(store, newest, rank, world, frozenset(), (), _spans_of(pieces))
    plan_s = time.monotonic() - start
    counts = store.counts[rank]
    return {"resized_restore_plan_s": plan_s,
            "resized_restore_requests_per_rank": counts.requests - before.requests,
            "resized_restore_metadata_bytes_per_rank": counts.document_bytes - before.document_bytes}


def _retention(store: SimulatedS3, ckpt_ids: List[str], objects: int) -> Dict[str, float]:
    """Retention after the last commit, every checkpoint counted as verifying; and what verifying
    one checkpoint reads, counted (the stubs do not decode, so running it would count the re-reads
    of damage instead): each writer reads back each of its objects and its index once (``objects``
    of the job, one GET each), rank 0 the manifest too (cnr.policy.retention.note_verified); before
    issue #39 rank 0 read every one of them."""
    store.reset_counts()
    start = time.monotonic()
    with store.acting_as(0):
        report = retain_after_commit(store, lambda infos: plan_with(infos, 1, RetentionScope(),
                                                                  lambda ids: {i: True for i in ids}), "checkpoint")
    seconds = time.monotonic() - start
    manifest = read_head(store, ckpt_ids[-1])
    return {"retention_requests": store.counts[0].requests, "retention_s": seconds,
            "retention_deleted": len(report.get("deleted", [])),
            "verify_requests_rank0": 1 + objects // manifest.world_size + 1,
            "verify_requests_per_rank": objects / manifest.world_size + 1,
            "verify_bytes_per_rank": manifest.bytes // manifest.world_size}


def measure(ranks: int, shape: ScaleShape, latency_s: float, checkpoints: int, exchange: bool = True) -> Dict[str, Any]:
    """Every figure of one N (see the module docstring); ``exchange``: whether the writers have
    their exchange (every job of more than one rank has it; without: the commit polls the store)."""
    store = SimulatedS3(MemoryStorage(), latency_s)
    peers = Exchange(ranks) if exchange else None
    with store.acting_as(0):
        lease = Lease.acquire(store)
    runs = []
    for n in range(checkpoints):
        store.reset_counts()
        with store.acting_as(0):
            lease.renew()
        runs.append(_run_checkpoint(store, shape, ranks, 100 * (n + 1), lease, peers))
        others = [store.counts[r].requests for r in range(1, ranks)] or [0]
        figures = {"commit_latency_s": runs[-1].commit_latency_s, "requests_rank0": store.counts[0].requests,
                   "requests_per_rank": sum(others) / len(others), "slowdown": store.total_slowdowns(),
                   "chunks_per_rank": runs[-1].objects_per_rank}
    store.reset_counts()
    figures.update(_restore_plan(store, shape, ranks, ranks // 2))
    figures["slowdown"] += store.total_slowdowns()
    figures.update(_retention(store, [r.ckpt_id for r in runs], round(runs[-1].objects_per_rank * ranks)))
    figures["commit_latency_s_each"] = [round(r.commit_latency_s, 3) for r in runs]
    figures.update(_dcp(shape, ranks))
    figures.update(over_dcp(figures))
    return figures


def _dcp(shape: ScaleShape, ranks: int) -> Dict[str, float]:
    """DCP's figures for the same state (cnr.bench.scale_dcp: its planners, data-less shards)."""
    return dict(vars(dcp_figures(shape, ranks)))


OVER_DCP = {  # cnr's figure over DCP's: the metadata a rank reads to restore, and planning
    "restore_metadata_over_dcp": ("restore_metadata_bytes_per_rank", "dcp_metadata_bytes_per_rank"),
    "restore_plan_over_dcp": ("restore_plan_s", "dcp_load_plan_s"),
    "commit_latency_over_dcp_save_plan": ("commit_latency_s", "dcp_save_plan_s"),
}


def over_dcp(figures: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """``OVER_DCP``'s ratios of one N's figures (None where DCP's is 0)."""
    return {name: (round(figures[ours] / figures[theirs], 2) if figures.get(theirs) else None)
            for name, (ours, theirs) in OVER_DCP.items() if ours in figures and theirs in figures}


def growth(figures: Dict[int, Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """Per figure, the exponent k of figure ~ N**k between the smallest and the largest N (None
    when either value is not positive)."""
    ns = sorted(figures)
    if len(ns) < 2:
        return {}
    lo, hi = ns[0], ns[-1]
    out: Dict[str, Optional[float]] = {}
    for name, value in figures[hi].items():
        first = figures[lo].get(name)
        if isinstance(value, (int, float)) and isinstance(first, (int, float)) and not isinstance(value, bool):
            out[name] = round(math.log(value / first) / math.log(hi / lo), 2) if value > 0 and first > 0 else None
    return out


def _ranks_arg(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 2 or v > MAX_RANKS for v in values):
        raise ConfigError(f"--ranks {text!r} is not allowed: give comma-separated integers from 2 to {MAX_RANKS}")
    return sorted(set(values))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cnr bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=_ranks_arg, default=list(DEFAULT_RANKS), help="comma-separated world sizes")
    p.add_argument("--latency-ms", type=number_arg("--latency-ms", 0.0, 10_000.0, low_in=True), default=30.0,
                   help="milliseconds every request takes")
    p.add_argument("--checkpoints", type=int, choices=range(2, 11), default=3, metavar="{2..10}",
                   help="full checkpoints written per N")
    p.add_argument("--tables", type=int, default=ScaleShape.tables, help="embedding tables of the job")
    p.add_argument("--chunks-per-rank", type=int, default=ScaleShape.chunks_per_rank, help="objects per rank")
    return p


def run(argv: Sequence[str]) -> Dict[str, Any]:
    args = _parser().parse_args(list(argv))
    try:
        shape = ScaleShape(tables=args.tables, chunks_per_rank=args.chunks_per_rank)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    logging.getLogger("cnr.storage.s3").setLevel(logging.ERROR)  # one warning per SlowDown retried
    threading.stack_size(_STACK_BYTES)
    per_n: Dict[int, Dict[str, Any]] = {}
    for n in args.ranks:
        start = time.monotonic()
        per_n[n] = measure(n, shape, args.latency_ms / 1000.0, args.checkpoints)
        per_n[n]["bench_s"] = round(time.monotonic() - start, 1)
        print(f"N={n}: " + ", ".join(f"{k} {_shown(v)}" for k, v in per_n[n].items()), flush=True)
    exponents = growth(per_n)
    print("growth exponents: " + ", ".join(f"{k} {v}" for k, v in exponents.items()), flush=True)
    return {"bench": "scale", "latency_ms": args.latency_ms, "tables": shape.tables,
            "embedding_bytes": shape.embedding_bytes, "ranks": {str(n): f for n, f in per_n.items()},
            "growth": exponents}


def _shown(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
