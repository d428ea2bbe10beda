"""Names for code of stripped libraries: nearest exported symbol, .gnu_debuglink, debuginfod.

Libraries are compiled here, stripped and given debug files with binutils; debuginfod servers are real
HTTP servers on 127.0.0.1 in a thread.
"""

from __future__ import annotations

import ctypes
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT

from sampler.binary import debuginfod, elf
from sampler.binary.elf import ElfImage
from sampler.stacks.symbolize import Symbolizer, demangle, function_name

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"

# Definition order kept (-fno-toplevel-reorder): the static function lies between the two exports.
DEMO_SRC = r"""
const char *variant = VARIANT; /* distinct builds get distinct build-ids */
static int hidden_work(int x);
int first_export(int x) { return x + 1; }
static __attribute__((noinline)) int hidden_work(int x) { __asm__ volatile(""); return x * 5 + 3; }
int second_export(int x) { return hidden_work(x) + 2; }
"""


@dataclass(frozen=True)
class Demo:
    full: Path  # unstripped: what nm reads the static function's address from (never opened as an image)
    debug: Path  # objcopy --only-keep-debug
    stripped: Path  # strip --strip-all: .dynsym only
    build_id: str

    def address(self, name: str) -> int:
        out = subprocess.run(["nm", "--defined-only", str(self.full)], check=True, capture_output=True, text=True)
        return next(int(line.split()[0], 16) for line in out.stdout.splitlines() if line.endswith(f" {name}"))


def build_demo(tmp: Path, variant: str, debuglink: Path | None = None) -> Demo:
    """libdemo.so in tmp/<variant>/ (a distinct build-id per variant); `debuglink`: the debug file
    its stripped copy names in .gnu_debuglink (default: its own)."""
    d = tmp / variant
    d.mkdir(parents=True)
    src, full = d / "demo.c", d / "full.so"
    src.write_text(DEMO_SRC)
    subprocess.run(["gcc", "-O2", "-g", "-fPIC", "-shared", "-fno-toplevel-reorder", "-fno-reorder-functions",
                    f'-DVARIANT="{variant}"', "-Wl,--build-id=sha1", "-o", str(full), str(src)], check=True)
    debug, stripped = d / "libdemo.debug", d / "libdemo.so"
    subprocess.run(["objcopy", "--only-keep-debug", str(full), str(debug)], check=True)
    shutil.copy(full, stripped)
    subprocess.run(["strip", "--strip-all", str(stripped)], check=True)
    link = debuglink or debug
    subprocess.run(["objcopy", f"--add-gnu-debuglink={link.name}", str(stripped)], check=True, cwd=link.parent)
    debug.rename(d / "kept.debug")  # found only where a test puts it
    readelf = subprocess.run(["readelf", "-n", str(stripped)], check=True, capture_output=True, text=True).stdout
    return Demo(full, d / "kept.debug", stripped, re.search(r"Build ID: ([0-9a-f]+)", readelf).group(1))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private cache root for this test, debuginfod off unless the test sets it."""
    root = tmp_path / "cache"
    monkeypatch.setenv("ALLOCSAMPLER_CACHE_DIR", str(root))
    monkeypatch.delenv(debuginfod.URLS_ENV, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    return root


def test_static_function_named_after_nearest_export(tmp_path, cache):
    demo = build_demo(tmp_path, "nearest")
    first, hidden, second = (demo.address(n) for n in ("first_export", "hidden_work", "second_export"))
    assert first < hidden < second
    img = ElfImage.open(str(demo.stripped))
    assert not img.has_symtab and img.debug_path is None
    assert img.lookup(hidden + 3) is None
    assert img.nearest_export(hidden + 3) == ("first_export", hidden + 3 - first)
    assert function_name(img, hidden + 3) == f"first_export+{hidden + 3 - first:#x}"
    assert function_name(img, second + 1) == "second_export"  # covered: the exact name

    sections = {s.name: s for s in elf.ElfReader.open(str(demo.stripped)).sections}
    text, fini = sections[".text"], sections[".fini"]
    assert function_name(img, text.addr) is None  # before the first export
    assert function_name(img, first - 1) is None
    # past .text: neither the bytes after it nor .fini are named after an export of .text
    assert function_name(img, text.addr + text.size) is None
    assert function_name(img, fini.addr + 1) is None


def test_symbolizer_names_static_function_of_loaded_library(tmp_path, cache):
    demo = build_demo(tmp_path, "loaded")
    lib = ctypes.CDLL(str(demo.stripped))
    assert lib.second_export(1) == 10
    base = ctypes.cast(lib.first_export, ctypes.c_void_p).value - demo.address("first_export")
    hidden, first = demo.address("hidden_work"), demo.address("first_export")
    (ip,) = Symbolizer().frames(os.getpid(), [base + hidden + 2], first_is_ip=True)
    (ret,) = Symbolizer().frames(os.getpid(), [base + hidden + 1], first_is_ip=False)
    assert (ip.function, ip.module, ip.offset) == (f"first_export+{hidden + 2 - first:#x}", "libdemo.so", hidden + 2)
    assert ret.function == f"first_export+{hidden - first:#x}"  # return addresses: the call's byte


@pytest.mark.parametrize("where", ["beside", ".debug", "debug root"])
def test_debuglink_gives_static_names(tmp_path, cache, monkeypatch, where):
    demo = build_demo(tmp_path, f"link-{where.replace(' ', '-')}")
    lib_dir = demo.stripped.parent
    monkeypatch.setattr(elf, "DEBUG_ROOTS", (str(tmp_path / "debug"),))
    place = {"beside": lib_dir, ".debug": lib_dir / ".debug",
             "debug root": tmp_path / "debug" / str(lib_dir).lstrip("/")}[where]
    place.mkdir(parents=True, exist_ok=True)
    shutil.copy(demo.debug, place / "libdemo.debug")

    img = ElfImage.open(str(demo.stripped))
    hidden = demo.address("hidden_work")
    assert img.debug_path == str(place / "libdemo.debug")
    assert img.lookup(hidden + 3) == ("hidden_work", 3)
    assert function_name(img, hidden + 3) == "hidden_work"


def test_debuglink_through_a_process_mapping(tmp_path, cache):
    demo = build_demo(tmp_path, "link-mapped")
    shutil.copy(demo.debug, demo.stripped.parent / "libdemo.debug")
    lib = ctypes.CDLL(str(demo.stripped))
    base = ctypes.cast(lib.first_export, ctypes.c_void_p).value - demo.address("first_export")
    # the symbolizer opens /proc/PID/map_files/...: the debug file is looked for beside the path mapped
    (frame,) = Symbolizer().frames(os.getpid(), [base + demo.address("hidden_work")], first_is_ip=True)
    assert frame.function == "hidden_work"
    assert frame.file and frame.file.endswith("demo.c") and frame.line  # DWARF of the debug file


def test_debuglink_to_other_contents_is_ignored(tmp_path, cache):
    demo = build_demo(tmp_path, "bad-crc")
    with (demo.debug).open("ab") as f:
        f.write(b"\0")  # still an ELF file with the right build-id, not the file the CRC was taken of
    shutil.copy(demo.debug, demo.stripped.parent / "libdemo.debug")
    img = ElfImage.open(str(demo.stripped))
    hidden, first = demo.address("hidden_work"), demo.address("first_export")
    assert img.debug_path is None and img.lookup(hidden) is None
    assert function_name(img, hidden) == f"first_export+{hidden - first:#x}"


def test_debuglink_to_another_build_is_ignored(tmp_path, cache):
    # The link names (with its right CRC) the debug file of another build: the build-ids differ.
    other = build_demo(tmp_path, "other")
    demo = build_demo(tmp_path, "mismatch", debuglink=other.debug)
    shutil.copy(other.debug, demo.stripped.parent / other.debug.name)
    img = ElfImage.open(str(demo.stripped))
    assert img.debug_path is None and img.lookup(demo.address("hidden_work")) is None


def test_debuglink_names_a_link_or_a_fifo(tmp_path, cache):
    demo = build_demo(tmp_path, "fifo")
    lib_dir = demo.stripped.parent
    (lib_dir / ".debug").mkdir()
    os.mkfifo(lib_dir / "libdemo.debug")  # never waited on
    (lib_dir / ".debug" / "libdemo.debug").symlink_to(demo.debug)  # a link: not followed
    start = time.monotonic()
    img = ElfImage.open(str(demo.stripped))
    assert time.monotonic() - start < 2
    assert img.debug_path is None


class DebuginfodServer:
    """A debuginfod server on 127.0.0.1: /buildid/<id>/debuginfo from `files`, 404 otherwise."""

    def __init__(self, files: dict[str, Path]):
        self.requests: Counter[str] = Counter()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                owner.requests[self.path] += 1
                m = re.fullmatch(r"/buildid/([0-9a-f]+)/debuginfo", self.path)
                path = files.get(m.group(1)) if m else None
                if path is None:
                    self.send_error(404)
                    return
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def serve() -> Iterator:
    servers: list[DebuginfodServer] = []

    def start(files: dict[str, Path]) -> DebuginfodServer:
        servers.append(DebuginfodServer(files))
        return servers[-1]

    yield start
    for s in servers:
        if s.thread.is_alive():
            s.stop()


def lookup_in_fresh_interpreter(lib: Path, vaddr: int) -> str:
    """function_name in a new process (empty in-memory caches): what a restarted recorder sees."""
    code = ("import sys; from sampler.binary.elf import ElfImage; from sampler.stacks.symbolize import function_name;"
            "print(function_name(ElfImage.open(sys.argv[1]), int(sys.argv[2])))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, str(lib), str(vaddr)], check=True, capture_output=True,
                         text=True, env=env, timeout=60)
    return out.stdout.strip()


def test_debuginfod_fetches_verifies_and_caches(tmp_path, cache, monkeypatch, serve):
    demo = build_demo(tmp_path, "debuginfod")
    server = serve({demo.build_id: demo.debug})
    monkeypatch.setenv(debuginfod.URLS_ENV, f"{server.url}/")
    hidden = demo.address("hidden_work")

    img = ElfImage.open(str(demo.stripped))
    cached = cache / "debuginfod" / f"{demo.build_id}.debug"
    assert img.debug_path == str(cached)
    assert cached.read_bytes() == demo.debug.read_bytes()
    assert oct(cached.stat().st_mode & 0o777) == "0o600"
    assert function_name(img, hidden + 1) == "hidden_work"
    assert server.requests == {f"/buildid/{demo.build_id}/debuginfo": 1}

    server.stop()  # from the cache now, in this process and after a restart
    assert debuginfod.debug_file(demo.build_id).build_id() == demo.build_id
    assert lookup_in_fresh_interpreter(demo.stripped, hidden + 1) == "hidden_work"


def test_debuginfod_miss_is_remembered(tmp_path, cache, monkeypatch, serve):
    demo = build_demo(tmp_path, "debuginfod-miss")
    server = serve({})
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    hidden, first = demo.address("hidden_work"), demo.address("first_export")
    approx = f"first_export+{hidden - first:#x}"

    assert function_name(ElfImage.open(str(demo.stripped)), hidden) == approx
    assert (cache / "debuginfod" / f"{demo.build_id}.miss").exists()
    assert lookup_in_fresh_interpreter(demo.stripped, hidden) == approx
    assert server.requests == {f"/buildid/{demo.build_id}/debuginfo": 1}  # the restart did not ask


def test_debuginfod_file_of_another_build_is_not_used(tmp_path, cache, monkeypatch, serve):
    other, demo = build_demo(tmp_path, "served-other"), build_demo(tmp_path, "served-wrong")
    server = serve({demo.build_id: other.debug})
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    img = ElfImage.open(str(demo.stripped))
    assert img.debug_path is None and img.lookup(demo.address("hidden_work")) is None
    assert not (cache / "debuginfod" / f"{demo.build_id}.debug").exists()


def test_debuginfod_hanging_server_costs_one_timeout(tmp_path, cache, monkeypatch):
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept_and_hold():
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept_and_hold, daemon=True).start()
    monkeypatch.setenv(debuginfod.URLS_ENV, f"http://127.0.0.1:{listener.getsockname()[1]}")
    demo, again = build_demo(tmp_path, "hang"), build_demo(tmp_path, "hang-again")
    try:
        start = time.monotonic()
        img = ElfImage.open(str(demo.stripped))
        took = time.monotonic() - start
        hidden, first = demo.address("hidden_work"), demo.address("first_export")
        assert debuginfod.TIMEOUT_S - 0.2 < took < debuginfod.TIMEOUT_S + 1.5
        assert img.debug_path is None
        assert function_name(img, hidden) == f"first_export+{hidden - first:#x}"
        # the server is backed off: the next library does not wait for it
        start = time.monotonic()
        assert ElfImage.open(str(again.stripped)).debug_path is None
        assert time.monotonic() - start < 0.5
        assert len(held) == 1
    finally:
        listener.close()
        for s in held:
            s.close()


def test_debuginfod_off_without_urls(tmp_path, cache, serve):
    demo = build_demo(tmp_path, "debuginfod-off")
    server = serve({demo.build_id: demo.debug})  # running, but not named in the environment
    assert ElfImage.open(str(demo.stripped)).debug_path is None
    assert not server.requests and not (cache / "debuginfod").exists()


def exported_functions(path: str) -> dict[int, tuple[int, list[str]]]:
    """start -> (size, names) of the defined functions of `path`'s .dynsym, as nm reads them."""
    out = subprocess.run(["nm", "-DS", "--defined-only", path], check=True, capture_output=True, text=True).stdout
    funcs: dict[int, tuple[int, list[str]]] = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[2] in "TWi":
            size, names = funcs.setdefault(int(fields[0], 16), (int(fields[1], 16), []))
            names.append(demangle(fields[3].split("@")[0]))
    return funcs


def test_debian_libjemalloc():
    if not os.path.exists(JEMALLOC):
        pytest.skip(f"{JEMALLOC} not installed (apt-get install libjemalloc2)")
    img = ElfImage.open(JEMALLOC)
    if img.has_symtab:
        pytest.skip("libjemalloc's debug symbols are installed: every address has its exact name")
    text = next(s for s in elf.ElfReader.open(JEMALLOC).sections if s.name == ".text")
    text_end = text.addr + text.size
    funcs = exported_functions(JEMALLOC)
    starts = sorted(a for a in funcs if text.addr <= a < text_end)
    # static code between two exports, and after the last one (the bulk of jemalloc's internals)
    gaps = [a + funcs[a][0] for a in starts if a + funcs[a][0] not in funcs and funcs[a][0]]
    assert len(gaps) > 5, "no static code between jemalloc's exports"
    for vaddr in (gaps[0], gaps[len(gaps) // 2] + 1, (starts[-1] + text_end) // 2, text_end - 1):
        before = max(a for a in starts if a <= vaddr)
        assert img.lookup(vaddr) is None
        name, off = function_name(img, vaddr).rsplit("+", 1)
        assert name in funcs[before][1] and off == hex(vaddr - before)
    assert function_name(img, text.addr) is None  # before the first export
    assert function_name(img, text_end) is None  # .fini: no export there
