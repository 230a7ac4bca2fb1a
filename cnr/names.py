"""Stored tensor names: one type that formats and parses them (cnr.track.app_state lists the forms).

A stored name is ``<key>/<path>`` or ``<key>/<path>/<state>``, no part empty and none holding
"/" (app_state keys, state_dict keys and optimizer state keys hold none):

    <key>/<state_dict key>                    a module's tensor
    <key>/<table weight key>/<fused state>    a fused table's optimizer state (parent: the table's id)
    <key>/<parameter name>/<state key>        an optimizer's state of a parameter
    <key>/rank-<r>/t<i>                       the i-th tensor of a Stateful object's state on rank r
    rng/rank-<r>                              rank r's generator state

``rank-<r>`` (``rank_label``) also names rank r's folder in a checkpoint (cnr.format.layout).
This module sits below cnr.track and cnr.format, which both name tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from cnr.errors import CheckpointError
from cnr.types import RNG_PREFIX

_RANK_LABEL = re.compile(r"rank-(\d{5,})")
_SEP = "/"


def rank_label(rank: int) -> str:
    """``rank-<r>``, the rank in at least 5 digits: a rank's folder and per-rank tensor names."""
    return f"rank-{rank:05d}"


def parse_rank_label(text: str) -> Optional[int]:
    """The rank ``rank_label`` wrote ``text`` for, or None when ``text`` is not of its form."""
    match = _RANK_LABEL.fullmatch(text)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class TensorName:
    """A stored tensor name split into its parts: ``key`` (the app_state key, or "rng"), ``path``
    (the tensor's place under it) and ``state`` (an optimizer state key, a Stateful tensor's
    ``t<i>``; None for a module tensor or RNG state). ``str()`` is the stored name."""

    key: str
    path: str
    state: Optional[str] = None

    def __post_init__(self) -> None:
        parts = [("key", self.key), ("path", self.path)] + ([("state", self.state)] if self.state is not None else [])
        for what, part in parts:
            if not isinstance(part, str) or not part or _SEP in part:
                raise ValueError(f"tensor name {what} {part!r:.80} must be a non-empty string without '/'")

    def __str__(self) -> str:
        head = f"{self.key}{_SEP}{self.path}"
        return head if self.state is None else f"{head}{_SEP}{self.state}"

    @classmethod
    def parse(cls, name: str) -> "TensorName":
        """The parts of stored name ``name``; CheckpointError naming it unless it has 2 or 3
        non-empty parts separated by "/"."""
        parts = name.split(_SEP) if isinstance(name, str) else []
        if len(parts) not in (2, 3) or not all(parts):
            raise CheckpointError(f"stored tensor name {name!r:.200} is malformed: expected <key>/<path> or "
                                  "<key>/<path>/<state>, with no part empty")
        return cls(*parts)

    @property
    def parent(self) -> str:
        """``<key>/<path>``: for a state, the stored name of the tensor it belongs to (a fused
        table's state: the table's id)."""
        return f"{self.key}{_SEP}{self.path}"

    @property
    def rank(self) -> Optional[int]:
        """The rank of a per-rank name (Stateful tensor, RNG state), else None."""
        return parse_rank_label(self.path)


def stateful_name(key: str, rank: int, i: int) -> str:
    """The stored name of the ``i``-th tensor of app_state[key]'s Stateful state on ``rank``."""
    return str(TensorName(key, rank_label(rank), f"t{i}"))


def rng_name(rank: int) -> str:
    """The stored name of ``rank``'s generator state."""
    return RNG_PREFIX + rank_label(rank)
