"""cnr: Check-N-Run checkpoints for torchrec jobs.

The public API (see README "Use cnr from your own training loop")::

    ckpt = cnr.Checkpointer(uri, app_state, cnr.CheckpointOptions(...), publish=cnr.PublishOptions(...))
    ckpt.restore(); pending = ckpt.save(step); pending.wait(); ckpt.publish(step); ckpt.close()
    cnr.load_state_dict(uri, "model")
    cnr.Subscriber(publish_uri, plain_model).poll()
"""

from cnr.api import Checkpointer, PendingCheckpoint
from cnr.errors import CheckpointError
from cnr.load import load_state_dict
from cnr.options import CheckpointOptions, PublishOptions
from cnr.subscribe import Subscriber
from cnr.types import CheckpointInfo, CheckpointKind

__all__ = ["Checkpointer", "CheckpointOptions", "CheckpointInfo", "CheckpointKind", "CheckpointError",
           "PendingCheckpoint", "PublishOptions", "Subscriber", "load_state_dict"]
