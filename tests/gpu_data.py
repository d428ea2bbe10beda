"""What the GPU tests share: a PyTorch memory snapshot as `torch.cuda.memory._snapshot()` returns
it (its documented layout), for the import tests and the import journey; no GPU is needed."""

from __future__ import annotations

MiB = 1 << 20


def _frames(*names: str) -> list[dict]:
    return [{"name": n, "filename": "train.py" if n.startswith("py_") else "CUDACachingAllocator.cpp",
             "line": 10 + i} for i, n in enumerate(names)]


def torch_snapshot() -> dict:
    """Two 20 MiB segments and an expandable segment with 4 MiB mapped; a trace over 9 s in
    which tensors come and go and one stack (py_cache) keeps growing."""
    base_us = 1_790_000_000_000_000
    trace, blocks = [], []
    addr = 0x7F00_0000_0000
    trace.append({"action": "segment_alloc", "addr": addr, "size": 20 * MiB, "stream": 0,
                  "frames": _frames("py_step"), "time_us": base_us})
    for i in range(9):
        a = addr + i * 2 * MiB
        trace.append({"action": "alloc", "addr": a, "size": 2 * MiB, "stream": 0, "frames": _frames("py_cache"),
                      "time_us": base_us + i * 1_000_000 + 10})
        blocks.append({"address": a, "size": 2 * MiB, "requested_size": 2 * MiB, "state": "active_allocated",
                       "frames": _frames("py_cache")})
        tmp = addr + 19 * MiB
        trace.append({"action": "alloc", "addr": tmp, "size": MiB, "stream": 0, "frames": _frames("py_tmp"),
                      "time_us": base_us + i * 1_000_000 + 20})
        trace.append({"action": "free_requested", "addr": tmp, "size": MiB, "stream": 0, "frames": _frames("py_tmp"),
                      "time_us": base_us + i * 1_000_000 + 30})
        trace.append({"action": "free_completed", "addr": tmp, "size": MiB, "stream": 0, "frames": _frames("py_tmp"),
                      "time_us": base_us + i * 1_000_000 + 31})
    blocks.append({"address": addr + 18 * MiB, "size": 2 * MiB, "state": "inactive"})
    seg2 = 0x7F10_0000_0000
    trace.append({"action": "segment_alloc", "addr": seg2, "size": 20 * MiB, "stream": 0,
                  "frames": _frames("py_eval"), "time_us": base_us + 8_500_000})
    exp = 0x7F20_0000_0000
    trace.append({"action": "segment_map", "addr": exp, "size": 2 * MiB, "stream": 0, "frames": _frames("py_big"),
                  "time_us": base_us + 8_600_000})
    trace.append({"action": "segment_map", "addr": exp + 2 * MiB, "size": 2 * MiB, "stream": 0,
                  "frames": _frames("py_big"), "time_us": base_us + 8_700_000})
    return {
        "segments": [
            {"device": 0, "address": addr, "total_size": 20 * MiB, "allocated_size": 18 * MiB, "stream": 0,
             "segment_type": "large", "is_expandable": False, "frames": _frames("py_step"), "blocks": blocks},
            {"device": 0, "address": seg2, "total_size": 20 * MiB, "allocated_size": 0, "stream": 0,
             "segment_type": "large", "is_expandable": False, "frames": _frames("py_eval"),
             "blocks": [{"address": seg2, "size": 20 * MiB, "state": "inactive"}]},
            {"device": 0, "address": exp, "total_size": 4 * MiB, "allocated_size": 0, "stream": 0,
             "segment_type": "large", "is_expandable": True, "frames": _frames("py_big"),
             "blocks": [{"address": exp, "size": 4 * MiB, "state": "inactive"}]},
        ],
        "device_traces": [trace],
    }
