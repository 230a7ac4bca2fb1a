"""torchrec's sharded embedding modules inside a module, as cnr finds them (cnr.track.app_state
for the tables they hold, cnr.track.managed_collision for the managed-collision wrappers)."""

from __future__ import annotations

from typing import List, Tuple

import torch


def is_managed_collision(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torchrec's sharded MC-EC / MC-EBC: a wrapper whose tables live in its
    ``_embedding_module`` (cnr.track.managed_collision)."""
    return hasattr(module, "_managed_collision_collection") and hasattr(module, "_embedding_module") \
        and hasattr(module, "register_post_lookup_tracker_fn")


def embedding_modules(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(path as in ``module.state_dict()`` keys, module) for every torchrec sharded embedding
    module inside ``module``, managed-collision wrappers as they are. DMP's and DDP's wrapper
    levels are not part of the state_dict keys, so they are left out of the path."""
    out: List[Tuple[str, torch.nn.Module]] = []

    def walk(parent: torch.nn.Module, prefix: str) -> None:
        for name, child in parent.named_children():
            wrapper = (name == "_dmp_wrapped_module" and hasattr(parent, "_dmp_wrapped_module")) or \
                (name == "module" and isinstance(parent, torch.nn.parallel.DistributedDataParallel))
            path = prefix if wrapper else (f"{prefix}.{name}" if prefix else name)
            if hasattr(child, "register_post_lookup_tracker_fn"):
                out.append((path, child))
            else:
                walk(child, path)

    walk(module, "")
    return out
