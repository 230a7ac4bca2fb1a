"""Exception types raised by cnr. Each message names the bad value and what is allowed."""


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


class CorruptChunkError(CheckpointError):
    """A chunk failed validation: truncated, altered, or its header does not match the manifest."""


NONFINITE = "non-finite values (NaN or inf)"
"""The phrase every NonFiniteStateError carries, so reports that only see the text can count them."""


class NonFiniteStateError(CheckpointError):
    """State to be checkpointed holds NaN or inf: a diverged run. The checkpoint does not commit,
    so the newest committed checkpoint stays the last finite one."""
