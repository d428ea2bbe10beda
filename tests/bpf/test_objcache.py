"""Compiled BPF programs kept across runs (sampler/bpf/objcache.py): a second start loads what the
first compiled, with the same instructions, map layouts and working maps; a damaged entry is
compiled again; map sizes are load-time settings, compile flags part of the key."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sampler.bpf import abi, btf, events, objcache
from sampler.bpf.loader import BpfProbes, ProbeConfig, program_source
from sampler.control.weights import weight_table
from sampler.probes.allocators import find_allocators

WEIGHTS = tuple(weight_table())


@pytest.fixture(scope="module")
def cache(tmp_path_factory, bpf_ready):
    """A private cache, filled by one compile (the suite's other tests use the host's)."""
    d = tmp_path_factory.mktemp("bpf_cache")
    t0 = time.monotonic()
    p = BpfProbes(ProbeConfig(cache_dir=d, weight_table=WEIGHTS))
    compile_s = time.monotonic() - t0
    assert p.compiled
    spec = p.bpf.spec
    p.close()
    return d, spec, compile_s


@pytest.mark.bpf
def test_second_start_loads_the_cached_programs(cache):
    d, spec, compile_s = cache
    [entry] = d.glob("*.json")
    assert entry.stat().st_mode & 0o777 == 0o600
    t0 = time.monotonic()
    p = BpfProbes(ProbeConfig(cache_dir=d, live_max=4096, ringbuf_bytes=1 << 20, weight_table=WEIGHTS))
    load_s = time.monotonic() - t0
    try:
        assert not p.compiled
        assert p.bpf.spec == spec
        print(f"\n[bpf cache] compile and load {compile_s:.1f} s, cached load {load_s:.1f} s; "
              f"{len(spec.progs)} programs, {len(spec.maps)} maps, {entry.stat().st_size >> 10} KiB")
        # every map load of every program points at one of the object's maps
        names = {m.name for m in spec.maps}
        assert all(name in names for prog in spec.progs for _, name in prog.relocs)
        assert sum(len(prog.relocs) for prog in spec.progs) > 100
        # sizes are given at load, not compiled in
        info = {m.name: m for m in spec.maps}
        assert info["live"].max_entries == ProbeConfig().live_max
        assert _max_entries(p.bpf["live"].fd) == 4096
        assert _max_entries(p.bpf["events"].fd) == 1 << 20
        # the maps work: hash get/set/delete/iterate, per-CPU values, KeyError when absent
        tab = p.bpf["targets"]
        p.add_target(4242)
        p.set_sample_shift(4242, 3)
        assert tab[ctypes.c_uint32(4242)].shift == 3
        assert [k.value for k in tab] == [4242]
        assert [v.shift for v in p.bpf["pid_hits"][ctypes.c_uint32(4242)]] == [3] * len(
            p.bpf["pid_hits"].Leaf())
        del tab[ctypes.c_uint32(4242)]
        with pytest.raises(KeyError):
            tab[ctypes.c_uint32(4242)]
        with pytest.raises(KeyError):
            del tab[ctypes.c_uint32(4242)]
        assert p.bpf["weight_tab"][ctypes.c_int(0)].value > 0
    finally:
        p.close()


@pytest.mark.bpf
def test_loaded_programs_run(cache):
    """Programs loaded from the cache run and report through the ring buffer: the sched
    tracepoint sees this process fork a child, the syscall tracepoints its mmap."""
    d, _, _ = cache
    p = BpfProbes(ProbeConfig(cache_dir=d, weight_table=WEIGHTS))
    try:
        seen: list[events.Event] = []
        p.open_events(lambda raw: seen.append(events.decode(raw)))
        p.add_target(os.getpid())
        child = subprocess.Popen(["true"])
        child.wait()
        m = mmap.mmap(-1, 1 << 20)
        m.close()

        def got(type_, op, **match) -> bool:
            return any(e.type == type_ and e.op == op and all(getattr(e, k) == v for k, v in match.items())
                       for e in seen)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not (got(abi.EvType.PROC, abi.ProcOp.FORK, addr=child.pid)
                                                   and got(abi.EvType.VM, abi.VmOp.MMAP, size=1 << 20)):
            p.poll(100)
        assert got(abi.EvType.PROC, abi.ProcOp.FORK, pid=os.getpid(), addr=child.pid), seen[:5]
        assert got(abi.EvType.VM, abi.VmOp.MMAP, pid=os.getpid(), size=1 << 20), seen[:5]
    finally:
        p.close()


@pytest.mark.bpf
def test_damaged_entry_is_compiled_again(cache, tmp_path):
    d, spec, _ = cache
    [entry] = d.glob("*.json")
    damaged = tmp_path / entry.name
    damaged.write_text(entry.read_text()[:1000])     # cut short, as by a crash
    os.chmod(damaged, 0o600)                         # private: refused for its content only
    with pytest.raises(ValueError):
        objcache.ObjectSpec.from_json(damaged.read_text())
    text, flags = program_source(ProbeConfig())
    got, compiled = objcache.build(text, flags, tmp_path)
    assert compiled and got == spec         # the compiler is deterministic, map fds are not stored
    assert objcache.ObjectSpec.from_json((tmp_path / entry.name).read_text()) == got
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.bpf
def test_entries_others_can_write_are_not_loaded(cache, tmp_path, monkeypatch):
    """Cached programs run in the kernel: an entry (or a cache directory) that another user
    could have written is compiled again instead of loaded, and nothing is stored there."""
    d, spec, _ = cache
    [entry] = d.glob("*.json")
    text, flags = program_source(ProbeConfig())
    compiles = []
    monkeypatch.setattr(objcache, "compile_spec", lambda *a: compiles.append(a) or spec)
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    (good / entry.name).write_text(entry.read_text())
    os.chmod(good / entry.name, 0o600)
    assert objcache.build(text, flags, good) == (spec, False)
    os.chmod(good / entry.name, 0o666)
    assert objcache.build(text, flags, good) == (spec, True) and len(compiles) == 1
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert objcache.build(text, flags, shared) == (spec, True) and len(compiles) == 2
    assert not list(shared.iterdir())


@pytest.mark.bpf
def test_a_cached_spec_the_kernel_refuses_is_compiled_again(cache, tmp_path):
    """An entry that loads no more (here: a program without its exit) is dropped and compiled
    once; the recorder starts anyway and the entry is good again."""
    _, spec, _ = cache
    text, flags = program_source(ProbeConfig())
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    objcache._store(d / f"{objcache.cache_key(text, flags)}.json",
                    _broken(spec, "tracepoint__task__task_newtask").to_json())
    p = BpfProbes(ProbeConfig(cache_dir=d, mode="session", weight_table=WEIGHTS))
    try:
        assert p.compiled and p.bpf.spec == spec
    finally:
        p.close()
    assert objcache.build(text, flags, d) == (spec, False)


def _broken(spec: objcache.ObjectSpec, name: str) -> objcache.ObjectSpec:
    """`spec` with program `name` reduced to one instruction (no exit: the verifier refuses it)."""
    return dataclasses.replace(spec, progs=tuple(
        dataclasses.replace(p, insns=bytes([0xb7, 0, 0, 0, 0, 0, 0, 0]), relocs=())
        if p.name == name else p for p in spec.progs))


@pytest.mark.bpf
def test_session_programs_load_at_the_first_uprobe_attach_and_a_refusal_falls_back_to_perf(cache, tmp_path):
    """A recording of injected samplers never loads the uprobe tier's programs; when the kernel
    refuses session mode's at the first attach, that process is probed in perf mode, not lost."""
    _, spec, _ = cache
    text, flags = program_source(ProbeConfig())
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    objcache._store(d / f"{objcache.cache_key(text, flags)}.json", _broken(spec, "alloc_session").to_json())
    p = BpfProbes(ProbeConfig(cache_dir=d, mode="session", weight_table=WEIGHTS))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert not p.compiled and p.session          # the broken program was not loaded at start
        p.add_target(proc.pid)
        libs, _ = find_allocators(proc.pid, ())
        modes, failed = p.attach(proc.pid, libs[0])
        assert not failed and modes and set(modes.values()) == {"perf"}
        assert not p.session
    finally:
        proc.kill()
        proc.wait()
        p.close()


@pytest.mark.bpf
def test_recorders_starting_together_compile_once(cache, tmp_path, monkeypatch):
    _, spec, _ = cache
    text, flags = program_source(ProbeConfig())
    compiles = []

    def slow_compile(*_args):
        compiles.append(1)
        time.sleep(0.5)
        return spec
    monkeypatch.setattr(objcache, "compile_spec", slow_compile)
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda _: objcache.build(text, flags, d), range(3)))
    assert len(compiles) == 1 and sorted(compiled for _, compiled in got) == [False, False, True]
    assert all(s == spec for s, _ in got)


def test_flags_are_part_of_the_key_and_sizes_are_not():
    text, flags = program_source(ProbeConfig())
    base = objcache.cache_key(text, flags)
    assert objcache.cache_key(text, flags) == base
    assert objcache.cache_key(text, [f.replace("524288", "65536") for f in flags]) != base
    assert objcache.cache_key(text + "\n", flags) != base
    assert not any("LIVE_MAX" in f or "RINGBUF" in f for f in flags)


@pytest.mark.bpf
def test_verifier_refusal_names_the_program_and_the_reason(bpf_ready):
    insn = bytes([0xb7, 0, 0, 0, 0, 0, 0, 0])       # r0 = 0, and no exit
    spec = objcache.ObjectSpec("GPL", 0, (), (objcache.ProgSpec("no_exit", insn, ()),))
    obj = objcache.BpfObject(spec)
    try:
        with pytest.raises(OSError, match="loading no_exit: .*(exit|jump)"):
            obj.load_func("no_exit", objcache.PROG_KPROBE)
    finally:
        obj.close()


def test_old_entries_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setattr(objcache, "CACHE_ENTRIES", 3)
    for i in range(5):
        p = tmp_path / f"old{i}.json"
        p.write_text("{}")
        os.utime(p, (1000 + i, 1000 + i))
    objcache._store(tmp_path / "new.json", "{}")
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["new.json", "old3.json", "old4.json"]


def _max_entries(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        return int(next(ln for ln in f if ln.startswith("max_entries:")).split()[1])


def test_uretprobe_offsets_come_from_the_kernels_btf(tmp_path):
    """The members capture_user reads to restore a return address any uretprobe replaced: found
    in this kernel's BTF (then compiled in), absent without BTF (the feature is then off)."""
    want = {"task_struct": ("utask", "no_such_member"), "return_instance": ("stack", "orig_ret_vaddr", "next")}
    off = btf.struct_offsets(want)
    assert set(off) == {("task_struct", "utask"), ("return_instance", "stack"),
                                ("return_instance", "orig_ret_vaddr"), ("return_instance", "next")}
    assert off["return_instance", "stack"] + 8 == off["return_instance", "orig_ret_vaddr"]
    _, cflags = program_source(ProbeConfig(512 << 10))
    assert f"-DRI_TASK_STRUCT_UTASK={off['task_struct', 'utask']}" in cflags
    assert btf.struct_offsets(want, tmp_path / "absent") == {}


LOAD_UNDER_SIGNALS = """
import signal, sys
from pathlib import Path
from sampler.bpf.loader import BpfProbes, ProbeConfig
from sampler.control.weights import weight_table
from sampler.probes.allocators import find_allocators
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
print("ready", flush=True)
p = BpfProbes(ProbeConfig(cache_dir=Path(sys.argv[1]), weight_table=tuple(weight_table())))
p.load_usdt()
p.close()
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
print("loaded", len(got), flush=True)
"""


@pytest.mark.bpf
def test_signals_during_a_load_do_not_abort_it(cache):
    """The verifier gives up with EAGAIN when the loading thread has a signal pending (a child's
    SIGCHLD once aborted a recording): a process loading under a stream of signals it handles
    loads every program, and gets its signals afterwards."""
    child = subprocess.Popen([sys.executable, "-c", LOAD_UNDER_SIGNALS, str(cache[0])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        sent = 0
        while child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGUSR1)
                sent += 1
            time.sleep(0.002)
        out, err = child.communicate()
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert sent > 100 and int(out.split()[-1]) > 0, (sent, out)


@pytest.mark.bpf
def test_records_are_read_in_order_across_the_end_of_the_ring(cache):
    """The ring's data is mapped once (sampler/bpf/ringbuf.py): a record that crosses the end is
    joined from its two pieces. 1,500 munmap records of 16 KiB ring go round it ~8 times; their
    size does not divide the ring's, so some cross its end. Every one arrives, in order, intact."""
    d, _, _ = cache
    page = mmap.PAGESIZE
    p = BpfProbes(ProbeConfig(cache_dir=d, ringbuf_bytes=4 * page, vm_events_per_s=0, weight_table=WEIGHTS))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = 0x7e0000000000           # never mapped here: munmap succeeds and unmaps nothing
    raw: list[bytes] = []
    try:
        p.open_events(lambda b: raw.append(bytes(b)))
        p.add_target(os.getpid())
        for batch in range(15):
            for i in range(100):
                libc.munmap(base + (batch * 100 + i) * page, page)
            p.drain()
        seen = [e.addr for e in map(events.decode, raw) if e.type == abi.EvType.VM and e.op == abi.VmOp.MUNMAP
                and base <= e.addr < base + 1500 * page]
        assert seen == [base + i * page for i in range(1500)]
        assert p.counters()[abi.Counter.LOST_EVENTS] == 0
        ends, pos = 0, 0
        for b in raw:
            nxt = pos + (len(b) + 8 + 7) // 8 * 8
            ends += (pos + 8) // (4 * page) != (pos + 8 + len(b) - 1) // (4 * page)
            pos = nxt
        assert ends > 0
    finally:
        p.close()
