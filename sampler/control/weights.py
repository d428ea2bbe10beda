"""The one definition of sampling weights.

Allocations are sampled as a Poisson process over requested bytes with mean T: an allocation of
S bytes is sampled with probability p = 1 - exp(-S/T) and then stands for S/p bytes and 1/p
objects (Horvitz-Thompson), which makes every sum of weights an unbiased estimate.

The BPF side computes S/p by interpolating `weight_table()` (bpf/common.h: sample_bytes);
everything else here derives from (S, weight) as recorded in the events.
"""

from __future__ import annotations

import math

from sampler.bpf.abi import WTAB_N, WTAB_SHIFT, WTAB_STEPS


def inclusion_probability(size: float, mean: float) -> float:
    return -math.expm1(-size / mean)


def unbiased_weight(size: float, mean: float) -> float:
    """Bytes that one sampled allocation of `size` bytes stands for."""
    return size / inclusion_probability(size, mean)


def _h(x: float) -> float:
    # x / (1 - exp(-x)): the weight in units of T; smooth, 1 at x = 0.
    return 1.0 if x == 0 else x / -math.expm1(-x)


def weight_table() -> list[int]:
    """Values of h(i / WTAB_STEPS) in Q20 for the BPF weight interpolation."""
    return [round(_h(i / WTAB_STEPS) * (1 << WTAB_SHIFT)) for i in range(WTAB_N + 1)]


def sample_terms(size: int, weight: float) -> tuple[float, float, float]:
    """For one sample: (bytes variance term, objects estimate, objects variance term).

    The variance of a Horvitz-Thompson sum is estimated without bias by summing
    w^2 (1 - p) over the samples (bytes), and (1 - p) / p^2 (objects), with p = size / w.
    """
    if weight <= 0 or size <= 0:
        return 0.0, 0.0, 0.0
    p = min(1.0, size / weight)
    objects = 1.0 / p
    return weight * weight * (1.0 - p), objects, (1.0 - p) * objects * objects


def chunk_size(request: int) -> int:
    """glibc x86-64 chunk size for a request: max(32, request + 8 rounded up to 16)."""
    return max(32, (request + 8 + 15) & ~15)
