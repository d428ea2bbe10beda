"""The daemon's child processes: analysis, compaction and upload, one at a time, out of its memory.

pyarrow's merge buffers, pandas and the S3 client never enter the daemon; a child dies with the
daemon (PR_SET_PDEATHSIG), is stopped past its deadline, and reports one JSON document on stdout.
    python -m sampler.service.children PARENT_PID analyze DIR --window S
    python -m sampler.service.children PARENT_PID compact DIR --older-than S [--seal]
    python -m sampler.service.children PARENT_PID upload DIR --uri URI [--endpoint E] [--region R]
                                       --retries N --budget S
    python -m sampler.service.children PARENT_PID probe DIR --uri URI ...   (exit 3: refused, 4: unreachable)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sampler.environ import python_module
from sampler.lifetime import die_with_parent
from sampler.shutdown import release_s3

CHILD_TIMEOUT_S = 600


@dataclass
class Child:
    kind: str
    proc: subprocess.Popen
    out: object            # a temporary file: its stdout
    err: object
    started: float
    deadline: float
    wall: float            # when it started (wall clock)


@dataclass
class Result:
    """A finished child: `doc` its JSON document (None when it failed), `state` for `status`."""

    kind: str
    doc: dict | None
    state: dict = field(default_factory=dict)
    wall: float = 0.0


class Children:
    """A queue of jobs run one at a time; `poll` (every loop tick) starts, reaps and times them out.
    `args(kind)` gives a job's arguments and timeout; `log` takes one line."""

    def __init__(self, args: Callable[[str], tuple[list[str], float]], log: Callable[[str], None]):
        self.args, self.log = args, log
        self.child: Child | None = None
        self.pending: list[str] = []
        self.stopping = False

    def queue(self, kind: str) -> None:
        if kind not in self.pending and not (self.child and self.child.kind == kind):
            self.pending.append(kind)

    def poll(self, now: float) -> Result | None:
        """A result when a child finished at this tick."""
        c, result = self.child, None
        if c is not None:
            code = c.proc.poll()
            if code is None:
                if now > c.deadline:
                    c.proc.kill()
                    c.proc.wait()
                    why = f"took over {c.deadline - c.started:.0f} s and was stopped"
                    self.log(f"{c.kind}: child {why}")
                    self._close()
                    return Result(c.kind, None, {**self._state(c, now, -9), "error": why}, c.wall)
                return None
            try:
                result = self._done(c, code, now)
            finally:
                self._close()
        if self.pending and self.child is None and not self.stopping:
            self._start(self.pending.pop(0), now)
        return result

    def stop(self) -> None:
        self.stopping = True
        if self.child is not None and self.child.proc.poll() is None:
            self.child.proc.kill()
            with contextlib.suppress(Exception):
                self.child.proc.wait(5)
        self._close()

    def _start(self, kind: str, now: float) -> None:
        args, timeout = self.args(kind)
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()     # noqa: SIM115 (closed in _close)
        try:
            argv = python_module("sampler.service.children", str(os.getpid()), kind, *args)
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, close_fds=True, cwd="/")
        except OSError as e:
            out.close()
            err.close()
            self.log(f"{kind}: could not start a child process: {e.strerror or e}")
            return
        self.child = Child(kind, proc, out, err, now, now + min(timeout, CHILD_TIMEOUT_S), time.time())

    def _close(self) -> None:
        c, self.child = self.child, None
        if c is not None:
            for f in (c.out, c.err):
                with contextlib.suppress(Exception):
                    f.close()

    @staticmethod
    def _state(c: Child, now: float, code: int) -> dict:
        return {"at": dt.datetime.fromtimestamp(c.wall, dt.timezone.utc).isoformat(timespec="seconds"),
                "seconds": round(now - c.started, 1), "exit": code}

    def _done(self, c: Child, code: int, now: float) -> Result:
        c.out.seek(0)
        c.err.seek(0)
        text = c.out.read(16 << 20).decode(errors="replace")
        err_lines = c.err.read(1 << 20).decode(errors="replace").strip().splitlines()
        state = self._state(c, now, code)
        doc = None
        if code != 0:
            state["error"] = err_lines[-1] if err_lines else f"exit status {code}"
            self.log(f"{c.kind}: failed ({state['error']})")
        else:
            try:
                doc = json.loads(text)
            except ValueError:
                state["error"] = "unreadable output"
                self.log(f"{c.kind}: unreadable output from the child")
        return Result(c.kind, doc if isinstance(doc, dict) else None, state, c.wall)


# -- the child's side ------------------------------------------------------------------------------

def child_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m sampler.service.children")
    p.add_argument("parent", type=int)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("analyze")
    a.add_argument("dir")
    a.add_argument("--window", type=float, required=True)
    c = sub.add_parser("compact")
    c.add_argument("dir")
    c.add_argument("--older-than", type=float, required=True)
    c.add_argument("--seal", action="store_true")
    for name in ("upload", "probe"):
        u = sub.add_parser(name)
        u.add_argument("dir")
        u.add_argument("--uri", required=True)
        u.add_argument("--endpoint")
        u.add_argument("--region")
        u.add_argument("--retries", type=int, default=3)
        u.add_argument("--budget", type=float, default=60.0)
    args = p.parse_args(argv)
    die_with_parent(args.parent)
    if args.what in ("upload", "probe"):
        return _upload(args)
    if args.what == "analyze":
        from analysis import analyze
        from analysis.dataset import load

        since = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=args.window)
        findings = analyze.run(load(args.dir, since=since))
        print(json.dumps({**analyze.to_document(findings), "max_rss_bytes": _own_peak()}))
        return 0
    from sampler.dataset.retention import compact

    rep = compact(args.dir, args.older_than, seal=args.seal)
    print(json.dumps({"merged_files": rep.files_before, "new_files": len(rep.merged),
                      "bytes_before": rep.bytes_before, "bytes_after": rep.bytes_after,
                      "seconds": round(rep.seconds, 2), "skipped": rep.skipped, "max_rss_bytes": _own_peak()}))
    return 0


def _upload(args) -> int:
    from sampler.dataset import upload

    dest = upload.Destination(args.uri, args.endpoint, args.region, args.retries,
                              request_timeout_s=max(5.0, args.budget))
    if args.what == "probe":
        try:
            upload.probe(dest)
        except upload.DestinationError as e:
            print(e, file=sys.stderr)
            return 3
        except OSError as e:
            print(e, file=sys.stderr)
            return 4
        return 0
    rep = upload.run(args.dir, dest, args.budget)
    print(json.dumps({**rep.to_dict(), "max_rss_bytes": _own_peak()}))
    return 0


def _own_peak() -> int:
    """This process's peak RSS since its exec: VmHWM, as getrusage's maxrss keeps the RSS of the
    forked daemon from before the exec."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) << 10
    return 0


if __name__ == "__main__":
    try:
        code = child_main(sys.argv[1:])
    finally:
        release_s3()
    sys.exit(code)
