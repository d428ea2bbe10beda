"""Bad input and bad environments: one clear line naming cause and fix, the documented exit
code, and no traceback. Everything here runs the real CLI in a real (restricted) environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import WORKLOADS, allocsampler_cmd, compile_c

pytestmark = pytest.mark.bpf


def run(args: list[str], prefix: list[str] = (), **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *allocsampler_cmd(*args)], capture_output=True, text=True,
                          timeout=120, cwd="/", **kw)


def assert_clean_error(p: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("allocsampler: error:")]
    assert len(lines) == 1, p.stderr
    for w in words:
        assert w in lines[0], lines[0]


def free_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(pid_max - 1, 1, -1):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free pid")


def test_not_root(tmp_path):
    # nobody, allowed to read the checkout wherever it lives (CAP_DAC_READ_SEARCH), nothing more
    p = run(["record", "--pid", "1", "-o", str(tmp_path)],
            prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                    "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"])
    assert_clean_error(p, 3, "must run as root", "sudo")


def test_no_bpf_permission(tmp_path):
    # root without capabilities, as in a container that lacks CAP_BPF/CAP_SYS_ADMIN
    p = run(["record", "--pid", str(os.getpid()), "-o", str(tmp_path)],
            prefix=["setpriv", "--bounding-set=-all", "--inh-caps=-all"])
    assert_clean_error(p, 3, "BPF is not permitted", "CAP_BPF")


def test_no_kernel_headers(tmp_path, bpf_ready):
    # hide /lib/modules in a private mount namespace
    cmd = " ".join(allocsampler_cmd("record", "--pid", "1", "-o", str(tmp_path)))
    p = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none /lib/modules && exec {cmd}"],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert_clean_error(p, 3, "no kernel headers", "linux-headers", "kernel-headers.sh")


def test_no_such_pid(tmp_path, bpf_ready):
    assert_clean_error(run(["record", "--pid", str(free_pid()), "-o", str(tmp_path)]), 2, "no such process")


def test_kernel_thread(tmp_path, bpf_ready):
    assert_clean_error(run(["record", "--pid", "2", "-o", str(tmp_path)]), 2, "kernel thread")


def test_process_already_gone(tmp_path, bpf_ready):
    zombie = subprocess.Popen(["true"])
    try:
        for _ in range(100):
            if Path(f"/proc/{zombie.pid}/stat").read_text().split(")")[1].split()[0] == "Z":
                break
            os.sched_yield()
        assert_clean_error(run(["record", "--pid", str(zombie.pid), "-o", str(tmp_path)]), 3, "exited")
    finally:
        zombie.wait()


def test_static_stripped_binary(tmp_path, bpf_ready):
    exe = compile_c(WORKLOADS / "static_alloc.c", tmp_path / "static_alloc", "-static", "-s")
    target = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        p = run(["record", "--pid", str(target.pid), "-o", str(tmp_path / "out"), "-d", "1"])
        assert_clean_error(p, 3, "no probeable allocator", "--allocator", "--syscalls-only")
        assert target.poll() is None, "the target was harmed"
    finally:
        target.kill()
        target.wait()


def test_check_command(bpf_ready):
    p = run(["check"])
    assert p.returncode == 0 and "can record" in p.stdout, p.stderr


def test_module_entry_point_matches_console_script():
    exe = os.path.join(os.path.dirname(sys.executable), "allocsampler")
    p = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("allocsampler ")
