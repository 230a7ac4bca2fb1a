"""The batch type every reader yields, reader errors, and the rank/cursor protocol they share.

Stream protocol (both readers): the global sample stream is cut into global batches of
``batch_size`` samples; global batch ``g`` holds samples ``g*B .. g*B+B-1``. Rank ``r`` of ``W``
reads global batches ``start + r + k*W`` (k = 0, 1, ...), where ``start`` is the cursor's
``next_batch``. After ``k`` reads every rank's cursor says ``next_batch = start + k*W``, so a
reader of any rank and any world size resumes from rank 0's cursor with exactly the batches no
rank has read yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cnr.errors import CnrError, ConfigError

Features = Tuple[Tuple[str, int], ...]


class DataExhaustedError(CnrError):
    """A finite reader has no complete global batch left to return."""


class MalformedDataError(CnrError):
    """An input record cannot be parsed; the message names the file, 1-based line and problem."""


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value to compare
class Batch:
    """One rank's batch of ``B`` samples.

    - ``dense``: float32 ``[B, num_dense]``.
    - ``sparse``: KJT whose keys are the feature names in the reader's order; values int64 row
      ids (each < that feature's table rows), lengths int32 ``[num_features * B]`` feature-major.
    - ``labels``: float32 ``[B]``, every value 0.0 or 1.0.
    - ``sample_ids``: int64 ``[B]``, the global index of each sample in the stream
      (global batch ``g`` holds ``g*B .. g*B+B-1``); used to prove each sample trains once.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    sample_ids: torch.Tensor

    def __post_init__(self) -> None:
        # Cheap shape/dtype checks: a reader bug here would otherwise surface deep in training.
        b = int(self.labels.shape[0]) if self.labels.dim() == 1 else -1
        if self.dense.dim() != 2 or self.dense.dtype != torch.float32 or self.dense.shape[0] != b:
            raise ValueError(f"Batch.dense must be float32 [B, num_dense], got {self.dense.dtype} "
                             f"{tuple(self.dense.shape)} with B={b}")
        if self.labels.dtype != torch.float32:
            raise ValueError(f"Batch.labels must be float32 [B], got {self.labels.dtype}")
        if self.sample_ids.dtype != torch.int64 or tuple(self.sample_ids.shape) != (b,):
            raise ValueError(f"Batch.sample_ids must be int64 [{b}], got {self.sample_ids.dtype} "
                             f"{tuple(self.sample_ids.shape)}")
        if self.sparse.stride() != b:
            raise ValueError(f"Batch.sparse has stride {self.sparse.stride()}, expected B={b}")

    @property
    def batch_size(self) -> int:
        """Number of samples ``B``."""
        return int(self.labels.shape[0])

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "Batch":
        """A copy of this batch on ``device``."""
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(torch.device(device), non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            sample_ids=self.sample_ids.to(device, non_blocking=non_blocking),
        )


def check_int(name: str, value: Any, minimum: int, maximum: Optional[int] = None) -> int:
    """Return ``value`` if it is an int (not bool) in ``[minimum, maximum]``, else ConfigError."""
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name}={value!r} is not allowed: it must be an integer {allowed}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(f"{name}={value!r} is not allowed: it must be an integer {allowed}")
    return int(value)


def check_positive_float(name: str, value: Any) -> float:
    """Return ``value`` as float if it is a finite real number > 0, else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a finite number > 0")
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a finite number > 0")
    return v


def validate_features(features: Any, max_rows: Optional[int] = None) -> Features:
    """Validate ``(name, table_rows)`` pairs: non-empty, unique non-empty names, rows >= 1."""
    if isinstance(features, (str, bytes)) or not isinstance(features, Sequence) or not features:
        raise ConfigError(f"features={features!r} is not allowed: it must be a non-empty "
                          "sequence of (name, table_rows) pairs")
    out = []
    seen = set()
    for i, item in enumerate(features):
        if not isinstance(item, Sequence) or isinstance(item, (str, bytes)) or len(item) != 2:
            raise ConfigError(f"features[{i}]={item!r} is not allowed: it must be a "
                              "(name, table_rows) pair")
        name, rows = item
        if not isinstance(name, str) or not name:
            raise ConfigError(f"features[{i}] name {name!r} is not allowed: it must be a "
                              "non-empty string")
        if name in seen:
            raise ConfigError(f"features[{i}] name {name!r} is not allowed: names must be unique")
        seen.add(name)
        out.append((name, check_int(f"table_rows of feature {name!r}", rows, 1, max_rows)))
    return tuple(out)


def validate_common(features: Any, num_dense: Any, batch_size: Any, rank: Any,
                    world_size: Any, max_rows: Optional[int] = None) -> Features:
    """Validate the arguments both readers share; return the normalised feature list."""
    feats = validate_features(features, max_rows)
    check_int("num_dense", num_dense, 0)
    check_int("batch_size", batch_size, 1)
    check_int("world_size", world_size, 1)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not (
            0 <= rank < world_size):
        raise ConfigError(f"rank={rank!r} is not allowed: it must be an integer in "
                          f"[0, world_size-1] = [0, {world_size - 1}]")
    return feats


def cursor_start(cursor: Optional[Mapping[str, Any]], kind: str) -> int:
    """Validate ``cursor``'s dict shape, ``kind`` and ``next_batch``; return ``next_batch``.

    ``None`` means the start of the stream (0). Reader-specific keys are checked by the caller.
    """
    if cursor is None:
        return 0
    if not isinstance(cursor, Mapping):
        raise ConfigError(f"cursor={cursor!r} is not allowed: it must be a dict or None")
    if cursor.get("kind") != kind:
        raise ConfigError(f"cursor kind {cursor.get('kind')!r} is not allowed: this reader "
                          f"needs a {kind!r} cursor")
    if "next_batch" not in cursor:
        raise ConfigError(f"cursor {dict(cursor)!r} is not allowed: it has no 'next_batch'")
    return check_int("cursor['next_batch']", cursor["next_batch"], 0)


def global_batch_index(start: int, rank: int, world_size: int, k: int) -> int:
    """Global batch that rank ``rank`` reads as its ``k``-th (0-based) batch after ``start``."""
    return start + rank + k * world_size


class RawBatch(NamedTuple):
    """One rank's batch as numpy arrays: what reader processes send to the trainer.

    ``ids``: int64 ``[num_features, B * ids_per_sample]``, feature-major, sample-minor (the KJT
    values layout with constant lengths). ``dense``: float32 ``[B, D]``. ``labels``: float32
    ``[B]``, 0/1. ``global_batch``: ``g``; the samples are ``g*B .. g*B+B-1``.
    """

    ids: np.ndarray
    ids_per_sample: int
    dense: np.ndarray
    labels: np.ndarray
    global_batch: int


def to_batch(names: Sequence[str], raw: RawBatch) -> Batch:
    """The Batch (torch tensors, KJT keyed by ``names``) holding ``raw``."""
    return make_batch(names, raw.ids, raw.ids_per_sample, raw.dense, raw.labels, raw.global_batch)


def make_batch(names: Sequence[str], ids: np.ndarray, ids_per_sample: int, dense: np.ndarray,
               labels: np.ndarray, global_batch: int) -> Batch:
    """Assemble a Batch from numpy arrays laid out as in :class:`RawBatch`."""
    b = int(labels.shape[0])
    lengths = torch.full((len(names) * b,), ids_per_sample, dtype=torch.int32)
    sparse = KeyedJaggedTensor(
        keys=list(names),
        values=torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)),
        lengths=lengths,
    )
    return Batch(
        dense=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse=sparse,
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
        sample_ids=torch.arange(global_batch * b, (global_batch + 1) * b, dtype=torch.int64),
    )
