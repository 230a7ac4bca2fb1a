"""``log8``: non-negative values (optimizer accumulators) as one byte each on a log grid.

Code 0 is exactly 0. Codes 1..255 are spaced evenly in log2 between the chunk's smallest and
largest positive value: ``v = 2 ** ((lo + (c - 1) * (hi - lo) / 254) / 16)``, where ``lo``/``hi``
(spec parameters, ints in 1/16 octave) bracket ``16 * log2`` of those values. So the grid adapts
to the chunk's dynamic range and nothing is clipped; the relative error of a value is at most
``2 ** ((hi - lo) / 254 / 32) - 1``: 2.8% for a 20-octave range, 6.2% for 44 octaves (the widest
seen in a bench.yaml row-wise Adagrad table), i.e. 1.4% / 3.0% on ``sqrt`` of a sum of squares,
which is what Adagrad divides by. A row-wise Adagrad sum costs 1 byte per row instead of 4.

Why a log grid: an accumulator of squared gradients spans tens of octaves within one table
(rows touched once against rows touched every step); a linear 8-bit grid would flush the cold
rows to 0. Encoding is deterministic but not idempotent across chunks with different ranges, so
``reencode`` (the merge's, cnr.write.merge) checks that re-encoding reproduces the values, and the
merge stores them raw if not.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from cnr.codec.base import ArrayCodec, DecodedValues, Encoded, Target, ValuesShape, take, tensor_bytes, values_shape
from cnr.codec.spec import make_spec, require_params
from cnr.errors import CorruptChunkError
from cnr.types import CodecSpec, Encoding

STEPS_PER_OCTAVE = 16  # resolution of lo/hi; the code grid itself has 254 steps between them
_LEVELS = 254
_EXP_RANGE = (-150 * STEPS_PER_OCTAVE, 129 * STEPS_PER_OCTAVE)  # float32's positive range, with margin


def log8_applies(values: torch.Tensor) -> bool:
    """Whether ``values`` can be log8-coded: 1-D float32, every value finite and >= 0."""
    return (values.dim() == 1 and values.dtype == torch.float32
            and bool(torch.isfinite(values).all()) and bool((values >= 0).all()))


def log8_codes(values: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """uint8 codes of 1-D non-negative finite ``values`` and the grid's ``(lo, hi)``."""
    if not log8_applies(values):
        raise ValueError("log8 codes only 1-D float32 values that are all finite and >= 0")
    v = values.double()
    positive = v > 0
    codes = torch.zeros(values.shape, dtype=torch.uint8)
    if not bool(positive.any()):
        return codes, 0, 1
    k = torch.log2(v[positive]) * STEPS_PER_OCTAVE
    lo = math.floor(float(k.min()))
    hi = max(math.ceil(float(k.max())), lo + 1)
    codes[positive] = ((k - lo) * (_LEVELS / (hi - lo))).round_().add_(1).clamp_(1, 255).to(torch.uint8)
    return codes, lo, hi


def log8_values(codes: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """float32 values of ``codes`` on the grid ``(lo, hi)``; code 0 is 0."""
    c = codes.double()
    v = torch.exp2((lo + (c - 1) * ((hi - lo) / _LEVELS)) / STEPS_PER_OCTAVE)
    return torch.where(codes == 0, torch.zeros_like(v), v).float()


def _encoded(values: torch.Tensor, codes: torch.Tensor, lo: int, hi: int) -> Encoded:
    return Encoded(make_spec("log8", lo=lo, hi=hi), values_shape(values), [tensor_bytes(codes)])


class Log8Codec(ArrayCodec):
    """Takes what ``log8_applies`` to, below 32 bits (the plan asks it after rowwise)."""

    name = "log8"
    encoding = Encoding.LOG8

    def encode(self, values: torch.Tensor, target: Optional[Target] = None) -> Optional[Encoded]:
        if (target is not None and target.bits == 32) or not log8_applies(values):
            return None  # a 1-D state with negative values stays raw, exact
        return _encoded(values, *log8_codes(values))

    def reencode(self, stored: DecodedValues) -> Optional[Encoded]:
        """log8-coded again when that reproduces ``stored``'s values bit for bit (the grid depends on
        each chunk's range, so it may not), else None."""
        values = stored.data
        if not log8_applies(values):
            return None
        codes, lo, hi = log8_codes(values)
        if not torch.equal(log8_values(codes, lo, hi), values):  # the codec's own kernels: no chunk round trip
            return None
        return _encoded(values, codes, lo, hi)

    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        params = require_params(spec, {"lo": (), "hi": ()}, where)
        lo, hi = params["lo"], params["hi"]
        if not (_EXP_RANGE[0] <= lo < hi <= _EXP_RANGE[1]):
            raise CorruptChunkError(f"{where} log8 grid lo={lo} hi={hi} is not an increasing pair within "
                                    f"{_EXP_RANGE}")
        if shape.row_shape != () or shape.dtype != "float32":
            raise CorruptChunkError(f"{where} log8 values must be 1-D float32")
        return params

    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        return shape.rows

    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str,
               reference: Optional[torch.Tensor] = None) -> DecodedValues:
        p = dict(spec.params)
        codes, _ = take(data, 0, shape.rows, torch.uint8, where)
        return DecodedValues(data=log8_values(codes, p["lo"], p["hi"]))

    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        return 8, "log8"
