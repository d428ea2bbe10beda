"""A Python CUDA program for the GPU probe tests: ctypes calls into the stub libraries (and the
real libcudart), from named Python functions. Commands on stdin, one per line; each answers one
JSON line on stdout:
  load DIR          load DIR/libc10_cuda.so (which maps the stub runtime and driver)
  torch             a caching allocator's view: 4 segments of 32 MiB, 8 live tensors of 2 MiB,
                    6 tensors of 1 MiB allocated and freed
  real PATH         cudaMalloc through a real libcudart (fails without a GPU): its result
  grow N            leak 1 MiB of device memory N times, 0.25 s apart, freeing as much again
"""

import ctypes
import json
import sys
import time

MiB = 1 << 20
libs: dict[str, ctypes.CDLL] = {}


def answer(**kw) -> None:
    print(json.dumps(kw), flush=True)


def load(d: str) -> None:
    libs["c10"] = ctypes.CDLL(f"{d}/libc10_cuda.so")
    libs["rt"] = ctypes.CDLL(f"{d}/libcudart.so.12")
    libs["c10"].c10_tensor_alloc.restype = ctypes.c_size_t
    libs["c10"].c10_tensor_alloc.argtypes = [ctypes.c_size_t]
    libs["c10"].c10_tensor_free.argtypes = [ctypes.c_size_t]
    libs["c10"].c10_reserve_segment.argtypes = [ctypes.c_size_t]


def cuda_malloc(lib: ctypes.CDLL, n: int) -> tuple[int, int]:
    p = ctypes.c_void_p()
    r = lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n))
    return r, p.value or 0


def leak_from_python(n: int) -> None:
    r, _ = cuda_malloc(libs["rt"], n)
    assert r == 0


def churn_from_python(n: int) -> None:
    r, p = cuda_malloc(libs["rt"], n)
    assert r == 0 and libs["rt"].cudaFree(ctypes.c_void_p(p)) == 0


def tensors() -> dict:
    c10 = libs["c10"]
    for _ in range(4):
        assert c10.c10_reserve_segment(32 * MiB) == 0
    kept = [c10.c10_tensor_alloc(2 * MiB) for _ in range(8)]
    gone = [c10.c10_tensor_alloc(MiB) for _ in range(6)]
    for p in gone:
        c10.c10_tensor_free(p)
    assert all(kept) and all(gone)
    return {"reserved": 128 * MiB, "allocated": 16 * MiB}


def main() -> None:
    answer(ready=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "load":
            load(args[0])
            answer(ok=True)
        elif cmd == "torch":
            answer(**tensors())
        elif cmd == "real":
            rt = ctypes.CDLL(args[0])
            r, p = cuda_malloc(rt, MiB)
            answer(result=r, ptr=p)
        elif cmd == "grow":
            for _ in range(int(args[0])):
                leak_from_python(MiB)
                churn_from_python(2 * MiB)
                time.sleep(0.25)
            answer(leaked=int(args[0]) * MiB)
        else:
            answer(error=cmd)


if __name__ == "__main__":
    main()
