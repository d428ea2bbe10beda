"""Files that a recorded process maps are hostile input: malformed ELFs built here from real ones
(truncated, headers past the end, absurd counts, a DW_AT_sibling cycle, a zlib bomb, a CFI
remember_state bomb, huge names, a FIFO, a file truncated while read, a build-id shared with
another file) and seeded mutation fuzzing. Each parse returns or raises the format error, fast
and in bounded memory; then the real recorder runs next to a process mapping them."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Recording, final_by_site

from analysis.dataset import read_table
from sampler import files
from sampler.binary import reader
from sampler.binary.dwarf_lines import LineTables
from sampler.binary.elf import ElfImage
from sampler.binary.reader import ElfFormatError, ElfReader
from sampler.probes import usdt
from sampler.stacks import cfi
from sampler.stacks.cfi import CfiStore, CfiTable

SHDR = struct.Struct("<IIQQQQIIQQ")
SHF_COMPRESSED = 0x800
SHT_NOBITS = 8
BUDGET_S = 2.0          # one parse
RSS_CEILING_MIB = 700   # the whole corpus parsed in one process (numpy and pyelftools: ~120 MiB)

LIB_SRC = r"""
#include <stdlib.h>
#include <sys/sdt.h>
static void *volatile sink;
struct node { struct node *next; int v; };
__attribute__((noinline)) static int inner(struct node *n) { int s = 0; for (; n; n = n->next) s += n->v; return s; }
__attribute__((noinline)) int victim_fn(int n) {
    struct node *head = 0;
    for (int i = 0; i < n; i++) { struct node *x = malloc(sizeof *x); x->next = head; x->v = i; head = x; }
    DTRACE_PROBE2(otel_memory, alloc, head, n);
    sink = head;
    return inner(head);
}
void *plt_user(size_t n) { void *p = malloc(n); free(realloc(p, 2 * n)); return malloc(n); }
"""


def build(tmp: Path, name: str, src: str, *flags: str) -> Path:
    c = tmp / (name + ".c")
    c.write_text(src)
    out = tmp / name
    subprocess.run(["gcc", "-O1", "-g", "-gdwarf-4", "-shared", "-fPIC", *flags, "-o", str(out), str(c)],
                   check=True, capture_output=True)
    return out


def sections(data: bytes) -> dict[str, tuple[int, int, int, int]]:
    """name -> (index, offset, size, addr)."""
    elf = ElfReader(bytes(data))
    return {s.name: (i, s.offset, s.size, s.addr) for i, s in enumerate(elf.sections)}


def shdr_at(data: bytes, index: int) -> int:
    return struct.unpack_from("<Q", data, 0x28)[0] + index * SHDR.size


def replace_section(data: bytes, name: str, payload: bytes, flags: int = 0, typ: int | None = None) -> bytes:
    """`data` with section `name`'s bytes moved to `payload`, appended at the end of the file."""
    out = bytearray(data)
    out += b"\0" * (-len(out) % 16)
    index = sections(data)[name][0]
    at = shdr_at(data, index)
    h = list(SHDR.unpack_from(out, at))
    h[4], h[5] = len(out), len(payload)       # sh_offset, sh_size
    h[2] |= flags
    if typ is not None:
        h[1] = typ
    SHDR.pack_into(out, at, *h)
    return bytes(out + payload)


def hide_section(data: bytes, name: str) -> bytes:
    out = bytearray(data)
    at = shdr_at(data, sections(data)[name][0])
    struct.pack_into("<I", out, at + 4, SHT_NOBITS)
    return bytes(out)


# --- the corpus --------------------------------------------------------------------------------


def zlib_bomb(inflated: int) -> bytes:
    """A zlib stream inflating to about `inflated` zero bytes, built from one repeated block (its
    checksum is wrong: a reader that stops early never sees it)."""
    c = zlib.compressobj(9)
    chunk = b"\0" * (16 << 20)
    head = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    return head + block * (inflated // len(chunk) - 1) + c.flush()


def sibling_cycle(data: bytes) -> bytes:
    """The first DW_AT_sibling of .debug_info pointed back at its own DIE."""
    import io

    from elftools.elf.elffile import ELFFile
    f = ELFFile(io.BytesIO(data))
    dwarf = f.get_dwarf_info()
    info_off = f.get_section_by_name(".debug_info")["sh_offset"]
    for cu in dwarf.iter_CUs():
        for die in cu.iter_DIEs():
            attr = die.attributes.get("DW_AT_sibling")
            if attr is not None and attr.form == "DW_FORM_ref4":
                out = bytearray(data)
                struct.pack_into("<I", out, info_off + attr.offset, die.offset - cu.cu_offset)
                return bytes(out)
    raise AssertionError("no DW_AT_sibling to corrupt")


def remember_state_bomb(data: bytes, func_addr: int, size: int = 4 << 20) -> bytes:
    """.eh_frame replaced by one CIE and one FDE covering `func_addr` whose instructions are `size`
    bytes of DW_CFA_remember_state (and advance_loc1), without .eh_frame_hdr."""
    _, _, _, addr = sections(data)[".eh_frame"]
    cie_body = b"\0\0\0\0" + b"\x01zR\0" + b"\x01\x78\x10" + b"\x01\x1b" + b"\x0c\x07\x08\x90\x01"
    cie_body += b"\0" * (-(len(cie_body) + 4) % 4)
    cie = struct.pack("<I", len(cie_body)) + cie_body
    insns = (b"\x0a" * 15 + b"\x02\x01") * (size // 17)
    fde_at = len(cie)
    pc_field = addr + fde_at + 8
    body = struct.pack("<Iii", fde_at + 4, func_addr - pc_field, 0x1000) + b"\0" + insns
    body += b"\0" * (-(len(body) + 4) % 4)
    frame = cie + struct.pack("<I", len(body)) + body + b"\0\0\0\0"
    return hide_section(replace_section(data, ".eh_frame", frame), ".eh_frame_hdr")


def set_u16(data: bytes, at: int, v: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<H", out, at, v)
    return bytes(out)


def set_u64(data: bytes, at: int, v: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<Q", out, at, v)
    return bytes(out)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, bytes, int]:
    tmp = tmp_path_factory.mktemp("hostile")
    lib = build(tmp, "libbase.so", LIB_SRC)
    img = ElfImage.open(str(lib))
    return lib, lib.read_bytes(), img.symbol("victim_fn").value


def corpus(base_bytes: bytes, victim: int) -> dict[str, bytes]:
    d = base_bytes
    secs = sections(d)
    shoff = struct.unpack_from("<Q", d, 0x28)[0]
    out: dict[str, bytes] = {}
    for cut in sorted({0, 4, 63, 64, 100, *range(200, len(d), max(1, len(d) // 40)), len(d) - 1}):
        out[f"truncated-{cut}"] = d[:cut]
    out["shoff-past-eof"] = set_u64(d, 0x28, len(d) - 10)
    out["phoff-past-eof"] = set_u64(d, 0x20, len(d) + 4096)
    i, *_ = secs[".symtab"]
    out["symtab-past-eof"] = set_u64(d, shdr_at(d, i) + 0x18, len(d) + (1 << 40))
    out["symtab-huge-size"] = set_u64(d, shdr_at(d, i) + 0x20, 1 << 62)
    i, *_ = secs[".debug_info"]
    out["debug-info-past-eof"] = set_u64(d, shdr_at(d, i) + 0x18, len(d) - 16)
    out["shnum-ffff"] = set_u16(d, 0x3C, 0xFFFF)
    out["phnum-ffff"] = set_u16(d, 0x38, 0xFFFF)
    out["shnum-extended-huge"] = set_u64(set_u16(d, 0x3C, 0), shoff + 0x20, 1 << 40)
    out["shstrndx-past"] = set_u16(d, 0x3E, 0xFFFE)
    out["sibling-cycle"] = sibling_cycle(d)
    # a zlib bomb that declares its size (1 GiB: refused) and one that lies (1 MiB: stopped there)
    bomb = zlib_bomb(1 << 30)
    for label, declared in (("honest", 1 << 30), ("lying", 1 << 20)):
        chdr = struct.pack("<IIQQ", reader.ELFCOMPRESS_ZLIB, 0, declared, 1)
        out[f"zlib-bomb-{label}"] = replace_section(d, ".debug_info", chdr + bomb, SHF_COMPRESSED)
    out["cfi-remember-state-bomb"] = remember_state_bomb(d, victim)
    out["note-bomb"] = replace_section(d, ".note.stapsdt", struct.pack("<III", 8, 0, 3) + b"stapsdt\0" * 1
                                       + (struct.pack("<III", 0, 0, 3)) * 200_000)
    return out


# One process parses the whole corpus, each file as the recorder would use it, and reports per file
# what came out, how long it took, and the process's peak RSS.
PARSE_ALL = textwrap.dedent("""
    import json, resource, sys, time
    from sampler.binary.dwarf_lines import LineTables
    from sampler.binary.elf import ElfImage
    from sampler.binary.reader import ElfFormatError, ElfReader
    from sampler.probes import usdt
    from sampler.stacks.cfi import CfiTable
    from sampler.stacks.symbolize import demangle
    victim = int(sys.argv[1])
    out = {}
    for path in sys.argv[2:]:
        t0 = time.perf_counter()
        try:
            usdt.read_probes(path)
            ElfReader.open(path).build_id()
            img = ElfImage.open(path)
            img.plt_targets()
            for v in (victim, victim + 4):
                found = img.lookup(v)
                if found:
                    demangle(found[0])
                CfiTable(img).rule(v)
            lt = LineTables.for_image(img)
            if lt is not None:
                lt.lookup(victim + 4)
            result = "ok"
        except (ElfFormatError, OSError) as e:
            result = type(e).__name__
        except BaseException as e:
            result = "LEAKED " + type(e).__name__ + ": " + str(e)[:200]
        out[path] = [result, time.perf_counter() - t0]
        ElfImage.forget()
        LineTables.prune(shed=2)
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
""")


def parse_in_child(paths: list[Path], victim: int, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", PARSE_ALL, str(victim), *map(str, paths)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_corpus_parses_or_refuses_fast_and_bounded(base, tmp_path):
    lib, data, victim = base
    files = corpus(data, victim)
    paths = []
    for name, body in files.items():
        path = tmp_path / name
        path.write_bytes(body)
        paths.append(path)
    got = parse_in_child([lib, *paths], victim, timeout=120)
    rss = got.pop("maxrss_mib")
    leaked = {k: v for k, v in got.items() if v[0].startswith("LEAKED")}
    assert not leaked
    slow = {k: v for k, v in got.items() if v[1] > BUDGET_S}
    assert not slow
    assert rss < RSS_CEILING_MIB, rss
    assert got[str(lib)][0] == "ok"
    print(f"corpus of {len(paths)}: peak RSS {rss:.0f} MiB, slowest "
          f"{max(v[1] for v in got.values()):.2f} s")


def test_bombs_are_cut_short(base, tmp_path):
    """Each bomb of the corpus directly, in-process: what it would have cost is refused."""
    _, data, victim = base
    files = corpus(data, victim)
    # the zlib bombs: refused, never inflated past the declared size (the lying one), or at all
    for label in ("honest", "lying"):
        path = tmp_path / f"zlib-{label}"
        path.write_bytes(files[f"zlib-bomb-{label}"])
        img = ElfImage.open(str(path))
        t0 = time.perf_counter()
        assert LineTables.for_image(img) is None
        assert time.perf_counter() - t0 < BUDGET_S
    # the remember_state bomb: the FDE is unreadable past MAX_STATES, in bounded work
    path = tmp_path / "cfi-bomb"
    path.write_bytes(files["cfi-remember-state-bomb"])
    img = ElfImage.open(str(path))
    t0 = time.perf_counter()
    table = CfiTable(img)
    assert table.sources == [".eh_frame"] and table.fde_count == 1
    # rows emitted before the stack overflowed stay; past them the FDE is not followed
    assert table.rule(victim + 0x800)[0] == cfi.UNSUPPORTED
    assert time.perf_counter() - t0 < BUDGET_S
    # the sibling cycle: the lookup ends, without the function
    path = tmp_path / "sibling"
    path.write_bytes(files["sibling-cycle"])
    t0 = time.perf_counter()
    lt = LineTables.for_image(ElfImage.open(str(path)))
    assert lt is not None
    lt.lookup(victim + 4)
    assert time.perf_counter() - t0 < BUDGET_S


def test_cfi_bounds_each_fde_and_file(base, tmp_path, monkeypatch):
    """Alternating remember/restore stays under MAX_STATES but not under MAX_INSNS."""
    _, data, victim = base
    path = tmp_path / "cfi-long"
    frame = remember_state_bomb(data, victim, size=1 << 20)
    path.write_bytes(frame.replace(b"\x0a" * 15 + b"\x02\x01", b"\x0a\x0b" * 7 + b"\x00\x02\x01", 1 << 20))
    monkeypatch.setattr(cfi, "MAX_WORK", 1 << 17)
    table = CfiTable(ElfImage.open(str(path)))
    t0 = time.perf_counter()
    table.rule(victim + 1)
    assert time.perf_counter() - t0 < BUDGET_S
    assert table._sections[0].work <= cfi.MAX_INSNS + 1


def test_huge_symbol_names_are_capped(tmp_path):
    long = "f" * (1 << 20)
    mangled = "_Z" + "N" + "3abc" * 50_000 + "E" + "v"
    lib = build(tmp_path, "libnames.so", f"void {long}(void) {{}}\nvoid v(void) {{ {long}(); }}\n")
    img = ElfImage.open(str(lib))
    names = {img.lookup(int(v))[0] for v in img.index.ustart}
    assert "v" in names and max(map(len, names)) == 1024
    assert img.symbol(long) is not None  # found by its whole name all the same
    from sampler.stacks.symbolize import demangle
    assert len(demangle(mangled)) <= 4096


def test_fifo_at_a_library_path_never_blocks(tmp_path):
    fifo = tmp_path / "libjemalloc.so.2"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from sampler.binary.elf import ElfImage
        from sampler.binary.reader import ElfFormatError, ElfReader
        from sampler.probes import usdt
        from sampler import files
        assert usdt.read_probes({str(fifo)!r}) == ()
        for f in (ElfImage.open, ElfReader.open):
            try:
                f({str(fifo)!r})
            except ElfFormatError:
                pass
            else:
                raise AssertionError("a FIFO read as ELF")
        try:
            files.open_untrusted({str(fifo)!r}, 1 << 20)
        except ValueError:
            pass
        print("done")
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and p.stdout.strip() == "done", p.stderr


def test_symlink_at_a_library_path_is_not_followed(base, tmp_path):
    lib, _, _ = base
    link = tmp_path / "libpython3.11.so"
    link.symlink_to(lib)
    with pytest.raises(ElfFormatError):
        ElfImage.open(str(link))
    assert usdt.read_probes(str(link)) == ()


def test_another_processes_descriptor_link_is_not_followed(base, tmp_path):
    """/proc/PID/fd/N is followed only for our own descriptors and our parent's (the name worker
    reads the recorder's): a target's descriptor, which could be anything it opened, is a link
    like any other and refused."""
    lib, _, _ = base
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'rb'); "
                               "print(f.fileno(), flush=True); time.sleep(30)", str(lib)],
                              stdout=subprocess.PIPE, text=True)
    try:
        n = int(holder.stdout.readline())
        with pytest.raises(ValueError, match="is a symbolic link"):
            files.open_untrusted(f"/proc/{holder.pid}/fd/{n}", 1 << 30)
        with open(lib, "rb") as own:
            fd, st = files.open_untrusted(f"/proc/{os.getpid()}/fd/{own.fileno()}", 1 << 30)
            os.close(fd)
            assert st.st_ino == os.fstat(own.fileno()).st_ino
    finally:
        holder.kill()
        holder.wait()


def test_file_truncated_while_parsed_is_no_sigbus(base, tmp_path):
    """The target truncates its library after the recorder opened it: later reads fail cleanly
    (a mapping would have killed the process with SIGBUS)."""
    lib, _, victim = base
    victim_copy = tmp_path / "libvictim.so"
    shutil.copy(lib, victim_copy)
    code = textwrap.dedent(f"""
        import os
        from sampler.binary.dwarf_lines import LineTables
        from sampler.binary.elf import ElfImage
        from sampler.binary.reader import ElfFormatError
        from sampler.probes import usdt
        from sampler.stacks.cfi import CfiTable
        path = {str(victim_copy)!r}
        img = ElfImage.open(path)
        os.truncate(path, 100)
        outcomes = []
        for step in (lambda: img.lookup({victim}), img.plt_targets, lambda: CfiTable(img).rule({victim} + 1),
                     lambda: LineTables.for_image(img), lambda: img.read_vaddr({victim}, 16),
                     lambda: img.section(".text"), lambda: usdt.read_probes(path)):
            try:
                step()
                outcomes.append("ok")
            except (ElfFormatError, OSError) as e:
                outcomes.append(type(e).__name__)
        print(outcomes)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])   # -7 was SIGBUS
    assert "ElfFormatError" in p.stdout


SAME_ID = "-Wl,--build-id=0x" + "ab" * 20


def test_same_build_id_other_contents_share_nothing(tmp_path):
    """A stranger's file claiming the victim's build-id: its symbols, code and CFI never describe
    the victim's library, in memory or through the unwind cache on disk; identical copies share."""
    victim = build(tmp_path, "libvictim.so", "int victim_fn(int x) { return x * 3 + 1; }\n", SAME_ID)
    stranger = build(tmp_path, "libstranger.so",
                     "int pad(int x) { return x ^ 5; }\nint other_fn(int x) { return x + 7; }\n"
                     "int victim_fn(int x) { return other_fn(x) - pad(x); }\n", SAME_ID)
    shutil.copy(victim, tmp_path / "libcopy.so")
    ElfImage.forget()
    s = ElfImage.open(str(stranger))
    v = ElfImage.open(str(victim))
    assert s.build_id == v.build_id and s is not v
    assert v.symbol("other_fn") is None and s.symbol("other_fn") is not None
    assert v.symbol("victim_fn").value != s.symbol("victim_fn").value or \
        v.read_vaddr(v.symbol("victim_fn").value, 8) == s.read_vaddr(s.symbol("victim_fn").value, 8)
    assert ElfImage.open(str(tmp_path / "libcopy.so")) is v
    # the unwind cache: keyed apart, and a table saved for one is not loaded for the other
    cache = tmp_path / "cache"
    store = CfiStore(cache)
    ts, tv = store.table(s), store.table(v)
    assert ts is not tv and ts.key != tv.key and ts.key.startswith(s.build_id)
    for img, t in ((s, ts), (v, tv)):
        t.rule(img.symbol("victim_fn").value)
    store.save()
    assert sorted(p.stem for p in cache.iterdir()) == sorted([ts.key, tv.key])
    fresh = CfiStore(cache).table(v)
    assert fresh.key == tv.key and fresh.decodes == 0 and fresh.rule(v.symbol("victim_fn").value) == \
        tv.rule(v.symbol("victim_fn").value)


def test_unwind_cache_write_failure_is_logged_once(base, tmp_path, caplog):
    lib, _, victim = base
    cache = tmp_path / "ro"
    cache.mkdir(mode=0o700)
    store = CfiStore(cache)
    t = store.table(ElfImage.open(str(lib)))
    t.rule(victim + 1)
    # a full disk: the temporary cannot be written (a regular file in the way of the directory)
    shutil.rmtree(cache)
    cache.write_bytes(b"")
    for _ in range(3):
        t.dirty = True
        store.save()  # never raises
    cache.unlink()
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o500)
    with caplog.at_level("WARNING"):
        t.dirty = True
        store.save()
        t.dirty = True
        store.save()
    assert len([r for r in caplog.records if "unwind cache" in r.getMessage()]) <= 1


# --- fuzzing -----------------------------------------------------------------------------------

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", 4))


def mutate(rng: random.Random, data: bytearray, lo: int, hi: int) -> bytearray:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        kind = rng.choices(range(4), (4, 4, 2, 1))[0]
        at = min(rng.randrange(lo, max(lo + 1, hi)), len(out) - 1)
        if at < 0:
            break
        if kind == 0:
            out[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            width = rng.choice((1, 2, 4, 8))
            v = rng.choice((0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, (1 << 64) - 1, rng.getrandbits(64)))
            out[at : at + width] = (v & ((1 << (8 * width)) - 1)).to_bytes(width, "little")[: max(0, len(out) - at)]
        elif kind == 2:
            out[at : at + rng.randrange(1, 64)] = rng.randbytes(rng.randrange(1, 64))
        else:
            del out[rng.randrange(min(lo, len(out) - 1), len(out)) :]  # truncation
    return out


def fuzz(tmp_path: Path, seed: int, good: bytes, spans: list[tuple[int, int]], use) -> tuple[int, int]:
    rng = random.Random(seed + 1000 * int(os.environ.get("FUZZ_SEED", 0)))  # search further: FUZZ_SEED
    deadline = time.monotonic() + FUZZ_SECONDS
    runs = refused = 0
    while time.monotonic() < deadline:
        lo, hi = rng.choice(spans)
        path = tmp_path / f"f{seed}-{runs}"
        path.write_bytes(mutate(rng, bytearray(good), lo, hi))
        t0 = time.perf_counter()
        try:
            use(str(path))
        except (ElfFormatError, OSError):
            refused += 1
        assert time.perf_counter() - t0 < BUDGET_S, f"seed {seed} run {runs}"
        path.unlink()
        ElfImage.forget()
        runs += 1
    return runs, refused


def span(data: bytes, name: str) -> tuple[int, int]:
    _, off, size, _ = sections(data)[name]
    return off, off + size


def test_fuzz_elf_headers_symbols_notes(base, tmp_path):
    _, data, victim = base
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    spans = [(0, 64), (64, 64 + 56 * 8), (shoff, len(data))]
    spans += [span(data, n) for n in (".symtab", ".strtab", ".dynsym", ".dynstr", ".rela.plt", ".plt",
                                       ".note.stapsdt", ".note.gnu.build-id")]

    def use(path: str) -> None:
        usdt.read_probes(path)
        img = ElfImage.open(path)
        img.plt_targets()
        img.lookup(victim + 2)
        img.symbol("malloc")

    runs, refused = fuzz(tmp_path, 1, data, spans, use)
    assert runs > 20 and refused > 0


def test_fuzz_eh_frame(base, tmp_path):
    _, data, victim = base
    spans = [span(data, ".eh_frame"), span(data, ".eh_frame_hdr")]
    starts = np.array(sorted(ElfImage.open(str(base[0])).index.ustart.tolist()), np.int64)

    def use(path: str) -> None:
        t = CfiTable(ElfImage.open(path))
        for v in starts:
            t.rule(int(v) + 1)
        CfiTable(ElfImage.open(path), use_hdr=False).rule(victim + 1)

    runs, _ = fuzz(tmp_path, 2, data, spans, use)
    assert runs > 20


def test_fuzz_dwarf(base, tmp_path):
    _, data, victim = base
    spans = [span(data, n) for n in (".debug_line", ".debug_info", ".debug_abbrev", ".debug_aranges")]

    def use(path: str) -> None:
        lt = LineTables.for_image(ElfImage.open(path))
        if lt is not None:
            for v in (victim, victim + 8, victim + 40):
                lt.lookup(v)
        LineTables.prune(shed=2)

    runs, _ = fuzz(tmp_path, 3, data, spans, use)
    assert runs > 20


# --- end to end --------------------------------------------------------------------------------

MAPPER_SRC = r"""
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
/* Maps each file named on the command line executable, like a loaded library; those prefixed
   "dl:" are loaded (their .eh_frame and DWARF are not needed to run) and their victim_fn, which
   mallocs, is called in a loop, so that samples are unwound and named through them. */
int main(int argc, char **argv) {
    int (*calls[16])(int);
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (argv[i][0] == 'd' && argv[i][1] == 'l' && argv[i][2] == ':') {
            void *h = dlopen(argv[i] + 3, RTLD_NOW);
            if (!h || !(calls[n++] = (int (*)(int))dlsym(h, "victim_fn"))) {
                fprintf(stderr, "%s: %s\n", argv[i], dlerror());
                return 1;
            }
            continue;
        }
        int fd = open(argv[i], O_RDONLY);
        off_t size = lseek(fd, 0, SEEK_END);
        if (fd < 0 || size <= 0 || mmap(0, size, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED) {
            perror(argv[i]);
            return 1;
        }
    }
    puts("mapped");
    fflush(stdout);
    struct timespec ms = {0, 1000000};
    for (;;) {
        for (int i = 0; i < n; i++)
            calls[i](64);
        nanosleep(&ms, 0);
    }
}
"""


def with_build_id(data: bytes, tag: int) -> bytes:
    """`data` with a build-id of its own (its first byte `tag`): no cache can take it for another."""
    _, off, _, _ = sections(data)[".note.gnu.build-id"]
    out = bytearray(data)
    out[off + 16] = tag  # after the 12-byte note header and "GNU\0"
    return bytes(out)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start_mapper(tmp_path: Path, paths: list[str]) -> subprocess.Popen:
    exe = tmp_path / "mapper"
    (tmp_path / "mapper.c").write_text(MAPPER_SRC)
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(tmp_path / "mapper.c"), "-ldl"], check=True)
    return subprocess.Popen([str(exe), *paths], stdout=subprocess.PIPE, text=True)


def record_beside(record, workload, mapper: subprocess.Popen, snapshots: int,
                  ceiling: Path | None = None) -> tuple[Recording, int, int, float]:
    """The mapper and a workload recorded together (the recorder put in `ceiling`, a memory cgroup,
    with the children it starts) while the workload leaks 16 MiB, until `snapshots` snapshots:
    (the recording, the workload's pid, the bytes it leaked, the recorder's peak RSS in MiB). The
    mapper is killed after."""
    try:
        assert mapper.stdout.readline().strip() == "mapped"
        w = workload()
        rec = record("--pid", str(mapper.pid), "--pid", str(w.pid), "-i", "0.5", "--sample-bytes", "64K")
        if ceiling is not None:
            (ceiling / "cgroup.procs").write_text(str(rec.proc.pid))
        rec.wait_attached()
        deadline = time.monotonic() + 60             # both attached (the first row may be the mapper's)
        while not {mapper.pid, w.pid} <= set((t := read_table(rec.out, "targets"))[t["event"] == "attach"]["pid"]):
            assert time.monotonic() < deadline, t[["pid", "event", "detail"]]
            time.sleep(0.1)
        truth = w.call("leak_malloc", 4096, 4096)       # 16 MiB
        rec.wait_snapshots(snapshots)
        assert rec.proc.poll() is None
        peak = rss_mib(rec.proc.pid)
        code, _, err = rec.stop()
        assert code == 0, err[-3000:]
    finally:
        mapper.kill()
        mapper.wait()
    return rec, w.pid, truth, peak


@pytest.mark.bpf
def test_recorder_survives_a_target_mapping_hostile_files(base, tmp_path, workload, record):
    _, data, victim = base
    files = corpus(data, victim)
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    # loaded and called: unwound through a remember_state bomb, named through a sibling cycle
    loaded = {"libjemalloc.so.2": "cfi-remember-state-bomb", "libpython3.11.so.1.0": "sibling-cycle",
              "libcudart.so.12": "zlib-bomb-lying"}
    mapped = {"libtcmalloc.so.4": "shnum-extended-huge", "libc10_cuda.so": "note-bomb",
              "libcuda.so.1": "truncated-200", "libtorch_cpu.so": "symtab-huge-size"}
    paths = []
    for tag, (name, kind) in enumerate({**loaded, **mapped}.items()):
        (hostile / name).write_bytes(with_build_id(files[kind], tag) if name in loaded else files[kind])
        paths.append(("dl:" if name in loaded else "") + str(hostile / name))
    mapper = start_mapper(tmp_path, paths)
    rec, leaker, truth, peak = record_beside(record, workload, mapper, snapshots=4)
    # the hostile process was sampled, and unwound through the bombs (its leaks are in victim_fn)
    hostile_sites = final_by_site(rec.out, mapper.pid)
    print("hostile process's sites:", sorted(set(hostile_sites["site_fn"].astype(str)))[:10])
    assert len(hostile_sites) > 0
    df = final_by_site(rec.out, leaker)
    events = read_table(rec.out, "targets")
    assert "leak_malloc" in set(df["site_fn"]), (df, events[["pid", "event", "detail"]].to_string())
    est, se = df[df["site_fn"] == "leak_malloc"][["outstanding_bytes", "outstanding_stderr_bytes"]].sum()
    print(f"leak_malloc: {est / 2**20:.2f} MiB (se {se / 2**20:.2f}) of {truth / 2**20:.2f} MiB")
    assert abs(est - truth) < 4 * se + 0.02 * truth, (est, se, truth)
    assert peak < 1024, peak
    print(f"recorder peak RSS {peak:.0f} MiB")


def zdebug_bomb(data: bytes, declared: int = 200 << 20) -> bytes:
    """Every DWARF section compressed, each honestly declaring `declared` bytes (under the per-
    section cap): ~800 KiB of file that inflates to 800 MiB."""
    bomb = struct.pack("<IIQQ", reader.ELFCOMPRESS_ZLIB, 0, declared, 1) + zlib_bomb(declared)
    for name in (".debug_info", ".debug_abbrev", ".debug_str", ".debug_line"):
        data = replace_section(data, name, bomb, SHF_COMPRESSED)
    return data


def write_symtab_bomb(data: bytes, path: Path, count: int = 6, size: int = 128 << 20) -> None:
    """`data` with `count` more symbol tables of `size` bytes each (all over one hole of the file,
    sparse on disk): 768 MiB of symbol tables for a file of a few KiB on disk."""
    secs = sections(data)
    shoff, shnum = struct.unpack_from("<Q", data, 0x28)[0], struct.unpack_from("<H", data, 0x3C)[0]
    symtab = list(SHDR.unpack_from(data, shdr_at(data, secs[".symtab"][0])))
    head = data + b"\0" * (-len(data) % 16)
    hole_at = len(head)
    extra = b"".join(SHDR.pack(symtab[0], 2, 0, 0, hole_at, size, symtab[6], 0, 8, 24) for _ in range(count))
    with open(path, "wb") as f:
        f.write(head)
        f.seek(hole_at + size)
        table_at = f.tell()
        f.write(data[shoff : shoff + shnum * SHDR.size] + extra)
        f.seek(0x28)
        f.write(struct.pack("<Q", table_at))
        f.seek(0x3C)
        f.write(struct.pack("<H", shnum + count))


@pytest.mark.bpf
# serial: beside the other worker the bombs took the whole 5 s naming budget of a snapshot and the
# leaker's stack, sampled right (16.3 of 16.8 MB), was left unnamed (2 of 6 runs, CI 2026-12-01 and here)
@pytest.mark.serial
@pytest.mark.parametrize("inflated", ["in a file", "in memory"])
def test_bombs_in_aggregate_cost_one_file_never_the_recorder(base, tmp_path, workload, record, memory_ceiling,
                                                             inflated, monkeypatch):
    """A file of four compressed DWARF sections of 200 MiB each and one of six 128 MiB symbol
    tables, loaded and called by a recorded process (so that its samples are named through them),
    with the recorder under the unit's memory ceiling: each file's budget stops it, the kernel kills
    nothing, and the other target's leak is recorded. Inflated sections go to unlinked files of the
    cache, or stay in memory where there is no private cache directory."""
    if inflated == "in memory":
        cache = tmp_path / "cache"
        cache.mkdir(mode=0o700)
        (cache / "inflated").write_text("not a directory")
        if (compiled := Path(files.cache_dir("bpf") or "/nonexistent")).is_dir():
            shutil.copytree(compiled, cache / "bpf")       # no BPF compile under the ceiling
            (cache / "bpf").chmod(0o700)
        monkeypatch.setenv("ALLOCSAMPLER_CACHE_DIR", str(cache))
    lib, data, _ = base
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    zdebug, symtabs = hostile / "libzdebug.so", hostile / "libsymtabs.so"
    zdebug.write_bytes(with_build_id(zdebug_bomb(data), 1))
    write_symtab_bomb(with_build_id(data, 2), symtabs)
    assert zdebug.stat().st_size < 1 << 20 and symtabs.stat().st_blocks * 512 < 1 << 20
    mapper = start_mapper(tmp_path, [f"dl:{zdebug}", f"dl:{symtabs}"])
    rec, leaker, truth, peak = record_beside(record, workload, mapper, snapshots=6, ceiling=memory_ceiling)
    oom = dict(line.split() for line in (memory_ceiling / "memory.oom_control").read_text().splitlines())
    assert int(oom.get("oom_kill", 0)) == 0
    hostile_sites = final_by_site(rec.out, mapper.pid)
    assert len(hostile_sites) > 0                   # sampled, and its stacks named as far as they could be
    df = final_by_site(rec.out, leaker)
    est, se = df[df["site_fn"] == "leak_malloc"][["outstanding_bytes", "outstanding_stderr_bytes"]].sum()
    assert abs(est - truth) < 4 * se + 0.02 * truth, (est, se, truth, df[["site_fn", "outstanding_bytes"]],
                                                      read_table(rec.out, "targets")[["pid", "event", "detail"]])
    print(f"recorder peak RSS {peak:.0f} MiB, cgroup peak "
          f"{int((memory_ceiling / 'memory.max_usage_in_bytes').read_text()) / 2**20:.0f} MiB")
    assert peak < 340, peak          # 399-455 MiB before budgets (b2e353d)


def test_symbol_tables_over_the_same_bytes_and_whole_cfi_reads_are_charged(base, tmp_path):
    """Section headers may all point at the same bytes: a file with more symbol tables than real
    files have is refused, not read once per header; and reading a whole .eh_frame (no
    .eh_frame_hdr to index it) is charged to the file's budget like every section read."""
    _, data, _ = base
    many = tmp_path / "libmany.so"
    write_symtab_bomb(data, many, count=20, size=1 << 20)
    with pytest.raises(ElfFormatError, match="symbol tables"):
        ElfImage.open(str(many)).symbol("victim_fn")
    img = ElfImage.open("/lib/x86_64-linux-gnu/libc.so.6")
    eh_frame = next(x.size for x in img.elf.sections if x.name == ".eh_frame")
    before = img.elf.budget.used
    CfiTable(img, use_hdr=False)
    assert img.elf.budget.used - before >= eh_frame > 64 << 10
