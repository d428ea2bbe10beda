"""The Quickstart's first command, `bash scripts/demo.sh`, as a new user runs it from the checkout,
and the README's commands for reading a recording, run on what it recorded: what the user reads
first is the demo's leak, at the rate the demo service says it leaks."""

from __future__ import annotations

import gzip
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT
from journey import findings, first_finding, run_readme, tier_rows, user_env
from readers import chromium, decode

pytestmark = pytest.mark.bpf

DEMO_OUT = "/var/tmp/allocsampler-demo"        # scripts/demo.sh's default
# the line that leaks, as the report names it (the Quickstart's promise: handle (demo_workload.py:32))
LINE = next(i for i, ln in enumerate((ROOT / "scripts" / "demo_workload.py").read_text().splitlines(), 1)
            if "payload_cache[doc_id] =" in ln)
LEAK = f"handle (demo_workload.py:{LINE})"


@dataclass
class Demo:
    out: Path
    stdout: str
    stderr: str
    truth_bytes: int            # what the demo service says its leaking cache holds at the end
    truth_rate: float           # and how fast it grew (bytes/s)


@pytest.fixture(scope="module")
def demo(bpf_ready) -> Demo:
    r = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=user_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    m = re.search(r"demo service: served \d+ requests; .* holds (\d+) bytes, growing (\d+) bytes/s", r.stderr)
    assert m, r.stderr[-3000:]
    return Demo(Path(DEMO_OUT), r.stdout, r.stderr, int(m.group(1)), float(m.group(2)))


def test_the_demo_names_its_leak_first_at_the_rate_the_service_reports(demo):
    kind, text = first_finding(demo.stdout)
    assert kind == "persistent_growth" and LEAK in text, demo.stdout
    assert "[recording_incomplete]" not in demo.stdout and "[unexplained_growth]" not in demo.stdout, demo.stdout
    (pid,) = {int(p) for p in re.findall(r"pid (\d+) \(python\)", demo.stdout)}
    rows = tier_rows(demo.out, pid)
    assert rows[0][0] == "exec" and rows[1][0] == "tier" and rows[1][1].startswith("inject: in-process sampler"), rows
    # the same finding as JSON: its rate, within its error of what the service counted
    f = findings(run_readme("allocsampler analyze /var/tmp/prof [--json]", {"/var/tmp/prof": DEMO_OUT}).stdout)[0]
    assert f["kind"] == "persistent_growth" and any(fr["function"] == "handle" and fr["line"] == LINE
                                                   for fr in f["frames"]), f
    rate, se = f["growth_bytes_per_hour"] / 3600, f["growth_stderr_bytes_per_hour"] / 3600
    assert abs(rate - demo.truth_rate) <= 3 * se, (rate, se, demo.truth_rate)
    held, held_se = f["outstanding_bytes"], f["outstanding_stderr_bytes"]
    assert abs(held - demo.truth_bytes) <= 3 * held_se + 0.05 * demo.truth_bytes, (held, held_se, demo.truth_bytes)


def test_top_lists_the_leak_first(demo):
    out = run_readme("allocsampler top /var/tmp/prof", {"/var/tmp/prof": DEMO_OUT}).stdout
    first = next(ln for ln in out.splitlines() if ln.strip().startswith("1."))
    assert LEAK in first and "malloc" in first, out
    pinned = run_readme("allocsampler top /var/tmp/prof --pinned", {"/var/tmp/prof": DEMO_OUT}).stdout
    assert "pinned" in pinned and "Traceback" not in pinned, pinned


def test_the_html_report_opens_in_a_browser_and_shows_the_leak(demo, tmp_path):
    page = tmp_path / "report.html"
    run_readme("allocsampler report /var/tmp/prof --html report.html", {"/var/tmp/prof": DEMO_OUT}, cwd=tmp_path)
    assert page.is_file() and (demo.out / "report.html").is_file()      # and the demo's own
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert '<html lang="en" class="js">' in dom                        # its script ran
    assert "persistent_growth" in dom and LEAK in dom
    assert "{&#34;" not in dom and '{"' not in dom.split("<script")[0], "a raw dict in the report"


def test_exports_carry_the_leak(demo, tmp_path, profile_pb2):
    run_readme("allocsampler export DIR --pprof heap.pb.gz", {"DIR": DEMO_OUT}, cwd=tmp_path)
    _, samples = decode(profile_pb2, tmp_path / "heap.pb.gz")
    assert samples
    assert gzip.decompress((tmp_path / "heap.pb.gz").read_bytes())
    heaviest = max(samples, key=lambda s: s.values.get("inuse_space", 0))
    assert any(fr["function"] == "handle" for fr in heaviest.frames), heaviest.frames
    run_readme("allocsampler export DIR --collapsed stacks.txt", {"DIR": DEMO_OUT}, cwd=tmp_path)
    lines = (tmp_path / "stacks.txt").read_text().splitlines()
    top = max(lines, key=lambda ln: int(ln.rsplit(" ", 1)[1]))
    assert "handle" in top, top
