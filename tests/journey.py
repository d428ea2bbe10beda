"""What the journeys (tests/journeys/) share: the README's commands, run as a user runs them.

A journey runs a command by its README text (`readme_argv`): the line must be one that README.md
shows, its placeholders replaced with what the journey made (a directory, a pid, a shorter
duration), so that a journey runs nothing the README does not show, and the README shows nothing
that no journey runs (tests/journeys/test_readme.py). Commands run from a directory of their own,
with the environment of a fresh root shell: no PYTHONPATH, the checkout's entry point
`.venv/bin/allocsampler` (or an installed one).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from conftest import ROOT

README = ROOT / "README.md"
RECORD_CMD = "allocsampler record --out /var/tmp/prof -- python serve.py"
ANALYZE = "allocsampler analyze /var/tmp/prof [--json]"
ALLOCSAMPLER = str(Path(sys.executable).parent / "allocsampler")   # the checkout's .venv/bin/allocsampler
SHELL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def readme_commands(text: str | None = None) -> list[str]:
    """Every `allocsampler ...` command that README.md shows, as written: the lines of its code
    blocks and its inline code spans that start with the command, without their comments."""
    text = README.read_text() if text is None else text
    found: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            cmd = line.strip().split(" # ")[0].split("   #")[0].strip()
            if cmd.startswith("allocsampler "):
                found.append(cmd)
        else:
            found += [m.strip() for m in re.findall(r"`(allocsampler [a-z][^`]*)`", line)]
    return list(dict.fromkeys(found))


Subst = dict[str, "str | list[str]"]


def readme_argv(line: str, subst: Subst | None = None, *, optional: bool = True,
                exe: str = ALLOCSAMPLER) -> list[str]:
    """The argv of a README command: `line` as README.md shows it (asserted), each token equal to a
    key of `subst` replaced (by several when its value is a list: a script and its arguments; a key
    with a / also inside tokens, as in --out=/var/tmp/prof), `[X]` taken as X (or left out:
    `optional=False`), the program as `exe`."""
    assert line in readme_commands(), f"README.md shows no command {line!r}"
    argv: list[str] = []
    for tok in shlex.split(line):
        if tok.startswith("[") and tok.endswith("]"):
            if not optional:
                continue
            tok = tok[1:-1]
        spliced = (subst or {}).get(tok)
        if isinstance(spliced, list):
            argv += [str(x) for x in spliced]
            continue
        for key, value in (subst or {}).items():
            if isinstance(value, str) and (tok == key or ("/" in key and key in tok)):
                tok = value if tok == key else tok.replace(key, value)
        argv.append(tok)
    argv[0] = exe
    return argv


def user_env(**extra: str) -> dict[str, str]:
    """A fresh root shell's environment (nothing of pytest's, no PYTHONPATH)."""
    env = {"PATH": SHELL_PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    return {**env, **extra}


def run_readme(line: str, subst: Subst | None = None, *, cwd: Path | str = "/", timeout: float = 300,
               env: dict[str, str] | None = None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Runs a README command (readme_argv) from `cwd` to its end; with `check`, it must exit 0."""
    argv = readme_argv(line, subst, **kw)
    r = subprocess.run(argv, cwd=cwd, env=env or user_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{shlex.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def findings(stdout: str) -> list[dict]:
    """`analyze --json`'s findings, most severe first."""
    return json.loads(stdout)["findings"]


def first_finding(text: str) -> tuple[str, str]:
    """(kind, text) of the first finding `analyze` prints, its lines joined."""
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if re.match(r"\d+\. \[", ln))
    m = re.match(r"1\. \[([a-z_]+)\]", lines[at])
    assert m, lines[at]
    body = []
    for ln in lines[at + 1:]:
        if not ln.startswith("   ") or ln.strip().startswith(("outstanding", "stack", "next:")):
            break
        body.append(ln.strip())
    return m.group(1), " ".join(body)


def tier_rows(out: Path, pid: int) -> list[tuple[str, str]]:
    """(event, detail) of a process's `targets` rows, oldest first."""
    import pandas as pd
    t = pd.read_parquet(out / "targets")
    t = t[t["pid"] == pid].sort_values("ts", kind="stable")
    return list(zip(t["event"].astype(str), t["detail"].fillna(""), strict=True))


def start_readme(line: str, subst: Subst | None = None, *, cwd: Path | str = "/", env: dict[str, str] | None = None,
                 prefix: list[str] = (), **kw) -> subprocess.Popen:
    """A README command started (readme_argv) from `cwd` (after `prefix`: a wrapper that runs it, as
    systemd would), its output to pipes: to stop as a user does (SIGINT, Ctrl-C) or to wait for."""
    return subprocess.Popen([*prefix, *readme_argv(line, subst, **kw)], cwd=cwd, env=env or user_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def truth_line(stderr: str) -> dict:
    """The last `{"truth": ...}` line a workload printed (tests/workloads/serve.py)."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith('{"truth"')]
    assert lines, stderr[-3000:]
    return json.loads(lines[-1])["truth"]


def inject_delay(out: Path, pid: int) -> float:
    """Seconds from the process's last exec row to its inject-tier row after it (inf: none)."""
    import pandas as pd
    t = pd.read_parquet(out / "targets")
    t = t[t["pid"] == pid].sort_values("ts", kind="stable")
    execs = t[t["event"] == "exec"]
    if execs.empty:
        return float("inf")
    after = t[(t["ts"] >= execs["ts"].iloc[-1]) & (t["event"] == "tier")]
    ok = after[after["detail"].str.startswith("inject: in-process sampler")]
    return (ok["ts"].iloc[0] - execs["ts"].iloc[-1]).total_seconds() if len(ok) else float("inf")


def leak_named(out: Path, function: str, exe: str = ALLOCSAMPLER, env: dict[str, str] | None = None) -> dict:
    """The persistent_growth finding whose stack passes through `function` (one, and only one)."""
    found = findings(run_readme(ANALYZE, {"/var/tmp/prof": str(out)}, exe=exe, env=env).stdout)
    mine = [f for f in found if f["kind"] == "persistent_growth" and any(fr["function"] == function
                                                                          for fr in f["frames"])]
    assert len(mine) == 1, [(f["kind"], f["summary"]) for f in found]
    return mine[0]


def assert_rate(f: dict, truth: dict, since: float) -> None:
    """The finding's rate, within its error of the service's own, and its held bytes within theirs of
    what the service kept between `since` (the recording's first row) and the finding's last
    snapshot (the service runs on a moment after it; a process recorded by pid had a life before)."""
    rate, se = f["growth_bytes_per_hour"] / 3600, f["growth_stderr_bytes_per_hour"] / 3600
    assert abs(rate - truth["rate"]) <= 3 * se + 0.05 * truth["rate"], (f["summary"], rate, se, truth["rate"])
    t, b = zip(*truth["series"], strict=True)
    kept = float(np.interp(pd.Timestamp(f["last_seen"]).timestamp(), t, b) - np.interp(since, t, b))
    held, held_se = f["outstanding_bytes"], f["outstanding_stderr_bytes"]
    assert abs(held - kept) <= 3 * held_se + 0.05 * kept, (f["summary"], held, held_se, kept)


def assert_both_leaks(out: Path, truth: dict, exe: str = ALLOCSAMPLER, env: dict[str, str] | None = None) -> None:
    """tests/workloads/serve.py's two leaks, each named with the rate the service counted."""
    since = pd.read_parquet(out / "targets")["ts"].min().timestamp()
    py = leak_named(out, "cache_response", exe, env)
    assert "cache_response (serve.py:" in py["summary"], py["summary"]
    assert_rate(py, truth["cache_response"], since)
    c = leak_named(out, "ext_alloc_record", exe, env)
    names = [fr["function"] for fr in c["frames"]]
    # from the C function that allocated, through its C caller, to the Python line that called it
    assert names[:2] == ["ext_alloc_record", "ext_parse_record"] and "parse_request" in names, names
    assert_rate(c, truth["parse_request"], since)
