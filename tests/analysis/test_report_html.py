"""The HTML report: flame graph layout and rendering on synthetic datasets, and a real recording's
report opened in headless Chromium (screenshot not blank, charts and flame graphs in the DOM)."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from readers import chromium

from analysis.dataset import Dataset, load, read_frames
from analysis.findings import Finding, to_document
from analysis.frames import frames_json, naming_hint, read_stack_frames, stack_frames, trim_frames
from analysis.report import flamegraph, sections
from analysis.report.charts import byte_ticks, time_ticks
from analysis.report.html import format_detail, render_html
from analysis.report.text import render

KiB = 1024
T0 = pd.Timestamp("2026-01-02 03:04:00", tz="UTC")

# stack_id -> frames outermost first, and its bytes at the end (growing linearly from 0)
STACKS = {1: (["main", "parse", "alloc_a"], 300 * KiB),
          2: (["main", "parse", "std::vector<int>::push_back"], 100 * KiB),
          3: (["main", "cache_put"], 600 * KiB),
          4: (None, 50 * KiB)}                     # no frames recorded


def synthetic(n: int = 10) -> Dataset:
    times = [T0 + pd.Timedelta(seconds=10 * i) for i in range(n)]
    out = pd.DataFrame([{"ts": t, "pid": 42, "comm": "svc", "source": "malloc", "stack_id": sid,
                         "outstanding_bytes": final * i / (n - 1), "outstanding_stderr_bytes": final * 0.05}
                        for i, t in enumerate(times) for sid, (_, final) in STACKS.items()])
    frames = pd.DataFrame([{"stack_id": sid, "depth": len(fns) - 1 - k, "function": fn, "module": "svc",
                            "offset": 0x1000 + k, "file": None, "line": None, "kind": "native"}
                           for sid, (fns, _) in STACKS.items() if fns for k, fn in enumerate(fns)])
    mib = 1 << 20
    procs = pd.DataFrame([{"ts": t, "pid": 42, "comm": "svc", "rss": 90 * mib + i * mib, "heap_rss": 40 * mib,
                           "arena_rss": 20 * mib + i * mib, "anon_rss": 10 * mib, "file_rss": 19 * mib,
                           "stack_rss": mib, "heap_live_bytes": 30.0 * mib, "arena_live_bytes": 5.0 * mib,
                           "heap_arena_live_stderr_bytes": 0.5 * mib, "memory_limit": 8 << 30, "arenas": 3}
                          for i, t in enumerate(times)])
    empty = pd.DataFrame()
    return Dataset(root=Path("/data/synthetic"), outstanding=out, processes=procs, stacks=empty, frames=frames,
                   vm_events=empty, targets=empty, recordings=empty)


def flame_frames(doc: str) -> list[list[tuple[float, float, int, str]]]:
    """(x, width, depth, label) of the frames of each flame graph in a document."""
    graphs = re.findall(r'<svg class="flame".*?</svg>', doc, re.S)
    frame = r'data-x="([\d.]+)" data-w="([\d.]+)" data-d="(\d+)" data-l="([^"]*)"'
    return [[(float(x), float(w), int(d), label) for x, w, d, label in re.findall(frame, g)] for g in graphs]


def test_flame_graph_layout_widths_are_bytes_and_children_nest():
    ds = synthetic()
    stacks = stack_frames(ds.frames)
    assert [f["function"] for f in stacks[1]] == ["alloc_a", "parse", "main"]      # innermost first
    last = ds.outstanding[ds.outstanding["ts"] == ds.outstanding["ts"].max()].set_index("stack_id")
    root = flamegraph.tree_from_values(last["outstanding_bytes"], stacks, "all malloc")
    total = sum(b for _, b in STACKS.values())
    assert root.value == pytest.approx(total)
    rects = flamegraph.layout(root)
    width = {r.node.function: r.w for r in rects}
    assert width["all malloc"] == pytest.approx(1)
    assert width["main"] == pytest.approx(1000 * KiB / total)
    assert width["parse"] == pytest.approx(400 * KiB / total)
    assert width["cache_put"] == pytest.approx(600 * KiB / total)
    assert width["[no stack]"] == pytest.approx(50 * KiB / total)
    at = {id(r.node): r for r in rects}
    for r in rects:                          # children lie inside their parent, one row below, apart
        kids = sorted((at[id(c)] for c in r.node.children.values()), key=lambda k: k.x)
        assert sum(k.w for k in kids) <= r.w + 1e-12
        for k in kids:
            assert k.depth == r.depth + 1 and r.x - 1e-12 <= k.x and k.x + k.w <= r.x + r.w + 1e-12
        for a, b in zip(kids, kids[1:], strict=False):
            assert a.x + a.w <= b.x + 1e-12
    # the same in the report's SVG: the end-of-window graph, then the growth graph (all grew from 0)
    doc = render_html(ds, [])
    outstanding, growth = flame_frames(doc)
    for graph in (outstanding, growth):
        w = {label: width for _, width, _, label in graph}
        full = w["all malloc"]
        assert w["main"] / full == pytest.approx(1000 / 1050, abs=1e-3)
        assert w["alloc_a"] / full == pytest.approx(300 / 1050, abs=1e-3)
        assert "std::vector&lt;int&gt;::push_back" in w              # escaped, not markup
    assert "<int>" not in doc


def test_labels_are_truncated_to_fit():
    assert flamegraph.label_for("a_rather_long_function_name", 1000) == "a_rather_long_function_name"
    short = flamegraph.label_for("a_rather_long_function_name", 80)
    assert short.endswith("…") and len(short) * flamegraph.CHAR <= 80
    assert flamegraph.label_for("f", 10) == ""


def test_empty_inputs():
    assert flamegraph.layout(flamegraph.build_tree([])) == []
    assert flamegraph.layout(flamegraph.build_tree([([("f", "m")], 0.0), ([("g", "m")], -5.0)])) == []
    assert "nothing to show" in flamegraph.render_svg(flamegraph.build_tree([]))
    assert stack_frames(pd.DataFrame()) == {}
    bare = pd.DataFrame()
    no_rows = synthetic()
    no_rows.outstanding, no_rows.processes = no_rows.outstanding.iloc[0:0], no_rows.processes.iloc[0:0]
    for ds in (Dataset(Path("/nowhere"), bare, bare, bare, bare, bare, bare, bare), no_rows):
        doc = render_html(ds, [])
        assert "No findings" in doc and "No process data" in doc and doc.rstrip().endswith("</html>")


def test_empty_dataset_directory(tmp_path):
    doc = render_html(load(tmp_path), [], title="nothing yet")
    assert "<title>nothing yet</title>" in doc and "No process data" in doc


def test_one_snapshot_and_many_processes():
    ds = synthetic(2)
    last = ds.outstanding["ts"].max()
    ds.outstanding, ds.processes = ds.outstanding[ds.outstanding["ts"] == last], ds.processes.iloc[-1:]
    doc = render_html(ds, [])
    assert doc.count('<svg class="chart"') == 3 and "<circle" in doc
    assert len(flame_frames(doc)) == 1                 # at the end; one snapshot has no growth
    many = synthetic(3)
    many.processes = pd.concat([many.processes.assign(pid=pid) for pid in range(100, 105)])
    doc = render_html(many, [], max_processes=2)
    assert doc.count("<section") == 2 and "4 more processes are not charted" in doc


def test_process_without_outstanding_or_without_heap_columns():
    ds = synthetic()
    ds.outstanding = ds.outstanding.iloc[0:0]
    ds.processes = ds.processes.drop(columns=["heap_live_bytes", "arena_live_bytes", "stack_rss"])
    doc = render_html(ds, [])
    assert "No sampled allocations" in doc and 'class="flame"' not in doc
    assert doc.count('<svg class="chart"') == 2 and "thread stacks" not in doc


def test_layout_charts_split_resident_into_in_use_pinned_and_free_at_each_read():
    """malloc_arenas rows: two glibc arenas read at two of three snapshots (the middle one was not
    walked, so it is not charted), and pymalloc scanned once."""
    mib = 1 << 20
    ts = [T0 + pd.Timedelta(seconds=10 * i) for i in range(3)]
    walked = {"free_resident_bytes": 30.0 * mib, "pinned_bytes": 20.0 * mib}
    rows = [{"ts": t, "pid": 42, "allocator": "glibc", "rss": 50 * mib, **(walked if i != 1 else
            {"free_resident_bytes": None, "pinned_bytes": None})} for i, t in enumerate(ts) for _ in range(2)]
    rows.append({"ts": ts[2], "pid": 42, "allocator": "pymalloc", "rss": 8 * mib,
                 "free_resident_bytes": 6.0 * mib, "pinned_bytes": 6.0 * mib})
    glibc, py = sections.layout_charts(pd.DataFrame(rows))
    assert glibc.title.startswith("glibc heap pages") and "(2 reads)" in glibc.title
    assert [k.text for k in glibc.keys] == ["resident 100.0 MiB", "other free resident 20.0 MiB", "pinned 40.0 MiB",
                                            "in use 40.0 MiB"]
    assert "pymalloc" in py.title and "(1 reads)" in py.title and "pinned 6.0 MiB" in [k.text for k in py.keys]
    hover = json.loads(re.search(r'<script type="application/json">(.*?)</script>', str(glibc.svg)).group(1))
    assert len(hover["t"]) == 2                                  # the unwalked snapshot is not a read
    assert sections.layout_charts(pd.DataFrame(rows[2:4])) == []  # no complete read


def test_findings_ranked_with_units_and_any_details():
    frames = [{"function": "malloc", "module": "libc.so.6"},
              {"function": "leak_here", "module": "svc", "file": "/src/svc.c", "line": 42.0, "kind": "native"},
              {"function": "main", "module": "svc"},
              {"function": "__libc_start_call_main", "module": "libc.so.6"}]
    findings = [
        Finding("arena_bloat", 42, "svc", 40, 0.7, "arenas hold memory", {
            "resident_bytes": 300 << 20, "live_bytes": 100 << 20, "bloat_bytes": 200 << 20, "arenas": 8,
            "recommendation": ["MALLOC_ARENA_MAX=2 (saves ~150 MiB)", {"action": "malloc_trim", "saving_bytes": 1e8}]}),
        Finding("persistent_growth", 42, "svc", 90, 0.95, "leak in leak_here", {
            "frames": frames, "growth_bytes_per_hour": np.float64(3 << 30), "outstanding_bytes": 5 << 20,
            "outstanding_stderr_bytes": 1 << 20, "time_to_oom_hours": math.nan, "first_seen": T0,
            "classification": "leak"}),
        Finding("gpu_growth", 7, "trainer", 60, 0.5, "device memory creeps", {"odd": {"nested": [1, 2]}}),
    ]
    doc = render_html(synthetic(), findings)
    table = doc[doc.index('<table class="findings">'):]
    assert table.index("leak in leak_here") < table.index("device memory creeps") < table.index("arenas hold")
    for text in ("3.0 GiB/h", "5.0 MiB ± 1.0 MiB", "200.0 MiB", "2026-01-02 03:04:00 UTC",
                 "MALLOC_ARENA_MAX=2", "saving_bytes: 95.4 MiB",
                 "nested 1, 2", "time to OOM</span> –"):       # any detail, in words (no raw dict)
        assert text in table, text
    # the allocator's and the entry frames are trimmed; the full stack is one click away
    assert '<ol class="stack"><li>leak_here (svc)  svc.c:42</li><li>main (svc)</li></ol>' in table
    assert "all 4 frames" in table
    assert 'href="#pid-42"' in table and 'href="#pid-7"' not in doc          # pid 7 has no data to link to


@dataclass
class SwapSpill(Finding):
    """A kind the reports have never heard of."""

    kind: str = field(default="swap_spill", init=False)

    def facts(self) -> list[str]:
        return [f"swapped {self.details['swapped_bytes'] >> 30} GiB"]

    def next_step(self) -> str:
        return "Lower vm.swappiness for its cgroup."


def test_a_new_kind_of_finding_says_itself_in_every_report():
    """A kind is its Finding subclass (next to its detector): the text, HTML and JSON reports lay
    out what a finding returns and know no kinds."""
    f = SwapSpill(42, "svc", 50, 0.9, "memory spills to swap", {"swapped_bytes": 1 << 30, "recommendation": "add RAM"})
    text = render(synthetic(), [f])
    assert "[swap_spill] pid 42 (svc)" in text and "\n   swapped 1 GiB\n" in text
    assert text.endswith("   next: Lower vm.swappiness for its cgroup.") and "stack (" not in text
    doc = render_html(synthetic(), [f])
    assert '<span class="kind">swap_spill</span>' in doc and '<span class="k">swapped</span> 1.0 GiB' in doc
    assert "<b>What to do:</b> add RAM" in doc and '<ol class="stack">' not in doc
    assert to_document([f])["findings"] == [{"kind": "swap_spill", "pid": 42, "comm": "svc", "severity": 50,
                                             "confidence": 0.9, "summary": "memory spills to swap",
                                             "swapped_bytes": 1 << 30, "recommendation": "add RAM"}]


def csp_source(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def assert_strict_csp(doc: str) -> None:
    """The page's Content-Security-Policy allows its own style and script, by their hashes, and
    nothing else: no 'unsafe-inline', and no markup that only 'unsafe-inline' would run."""
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', doc).group(1)
    assert "'unsafe-inline'" not in csp and "unsafe" not in csp and "nonce" not in csp, csp
    style = re.findall(r"<style>(.*?)</style>", doc, re.S)
    script = re.findall(r"<script>(.*?)</script>", doc, re.S)           # the charts' data: type=application/json
    assert len(style) == 1 and len(script) == 1
    assert csp == f"default-src 'none'; style-src {csp_source(style[0])}; script-src {csp_source(script[0])}"
    markup = re.sub(r"<(script|style)\b[^>]*>.*?</\1>", "", doc, flags=re.S)
    assert not re.search(r"<[^>]*\s(style|on[a-z]+)\s*=", markup, re.I)     # style attributes, inline handlers


def test_content_security_policy_has_no_unsafe_inline():
    frames = [{"function": "f", "module": "svc"}] * 8
    findings = [Finding("persistent_growth", 42, "svc", 90, 0.95, "leak", {"frames": frames, "recommendation": ["a"]})]
    bare = pd.DataFrame()
    for ds in (synthetic(), Dataset(Path("/nowhere"), bare, bare, bare, bare, bare, bare, bare)):
        assert_strict_csp(render_html(ds, findings))


def test_axes_have_units_and_round_ticks():
    ticks, unit, scale = byte_ticks(45 * 2**20)
    assert (unit, scale) == ("MiB", 2**20) and [t / scale for t in ticks] == [0, 10, 20, 30, 40, 50]
    assert byte_ticks(3.2 * 2**30)[1] == "GiB" and byte_ticks(0)[1] == "KiB"
    assert time_ticks(100, 103.5) == ([100, 101, 102, 103], "%H:%M:%S")
    ticks, fmt = time_ticks(0, 86400 - 10, 8)
    assert ticks[1] - ticks[0] == 3 * 3600 and fmt == "%H:%M"
    doc = render_html(synthetic(), [])
    assert ">800 KiB</text>" in doc and ">03:05:30</text>" in doc and "time (UTC, 2026-01-02)" in doc


def test_trim_frames_and_format_detail():
    frames = [{"function": "operator new", "module": "libstdc++.so.6"},
              {"function": None, "module": "python3.11", "offset": 0x10},
              {"function": None, "module": "python3.11", "offset": 0x20},
              {"function": "handler", "module": "svc", "file": math.nan, "line": math.nan},   # from pandas
              {"function": "_start", "module": "svc"}]
    shown, hidden = trim_frames(frames)
    assert shown == ["[2 unnamed frames in python3.11]", "handler (svc)"] and hidden == 2
    assert trim_frames(frames[1:2]) == (["python3.11+0x10 (unnamed)"], 0)
    assert trim_frames([{"function": "malloc", "module": "libc.so.6"}]) == (["malloc (libc.so.6)"], 0)
    assert format_detail("time_to_oom_hours", 30.0) == "30.0 h"
    assert format_detail("time_to_oom_hours", 100.0) == "4.2 days"
    assert format_detail("last_seen", "2026-01-02T03:04:05+00:00") == "2026-01-02 03:04:05 UTC"
    assert format_detail("arenas", np.int64(8)) == "8"
    assert format_detail("growth_bytes_per_hour", None) == "–"
    # details read as a person would write them: no raw dicts, no float with 15 digits
    regions = {"heap_rss": 44609536.0, "arena_rss": 0.0}
    assert format_detail("region_growth_bytes", regions) == "heap 42.5 MiB, arena 0 B"
    assert format_detail("z", 6.443287888352623) == "6.44"
    assert format_detail("merged_stack_ids", [5055209497692423654, 12]) == "5055209497692423654, 12"


def test_an_unexplained_growths_regions_read_as_words_in_the_page():
    from analysis.detect.growth import UnexplainedGrowth
    f = UnexplainedGrowth(42, "svc", 50, 0.9, "RSS grew 40 MiB.", {
        "rss_growth_bytes": 44609536.0, "explained_bytes": 7233029.123456789, "unexplained_bytes": 37376506.87,
        "region_growth_bytes": {"heap_rss": 44609536.0, "arena_rss": 0.0, "anon_rss": 1048576.0}})
    page = render_html(synthetic(), [f])
    assert "heap 42.5 MiB, arena 0 B, anon 1.0 MiB" in page
    assert "heap_rss" not in page and "7233029.12" not in page


def test_interpreter_frames_between_python_frames_fold_unless_asked_and_unnamed_ones_say_how_to_name_them():
    py = [{"function": f, "module": "app.py", "file": "/srv/app.py", "line": n, "kind": "python"}
          for f, n in (("handle", 32), ("serve", 80))]
    eval_ = [{"function": "_PyEval_EvalFrameDefault", "module": "libpython3.11.so.1.0", "kind": "native"},
             {"function": None, "module": "python3.11", "offset": 0x1a2b3c, "kind": "native"}]
    inner = [{"function": None, "module": "python3.11", "offset": 0x1000, "kind": "native"}]
    frames = [*inner, py[0], *eval_, py[1]]
    shown, hidden = trim_frames(frames)
    assert shown == ["python3.11+0x1000 (unnamed)", "handle (app.py:32)", "serve (app.py:80)"] and hidden == 2
    shown, hidden = trim_frames(frames, interpreter=True)
    assert shown == ["python3.11+0x1000 (unnamed)", "handle (app.py:32)",
                     "_PyEval_EvalFrameDefault (libpython3.11.so.1.0)", "python3.11+0x1a2b3c (unnamed)",
                     "serve (app.py:80)"] and hidden == 0
    # frames of other modules between Python frames are not the interpreter's: never folded
    ext = {"function": "parse", "module": "myext.so", "kind": "native"}
    assert trim_frames([py[0], ext, py[1]])[0] == ["handle (app.py:32)", "parse (myext.so)", "serve (app.py:80)"]
    hint = naming_hint([frames])
    assert "python3.11" in hint and "(unnamed)" in hint and "DEBUGINFOD_URLS" in hint and "libpython" not in hint
    assert naming_hint([py, [ext, {"function": None, "module": "[anon]", "offset": 1}]]) is None
    # the terminal report folds, says how to name, and shows all with the flag
    finding = Finding("persistent_growth", 42, "svc", 90, 0.95, "leak", {"frames": frames})
    ds = synthetic()
    text = render(ds, [finding])
    assert "_PyEval_EvalFrameDefault" not in text and "handle (app.py:32)" in text and "debug package" in text
    assert "_PyEval_EvalFrameDefault" in render(ds, [finding], interpreter_frames=True)
    doc = render_html(ds, [finding])
    assert "python3.11+0x1000 (unnamed)" in doc and 'class="unnamed"' in doc
    shown_html = doc[doc.index('<ol class="stack">'):doc.index("</ol>")]
    assert "_PyEval_EvalFrameDefault" not in shown_html     # folded there, under "all frames" still
    assert "_PyEval_EvalFrameDefault" in doc


def test_older_recordings_approximate_names_read_as_unnamed(tmp_path):
    """Schema 5 and 6 recordings named code no symbol covers `export+0xOFF`: read as unnamed."""
    from sampler.dataset.schema import FRAMES
    rows = [{"ts": pd.Timestamp("2026-01-02", tz="UTC"), "stack_id": 7, "depth": d, "function": fn,
             "module": "python3.11", "offset": 0x100 + d, "kind": "native"}
            for d, fn in enumerate(["PyObject_IS_GC+0x167f", "PyType_GenericAlloc", "operator+"])]
    part = tmp_path / "frames" / "host=h" / "date=2026-01-02"
    part.mkdir(parents=True)
    table = pa.Table.from_pylist(rows, schema=pa.schema([FRAMES.schema.field(c) for c in rows[0]]))
    pq.write_table(table, part / "0.parquet")
    assert read_stack_frames(tmp_path)[7][0]["function"] is None
    assert [f["function"] for f in read_stack_frames(tmp_path)[7][1:]] == ["PyType_GenericAlloc", "operator+"]
    # a finding's frames carry the offset: the report writes where the unnamed code is
    bare = pd.DataFrame()
    found = frames_json(Dataset(tmp_path, bare, bare, bare, read_frames(tmp_path)), 7)
    assert (found[0]["function"], found[0]["offset"]) == (None, 0x100)
    assert trim_frames(found[:1]) == (["python3.11+0x100 (unnamed)"], 0)


# --- a real recording in a real browser ---------------------------------------------------------

def png_pixels(data: bytes) -> tuple[int, int, np.ndarray]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes): (width, height, pixels)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + n
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    stride = w * bpp
    raw = zlib.decompress(b"".join(idat))
    prev, rows = bytearray(stride), []
    for y in range(h):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride) if kind else ():                  # undo the row filter
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + ((a + b) >> 1)) & 255
            else:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, np.frombuffer(b"".join(rows), np.uint8).reshape(h, w, bpp)[:, :, :3]


# clicks a frame of the first flame graph and hovers the first chart, then reports what it saw
PROBE = """
const gs = [...document.querySelectorAll("svg.flame")[0].querySelectorAll("g.fr")];
const g = gs.find(e => e.dataset.l === "leak_malloc");
g.querySelector("rect").dispatchEvent(new MouseEvent("click", {bubbles: true}));
const svg = document.querySelector(".chartbox svg"), b = svg.getBoundingClientRect();
svg.dispatchEvent(new MouseEvent("mousemove", {clientX: b.left + b.width / 2, clientY: b.top + 40}));
document.body.dataset.probe = JSON.stringify({width: +g.querySelector("rect").getAttribute("width"),
  tip: document.getElementById("tip").textContent, h1: getComputedStyle(document.querySelector("h1")).fontSize});
"""
# what an injected script would do; the page's CSP must refuse it
INJECTED = 'document.body.dataset.injected = "ran";'


def with_script(doc: str, js: str, *, allowed: bool) -> str:
    """`doc` with `js` run at the end of its body; `allowed`: its hash joins the CSP's script-src
    (as a test's own probe), else it stands for a script that slipped in."""
    if allowed:
        doc = doc.replace("script-src ", f"script-src {csp_source(js)} ", 1)
    return doc.replace("</body>", f"<script>{js}</script></body>")


@pytest.mark.bpf
def test_real_recording_report_renders_in_chromium(workload, record, tmp_path):
    w = workload()
    rec = record("--pid", str(w.pid), "-i", "0.5")
    rec.wait_attached()
    w.call("leak_malloc", 4096, 4096, thread=True)               # an arena for the arena chart
    for _ in range(6):
        w.call("leak_malloc", 2048, 4096)
        w.call("leak_mmap", 2, 1 << 20)
        time.sleep(0.4)
    rec.wait_snapshot(time.time() + 0.5)
    code, _, err = rec.stop()
    assert code == 0, err
    ds = load(rec.out)
    leak = ds.frames[ds.frames["function"] == "leak_malloc"]["stack_id"].iloc[0]
    frames = [{k: f[k] for k in ("function", "module", "file", "line", "kind")}
              for f in ds.frames_of(leak).to_dict("records")]
    finding = Finding("persistent_growth", w.pid, "python", 90, 0.99, "leak_malloc leaks about 8 MiB per call",
                      {"source": "malloc", "frames": frames, "growth_bytes_per_hour": 20e9,
                       "outstanding_bytes": 64e6, "outstanding_stderr_bytes": 3e6, "classification": "leak"})
    doc = render_html(ds, [finding])
    assert_strict_csp(doc)
    page = tmp_path / "report.html"
    page.write_text(doc)

    # self-contained: no resource of any kind is referenced, only in-page anchors
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//|url\(\s*["']?\s*(https?:)?//|@import""", doc, re.I)
    assert not re.search(r"""\ssrc\s*=""", doc, re.I)
    assert all(h.startswith("#") for h in re.findall(r"""href\s*=\s*["']([^"']*)""", doc))

    shot = tmp_path / "report.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2400", page.as_uri())
    width, height, px = png_pixels(shot.read_bytes())
    assert (width, height) == (1280, 2400)
    ink = (px.min(axis=2) < 235).mean()
    colored = (px.max(axis=2).astype(int) - px.min(axis=2) > 60).sum()
    assert ink > 0.03 and colored > 50_000, (ink, colored)         # text, lines, areas and flame frames

    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).stdout
    assert '<html lang="en" class="js">' in dom                    # the page's script ran
    # top stacks, memory by kind, arenas, and the pages of each allocator whose layout was read
    assert "glibc heap pages: in use vs pinned" in dom
    assert dom.count('<svg class="chart"') == 3 + dom.count(": in use vs pinned (")
    assert len(flame_frames(dom)) >= 3                              # malloc and mmap at the end, growth
    assert 'data-l="leak_malloc"' in dom and "leak_malloc (libleaky.so)" in dom
    for text in ("glibc arenas", "estimated live", "18.6 GiB/h", "61.0 MiB ± 2.9 MiB"):
        assert text in dom, text

    probe = tmp_path / "probe.html"
    probe.write_text(with_script(with_script(doc, INJECTED, allowed=False), PROBE, allowed=True))
    dom = chromium(tmp_path, "--dump-dom", probe.as_uri()).stdout
    assert "data-injected" not in dom                               # the CSP refused the unlisted script
    seen = json.loads(re.search(r'data-probe="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    assert seen["width"] == pytest.approx(1159.5, abs=1)            # zoomed to the full width
    assert "UTC" in seen["tip"] and "leak_malloc" in seen["tip"]
    assert seen["h1"] == "22px"                                     # the page's style applies under its CSP
