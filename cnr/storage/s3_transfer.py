"""S3 transfer plumbing: a zero-copy upload source, safe body reads, and tracking of the
multipart uploads of puts in flight so a failed put can abort them.

Imported by ``cnr.storage.s3`` after it has checked that boto3 is installed.
"""

from __future__ import annotations

import io
import threading
from typing import Dict, Optional, Set

import botocore.exceptions as bexc

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
