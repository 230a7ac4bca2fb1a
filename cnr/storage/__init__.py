"""Storage backends behind one interface; ``open_storage`` opens one from a URI or a StorageSpec.

Schemes map to factories (cnr.storage.registry): "file" (a local path or ``file://PATH``) and
"s3" (``s3://BUCKET[/PREFIX]``) built in, others registered in code or by a ``cnr.storage`` entry
point. A store in front of another subclasses WrapperStorage (cnr.storage.wrapper).
``open_checkpoint_store`` opens a location's store behind its node-local tier
(cnr.storage.checkpoint_store); ``Storage.node_tier()`` says whether a store has one (a NodeTier).
"""

from __future__ import annotations

from cnr.storage.base import NodeTier, Storage, validate_key
from cnr.storage.checkpoint_store import open_checkpoint_store
from cnr.storage.local import LocalStorage
from cnr.storage.registry import StorageFactory, open_storage, register_scheme, schemes, unregister_scheme
from cnr.storage.s3_options import S3Options
from cnr.storage.spec import StorageSpec
from cnr.storage.tiered import TieredStorage
from cnr.storage.wrapper import WrapperStorage

__all__ = ["Storage", "NodeTier", "LocalStorage", "TieredStorage", "WrapperStorage", "StorageSpec", "StorageFactory",
           "S3Options", "open_storage", "open_checkpoint_store", "register_scheme", "unregister_scheme", "schemes",
           "validate_key"]
