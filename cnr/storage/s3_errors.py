"""S3 error handling: classifying botocore errors, keeping credentials out of every message,
and retrying a whole operation with exponential backoff and jitter.

Imported by ``cnr.storage.s3`` after it has checked that boto3 is installed.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, List, Optional, TypeVar
from urllib.parse import urlsplit

import botocore.exceptions as bexc

from cnr.errors import CnrError, StorageError
from cnr.errors import redact as redact_text

# The backend's logger, so retry warnings keep the name they had before this module was split out.
log = logging.getLogger("cnr.storage.s3")

T = TypeVar("T")

# Error codes worth retrying the whole operation for, besides any HTTP 5xx or 429.
RETRYABLE_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestTimeout",
        "RequestTimeoutException",
        "BandwidthLimitExceeded",
        "PriorRequestNotComplete",
        "BadDigest",  # the body was damaged on the way; sending it again fixes that
    }
)
# Exceptions botocore raises for a broken connection or a damaged body.
RETRYABLE_EXCEPTIONS = (
    bexc.ConnectionError,  # endpoint unreachable, connect timeout, proxy error
    bexc.HTTPClientError,  # connection closed, read timeout, broken response stream
    bexc.IncompleteReadError,
    bexc.FlexibleChecksumError,  # response body does not match the object's checksum
)
NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


# -- classification ---------------------------------------------------------------------------


def error_code(e: Exception) -> str:
    """The S3 error code of a ClientError (``"NoSuchKey"``...), else ``""``."""
    if isinstance(e, bexc.ClientError):
        return str(e.response.get("Error", {}).get("Code") or "")
    return ""


def status(e: Exception) -> Optional[int]:
    """The HTTP status of a ClientError, else None."""
    if isinstance(e, bexc.ClientError):
        return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def is_retryable(e: Exception) -> bool:
    """Whether ``e`` is transient: throttling, 5xx, a dropped connection or a damaged body."""
    if isinstance(e, bexc.ClientError):
        code = status(e) or 0
        return error_code(e) in RETRYABLE_CODES or code >= 500 or code == 429
    return isinstance(e, RETRYABLE_EXCEPTIONS)


# -- credential redaction ---------------------------------------------------------------------


def credential_strings(client) -> List[str]:
    """The credential strings the client signs with, to blank out of any text we emit."""
    try:
        credentials = client._request_signer._credentials  # botocore keeps them here
        frozen = credentials.get_frozen_credentials() if credentials is not None else None
    except Exception:  # noqa: BLE001 - best effort; messages are built from safe fields anyway
        return []
    if frozen is None:
        return []
    return [s for s in (frozen.secret_key, frozen.token, frozen.access_key) if s and len(s) >= 4]


def redact(text: str, client) -> str:
    """``text`` with every credential of ``client``, and what cnr.errors.redact blanks (URL user
    info, secrets of the environment), replaced by ``***``."""
    for secret in credential_strings(client):
        text = text.replace(secret, "***")
    return redact_text(text)


def leaks_credentials(e: Optional[BaseException], client) -> bool:
    """Whether the text of ``e`` or of any exception it chains holds a credential of ``client``."""
    secrets = credential_strings(client)
    while e is not None:
        text = f"{e} {getattr(e, 'response', '')}"
        if any(secret in text for secret in secrets) or redact_text(text) != text:
            return True
        e = e.__cause__ or e.__context__
    return False


def describe(e: Exception, client) -> str:
    """A one-line, credential-free reason: ``Code (HTTP nnn) message`` or ``Type: text``."""
    if isinstance(e, bexc.ClientError):
        message = e.response.get("Error", {}).get("Message") or ""
        code = error_code(e) or "error"
        reason = f"{code} (HTTP {status(e)})" + (f" {message}" if message and message != code else "")
    else:
        reason = f"{type(e).__name__}: {e}"
    return redact(reason, client)


def safe_endpoint(client) -> str:
    """The client's endpoint URL without any user info, query or fragment."""
    try:
        parts = urlsplit(client.meta.endpoint_url)
    except Exception:  # noqa: BLE001
        return "?"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"


# -- whole-operation retries ------------------------------------------------------------------


def retrying(
    fn: Callable[[], T],
    *,
    op: str,
    where: str,
    client,
    attempts: int,
    backoff_base: float,
    backoff_max: float,
    fail: Callable[[Exception, int], StorageError],
) -> T:
    """Call ``fn``, retrying it as a whole up to ``attempts`` times while it fails transiently.

    The delay before retry n is ``min(backoff_max, backoff_base * 2**(n-1))`` times a jitter in
    [0.5, 1]. CnrErrors pass through; any other failure that is not retryable, or the last one,
    is raised as ``fail(error, attempts_made)`` -- unchained if the error's text holds a credential.
    """
    attempt = 1
    while True:
        try:
            return fn()
        except CnrError:
            raise
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_retryable(e) or attempt >= attempts:
                error = fail(e, attempt)
                if leaks_credentials(e, client):
                    # The cause's own text holds a credential (a server echoing it): do
                    # not chain it, so no traceback prints it.
                    raise error from None
                raise error from e
            delay = min(backoff_max, backoff_base * 2 ** (attempt - 1))
            delay *= random.uniform(0.5, 1.0)
            log.warning(
                "%s of %s failed (attempt %d of %d): %s; retrying in %.2f s",
                op, where, attempt, attempts, describe(e, client), delay,
            )
            time.sleep(delay)
            attempt += 1
