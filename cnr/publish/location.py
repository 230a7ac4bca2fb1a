"""Where ``cnr.Checkpointer`` publishes by default, and the check that a publish store is usable.
Kept apart from cnr.publish.publisher (torch, the writer) so that a launcher can check a job's
publish store without loading the training stack."""

from __future__ import annotations

from typing import Optional

from cnr.errors import ConfigError
from cnr.storage import open_storage


def default_publish_uri(checkpoint_uri: str) -> str:
    """The publish store of a job checkpointing to ``checkpoint_uri`` that names none (PublishOptions.uri "")."""
    return checkpoint_uri.rstrip("/") + "/publish"


def check_publish_storage(uri: str, checkpoint_uri: Optional[str], name: str = "PublishOptions.uri") -> None:
    """Reject a publish store ``uri`` (the setting ``name``) that overlaps the checkpoint store
    (None: no checkpoints) or cannot be written.

    Both stores use the ``checkpoints/`` layout, so one inside the other's ``checkpoints/``
    prefix (or the same root) would have each side's retention delete the other's objects.
    """
    pub = open_storage(uri)
    try:
        if checkpoint_uri is not None:
            ckpt = open_storage(checkpoint_uri)
            a, b = pub.uri.rstrip("/"), ckpt.uri.rstrip("/")
            ckpt.close()
            if a == b or a.startswith(b + "/checkpoints") or b.startswith(a + "/checkpoints"):
                raise ConfigError(f"{name} {a!r} overlaps the checkpoint storage {b!r}; give publishing "
                                  "its own location (default: <checkpoint storage>/publish)")
        pub.check_writable()
    finally:
        pub.close()
