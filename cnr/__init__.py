"""cnr: Check-N-Run checkpoints for torchrec jobs.

The public API (see docs/guide.md)::

    ckpt = cnr.Checkpointer(uri, app_state, cnr.CheckpointOptions(...), publish=cnr.PublishOptions(...))
    ckpt.restore(); pending = ckpt.save(step); pending.wait(); ckpt.publish(step); ckpt.close()
    cnr.load_state_dict(uri, "model")
    cnr.Subscriber(publish_uri, plain_model).poll()
    cnr.Subscriber(publish_uri, cnr.ServingTarget(cnr.quantize_tables(plain_model, 4))).poll()
"""

from typing import TYPE_CHECKING, Any

# Public name -> the module defining it. Imported on first use (PEP 562), so that importing a
# submodule (a background writer process loads cnr.write.writer) does not load torchrec with cnr.api.
_EXPORTS = {
    "Checkpointer": "cnr.api", "PendingCheckpoint": "cnr.api", "CheckpointError": "cnr.errors",
    "load_state_dict": "cnr.restore.load", "CheckpointOptions": "cnr.options", "PublishOptions": "cnr.options",
    "FailureBudget": "cnr.options", "OnDamage": "cnr.types", "OnOverlap": "cnr.types", "BitPolicy": "cnr.types",
    "Compression": "cnr.types", "SearchKernel": "cnr.types", "Policy": "cnr.types", "Compaction": "cnr.types",
    "QuantMethod": "cnr.types", "ScheduleOptions": "cnr.options", "EncodingOptions": "cnr.options",
    "WriterOptions": "cnr.options", "TierOptions": "cnr.options", "RetentionOptions": "cnr.options",
    "LeaseOptions": "cnr.options",
    "Subscriber": "cnr.publish.subscriber", "CheckpointInfo": "cnr.types", "CheckpointKind": "cnr.types",
    "DeterministicDataParallel": "cnr.track.dense_sync", "PipelineFeed": "cnr.track.pipeline",
    "UnsupportedStateError": "cnr.track.coverage", "RankAgreementError": "cnr.errors",
    # every error a user can catch, under CnrError (docs/reference.md)
    "CnrError": "cnr.errors", "ConfigError": "cnr.errors", "StorageError": "cnr.errors",
    "KeyNotFoundError": "cnr.errors", "CorruptChunkError": "cnr.errors", "NonFiniteStateError": "cnr.errors",
    "OptionsError": "cnr.options", "LeaseHeldError": "cnr.write.lease_record", "WriterDied": "cnr.write.writer",
    "TrackerHookError": "cnr.track.hook_slot", "UnguardedMainError": "cnr.write.mainguard",
    "GapError": "cnr.publish.subscriber", "ServingTarget": "cnr.publish.serving",
    "quantize_tables": "cnr.publish.serving_tables",
    "CPURowWiseSharder": "cnr.track.sharders",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from cnr.api import Checkpointer, PendingCheckpoint  # noqa: F401
    from cnr.track.sharders import CPURowWiseSharder  # noqa: F401
    from cnr.track.dense_sync import DeterministicDataParallel  # noqa: F401
    from cnr.errors import (  # noqa: F401
        CheckpointError, CnrError, ConfigError, CorruptChunkError, KeyNotFoundError, NonFiniteStateError,
        RankAgreementError, StorageError,
    )
    from cnr.options import OptionsError  # noqa: F401
    from cnr.publish.subscriber import GapError  # noqa: F401
    from cnr.track.hook_slot import TrackerHookError  # noqa: F401
    from cnr.write.lease_record import LeaseHeldError  # noqa: F401
    from cnr.write.mainguard import UnguardedMainError  # noqa: F401
    from cnr.write.writer import WriterDied  # noqa: F401
    from cnr.restore.load import load_state_dict  # noqa: F401
    from cnr.track.coverage import UnsupportedStateError  # noqa: F401
    from cnr.options import (  # noqa: F401
        CheckpointOptions, EncodingOptions, FailureBudget, LeaseOptions, PublishOptions, RetentionOptions,
        ScheduleOptions, TierOptions, WriterOptions,
    )
    from cnr.track.pipeline import PipelineFeed  # noqa: F401
    from cnr.publish.subscriber import Subscriber  # noqa: F401
    from cnr.publish.serving import ServingTarget  # noqa: F401
    from cnr.publish.serving_tables import quantize_tables  # noqa: F401
    from cnr.types import (  # noqa: F401
        BitPolicy, CheckpointInfo, CheckpointKind, Compaction, Compression, OnDamage, OnOverlap, Policy, QuantMethod,
        SearchKernel,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cnr' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))
