"""Families: one finding for a growth that several processes of one server share.

A server's children (PostgreSQL's backends, gunicorn's or celery's workers, a multiprocessing pool)
run the same code, and a leak in it grows in each of them: 200 backends would give 200 findings.
Growth findings at the same call site (`site_key`: the functions, not the addresses) in two or more
processes of one family become one `family_growth` finding, which names the family's root (its
oldest recorded ancestor, through the `targets` table's ppid), how many of its processes grow
there and their total rate; the member findings go into it (`members`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from analysis.dataset import Dataset
from analysis.findings import SHOWN_APART, Finding
from analysis.frames import site, site_key
from analysis.units import fmt_rate
from sampler.units import fmt_bytes

MAX_DEPTH = 64              # ppid links followed up to a root (a cycle from pid reuse ends there)


@dataclass
class FamilyGrowth(Finding):
    """`family_growth`: the same call site grows in several processes of one family."""

    kind: str = field(default="family_growth", init=False)

    def facts(self) -> list[str]:
        d = self.details
        return [f"{d['processes']} processes, together "
                f"{fmt_rate(d['growth_bytes_per_hour'], d.get('growth_stderr_bytes_per_hour'))} "
                f"({fmt_bytes(d['min_growth_bytes_per_hour'])}-{fmt_bytes(d['max_growth_bytes_per_hour'])}/h each), "
                f"outstanding {fmt_bytes(d['outstanding_bytes'])} ± {fmt_bytes(d['outstanding_stderr_bytes'])}",
                f"pids: {', '.join(map(str, d['pids'][:12]))}" + (" ..." if len(d["pids"]) > 12 else "")]

    def numbers(self) -> dict:
        return {k: v for k, v in self.details.items() if k not in (*SHOWN_APART, "members", "pids", "root_cmdline")}

    def next_step(self) -> str:
        return ("Every process of this family runs the code that grows: find who keeps references to these "
                "allocations (the innermost frames are the allocation site); `allocsampler top --pid PID` "
                "shows one of them over time.")


def roots(targets: pd.DataFrame) -> dict[int, int]:
    """pid -> the oldest recorded ancestor it descends from (itself when its parent was not recorded)."""
    if targets is None or not len(targets) or "ppid" not in targets:
        return {}
    last = targets.dropna(subset=["ppid"]).groupby("pid")["ppid"].last()
    parent = {int(p): int(pp) for p, pp in last.items()}
    out = {}
    for pid in parent:
        r = pid
        for _ in range(MAX_DEPTH):
            up = parent.get(r)
            if up is None or up == r or up not in parent:
                break
            r = up
        out[pid] = r
    return out


def by_family(ds: Dataset, findings: list[Finding], growth_kind: str = "persistent_growth") -> list[Finding]:
    """`findings` with each family's shared growths merged into one FamilyGrowth."""
    family = roots(ds.targets)
    groups: dict[tuple, list[Finding]] = {}
    for f in findings:
        if f.kind == growth_kind and f.pid in family and isinstance(f.details.get("frames"), list):
            key = (f.details.get("recording_id"), family[f.pid], f.details.get("source"),
                   site_key(f.details["frames"]))
            groups.setdefault(key, []).append(f)
    merged: set[int] = set()
    out: list[Finding] = []
    for (_, root, source, _), members in groups.items():
        if len({m.pid for m in members}) < 2:
            continue
        merged.update(map(id, members))
        out.append(_family(ds, root, source, members))
    return out + [f for f in findings if id(f) not in merged]


def _family(ds: Dataset, root: int, source: str, members: list[Finding]) -> FamilyGrowth:
    rates = [m.details["growth_bytes_per_hour"] for m in members]
    rate = sum(rates)
    held = sum(m.details["outstanding_bytes"] for m in members)
    held_se = math.sqrt(sum(m.details["outstanding_stderr_bytes"] ** 2 for m in members))
    rate_se = math.sqrt(sum((m.details.get("growth_stderr_bytes_per_hour") or 0.0) ** 2 for m in members))
    comm, cmdline = _who(ds.targets, root)
    first = max(members, key=lambda m: m.severity)
    text = (f"{len(members)} processes of {comm} (pid {root}) grow at {site(first.details['frames'])}: "
            f"{fmt_bytes(rate)}/h together, {fmt_bytes(held)} ± {fmt_bytes(held_se)} held ({source})")
    return FamilyGrowth(
        root, comm, max(m.severity for m in members), max(m.confidence for m in members), text + ".",
        {"source": source, "frames": first.details["frames"], "processes": len(members),
         "pids": sorted(m.pid for m in members), "root_cmdline": cmdline,
         "growth_bytes_per_hour": rate, "growth_stderr_bytes_per_hour": rate_se,
         "min_growth_bytes_per_hour": min(rates), "max_growth_bytes_per_hour": max(rates),
         "outstanding_bytes": held, "outstanding_stderr_bytes": held_se,
         "recording_id": first.details.get("recording_id"),
         "members": [m.to_json() for m in sorted(members, key=lambda m: -m.severity)]})


def _who(targets: pd.DataFrame, pid: int) -> tuple[str, str]:
    rows = targets[targets["pid"] == pid]
    if not len(rows):
        return "?", ""
    last = rows.iloc[-1]
    return str(last.get("comm") or "?"), str(last.get("cmdline") or "")
