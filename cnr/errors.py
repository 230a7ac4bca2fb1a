"""Exception types raised by cnr. Each message names the bad value and what is allowed.

Also ``redact``: what leaves a process as text (error lines, failure markers in the store,
summaries, log records) goes through it, so no password or secret key is ever printed or stored.
"""

import logging
import os
import pickle
import re
from urllib.parse import urlsplit

_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]*@")
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
ENDPOINT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def _secrets() -> list:
    found = [os.environ[name] for name in SECRET_ENV if len(os.environ.get(name, "")) >= 4]
    for name in ENDPOINT_ENV:
        try:
            parts = urlsplit(os.environ.get(name, ""))
            password = parts.password
        except ValueError:
            continue
        found += [password] if password and len(password) >= 4 else []
    return found


def redact(text: str) -> str:
    """``text`` with the user info of every URL (``scheme://user:pass@``) and every secret of the
    environment (secret keys, session tokens, an endpoint URL's user and password) as ``***``."""
    text = _USERINFO.sub(r"\1***@", text)
    for secret in _secrets():
        text = text.replace(secret, "***")
    return text


class RedactingFilter(logging.Filter):
    """Redacts every log record's message (install on the handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def redact_logging() -> None:
    """Install RedactingFilter on every handler of the root logger."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


class CnrError(Exception):
    """Base class of every error cnr raises on purpose."""


class ConfigError(CnrError):
    """A configuration value, command-line flag or combination of them is not allowed."""


class StorageError(CnrError):
    """A storage backend could not read, write, list or delete a key."""


class KeyNotFoundError(StorageError):
    """The key does not exist in the storage backend."""


class InvalidKeyError(StorageError):
    """A key is absolute, contains '..', empty segments or characters that are not allowed."""


class CheckpointError(CnrError):
    """A checkpoint is missing, corrupt, uncommitted, or does not match the model."""


class Cancelled(CnrError):
    """A checkpoint was abandoned (the next boundary arrived first) before it committed."""


class RankAgreementError(CheckpointError):
    """A step every rank runs together (cnr.track.agreement) failed on one or more ranks; every
    rank raises this same error. ``step``: the step's name; ``failures``: rank -> that rank's
    exception (each picklable). The message names the step, the failing ranks and their errors."""

    def __init__(self, step: str, failures: "dict") -> None:
        self.step = step
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        why = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in self.failures.items())
        super().__init__(f"{step} failed on rank{'s' if len(self.failures) > 1 else ''} {ranks} "
                         f"(every rank stops here): {why}")

    def __reduce__(self):
        return type(self), (self.step, self.failures)


class CorruptChunkError(CheckpointError):
    """A chunk failed validation: truncated, altered, or its header does not match the manifest."""


NONFINITE = "non-finite values (NaN or inf)"
"""The phrase every NonFiniteStateError carries, so reports that only see the text can count them."""


class NonFiniteStateError(CheckpointError):
    """State to be checkpointed holds NaN or inf: a diverged run. The checkpoint does not commit,
    so the newest committed checkpoint stays the last finite one."""


def portable(error: BaseException, text: str) -> CnrError:
    """``error`` as an object that crosses a process boundary (it pickles) and holds no secret: the
    CnrError itself when it pickles and its message needs no redaction, else one of its class
    made from its redacted message, else a CheckpointError of ``text`` redacted (an error that is
    no CnrError: ``text`` is what users see of it, a traceback)."""
    if isinstance(error, CnrError):
        message = redact(str(error))
        candidates = [error] if message == str(error) else []
        for make in candidates + [None]:
            try:
                made = make if make is not None else type(error)(message)
                return pickle.loads(pickle.dumps(made))
            except Exception:  # noqa: BLE001 - a class that cannot travel: the generic error below
                continue
    return CheckpointError(redact(text))
