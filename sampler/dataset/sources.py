"""The values of the dataset's label columns: `source` (outstanding, gpu_events) and `tier`
(processes): the schema's contract.

Plain names, no imports: the command line builds its --source choices from them at start-up,
where sampler/dataset/schema.py (pyarrow) would cost ~0.15 s. sampler/dataset/schema.py re-exports them.
"""

# Tiers: how a process's allocations are seen (README: "Tiers"); the first three record allocations.
INJECT, ATTACH, PRELOAD, RSS, SYSCALLS = "inject", "attach", "preload", "rss", "syscalls"
ALLOCATION_TIERS = (INJECT, ATTACH, PRELOAD)
TIERS = (*ALLOCATION_TIERS, RSS, SYSCALLS)

MALLOC, MMAP, FAULT = "malloc", "mmap", "fault"
TORCH = "torch"       # sampled tensors of PyTorch's caching allocator: blocks, like malloc
PYTHON = "python"     # sampled objects of CPython's small-object allocator (pymalloc): blocks, like
                      # malloc; its arenas' mmaps (via libc) are not counted again under mmap

# GPU values (outstanding, gpu_events): the recorder writes them (sampler/gpu/cuda.py), the analysis
# and the command line select by them.
CUDA, CUDA_HOST, CUDA_DRIVER, CUDA_DRIVER_HOST = "cuda", "cuda-host", "cuda-driver", "cuda-driver-host"
GPU_SOURCES = (CUDA, CUDA_HOST, CUDA_DRIVER, CUDA_DRIVER_HOST, TORCH)
DEVICE_SOURCES = (CUDA, CUDA_DRIVER)          # device memory, the two layers
HOST_SOURCES = (CUDA_HOST, CUDA_DRIVER_HOST)  # pinned host memory, the two layers
