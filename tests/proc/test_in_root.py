"""Files of a process in another root (a container) are opened inside that root (security issue
29, docs/security.md "Parsing target files"): a real child chroot()s into a fake container root
built here, whose links try to make root open the host's files through /proc/PID/root."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sampler import files
from sampler.binary import debuginfod, elf
from sampler.binary.elf import ElfImage

HOST = b"host only\n"
INSIDE = b"inside the root\n"
CHILD = "import os, sys; os.chroot(sys.argv[1]); os.chdir('/'); print('ready', flush=True); sys.stdin.read()"


@dataclass(frozen=True)
class Container:
    root: Path       # the child's root, as seen from here
    host: Path       # a host directory, absent from the root but where a test puts a decoy
    proc: str        # /proc/PID/root of the child

    def inside(self, path: str | Path) -> Path:
        """Where the child's absolute `path` lies here."""
        return self.root / str(path).lstrip("/")


@pytest.fixture
def container(tmp_path) -> Iterator[Container]:
    """root/usr/lib/libfoo.so (a regular file) and a host directory holding `secret`; a child
    chroot()ed into root, sleeping until its stdin closes."""
    root, host = tmp_path / "root", tmp_path / "host"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "usr" / "lib" / "libfoo.so").write_bytes(INSIDE)
    host.mkdir()
    (host / "secret").write_bytes(HOST)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        assert os.readlink(f"/proc/{child.pid}/root") == str(root)
        yield Container(root, host, f"/proc/{child.pid}/root")
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def read_untrusted(path: str) -> tuple[bytes, os.stat_result]:
    fd, st = files.open_untrusted(path, 1 << 20)
    try:
        return os.read(fd, 1 << 10), st
    finally:
        os.close(fd)


def test_split_proc_root():
    assert files.split_proc_root("/proc/12/root/usr/lib/x.so") == ("/proc/12/root", "usr/lib/x.so")
    assert files.split_proc_root("/proc/self/root/etc/passwd") == ("/proc/self/root", "etc/passwd")
    for path in ("/proc/12/root", "/proc/12/root/", "/proc/12/map_files/1-2", "/usr/lib/x.so", "/proc/x/root/a"):
        assert files.split_proc_root(path) is None


def test_absolute_link_on_the_way_stays_in_the_root(container):
    # the container's /usr/lib/debug -> <host dir>: a plain open through /proc/PID/root reaches the host's file
    (container.root / "usr" / "lib" / "debug").symlink_to(container.host)
    path = f"{container.proc}/usr/lib/debug/secret"
    with open(path, "rb") as f:
        assert f.read() == HOST                 # what the old open did: the escape is real
    with pytest.raises(FileNotFoundError):      # <host dir> inside the root: not there
        read_untrusted(path)
    decoy = container.inside(container.host / "secret")
    decoy.parent.mkdir(parents=True)
    decoy.write_bytes(INSIDE)
    data, st = read_untrusted(path)             # <host dir> inside the root: its file
    assert data == INSIDE and st.st_ino == decoy.stat().st_ino


def test_dot_dot_cannot_climb_out(container):
    ups = "../" * (len(container.root.parts) + 2)
    rel = str(container.host / "secret").lstrip("/")
    (container.root / "usr" / "lib" / "up").symlink_to(ups.rstrip("/"))     # a relative link out
    for path in (f"{container.proc}/usr/lib/up/{rel}", f"{container.proc}/{ups}{rel}"):
        with open(path, "rb") as f:
            assert f.read() == HOST
        with pytest.raises(FileNotFoundError):  # '..' stops at the child's root
            read_untrusted(path)


def test_links_inside_the_root_are_followed_there(container):
    lib = container.root / "usr" / "lib"
    (container.root / "usr" / "lib64").symlink_to("lib")        # relative
    (container.root / "lib").symlink_to("/usr/lib")            # absolute: the container's /usr/lib
    for path in ("usr/lib/libfoo.so", "usr/lib64/libfoo.so", "lib/libfoo.so", "usr/../lib/libfoo.so"):
        data, st = read_untrusted(f"{container.proc}/{path}")
        assert data == INSIDE and (st.st_dev, st.st_ino) == ((s := (lib / "libfoo.so").stat()).st_dev, s.st_ino)


def test_last_link_fifo_device_and_size_are_refused(container):
    lib = container.root / "usr" / "lib"
    (lib / "libbar.so").symlink_to("libfoo.so")
    os.mkfifo(lib / "fifo.so")
    os.mknod(lib / "null.so", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    (lib / "big.so").write_bytes(b"\0" * 4096)

    def hung(*_: object) -> None:
        raise TimeoutError("a FIFO was waited on")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        for name, match in (("libbar.so", "symbolic link"), ("fifo.so", "not a regular"),
                            ("null.so", "not a regular")):
            with pytest.raises(ValueError, match=match):
                files.open_untrusted(f"{container.proc}/usr/lib/{name}", 1 << 20)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(ValueError, match="over the 1024"):
        files.open_untrusted(f"{container.proc}/usr/lib/big.so", 1024)


def test_debuglink_is_not_steered_to_a_host_file(container, tmp_path, monkeypatch):
    """A container's binary names a debug file (CRC and build-id of a host file: a copy of /bin/true
    and the binary itself), and its /usr/lib/.debug leads to the host's directory of that file."""
    monkeypatch.setattr(elf, "DEBUG_ROOTS", (str(tmp_path / "no-debug"),))
    monkeypatch.delenv(debuginfod.URLS_ENV, raising=False)
    shutil.copy("/bin/true", container.host / "libdemo.debug")
    binary = container.root / "usr" / "lib" / "libdemo.so"
    subprocess.run(["objcopy", "--remove-section=.gnu_debuglink", "--add-gnu-debuglink=libdemo.debug",
                    "/bin/true", str(binary)], check=True, cwd=container.host)
    (container.root / "usr" / "lib" / ".debug").symlink_to(container.host)
    ElfImage.forget()
    img = ElfImage.open(f"{container.proc}/usr/lib/libdemo.so", "/usr/lib/libdemo.so", container.proc)
    assert img.debug_path is None

    # the same file inside the root, where the link leads there: found (the lookup works)
    shutil.copytree(container.host, container.inside(container.host))
    ElfImage.forget()
    img = ElfImage.open(f"{container.proc}/usr/lib/libdemo.so", "/usr/lib/libdemo.so", container.proc)
    assert img.debug_path == f"{container.proc}/usr/lib/.debug/libdemo.debug"
    ElfImage.forget()
