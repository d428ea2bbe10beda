"""Rows of the dataset's tables, built from the recorder's plain state.

The writer stamps `recording_id` and `host` (sampler/dataset/writer.py); each function here returns
the rest of a row, or a list of them, for one table of sampler/dataset/schema.py.
"""

from __future__ import annotations

import datetime as dt
import os

from sampler.bpf.abi import Counter as C
from sampler.bpf.abi import VmOp
from sampler.dataset.schema import SCHEMA_VERSION, int32, int64
from sampler.dataset.sources import ALLOCATION_TIERS
from sampler.proc.memory import ProcessSample
from sampler.record.outstanding import MALLOC, MMAP, PYTHON
from sampler.record.target import ATTACH, Target
from sampler.stacks.table import Stack
from sampler.text import unnamed_frame

_VM_NAME = {op.value: op.name.lower() for op in VmOp}


def outstanding_rows(t: Target, now: dt.datetime, interval: float, mono_ns: int, *,
                     exiting: bool = False) -> list[dict]:
    """`exiting`: the process is gone; the rows hold what its teardown left, not its running state."""
    common = {"ts": now, "interval_s": interval, "pid": t.pid, "comm": t.info.comm, "exiting": exiting}
    rows = [{**common, **r} for r in t.table.snapshot(mono_ns)]
    for r in rows:
        pin = t.pinned.get((r["source"], r["stack_id"])) if not exiting else None
        r["pinned_bytes"], r["pinned_stderr_bytes"] = (pin[0], pin[1] ** 0.5) if pin else (None, None)
    t.pinned = {}
    return rows


def process_row(t: Target, now: dt.datetime, s: ProcessSample, *, sample_mean: int, stack_collisions: int,
                probe_cost_ns: float | None, gpu: dict, malloc_in_use: float | None = None) -> dict:
    """A `processes` row. `probe_cost_ns`: the governor's price of a probe hit (None: no governor);
    `malloc_in_use`: glibc's own count of its bytes in use (None: its free lists not read)."""
    b = s.breakdown
    mmb, mms = t.table.totals(MMAP)
    # unknown is not zero: outside the allocation tiers nothing sees malloc, so its figures are null
    if t.tier in ALLOCATION_TIERS:
        heap_live, arena_live, live_var = t.table.live_by_region(b.regions)
        (mb, ms), (pyb, pys) = t.table.totals(MALLOC), t.table.totals(PYTHON)
        live_sd = live_var ** 0.5
    else:
        heap_live = arena_live = live_sd = mb = ms = pyb = pys = None
    attach = t.tier == ATTACH
    return {
        "ts": now, "pid": t.pid,
        "comm": s.comm, "rss": s.rss, "pss": s.pss, "uss": s.uss, "swap": s.swap, "vms": s.vms,
        "threads": s.threads, "memory_limit": s.memory_limit,
        "heap_rss": b.heap_rss, "heap_size": b.heap_size, "heap_swap": b.heap_swap,
        "arena_rss": b.arena_rss, "arena_size": b.arena_size, "arena_swap": b.arena_swap,
        "arena_heaps": b.arena_heaps, "arenas": b.arenas, "anon_rss": b.anon_rss,
        "file_rss": b.file_rss, "stack_rss": b.stack_rss,
        "heap_live_bytes": heap_live, "arena_live_bytes": arena_live,
        "heap_arena_live_stderr_bytes": live_sd, "malloc_in_use_bytes": malloc_in_use,
        "malloc_outstanding_bytes": mb, "malloc_outstanding_stderr_bytes": ms,
        "mmap_outstanding_bytes": mmb, "mmap_outstanding_stderr_bytes": mms,
        "python_outstanding_bytes": pyb, "python_outstanding_stderr_bytes": pys,
        "lost_events": t.drops[0], "dropped_samples": t.drops[1], "vm_events_suppressed": t.drops[2],
        "sample_mean_bytes": sample_mean,
        "stack_collisions": stack_collisions,
        "tier": t.tier, "alloc_coverage": t.coverage,
        "probe_hits_per_s": t.hit_rate if attach else None,
        "probe_cpu_estimate": t.hit_rate * probe_cost_ns * 1e-9 if attach and probe_cost_ns is not None else None,
        **gpu,
    }


def label(f) -> str:
    """A frame as `stacks.summary` shows it."""
    if f.kind == "python":
        return f"{f.function} ({f.module}:{f.line})" if f.line else f"{f.function} ({f.module})"
    return f"{f.function} ({f.module})" if f.function else unnamed_frame(f.module, f.offset)


def stack_rows(stacks: list[Stack], now: dt.datetime) -> tuple[list[dict], list[dict]]:
    """`stacks` and `frames` rows of newly seen stacks."""
    stack_out, frame_out = [], []
    for st in stacks:
        labels = [label(f) for f in st.frames]
        stack_out.append({"ts": now, "stack_id": st.stack_id, "n_frames": len(st.frames),
                          "truncated": st.truncated, "site": labels[0] if labels else None,
                          "summary": " < ".join(labels), "unwind_stop": st.unwind_stop,
                          "python_frames": sum(f.kind == "python" for f in st.frames)})
        for depth, f in enumerate(st.frames):
            frame_out.append({"ts": now, "stack_id": st.stack_id, "depth": depth,
                              "function": f.function, "module": f.module, "path": f.path,
                              "offset": None if f.kind == "python" else int64(f.offset),
                              "build_id": f.build_id, "file": f.file, "line": f.line, "kind": f.kind,
                              "inlined": f.inline})
    return stack_out, frame_out


def recording_row(recording_id: str, host: str, started: dt.datetime, ended: dt.datetime | None, *,
                  sampler_version: str, sample_mean: int, interval_s: float, probe_mode: str, argv: str,
                  cpu_budget: float, probe_cost_ns: float | None, fault_period: int | None,
                  gpu_status: str) -> dict:
    """The `recordings` row (written at the start and again at the end, with `ended`)."""
    return {
        "recording_id": recording_id, "host": host, "started": started, "ended": ended,
        "schema_version": SCHEMA_VERSION, "sampler_version": sampler_version, "sample_mean_bytes": sample_mean,
        "interval_s": interval_s, "probe_mode": probe_mode, "kernel": os.uname().release, "argv": argv,
        "cpu_budget": cpu_budget, "probe_cost_ns": probe_cost_ns, "fault_period": fault_period,
        "gpu_status": gpu_status,
    }


def target_row(t: Target, now: dt.datetime, event: str, detail: str, *, gpu_libraries: list[str],
               gpu_labels: list[str]) -> dict:
    i = t.info
    return {
        "ts": now, "pid": i.pid, "event": event, "comm": i.comm, "exe": i.exe, "cmdline": i.cmdline,
        "ppid": i.ppid, "allocators": t.allocator_labels() + gpu_libraries,
        "probes": t.probe_labels() + gpu_labels, "detail": detail,
    }


def vm_row(ev, event: str | None, ts: dt.datetime, stack_id: int | None) -> dict:
    """A `vm_events` row of one mmap-family syscall."""
    op = ev.op
    prot = flags = advice = new_length = None
    if op in (VmOp.MMAP, VmOp.MPROTECT):
        prot = ev.arg & 0xFFFFFFFF
        flags = (ev.arg >> 32) if op == VmOp.MMAP else None
    elif op == VmOp.MADVISE:
        advice = ev.arg & 0xFFFFFFFF
    elif op == VmOp.MREMAP:
        new_length = ev.arg
    return {
        "ts": ts, "pid": ev.pid, "tid": ev.tid, "op": _VM_NAME.get(op, str(op)), "event": event,
        "addr": int64(ev.addr), "length": int64(ev.size), "prot": int32(prot), "flags": int32(flags),
        "advice": int32(advice), "new_length": int64(new_length), "result": ev.ret,
        "sampled_weight": float(ev.weight) if ev.weight else None, "stack_id": stack_id,
    }


def recorder_row(now: dt.datetime, interval: float, counters: list[int], **measured) -> dict:
    """A `recorder` row: `counters` are the BPF counters' increase over the interval (sampler/bpf/abi.py
    Counter), `measured` the recorder's own figures."""
    return {
        "ts": now, "interval_s": interval,
        "probe_hits": sum(counters[C.HITS:C.HITS + 32]), "vm_hits": sum(counters[C.VM_HITS:C.VM_HITS + 16]),
        "samples": counters[C.SAMPLED], "lost_events": counters[C.LOST_EVENTS],
        "dropped_samples": counters[C.LIVE_FULL], "pending_full": counters[C.PENDING_FULL],
        "stack_errors": counters[C.STACK_ERR], "python_thread_misses": counters[C.PY_MISS],
        "vm_events_suppressed": counters[C.VM_SUPPRESSED], "sampled_faults": counters[C.FAULTS],
        "cuda_calls": counters[C.CUDA_CALLS], **measured,
    }
