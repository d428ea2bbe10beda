"""The preload tier: locate the LD_PRELOAD sampling shim (sampler/inprocess/preload.c).

A process started with the shim in LD_PRELOAD samples its own allocations (a per-thread byte
countdown, Poisson with mean ALLOCSAMPLER_SAMPLE_MEAN) and reaches a probe site only for sampled
calls: USDT `otel_memory:alloc(ptr, size, weighted_bytes)` and `otel_memory:free(ptr)`, the
OpenTelemetry eBPF profiler memory contract. Weights agree with `sampler.control.weights.unbiased_weight`.
Above ALLOCSAMPLER_MAX_SAMPLES_PER_S samples/s (default 2000, 0: no cap) the shim raises its mean
by powers of two, and lowers it again when the rate falls; each sample is weighted with the mean its
gap was drawn with, so estimates stay unbiased.

    python -m sampler.inprocess.preload     # builds the shim if needed and prints its path
"""

from __future__ import annotations

import os
from pathlib import Path

from sampler.errors import EnvironmentProblem, UsageError
from sampler.inprocess import build as builder
from sampler.inprocess.abi import SMP_DEFAULT_MAX_PER_S, SMP_DEFAULT_MEAN, SMP_MAX_MAX_PER_S, SMP_MAX_MEAN

SOURCE = builder.HERE / builder.SHIM.source
BUILD_DIR = builder.BUILD_DIR
LIB_NAME = builder.SHIM.name
ENV_SAMPLE_MEAN = "ALLOCSAMPLER_SAMPLE_MEAN"
DEFAULT_SAMPLE_MEAN = SMP_DEFAULT_MEAN
MAX_SAMPLE_MEAN = SMP_MAX_MEAN                      # the shim treats larger values as invalid (default)
ENV_MAX_SAMPLES_PER_S = "ALLOCSAMPLER_MAX_SAMPLES_PER_S"
DEFAULT_MAX_SAMPLES_PER_S = SMP_DEFAULT_MAX_PER_S   # 0: no cap
MAX_MAX_SAMPLES_PER_S = SMP_MAX_MAX_PER_S           # the shim treats larger values as invalid (default)

SHIM = builder.SHIM
CFLAGS = list(SHIM.cflags)

EXPORTED = frozenset({
    "malloc", "free", "calloc", "realloc", "reallocarray", "posix_memalign", "aligned_alloc",
    "memalign", "valloc", "pvalloc",
    "allocsampler_preload_weight", "allocsampler_preload_stats", "allocsampler_preload_sampling",
    "allocsampler_preload_counts",
})


def shim_path(build: bool = True) -> Path:
    """Path of the shim: the installed package's prebuilt one, else `<repo>/build/liballocsampler_preload.so`,
    with `build` compiled first when it is missing or older than its sources.
    """
    if builder.PREBUILT.is_dir():
        return builder.path(SHIM)
    if not build:
        return BUILD_DIR / LIB_NAME
    return builder.build(SHIM, SOURCE.parent, BUILD_DIR)


def preload_env(sample_mean: int, base: dict | None = None,
                max_samples_per_s: int | None = None) -> dict[str, str]:
    """A copy of `base` (default: os.environ) that runs a command under the shim.

    The shim is prepended to LD_PRELOAD (existing entries kept) and ALLOCSAMPLER_SAMPLE_MEAN set;
    with `max_samples_per_s`, ALLOCSAMPLER_MAX_SAMPLES_PER_S too (0: no cap; None keeps what
    `base` says, else the shim's default of 2000).
    """
    if isinstance(sample_mean, bool) or not isinstance(sample_mean, int) \
            or not 0 < sample_mean <= MAX_SAMPLE_MEAN:
        raise UsageError(f"sample mean must be a whole number of bytes in 1..{MAX_SAMPLE_MEAN}, got {sample_mean!r}")
    if max_samples_per_s is not None and (
            isinstance(max_samples_per_s, bool) or not isinstance(max_samples_per_s, int)
            or not 0 <= max_samples_per_s <= MAX_MAX_SAMPLES_PER_S):
        raise UsageError(f"max samples per second must be a whole number in 0..{MAX_MAX_SAMPLES_PER_S} "
                         f"(0: no cap), got {max_samples_per_s!r}")
    shim = str(shim_path())
    if any(c in shim for c in ": \t\n"):
        raise EnvironmentProblem(f"the preload shim's path {shim!r} cannot go into LD_PRELOAD (it has a colon or "
                                 "whitespace): move the checkout to a plain path")
    env = dict(os.environ if base is None else base)
    existing = [e for e in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if e and e != shim]
    env["LD_PRELOAD"] = ":".join([shim, *existing])
    env[ENV_SAMPLE_MEAN] = str(sample_mean)
    if max_samples_per_s is not None:
        env[ENV_MAX_SAMPLES_PER_S] = str(max_samples_per_s)
    return env


if __name__ == "__main__":
    import sys

    from sampler.errors import AllocsamplerError
    try:
        print(shim_path())
    except AllocsamplerError as e:
        print(f"allocsampler: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
