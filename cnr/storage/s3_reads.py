"""One S3 GET for cnr.storage.s3: a whole object, bounded by the size its reader expects, or a
byte range, checked against the reply's Content-Range so that no more than the range is read and
a short or shifted reply is refused.

Imported by ``cnr.storage.s3`` after it has checked that boto3 is installed.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

import botocore.exceptions as bexc

from cnr.errors import InvalidKeyError, StorageError
from cnr.storage.base import check_limit, check_range
from cnr.storage.s3_errors import error_code, status
from cnr.storage.s3_transfer import read_body
from cnr.types import ByteRange

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def get_whole(client, bucket: str, full: str, key: str, limit: Optional[int], checksum: bool) -> bytes:
    """The whole object ``full`` (``key`` in messages), bounded by ``limit`` bytes (None: none),
    checked against its stored checksum when ``checksum``."""
    kwargs = {"ChecksumMode": "ENABLED"} if checksum else {}
    response = client.get_object(Bucket=bucket, Key=full, **kwargs)
    length = response.get("ContentLength")
    if limit is not None and isinstance(length, int):
        try:
            check_limit(length, limit, key)  # from the reply's Content-Length, before reading the body
        except InvalidKeyError:
            response["Body"].close()
            raise
    data = read_body(response)
    check_limit(len(data), limit, key)
    return data


def get_range(client, bucket: str, full: str, key: str, byte_range: ByteRange, where: str,
              size: Callable[[], int]) -> bytes:
    """``byte_range`` (length > 0) of the object ``full`` in one GET; ``where`` names it in errors
    and ``size()`` gives its size when a refused range's reply does not."""
    # One ranged GET, no HEAD: the reply's Content-Range carries the object's size, so a
    # range that runs past the end is caught from it, and one that starts past the end gets
    # a 416 whose error names the size. No more than the range is read: a reply whose
    # Content-Length says more is refused, and of a whole object sent by a server that
    # ignored the Range header only the bytes up to the range's end are read.
    end = byte_range.start + byte_range.length - 1
    try:
        response = client.get_object(
            Bucket=bucket, Key=full, Range=f"bytes={byte_range.start}-{end}"
        )
    except bexc.ClientError as e:
        if error_code(e) != "InvalidRange" and status(e) != 416:
            raise
        actual = e.response.get("Error", {}).get("ActualObjectSize")
        size = int(actual) if actual and actual.isdigit() else size()
        check_range(byte_range, size, key)
        raise StorageError(
            f"cannot read {where}: the server refused bytes {byte_range.start}-{end} "
            f"of an object of {size} bytes"
        ) from None
    match = _CONTENT_RANGE.match(response.get("ContentRange") or "")
    length = response.get("ContentLength")
    if response["ResponseMetadata"]["HTTPStatusCode"] == 206 and match:
        if match.group(3) != "*":
            check_range(byte_range, int(match.group(3)), key)
        got_start = int(match.group(1))
        if isinstance(length, int) and length > byte_range.length:
            response["Body"].close()
            raise StorageError(f"cannot read {where}: asked for {byte_range.length} bytes at "
                               f"{byte_range.start}, the reply holds {length}")
        data = read_body(response)
    else:
        # The server ignored the Range header and sends the whole object: read up to the end.
        if isinstance(length, int):
            check_range(byte_range, length, key)
        data = read_body(response, end + 1)
        check_range(byte_range, len(data), key)
        data = data[byte_range.start : end + 1]
        got_start = byte_range.start
    if got_start != byte_range.start or len(data) != byte_range.length:
        raise StorageError(
            f"cannot read {where}: asked for {byte_range.length} bytes at "
            f"{byte_range.start}, got {len(data)} at {got_start}"
        )
    return data
