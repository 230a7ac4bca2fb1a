"""The codec seam: the two kinds of stage a chunk's codec chain is made of, and spec helpers.

A chunk's values go through one array->bytes stage (cnr.codec.raw, .rowwise, .log8), whose
output is the payload's value bytes; the payload (row ids, then values) then goes through at
most one bytes->bytes stage (cnr.codec.zstd). At most one because a chunk header records only
the payload's size before its bytes stage and after it, not the size between two stages, and a
bytes stage decodes to exactly the size it is told (the manifest and header parsers refuse a
longer chain: cnr.codec.check_chain_names). Each stage is recorded as a CodecSpec in the chunk
header and in the manifest, so a reader knows the whole chain before it touches a byte.

A codec is one module: a class implementing ArrayCodec or BytesCodec (both directions, the
checks a reader needs, and what the writer's plan and the merge need to know: ``compressible``,
``searched_rows``, ``reencode``, ``merge_rows``) plus one ``register`` line in cnr.codec.
cnr.codec.chunk_format (the chunk layout), cnr.write.plan (which codec stores a block) and
cnr.write.merge go through the registry and this interface only.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Union

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
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Stored dtypes by the name headers and manifests give them. Every one is stored by its bytes
(cnr.codec.raw), so bit for bit: a bool is its one byte. A tensor of any other dtype is refused
when a Checkpointer is built (cnr.track.coverage)."""
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


Parts = List[memoryview]
"""Value bytes as the pieces an encoder produced, joined as they are (no copy until the join)."""


def values_shape(data: torch.Tensor) -> ValuesShape:
    """What a chunk header records of plain rows ``data`` ``[rows, *row_shape]``."""
    return ValuesShape(int(data.shape[0]), tuple(int(s) for s in data.shape[1:]),
                       int(data.shape[1]) if data.dim() >= 2 else 0, dtype_name(data.dtype))


@dataclass(frozen=True)
class Encoded:
    """An array codec's output for one chunk: its stage's ``spec``, the ``shape`` the chunk header
    records of the values, and the value ``parts`` (cnr.codec.chunk_format.encode_chunk frames them)."""

    spec: CodecSpec
    shape: ValuesShape
    parts: Parts


@dataclass(frozen=True)
class Target:
    """What the writer's plan (cnr.write.plan) asks of the array codecs for a block of one piece:
    ``bits`` per value (32: exact), the job's own ``job_bits`` and ``method`` (the width and
    quantization method it was configured with), ``search``: the adaptive range search's compiled
    kernels (cnr.codec.quant.range_search.Fused) or None for the eager ones, ``name``: the
    tensor's, for messages; ``serving_params``: quantized rows keep float16 scale and bias (the
    job's CodecPlan.serving_params, for table rows)."""

    bits: int = 32
    job_bits: int = 32
    method: str = ""
    search: Optional[Any] = None
    name: str = ""
    serving_params: bool = False


@dataclass(frozen=True)
class DecodedValues:
    """An array codec's output: plain ``data`` ``[rows, *row_shape]``, or ``stored`` rows left in
    the codec's stored form for the caller to turn into values when it needs them (a StoredRows,
    e.g. cnr.codec.quant.quantize.QuantizedRows)."""

    data: Optional[torch.Tensor] = None
    stored: Optional[Any] = None


class StoredRows(abc.ABC):
    """Rows an array codec decoded without computing their values (``dequantize=False``). The
    quantized rows of cnr.codec.quant.quantize.QuantizedRows are one."""

    rows: int

    @abc.abstractmethod
    def select(self, at: Union[slice, torch.Tensor]) -> "StoredRows":
        """The rows at ``at``: a slice, or int64 local row indexes."""

    @abc.abstractmethod
    def values(self) -> torch.Tensor:
        """Every row as values, ``[rows, *row_shape]``."""

    def values_into(self, out: torch.Tensor) -> torch.Tensor:
        """``values()`` written into ``out`` (same shape; a codec may write there directly)."""
        return out.copy_(self.values())


class MergeRows(abc.ABC):
    """Every row of one column slice of a tensor in its decoded form, as the merge
    (cnr.write.merge) gathers them link by link and then re-encodes them block by block."""

    rows: int

    @abc.abstractmethod
    def place(self, at: Union[slice, torch.Tensor], values: DecodedValues) -> None:
        """Write a chunk's decoded rows at ``at`` (a slice, or global row ids)."""

    @abc.abstractmethod
    def row_bytes(self) -> int:
        """Bytes one row takes in a chunk, for the size of the merged chunks."""

    @abc.abstractmethod
    def block(self, lo: int, hi: int) -> DecodedValues:
        """Rows ``lo..hi-1`` in the form decode gives them."""


class PlainRows(MergeRows):
    """MergeRows of a codec whose decode gives plain values: one tensor of ``dtype``."""

    def __init__(self, rows: int, row_shape: Tuple[int, ...], dtype: str) -> None:
        self.rows = rows
        self.data = torch.empty((rows,) + tuple(row_shape), dtype=DTYPES[dtype])

    def place(self, at: Union[slice, torch.Tensor], values: DecodedValues) -> None:
        self.data[at] = values.data

    def row_bytes(self) -> int:
        return self.data[:1].numel() * self.data.element_size()

    def block(self, lo: int, hi: int) -> DecodedValues:
        return DecodedValues(data=self.data[lo:hi])


class ArrayCodec(abc.ABC):
    """array->bytes: a chunk's values <-> the value bytes of its payload.

    ``encoding``: the Encoding a ChunkRef records for its chunks. ``compressible``: whether the
    writer (cnr.write.plan) and the merge run a job's bytes->bytes stage over its chunks.
    ``plain``: whether decode gives plain values (``data``), which the merge may then mix with
    raw rows of the same tensor (rows it stored raw when ``reencode`` could not reproduce them).
    """

    name: ClassVar[str]
    encoding: ClassVar[Encoding]
    compressible: ClassVar[bool] = True
    plain: ClassVar[bool] = True

    @abc.abstractmethod
    def encode(self, values: Any, target: Optional[Target] = None) -> Optional[Encoded]:
        """The value bytes of ``values``: host rows (a tensor ``[rows, *row_shape]``), or rows in
        this codec's stored form (what decode gives as ``stored``), kept as they are. ``target``:
        what the writer's plan asks for (None: the codec's own choice, e.g. a merge's re-encoding).
        None when this codec does not store these values at ``target``; the plan then asks the
        next codec (cnr.codec.plan_codecs). A value a codec cannot take by contract (a bad
        argument, not a bad fit) raises ValueError instead."""

    def reencode(self, stored: DecodedValues) -> Optional[Encoded]:
        """Rows this codec decoded (``dequantize=False``) encoded so that they decode to exactly
        the same values, or None when they cannot be (the merge then stores them with
        cnr.codec.exact_codec). Default: encode them as they are, which is exact for a lossless
        codec and for a stored form copied as it is."""
        return self.encode(stored.data if stored.stored is None else stored.stored)

    def searched_rows(self, values: torch.Tensor, target: Target) -> int:
        """Rows of ``values`` that ``encode(values, target)`` passes to the adaptive range search
        (cnr.codec.quant.range_search), by which the writer sizes its compiled kernels; 0 here."""
        return 0

    def merge_rows(self, first: DecodedValues, rows: int, dtype: str) -> MergeRows:
        """Room for ``rows`` rows shaped like the decoded chunk ``first`` (of a tensor of stored
        ``dtype``), for the merge. Default: PlainRows, for a codec whose decode gives ``data``."""
        return PlainRows(rows, tuple(first.data.shape[1:]), dtype)

    @abc.abstractmethod
    def check(self, spec: CodecSpec, shape: ValuesShape, where: str) -> Dict[str, Any]:
        """Validate ``spec`` against the header's values; return its parameters."""

    @abc.abstractmethod
    def value_bytes(self, spec: CodecSpec, shape: ValuesShape) -> int:
        """Exact size of the encoded values."""

    @abc.abstractmethod
    def decode(self, spec: CodecSpec, shape: ValuesShape, data: memoryview, where: str,
               reference: Optional[torch.Tensor] = None) -> DecodedValues:
        """Invert the stage; ``data`` is exactly ``value_bytes`` long. ``reference``: the values
        these rows held before (``[rows, *row_shape]``), for a codec that stores rows as a delta
        against them; no codec does today, and readers pass None."""

    @abc.abstractmethod
    def summary(self, spec: CodecSpec, dtype: str) -> Tuple[int, str]:
        """(bits, method) as a ChunkRef records them for this stage of values of ``dtype``."""


class BytesCodec(abc.ABC):
    """bytes->bytes: a payload <-> its stored form (a chain holds at most one such stage)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def check(self, spec: CodecSpec, where: str) -> None:
        """Validate ``spec``'s parameters."""

    @abc.abstractmethod
    def encode(self, spec: CodecSpec, data: bytes) -> bytes:
        """The stored form of ``data``."""

    @abc.abstractmethod
    def decode(self, spec: CodecSpec, data: memoryview, size: int, where: str) -> Union[bytes, memoryview]:
        """Exactly ``size`` bytes back from stored ``data``, or CorruptChunkError; never more
        memory than ``size`` whatever ``data`` claims. A writable result must be a fresh buffer
        the caller owns: the decoded tensors become views of it (``take``)."""


def take(data: memoryview, offset: int, count: int, dtype: torch.dtype, where: str) -> Tuple[torch.Tensor, int]:
    """``count`` values of ``dtype`` from ``data[offset:]`` and the offset after them.

    A writable ``data`` is a buffer this decode owns (a bytes stage's output): the values are a
    view of it where they are aligned for ``dtype``. Read-only ``data`` (the stored blob, which
    a storage may share) and unaligned values are copied, so the result is always writable and
    never aliases what the storage returned."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = count * itemsize
    if offset + size > len(data):
        raise CorruptChunkError(f"{where} payload is too short for its declared contents")
    if count == 0:
        return torch.empty(0, dtype=dtype), offset
    if not data.readonly:
        raw = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=offset)
        if raw.data_ptr() % itemsize == 0:
            return raw.view(dtype), offset + size
    return torch.frombuffer(bytearray(data[offset:offset + size]), dtype=dtype), offset + size


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of ``t``'s memory (1-D, so len() counts bytes): no copy until a join."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def numel(shape: ValuesShape) -> int:
    n = shape.rows
    for s in shape.row_shape:
        n *= s
    return n
