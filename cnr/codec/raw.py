"""``raw``: values stored unchanged, little-endian, in the header's dtype (lossless)."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from cnr.codec.base import DTYPES, ArrayCodec, DecodedValues, ValuesShape, numel, take, tensor_bytes
from cnr.codec.spec import make_spec, require_params
from cnr.types import CodecSpec, Encoding

SPEC = make_spec("raw")


def encode_raw(values: torch.Tensor) -> Tuple[CodecSpec, list]:
    """The raw stage of ``values`` (any stored dtype, host memory): its spec and value bytes."""
    return SPEC, [tensor_bytes(values)]


class RawCodec(ArrayCodec):
    name = "raw"
    encoding = Encoding.RAW

    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        return require_params(spec, {}, where)

    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        return numel(shape) * DTYPES[shape.dtype].itemsize

    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str) -> DecodedValues:
        values, _ = take(data, 0, numel(shape), DTYPES[shape.dtype], where)
        return DecodedValues(data=values.reshape((shape.rows,) + shape.row_shape))

    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        return DTYPES[dtype].itemsize * 8, ""
