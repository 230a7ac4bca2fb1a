"""The library's settings, each field with its default, meaning and rules written once here.

``CheckpointOptions`` (every knob of a checkpoint engine, in six groups: cnr.options.groups),
``FailureBudget`` (its ``bit_policy: failures`` inputs) and ``PublishOptions`` are checked when
constructed, by one path: every field's type from its annotation (cnr.options.fields: choices,
Optional and Dict fields included), then the rules across fields (cnr.options.checks); an error
names the setting as ``CheckpointOptions.<name>``. The checks take a ``Naming`` (cnr.options.naming),
so that an application that reads the same settings from its own configuration (``cnr train``'s
``checkpoint`` and ``publish`` sections) goes through the same path, naming its own keys
(``check_checkpoint_settings``, ``check_publish_settings``).
"""

from cnr.options.checkpoint import (CheckpointOptions, PublishOptions, check_checkpoint_settings,
                                    check_publish_settings, flat_settings)
from cnr.options.checks import (DEFAULT_COMPACT_RATIO, MAX_CHUNK_BYTES, MAX_KEEP_LAST, MAX_THREADS, PUBLISH_BITS,
                                TABLE_WIDTHS, check_checkpoint, check_compaction, check_failures, check_publish)
from cnr.options.groups import (FIELD_ORDER, LOG8_TOLERATED_RESTORES, EncodingOptions, FailureBudget, LeaseOptions,
                                RetentionOptions, ScheduleOptions, TierOptions, WriterOptions)
from cnr.options.naming import CHECKPOINT_OPTIONS, MAX_SHOWN, PUBLISH_OPTIONS, Naming, OptionsError, shown, values_of

__all__ = [
    "CheckpointOptions", "PublishOptions", "FailureBudget", "OptionsError",
    "ScheduleOptions", "EncodingOptions", "WriterOptions", "TierOptions", "RetentionOptions", "LeaseOptions",
    "Naming", "shown", "values_of", "check_checkpoint_settings", "check_publish_settings", "flat_settings",
    "check_checkpoint", "check_compaction", "check_failures", "check_publish",
    "CHECKPOINT_OPTIONS", "PUBLISH_OPTIONS", "DEFAULT_COMPACT_RATIO", "FIELD_ORDER", "LOG8_TOLERATED_RESTORES",
    "MAX_CHUNK_BYTES", "MAX_KEEP_LAST", "MAX_SHOWN", "MAX_THREADS", "PUBLISH_BITS", "TABLE_WIDTHS",
]
