"""allocsampler: user-space side of the eBPF allocation sampler."""

__version__ = "0.1.0"
