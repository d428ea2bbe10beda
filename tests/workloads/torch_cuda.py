"""A PyTorch CUDA process for the GPU-only tests. Imports torch, says "ready" (stderr) and waits
for a line; then initialises CUDA, allocates tensors from `allocate_tensors`, frees some, and
prints the caching allocator's own figures as JSON (stderr); waits for a line and exits.
PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments:True) is read by torch itself."""

import json
import sys

import torch

MiB = 1 << 20


def allocate_tensors() -> list:
    keep = [torch.empty(MiB * (i + 1), dtype=torch.uint8, device="cuda") for i in range(8)]
    keep += [torch.empty(256 * 1024, dtype=torch.uint8, device="cuda") for _ in range(32)]
    return keep


def churn() -> None:
    for _ in range(16):
        t = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")
        del t


def main() -> None:
    print("ready", file=sys.stderr, flush=True)
    sys.stdin.readline()
    torch.cuda.init()
    kept = allocate_tensors()
    churn()
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    print(json.dumps({"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
                      "segments": s.get("segment.all.current", 0), "kept": len(kept)}), file=sys.stderr, flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
