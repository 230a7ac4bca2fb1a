"""Compaction: merging a consecutive chain into a new baseline, by the job or by another process.

A merge (cnr.write.merge) runs in one of two places, and the same ``merge_and_retain`` does the work
in both:

- **the job's merge worker** (``Merger``): rank 0 of a job with ``checkpoint.compaction: job``
  hands a committed increment to a long-lived worker process, started lazily from a thread, so
  neither the spawn nor the merge touches the training thread. One merge at a time. It commits
  and runs retention only while the job's lease is held (``check_held`` on the job's LeaseRef,
  right before the manifest and again right before retention).
- **``python -m cnr compact URI``** (``compact_location``), on any machine that reaches the store,
  for a job with ``checkpoint.compaction: external``. When no job holds the location's lease it
  takes the lease for the duration (a job starting meanwhile is refused rather than racing it),
  merges, and runs retention. While a live job holds it, it merges and commits the merged
  baseline but deletes nothing: the job's own retention drops the superseded chain at its next
  commit (a committed merged baseline ends every chain through its increment).

**Claims.** Two processes never write one merged id at once: a merge first takes the claim
``compact/<merged id>/<generation>.json``, a lease (cnr.write.lease) in a space of its own: the
same conditional-write probe (a store that ignores If-None-Match is refused, as for the job's
lease), the same conditional create and takeover rules. A claim is live while renewed within its ttl (every ttl/4
by a thread) and, on the machine that took it, while its process runs, so a killed merge's claim
is taken over at once there and ``ttl_s`` later elsewhere; the merge checks its claim is still the
newest right before it commits. Claims are deleted when their merge ends.

**Kill safety.** The merged baseline's manifest is written last and only after every chunk is
stored, so a merge killed at any point leaves nothing a restore resolves; the chain it replaces is
deleted only by a retention after the commit. A re-run merges again (or finds the merge committed).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from cnr.errors import KeyNotFoundError
from cnr.format.catalog import newest_committed, read_manifest, resolve_chain
from cnr.format.layout import CLAIM_PREFIX, MERGED_SUFFIX, merged_id
from cnr.policy.retention import retain_checkpoints
from cnr.storage import open_storage
from cnr.storage.base import Buffer, Storage
from cnr.storage.wrapper import WrapperStorage
from cnr.types import ByteRange, LeaseRef, RetentionScope
from cnr.write.faults import maybe_crash
from cnr.write.lease import Lease, LeaseHeldError, LeaseSpace, check_held
from cnr.write.merge import merge_chain
from cnr.write.proc import MERGER, die_with_spawner, name_this_process

logger = logging.getLogger(__name__)

DEFAULT_CLAIM_TTL_S = 60.0


class ClaimHeldError(LeaseHeldError):
    """Another live process is merging the same checkpoint."""


def claim_space(merged: str) -> LeaseSpace:
    """The lease space of the claims on merging into ``merged`` (``compact/<merged>/``)."""
    quoted = merged.replace("{", "{{").replace("}", "}}")  # the words are format strings of {uri}
    return LeaseSpace(f"{CLAIM_PREFIX}/{merged}", what=f"the merge claim on {merged}",
                      holder_does=f"another process is merging into {quoted} on {{uri}}",
                      advice="Its claim ends with its merge, or ttl after its last renewal if it died on another "
                             "machine; compact again then",
                      me="this merge", held_error=ClaimHeldError)


def claim_key(merged: str, generation: int) -> str:
    """The key of the claim record ``generation`` on ``merged``."""
    return claim_space(merged).key(generation)


def take_claim(storage: Storage, merged: str, ttl_s: float = DEFAULT_CLAIM_TTL_S) -> Lease:
    """This process's claim on merging into ``merged``, renewed by a thread from now on (the job
    lease's protocol in the claim's own space, cnr.write.lease: a conditional-write probe first,
    damaged and unknown records handled as the lease does); raises ClaimHeldError naming a live
    holder. Release it with ``release(delete=True)``."""
    claim = Lease.acquire(storage, ttl_s, space=claim_space(merged))
    claim.start_renewing()
    return claim


class CountingStorage(WrapperStorage):
    """``inner``, counting the bytes read (``read``) and written (``written``) through it."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.read = 0
        self.written = 0

    def _count(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.read += read
            self.written += written

    def get(self, key: str, byte_range: Optional[ByteRange] = None, *, limit: Optional[int] = None) -> bytes:
        data = self.inner.get(key, byte_range, limit=limit)
        self._count(read=len(data))
        return data

    def put(self, key: str, data: Buffer) -> None:
        self.inner.put(key, data)
        self._count(written=memoryview(data).nbytes)

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        done = self.inner.put_if_absent(key, data)
        self._count(written=memoryview(data).nbytes if done else 0)
        return done

    def commit(self, key: str, data: Buffer, requires: Sequence[str] = ()) -> None:
        self.inner.commit(key, data, requires)
        self._count(written=memoryview(data).nbytes)


@dataclass(frozen=True)
class MergeSettings:
    """How a merge stores its chunks (as the job's writer: ``chunk_bytes``, ``threads`` concurrent
    puts, ``compression``), the ``keep_last`` of the retention after it (0: none), and its claim's
    ``claim_ttl_s`` (seconds)."""

    chunk_bytes: int
    threads: int = 2
    keep_last: int = 2
    compression: Tuple[Any, ...] = ()
    claim_ttl_s: float = DEFAULT_CLAIM_TTL_S


def merge_and_retain(storage: Storage, ckpt_id: str, settings: MergeSettings, fence: Callable[[], None],
                     retain: bool, scope: Optional[RetentionScope] = None) -> Dict[str, Any]:
    """Claim, merge and commit ``ckpt_id``'s chain, then (``retain``) run retention; ``fence`` raises
    when this process may no longer commit or delete (the lease), and is called right before the
    manifest and right before retention. Returns a JSON-able report with the bytes moved; raises
    CheckpointError (ClaimHeldError, the fence's) with nothing committed. Fault point
    ``merge_after_commit``: after the commit, before retention."""
    counting = CountingStorage(storage)
    start = time.perf_counter()
    claim = take_claim(storage, merged_id(ckpt_id), settings.claim_ttl_s)
    try:
        merged, fresh = merge_chain(counting, ckpt_id, settings.chunk_bytes, settings.threads, settings.compression,
                                    fence=lambda: (fence(), claim.check()))
    finally:
        claim.release(delete=True)
    seconds = time.perf_counter() - start
    if fresh:
        logger.info("merged the chain of %s into full checkpoint %s (%d bytes) in %.1f s", ckpt_id, merged.id,
                    merged.bytes, seconds)
    maybe_crash("merge_after_commit", merged.step, 0)
    retention = None
    if retain and settings.keep_last > 0:
        fence()
        retention = retain_checkpoints(storage, settings.keep_last, scope or RetentionScope(merged.lineage))
    return {"checkpoint": ckpt_id, "merged": merged.id, "committed_now": fresh, "merged_bytes": merged.bytes,
            "bytes_read": counting.read, "bytes_written": counting.written, "seconds": round(seconds, 6),
            "retention": retention}


# ---- the job's merge worker -------------------------------------------------------------------


def _worker_main(conn: Any, storage_uri: str, settings: MergeSettings, lease: Optional[LeaseRef]) -> None:
    """The merge worker process: merge each (checkpoint id, retention scope) received on ``conn``
    and send back its report (``{"error": ...}`` on failure), until None or the pipe closes. It
    dies with the job's process."""
    die_with_spawner()
    name_this_process(MERGER)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    storage = open_storage(storage_uri)
    fence = (lambda: check_held(storage, lease)) if lease is not None else (lambda: None)
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            ckpt_id, scope = request
            try:
                report = merge_and_retain(storage, ckpt_id, settings, fence, retain=True, scope=scope)
            except Exception as e:  # noqa: BLE001 - reported; the chain stays valid
                logger.error("merging the chain of %s failed; it stays as it is: %s: %s", ckpt_id,
                             type(e).__name__, e)
                report = {"checkpoint": ckpt_id, "error": f"{type(e).__name__}: {e}"}
            conn.send(report)
    finally:
        storage.close()


class Merger:
    """Rank 0's background merges: one at a time, in a worker process that a thread of this
    process starts (``warm``, or the first merge) and feeds, so ``start`` only hands over a request
    (no spawn, no wait: nothing in the training stall). A worker that dies (killed) is started afresh for
    the next merge; a failed merge is logged and its chain stays valid. ``lease``: the job's, which
    the worker checks before it commits or deletes."""

    def __init__(self, storage_uri: str, settings: MergeSettings, lease: Optional[LeaseRef] = None) -> None:
        self._args = (storage_uri, settings, lease)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: Optional[Tuple[str, Optional[RetentionScope]]] = None
        self._busy = False
        self._closing = False
        self._warming = False
        self._thread: Optional[threading.Thread] = None
        self._process: Optional[mp.process.BaseProcess] = None
        self._conn: Any = None
        self.reports: List[Dict[str, Any]] = []  # every finished merge's report, oldest first

    def start(self, ckpt_id: str, scope: Optional[RetentionScope] = None) -> bool:
        """Merge the chain of committed ``ckpt_id`` in the background (``scope``: the job's retention
        scope). While a merge runs it waits in a one-place slot (a newer request replaces it) and
        starts the moment that merge ends, so increments do not pile up for an interval. Returns
        True: it will run (an older waiting request is dropped, its chain is part of this one)."""
        with self._lock:
            self._pending = (ckpt_id, scope)
            self._busy = True
        self._ensure_thread()
        self._wake.set()
        logger.info("merging the chain of %s into a new baseline in the background", ckpt_id)
        return True

    def warm(self) -> None:
        """Start the worker process now, off this thread, so the first merge does not wait for it."""
        self._warming = True
        self._ensure_thread()
        self._wake.set()

    @property
    def running(self) -> bool:
        """Whether a merge runs or waits."""
        return self._busy

    @property
    def worker_pid(self) -> Optional[int]:
        """The merge worker process's pid while it lives, else None (benchmarks pause it)."""
        process = self._process
        return process.pid if process is not None and process.is_alive() else None

    def wait(self) -> None:
        """Block until the running and waiting merges end, then stop the worker."""
        if self._thread is None:
            return
        self._closing = True
        self._wake.set()
        self._thread.join()
        self._thread = None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(target=self._serve, name="cnr-merger", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                request, self._pending = self._pending, None
            if request is None:
                if self._closing:
                    break
                if self._warming and self._process is None:
                    self._spawn()
                self._warming = False
                continue
            try:
                report = self._run(request)
                if "error" in report:
                    logger.error("the merge of %s failed; its chain stays valid: %s", request[0], report["error"])
                self.reports.append(report)
            except Exception as e:  # noqa: BLE001 - a merge never takes the job down
                logger.error("the merge of %s failed; its chain stays valid: %s", request[0], e)
            with self._lock:
                self._busy = self._pending is not None
            self._wake.set()  # a request that came meanwhile, or the close
        self._stop_worker()

    def _run(self, request: Tuple[str, Optional[RetentionScope]]) -> Dict[str, Any]:
        if self._process is None or not self._process.is_alive():
            self._spawn()
        self._conn.send(request)
        while not self._conn.poll(0.1):
            if not self._process.is_alive():
                break
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join()
            code = self._process.exitcode
            self._process = None
            return {"checkpoint": request[0], "error": f"the merge worker died (exit code {code})"}

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_worker_main, name=MERGER, daemon=True, args=(child, *self._args))
        self._process.start()
        child.close()  # the worker's end: once it dies, recv here ends with EOFError

    def _stop_worker(self) -> None:
        if self._process is None:
            return
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._process = None


# ---- python -m cnr compact -----------------------------------------------------------------------


def _target(storage: Storage, ckpt_id: Optional[str]):
    """The checkpoint to compact: ``ckpt_id`` (it must be committed) or the newest committed one;
    for a merged baseline, the increment it stands for while that is still committed (so that a
    merge cut off after its commit gets its retention)."""
    target = read_manifest(storage, ckpt_id) if ckpt_id else newest_committed(storage)
    if target is not None and target.id.endswith(MERGED_SUFFIX):
        try:
            return read_manifest(storage, target.id[:-len(MERGED_SUFFIX)])
        except KeyNotFoundError:
            pass
    return target


def compact_location(storage: Storage, ckpt_id: Optional[str], settings: MergeSettings, min_chain_ratio: float = 0.0,
                     lease_ttl_s: float = 60.0) -> Dict[str, Any]:
    """Merge the chain of ``ckpt_id`` (default: the newest committed checkpoint) if its increments
    store at least ``min_chain_ratio`` times its baseline's bytes; see the module docstring for how
    it shares the location with a job. Returns a JSON-able summary (``merged``: None when there was
    nothing to do, ``reason`` says why)."""
    out: Dict[str, Any] = {"uri": storage.uri, "checkpoint": ckpt_id, "merged": None, "committed_now": False,
                           "bytes_read": 0, "bytes_written": 0, "retention": None, "lease": None}
    target = _target(storage, ckpt_id)
    if target is None:
        return {**out, "reason": "no committed checkpoint"}
    chain = resolve_chain(storage, target)
    ratio = sum(m.bytes for m in chain[1:]) / max(1, chain[0].bytes)
    out.update(checkpoint=target.id, chain_links=len(chain), chain_ratio=round(ratio, 6))
    finished = chain[0].id == merged_id(target.id)  # merged already: finish a cut-off run's retention
    if len(chain) < 2 and not finished:
        return {**out, "reason": f"{target.id} restores from one full checkpoint ({chain[0].id}): nothing to merge"}
    if ratio < min_chain_ratio and not finished:
        return {**out, "reason": f"its increments store {ratio:.3f} x its baseline's bytes, under --min-chain-ratio "
                                 f"{min_chain_ratio}"}
    lease = _lease_if_free(storage, lease_ttl_s)
    out["lease"] = "held by this process" if lease is not None else "held by a live job: nothing deleted"
    try:
        fence = (lambda: check_held(storage, lease.ref)) if lease is not None else (lambda: None)
        report = merge_and_retain(storage, target.id, settings, fence, retain=lease is not None,
                                  scope=RetentionScope(target.lineage))
    finally:
        if lease is not None:
            lease.release()
    return {**out, **report}


def _lease_if_free(storage: Storage, ttl_s: float) -> Optional[Lease]:
    """The location's lease, renewed from now on, or None while a live job holds it."""
    try:
        lease = Lease.acquire(storage, ttl_s)
    except LeaseHeldError as e:
        logger.info("a job holds the lease (%s): merging without deleting anything", e)
        return None
    lease.start_renewing()
    return lease
