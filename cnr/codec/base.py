"""The codec seam: the two kinds of stage a chunk's codec chain is made of, and spec helpers.

A chunk's values go through one array->bytes stage (cnr.codec.raw, .rowwise, .log8), whose
output is the payload's value bytes; the payload (row ids, then values) then goes through any
number of bytes->bytes stages (cnr.codec.zstd). Each stage is recorded as a CodecSpec in the
chunk header and in the manifest, so a reader knows the whole chain before it touches a byte.

Encoding is specific to each array codec (it takes a tensor or QuantizedRows and returns its
spec and byte parts), so only decoding, size and parameter checks are part of the interface:
everything a reader needs to verify and invert a chain it did not write.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch

from cnr.errors import CorruptChunkError
from cnr.types import CodecSpec, Encoding

DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
"""Stored dtypes by the name headers and manifests give them."""
DTYPE_NAMES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of a torch dtype as written in headers and manifests."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} cannot be checkpointed; supported: {', '.join(DTYPES)}")
    return DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class ValuesShape:
    """What a chunk header says about its values: ``rows`` rows of ``row_shape`` (``cols`` is
    ``row_shape[0]`` for 2-D tensors, 0 for 1-D ones) of ``dtype`` (a cnr.codec.chunk_format dtype name)."""

    rows: int
    row_shape: Tuple[int, ...]
    cols: int
    dtype: str


@dataclass(frozen=True)
class DecodedValues:
    """An array codec's output: plain ``data`` ``[rows, *row_shape]``, or ``quantized`` rows
    (cnr.codec.quant.quantize.QuantizedRows) left for the caller to dequantize when it needs values."""

    data: Optional[torch.Tensor] = None
    quantized: Optional[Any] = None


class ArrayCodec(abc.ABC):
    """array->bytes: a chunk's values <-> the value bytes of its payload."""

    name: ClassVar[str]
    encoding: ClassVar[Encoding]

    @abc.abstractmethod
    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        """Validate ``spec`` against the header's values; return its parameters."""

    @abc.abstractmethod
    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        """Exact size of the encoded values."""

    @abc.abstractmethod
    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str) -> DecodedValues:
        """Invert the stage; ``data`` is exactly ``value_bytes`` long."""

    @abc.abstractmethod
    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        """(bits, method) as a ChunkRef records them for this stage of values of ``dtype``."""


class BytesCodec(abc.ABC):
    """bytes->bytes: a payload <-> its stored form."""

    name: ClassVar[str]

    @abc.abstractmethod
    def check(self, spec: CodecSpec, where: str) -> None:
        """Validate ``spec``'s parameters."""

    @abc.abstractmethod
    def encode(self, spec: CodecSpec, data: bytes) -> bytes:
        """The stored form of ``data``."""

    @abc.abstractmethod
    def decode(self, spec: CodecSpec, data: memoryview, size: int, where: str) -> bytes:
        """Exactly ``size`` bytes back from stored ``data``, or CorruptChunkError; never more
        memory than ``size`` whatever ``data`` claims."""


def take(data: memoryview, offset: int, count: int, dtype: torch.dtype, where: str) -> Tuple[torch.Tensor, int]:
    """``count`` values of ``dtype`` from ``data[offset:]`` (a copy) and the offset after them."""
    size = count * torch.empty((), dtype=dtype).element_size()
    if offset + size > len(data):
        raise CorruptChunkError(f"{where} payload is too short for its declared contents")
    if count == 0:
        return torch.empty(0, dtype=dtype), offset
    return torch.frombuffer(bytearray(data[offset:offset + size]), dtype=dtype), offset + size


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of ``t``'s memory (1-D, so len() counts bytes): no copy until a join."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def numel(shape: ValuesShape) -> int:
    n = shape.rows
    for s in shape.row_shape:
        n *= s
    return n


Parts = List[memoryview]
