"""Synthetic Criteo-like click stream with power-law ids and labels from a hidden teacher.

Every global batch is a pure function of (seed, split, g, batch_size, features, num_dense,
power_law_exponent, ids_per_feature), so readers of any rank/world size agree on the content
of each global batch and resuming from a cursor is exact.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from cnr.errors import ConfigError
from cnr.readers.batch import (
    Batch,
    check_int,
    check_positive_float,
    cursor_start,
    RawBatch,
    global_batch_index,
    to_batch,
    validate_common,
)

SPLITS = ("train", "eval")
# rank*multiplier < rows^2 must fit in uint64 for the vectorised permutation below.
MAX_ROWS = 1 << 32

# Teacher scale: std of the sparse and dense logit parts and the bias. Chosen so the
# teacher logit separates labels clearly (AUC ~0.8) while ~30% of labels are positive.
_SPARSE_SCALE = 1.5
_DENSE_SCALE = 1.0
_BIAS = -1.2
_U64 = np.uint64
_EULER_GAMMA = 0.5772156649015329


def _stable_u64(*parts: object) -> int:
    """64-bit hash of ``parts`` that is stable across processes and Python versions."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array: a cheap, well-mixed integer hash (wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> _U64(30))
        x = x * _U64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> _U64(27))
        x = x * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def power_law_ranks(u: np.ndarray, rows: np.ndarray, exponent: float) -> np.ndarray:
    """Map uniforms ``u`` in [0, 1) to popularity ranks in ``[0, rows)`` (broadcasting).

    Inverse CDF of the continuous power law with density ∝ x^-a on [1, rows+1), floored:
    P(rank = k) = ((k+2)^(1-a) - (k+1)^(1-a)) / ((rows+1)^(1-a) - 1), i.e. ∝ ∫_{k+1}^{k+2} x^-a dx
    ≈ (k+1.5)^-a (for a = 1: log((k+2)/(k+1)) / log(rows+1)).
    """
    log_top = np.log(rows.astype(np.float64) + 1.0)
    one_minus_a = 1.0 - exponent
    if abs(one_minus_a) < 1e-9:
        x = np.exp(u * log_top)
    else:
        # expm1/log1p keep precision when the exponent is close to 1.
        x = np.exp(np.log1p(u * np.expm1(one_minus_a * log_top)) / one_minus_a)
    ranks = np.floor(x).astype(np.int64) - 1
    # Float rounding can land exactly on rows+1; clamp to keep the invariant rank < rows.
    return np.clip(ranks, 0, rows.astype(np.int64) - 1)


class SyntheticReader:
    """Infinite synthetic stream; see the module docstring and ``cnr.readers.batch`` for the protocol.

    Sample content (global batch ``g``, generated with a PCG64 seeded by a hash of
    (seed, split, g), drawn in this order):

    - sparse: ``ids_per_feature`` ids per sample per feature. Popularity rank ``k`` follows
      :func:`power_law_ranks` with ``power_law_exponent`` (> 0; larger = more skewed) and is
      mapped to a row by the per-feature affine bijection ``(k * m_f + c_f) mod rows_f``
      (``gcd(m_f, rows_f) = 1``, m_f and c_f from the seed) so hot rows spread over the table.
    - dense: ``log1p(s_j * Exp(1))`` per column j, s_j = 10^U(0,3) fixed from the seed:
      non-negative, heavy-ish tailed, float32.
    - label ~ Bernoulli(sigmoid(teacher logit)), see :meth:`teacher_logits`.

    ``split="eval"`` is a held-out stream with the same distribution and the same teacher.
    Rows per table are limited to 2^32 (the bijection is computed in uint64).
    """

    def __init__(
        self,
        features: Sequence[Tuple[str, int]],
        num_dense: int,
        batch_size: int,
        rank: int,
        world_size: int,
        cursor: Optional[Mapping[str, Any]] = None,
        *,
        seed: int,
        power_law_exponent: float,
        ids_per_feature: int = 1,
        split: str = "train",
    ) -> None:
        self._features = validate_common(features, num_dense, batch_size, rank, world_size,
                                         max_rows=MAX_ROWS)
        check_int("seed", seed, -(1 << 63), (1 << 64) - 1)
        self._exponent = check_positive_float("power_law_exponent", power_law_exponent)
        self._ids_per_feature = check_int("ids_per_feature", ids_per_feature, 1)
        if split not in SPLITS:
            raise ConfigError(f"split={split!r} is not allowed: it must be one of {list(SPLITS)}")
        self._start = cursor_start(cursor, "synthetic")
        extra = set(cursor or {}) - {"kind", "next_batch"}
        if extra:
            raise ConfigError(f"cursor keys {sorted(extra)} are not allowed in a synthetic "
                              "cursor: it holds only 'kind' and 'next_batch'")
        self._num_dense = int(num_dense)
        self._batch_size = int(batch_size)
        self._rank = int(rank)
        self._world_size = int(world_size)
        self._seed = int(seed)
        self._split = split
        self._read = 0  # batches this reader has returned

        # Fixed per-seed parameters; the same for every split, so eval shares the teacher.
        names = [n for n, _ in self._features]
        self._names = names
        rows = np.array([r for _, r in self._features], dtype=np.uint64)
        self._rows = rows[:, None]  # [F, 1] broadcasts over samples
        mults, offs, salts = [], [], []
        for name, r in self._features:
            m = 1 + _stable_u64("cnr-synth-mult", self._seed, name) % max(r - 1, 1)
            while math.gcd(m, r) != 1:  # a few steps at most on average
                m = m % (r - 1) + 1 if r > 2 else 1
            mults.append(m)
            offs.append(_stable_u64("cnr-synth-off", self._seed, name) % r)
            salts.append(_stable_u64("cnr-synth-salt", self._seed, name))
        self._mults = np.array(mults, dtype=np.uint64)[:, None]
        self._offs = np.array(offs, dtype=np.uint64)[:, None]
        self._salts = np.array(salts, dtype=np.uint64)[:, None, None]
        prng = np.random.Generator(np.random.PCG64(_stable_u64("cnr-synth-params", self._seed)))
        self._dense_scale = 10.0 ** prng.uniform(0.0, 3.0, size=self._num_dense)
        # E[log(s*Exp(1))] = log(s) - Euler's gamma: approximately centres each column.
        self._dense_center = np.log1p(self._dense_scale) - _EULER_GAMMA
        self._dense_v = prng.standard_normal(self._num_dense)

    @property
    def features(self) -> Tuple[Tuple[str, int], ...]:
        """``(name, table_rows)`` pairs in KJT key order."""
        return self._features

    def cursor(self) -> Dict[str, Any]:
        """``{"kind": "synthetic", "next_batch": start + k*W}`` after k reads; no side effects."""
        return {"kind": "synthetic", "next_batch": self._start + self._read * self._world_size}

    def next_batch(self) -> Batch:
        """This rank's next batch: global batch ``start + rank + k*world_size``. Never ends."""
        return to_batch(self._names, self.next_raw())

    def next_raw(self) -> RawBatch:
        """:meth:`next_batch` as numpy arrays (no torch tensors, no KJT)."""
        g = global_batch_index(self._start, self._rank, self._world_size, self._read)
        raw = self.global_raw(g)
        self._read += 1
        return raw

    def skip_batch(self) -> None:
        """Move the cursor past this rank's next batch without generating it."""
        self._read += 1

    def __iter__(self) -> "SyntheticReader":
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def global_batch(self, g: int) -> Batch:
        """Global batch ``g`` of this split; pure (does not move the cursor)."""
        return to_batch(self._names, self.global_raw(g))

    def global_raw(self, g: int) -> RawBatch:
        """:meth:`global_batch` as numpy arrays; pure."""
        g = check_int("global batch", g, 0)
        b, f, l = self._batch_size, len(self._features), self._ids_per_feature
        rng = np.random.Generator(np.random.PCG64(
            _stable_u64("cnr-synth-batch", self._seed, self._split, g)))
        u = rng.random((f, b * l))
        ranks = power_law_ranks(u, self._rows, self._exponent).astype(np.uint64)
        # rank < rows and m < rows <= 2^32, so rank*m + c < rows^2 fits in uint64.
        ids = ((ranks * self._mults + self._offs) % self._rows).astype(np.int64)
        dense = np.log1p(self._dense_scale * rng.standard_exponential((b, self._num_dense)))
        dense = dense.astype(np.float32)
        logits = self._teacher_np(ids.reshape(f, b, l), dense)
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        return RawBatch(ids, l, dense, labels, g)

    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """Hidden teacher's logit per sample, float64 ``[B]``; labels ~ Bernoulli(sigmoid(.)).

        logit = 1.5 * sum_{f, ids} w_f(id) / sqrt(F * ids_per_feature)
              + 1.0 * sum_j v_j * (dense_j - log1p(s_j) + 0.5772) / sqrt(num_dense) - 1.2,
        where w_f(id) is uniform on [-sqrt 3, sqrt 3] (unit variance) from a splitmix64 hash of
        (id + per-feature salt) -- no per-row tables -- and v_j ~ N(0, 1) fixed from the seed.
        """
        b, f = batch.batch_size, len(self._features)
        ids = batch.sparse.values().numpy().reshape(f, b, -1)
        return torch.from_numpy(self._teacher_np(ids, batch.dense.numpy()))

    def _teacher_np(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """Teacher logits, float64 ``[B]``, from ids ``[F, B, L]`` and float32 dense ``[B, D]``."""
        f, _, l = ids.shape
        with np.errstate(over="ignore"):
            h = _mix64(ids.astype(np.uint64) + self._salts)
        # Top 53 bits -> uniform [0, 1) -> centred, unit variance.
        w = ((h >> _U64(11)).astype(np.float64) * 2.0 ** -53 - 0.5) * math.sqrt(12.0)
        logit = _SPARSE_SCALE * w.sum(axis=(0, 2)) / math.sqrt(f * l) + _BIAS
        if self._num_dense:
            centred = dense.astype(np.float64) - self._dense_center
            logit += _DENSE_SCALE * (centred @ self._dense_v) / math.sqrt(self._num_dense)
        return logit
