"""`allocsampler status`: what the daemon is doing, from the status file it rewrites every interval
(DATA_DIR/.status.json, sampler/service/daemon.py) and, while it runs, its metrics endpoint."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
import urllib.request
from pathlib import Path

from sampler.errors import EnvironmentProblem
from sampler.service.config import DEFAULT_PATH, Config
from sampler.service.config import load as load_config
from sampler.text import printable
from sampler.units import fmt_bytes

STATUS_FILE = ".status.json"      # sampler.service.daemon.STATUS_FILE (not imported: that module is heavier)


def read_status(cfg: Config) -> dict:
    path = Path(cfg.daemon.data_dir) / STATUS_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EnvironmentProblem(f"no daemon status at {path}: the daemon has not run with this configuration "
                                 "(systemctl status allocsampler; journalctl -u allocsampler)") from None
    except PermissionError:
        raise EnvironmentProblem(f"cannot read {path}: run allocsampler status as root") from None
    except (OSError, ValueError) as e:
        raise EnvironmentProblem(f"unreadable daemon status at {path}: {e}") from None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"daemon" in f.read()
    except OSError:
        return False


def live_metrics(url: str, timeout: float = 2.0) -> dict[str, float]:
    """The unlabelled samples of the metrics endpoint (health figures); {} when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def state(doc: dict, now: float | None = None) -> tuple[str, bool]:
    """("running" | "stale" | "stopped", ok)."""
    now = dt.datetime.now(dt.timezone.utc).timestamp() if now is None else now
    if doc.get("state") != "running" or not _alive(int(doc.get("pid") or 0)):
        return "stopped", False
    age = now - dt.datetime.fromisoformat(doc["updated"]).timestamp()
    if age > 3 * float(doc.get("interval_s") or 10) + 30:
        return "stale", False
    return "running", True


def render(doc: dict, live: dict[str, float]) -> str:
    now = dt.datetime.now(dt.timezone.utc)
    st, _ = state(doc, now.timestamp())
    ago = now.timestamp() - dt.datetime.fromisoformat(doc["updated"]).timestamp()
    head = {"running": "running", "stale": "running, but its status is stale (it cannot write, or is stuck)",
            "stopped": "not running"}[st]
    lines = [f"allocsampler daemon: {head} (pid {doc.get('pid')}, started {doc.get('started')}, status "
             f"updated {ago:.0f} s ago)",
             f"  config {doc.get('config')}; data {doc.get('data_dir')}; recording {doc.get('recording_id')}; "
             f"metrics {doc.get('metrics') or 'off'}"]
    writing = doc.get("writing", "?")
    if live.get("allocsampler_writing_paused") == 1 and writing == "ok":
        writing = "paused (from the metrics endpoint)"
    lines.append(f"  writing: {writing}")
    disk = doc.get("disk", {})
    used = disk.get("dataset_bytes")
    free = disk.get("free_bytes")
    lines.append(f"  disk: dataset {fmt_bytes(used)} of {fmt_bytes(disk.get('max_bytes'))} budget; "
                 f"{fmt_bytes(free)} free (min {fmt_bytes(disk.get('min_free_bytes'))})")
    d = doc.get("daemon", {})
    bounded = d.get("bounded_rss_bytes")
    shared = (f" ({fmt_bytes(bounded)} less bcc's compiler pages that other processes share)"
              if bounded and d.get("rss_bytes") and bounded < d["rss_bytes"] - (1 << 20) else "")
    lines.append(f"  daemon: RSS {fmt_bytes(d.get('rss_bytes'))}{shared}, max_rss {fmt_bytes(d.get('max_rss'))}; CPU "
                 f"{100 * (d.get('cpu_fraction') or 0):.1f}% of a {100 * (d.get('cpu_budget') or 0):g}% budget "
                 f"(throttled {d.get('throttled_s', 0):g} s)")
    h = doc.get("health", {})
    lines.append(f"  events: {h.get('events_per_s', 0):,.0f}/s; lost {h.get('lost_events_total', 0):,}; dropped "
                 f"samples {h.get('dropped_samples_total', 0):,}; live table {h.get('live_entries', 0):,} of "
                 f"{h.get('live_capacity', 0):,}")
    tiers = ", ".join(f"{k} {v}" for k, v in sorted(doc.get("tiers", {}).items())) or "none"
    lines.append(f"  targets: {doc.get('targets_total', 0)} ({tiers}); selected but left out: "
                 f"{doc.get('targets_left_out', 0)}")
    targets = doc.get("targets", [])
    if targets:
        lines.append(f"    {'PID':>8}  {'COMM':<16} {'TIER':<8} {'RSS':>9}  RULE")
        for t in targets[:30]:
            tier = t.get("tier") or "?"
            if t.get("pre_oom"):
                tier += "*"
            lines.append(f"    {t.get('pid'):>8}  {printable(t.get('comm'), 16):<16} {tier:<8} "
                         f"{fmt_bytes(t.get('rss_bytes')):>9}  {printable(t.get('rule') or '')}")
        if len(targets) > 30:
            lines.append(f"    ... {len(targets) - 30} more (allocsampler status --json)")
        if any(t.get("pre_oom") for t in targets):
            lines.append("    * in a pre-OOM capture window")
    for kind in ("analysis", "compaction"):
        s = doc.get(kind) or {}
        if s:
            extra = (f", {s['findings']} findings" if "findings" in s else
                     f", {s.get('merged_files', 0)} files merged" if kind == "compaction" else "")
            err = f", failed: {printable(s['error'])}" if s.get("error") else ""
            child = s.get("max_rss_bytes")
            peak = f", peak RSS {fmt_bytes(child)}" if child else ""
            lines.append(f"  {kind}: last run {s.get('at')} ({s.get('seconds')} s{extra}{peak}{err})")
        else:
            lines.append(f"  {kind}: not run yet")
    up = doc.get("upload")
    if up:
        age = up.get("backlog_oldest_age_s")
        lines.append(f"  upload: {printable(up.get('uri'))}: {up.get('state')}; backlog "
                     f"{up.get('backlog_files', 0)} files "
                     f"({fmt_bytes(up.get('backlog_bytes'))} of {fmt_bytes(up.get('max_backlog_bytes'))}"
                     + (f", oldest {age:.0f} s" if age is not None else "") + f"); uploaded "
                     f"{up.get('uploaded_files', 0)} files ({fmt_bytes(up.get('uploaded_bytes'))}) since start; "
                     f"{up.get('failed_runs', 0)} failed runs; lost {up.get('lost_files', 0)} files "
                     f"({fmt_bytes(up.get('lost_bytes'))})")
        if up.get("consecutive_failures"):
            lines.append(f"    failing: {printable(up.get('last_error') or '?')} ({up['consecutive_failures']} runs in "
                         f"a row; next try in {up.get('next_run_in_s', 0):.0f} s)")
    findings = doc.get("findings") or []
    if findings:
        lines.append("  findings of the last analysis:")
        for f in findings[:10]:
            lines.append(f"    {f.get('kind')} pid {f.get('pid')} ({printable(f.get('comm'))}), severity "
                         f"{float(f.get('severity') or 0):.0f}: {printable(f.get('summary'))}")
    return "\n".join(lines)


def main(config_path: str = DEFAULT_PATH, as_json: bool = False) -> int:
    """0 while the daemon runs; 3 (with the status still printed) when it does not."""
    cfg = load_config(config_path)
    doc = read_status(cfg)
    st, ok = state(doc)
    live = live_metrics(doc["metrics"]) if ok and doc.get("metrics") else {}
    if as_json:
        print(json.dumps({**doc, "status": st, "live_metrics": live}, indent=2))
    else:
        print(render(doc, live))
    if not ok:
        print(f"allocsampler: error: the daemon is {st} (pid {doc.get('pid')}); see journalctl -u allocsampler",
              file=sys.stderr)
    return 0 if ok else 3

