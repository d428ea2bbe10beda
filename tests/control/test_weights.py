"""The sampling weights (sampler/control/weights.py): the unbiased weight of a sampled block, the
integer table BPF interpolates it from, a sample's variance terms, and malloc's chunk sizes."""

from __future__ import annotations

import math

import pytest

from sampler.bpf import abi
from sampler.control import weights

T = 512 << 10


def test_weight_formula():
    assert weights.unbiased_weight(T * 100, T) == pytest.approx(T * 100)
    assert weights.unbiased_weight(1, T) == pytest.approx(T + 0.5, rel=1e-6)
    for s in (1, 100, T // 3, T, 5 * T):
        p = weights.inclusion_probability(s, T)
        assert weights.unbiased_weight(s, T) * p == pytest.approx(s)


def _bpf_weight(size: int, mean: int, tab: list[int]) -> int:
    """bpf/common.h sample_bytes(), integer for integer."""
    if size >= abi.WTAB_MAX_X * mean:
        return size
    xq = (size << 22) // mean
    i = xq >> 16
    if i >= abi.WTAB_N - 1:
        return size
    h = tab[i] + (((tab[i + 1] - tab[i]) * (xq & 0xFFFF)) >> 16)
    return (mean * h) >> 20


@pytest.mark.parametrize("mean", [64 << 10, 512 << 10, 2 << 20])
def test_bpf_weight_interpolation_matches_formula(mean):
    tab = weights.weight_table()
    assert tab[0] == 1 << 20 and all(a < b for a, b in zip(tab[:-1], tab[1:], strict=True))
    for size in [1, 16, 100, 4096, mean // 2, mean, 3 * mean, 10 * mean, 23 * mean, 25 * mean]:
        assert _bpf_weight(size, mean, tab) == pytest.approx(weights.unbiased_weight(size, mean), rel=2e-5)


def test_sample_terms():
    var, objects, objects_var = weights.sample_terms(T, weights.unbiased_weight(T, T))
    p = 1 - math.exp(-1)
    assert objects == pytest.approx(1 / p)
    assert var == pytest.approx((T / p) ** 2 * (1 - p))
    assert weights.sample_terms(10 * T * 30, 10 * T * 30) == (0.0, 1.0, 0.0)


def test_chunk_size():
    assert [weights.chunk_size(n) for n in (0, 24, 25, 100)] == [32, 32, 48, 112]
