"""`allocsampler diff`: two real recordings of the leaky workload, the new one leaking more at one
site, at a new site, and no longer at a third; the gate's exit status and what it says grew."""

from __future__ import annotations

import json
import math
import subprocess

import pandas as pd
import pytest
from conftest import Recorded, allocsampler_cmd

MiB = 1 << 20


# site -> its status in the new run against the baseline
STATUS = {"leak_malloc": "grew", "leak_posix_memalign": "new", "leak_calloc": "gone"}


@pytest.fixture(scope="module")
def runs(leaky, leaky_grown) -> tuple[Recorded, Recorded]:
    """The session's shared recordings (conftest.py), read in place. Baseline `leaky`: leak_malloc
    32 MiB, leak_calloc 16 MiB (gone in the new run), churn. New `leaky_grown`: leak_malloc
    128 MiB (grew by 96 MiB), leak_posix_memalign 16 MiB (new), the same churn (unchanged).
    The sizes keep every listed change many standard errors (512 KiB sampling) above the
    3-stderr threshold of the listing."""
    base, new = leaky, leaky_grown
    assert {s for s, n in base.truth.items() if n and s != "churn"} == {"leak_malloc", "leak_calloc"}
    assert {s for s, n in new.truth.items() if n and s != "churn"} == {"leak_malloc", "leak_posix_memalign"}
    assert new.truth["leak_malloc"] >= 4 * base.truth["leak_malloc"] and new.truth["churn"] == base.truth["churn"]
    return base, new


def diff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(allocsampler_cmd("diff", *args), capture_output=True, text=True)


def final_by_site(r: Recorded) -> pd.DataFrame:
    """The last snapshot's malloc estimate per allocation site, from the dataset itself."""
    o = pd.read_parquet(r.out / "outstanding")
    o = o[(o["source"] == "malloc") & (o["ts"] == o["ts"].max())]
    f = pd.read_parquet(r.out / "frames")
    site = f[f["depth"] == 0].drop_duplicates("stack_id").set_index("stack_id")["function"]
    o = o.assign(site=o["stack_id"].map(site), var=o["outstanding_stderr_bytes"] ** 2)
    return o.groupby("site")[["outstanding_bytes", "var"]].sum()


@pytest.mark.bpf
def test_gate_fails_on_growth_and_explains_it(runs):
    base, new = runs
    p = diff(str(base.out), str(new.out), "--budget", "5%", "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["schema"] == 1 and doc["over_budget"] is True and doc["budget"] == "5%"
    comm = str(pd.read_parquet(new.out / "processes")["comm"].iloc[0])
    (proc,) = [x for x in doc["processes"] if x["comm"] == comm]
    assert proc["presence"] == "both" and proc["over_budget"]
    metrics = {(m["metric"], m["source"]): m for m in proc["metrics"]}

    # peak RSS is exact: the highest RSS of the process in each dataset
    for r, side in ((base, "baseline"), (new, "new")):
        assert metrics["peak_rss", None][side] == pd.read_parquet(r.out / "processes")["rss"].max()
    assert metrics["peak_rss", None]["over_budget"]      # 96 MiB more touched heap
    # no GPU measurement: n/a, never 0, and never over budget
    gpu = metrics["gpu_reserved", None]
    assert gpu["baseline"] is None and gpu["new"] is None and not gpu["over_budget"]

    # final outstanding grew by what the workload leaked more, within its standard error
    truth = sum(new.truth[s] for s in STATUS if s in new.truth) - sum(base.truth[s] for s in STATUS if s in base.truth)
    final = metrics["final_outstanding", "malloc"]
    assert abs(final["change"] - truth) <= 4 * final["stderr"], final
    assert final["over_budget"]

    # per stack, matched by frames: what grew, what is new, what went away; churn did not change
    stacks = {}
    for s in proc["stacks"]:
        site = s["stack"].split(" (", 1)[0]
        assert site not in stacks, "a site's stack was not matched across the datasets"
        stacks[site] = s
    assert set(stacks) == set(STATUS), list(stacks)
    assert {site: s["status"] for site, s in stacks.items()} == STATUS
    fb, fn = final_by_site(base), final_by_site(new)
    for site in STATUS:
        want = new.truth.get(site, 0) - base.truth.get(site, 0)
        s = stacks[site]
        assert abs(s["change_bytes"] - want) <= 4 * s["stderr_bytes"], s
        # the numbers are the datasets' own estimates for that site
        assert s["new_final_bytes"] == pytest.approx(fn["outstanding_bytes"].get(site, 0.0))
        assert s["baseline_final_bytes"] == pytest.approx(fb["outstanding_bytes"].get(site, 0.0))
        se = math.sqrt(fb["var"].get(site, 0.0) + fn["var"].get(site, 0.0))
        assert s["stderr_bytes"] == pytest.approx(se)

    # the text form says the same
    p = diff(str(base.out), str(new.out), "--budget", "5%")
    assert p.returncode == 1
    assert "OVER BUDGET" in p.stdout and "n/a" in p.stdout
    for word in ("grew stacks", "new stacks", "gone stacks", *STATUS):
        assert word in p.stdout


@pytest.mark.bpf
def test_gate_passes_within_budget(runs):
    base, new = runs
    # the same dataset on both sides: nothing changed
    p = diff(str(base.out), str(base.out), "--budget", "0%", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert not doc["over_budget"]
    assert all(not x["stacks"] and all(m["change"] in (0, None) for m in x["metrics"]) for x in doc["processes"])
    # an absolute budget above the growth; no budget at all; a gate on a metric that is n/a
    assert diff(str(base.out), str(new.out), "--budget", "1G").returncode == 0
    assert diff(str(base.out), str(new.out)).returncode == 0
    assert diff(str(base.out), str(new.out), "--budget", "0%", "--metric", "gpu_reserved").returncode == 0
    # shrinking is never over budget
    assert diff(str(new.out), str(base.out), "--budget", "5%", "--metric", "final_outstanding").returncode == 0


def test_diff_usage_errors(tmp_path):
    for args in ([str(tmp_path), str(tmp_path)],                              # no recording there
                 [str(tmp_path), str(tmp_path), "--budget", "5x"],
                 [str(tmp_path), str(tmp_path), "--metric", "peak_vram"]):
        p = diff(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("allocsampler: error:")


def test_parse_budget():
    from analysis.diff import parse_budget
    assert parse_budget("5%").allowed(200.0) == pytest.approx(210.0)
    assert parse_budget("64M").allowed(1.0) == 1 + 64 * MiB
    assert parse_budget("1.5GiB").absolute == 1.5 * (1 << 30)
    assert parse_budget("4096").absolute == 4096
    for bad in ("x", "-5%", "%", "5 apples"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_stacks_match_across_paths_and_builds():
    """Keys leave out what changes between builds and checkouts: addresses, install prefixes."""
    from analysis.diff import stack_key

    def stack(prefix: str, offset: int) -> list[dict]:
        return [{"function": "leak", "module": "libx.so", "offset": offset, "kind": "native"},
                {"function": None, "module": "libffi.so.8", "offset": offset + 7, "kind": "native"},
                {"function": None, "module": "libffi.so.8", "offset": offset + 9, "kind": "native"},
                {"function": "forward", "file": f"{prefix}/lib/python3.11/site-packages/torch/nn/modules/module.py",
                 "line": offset, "kind": "python"},
                {"function": "<module>", "file": f"{prefix}/bench.py", "line": 3, "kind": "python"}]

    a, b = stack_key(stack("/home/ci/base/.venv", 100)), stack_key(stack("/tmp/pr/venv", 200))
    assert a == b == ("leak (libx.so) < ? (libffi.so.8) < forward (torch/nn/modules/module.py) < "
                      "<module> (bench.py)")
    assert stack_key([]) == "[no stack]"


def _spread_growth(out, per_stack: float, stderr: float, stacks: int = 40):
    """A dataset of one process `svc` whose `stacks` malloc stacks each hold `per_stack` bytes at
    its two snapshots, each estimate with `stderr`: the recorder's own writer and schema."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from bench_analysis import arrow

    from sampler.dataset.schema import FRAMES, OUTSTANDING, PROCESSES, STACKS
    from sampler.dataset.writer import DatasetWriter

    t0 = pd.Timestamp("2026-11-01T00:00:00Z")
    ts = [t0 + pd.Timedelta(seconds=10), t0 + pd.Timedelta(seconds=20)]
    sids = range(100, 100 + stacks)
    w = DatasetWriter(out, "diff", host="h")
    w.write(OUTSTANDING, arrow(OUTSTANDING, pd.DataFrame(
        [{"ts": t, "recording_id": "diff", "interval_s": 10.0, "pid": 7, "comm": "svc", "source": "malloc",
          "stack_id": sid, "outstanding_bytes": per_stack, "outstanding_stderr_bytes": stderr,
          "live_samples": 4, "alloc_samples": 0, "free_samples": 0} for t in ts for sid in sids])))
    w.write(PROCESSES, arrow(PROCESSES, pd.DataFrame(
        [{"ts": t, "recording_id": "diff", "pid": 7, "comm": "svc", "rss": 512 * MiB} for t in ts])))
    w.write(FRAMES, arrow(FRAMES, pd.DataFrame(
        [{"ts": t0, "recording_id": "diff", "stack_id": sid, "depth": 0, "function": f"cache_{sid}",
          "module": "libapp.so", "kind": "native"} for sid in sids])))
    w.write(STACKS, arrow(STACKS, pd.DataFrame([{"ts": t0, "recording_id": "diff", "stack_id": sid, "n_frames": 1}
                                               for sid in sids])))
    return out


def test_growth_spread_over_many_stacks_fails_the_gate_and_names_the_largest(tmp_path):
    """40 stacks each 0.6 MiB larger, each change 0.85 standard errors: no stack passes 3 alone,
    their sum (24 MiB ± 4.5 MiB) does. The gate fails and lists the largest growths, each with its
    error and marked as within it; within budget the same changes are not listed (noise)."""
    base = _spread_growth(tmp_path / "base", 1.0 * MiB, 0.5 * MiB)
    new = _spread_growth(tmp_path / "new", 1.6 * MiB, 0.5 * MiB)
    p = diff(str(base), str(new), "--budget", "5%", "--json", "--metric", "final_outstanding")
    assert p.returncode == 1, p.stdout + p.stderr
    (proc,) = json.loads(p.stdout)["processes"]
    final = {m["metric"]: m for m in proc["metrics"] if m["source"] == "malloc"}["final_outstanding"]
    assert final["over_budget"] and final["change"] == pytest.approx(40 * 0.6 * MiB)
    assert final["stderr"] == pytest.approx(math.sqrt(80) * 0.5 * MiB)
    assert len(proc["stacks"]) == 10 and {s["status"] for s in proc["stacks"]} == {"grew_within_error"}
    assert proc["grew_within_error_of"] == 40
    for s in proc["stacks"]:
        assert s["change_bytes"] == pytest.approx(0.6 * MiB)
        assert s["stderr_bytes"] == pytest.approx(math.sqrt(0.5) * MiB)
    text = diff(str(base), str(new), "--budget", "5%", "--metric", "final_outstanding")
    assert text.returncode == 1
    assert "no stack grew by more than 3 standard errors alone; the largest growths (10 of 40)" in text.stdout
    assert "+614.4 KiB ± 724.1 KiB" in text.stdout and "cache_1" in text.stdout, text.stdout
    within = json.loads(diff(str(base), str(new), "--budget", "100%", "--json").stdout)
    assert within["over_budget"] is False and within["processes"][0]["stacks"] == []
