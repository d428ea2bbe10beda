"""Stacks as lists of frames, and frames as text: shared by the detectors, reports, exports and diff.

A frame is a dict of `frames` table columns (function, module, file, line, kind, ...), a stack a
list of them innermost first. Missing values are None in `stack_frames()` and `frames_json()`,
but frames built elsewhere may carry NaN (pandas), so the text helpers accept both.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.dataset import Dataset, read_frames
from sampler.text import UNNAMED, unnamed_frame

Frame = dict[str, Any]
Stacks = dict[int, list[Frame]]       # stack_id -> frames innermost first

# the `frames` columns a stack's frames carry, where the table has them
FRAME_COLUMNS = ("function", "module", "path", "offset", "build_id", "file", "line", "kind")
SHOWN_FRAMES = 6
# frames that say nothing about who allocated: the allocator's own and the program's entry
ALLOCATOR_MODULES = re.compile(r"^(libc\.so|libc-|libstdc\+\+|libjemalloc|libtcmalloc|libmimalloc|ld-linux)")
ENTRY_FUNCTIONS = {"_start", "__libc_start_main", "__libc_start_call_main", "__libc_start_main_impl",
                   "start_thread", "clone", "clone3", "__clone3"}
# CPython itself: libpython, or an executable that links it statically
INTERPRETER_MODULES = re.compile(r"^(libpython\d|python\d)")
# Python's thread bootstrap (threading.py): like ENTRY_FUNCTIONS, where a thread starts, not why
THREAD_BOOTSTRAP = {"run", "_bootstrap_inner", "_bootstrap"}
# Python code of the interpreter and of installed packages: the user's own frame is the
# innermost one outside these (torch's `relu` is where, `train_step` is why).
_LIBRARY_CODE = re.compile(r"/lib/python3[^/]*/|/(site|dist)-packages/|^<frozen ")


# --- reading -------------------------------------------------------------------------------------

def stack_frames(frames: pd.DataFrame) -> Stacks:
    """stack_id -> its frames innermost first, as dicts of the FRAME_COLUMNS the table has
    (nulls as None); a (stack_id, depth) written twice counts once."""
    if frames.empty or not {"stack_id", "depth"} <= set(frames.columns):
        return {}
    cols = [c for c in FRAME_COLUMNS if c in frames]
    f = frames.drop_duplicates(["stack_id", "depth"]).sort_values(["stack_id", "depth"])[["stack_id", *cols]]
    f = f.astype(object).where(f.notna(), None)
    out: Stacks = {}
    for row in f.to_dict("records"):
        out.setdefault(int(row.pop("stack_id")), []).append(row)
    return out


def read_stack_frames(root: str | Path) -> Stacks:
    """`stack_frames()` of a dataset directory's `frames` table."""
    return stack_frames(read_frames(root))


def frames_json(ds: Dataset, stack_id: int) -> list[Frame]:
    """A stack's frames in the shape of a finding's `frames` detail (JSON-ready)."""
    # offset: where an unnamed native frame is (reports write it `module+0xOFF (unnamed)`)
    return [{"function": r.get("function"), "module": r.get("module"), "file": r.get("file"),
             "line": None if r.get("line") is None else int(r["line"]), "kind": r.get("kind"),
             "offset": None if r.get("kind") == "python" or r.get("offset") is None else int(r["offset"])}
            for r in ds.frame_records(stack_id)]


# --- as text -------------------------------------------------------------------------------------

def site(frames: list[Frame]) -> str:
    """The innermost named frame, and the innermost Python frame above it (the line a Python
    user recognises), e.g. `alloc_cpu (libc10.so) from train_step (train.py:41)`."""
    # past the allocator's own frames (a page fault in malloc's header write, glibc's mmap of a
    # large chunk): its caller is the site
    lo = 0
    while lo < len(frames) - 1 and ALLOCATOR_MODULES.match(str(frames[lo].get("module") or "")):
        lo += 1
    named = next((f for f in frames[lo:] if f["function"]), None) or next((f for f in frames if f["function"]), None)
    if named is None:
        return f"an unsymbolized stack in {frames[0]['module']}" if frames else "an unknown stack"
    where = _where(named)
    py = [f for f in frames if f.get("kind") == "python"]
    mine = next((f for f in py if not _LIBRARY_CODE.search(str(f.get("file") or ""))), py[0] if py else None)
    return where if mine is None or mine is named else f"{where} from {_where(mine)}"


def _where(f: Frame) -> str:
    if f.get("kind") == "python" and f.get("line"):
        return f"{f['function']} ({f['module']}:{f['line']})"
    return f"{f['function']} ({f['module']})"


def frame_text(f: Frame) -> str:
    """One frame on one line: `function (module)`, `function (module:line)` for Python,
    `module+0xOFF (unnamed)` where no symbol names it."""
    name = _text(f.get("function"))
    if f.get("kind") == "python" and _finite(f.get("line")):
        return f"{name or '?'} ({f.get('module') or '?'}:{int(f['line'])})"
    if name is None and f.get("kind") != "python":
        return unnamed_frame(f.get("module"), int(f["offset"]) if _finite(f.get("offset")) else None)
    return f"{name or '?'} ({f.get('module') or '?'})"


def trim_frames(frames: list[Frame], keep: int = SHOWN_FRAMES, interpreter: bool = False) -> tuple[list[str], int]:
    """The interesting frames of a stack (innermost first) as text, and how many were left out:
    allocator-internal frames at the top and entry frames at the bottom are dropped, the
    interpreter's own frames between two Python frames are folded (as py-spy shows a stack;
    `interpreter` keeps them), runs of unnamed frames of one module become one line."""
    def fn(f: Frame) -> str | None:
        return _text(f.get("function"))

    lo, hi = 0, len(frames)
    while hi - lo > 1 and ALLOCATOR_MODULES.match(str(frames[lo].get("module") or "")):
        lo += 1
    while hi - lo > 1 and fn(frames[hi - 1]) in ENTRY_FUNCTIONS:
        hi -= 1
    folded = set() if interpreter else interpreter_between_python(frames)
    lines: list[str] = []
    run_module, run = None, 0
    for i in range(lo, hi):
        f = frames[i]
        if i in folded:
            continue
        module = str(f.get("module") or "?")
        if fn(f) is None and f.get("kind") != "python":
            if run and module == run_module:
                run += 1
                lines[-1] = f"[{run} unnamed frames in {module}]"
            else:
                run_module, run = module, 1
                lines.append(frame_text(f))
            continue
        run = 0
        text = frame_text(f)
        if f.get("kind") != "python" and _text(f.get("file")):
            line = f.get("line")
            text += f"  {Path(f['file']).name}" + (f":{int(line)}" if _finite(line) else "")
        lines.append(text)
    dropped = len(frames) - (hi - lo) + sum(lo <= i < hi for i in folded)
    return lines[:keep], max(0, len(lines) - keep) + dropped


def interpreter_between_python(frames: list[Frame]) -> set[int]:
    """Positions of the interpreter's native frames (INTERPRETER_MODULES) that lie between two
    Python frames: how CPython ran the outer one's call, not who allocated."""
    py = [i for i, f in enumerate(frames) if f.get("kind") == "python"]
    if len(py) < 2:
        return set()
    return {i for i in range(py[0] + 1, py[-1]) if frames[i].get("kind") != "python"
            and INTERPRETER_MODULES.match(str(frames[i].get("module") or ""))}


def naming_hint(stacks: list[list[Frame]]) -> str | None:
    """What to do about unnamed frames in `stacks` (None when every native frame has a name)."""
    modules = sorted({str(f.get("module")) for frames in stacks for f in frames
                      if f.get("kind") != "python" and _text(f.get("function")) is None
                      and _text(f.get("module")) and not str(f["module"]).startswith("[")})
    if not modules:
        return None
    shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    return (f"Frames marked {UNNAMED} are code of {shown} that no symbol covers (a stripped file: its "
            "static functions have no name in it), shown as file+offset rather than guessed from the "
            "exports around them. The files' debug symbols name them and give their lines: install the "
            "debug package (e.g. python3.11-dbg, libc6-dbg, or a -dbgsym package; they land in "
            "/usr/lib/debug/.build-id) or set DEBUGINFOD_URLS for the recorder, then record again "
            "(names are read while recording, by build-id).")


def _text(v: Any) -> str | None:
    """A non-empty string, else None (frames from DataFrames carry NaN for nulls)."""
    return v if isinstance(v, str) and v else None


def _hex(v: Any) -> str:
    return f"{int(v):#x}" if _finite(v) else "?"


def _finite(v: Any) -> bool:
    return isinstance(v, int | float | np.integer | np.floating) and math.isfinite(v)


def cause_representatives(frames: pd.DataFrame) -> dict[int, int]:
    """stack_id -> the stack that stands for it, for stacks that differ only in their thread start
    (the frames from the first entry function, the thread's start routine or Python's thread
    bootstrap outwards) or in the allocator's own frames at the top: one cause, one series. Native
    frames compare by module, function and offset, Python frames by file, function and line; Python
    code that allocates through the interpreter alone compares by its Python frames. Stacks that
    stand for themselves are left out."""
    if frames.empty:
        return {}
    f = frames.drop_duplicates(["stack_id", "depth"]).sort_values(["stack_id", "depth"])
    fn, kind = f["function"].astype(object), f["kind"].astype(str)
    python = (kind == "python").to_numpy()
    entry = fn.isin(ENTRY_FUNCTIONS).to_numpy() | (
        python & (f["module"].astype(str) == "threading.py").to_numpy() & fn.isin(THREAD_BOOTSTRAP).to_numpy())
    # the thread's start routine, the frame just inside start_thread, is where it started too
    entry |= np.append((fn.to_numpy()[1:] == "start_thread") & (f["stack_id"].to_numpy()[1:]
                                                                == f["stack_id"].to_numpy()[:-1]), False)
    cut = f["stack_id"].map(f.loc[entry].groupby("stack_id")["depth"].min()).fillna(np.iinfo(np.int32).max)
    # Python code that allocates through the interpreter alone (every native frame inside its
    # innermost Python frame is the interpreter's): the Python frames are the cause, whichever object
    # type happened to need the block (a pymalloc arena serves every type)
    sid = f["stack_id"].to_numpy()
    first_py = f["stack_id"].map(f.loc[python].groupby("stack_id")["depth"].min())
    foreign = (~python & ~f["module"].astype(object).fillna("").astype(str).str.match(INTERPRETER_MODULES).to_numpy()
               & (f["depth"] < first_py).to_numpy())
    by_python = ~np.isin(sid, sid[foreign]) & first_py.notna().to_numpy()
    keep = (f["depth"] < cut).to_numpy() & (~by_python | python)
    # the allocator's own frames at the top (a page first touched in malloc or in _int_malloc, for
    # the same caller) are where inside it, not who allocated: left out, but for a stack of nothing else
    mod = f["module"].astype(object).fillna("").astype(str).str.match(ALLOCATOR_MODULES).to_numpy() & ~python
    depth = f["depth"].to_numpy(np.int64)
    none = np.iinfo(np.int64).max
    other = pd.Series(np.where(mod, none, depth), index=f.index).groupby(sid).transform("min").to_numpy()
    keep &= ~(mod & (depth < other) & (other < none))
    inner = f[keep]
    py = (inner["kind"].astype(str) == "python").to_numpy()
    def txt(col: str) -> pd.Series:
        return inner[col].astype(object).fillna("").astype(str) if col in inner else pd.Series("", inner.index)

    label = np.where(py, txt("file") + ":" + txt("function") + ":" + txt("line"),
                     txt("module") + ":" + txt("function") + "+" + txt("offset"))
    keys = pd.Series(label, index=inner.index).groupby(inner["stack_id"].to_numpy()).agg("<".join)
    # stacks cut nowhere keep their full key, so they merge only with an identical inner part
    rep = pd.Series(keys.index, index=keys.index).groupby(keys.to_numpy()).transform("min")
    return {int(a): int(b) for a, b in rep.items() if a != b}


def site_key(frames: list[Frame]) -> tuple:
    """What a stack says about who allocated, at the level of functions: the allocator's own
    frames at the top and the thread start at the bottom dropped, native frames as (module,
    function), unsymbolized ones by offset, Python frames with their line. The same code seen
    through two sources (the malloc call and the page faults of its memset) has one key."""
    lo, hi = 0, len(frames)
    while lo < hi - 1 and ALLOCATOR_MODULES.match(str(frames[lo].get("module") or "")):
        lo += 1
    for i in range(lo, hi):
        f = frames[i]
        fn = _text(f.get("function"))
        if fn in ENTRY_FUNCTIONS or (f.get("kind") == "python" and f.get("module") == "threading.py"
                                     and fn in THREAD_BOOTSTRAP):
            hi = i - 1 if fn == "start_thread" and i - 1 > lo else i     # and the thread's start routine
            break
    return tuple((f.get("module"), _text(f.get("function")) or _hex(f.get("offset")),
                  f.get("line") if f.get("kind") == "python" else None) for f in frames[lo:hi])
