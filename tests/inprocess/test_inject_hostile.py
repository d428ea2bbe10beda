"""Placement against processes that lie (sampler/inprocess/place.c, inject.py; docs/security.md):
real targets started as `nobody` (tests/workloads/hostile.c) answer the helper's remote calls with
forged results, slowly, or with a seccomp policy that would kill them; they exec another image or
give up their pid between placement and the next write; they forge a sampler to be adopted. Root's
files, other images and the targets themselves come through unchanged."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import NOBODY, WORKLOADS, allocsampler_cmd, compile_c, drop_to_nobody

from sampler.inprocess import inject
from sampler.proc.maps import read_maps
from sampler.proc.process import read_stat

SECRET = b"root's own bytes: nobody may read or write them\n"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A directory nobody can reach, with the hostile workload, a victim program and a root 0600
    file (in a 0755 directory: nobody can name it, not open it)."""
    d = Path(tempfile.mkdtemp(prefix="allocsampler-hostile-", dir="/tmp"))
    os.chmod(d, 0o755)
    compile_c(WORKLOADS / "hostile.c", d / "hostile", "-pthread")
    compile_c(_victim_source(d), d / "victim", "-no-pie")
    secret = d / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    code, _ = inject.built()
    shutil.copy(code, d / "sampler.so")
    os.chmod(d / "sampler.so", 0o644)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _victim_source(d: Path) -> Path:
    src = d / "victim.c"
    src.write_text(r"""
#include <stdint.h>
#include <stdio.h>
volatile uint64_t word = 0x1122334455667788ULL;
int main(void) {
    printf("%lx %lx\n", (unsigned long)(uintptr_t)&word, (unsigned long)word);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 2;
    printf("%lx\n", (unsigned long)word);
    return 0;
}
""")
    return src


class Hostile:
    def __init__(self, d: Path, *args: str):
        self.p = subprocess.Popen([str(d / "hostile"), *args], preexec_fn=drop_to_nobody, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd="/")
        self.lines = [self.p.stdout.readline().strip()]
        assert self.lines[-1] in ("ready",) or self.lines[-1].startswith("0x"), self.lines

    @property
    def pid(self) -> int:
        return self.p.pid

    def finish(self) -> str:
        out, _ = self.p.communicate("done\n", timeout=30)
        return out.strip()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def _place(pid: int, env: dict | None = None) -> subprocess.CompletedProcess:
    code, helper = inject.built()
    layout = inject.CodeLayout.of(code)
    return subprocess.run([str(helper), "place", str(pid), str(read_stat(pid).start), str(code),
                           hex(layout.code_span), hex(layout.total_span)], capture_output=True, text=True,
                          timeout=60, env=env)


def _ours(pid: int) -> bool:
    return inject.MEMFD_NAME in Path(f"/proc/{pid}/maps").read_text()


def test_a_forged_memfd_never_makes_root_write_a_file(shared):
    """memfd_create answered (seccomp user notification) with an O_PATH fd of a root 0600 file:
    the helper duplicates the fd instead of reopening it, finds it is no memfd of ours, writes
    nothing, and gives the process back running."""
    before = (shared / "secret").stat()
    h = Hostile(shared, "notify-fd", str(shared / "secret"))
    try:
        r = _place(h.pid)
        assert r.returncode == 1 and "answered memfd_create with fd" in r.stdout, r.stdout
        assert "not placed" in r.stdout
        assert not _ours(h.pid)                     # the anonymous region it made is gone again
        assert h.finish() == "ok 1"                 # its computation never saw us
    finally:
        h.kill()
    after = (shared / "secret").stat()
    assert (shared / "secret").read_bytes() == SECRET
    assert (after.st_size, after.st_mtime_ns, stat.S_IMODE(after.st_mode)) == \
           (before.st_size, before.st_mtime_ns, 0o600)


def test_a_forged_mmap_answer_is_not_used(shared):
    """The anonymous mmap answered with an address of the process's own data: not the region
    asked for, so nothing is written there or mapped over it."""
    h = Hostile(shared, "notify-mmap")
    try:
        r = _place(h.pid)
        assert r.returncode == 1 and "answered mmap with" in r.stdout, r.stdout
        assert not _ours(h.pid)
        assert h.finish() == "ok 1"
    finally:
        h.kill()


def test_a_call_answered_late_is_interrupted_and_the_thread_gets_its_registers(shared):
    """memfd_create answered after 3 s, past the helper's 2 s: the call is interrupted, the region
    already made is unmapped, the thread gets its registers back; the process lives and its
    computation is the uninterrupted one."""
    h = Hostile(shared, "notify-slow")
    try:
        t0 = time.monotonic()
        r = _place(h.pid)
        took = time.monotonic() - t0
        assert r.returncode == 1 and "memfd_create did not return within 2000 ms" in r.stdout, r.stdout
        assert took < 10
        time.sleep(1.5)                             # the supervisor's late answer comes and goes
        assert h.p.poll() is None, f"the target died (exit {h.p.returncode})"
        assert not _ours(h.pid)
        assert h.finish() == "ok 1"
    finally:
        h.kill()


def _helpers_of_ours(*targets: int) -> list[int]:
    """Placement helpers alive on this host at work in one of `targets` (ours: their executable is the
    checkout's; the suite's other worker places into processes of its own meanwhile)."""
    _code, helper = inject.built()
    wanted = {str(t) for t in targets}
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "exe") == str(helper) \
                        and wanted & set((d / "cmdline").read_bytes().decode(errors="replace").split("\0")):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def test_a_vdso_taken_away_mid_placement_gives_the_thread_back_at_once(shared):
    """memfd_create's supervisor unmaps the process's vDSO, where the helper makes its calls: the next
    call would fault there (and, held and resumed, fault again for ever: a helper spinning at half a
    CPU). The helper sees it before the call, gives the thread its registers back and ends; the
    process lives and its computation is the uninterrupted one."""
    h = Hostile(shared, "notify-vdso")
    try:
        t0 = time.monotonic()
        r = _place(h.pid)
        took = time.monotonic() - t0
        assert r.returncode == 1 and "vDSO" in r.stdout, r.stdout
        assert took < 5 and not _helpers_of_ours(h.pid)
        assert h.p.poll() is None, f"the target died (exit {h.p.returncode})"
        assert h.finish() == "ok 1"
    finally:
        h.kill()


def test_a_supervisor_that_never_answers_cannot_keep_the_helper(shared):
    """memfd_create's supervisor receives the call and never answers, the thread in a wait that no
    interrupt ends: the helper cannot get the thread back, and ends at its own bound all the same
    (here 4 s), saying so; nothing of ours runs on. The process lives (its own supervisor holds its
    thread)."""
    h = Hostile(shared, "notify-never")
    try:
        t0 = time.monotonic()
        r = _place(h.pid, env={**os.environ, "ALLOCSAMPLER_PLACE_MAX_MS": "4000"})
        took = time.monotonic() - t0
        assert r.returncode == 1 and "did not come back from a system call" in r.stdout, r.stdout
        assert 3.5 <= took < 8, took
        assert not _helpers_of_ours(h.pid)
        assert h.p.poll() is None, f"the target died (exit {h.p.returncode})"
    finally:
        h.kill()


def test_helpers_are_counted_per_process_and_per_uid(shared):
    """The recorder's side: a process whose helper is still at work gets no new one, nor does a uid
    with MAX_PER_UID of them at work; they end on their own within their bound, never killed."""
    from sampler.inprocess import helper as runs
    stuck = [Hostile(shared, "notify-never") for _ in range(runs.MAX_PER_UID + 1)]
    saved = runs.PLACE_WAIT_S, runs.HELPER_MAX_S
    runs.PLACE_WAIT_S, runs.HELPER_MAX_S = 0.5, 4.0
    try:
        for h in stuck[:runs.MAX_PER_UID]:
            with pytest.raises(inject.Refused, match="still waiting for a thread"):
                inject.inject(h.pid, 65536, 0)
        with pytest.raises(inject.Refused, match="still at work in process"):
            inject.inject(stuck[0].pid, 65536, 0)
        with pytest.raises(inject.Refused, match=f"still at work in processes of uid {NOBODY}"):
            inject.inject(stuck[-1].pid, 65536, 0)
        assert runs.alive() == runs.MAX_PER_UID
        assert runs.wait_all(10) == 0                  # each ended at its bound
        assert not _helpers_of_ours(*(h.pid for h in stuck)) and all(h.p.poll() is None for h in stuck)
    finally:
        runs.PLACE_WAIT_S, runs.HELPER_MAX_S = saved
        for h in stuck:
            h.kill()


def test_runs_on_two_workers_at_once_read_only_their_own_answers():
    """Two placement workers running helpers side by side (two processes recorded together): a run
    that ended while the other worker was starting one is that worker's to read, never reaped
    under it (a race that failed one of two placements with "I/O operation on closed file")."""
    import threading

    from sampler.inprocess import helper as runs
    argv = ["/bin/sh", "-c", 'read x && echo "ok $x"']
    answers: dict[int, list] = {os.getpid(): [], os.getppid(): []}

    def worker(pid: int) -> None:
        for i in range(150):
            try:
                answers[pid].append(runs.run(argv, pid, f"{i}\n"))
            except Exception as e:  # noqa: BLE001 - the test counts what went wrong
                answers[pid].append(e)
    threads = [threading.Thread(target=worker, args=(pid,)) for pid in answers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for got in answers.values():
        assert got == [[f"ok {i}"] for i in range(150)], [x for x in got if not isinstance(x, list)][:3]
    assert runs.alive() == 0


def test_a_recording_of_processes_that_keep_its_helpers_leaves_none_behind(shared, tmp_path, bpf_ready):
    """`record --pid` of both kinds above, as nobody: each falls back to uprobes with the reason, the
    recording ends on time, waiting for its helpers within their bound; none is left running and
    both processes live."""
    spin, block = Hostile(shared, "notify-vdso"), Hostile(shared, "notify-never")
    try:
        t0 = time.monotonic()
        r = subprocess.run(allocsampler_cmd("record", "-q", "-o", str(tmp_path / "rec"), "-d", "3", "--pid",
                                            str(spin.pid), "--pid", str(block.pid)),
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "ALLOCSAMPLER_PLACE_MAX_MS": "3000"})
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert not _helpers_of_ours(spin.pid, block.pid), "a placement helper outlived the recording"
        assert spin.p.poll() is None and block.p.poll() is None
        assert took < 3 + 30, took
        from analysis.dataset import read_table
        tiers = read_table(tmp_path / "rec", "targets")
        tiers = tiers[tiers["event"] == "tier"].groupby("pid")["detail"].first()
        assert tiers[spin.pid].startswith("attach:") and "vDSO" in tiers[spin.pid], tiers.to_dict()
        assert tiers[block.pid].startswith("attach:"), tiers.to_dict()
        assert spin.finish() == "ok 1"
    finally:
        spin.kill()
        block.kill()


@pytest.mark.parametrize("mode", ["kill-memfd", "strict"])
def test_a_seccomp_policy_that_would_kill_it_is_read_first(shared, mode):
    """A filter that kills on memfd_create, and strict mode: placement is refused before any call,
    with the reason (the recorder then falls back to uprobes with it); the process lives."""
    h = Hostile(shared, mode)
    try:
        with pytest.raises(inject.Refused, match="seccomp (filter of .* would kill it on memfd_create|strict mode)"):
            inject.inject(h.pid, 65536, 0)
        assert h.p.poll() is None and not _ours(h.pid)
        assert h.finish() == "ok 1"
    finally:
        h.kill()


def test_check_fd_accepts_only_an_empty_sealable_memfd_of_ours(shared):
    """The check every memfd_create answer goes through, on each kind of fd a process could
    answer with."""
    h = Hostile(shared, "fds", str(shared / "secret"))
    _code, helper = inject.built()
    try:
        said = {}
        for fd in (3, 4, 5, 6):
            r = subprocess.run([str(helper), "check-fd", str(h.pid), str(fd)], capture_output=True, text=True)
            said[fd] = r.stdout.strip()
        assert said[6] == "ok"
        assert said[3].startswith("error pidfd_getfd(3)") or "not open read-write" in said[3], said[3]
        assert "not an empty unlinked file" in said[4], said[4]
        assert "not our memfd" in said[5], said[5]
    finally:
        h.kill()
    assert (shared / "secret").read_bytes() == SECRET


def test_a_forged_sampler_is_not_adopted(shared):
    """A whole copy of the sampler's code in a memfd called allocsampler, with the magic set: this
    host did not place it, so it is refused (its base would steer every later write)."""
    layout = inject.CodeLayout.of(inject.built()[0])
    h = Hostile(shared, "forge", str(shared / "sampler.so"), hex(layout.data))
    try:
        with pytest.raises(inject.Refused, match="did not place"):
            inject.inject(h.pid, 65536, 0)
    finally:
        h.kill()


def test_a_forged_sampler_is_not_taken_for_an_inherited_one(shared):
    """A fork keeps its parent's sampler at the parent's base, in the parent's memfd: a forged one
    is refused whatever parent it claims, unless it is that memfd (another inode is another file),
    and the kernel's ppid (here root's test process) has no placement note to lend it."""
    layout = inject.CodeLayout.of(inject.built()[0])
    h = Hostile(shared, "forge", str(shared / "sampler.so"), hex(layout.data))
    try:
        forged = next(m for m in read_maps(h.pid) if m.path.startswith(inject.MEMFD_NAME) and m.executable)
        for parent in ((forged.start, forged.inode + 1), (forged.start + 0x1000, forged.inode), None):
            with pytest.raises(inject.Refused, match="did not place"):
                inject.inject(h.pid, 65536, 0, parent=parent)
    finally:
        h.kill()


def test_no_write_reaches_the_image_an_exec_brings(shared):
    """Placed and redirected, then the process execs a non-PIE program whose word lies where the
    recorder's planned writes point: set_mean and restore write nothing into it (the memory was
    opened for the old image; the helper finds no sampler of ours in the new one)."""
    h = Hostile(shared, "exec", str(shared / "victim"))
    try:
        inj = inject.inject(h.pid, 65536, 0)
        inj.redirect()
        assert inj.slots
        h.p.stdin.write("exec\n")
        h.p.stdin.flush()
        addr, value = (int(x, 16) for x in h.p.stdout.readline().split())
        # the writes as an attacker would aim them: at the victim's word, expecting what it holds
        for s in inj.slots.values():
            s.addr, s.original = addr, 0x4141414141414141
        inj.slots = {addr: next(iter(inj.slots.values()))}
        with pytest.raises(OSError):
            inj.set_mean(0x4141414141)
        with pytest.raises(inject.StoreFailed, match="not at"):
            inj.store([inject._Write(addr, value, 0x4141414141414141)])
        assert inj.restore() == 0
        out, _ = h.p.communicate("done\n", timeout=30)
        assert int(out.strip(), 16) == value == 0x1122334455667788
    finally:
        h.kill()


def test_a_fork_that_swaps_the_sampler_it_inherited_gets_no_write(shared):
    """A placed process forks; the child (adopted from its parent's injection, nothing read again)
    maps a changed copy of the sampler over the one it inherited: the helper finds the code is not
    ours and writes nothing, the recorder writes nothing into its data either (the code is checked
    before the first write: the child could as well have exec'd), and the parent's own writes still
    work."""
    h = Hostile(shared, "fork-swap")
    try:
        inj = inject.inject(h.pid, 65536, 0)
        inj.redirect()
        assert inj.slots
        h.p.stdin.write("fork\n")
        h.p.stdin.flush()
        pid, addr, value = (int(x, 16) if i else int(x) for i, x in enumerate(h.p.stdout.readline().split()))
        child = inj.forked(pid)
        with pytest.raises(inject.StoreFailed, match="not at"):
            child.store([inject._Write(addr, value, 0x4141414141414141)])
        # nor through its memory: the child's code is checked before root's first write into its data
        with pytest.raises(inject.StoreFailed, match="not at"):
            child.set_mean(0x4141414141)
        assert child.restore() == 0
        slots = len(inj.slots)
        assert inj.restore() == slots
        out, _ = h.p.communicate("show\n", timeout=30)
        assert int(out.strip(), 16) == value == 0x1122334455667788
        assert h.p.returncode == 0
    finally:
        h.kill()


def test_no_write_reaches_a_process_that_reused_the_pid(shared):
    """The placed process exits and another (the victim) gets its pid: nothing of the injection
    reaches it."""
    h = Hostile(shared, "exec", "/bin/true")
    inj = inject.inject(h.pid, 65536, 0)
    inj.redirect()
    pid = h.pid
    h.kill()
    victim = None
    for _ in range(20):                         # the next pid handed out is the old one
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen([str(shared / "victim")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if p.pid == pid:
            victim = p
            break
        p.kill()
        p.wait()
    assert victim is not None, "could not get the pid back"
    try:
        addr, value = (int(x, 16) for x in victim.stdout.readline().split())
        with pytest.raises(OSError):
            inj.set_mean(0x4141414141)
        with pytest.raises(inject.StoreFailed, match="another process"):
            inj.store([inject._Write(addr, value, 0x4141414141414141)])
        assert inj.restore() == 0
        out, _ = victim.communicate("done\n", timeout=30)
        assert int(out.strip(), 16) == value
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()


def _many_layouts_source(d: Path, n: int) -> Path:
    """A program with `n` otel_memory:alloc sites whose third argument is a different constant each
    (a distinct argument layout per site), all reached once a line arrives."""
    sites = "\n".join(f"__attribute__((noinline)) void s{i}(unsigned long p) {{ STAP_PROBE3(otel_memory, alloc, p, "
                      f"64, {i + 1}); }}" for i in range(n))
    calls = "\n".join(f"    s{i}((unsigned long)buf);" for i in range(n))
    src = d / "layouts.c"
    src.write_text(f"""
#include <stdio.h>
#include <sys/sdt.h>
static char buf[64];
{sites}
__attribute__((noinline)) void released(void) {{ unsigned long p = 0; STAP_PROBE1(otel_memory, free, p); }}
int main(void) {{
    char line[8];
    printf("ready\\n"); fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {{
{calls}
        released();
    }}
    return 0;
}}
""")
    return src


@pytest.mark.bpf
def test_a_file_with_a_thousand_argument_layouts_crowds_out_no_one(tmp_path, workload, record):
    """A process whose memory probes have 1,100 distinct argument layouts (over the 1,024 slots the
    BPF side has) is refused its probes with the reason, and an inject-tier target recorded beside
    it still gets its allocation data (the samplers' own layouts are reserved at load)."""
    from conftest import final_by_site
    exe = compile_c(_many_layouts_source(tmp_path, 1100), tmp_path / "layouts")
    greedy = subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert greedy.stdout.readline().strip() == "ready"
        w = workload()
        rec = record("--pid", str(greedy.pid), "--pid", str(w.pid), "-i", "1", "--sample-bytes", "64K")
        rec.wait_attached(pid=w.pid)
        greedy.stdin.write("go\n")
        greedy.stdin.flush()
        w.call("leak_malloc", 4096, 4096)
        time.sleep(1.5)
        code, _, err = rec.stop()
        assert code == 0, err
    finally:
        greedy.kill()
        greedy.wait()
    from analysis.dataset import read_table
    targets = read_table(rec.out, "targets")
    said = targets[targets["pid"] == greedy.pid]["detail"].astype(str)
    assert said.str.contains("distinct argument layouts in the memory probes of").any(), list(said)
    tiers = read_table(rec.out, "processes")
    assert set(tiers[tiers["pid"] == w.pid]["tier"]) == {"inject"}
    df = final_by_site(rec.out, w.pid)
    est = df[df["site_fn"] == "leak_malloc"]["outstanding_bytes"].sum()
    assert est > 0.5 * 4096 * 4096, est
