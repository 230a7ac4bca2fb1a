"""The quantize benchmark's k-means reference (cnr.bench.kmeans): nearest-centroid decoding,
exact constant rows, size, block independence and the quantizer's input checks."""

from __future__ import annotations

import math

import pytest
import torch

import cnr.bench.kmeans as kmeans
from cnr.bench.kmeans import kmeans_rows
from cnr.codec.quant.quantize import BITS, l2_per_row, quantize_rows
from cnr.errors import ConfigError


def _student_t(n: int, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    """Heavy-tailed rows: a normal over the root of a uniform (clamped), deterministic per seed."""
    return torch.randn(n, dim, generator=g) / torch.rand(n, dim, generator=g).clamp(min=0.05).sqrt()


def test_kmeans_is_a_sensible_reference() -> None:
    x = _student_t(400)
    q = kmeans_rows(x, 2)
    deq = q.values()
    # every value decodes to its nearest centroid
    nearest = (x.unsqueeze(2) - q.codebook.unsqueeze(1)).abs().amin(2)
    torch.testing.assert_close((x - deq).abs(), nearest)
    assert float(l2_per_row(x, q).mean()) < float(l2_per_row(x, quantize_rows(x, 2, "naive")).mean())


@pytest.mark.parametrize("bits", BITS)
def test_constant_zero_and_single_element_rows_round_trip_exactly(bits: int) -> None:
    constant = torch.tensor([0.1, -3.7, 1e-30, 123456.789, -2.5e30, 7.0]).unsqueeze(1).repeat(1, 33)
    for x in (constant, torch.zeros(4, 64), torch.tensor([[0.1], [-5.25], [0.0], [3e20], [1e-40]])):
        q = kmeans_rows(x, bits)
        assert torch.equal(q.values(), x) and (q.rows, q.dim) == tuple(x.shape)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", (1, 7, 64, 130))
def test_nbytes_is_codes_plus_codebooks(bits: int, dim: int) -> None:
    q = kmeans_rows(_student_t(11, dim), bits)
    codes = 11 * math.ceil(dim * bits / 8)
    assert q.codes.numel() == codes and q.nbytes == codes + 11 * (1 << bits) * 4


def test_empty_input_and_strided_views() -> None:
    q = kmeans_rows(torch.zeros(0, 16), 4)
    assert (q.rows, q.nbytes, tuple(q.values().shape)) == (0, 0, (0, 16))
    weight = torch.nn.Parameter(_student_t(40, 12))
    assert torch.equal(kmeans_rows(weight, 4).values(), kmeans_rows(weight.detach().clone(), 4).values())
    assert kmeans_rows(weight.detach().t(), 4).values().shape == (12, 40)


def test_block_boundaries_and_select_do_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _student_t(300, 20)
    whole = kmeans_rows(x, 3)
    monkeypatch.setattr(kmeans, "BLOCK_VALUES", 7 * 20)  # 7-row blocks, the last one partial
    blocked = kmeans_rows(x, 3)
    assert torch.equal(whole.codes, blocked.codes) and torch.equal(whole.codebook, blocked.codebook)
    at = torch.tensor([5, 0, 299])
    assert torch.equal(whole.select(at).values(), whole.values()[at])
    assert torch.equal(whole.select(slice(10, 20)).values(), whole.values()[10:20])


@pytest.mark.parametrize("call, fragment", [
    (lambda: kmeans_rows(torch.randn(2, 4), 5), "bits=5"),
    (lambda: kmeans_rows(torch.randn(2, 4, dtype=torch.float64), 4), "torch.float64"),
    (lambda: kmeans_rows(torch.tensor([[1.0, float("nan")]]), 4, name="table t3"), "table t3 row 0 contains nan"),
])
def test_bad_input_is_rejected(call, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        call()
