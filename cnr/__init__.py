"""cnr: Check-N-Run checkpoints for torchrec jobs.

The public API (see README "Use cnr from your own training loop")::

    ckpt = cnr.Checkpointer(uri, app_state, cnr.CheckpointOptions(...))
    ckpt.restore(); pending = ckpt.save(step); pending.wait(); ckpt.close()
    cnr.load_state_dict(uri, "model")
"""

from cnr.api import Checkpointer, PendingCheckpoint
from cnr.errors import CheckpointError
from cnr.load import load_state_dict
from cnr.options import CheckpointOptions
from cnr.types import CheckpointInfo, CheckpointKind

__all__ = ["Checkpointer", "CheckpointOptions", "CheckpointInfo", "CheckpointKind", "CheckpointError",
           "PendingCheckpoint", "load_state_dict"]
