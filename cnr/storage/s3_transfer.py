"""S3 transfer plumbing: puts (one PutObject, or a multipart upload on s3transfer's pool), a
zero-copy upload source, safe body reads, and tracking of the multipart uploads of puts in flight
so a failed put can abort them.

Imported by ``cnr.storage.s3`` after it has checked that boto3 is installed.
"""

from __future__ import annotations

import io
import threading
from typing import Callable, Dict, Optional, Set

import botocore.exceptions as bexc
from s3transfer.manager import TransferConfig, TransferManager

from cnr.errors import StorageError
from cnr.storage.s3_errors import describe, error_code, log


class BufferReader(io.RawIOBase):
    """A read-only, seekable file over a byte memoryview, so uploads do not copy it whole."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        data = bytes(self._view[self._pos:end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def read_body(response, amount: Optional[int] = None) -> bytes:
    """Read and close a GetObject reply's body, with botocore's length and checksum checks;
    ``amount``: read no more than that many bytes (the rest is dropped with the connection)."""
    # Not ``with body:`` -- StreamingBody.__enter__ hands out the raw urllib3 stream, which
    # skips botocore's Content-Length check and CRC validation.
    body = response["Body"]
    try:
        return body.read() if amount is None else body.read(amount)
    finally:
        body.close()


class MultipartUploads:
    """Multipart uploads started and not seen complete, per full key of a put in flight, so a
    failed put can abort them even if s3transfer's own abort failed."""

    def __init__(self, client, bucket: str) -> None:
        self._client = client
        self._bucket = bucket
        self._lock = threading.Lock()
        self._puts_in_flight: Dict[str, int] = {}
        self._open_uploads: Dict[str, Set[str]] = {}
        client.meta.events.register("after-call.s3.CreateMultipartUpload", self._record)

    def begin(self, full: str) -> None:
        """A put of ``full`` starts: record the multipart uploads created for it."""
        with self._lock:
            self._puts_in_flight[full] = self._puts_in_flight.get(full, 0) + 1

    def end(self, full: str) -> None:
        """A put of ``full`` is over; the last one forgets its uploads."""
        with self._lock:
            left = self._puts_in_flight[full] - 1
            if left:
                self._puts_in_flight[full] = left
            else:
                del self._puts_in_flight[full]
                self._open_uploads.pop(full, None)

    def abort(self, full: str) -> None:
        """Abort the recorded uploads of ``full`` unless another put of it is in flight."""
        with self._lock:
            if self._puts_in_flight.get(full, 0) > 1:
                return  # another put of the same key may own them; its own failure cleans up
            upload_ids = self._open_uploads.pop(full, set())
        for upload_id in upload_ids:
            try:
                self._client.abort_multipart_upload(Bucket=self._bucket, Key=full, UploadId=upload_id)
            except bexc.ClientError as e:
                if error_code(e) != "NoSuchUpload":  # s3transfer already aborted it
                    log.warning("could not abort a failed multipart upload of s3://%s/%s: %s",
                                self._bucket, full, describe(e, self._client))
            except bexc.BotoCoreError as e:
                log.warning("could not abort a failed multipart upload of s3://%s/%s: %s",
                            self._bucket, full, describe(e, self._client))

    def _record(self, parsed=None, **_kwargs) -> None:
        if not parsed or parsed.get("Bucket") != self._bucket or "UploadId" not in parsed:
            return
        with self._lock:
            if parsed.get("Key") in self._puts_in_flight:
                self._open_uploads.setdefault(parsed["Key"], set()).add(parsed["UploadId"])


class Puts:
    """The puts of one S3 store. An object under ``part_size`` goes up as one PutObject on the
    calling thread (as s3transfer would send it from its pool); a larger one as a multipart upload
    on s3transfer's TransferManager (``max_concurrency`` parts at once), its parts aborted if it fails.

    At interpreter exit concurrent.futures' own hook (run before atexit's) has stopped every
    ThreadPoolExecutor's threads, s3transfer's among them: a small put (a lease record, a failure
    marker: cnr.write.at_exit) still works; a multipart upload is refused with StorageError, and
    since s3transfer keeps the transfer it could not submit as in progress, ``close`` then cancels
    it rather than wait for it forever.
    """

    def __init__(self, client, bucket: str, part_size: int, max_concurrency: int) -> None:
        self._client, self._bucket, self._part_size = client, bucket, part_size
        self._transfer = TransferManager(client, TransferConfig(multipart_threshold=part_size,
                                                                multipart_chunksize=part_size,
                                                                max_request_concurrency=max_concurrency))
        self._uploads = MultipartUploads(client, bucket)
        self._refused = False  # a multipart upload was refused by a shut-down pool: close cancels it

    def put(self, full: str, view: memoryview, extra: Dict[str, str],
            retrying: Callable[[Callable[[], None]], None]) -> None:
        """Store bytes ``view`` at key ``full`` with PutObject arguments ``extra``; ``retrying`` runs
        one attempt with the store's retries and raises its StorageError."""
        if len(view) < self._part_size:
            retrying(lambda: self._client.put_object(Bucket=self._bucket, Key=full, Body=BufferReader(view), **extra))
            return

        def attempt() -> None:
            try:
                future = self._transfer.upload(BufferReader(view), self._bucket, full, extra_args=extra)
            except RuntimeError as e:  # "cannot schedule new futures after (interpreter) shutdown"
                self._refused = True
                raise StorageError(f"cannot write s3://{self._bucket}/{full}: the interpreter is exiting and its "
                                   f"thread pools are shut down, so no multipart upload can start ({e})") from None
            try:
                future.result()
            except BaseException:
                self._uploads.abort(full)
                raise

        self._uploads.begin(full)
        try:
            retrying(attempt)
        finally:
            self._uploads.end(full)

    def close(self) -> None:
        """Wait for the transfers in progress (cancel them once one was refused: see the class) and
        stop the manager's pools."""
        if not self._refused:
            self._transfer.shutdown()
            return
        # not shutdown(cancel=True): it hands its arguments on in the wrong order (s3transfer 0.17,
        # a str where the exception type goes); leaving the manager's context on an error cancels
        # every transfer in progress, as s3transfer documents, the refused one included
        error = StorageError("the interpreter is exiting: transfers in progress are cancelled")
        self._transfer.__exit__(StorageError, error, None)
