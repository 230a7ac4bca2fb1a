"""The subscriber: follow a publish store and apply its publishes, in order, to an unsharded model.

A publish is visible only once its manifest is committed (cnr.publish.publisher reuses the checkpoint
commit protocol), so the subscriber reads committed manifests only and never sees a partial one.

Each apply has two phases. *Stage*: read the manifests, check them against the model, fetch and
verify (CRC) every chunk; this is where storage can fail (a publish garbage-collected meanwhile,
a network error, a corrupt object). *Apply*: copy the verified rows into the live tensors under
the model's lock, which does no I/O. A failure while staging leaves the model as it was.

Ordering: the model holds the publish ``applied`` (sequence number ``seq``). The next one applies
if it is a full base, or an increment whose ``base`` is ``applied`` (sequence ``seq + 1``).
Anything else, an increment with a gap before it, or one whose base was garbage-collected, makes
the subscriber *reload*: stage the newest publish's whole chain (its base, then every increment
in order) and apply it in one go. Publishes at or below ``seq`` are skipped: re-applying one is
harmless anyway, since an increment holds absolute row values, not deltas. A store that went back
(the publish held is gone and nothing after it is listed: reset, rolled back) is reloaded from its
newest chain too, with a warning, rather than skipped behind the stale seq.

Resumable: ``applied`` is kept in memory, and with ``state_path`` also in one file together with
the tensors it describes (``torch.save``, written to a temp file and renamed; read back with
``weights_only``), so a restarted subscriber carries on from the publish after it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from cnr.format.chunk_coverage import check_coverage
from cnr.codec.chunk_format import DecodedChunk
from cnr.errors import CheckpointError, CnrError, ConfigError
from cnr.publish.module_target import ModuleTarget
from cnr.format.documents import Manifest
from cnr.format.layout import ROOT, id_order, is_manifest_key, step_of
from cnr.format.catalog import read_manifest, resolve_chain
from cnr.format.chunks import fetch_chunk
from cnr.storage import open_storage
from cnr.storage.base import Storage
from cnr.types import CheckpointKind, ChunkRef, Role

logger = logging.getLogger(__name__)

STATE_FORMAT = "cnr.subscriber-state"
STATE_VERSION = 1
_RELOAD_TRIES = 3  # a reload races retention at most a few times before a newer base is stable
_KEPT = 10000
MAX_FETCH_THREADS = 64  # records and errors kept, so a subscriber that runs for months stays small


class GapError(CheckpointError):
    """A publish does not follow the applied one (a gap, or its base is gone)."""


@dataclass(frozen=True)
class Applied:
    """The newest publish the model holds: its id, sequence number, training step, the full base
    its chain starts at, and the training step of the dense parameters it holds."""

    id: str
    seq: int
    step: int
    base: str
    dense_step: int


@dataclass
class SubscriberStats:
    """Counts over this subscriber's life. ``records``: one dict per applied publish (id, seq,
    step, kind, rows, bytes, whether by reload, and unix microseconds of its trigger on the
    trainer, of its commit (manifest time), of the poll that first listed it, and of the end of
    its apply)."""

    polls: int = 0
    skipped: int = 0
    errors: List[str] = field(default_factory=list)
    # what was applied
    bases: int = 0
    increments: int = 0
    reloads: int = 0
    bytes_read: int = 0
    records: List[Dict[str, Any]] = field(default_factory=list)


def _now_us() -> int:
    return int(time.time() * 1e6)


def committed_publishes(storage: Storage) -> List[Tuple[int, str]]:
    """(sequence number, id) of every committed publish in the store, ascending (``id_order``)."""
    ids = [key.split("/")[1] for key in storage.list(ROOT) if is_manifest_key(key)]
    ids = [pub_id for pub_id in ids if step_of(pub_id) >= 0]
    return [(step_of(pub_id), pub_id) for pub_id in sorted(ids, key=id_order)]


class Subscriber:
    """Applies publishes from ``storage`` (a URI or an open Storage) to ``model``.

    ``model``: any unsharded module whose ``state_dict()`` keys are those of app_state[``key``]
    on the trainer (the same architecture built without DMP), or a ModuleTarget such as a
    cnr.publish.serving.ServingTarget (torchrec's quantized inference tables) or cnr's
    InferenceModel. Its tensors are written in place; hold ``subscriber.model.lock`` to read
    them while another thread polls. ``fetch_threads``: chunks fetched and verified at once while
    staging (1 to MAX_FETCH_THREADS; an object store's latency, not its bandwidth, bounds one
    fetch at a time).
    """

    def __init__(self, storage: Union[str, Storage], model: Union[ModuleTarget, torch.nn.Module],
                 state_path: Optional[str] = None, key: str = "model", fetch_threads: int = 8) -> None:
        if isinstance(fetch_threads, bool) or not isinstance(fetch_threads, int) \
                or not 1 <= fetch_threads <= MAX_FETCH_THREADS:
            raise ValueError(f"fetch_threads={fetch_threads!r} is not allowed; it must be an integer from 1 to "
                             f"{MAX_FETCH_THREADS}")
        self._pool = ThreadPoolExecutor(fetch_threads, thread_name_prefix="cnr-subscriber-fetch") \
            if fetch_threads > 1 else None
        self.model = model if isinstance(model, ModuleTarget) else ModuleTarget(model, key)
        self.storage = open_storage(storage) if isinstance(storage, str) else storage
        self.state_path = state_path
        self.applied: Optional[Applied] = None
        self.stats = SubscriberStats()
        self._seen: Dict[str, int] = {}
        if state_path is not None and os.path.exists(state_path):
            self._load_state(state_path)

    # ---- public ------------------------------------------------------------------------------

    def poll(self) -> List[str]:
        """Apply every committed publish after ``applied``, in order; return the ids applied.

        Errors (storage, corrupt or mismatched publishes) are logged and counted, never half
        applied; the next poll tries again.
        """
        self.stats.polls += 1
        done: List[str] = []
        listing = committed_publishes(self.storage)
        now = _now_us()
        self._seen = {pub_id: self._seen.get(pub_id, now) for _seq, pub_id in listing}
        if self._went_back(listing):
            return []
        try:
            self._catch_up(listing, done)
        except CnrError as e:
            logger.info("%s; reloading from the newest base", e)
            done += self._reload(listing, cause=e)
        if done and self.state_path is not None:
            self.save_state(self.state_path)
        return done

    def apply(self, pub_id: str) -> bool:
        """Apply committed publish ``pub_id`` if it is next (a full base, or an increment on the
        applied one). False if it is at or below the applied sequence number (a harmless no-op);
        GapError if it does not follow."""
        manifest = read_manifest(self.storage, pub_id)
        if manifest.step != step_of(pub_id):
            raise CheckpointError(f"publish {pub_id} says its sequence number is {manifest.step}")
        if self.applied is not None and manifest.step <= self.applied.seq:
            self.stats.skipped += 1
            return False
        if manifest.kind != CheckpointKind.FULL and (
                self.applied is None or manifest.base != self.applied.id or manifest.step != self.applied.seq + 1):
            have = f"{self.applied.id} (seq {self.applied.seq})" if self.applied else "nothing"
            raise GapError(f"publish {pub_id} (seq {manifest.step}) builds on {manifest.base}, the model holds {have}")
        self._apply_chain([manifest], reload=False)
        return True

    def follow(self, until_seq: Optional[int] = None, timeout_s: float = 0.0, poll_s: float = 0.5) -> None:
        """Poll every ``poll_s`` seconds until ``until_seq`` is applied or ``timeout_s`` passed (0: forever)."""
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        while True:
            self.poll()
            if until_seq is not None and self.applied is not None and self.applied.seq >= until_seq:
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(poll_s)

    def summary(self) -> Dict[str, Any]:
        """What the subscriber holds and has done (JSON-able)."""
        s = self.stats
        return {"uri": self.storage.uri, "applied": asdict(self.applied) if self.applied else None,
                "polls": s.polls, "bases": s.bases, "increments": s.increments, "reloads": s.reloads,
                "skipped": s.skipped, "bytes_read": s.bytes_read, "errors": list(s.errors)}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.storage.close()

    # ---- ordering ----------------------------------------------------------------------------

    def _catch_up(self, listing: List[Tuple[int, str]], done: List[str]) -> None:
        """Apply the listed publishes after ``applied`` one by one (appending to ``done``); raise
        CnrError on a gap or on a publish that cannot be read (retention may have removed it)."""
        if self.applied is None:
            done += self._reload(listing)
            return
        for seq, pub_id in listing:
            if seq > self.applied.seq and self.apply(pub_id):
                done.append(pub_id)

    def _went_back(self, listing: List[Tuple[int, str]]) -> bool:
        """Whether the store went back behind the publish the model holds: that publish is gone
        and nothing after it is listed (the store was reset, rolled back, or another trainer
        publishes there from seq 1 again). Publishes at or below the held seq would be skipped
        forever, so the model would stay on a publish the store no longer has without a word.
        Instead the newest listed chain is reloaded on this poll (``applied`` is dropped, with a
        warning); with nothing listed, the model stays and an error is recorded (True)."""
        held = self.applied
        if held is None or any(pub_id == held.id or seq > held.seq for seq, pub_id in listing):
            return False
        what = (f"the publish store {self.storage.uri} no longer holds publish {held.id} (seq {held.seq}), the one "
                "the model holds, nor anything after it")
        if not listing:
            self._error(CheckpointError(f"{what}: it holds no committed publish; the model stays as it is"))
            return True
        logger.warning("%s (its newest is %s, seq %d): it went back; reloading its newest chain", what,
                       listing[-1][1], listing[-1][0])
        self.applied = None
        return False

    def _reload(self, listing: List[Tuple[int, str]], cause: Optional[CnrError] = None) -> List[str]:
        """Stage and apply the newest committed publish's whole chain (base first).

        Retention may delete that chain's base while it is read, when a newer base has just
        committed: then the listing has moved on, and the reload lists again and retries. A failure
        with the same newest publish listed would only repeat, so it is recorded and left for the
        next poll; so is ``cause`` (why catching up failed) when the chain starts at the base the
        model already holds: catching up by increments has just failed to extend it, and reloading
        would fetch that whole base again only to fail the same way.
        """
        for _attempt in range(_RELOAD_TRIES):
            if not listing or (self.applied is not None and listing[-1][0] <= self.applied.seq):
                return []  # nothing newer than what the model holds
            try:
                chain = resolve_chain(self.storage, read_manifest(self.storage, listing[-1][1]))
                if self.applied is not None and chain[0].id == self.applied.base:
                    raise cause or CheckpointError(f"publish {chain[-1].id} extends the base the model holds "
                                                   f"({chain[0].id}), but not from seq {self.applied.seq}")
                self._apply_chain(chain, reload=True)
                self.stats.reloads += 1
                return [m.id for m in chain]
            except CnrError as e:
                newer = committed_publishes(self.storage)
                if not newer or newer[-1] == listing[-1]:
                    self._error(e)
                    return []
                logger.info("reload failed (%s); a newer publish is listed, trying it", e)
                listing = newer
        return []

    # ---- stage, then apply -------------------------------------------------------------------

    def _stage(self, manifest: Manifest) -> List[DecodedChunk]:
        """Check ``manifest`` against the model and fetch every chunk, verified (all the I/O)."""
        names, needed = set(manifest.tensors), self.model.published_names()
        if manifest.kind == CheckpointKind.FULL and not needed <= names:
            missing = sorted(needed - names)
            raise CheckpointError(f"base {manifest.id} lacks tensors the subscribed module needs: {missing[:5]}")
        for name, entry in manifest.tensors.items():
            self.model.check_tensor(name, entry.shape, entry.dtype)
        check_coverage(manifest.tensors, manifest.kind)
        refs = [(ref, entry.shape[0] if entry.shape else None) for entry in manifest.tensors.values()
                for ref in entry.chunks]

        def fetch(item: Tuple[ChunkRef, Optional[int]]) -> DecodedChunk:
            return fetch_chunk(self.storage, item[0], dequantize=self.model.dequantize, tensor_rows=item[1])

        # in the manifest's order whatever order they arrive in; the first error is raised
        chunks = list(self._pool.map(fetch, refs)) if self._pool is not None and len(refs) > 1 else \
            [fetch(item) for item in refs]
        self.stats.bytes_read += sum(ref.nbytes for ref, _rows in refs)
        return chunks

    def _apply_chain(self, chain: List[Manifest], reload: bool) -> None:
        staged = [self._stage(m) for m in chain]  # everything verified before anything is written
        for chunks in staged:
            self.model.apply(chunks)
        done = _now_us()
        dense_step = self.applied.dense_step if self.applied is not None and not reload else -1
        for m in chain:
            if _has_dense(m):
                dense_step = m.counters.get("step", -1)
            full = m.kind == CheckpointKind.FULL
            self.stats.bases += int(full)
            self.stats.increments += int(not full)
            self.stats.records.append({
                "id": m.id, "seq": m.step, "step": m.counters.get("step", -1), "kind": m.kind.value,
                "rows": m.rows, "bytes": m.bytes, "reload": reload, "dense": _has_dense(m),
                "trigger_unix_us": m.counters.get("trigger_unix_us"), "created_unix_us": int(m.created_unix * 1e6),
                "seen_unix_us": self._seen.get(m.id, done),
                "applied_unix_us": done})
        del self.stats.records[:-_KEPT]
        newest = chain[-1]
        base = newest.id if newest.kind == CheckpointKind.FULL else (chain[0].id if reload else self.applied.base)
        self.applied = Applied(newest.id, newest.step, newest.counters.get("step", -1), base, dense_step)
        logger.info("applied publish %s (seq %d, step %d, %s%s)", newest.id, newest.step, self.applied.step,
                    newest.kind.value, ", reload" if reload else "")

    def _error(self, e: Exception) -> None:
        message = f"{type(e).__name__}: {e}"
        self.stats.errors.append(message)
        del self.stats.errors[:-_KEPT]
        logger.warning("subscriber: %s (the model keeps publish %s)", message,
                       self.applied.id if self.applied else None)

    # ---- state file --------------------------------------------------------------------------

    def save_state(self, path: str) -> None:
        """Write ``applied`` and the tensors it describes to ``path`` as one atomic file."""
        state = {"format": STATE_FORMAT, "version": STATE_VERSION, "uri": self.storage.uri,
                 "applied": asdict(self.applied) if self.applied else None}
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save({"state": json.dumps(state), "tensors": self.model.snapshot()}, tmp)
        os.replace(tmp, path)

    def _load_state(self, path: str) -> None:
        try:
            saved = torch.load(path, weights_only=True)
            state = json.loads(saved["state"])
            tensors = saved["tensors"]
        except Exception as e:
            raise ConfigError(f"subscriber state file {path!r} cannot be read: {e}") from e
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ConfigError(f"{path!r} is not a {STATE_FORMAT} version {STATE_VERSION} file")
        if state.get("uri") != self.storage.uri:
            raise ConfigError(f"subscriber state {path!r} follows {state.get('uri')!r}, not {self.storage.uri!r}")
        self.model.load(tensors)
        self.applied = Applied(**state["applied"]) if state["applied"] else None
        logger.info("subscriber state loaded from %s: publish %s", path, self.applied.id if self.applied else None)


def _has_dense(m: Manifest) -> bool:
    """Whether a publish holds dense parameters (any tensor that is not a table's)."""
    return any(t.role == Role.DENSE for t in m.tensors.values())
