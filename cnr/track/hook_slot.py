"""cnr's share of torchrec's single post-lookup hook slot of a sharded embedding module.

torchrec 1.8's sharded EBC/EC modules hold ONE callable, ``post_lookup_tracker_fn``, called after
each lookup; ``register_post_lookup_tracker_fn`` overwrites whatever is there (with only a logged
warning) and torchrec offers no call to remove it. So two cnr trackers (two Checkpointers, or a
Checkpointer and a publish-only tracker) registered directly would silently steal each other's
rows. Instead cnr puts one ``LookupHooks`` dispatcher in the slot, shared by every cnr tracker of
that module, and refuses a slot held by anything else (torchrec's ModelDeltaTracker, a user's
hook): cnr cannot share the slot with it without one of the two losing rows.

Removal sets the attribute back to None: it is the attribute torchrec's forward tests
(``if self.post_lookup_tracker_fn is not None``), and None is its initial value.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Tuple

import torch

from cnr.errors import CheckpointError

SLOT = "post_lookup_tracker_fn"  # the attribute torchrec's forward calls (embedding_types.py)


class TrackerHookError(CheckpointError):
    """torchrec's post-lookup hook slot of a sharded module is held by a hook that is not cnr's."""


class LookupHooks:
    """cnr's occupant of one module's slot: calls ``record`` of every cnr tracker installed there.

    Trackers are held strongly: a tracker records until ``detach`` (RowTracker.uninstall, which
    Checkpointer.close and abort call).
    """

    __slots__ = ("trackers",)

    def __init__(self) -> None:
        self.trackers: Tuple[Any, ...] = ()

    def __call__(self, features, embeddings=None, module=None, raw_ids=None) -> None:
        for tracker in self.trackers:
            tracker.record(features, embeddings, module, raw_ids)

    def __repr__(self) -> str:
        return f"cnr.LookupHooks({len(self.trackers)} trackers)"


def occupant(module: torch.nn.Module) -> Optional[Callable[..., None]]:
    """What the module's slot holds now (None when empty)."""
    return getattr(module, SLOT, None)


def foreign(module: torch.nn.Module) -> Optional[Callable[..., None]]:
    """The slot's hook when it is there and not cnr's dispatcher, else None."""
    fn = occupant(module)
    return None if fn is None or isinstance(fn, LookupHooks) else fn


def refusal(name: str, fn: Callable[..., None]) -> str:
    """The message for a foreign hook ``fn`` in the slot of module ``name``."""
    return (f"the sharded module {name} already has a post-lookup hook that is not cnr's ({describe(fn)}); "
            "torchrec gives each module one such slot and cnr cannot share it with another hook (one of the "
            "two would miss rows). Remove that hook (e.g. do not build torchrec's ModelDeltaTracker on this "
            "model, or let cnr read it: CheckpointOptions(tracker='torchrec')), or checkpoint with "
            "CheckpointOptions(policy='full'), which needs no tracker")


def attach(module: torch.nn.Module, name: str, tracker: Any) -> None:
    """Add ``tracker`` to the module's dispatcher, putting one in an empty slot; a foreign hook
    raises TrackerHookError. Attaching a tracker twice is a no-op."""
    fn = foreign(module)
    if fn is not None:
        raise TrackerHookError(refusal(name, fn))
    hooks = occupant(module)
    if hooks is None:
        hooks = LookupHooks()
        module.register_post_lookup_tracker_fn(hooks)  # the slot is empty: torchrec logs nothing
    if not any(t is tracker for t in hooks.trackers):
        hooks.trackers = hooks.trackers + (tracker,)


def detach(module: torch.nn.Module, tracker: Any) -> None:
    """Remove ``tracker`` from the module's dispatcher; the last one out empties the slot (set to
    None: torchrec has no unregister call). A slot taken by a foreign hook is left as it is."""
    hooks = occupant(module)
    if not isinstance(hooks, LookupHooks):
        return
    hooks.trackers = tuple(t for t in hooks.trackers if t is not tracker)
    if not hooks.trackers:
        setattr(module, SLOT, None)


def holds(module: torch.nn.Module, tracker: Any) -> bool:
    """Whether the module's slot still calls ``tracker`` (through cnr's dispatcher)."""
    hooks = occupant(module)
    return isinstance(hooks, LookupHooks) and any(t is tracker for t in hooks.trackers)


def describe(fn: Callable[..., None]) -> str:
    """``fn``'s dotted name, its class's for a bound method (``...ModelDeltaTrackerTrec.record_lookup``)."""
    if inspect.ismethod(fn):
        owner = type(fn.__self__)
        return f"{owner.__module__}.{owner.__qualname__}.{fn.__name__}"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module != "builtins" else name
