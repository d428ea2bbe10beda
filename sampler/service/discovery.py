"""Which processes the daemon records: /proc scans matched against the configuration's [[targets]].

Processes are known by (pid, start time), so a reused pid is a new process; a process is evaluated
again when its name or command line changes (exec). Exits are reported by the kernel at once
(sched_process_exit); the scan is the safety net.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from sampler.proc import process
from sampler.proc.process import ProcView, read_cmdline, read_stat
from sampler.service.config import ALWAYS_ON, Config, Target

MAX_ADDS_PER_SCAN = 64          # processes attached per scan; the rest wait for the next (events flow)
PF_KTHREAD = 0x00200000


def recorder_tier(rule: Target) -> str:
    """The recorder's tier for a configured one. attach and preload-aware are one tier there: a
    process that carries otel_memory probes is recorded through them in both (probing its
    allocator as well would count each sample twice)."""
    return "rss" if rule.tier == ALWAYS_ON else "attach"


@dataclass
class Known:
    start: int
    sig: tuple[str, str]             # (comm, cmdline) when last evaluated
    rule: int | None                 # index of the [[targets]] table that selected it
    recorded: bool = False
    since: float = 0.0               # wall time it was added
    readds: int = 0                  # times added again after the recorder dropped it alive


class Discovery:
    """Which processes to record: /proc scans matched against the configuration.

    `rec` needs recording(pid) -> bool, recorded_count(), failed_on(pid) -> bool,
    add_process(info, tier, family) -> bool, takes_forks_of(pid) -> bool, remove_process(pid,
    event, detail) and note(pid, event, detail) (sampler/record/recorder.py); tests pass a fake
    recorder and a fake /proc."""

    def __init__(self, cfg: Config, rec, *, proc: str = "/proc", self_pid: int | None = None,
                 max_targets: int | None = None, read_info=None):
        self.cfg, self.rec, self.proc = cfg, rec, proc
        self.read_info = read_info or process.read_info
        self.self_pid = os.getpid() if self_pid is None else self_pid
        self.max_targets = max_targets or cfg.daemon.max_targets
        self.known: dict[int, Known] = {}
        self.paused = False              # memory: no new targets
        self.left_out = 0                # processes selected but not recorded (max_targets, memory)
        self._said_full = False
        self.scans = 0

    def scan(self, full: bool = False) -> list[str]:
        """One pass over /proc; returns log lines. `full` re-evaluates every process (cgroup or
        user changes are not visible in the name and command line)."""
        self.scans += 1
        lines: list[str] = []
        try:
            pids = sorted(int(d) for d in os.listdir(self.proc) if d.isdigit())
        except OSError:
            return lines
        present = set(pids)
        adds = 0
        left_out = 0
        for pid in pids:
            if pid == self.self_pid:
                continue
            st = read_stat(pid, self.proc)
            if st is None or st.flags & PF_KTHREAD or st.ppid == self.self_pid:
                continue                            # gone, a kernel thread, or our own child
            k = self.known.get(pid)
            if k is None and (self.rec.recording(pid) or self.rec.takes_forks_of(st.ppid)):
                # a fork of a target whose rule says children = true: the recorder takes it at its
                # fork (BPF registered it; its fork event may still be on its way). Known from now
                # on, so that a scan never adds it too; were it never taken (events lost), the
                # next scan finds it known and unrecorded, and adds it
                cmdline = read_cmdline(pid, self.proc)
                self.known[pid] = Known(st.start, (st.comm, cmdline or ""), None, recorded=True, since=time.time())
                continue
            if k is not None and k.start != st.start:      # the pid was reused: the old one ended
                if k.recorded and self.rec.recording(pid):
                    self.rec.remove_process(pid, "exit", "exited (its pid was reused)")
                    lines.append(f"target pid {pid} exited (pid reused)")
                k = None
            if st.state in "ZX":
                if k is not None and k.recorded and self.rec.recording(pid):
                    self.rec.remove_process(pid, "exit", "exited")
                    k.recorded = False
                continue
            cmdline = read_cmdline(pid, self.proc)
            if cmdline is None:
                continue
            sig = (st.comm, cmdline)
            readds = k.readds if k is not None else 0
            if k is not None and k.recorded and not self.rec.recording(pid):
                # alive, yet dropped by the recorder: a failed attach, or the exit event of the
                # pid's previous process read late. Tried again, twice at most; never when
                # recording it failed on what it supplied (Recorder.failed_on)
                k.recorded = False
                if k.readds >= 2 or self.rec.failed_on(pid):
                    k.sig = sig
                    continue
                readds += 1
            elif k is not None and k.sig == sig and (not full or k.readds >= 2):
                continue
            view = ProcView.read(pid, self.proc)
            if view is None:
                continue
            rule = next((i for i, t in enumerate(self.cfg.targets) if t.matches(view)), None)
            was = k.rule if k is not None and k.recorded and self.rec.recording(pid) else None
            if was is not None:
                if rule == was or (rule is not None and self.cfg.targets[rule].tier == self.cfg.targets[was].tier):
                    k.sig, k.rule = sig, rule
                    continue
                why = (f"exec: now {st.comm!r}, no target table selects it" if rule is None else
                       f"exec: now selected by targets[{rule}] at tier {self.cfg.targets[rule].tier}")
                self.rec.remove_process(pid, "detach", why)
                lines.append(f"target pid {pid} ({st.comm}) detached: {why}")
                k.recorded = False
            k = self.known[pid] = Known(st.start, sig, rule, readds=readds)
            if rule is None:
                continue
            if adds >= MAX_ADDS_PER_SCAN:
                del self.known[pid]                 # evaluated again at the next scan
                continue
            if self.paused or self.rec.recorded_count() >= self.max_targets:
                left_out += 1
                del self.known[pid]
                continue
            try:
                info = self.read_info(pid)
            except ProcessLookupError:
                continue
            if (again := read_stat(pid, self.proc)) is None or again.start != st.start:
                del self.known[pid]                 # reused while we looked: next scan
                continue
            adds += 1
            target = self.cfg.targets[rule]
            tier = recorder_tier(target)
            if self.rec.add_process(info, tier, family=target.children):
                k.recorded, k.since = True, time.time()
                self.rec.note(pid, "select", f"targets[{rule}] ({target.describe()}): tier {target.tier}")
                lines.append(f"target pid {pid} ({info.comm}) added: targets[{rule}] "
                             f"({target.describe()}), tier {target.tier}")
        for pid in [p for p in self.known if p not in present]:
            k = self.known.pop(pid)
            if k.recorded and self.rec.recording(pid):
                self.rec.remove_process(pid, "exit", "exited")
                lines.append(f"target pid {pid} exited")
        self.left_out = left_out
        if left_out and not self._said_full:
            why = "memory above max_rss" if self.paused else f"max_targets = {self.max_targets} reached"
            lines.append(f"{left_out} selected processes are not recorded ({why}); they are added when "
                         "room is back")
            self._said_full = True
        elif not left_out:
            self._said_full = False
        return lines

    def start_of(self, pid: int) -> int:
        """The start time of a known process (0: not known)."""
        k = self.known.get(pid)
        return k.start if k is not None else 0
