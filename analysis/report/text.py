"""The terminal report: findings ranked by severity, with stacks, numbers and next steps."""

from __future__ import annotations

import textwrap

from analysis.dataset import Dataset
from analysis.findings import Finding
from analysis.frames import trim_frames
from analysis.units import fmt_hours
from sampler.text import printable
from sampler.units import fmt_bytes

_NEXT = {
    "persistent_growth": "Find who keeps references to these allocations (the innermost frames are the allocation "
                         "site); compare with `allocsampler top` over time.",
    "unexplained_growth": "The summary names the region that grew; the `processes` table has it per snapshot.",
    "arena_bloat": "",
    "gpu_growth": "The stack allocates GPU memory that is never freed: look for tensors or buffers kept alive "
                  "(caches, lists of outputs, graphs held by .grad_fn).",
    "gpu_fragmentation": "Try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or torch.cuda.empty_cache() "
                         "after peaks.",
    "gpu_unexplained_growth": "Memory outside traced CUDA calls: check cudaMallocAsync pools, NCCL, "
                              "statically linked CUDA runtimes.",
}


def next_step(f: Finding) -> str:
    """What to do next, true for the finding's situation (its tier and what was measured)."""
    d = f.details
    if f.kind == "persistent_growth" and d.get("attribution") == "first_touch":
        return ("These stacks first wrote the pages; in the page-fault tier the allocating stack is not seen. "
                f"Record the process with `allocsampler record --pid {f.pid}` (a sampler injected at in-process "
                "cost) to see what allocates them and from where.")
    return _NEXT.get(f.kind, "")


def render(ds: Dataset, findings: list[Finding], width: int = 100) -> str:
    lines = [f"allocsampler analysis of {ds.root}"]
    procs = ds.processes
    if not procs.empty:
        span = f"{procs['ts'].min():%Y-%m-%d %H:%M:%S} .. {procs['ts'].max():%H:%M:%S} UTC"
        lines.append(f"{procs['pid'].nunique()} process(es), {span}")
    if not findings:
        lines.append("\nNo findings: no stack grows persistently and no glibc arena bloat was detected.")
        return "\n".join(lines)
    lines.append(f"\n{len(findings)} finding(s), most severe first:")
    for i, f in enumerate(sorted(findings, key=lambda f: -f.severity), 1):
        head = (f"{i}. [{f.kind}] pid {f.pid} ({printable(f.comm)})  severity {f.severity:.0f}  "
                f"confidence {f.confidence:.0%}")
        lines += ["", head]
        lines += textwrap.wrap(printable(f.summary), width, initial_indent="   ", subsequent_indent="   ")
        d = f.details
        if f.kind in ("persistent_growth", "gpu_growth"):
            lines.append(f"   outstanding {fmt_bytes(d['outstanding_bytes'])} ± "
                         f"{fmt_bytes(d['outstanding_stderr_bytes'])}, growth {fmt_bytes(d['growth_bytes_per_hour'])}/h"
                         + (f", OOM in {fmt_hours(d['time_to_oom_hours'])} ({d['time_to_oom_basis']})"
                            if d.get("time_to_oom_hours") is not None else ""))
            lines.append("   stack (allocation site first):")
            shown, hidden = trim_frames(d.get("frames", []))
            lines += [f"     {printable(s)}" for s in shown] or ["     [no symbols]"]
            if hidden:
                lines.append(f"     ({hidden} more frames)")
        elif f.kind == "arena_bloat":
            lines.append(f"   resident {fmt_bytes(d['resident_bytes'])}, live {fmt_bytes(d['live_bytes'])}, "
                         f"bloat {fmt_bytes(d['bloat_bytes'])}, {d.get('arenas')} arenas")
            if d.get("recommendation"):
                lines += textwrap.wrap("next: " + printable(d["recommendation"]), width, initial_indent="   ",
                                       subsequent_indent="         ")
        elif f.kind == "unexplained_growth":
            regions = ", ".join(f"{k[:-4]} {fmt_bytes(v)}" for k, v in d["region_growth_bytes"].items() if v)
            lines.append(f"   region growth: {regions}")
        if step := next_step(f):
            lines += textwrap.wrap("next: " + printable(step), width, initial_indent="   ",
                                   subsequent_indent="         ")
    return "\n".join(lines)
