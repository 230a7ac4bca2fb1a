"""A user's own loop on S3 that leaves a live Checkpointer (no ``with``, no ``close()``) at
interpreter exit (issue #38, defect 5; cnr.write.at_exit). At exit, concurrent.futures has already
stopped s3transfer's thread pools: the S3 store's puts must work, or fail, without them."""

from __future__ import annotations

import concurrent.futures.thread
import threading

import pytest

from cnr.errors import StorageError
from cnr.storage import S3Options
from cnr.storage.s3 import S3Storage

MiB = 1024 * 1024


def test_puts_once_the_thread_pools_are_shut_down(s3_bucket, monkeypatch):
    """What concurrent.futures' exit hook leaves an atexit hook (cnr.storage.s3_transfer.Puts): a
    small put (a lease record) still stores its object; a multipart one is refused with
    StorageError naming the key; close() returns instead of waiting forever for the refused upload."""
    store = S3Storage(s3_bucket, "p", S3Options(part_size=5 * MiB, backoff_base=0.01, backoff_max=0.05))
    store.put("before", b"b" * (6 * MiB))  # multipart: the manager's pools have threads
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)  # as at interpreter exit
    store.put("lease", b"record")
    assert store.get("lease") == b"record"
    with pytest.raises(StorageError, match=f"cannot write s3://{s3_bucket}/p/big: the interpreter is exiting"):
        store.put("big", b"y" * (6 * MiB))
    closed = []
    closing = threading.Thread(target=lambda: closed.append(store.close()), daemon=True)
    closing.start()
    closing.join(30)
    assert not closing.is_alive(), "close() waits for the upload the shut-down pool never ran"
    assert closed == [None]  # it returned rather than raised
