"""Checks that the machine can record, each failing with the cause and the fix in one line."""

from __future__ import annotations

import errno
import importlib.util
import os
import platform
from pathlib import Path

from sampler.bpf import syscall as sc
from sampler.bpf import tracefs
from sampler.errors import EnvironmentProblem

_BPF_MAP_TYPE_ARRAY = 2


def check_root() -> None:
    if os.geteuid() != 0:
        raise EnvironmentProblem("must run as root: loading BPF programs and reading other processes' "
                                 "memory maps needs it; run with sudo")


def check_bcc() -> None:
    # found, not imported: importing bcc loads libbcc and LLVM, which only a compile needs
    if importlib.util.find_spec("bcc") is None:
        raise EnvironmentProblem(
            "bcc is not importable from this Python: install python3-bpfcc, and run allocsampler from an "
            "environment that sees the system's packages (the Debian package's, a venv made with "
            "--system-site-packages, or a checkout's from scripts/setup.sh)")


def check_headers() -> None:
    rel = platform.release()
    build = Path("/lib/modules", rel, "build")
    if (build / "include").is_dir() or Path("/sys/kernel/kheaders.tar.xz").exists() \
            or os.environ.get("BCC_KERNEL_SOURCE"):
        return
    raise EnvironmentProblem(f"no kernel headers at {build}: {headers_fix()}")


def headers_fix() -> str:
    return (f"install linux-headers-{platform.release()}, or where the running kernel has no such package run "
            "kernel-headers.sh (/usr/lib/allocsampler/ with the Debian package, scripts/ in a checkout): it "
            "unpacks and links the nearest available ones")


def check_bpf() -> None:
    """Create and close a one-entry BPF array: proves the syscall exists and is permitted."""
    try:
        os.close(sc.bpf(sc.MAP_CREATE, sc.MapCreateAttr(map_type=_BPF_MAP_TYPE_ARRAY, key_size=4, value_size=4,
                                                        max_entries=1)))
        return
    except OSError as e:
        err = e.errno
    if err == errno.ENOSYS:
        raise EnvironmentProblem("this kernel has no BPF support (bpf() returned ENOSYS): "
                                 "use a kernel built with CONFIG_BPF_SYSCALL")
    if err == errno.EPERM:
        raise EnvironmentProblem("BPF is not permitted (bpf() returned EPERM): run as root with "
                                 "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN); in a container add "
                                 "those capabilities")
    raise EnvironmentProblem(f"BPF is unavailable: bpf() failed with {os.strerror(err)}")


def check_tracefs() -> None:
    if tracefs.root() is not None:
        return
    raise EnvironmentProblem("tracefs is not mounted (needed for tracepoints and uprobes): "
                             "mount -t tracefs tracefs /sys/kernel/tracing")


def check_all() -> None:
    check_root()
    check_bpf()
    check_bcc()
    check_headers()
    check_tracefs()
