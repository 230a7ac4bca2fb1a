"""``rowwise``: row-wise uniform quantization (cnr.codec.quant.quantize) as an array->bytes stage.

Value bytes: the bit-packed codes ``[rows, packed_bytes_per_row(cols, bits)]`` (cnr.codec.quant.bitpack),
then the per-row scales, then the per-row biases, in the dtypes the spec names. Parameters:
``bits`` (2, 3, 4, 8), ``method`` (a stored uniform method), ``scale`` and ``bias`` ("float16"
or "float32"; float16 for every row of a target with ``serving_params``). Only float32 rows of
shape ``[cols]`` are quantized.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

from cnr.codec.quant.bitpack import packed_bytes_per_row
from cnr.codec.base import (
    DTYPES, ArrayCodec, DecodedValues, Encoded, MergeRows, Target, ValuesShape, dtype_name, take, tensor_bytes,
)
from cnr.codec.spec import make_spec, require_params
from cnr.errors import CorruptChunkError
from cnr.codec.quant.quantize import quantize_rows, quantize_serving_rows, stored_method
from cnr.codec.quant.rows import BITS, QuantizedRows
from cnr.types import STORED_QUANT_METHODS, CodecSpec, Encoding

_PARAM_DTYPES = ("float16", "float32")
_ALLOWED = {"bits": BITS, "method": STORED_QUANT_METHODS, "scale": _PARAM_DTYPES, "bias": _PARAM_DTYPES}


def _encode_quantized(q: QuantizedRows) -> Encoded:
    """The rowwise stage of ``q`` (a uniform method)."""
    if q.method not in STORED_QUANT_METHODS or q.scale is None or q.bias is None:
        raise ValueError(f"method {q.method!r} cannot be checkpointed; allowed: {', '.join(STORED_QUANT_METHODS)}")
    spec = make_spec("rowwise", bits=q.bits, method=q.method, scale=dtype_name(q.scale.dtype),
                     bias=dtype_name(q.bias.dtype))
    shape = ValuesShape(q.rows, (q.dim,), q.dim, "float32")
    return Encoded(spec, shape, [tensor_bytes(q.codes), tensor_bytes(q.scale), tensor_bytes(q.bias)])


def _quantizes(values: torch.Tensor, target: Optional[Target]) -> bool:
    return target is not None and target.bits != 32 and values.dim() == 2


class _QuantizedMergeRows(MergeRows):
    """The merge's rows of a quantized tensor: codes as stored, scales and biases held as float32
    (float16 ones widen exactly); ``half`` says they were all float16, so they are stored narrowed
    back as they were. Never re-quantized."""

    def __init__(self, first: QuantizedRows, rows: int) -> None:
        self.rows, self.bits, self.method, self.dim = rows, first.bits, first.method, first.dim
        self.codes = torch.empty((rows, first.codes.shape[1]), dtype=torch.uint8)
        self.scale, self.bias = torch.empty(rows), torch.empty(rows)
        self.half = (True, True)
        self._narrowed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def place(self, at: Union[slice, torch.Tensor], values: DecodedValues) -> None:
        q = values.stored
        self.codes[at] = q.codes
        self.scale[at] = q.scale.float()
        self.bias[at] = q.bias.float()
        self.half = (self.half[0] and q.scale.dtype == torch.float16, self.half[1] and q.bias.dtype == torch.float16)
        self._narrowed = None

    def _stored(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._narrowed is None:
            self._narrowed = (self.scale.half() if self.half[0] else self.scale,
                              self.bias.half() if self.half[1] else self.bias)
        return self._narrowed

    def row_bytes(self) -> int:
        scale, bias = self._stored()
        return self.codes.shape[1] + scale.element_size() + bias.element_size()

    def block(self, lo: int, hi: int) -> DecodedValues:
        scale, bias = self._stored()
        return DecodedValues(stored=QuantizedRows(bits=self.bits, method=self.method, rows=hi - lo, dim=self.dim,
                                                  codes=self.codes[lo:hi], scale=scale[lo:hi], bias=bias[lo:hi]))


class RowwiseCodec(ArrayCodec):
    """Takes 2-D rows below 32 bits (quantized at the plan's bits with the job's method, or
    QuantizedRows as they are); decodes to QuantizedRows, dequantized by whoever needs values."""

    name = "rowwise"
    encoding = Encoding.QUANTIZED
    plain = False

    def encode(self, values: Any, target: Optional[Target] = None) -> Optional[Encoded]:
        if isinstance(values, QuantizedRows):
            return _encode_quantized(values)
        if not _quantizes(values, target):
            return None
        method = stored_method(target.bits, target.job_bits, target.method)
        quantize = quantize_serving_rows if target.serving_params else quantize_rows
        return _encode_quantized(quantize(values, target.bits, method=method, name=target.name, search=target.search))

    def searched_rows(self, values: torch.Tensor, target: Target) -> int:
        if _quantizes(values, target) and stored_method(target.bits, target.job_bits, target.method) == "adaptive":
            return values.shape[0]
        return 0

    def merge_rows(self, first: DecodedValues, rows: int, dtype: str) -> MergeRows:
        return _QuantizedMergeRows(first.stored, rows)

    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        params = require_params(spec, _ALLOWED, where)
        if shape.row_shape != (shape.cols,) or shape.dtype != "float32":
            raise CorruptChunkError(f"{where} quantized rows must be float32 of shape [cols]")
        return params

    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        p = dict(spec.params)
        per_row = packed_bytes_per_row(shape.cols, p["bits"]) + DTYPES[p["scale"]].itemsize + DTYPES[p["bias"]].itemsize
        return shape.rows * per_row

    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str,
               reference: Optional[torch.Tensor] = None) -> DecodedValues:
        p = dict(spec.params)
        rows, cols, bits = shape.rows, shape.cols, p["bits"]
        width = packed_bytes_per_row(cols, bits)
        codes, offset = take(data, 0, rows * width, torch.uint8, where)
        scale, offset = take(data, offset, rows, DTYPES[p["scale"]], where)
        bias, _ = take(data, offset, rows, DTYPES[p["bias"]], where)
        return DecodedValues(stored=QuantizedRows(bits=bits, method=p["method"], rows=rows, dim=cols,
                                                     codes=codes.reshape(rows, width), scale=scale, bias=bias))

    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        p = dict(spec.params)
        return p["bits"], p["method"]
