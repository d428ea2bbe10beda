"""Names for code of stripped libraries: nearest exported symbol, .gnu_debuglink, debuginfod.

Libraries are compiled here, stripped and given debug files with binutils; debuginfod servers are real
HTTP servers on 127.0.0.1 in a thread; downloads run on debuginfod's own thread (debuginfod.wait_idle).
"""

from __future__ import annotations

import ctypes
import hashlib
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
from sampler.binary.reader import ElfReader
from sampler.stacks.name_worker import NameWorker
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
    debuginfod.reset()  # no limit spent, id remembered or server backed off by another test
    return root


def test_static_function_of_a_stripped_library_is_unnamed(tmp_path, cache):
    """No symbol covers it: no name (the nearest export before it is another function)."""
    demo = build_demo(tmp_path, "nearest")
    first, hidden, second = (demo.address(n) for n in ("first_export", "hidden_work", "second_export"))
    assert first < hidden < second
    img = ElfImage.open(str(demo.stripped))
    assert not img.has_symtab and img.debug_path is None
    assert img.lookup(hidden + 3) is None and function_name(img, hidden + 3) is None
    assert function_name(img, second + 1) == "second_export"  # covered: the exact name
    assert function_name(img, first) == "first_export"
    sections = {s.name: s for s in elf.ElfReader.open(str(demo.stripped)).sections}
    assert function_name(img, sections[".text"].addr) is None
    assert function_name(img, sections[".fini"].addr + 1) is None


def test_libc_static_function_is_unnamed_without_its_debug_file(monkeypatch):
    """The same address of the real libc: named with libc6-dbg's file, unnamed without it."""
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    ElfImage.forget()
    with_debug = ElfImage.open(libc)
    assert with_debug.debug_path, f"no debug file for {libc}: scripts/setup.sh installs libc6-dbg"
    alloc_dir = with_debug.symbol("__alloc_dir")
    assert function_name(with_debug, alloc_dir.value + 8) == "__alloc_dir"
    monkeypatch.setattr(elf, "DEBUG_ROOTS", ())
    ElfImage.forget()
    try:
        bare = ElfImage.open(libc)
        assert bare.debug_path is None and not bare.has_symtab
        assert function_name(bare, alloc_dir.value + 8) is None
        assert function_name(bare, bare.symbol("opendir").value + 4) == "opendir"
    finally:
        ElfImage.forget()


# An exported function of hand-written assembly has no .size: in .dynsym it ends nowhere, and
# the static function after it must not take its name.
BARE_SRC = r"""
const char *variant = "bare";
__asm__(".text\n.globl bare_export\n.type bare_export,@function\nbare_export:\n\tret\n");
static __attribute__((noinline)) int after_bare(int x) { __asm__ volatile(""); return x * 7 + 1; }
int user_export(int x) { return after_bare(x) + 2; }
"""


def test_an_export_without_a_size_names_only_its_first_byte_in_a_stripped_library(tmp_path, cache):
    src, full, stripped = tmp_path / "bare.c", tmp_path / "full.so", tmp_path / "libbare.so"
    src.write_text(BARE_SRC)
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-fno-toplevel-reorder", "-o", str(full), str(src)], check=True)
    shutil.copy(full, stripped)
    subprocess.run(["strip", "--strip-all", str(stripped)], check=True)
    syms = subprocess.run(["nm", "--defined-only", str(full)], check=True, capture_output=True, text=True).stdout
    addr = {line.split()[-1]: int(line.split()[0], 16) for line in syms.splitlines()}
    bare, after = addr["bare_export"], addr["after_bare"]
    assert bare < after < addr["user_export"]
    img = ElfImage.open(str(stripped))
    assert function_name(img, bare) == "bare_export"
    assert function_name(img, bare + 1) is None and function_name(img, after + 2) is None
    assert function_name(img, addr["user_export"] + 1) == "user_export"
    whole = ElfImage.open(str(full))         # its .symtab lists the static function: the real names
    assert function_name(whole, after + 2) == "after_bare" and function_name(whole, bare) == "bare_export"


def test_symbolizer_leaves_a_static_function_of_a_loaded_library_unnamed(tmp_path, cache):
    demo = build_demo(tmp_path, "loaded")
    lib = ctypes.CDLL(str(demo.stripped))
    assert lib.second_export(1) == 10
    base = ctypes.cast(lib.first_export, ctypes.c_void_p).value - demo.address("first_export")
    hidden = demo.address("hidden_work")
    (ip,) = Symbolizer().frames(os.getpid(), [base + hidden + 2], first_is_ip=True)
    (ret,) = Symbolizer().frames(os.getpid(), [base + hidden + 1], first_is_ip=False)
    assert (ip.function, ip.module, ip.offset) == (None, "libdemo.so", hidden + 2)
    assert (ret.function, ret.offset) == (None, hidden)  # return addresses: the call's byte


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


def test_the_name_worker_names_through_the_debug_file_the_recorder_found(tmp_path, cache):
    """The recorder found the debug file (beside the library, through the process's root); the
    name worker, which could not find it any more, reads it through the recorder's descriptor."""
    demo = build_demo(tmp_path, "link-worker")
    beside = demo.stripped.parent / "libdemo.debug"
    shutil.copy(demo.debug, beside)
    lib = ctypes.CDLL(str(demo.stripped))
    base = ctypes.cast(lib.first_export, ctypes.c_void_p).value - demo.address("first_export")
    sym = Symbolizer(namer=NameWorker())
    try:
        places = sym.places(os.getpid(), [base + demo.address("hidden_work")], first_is_ip=True)
        assert places[0].image.debug_path
        beside.unlink()
        sym.prepare(places)
        frame = sym.describe(places[0])
    finally:
        sym.close()
    assert frame.function == "hidden_work"
    assert frame.file and frame.file.endswith("demo.c") and frame.line


def test_debuglink_to_other_contents_is_ignored(tmp_path, cache):
    demo = build_demo(tmp_path, "bad-crc")
    with (demo.debug).open("ab") as f:
        f.write(b"\0")  # still an ELF file with the right build-id, not the file the CRC was taken of
    shutil.copy(demo.debug, demo.stripped.parent / "libdemo.debug")
    img = ElfImage.open(str(demo.stripped))
    hidden = demo.address("hidden_work")
    assert img.debug_path is None and img.lookup(hidden) is None
    assert function_name(img, hidden) is None


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
    """A debuginfod server on 127.0.0.1: /buildid/<id>/debuginfo from `files`, 404 otherwise; each
    answer after `delay` seconds."""

    def __init__(self, files: dict[str, Path], delay: float = 0.0):
        self.requests: Counter[str] = Counter()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                owner.requests[self.path] += 1
                time.sleep(delay)
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
        # a short poll: shutdown() waits for one
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def serve() -> Iterator:
    servers: list[DebuginfodServer] = []

    def start(files: dict[str, Path], delay: float = 0.0) -> DebuginfodServer:
        servers.append(DebuginfodServer(files, delay))
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
    assert debuginfod.wait_idle(5)
    cached = cache / "debuginfod" / f"{demo.build_id}.debug"
    assert function_name(img, hidden + 1) == "hidden_work"  # names first needed: the file is attached
    assert img.debug_path == str(cached)
    assert cached.read_bytes() == demo.debug.read_bytes()
    assert oct(cached.stat().st_mode & 0o777) == "0o600"
    assert server.requests == {f"/buildid/{demo.build_id}/debuginfo": 1}

    server.stop()  # from the cache now, in this process and after a restart
    assert debuginfod.debug_file(demo.build_id).build_id() == demo.build_id
    assert lookup_in_fresh_interpreter(demo.stripped, hidden + 1) == "hidden_work"


def test_debuginfod_miss_is_remembered(tmp_path, cache, monkeypatch, serve):
    demo = build_demo(tmp_path, "debuginfod-miss")
    server = serve({})
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    hidden = demo.address("hidden_work")

    img = ElfImage.open(str(demo.stripped))
    assert debuginfod.wait_idle(5)
    assert function_name(img, hidden) is None
    assert (cache / "debuginfod" / f"{demo.build_id}.miss").exists()
    assert debuginfod.stats()["missed"] == 1
    assert lookup_in_fresh_interpreter(demo.stripped, hidden) == "None"
    assert server.requests == {f"/buildid/{demo.build_id}/debuginfo": 1}  # the restart did not ask


def test_debuginfod_file_of_another_build_is_not_used(tmp_path, cache, monkeypatch, serve):
    other, demo = build_demo(tmp_path, "served-other"), build_demo(tmp_path, "served-wrong")
    server = serve({demo.build_id: other.debug})
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    img = ElfImage.open(str(demo.stripped))
    assert debuginfod.wait_idle(5)
    assert img.lookup(demo.address("hidden_work")) is None and img.debug_path is None
    assert not (cache / "debuginfod" / f"{demo.build_id}.debug").exists()
    assert debuginfod.stats()["missed"] == 1


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
        hidden = demo.address("hidden_work")
        assert function_name(img, hidden) is None
        assert time.monotonic() - start < 0.5  # the caller never waits for the server
        assert debuginfod.wait_idle(debuginfod.TIMEOUT_S + 3)
        assert debuginfod.TIMEOUT_S - 0.2 < time.monotonic() - start < debuginfod.TIMEOUT_S + 1.5
        assert img.debug_path is None and debuginfod.stats()["failed"] == 1
        # the server is backed off: the next library's request does not reach it
        start = time.monotonic()
        assert ElfImage.open(str(again.stripped)).debug_path is None
        assert debuginfod.wait_idle(5)
        assert time.monotonic() - start < 0.5
        assert len(held) == 1 and debuginfod.stats()["failed"] == 2
    finally:
        listener.close()
        for s in held:
            s.close()


def test_debuginfod_off_without_urls(tmp_path, cache, serve):
    demo = build_demo(tmp_path, "debuginfod-off")
    server = serve({demo.build_id: demo.debug})  # running, but not named in the environment
    assert ElfImage.open(str(demo.stripped)).debug_path is None
    assert not server.requests and not (cache / "debuginfod").exists()


def test_debuginfod_slow_server_does_not_block_the_caller(tmp_path, cache, monkeypatch, serve):
    demo = build_demo(tmp_path, "debuginfod-slow")
    server = serve({demo.build_id: demo.debug}, delay=1.0)  # slow, within debuginfod.TIMEOUT_S
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    monkeypatch.setattr(elf, "DEBUGINFOD_RECHECK_S", 0.2)
    hidden = demo.address("hidden_work")

    start = time.monotonic()
    assert debuginfod.debug_file(demo.build_id, 0) is None  # queued
    assert time.monotonic() - start < 0.05
    start = time.monotonic()
    img = ElfImage.open(str(demo.stripped))
    assert function_name(img, hidden) is None  # not there yet
    assert time.monotonic() - start < 0.5
    assert img.debug_path is None and debuginfod.pending(demo.build_id)
    assert debuginfod.stats()["pending"] == 1

    assert debuginfod.wait_idle(10)
    assert function_name(img, hidden + 1) == "hidden_work"  # the same image, its debug file attached since
    assert img.debug_path == str(cache / "debuginfod" / f"{demo.build_id}.debug")
    assert not debuginfod.pending(demo.build_id)
    assert server.requests == {f"/buildid/{demo.build_id}/debuginfo": 1}  # asked once, looked for twice
    assert debuginfod.stats()["fetched"] == 1


def rebuilt_ids(debug: Path, build_id: str, n: int, out: Path) -> dict[str, Path]:
    """`n` copies of the debug file `debug`, each with another build-id (its note's bytes replaced)."""
    data, old = debug.read_bytes(), bytes.fromhex(build_id)
    assert data.count(old) == 1
    copies = {}
    for i in range(n):
        new = hashlib.sha1(f"{build_id} {i}".encode()).hexdigest()
        copies[new] = out / f"{new}.debug"
        copies[new].write_bytes(data.replace(old, bytes.fromhex(new)))
    return copies


def cache_entries(d: Path, suffix: str) -> set[str]:
    return {p.name.removesuffix(suffix) for p in d.iterdir() if p.name.endswith(suffix) and not p.is_symlink()
            and p.stat().st_uid == os.geteuid()}


def test_debuginfod_cache_is_bounded_least_recently_used_first(tmp_path, cache, monkeypatch, serve):
    demo = build_demo(tmp_path, "cache-cap")
    served = rebuilt_ids(demo.debug, demo.build_id, 6, tmp_path)
    size = demo.debug.stat().st_size
    server = serve(served)
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    monkeypatch.setattr(debuginfod, "CACHE_ENTRIES", 3)
    monkeypatch.setenv(debuginfod.CACHE_BYTES_ENV, str(10 * size))
    a, b, c, e, f, g = served
    d = cache / "debuginfod"

    def fetch(bid: str) -> ElfReader | None:
        assert debuginfod.debug_file(bid) is None
        assert debuginfod.wait_idle(5)
        return debuginfod.debug_file(bid)

    for bid in (a, b, c):
        assert fetch(bid).build_id() == bid
    # not ours, or not cache entries: neither counted nor removed
    (tmp_path / "target").write_bytes(b"x" * size)
    (d / f"{'e' * 40}.debug").symlink_to(tmp_path / "target")
    (d / f"{'d' * 40}.debug").write_bytes(b"x" * size)
    os.chown(d / f"{'d' * 40}.debug", 65534, 65534)
    (d / "notes.txt").write_bytes(b"x" * size)
    foreign = sorted(p.name for p in d.iterdir() if p.name.endswith((".debug", ".txt")))
    # a download's temporary left by a child killed mid-download goes once no download can be that
    # long; a fresh one (a download under way) stays
    stale, fresh = (d / f".{x * 40}.debug.{os.getpid()}-0a1b2c3d.tmp" for x in "12")
    for t in (stale, fresh):
        t.write_bytes(b"x" * size)
    old = time.time() - debuginfod.TEMPORARY_STALE_S - 1
    os.utime(stale, (old, old))

    assert debuginfod.debug_file(a).build_id() == a  # used: b is now the least recently used
    assert fetch(e) is not None
    assert cache_entries(d, ".debug") == {a, c, e}
    assert not stale.exists() and fresh.exists()
    monkeypatch.setenv(debuginfod.CACHE_BYTES_ENV, str(2 * size + size // 2))  # room for two
    assert fetch(f) is not None
    assert cache_entries(d, ".debug") == {e, f}  # c, then a (used after c was stored)
    assert debuginfod.stats()["evicted"] == 3
    monkeypatch.setenv(debuginfod.CACHE_BYTES_ENV, str(size // 2))  # a file alone over the cap: not kept
    assert fetch(g) is None
    assert cache_entries(d, ".debug") == set() and cache_entries(d, ".miss") == {g}
    assert debuginfod.stats()["missed"] == 1 and debuginfod.stats()["evicted"] == 6  # e, f and g itself
    assert sorted(p.name for p in d.iterdir() if p.name.endswith((".debug", ".txt"))) == [
        n for n in foreign if n not in (f"{x}.debug" for x in (a, b, c))]
    assert (tmp_path / "target").exists()
    assert sum(server.requests.values()) == 6


def test_debuginfod_unknown_ids_are_bounded_and_rate_limited(cache, monkeypatch, serve):
    server = serve({})
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    monkeypatch.setattr(debuginfod, "RATE_PER_S", 0.0)
    monkeypatch.setattr(debuginfod, "BURST", 5)
    monkeypatch.setattr(debuginfod, "ASKED_MAX", 16)
    monkeypatch.setattr(debuginfod, "CACHE_ENTRIES", 8)
    ids = [hashlib.sha1(f"unknown {i}".encode()).hexdigest() for i in range(100)]

    start = time.monotonic()
    assert all(debuginfod.debug_file(bid) is None for bid in ids[:40])
    assert time.monotonic() - start < 0.5
    assert debuginfod.wait_idle(10)
    stats = debuginfod.stats()
    assert (stats["queued"], stats["rate_limited"], stats["missed"]) == (5, 35, 5)
    assert sum(server.requests.values()) == 5
    assert not debuginfod.pending(ids[0]) and debuginfod.pending(ids[39])  # refused: may be asked later

    # one requester's limit leaves the others theirs; markers and memory stay bounded
    monkeypatch.setattr(debuginfod, "BURST", 1000)
    monkeypatch.setattr(debuginfod, "PER_REQUESTER_MAX", 20)
    debuginfod.reset()
    for bid in ids[40:90]:
        debuginfod.debug_file(bid, requester=1000)
    for bid in ids[90:]:
        debuginfod.debug_file(bid, requester=1001)
    assert debuginfod.wait_idle(10)
    stats = debuginfod.stats()
    assert (stats["queued"], stats["rate_limited"], stats["missed"]) == (30, 30, 30)
    assert stats["remembered"] <= 16
    markers = cache_entries(cache / "debuginfod", ".miss")
    assert len(markers) == 8 and markers <= set(ids[90:]) | set(ids[40:60])
    assert markers >= set(ids[92:])  # the latest kept

    debuginfod.reset()  # as after a restart: the markers still answer
    assert debuginfod.debug_file(ids[-1]) is None and debuginfod.stats()["queued"] == 0
    assert sum(server.requests.values()) == 35

    # a full queue drops requests, asked again later
    slow = serve({}, delay=0.3)
    monkeypatch.setenv(debuginfod.URLS_ENV, slow.url)
    monkeypatch.setattr(debuginfod, "QUEUE_MAX", 2)
    for bid in ids[:4]:
        debuginfod.debug_file(bid)
    assert debuginfod.stats()["dropped"] == 2
    assert debuginfod.wait_idle(5)
    assert debuginfod.pending(ids[3]) and not debuginfod.pending(ids[1])
    assert sum(slow.requests.values()) == 2


def test_debuginfod_asks_only_for_files_root_alone_can_change(tmp_path, cache, monkeypatch, serve):
    demo, writable = build_demo(tmp_path, "not-roots"), build_demo(tmp_path, "group-writable")
    server = serve({demo.build_id: demo.debug, writable.build_id: writable.debug})
    monkeypatch.setenv(debuginfod.URLS_ENV, server.url)
    monkeypatch.delenv(debuginfod.ANY_ENV, raising=False)
    os.chown(demo.stripped, 65534, 65534)  # nobody's
    os.chmod(writable.stripped, 0o775)  # root's, but its group may change it
    hidden = demo.address("hidden_work")

    img = ElfImage.open(str(demo.stripped))
    assert ElfImage.open(str(writable.stripped)).lookup(writable.address("hidden_work")) is None
    assert debuginfod.wait_idle(5)
    assert function_name(img, hidden) is None
    assert not server.requests and debuginfod.stats()["queued"] == 0

    monkeypatch.setenv(debuginfod.ANY_ENV, "1")  # opted in: anyone's files too, their owner's limit
    monkeypatch.setattr(debuginfod, "PER_REQUESTER_MAX", 0)
    monkeypatch.setattr(elf, "DEBUGINFOD_RECHECK_S", 0.0)
    ElfImage.forget()
    img = ElfImage.open(str(demo.stripped))
    assert function_name(img, hidden) is None
    # refused at open and at each look since: not asked, asked again later
    assert debuginfod.stats()["rate_limited"] >= 2 and debuginfod.pending(demo.build_id) and not server.requests
    monkeypatch.setattr(debuginfod, "PER_REQUESTER_MAX", 1)
    assert function_name(img, hidden) is None  # asked again: queued now
    assert debuginfod.wait_idle(5)
    assert function_name(img, hidden) == "hidden_work"
    assert server.requests == {f"/buildid/{demo.build_id}/debuginfo": 1}


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
        assert img.lookup(vaddr) is None and function_name(img, vaddr) is None
    for a in starts[:50]:       # the exports themselves: their exact names
        assert function_name(img, a) in funcs[a][1]
    assert function_name(img, text.addr) is None  # before the first export
    assert function_name(img, text_end) is None  # .fini: no export there
