"""The benchmarks in scripts/ keep running: each one's --quick mode, run as a user runs it
(`python scripts/bench_x.py --quick` from the repository root), must exit 0 and print its table
with the rows and columns of a full run. The numbers are not checked (quick runs are too small
to mean anything), only that they are there and parse.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from types import ModuleType

import pandas as pd
import pyarrow as pa
import pytest
from conftest import ROOT

from sampler.dataset.schema import PROCESSES, STR, TABLES

pytestmark = pytest.mark.serial     # alone after the rest (scripts/test.sh): benchmarks time things

QUICK_NOTE = "(--quick: a smoke test at the smallest sizes; the numbers mean nothing)"


def run_quick(script: str, *args: str) -> str:
    """stdout of `python scripts/<script> --quick [ARGS]`, which must exit 0 and say that it was quick."""
    r = subprocess.run([sys.executable, f"scripts/{script}", "--quick", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{script} exited {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert QUICK_NOTE in r.stdout
    return r.stdout


def _cells(line: str) -> list[str]:
    # between the first and the last pipe: bench_startup writes a remark after its header
    return [c.strip() for c in line[line.index("|") + 1:line.rindex("|")].split("|")]


def md_table(text: str, first: str) -> tuple[list[str], list[dict[str, str]]]:
    """The markdown table whose header starts with `| first |`: its header and one dict per row."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"| {first} ")), None)
    assert start is not None, f"no table with a `{first}` column in:\n{text}"
    header = _cells(lines[start])
    assert set(lines[start + 1]) <= set("|-: ") and len(_cells(lines[start + 1])) == len(header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        assert len(cells) == len(header), f"{line!r} has {len(cells)} cells, the header {len(header)}"
        rows.append(dict(zip(header, cells, strict=True)))
    return header, rows


def num(cell: str) -> float:
    """A table cell's (first) number: `1,234.5`, `+12.3%`, `4.10 (4.10-4.10)`."""
    return float(cell.split()[0].rstrip("%").replace(",", ""))


# -- bench_analysis: no BPF ------------------------------------------------------------------------

def test_bench_analysis_quick() -> None:
    out = run_quick("bench_analysis.py")
    rows = re.search(r"^wrote ([\d,]+) outstanding rows in \d+ s$", out, re.M)
    assert rows and int(rows[1].replace(",", "")) > 0, out
    m = re.search(r"^analyze: ([\d.]+) s, peak RSS (\d+) MiB, findings (\{.*\})$", out, re.M)
    assert m, out
    assert float(m[1]) > 0 and int(m[2]) > 0
    # each synthetic process has one leaking stack (and a cache, churn and a steady pool that are not leaks)
    assert ast.literal_eval(m[3]) == {"persistent_growth": 2}


def test_bench_analysis_fleet_quick() -> None:
    """--fleet --quick (3 hosts x 2 days) with --s3: every selection, locally and over moto, finds
    each host's leaks (one per process, 2 processes a host) and nothing else."""
    r = subprocess.run([sys.executable, "scripts/bench_analysis.py", "--fleet", "--quick", "--s3", "--s3-all"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and QUICK_NOTE in r.stdout, r.stderr[-4000:]
    header, rows = md_table(r.stdout, "where")
    assert header == ["where", "selection", "hosts", "findings", "wall time, median [min-max]",
                      "peak Pss with workers, median [min-max]"]
    assert [(row["where"], row["selection"].split()[0]) for row in rows] == \
        [("local", s) for s in ("every", "every", "--host", "--host", "--since", "as")] + \
        [("moto S3", s) for s in ("every", "every", "--host", "--host", "--since")]
    assert "--jobs 1" in rows[1]["selection"] and "--jobs" not in rows[0]["selection"]
    for row in rows:
        assert int(row["findings"]) == 2 * int(row["hosts"]) > 0 and num(row["wall time, median [min-max]"]) > 0
        assert int(row["hosts"]) == (1 if "one host" in row["selection"] else 3)


def _bench_analysis_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_analysis", ROOT / "scripts" / "bench_analysis.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_analysis_writes_the_schema_types() -> None:
    """Its synthetic tables take every type from the schema, whatever pandas infers (an all-null
    column is float64 to pandas), and a column the schema lacks is refused, not dropped."""
    arrow = _bench_analysis_module().arrow
    ts = pd.to_datetime(["2026-11-01T00:00:00Z", "2026-11-01T00:00:10Z"])
    for table in TABLES.values():
        assert arrow(table, pd.DataFrame(index=range(2))).schema == table.schema
    t = arrow(PROCESSES, pd.DataFrame({"ts": ts, "tier": [None, None], "rss": [1.0, 2.0]}))
    assert t.schema.field("tier").type == STR and t.schema.field("rss").type == pa.int64()
    with pytest.raises(ValueError, match="no columns"):
        arrow(PROCESSES, pd.DataFrame({"ts": ts, "no_such_column": [1, 2]}))


# -- the BPF benchmarks ----------------------------------------------------------------------------

@pytest.mark.bpf
def test_bench_overhead_quick(bpf_ready: None) -> None:
    text = run_quick("bench_overhead.py")
    header, rows = md_table(text, "workload")
    assert header[:4] == ["workload", "variant", "median loop s", "ratio vs unprobed"]
    assert len(header) == 13 and header[-1] == "tool peak RSS MiB"
    # one variant of each kind the harness starts differently, on the c workload only
    assert [(r["workload"], r["variant"]) for r in rows] == [
        ("c", v) for v in ("unprobed", "memleak", "inject", "attach", "preload", "preload-idle", "rss")]
    by = {r["variant"]: r for r in rows}
    assert all(num(r["median loop s"]) >= 0 and num(r["ratio vs unprobed"]) > 0 for r in rows)
    assert num(by["unprobed"]["ratio vs unprobed"]) == 1
    for v in ("inject", "attach", "preload", "rss"):  # read from the recorder's own dataset
        assert num(by[v]["probe hits/s"]) >= 0 and num(by[v]["lost events"]) >= 0
    assert num(by["attach"]["probe hits/s"]) > 0     # every malloc and free of the loop is a hit
    assert num(by["memleak"]["tool peak RSS MiB"]) > 0
    assert by["attach"]["our overhead / memleak's"] != "–"
    # the inject tier's attach: 20 timed placements, and each recorder's time to be in place
    stop = re.search(r"placement stop of the target's thread, 20 placements .*: median (\d+) us, p99 (\d+) us", text)
    assert stop and 0 < int(stop[1]) <= int(stop[2]), text
    assert re.search(r"c / inject: `record` started -> probes and redirection in place: median [\d.]+ s", text)


@pytest.mark.bpf
def test_bench_stacks_quick(bpf_ready: None) -> None:
    header, rows = md_table(run_quick("bench_stacks.py"), "workload")
    assert header == ["workload", "unwind", "pass", "samples", "mean record bytes", "p95 bytes", "reach entry",
                      "median µs/sample", "p95 µs/sample", "max µs"]
    passes = {"bpf": ("cold", "warm", "restart", "first sight: cold"), "user": ("cold", "warm", "restart")}
    assert [(r["workload"], r["unwind"], r["pass"]) for r in rows] == [
        (w, u, p) for u in ("bpf", "user") for w in ("C ext from Python", "torch CPU") for p in passes[u]]
    for r in rows:
        assert num(r["samples"]) > 0 and num(r["mean record bytes"]) > 0 and num(r["median µs/sample"]) > 0
        assert 0 <= num(r["reach entry"]) <= 100
    for w in ("C ext from Python", "torch CPU"):        # the three passes turn the same records into stacks
        for u in ("bpf", "user"):
            same = [r for r in rows if r["workload"] == w and r["unwind"] == u and r["pass"] != "first sight: cold"]
            assert len({r["samples"] for r in same}) == 1
        walked = [r for r in rows if r["workload"] == w and r["pass"] == "warm"]
        # records that carry walked pcs are far smaller than stack copies
        assert num(walked[0]["mean record bytes"]) < num(walked[1]["mean record bytes"]) / 4


@pytest.mark.bpf
def test_bench_startup_quick(bpf_ready: None) -> None:
    header, rows = md_table(run_quick("bench_startup.py"), "target")
    assert header == ["target", "BPF programs", "attached after (s)", "recorder CPU (s)", "of it user",
                      "of it system", "recorder peak RSS (MiB)"]
    assert [(r["target"], r["BPF programs"]) for r in rows] == [("python", "compiled (cold cache)"),
                                                               ("python", "loaded from the cache")]
    for r in rows:
        for col in header[2:]:
            assert re.fullmatch(r"[\d.]+ \([\d.]+-[\d.]+\)", r[col]) and num(r[col]) > 0, r


@pytest.mark.bpf
def test_bench_targets_quick(bpf_ready: None) -> None:
    header, rows = md_table(run_quick("bench_targets.py"), "scenario (20000 pairs/s, governor off)")
    assert header[1:] == ["median us CPU/pair", "max", "seconds"]
    assert [r[header[0]] for r in rows] == ["alone", "with 3 idle targets", "with 3 busy targets"]
    for r in rows:
        assert 0 < num(r["median us CPU/pair"]) <= num(r["max"]) and num(r["seconds"]) == 1


@pytest.mark.bpf
def test_bench_recorder_quick(bpf_ready: None) -> None:
    header, rows = md_table(run_quick("bench_recorder.py"), "recorder")
    assert header == ["recorder", "workload", "snapshots every (s)", "samples/s", "recorder CPU (% of a core)",
                      "us of recorder CPU per sample", "peak RSS (MiB)", "workers' CPU, whole run (s)"]
    assert [(r["recorder"], r["workload"], r["snapshots every (s)"]) for r in rows] == [
        ("this checkout", "service", "1")]
    for col in header[3:]:
        assert num(rows[0][col]) > 0, rows[0]


@pytest.mark.bpf
def test_bench_servers_quick(bpf_ready: None) -> None:
    # pg-S-C runs pg-S's code with -C: pg-S itself is left out of the smoke test
    servers = ["pg-S-C", "redis", "gunicorn", "pg-S-beside"]
    text = run_quick("bench_servers.py", "--servers", ",".join(servers), "--kernel-side")
    header, rows = md_table(text, "server")
    assert header == ["server", "unrecorded (per s)", "recorded (per s)", "ratio", "per-round ratios",
                      "recorder CPU (% of a core)"]
    assert [r["server"] for r in rows] == servers
    for r in rows:
        assert num(r["unrecorded (per s)"]) > 0 and num(r["recorded (per s)"]) > 0 and num(r["ratio"]) > 0, r
    tables = text.split("\n\n")         # the kernel side's table, the second whose header is `| server |`
    header, rows = md_table(next(t for t in tables if "no-op syscall tracepoint" in t), "server")
    assert header == ["server", "beside a no-op syscall tracepoint (per s)", "ratio", "per-round ratios"]
    assert [r["server"] for r in rows] == servers[:-1]      # pg-S-beside records in its own way
    assert all(num(r["ratio"]) > 0 for r in rows), rows
    header, rows = md_table(text, "fork storm")
    assert header == ["fork storm", "children/s", "forked", "recorded", "seen allocating",
                      "recorder CPU (% of a core)", "on the idle parent"]
    assert len(rows) == 1 and num(rows[0]["forked"]) > 0 and num(rows[0]["recorded"]) > 0, rows
    assert num(rows[0]["seen allocating"]) > 0, rows        # registered at the fork: sampled from the start
