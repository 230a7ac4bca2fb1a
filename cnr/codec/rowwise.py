"""``rowwise``: row-wise uniform quantization (cnr.codec.quant.quantize) as an array->bytes stage.

Value bytes: the bit-packed codes ``[rows, packed_bytes_per_row(cols, bits)]`` (cnr.codec.quant.bitpack),
then the per-row scales, then the per-row biases, in the dtypes the spec names. Parameters:
``bits`` (2, 3, 4, 8), ``method`` (a stored uniform method), ``scale`` and ``bias`` ("float16"
or "float32"). Only float32 rows of shape ``[cols]`` are quantized.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from cnr.codec.quant.bitpack import packed_bytes_per_row
from cnr.codec.base import DTYPES, ArrayCodec, DecodedValues, ValuesShape, dtype_name, take, tensor_bytes
from cnr.codec.spec import make_spec, require_params
from cnr.errors import CorruptChunkError
from cnr.codec.quant.quantize import BITS, QuantizedRows
from cnr.types import STORED_QUANT_METHODS, CodecSpec, Encoding

_PARAM_DTYPES = ("float16", "float32")
_ALLOWED = {"bits": BITS, "method": STORED_QUANT_METHODS, "scale": _PARAM_DTYPES, "bias": _PARAM_DTYPES}


def encode_rowwise(q: QuantizedRows) -> Tuple[CodecSpec, list]:
    """The rowwise stage of ``q`` (a uniform method): its spec and value bytes."""
    if q.method not in STORED_QUANT_METHODS or q.scale is None or q.bias is None:
        raise ValueError(f"method {q.method!r} cannot be checkpointed; allowed: {', '.join(STORED_QUANT_METHODS)}")
    spec = make_spec("rowwise", bits=q.bits, method=q.method, scale=dtype_name(q.scale.dtype),
                     bias=dtype_name(q.bias.dtype))
    return spec, [tensor_bytes(q.codes), tensor_bytes(q.scale), tensor_bytes(q.bias)]


class RowwiseCodec(ArrayCodec):
    name = "rowwise"
    encoding = Encoding.QUANTIZED

    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        params = require_params(spec, _ALLOWED, where)
        if shape.row_shape != (shape.cols,) or shape.dtype != "float32":
            raise CorruptChunkError(f"{where} quantized rows must be float32 of shape [cols]")
        return params

    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        p = dict(spec.params)
        per_row = packed_bytes_per_row(shape.cols, p["bits"]) + DTYPES[p["scale"]].itemsize + DTYPES[p["bias"]].itemsize
        return shape.rows * per_row

    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str) -> DecodedValues:
        p = dict(spec.params)
        rows, cols, bits = shape.rows, shape.cols, p["bits"]
        width = packed_bytes_per_row(cols, bits)
        codes, offset = take(data, 0, rows * width, torch.uint8, where)
        scale, offset = take(data, offset, rows, DTYPES[p["scale"]], where)
        bias, _ = take(data, offset, rows, DTYPES[p["bias"]], where)
        return DecodedValues(quantized=QuantizedRows(bits=bits, method=p["method"], rows=rows, dim=cols,
                                                     codes=codes.reshape(rows, width), scale=scale, bias=bias))

    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        p = dict(spec.params)
        return p["bits"], p["method"]
