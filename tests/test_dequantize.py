"""cnr.codec.quant.dequantize: fbgemm's unpack bit-identical to the shift/mask one, and values
written into a given tensor bit-identical to new ones, for every width, method and parameter dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cnr.codec.quant import dequantize
from cnr.codec.quant.bitpack import unpack
from cnr.codec.quant.dequantize import codes_as_float, dequantize_rows
from cnr.codec.quant.quantize import quantize_rows


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [1, 3, 63, 64])
def test_fbgemm_unpack_is_bit_identical_to_the_shift_mask_one(bits: int, dim: int) -> None:
    fbgemm_gpu = pytest.importorskip("fbgemm_gpu")  # loads torch.ops.fbgemm: the fast path is on
    assert fbgemm_gpu is not None and dequantize._fbgemm_nbit_to_float() is not None
    g = torch.Generator().manual_seed(bits * 100 + dim)
    x = torch.randn(300, dim, generator=g) * torch.logspace(-3, 2, 300).unsqueeze(1)
    q = quantize_rows(x, bits)
    codes = unpack(q.codes, bits, dim)
    fast = codes_as_float(q)
    assert fast.shape == (300, dim) and fast.is_contiguous() and torch.equal(fast, codes.float())
    expected = codes.float().mul_(q.scale.float().unsqueeze(1)).add_(q.bias.float().unsqueeze(1))
    assert torch.equal(dequantize_rows(q), expected)


def test_without_fbgemm_the_shift_mask_unpack_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dequantize, "_fbgemm_nbit_to_float", lambda: None)
    q = quantize_rows(torch.randn(10, 7), 4)
    assert torch.equal(codes_as_float(q), unpack(q.codes, 4, 7).float())


@pytest.mark.parametrize("bits,method", [(2, "adaptive"), (3, "adaptive"), (4, "naive"), (8, "naive")])
@pytest.mark.parametrize("params", [torch.float16, torch.float32])
@pytest.mark.parametrize("where", ["rows of a table", "columns of a table"])
def test_values_written_into_a_given_tensor_are_bit_identical(bits: int, method: str, params: torch.dtype,
                                                              where: str) -> None:
    """``dequantize_rows(q, out)`` into a view of a bigger tensor (some rows of it, contiguous, or
    some columns, strided) writes there exactly ``dequantize_rows(q)``, and nothing else."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(50, 9, generator=g) * torch.logspace(-2, 2, 50).unsqueeze(1)
    q = quantize_rows(x, bits, method)
    # scales and biases off float16's grid when float32 (else the same numbers)
    nudge = 1 + 2.0 ** -18 if params == torch.float32 else 1.0
    q = dataclasses.replace(q, scale=q.scale.to(params) * nudge, bias=q.bias.to(params) * nudge)
    table = torch.full((70, 12 if where == "columns of a table" else 9), -3.0)
    out = table[10:60, :9]  # strided when the table is wider
    before = table.clone()
    returned = q.values_into(out)
    assert returned.data_ptr() == out.data_ptr() and torch.equal(out, dequantize_rows(q))
    mask = torch.ones_like(table, dtype=torch.bool)
    mask[10:60, :9] = False
    assert torch.equal(table[mask], before[mask])  # nothing outside ``out`` written
