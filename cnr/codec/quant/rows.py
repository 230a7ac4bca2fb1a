"""The stored form of row-wise quantized rows (cnr.codec.quant.quantize makes them): packed codes
and per-row float16/float32 scale and bias, with the bit-widths and methods they may have."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple, Union

import torch

from cnr.codec.base import StoredRows
from cnr.codec.quant.bitpack import packed_bytes_per_row
from cnr.codec.quant.dequantize import dequantize_rows
from cnr.errors import ConfigError

BITS: Tuple[int, ...] = (2, 3, 4, 8)
METHODS: Tuple[str, ...] = ("naive", "symmetric", "adaptive")  # k-means, a loss reference: cnr.bench.kmeans


@dataclass(frozen=True)
class QuantizedRows(StoredRows):
    """``rows`` quantized rows of ``dim`` values each.

    ``codes``: uint8 ``[rows, packed_bytes_per_row(dim, bits)]``, bit-packed per row (cnr.codec.quant.bitpack).
    ``scale`` and ``bias`` are 1-D ``[rows]`` float16 or float32 and ``value = code * scale + bias``.
    """

    bits: int
    method: str
    rows: int
    dim: int
    codes: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor

    def __post_init__(self) -> None:
        check_bits(self.bits)
        check_method(self.method)
        for label, value in (("rows", self.rows), ("dim", self.dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"QuantizedRows {label}={value!r} is not allowed; it must be an int >= 0")
        _check_tensor("codes", self.codes, (torch.uint8,), (self.rows, packed_bytes_per_row(self.dim, self.bits)))
        _check_tensor("scale", self.scale, (torch.float16, torch.float32), (self.rows,))
        _check_tensor("bias", self.bias, (torch.float16, torch.float32), (self.rows,))

    @property
    def nbytes(self) -> int:
        """Exact encoded size in bytes: packed codes plus per-row scale and bias."""
        return self.codes.numel() + sum(t.numel() * t.element_size() for t in (self.scale, self.bias))

    def select(self, at: Union[slice, torch.Tensor]) -> "QuantizedRows":
        """These rows at ``at``: a slice (views) or int64 local row indexes (copies). With
        ``values`` this is the stored form a rowwise chunk decodes to (cnr.codec.base.StoredRows):
        dequantizing the selected rows is bit-identical to the same rows of the whole (per-row ops)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[at] if isinstance(at, slice) else t.index_select(0, at)

        codes = pick(self.codes)
        # rows of checked rows are well formed: built without __post_init__'s checks (a restore
        # selects a block or an increment's run some thousand times)
        picked = {"rows": codes.shape[0], "codes": codes, "scale": pick(self.scale), "bias": pick(self.bias)}
        rows = object.__new__(QuantizedRows)
        for f in dataclasses.fields(self):
            object.__setattr__(rows, f.name, picked.get(f.name, getattr(self, f.name)))
        return rows

    def values(self) -> torch.Tensor:
        """float32 ``[rows, dim]``: the rows dequantized (dequantize_rows)."""
        return dequantize_rows(self)

    def values_into(self, out: torch.Tensor) -> torch.Tensor:
        """``values()`` written into ``out`` (``[rows, dim]``), bit for bit: computed there when it
        is float32 on the host, else computed and copied (converted, or to its device)."""
        if out.dtype != torch.float32 or out.device.type != "cpu":
            return super().values_into(out)
        return dequantize_rows(self, out=out)


def _check_tensor(label: str, t: object, dtypes: Tuple[torch.dtype, ...], shape: Tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or tuple(t.shape) != shape:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        allowed = " or ".join(str(d) for d in dtypes)
        raise ConfigError(f"QuantizedRows {label} is {got}; it must be {allowed} with shape {shape}")


def check_bits(bits: object) -> None:
    """Raise ConfigError unless ``bits`` is one of BITS (an int, not a bool)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ConfigError(f"bits={bits!r} is not allowed; allowed: {', '.join(map(str, BITS))}")


def check_method(method: object) -> None:
    """Raise ConfigError unless ``method`` is one of METHODS."""
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not allowed; allowed: {', '.join(METHODS)}")
