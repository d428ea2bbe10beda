"""The terminal report: findings ranked by severity, with stacks, numbers and next steps (what
each finding says of itself: analysis/findings.py)."""

from __future__ import annotations

import textwrap

from analysis.dataset import Dataset
from analysis.findings import Finding
from analysis.frames import naming_hint, trim_frames
from sampler.text import printable


def render(ds: Dataset, findings: list[Finding], width: int = 100, interpreter_frames: bool = False) -> str:
    """`interpreter_frames`: CPython's own frames between two Python frames shown, not folded."""
    lines = [f"allocsampler analysis of {ds.root}"]
    procs = ds.summary()
    if not procs.empty:
        span = f"{procs['first_ts'].min():%Y-%m-%d %H:%M:%S} .. {procs['last_ts'].max():%H:%M:%S} UTC"
        lines.append(f"{procs['pid'].nunique()} process(es), {span}")
    if not findings:
        lines.append("\nNo findings: no stack grows persistently and no glibc arena bloat was detected.")
        return "\n".join(lines)
    lines.append(f"\n{len(findings)} finding(s), most severe first:")
    stacks = []
    for i, f in enumerate(sorted(findings, key=lambda f: -f.severity), 1):
        head = (f"{i}. [{f.kind}] pid {f.pid} ({printable(f.comm)})  severity {f.severity:.0f}  "
                f"confidence {f.confidence:.0%}")
        lines += ["", head]
        lines += textwrap.wrap(printable(f.summary), width, initial_indent="   ", subsequent_indent="   ")
        lines += [f"   {printable(fact)}" for fact in f.facts()]
        if (frames := f.stack()) is not None:
            lines.append("   stack (allocation site first):")
            stacks.append(frames)
            shown, hidden = trim_frames(frames, interpreter=interpreter_frames)
            lines += [f"     {printable(s)}" for s in shown] or ["     [no symbols]"]
            if hidden:
                lines.append(f"     ({hidden} more frames)")
        if step := f.next_step():
            lines += textwrap.wrap("next: " + printable(step), width, initial_indent="   ",
                                   subsequent_indent="         ")
    if hint := naming_hint(stacks):
        lines += ["", *textwrap.wrap(printable(hint), width)]
    return "\n".join(lines)
