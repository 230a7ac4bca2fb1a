"""Where cnr stores what: every key name and checkpoint id under a storage root, in one place.

Layout under the storage root (docs/format.md is the full specification):

    checkpoints/<id>/rank-<r>/chunk-<n>.bin   rank r's encoded chunks: one large chunk, or small ones back to back
    checkpoints/<id>/rank-<r>/index.json      rank r's index, written after its chunks are durable
                                              (checkpoints/<id>/rank-<r>.json before format version 6)
    checkpoints/<id>/manifest.json            the commit: written last, after every rank's index
    checkpoints/<id>/failed-rank-<r>.json     rank r's writer failed (error text)
    checkpoints/<id>/failed.json              the checkpoint will never commit (error text)
    checkpoints/<id>/deleting.json            retention is deleting the committed checkpoint
    lease/...  compact/...                    the job's lease and merge claims (cnr.write.lease)
    lineage/<seq>-<lineage>.json              job lineage records (cnr.format.lineage)
    abandoned/<id>.json                       abandoned checkpoints (cnr.format.abandoned)

``<r>`` is the rank in 5 digits (cnr.names.rank_label, as in per-rank tensor names), ``<n>`` the
object number in 6. ``<id>`` is ``<step:010d>-<nonce>``: ids order by step (``id_order``: past 10
digits not as strings), and a rewrite of the same step never mixes with leftovers of an earlier
attempt. A checkpoint without ``manifest.json`` is uncommitted.
"""

from __future__ import annotations

import re
from typing import AbstractSet, List, Mapping, Optional, Tuple

from cnr.names import rank_label
from cnr.storage.base import Storage

ROOT = "checkpoints"
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.json"
LEASE_PREFIX = "lease"
CLAIM_PREFIX = "compact"
LINEAGE_PREFIX = "lineage"
ABANDONED_PREFIX = "abandoned"
_RANK_FAILED = "/failed-rank-"
_RANK_FOLDER = re.compile(r"/rank-(\d{5,})/")
def checkpoint_prefix(ckpt_id: str) -> str:
    return f"{ROOT}/{ckpt_id}"


def rank_prefix(ckpt_id: str, rank: int) -> str:
    """The folder (with its trailing "/") of rank ``rank``'s objects and index of ``ckpt_id``."""
    return f"{ROOT}/{ckpt_id}/{rank_label(rank)}/"


def manifest_key(ckpt_id: str) -> str:
    return f"{ROOT}/{ckpt_id}/{MANIFEST_NAME}"


def is_manifest_key(key: str) -> bool:
    """Whether ``key`` is ``manifest_key`` of some id directly under ``ROOT``."""
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == ROOT and parts[2] == MANIFEST_NAME


def rank_index_key(ckpt_id: str, rank: int, in_rank_folder: bool = True) -> str:
    """Rank ``rank``'s index of ``ckpt_id``: in the rank's folder (format version 6 on, the
    manifest's ``indexes_in_rank_folders``), or beside the manifest (before)."""
    if in_rank_folder:
        return rank_prefix(ckpt_id, rank) + INDEX_NAME
    return f"{ROOT}/{ckpt_id}/{rank_label(rank)}.json"


def stored_rank_index_key(storage: Storage, ckpt_id: str, rank: int) -> str:
    """The key of rank ``rank``'s index of ``ckpt_id`` on ``storage`` when no manifest says its
    layout (an uncommitted checkpoint): this version's, unless only an older layout's is stored."""
    key = rank_index_key(ckpt_id, rank)
    legacy = rank_index_key(ckpt_id, rank, in_rank_folder=False)
    return legacy if not storage.exists(key) and storage.exists(legacy) else key


def object_key(ckpt_id: str, rank: int, n: int) -> str:
    """Rank ``rank``'s ``n``-th data object: one large chunk, or small chunks back to back."""
    return f"{rank_prefix(ckpt_id, rank)}chunk-{n:06d}.bin"


def writer_rank(key: str) -> int:
    """The rank whose folder holds object ``key`` (``object_key``), or -1."""
    match = _RANK_FOLDER.search(key)
    return int(match.group(1)) if match else -1


def failed_key(ckpt_id: str, rank: Optional[int] = None) -> str:
    """Marker of a failed checkpoint (``rank`` None) or of one rank's failed writer."""
    name = "failed.json" if rank is None else f"failed-{rank_label(rank)}.json"
    return f"{ROOT}/{ckpt_id}/{name}"


def is_rank_failure_key(key: str) -> bool:
    """Whether ``key`` is a ``failed_key`` of one rank."""
    return _RANK_FAILED in key


def deleting_key(ckpt_id: str) -> str:
    """Retention's marker on a committed checkpoint it is deleting: stored before the manifest
    goes, removed last. A checkpoint left with it (a crash, or another process's retention
    mid-way) was committed, so its purge records no failure."""
    return f"{ROOT}/{ckpt_id}/deleting.json"


# ---- checkpoint ids ---------------------------------------------------------------------------

# A merged baseline (cnr.write.merge) is named after the increment it stands for: it sorts right after it.
MERGED_SUFFIX = ".merged"
CHECKPOINT_ID = r"\d{10,}-[0-9a-f]+"  # make_id's form (a step, then a hex nonce); a merged one adds MERGED_SUFFIX


def merged_id(ckpt_id: str) -> str:
    """Id of the full checkpoint that a merge of ``ckpt_id``'s chain writes."""
    return ckpt_id + MERGED_SUFFIX


def state_id(ckpt_id: str) -> str:
    """The id of the training state ``ckpt_id`` holds: a merged baseline holds its increment's
    state (bit for bit, cnr.write.merge), so both forms of one state share the increment's id.
    Retention counts states, abandoned records name them (cnr.format.abandoned)."""
    return ckpt_id[:-len(MERGED_SUFFIX)] if ckpt_id.endswith(MERGED_SUFFIX) else ckpt_id


def make_id(step: int, nonce: str) -> str:
    return f"{step:010d}-{nonce}"


def is_checkpoint_id(text: str, merged: bool = False) -> bool:
    """Whether ``text`` is an id of ``make_id``'s form (``merged``: or a merged baseline's)."""
    suffix = f"({re.escape(MERGED_SUFFIX)})?" if merged else ""
    return re.fullmatch(CHECKPOINT_ID + suffix, text) is not None


def step_of(ckpt_id: str) -> int:
    """The step a checkpoint id (``make_id``) names, or -1 for an id not of that form."""
    head = ckpt_id.split("-")[0]
    return int(head) if head.isdigit() else -1


def id_order(ckpt_id: str) -> Tuple[int, str]:
    """Sort key of checkpoint and publish ids: the step the id names, numerically, then the id.

    Order ids with it, never as strings: the step is zero-padded to 10 digits only, so past
    9999999999 a string sort puts ``10000000000-…`` before ``9999999999-…``. The id breaks ties,
    which keeps a merged baseline (``<id>.merged``) right after the checkpoint it stands for.
    A name not of ``make_id``'s form (``step_of`` -1) sorts before every id."""
    return step_of(ckpt_id), ckpt_id


def chain_links(ckpt_id: str, bases: Mapping[str, Optional[str]],
                skip: AbstractSet[str] = frozenset()) -> Tuple[List[str], bool]:
    """The ids a restore of ``ckpt_id`` reads, newest first, walked as ``resolve_chain`` walks
    storage but over ``bases`` (committed id -> its base id, None for a full checkpoint): base
    links, and a link with a committed merged baseline not in ``skip`` ends at that baseline, in
    its place (a restore passes over a merged baseline it finds damaged: ``skip``).
    Also whether the walk reached a full checkpoint (a missing link or a loop ends it early)."""
    out: List[str] = []
    link = ckpt_id
    while True:
        shortcut = merged_id(state_id(link))
        if shortcut != link and shortcut in bases and shortcut not in skip:  # checked before the link itself is needed
            return out + [shortcut], True
        if link not in bases or link in out:
            return out, False
        out.append(link)
        if bases[link] is None:
            return out, True
        link = bases[link]
