"""The values of the `source` column (outstanding, gpu_events): the schema's contract.

Plain names, no imports: the command line builds its --source choices from them at start-up,
where sampler/dataset/schema.py (pyarrow) would cost ~0.15 s. sampler/dataset/schema.py re-exports them.
"""

MALLOC, MMAP, FAULT = "malloc", "mmap", "fault"
TORCH = "torch"       # sampled tensors of PyTorch's caching allocator: blocks, like malloc

# GPU values (outstanding, gpu_events): the recorder writes them (sampler/gpu/cuda.py), the analysis
# and the command line select by them.
CUDA, CUDA_HOST, CUDA_DRIVER, CUDA_DRIVER_HOST = "cuda", "cuda-host", "cuda-driver", "cuda-driver-host"
GPU_SOURCES = (CUDA, CUDA_HOST, CUDA_DRIVER, CUDA_DRIVER_HOST, TORCH)
DEVICE_SOURCES = (CUDA, CUDA_DRIVER)          # device memory, the two layers
HOST_SOURCES = (CUDA_HOST, CUDA_DRIVER_HOST)  # pinned host memory, the two layers
