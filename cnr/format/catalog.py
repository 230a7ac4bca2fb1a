"""What a store holds: reading manifests, listing checkpoints with their status, and resolving
the chain a restore reads (cnr.format.manifest holds the formats and the layout)."""

from __future__ import annotations

import json
import logging
from typing import AbstractSet, Callable, List, Optional, Tuple

from cnr.errors import CheckpointError, CorruptChunkError, KeyNotFoundError
from cnr.format.documents import Manifest
from cnr.format.layout import (
    MERGED_SUFFIX, ROOT, checkpoint_prefix, failed_key, id_order, is_rank_failure_key, manifest_key, merged_id,
    state_id, step_of,
)
from cnr.format.manifest import read_head
from cnr.format.split import read_manifest
from cnr.format.abandoned import abandoned_ids, is_abandoned
from cnr.format.lineage import foreign_reason, recorded_lineages, restore_order
from cnr.storage.base import Storage
from cnr.types import CheckpointInfo, CheckpointKind, CheckpointStatus

logger = logging.getLogger(__name__)


def checkpoint_ids(storage: Storage) -> List[str]:
    """Ids of every checkpoint with anything stored, committed or not, oldest step first
    (``id_order``: numerically, so step 10000000000 comes after 9999999999)."""
    ids = storage.list_folders(ROOT)  # S3: by delimiter, not every object of every checkpoint
    return sorted(ids, key=id_order)


def marker_error(storage: Storage, key: str) -> str:
    """The error a failure marker (``failed_key``) records, shortened to 2000 characters."""
    try:
        return str(json.loads(storage.get(key).decode()).get("error", "failed"))[:2000]
    except (ValueError, UnicodeDecodeError, AttributeError):
        return "failed (unreadable marker)"


def failure_of(storage: Storage, ckpt_id: str) -> Optional[str]:
    """The error recorded for a failed checkpoint (or one of its ranks), else None."""
    for key in [failed_key(ckpt_id)] + [k for k in storage.list(checkpoint_prefix(ckpt_id)) if is_rank_failure_key(k)]:
        if storage.exists(key):
            return marker_error(storage, key)
    return None


def scan_checkpoints(storage: Storage) -> List[Tuple[CheckpointInfo, Optional[Manifest]]]:
    """Every checkpoint in storage, oldest first, with its manifest as stored (None unless
    committed; a split one without its indexes' chunks: cnr.format.split).

    Kind, bit-width and rows are the manifest's to say: a checkpoint without a readable one
    (uncommitted: a writer killed before its manifest; failed; damaged) lists them as None,
    unknown, with the bytes it has stored."""
    found: List[Tuple[CheckpointInfo, Optional[Manifest]]] = []
    for ckpt_id in checkpoint_ids(storage):
        step = step_of(ckpt_id)
        if not storage.exists(manifest_key(ckpt_id)):
            error = failure_of(storage, ckpt_id)
            status = CheckpointStatus.FAILED if error else CheckpointStatus.UNCOMMITTED
            found.append((CheckpointInfo(ckpt_id, step, None, status, None, None, _stored_bytes(storage, ckpt_id),
                                         error=error), None))
            continue
        try:
            m = read_head(storage, ckpt_id)
        except KeyNotFoundError:
            continue  # deleted since the listing (a live job's retention): not in the store any more
        except CheckpointError as e:  # one damaged manifest must not hide the others
            logger.warning("checkpoint %s is damaged: %s", ckpt_id, e)
            found.append((CheckpointInfo(ckpt_id, step, None, CheckpointStatus.DAMAGED, None, None,
                                         _stored_bytes(storage, ckpt_id), error=str(e)), None))
            continue
        found.append((committed_info(m), m))
    return found


def committed_info(m: Manifest) -> CheckpointInfo:
    """The CheckpointInfo of the committed checkpoint whose manifest is ``m``."""
    return CheckpointInfo(m.id, m.step, m.kind, CheckpointStatus.COMMITTED, m.bits, m.rows, m.bytes, m.base,
                          method=m.method, lineage=m.lineage)


def _stored_bytes(storage: Storage, ckpt_id: str) -> int:
    """The bytes stored under ``ckpt_id``'s prefix now (whatever they are)."""
    return sum(_size_or_zero(storage, k) for k in storage.list(checkpoint_prefix(ckpt_id)))


def _size_or_zero(storage: Storage, key: str) -> int:
    """A listed key's size; 0 when it is gone since the listing or is no object (a FIFO, a link
    out of a local store's root): an uncommitted checkpoint's size is informative only."""
    try:
        return storage.size(key)
    except KeyNotFoundError:
        return 0


def list_checkpoints(storage: Storage) -> List[CheckpointInfo]:
    """Every checkpoint in storage with its status, oldest first (what ``inspect`` prints)."""
    return [info for info, _ in scan_checkpoints(storage)]


Reader = Callable[[Storage, str], Manifest]  # read_manifest (the whole form) or read_head (as stored)


def resolve_chain(storage: Storage, manifest: Manifest, skip: AbstractSet[str] = frozenset(),
                  read: Reader = read_manifest) -> List[Manifest]:
    """The manifests to apply in order to restore ``manifest``: its full baseline first, each
    link read by ``read`` (a restore reads them as stored, then the indexes it needs).

    Follows ``base`` links: a one-shot or intermittent increment names its full baseline, a
    consecutive increment the checkpoint before it. Every link must be committed and older. A link
    whose chain was merged (a committed ``merged_id(link)``, cnr.write.merge) is replaced by the merged
    full checkpoint, which holds the same state, and the walk ends there without reading that
    link (``chain_links`` walks the same way over a listing). A merged baseline is a shortcut,
    never the only way: one named in ``skip`` (its data found damaged), or whose manifest does not
    verify, is passed over and the walk goes on through the links it merged.
    """
    if manifest.kind != CheckpointKind.FULL:
        merged = _shortcut(storage, merged_id(manifest.id), manifest, skip, read)
        if merged is not None:
            return [merged]
    chain = [manifest]
    while chain[0].kind != CheckpointKind.FULL:
        head = chain[0]
        if not head.base:
            raise CheckpointError(f"incremental checkpoint {head.id} names no baseline")
        merged = _shortcut(storage, merged_id(head.base), head, skip, read)
        if merged is not None:
            chain.insert(0, merged)
            break
        base = _read_if_committed(storage, head.base, read)
        if base is None:
            raise CheckpointError(f"checkpoint {manifest.id} needs {head.base} (the base of {head.id}), "
                                  f"which is not committed in {storage.uri}")
        if base.step >= head.step:
            raise CheckpointError(f"base {base.id} of {head.id} is not older than the increment")
        chain.insert(0, base)
    return chain



def damaged_merges(chain: List[Manifest], error: BaseException) -> Tuple[str, ...]:
    """The merged baselines of ``chain`` that ``error`` finds damaged: a chunk that fails its
    check, or an object gone (CorruptChunkError, KeyNotFoundError), whose key names the merged
    baseline (every damaged-object error names its key, and keys carry the checkpoint id). Such
    a baseline is a shortcut (``resolve_chain``): the chain's links it merged are the long way."""
    if not isinstance(error, (CorruptChunkError, KeyNotFoundError)):
        return ()
    return tuple(m.id for m in chain if m.id.endswith(MERGED_SUFFIX) and m.id in str(error))


def _read_if_committed(storage: Storage, ckpt_id: str, read: Reader = read_manifest) -> Optional[Manifest]:
    try:
        return read(storage, ckpt_id)
    except KeyNotFoundError:
        return None


def _shortcut(storage: Storage, merged: str, after: Manifest, skip: AbstractSet[str],
              read: Reader) -> Optional[Manifest]:
    """The committed merged baseline ``merged`` standing for ``after``'s chain up to it: None when
    there is none, it is in ``skip``, or it is damaged (a manifest that does not verify, or not a
    full checkpoint at or before ``after``: then with a warning)."""
    if merged in skip:
        return None
    try:
        found = _read_if_committed(storage, merged, read)
        if found is not None and (found.kind != CheckpointKind.FULL or found.step > after.step):
            raise CheckpointError(f"{merged} is not a full checkpoint at or before step {after.step}")
    except CheckpointError as e:  # damaged where stored (cnr.format.verify.DAMAGE); a storage error propagates
        logger.warning("merged baseline %s is damaged (%s); %s is resolved through the links it merged", merged, e,
                       after.id)
        return None
    return found


def committed_ids(storage: Storage) -> List[str]:
    """Ids of every checkpoint with a manifest (readable or not), newest first."""
    return [i for i in reversed(checkpoint_ids(storage)) if storage.exists(manifest_key(i))]


def restore_ids(storage: Storage) -> List[str]:
    """Ids of every state with a manifest in the order a restore tries them: the current
    history's first, each history's highest step first (cnr.format.lineage.restore_order); none
    that a restore passed over as damaged (cnr.format.abandoned). One id per state: an
    increment with a committed merged baseline is listed once, by the increment's id (its
    restore takes the merged baseline as its shortcut, cnr.restore.newest), a merged baseline
    alone only once its increment is gone."""
    abandoned = abandoned_ids(storage)
    ids = [i for i in committed_ids(storage) if not is_abandoned(i, abandoned)]
    listed = set(ids)
    return restore_order(storage, [i for i in ids if not (i.endswith(MERGED_SUFFIX) and state_id(i) in listed)])


def newest_committed(storage: Storage, read: Reader = read_manifest) -> Optional[Manifest]:
    """The committed checkpoint a restore tries first (``restore_ids``) whose manifest reads (by
    ``read``: whole, or as stored), or None. A damaged newer manifest, or one of another job's
    lineage (cnr.format.lineage.foreign_reason), is skipped with a warning naming it."""
    recorded = recorded_lineages(storage)
    for ckpt_id in restore_ids(storage):
        try:
            manifest = read(storage, ckpt_id)
        except KeyNotFoundError:
            continue  # deleted by retention since the listing
        except CheckpointError as e:
            logger.warning("skipping damaged checkpoint %s: %s", ckpt_id, e)
            continue
        foreign = foreign_reason(manifest, recorded)
        if not foreign:
            return manifest
        logger.warning("skipping checkpoint %s: %s", ckpt_id, foreign)
    return None
