"""``raw``: values stored unchanged, little-endian, in the header's dtype (lossless)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from cnr.codec.base import (
    DTYPES, ArrayCodec, DecodedValues, Encoded, Target, ValuesShape, numel, take, tensor_bytes, values_shape,
)
from cnr.codec.spec import make_spec, require_params
from cnr.types import CodecSpec, Encoding

SPEC = make_spec("raw")


class RawCodec(ArrayCodec):
    """Stores any values exactly, whatever the plan's bits. Its chunks skip the job's compression
    (``compressible``; cnr.write.plan.encode_block says why)."""

    name = "raw"
    encoding = Encoding.RAW
    compressible = False

    def encode(self, values: torch.Tensor, target: Optional[Target] = None) -> Optional[Encoded]:
        """``values`` (any stored dtype, host memory) as they are."""
        return Encoded(SPEC, values_shape(values), [tensor_bytes(values)])

    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        return require_params(spec, {}, where)

    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        return numel(shape) * DTYPES[shape.dtype].itemsize

    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str,
               reference: Optional[torch.Tensor] = None) -> DecodedValues:
        values, _ = take(data, 0, numel(shape), DTYPES[shape.dtype], where)
        return DecodedValues(data=values.reshape((shape.rows,) + shape.row_shape))

    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        return DTYPES[dtype].itemsize * 8, ""
