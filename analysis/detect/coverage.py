"""recording_incomplete: the recording checked against what the allocator itself counts.

Sampled estimates are unbiased for the allocations the recording sees. Allocations it does not see
(a library that calls malloc through a pointer copied before the sampler was placed, an entry
point no probe covers, events lost to a full ring buffer, a full live table) leave no trace in
them, and every finding built on them would then blame the heap for memory the program holds. So
at each snapshot where glibc's free lists were read, the allocator's own count of its bytes in use
(`processes.malloc_in_use_bytes`) is compared with what was sampled live in its heaps
(`heap_live_bytes + arena_live_bytes`, chunk sizes both): as growth since the first such snapshot,
since what a process held before it was recorded was never sampled. A gap beyond
max(4 sigma + 4 MiB, 10% of the allocator's growth) at the last two such snapshots is a finding: how
much, since when, the recording's own rows that explain it, and what records it instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.dataset import Dataset
from analysis.findings import Finding
from sampler.units import fmt_bytes

MiB = 1 << 20
PROCESS_COLUMNS = ("ts", "recording_id", "pid", "comm", "tier", "malloc_in_use_bytes", "heap_live_bytes",
                   "arena_live_bytes", "heap_arena_live_stderr_bytes", "lost_events", "dropped_samples")


@dataclass
class RecordingIncomplete(Finding):
    """`recording_incomplete`: the allocator counts more growth in use than the recording sampled."""

    kind: str = field(default="recording_incomplete", init=False)

    def facts(self) -> list[str]:
        d = self.details
        return [f"glibc grew {fmt_bytes(d['allocator_growth_bytes'])} in use, the recording sampled "
                f"{fmt_bytes(d['sampled_growth_bytes'])} ± {fmt_bytes(d['sampled_growth_stderr_bytes'])} of it "
                f"({100 * d['coverage']:.0f}%)"]

    def next_step(self) -> str:
        return self.details["recommendation"]


def allocator_growth(p: pd.DataFrame) -> tuple[pd.DataFrame, float] | None:
    """One process's snapshots whose free lists were read, in time order, with `gap` (the
    allocator's growth in use since the first of them less the sampled one), `sigma` (that sampled
    growth's standard error) and `bound` (what the gap may be without saying anything); None
    without three of them."""
    if "malloc_in_use_bytes" not in p or "heap_live_bytes" not in p:
        return None
    w = p[p["malloc_in_use_bytes"].notna() & p["heap_live_bytes"].notna() & p["arena_live_bytes"].notna()]
    if len(w) < 3:
        return None
    w = w.sort_values("ts")
    used = w["malloc_in_use_bytes"].to_numpy(float)
    live = (w["heap_live_bytes"] + w["arena_live_bytes"]).to_numpy(float)
    se = w["heap_arena_live_stderr_bytes"].fillna(0.0).to_numpy(float)
    grown, seen = used - used[0], live - live[0]
    sigma = np.hypot(se, se[0])
    bound = 4 * sigma + np.maximum(4 * MiB, 0.1 * np.abs(grown))
    return w.assign(grown=grown, seen=seen, sigma=sigma, gap=grown - seen, bound=bound), float(grown[-1])


def detect_recording_incomplete(ds: Dataset) -> list[Finding]:
    """One finding per process and recording at most."""
    if ds.processes.empty or "malloc_in_use_bytes" not in ds.processes:
        return []
    out = []
    for (rec, pid), p in ds.by_process().items():
        got = allocator_growth(p)
        if got is None:
            continue
        w, grown = got
        over = (w["gap"] > w["bound"]).to_numpy()
        if grown < 8 * MiB or not over[-2:].all():
            continue
        first = len(over) - int(np.argmin(over[::-1])) if not over.all() else 0     # from here on, always over
        last, since = w.iloc[-1], w.iloc[first]
        gap, sigma, seen = float(last["gap"]), float(last["sigma"]), float(last["seen"])
        causes, advice = _causes(p, w)
        z = gap / max(sigma, 1.0)
        confidence = min(0.999, 1 - 0.5 * math.erfc(z / math.sqrt(2)))
        out.append(RecordingIncomplete(
            int(pid), str(last["comm"]), min(60.0, 60.0 * gap / max(grown, 1.0)) * confidence, confidence,
            f"glibc's own count of its bytes in use grew {fmt_bytes(grown)} from {w.iloc[0]['ts']:%H:%M:%S} UTC, "
            f"and the recording sampled {fmt_bytes(max(seen, 0.0))} of it: {fmt_bytes(gap)} ± {fmt_bytes(sigma)} "
            f"of allocations were not seen, since {since['ts']:%H:%M:%S} UTC ({'; '.join(causes)}). Findings of "
            "this process miss them; they are not heap bloat.",
            {"allocator_growth_bytes": grown, "sampled_growth_bytes": seen, "sampled_growth_stderr_bytes": sigma,
             "unseen_bytes": gap, "coverage": max(0.0, seen) / grown, "since": since["ts"],
             "first_seen": w.iloc[0]["ts"], "last_seen": last["ts"], "likely_causes": causes,
             "recommendation": advice, "recording_id": rec}))
    return out


def _causes(p: pd.DataFrame, w: pd.DataFrame) -> tuple[list[str], str]:
    """What the recording's own rows say about the allocations it missed, and what to do."""
    causes = []
    lost = _increase(p, "lost_events")
    dropped = _increase(p, "dropped_samples")
    if lost:
        causes.append(f"{lost:,} events lost (the ring buffer was full)")
    if dropped:
        causes.append(f"{dropped:,} sampled blocks not tracked (the live table was full)")
    tier = str(w["tier"].iloc[-1])
    if tier == "inject":
        causes.append("allocations that do not go through the redirected entry points: a pointer to malloc "
                      "copied before the sampler was placed, or code that reaches glibc's allocator another way")
        advice = ("Record the process with `--attach-mode uprobe` (probes on the allocator itself see every call, "
                  "however it is reached), or start it under the preload shim (`allocsampler record --preload -- "
                  "CMD`), and compare.")
    else:
        causes.append("an allocator entry point that no probe covers")
        advice = ("Start the process under the preload shim (`allocsampler record --preload -- CMD`), or name "
                  "the allocator's library with --allocator LIB[:PREFIX], and compare.")
    if dropped:
        advice += " Raise --live-max for the blocks the live table could not hold."
    return causes, advice


def _increase(p: pd.DataFrame, column: str) -> int:
    if column not in p:
        return 0
    v = p[column].dropna()
    return int(v.iloc[-1] - v.iloc[0]) if len(v) > 1 else 0
