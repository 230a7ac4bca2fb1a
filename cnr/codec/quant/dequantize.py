"""Dequantizing row-wise quantized rows (cnr.codec.quant.quantize.QuantizedRows) to float32.

Uniform methods compute ``code * float32(scale)``, then ``+ float32(bias)``: two rounded ops, no
fused multiply-add, the order the quantizer's search measured its error in
(cnr.codec.quant.quantize._fake_quant), so a restored value is the value the search chose.
Every op is per row: the values of some rows of a chunk are
bit-identical to the same rows of the whole chunk dequantized.

``dequantize_rows(q, out)`` writes into ``out`` (a float32 view of the model's rows, say) instead
of a new tensor: a restore then writes each block once, not into a temporary and again into
the model (4-7% of a 2-bit baseline restore on bench.yaml, in one process, interleaved).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from cnr.codec.quant.bitpack import unpack

QuantizedRows = Any  # cnr.codec.quant.rows.QuantizedRows, which imports this module

# fp16 scale 1.0 and bias 0.0, the tail of a row in fbgemm's fused n-bit layout
_UNIT_SCALE_BIAS = torch.tensor([1.0, 0.0], dtype=torch.float16).view(torch.uint8)


def _fbgemm_nbit_to_float() -> Optional[Callable[[torch.Tensor, int], torch.Tensor]]:
    """fbgemm's fused n-bit row dequantizer when fbgemm_gpu is loaded (torchrec loads it), else
    None. Not imported here: the writer process and the tests run without it."""
    try:
        return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat
    except (AttributeError, RuntimeError):
        return None


def codes_as_float(q: QuantizedRows) -> torch.Tensor:
    """float32 ``[rows, dim]`` of ``q``'s integer codes (exact: codes are < 2**8).

    For 2- and 4-bit rows, fbgemm's vectorised kernel unpacks and converts in one pass (about 3x
    faster than the shift/mask passes on this CPU): the rows are given a unit fp16 scale and a
    zero bias, so its ``code * 1 + 0`` is the code itself, bit for bit.
    """
    op = _fbgemm_nbit_to_float() if q.bits in (2, 4) and q.rows else None
    if op is None:
        return unpack(q.codes, q.bits, q.dim).float()
    width = q.codes.shape[1]
    fused = torch.empty((q.rows, width + 4), dtype=torch.uint8)
    fused[:, :width] = q.codes
    fused[:, width:] = _UNIT_SCALE_BIAS
    out = op(fused, q.bits)  # [rows, width * 8 / bits]: a partly used last byte decodes as zeros
    return out if out.shape[1] == q.dim else out[:, :q.dim].contiguous()


def dequantize_rows(q: QuantizedRows, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 ``[rows, dim]`` values of ``q``, computed from exactly its stored parameters;
    written into ``out`` when given (float32 ``[rows, dim]`` on the host, any strides) and
    returned. The values are the same either way, bit for bit."""
    # Same op order as the search's _fake_quant (mul, then add): no fused multiply-add, so the
    # error the search measured is the error of this result.
    codes = codes_as_float(q)
    scale = q.scale.float().unsqueeze(1)
    values = codes.mul_(scale) if out is None else torch.mul(codes, scale, out=out)
    return values.add_(q.bias.float().unsqueeze(1))
