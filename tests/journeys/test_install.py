"""The README's installs, away from the checkout: the wheel that `python -m build` makes (from its
sdist) in a fresh virtual environment as the README's line makes it, and the Debian package that
scripts/build-deb.sh makes from that wheel, through apt. Each records a leaking process from `/`
with no compiler on PATH, and writes nothing into its install tree; the package upgrades with its
config kept and purges with nothing left but the recorded data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, WORKLOADS, compile_c
from journey import README, RECORD_CMD, assert_both_leaks, inject_delay, run_readme, truth_line

SYSTEM_PY = "/usr/bin/python3"        # the interpreter that sees Debian's bcc (python3-bpfcc)
PREBUILT = ("liballocsampler_preload.so", "allocsampler-inject.so", "allocsampler-place")
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "tcc", "x86_64-linux-gnu-gcc")
DEB_PATHS = ("/opt/allocsampler", "/usr/bin/allocsampler", "/lib/systemd/system/allocsampler.service",
             "/etc/allocsampler", "/usr/lib/allocsampler", "/usr/share/doc/allocsampler",
             "/var/cache/allocsampler", "/run/allocsampler")

# serial: the .deb's purge removes /run/allocsampler (placement notes, the recorders' leases) and
# /var/cache/allocsampler (compiled BPF), which every recorder of this host shares; they are set
# aside and put back around it, and a recording of the other worker in that window would lose
# what it wrote there (the wheel's journey shares the module's build)
pytestmark = [pytest.mark.bpf, pytest.mark.serial]


def start(cmd, **kw) -> subprocess.Popen:
    """cmd started from / (unless told) without the checkout on its path, as an installed tool
    runs, in a session of its own; what it writes goes to files (nothing blocks while it runs
    unwatched)."""
    kw.setdefault("cwd", "/")
    kw.setdefault("env", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    outputs = tempfile.TemporaryFile(), tempfile.TemporaryFile()    # noqa: SIM115 - closed by finish()
    p = subprocess.Popen([str(c) for c in cmd], stdout=outputs[0], stderr=outputs[1], start_new_session=True, **kw)
    p.outputs = outputs
    return p


def stop(p: subprocess.Popen) -> None:
    """A command of start(), its children included, ended if it still runs."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    """What a command of start() wrote; it must exit 0 within timeout."""
    try:
        p.wait(timeout)
    finally:
        stop(p)
    out, err = [(f.seek(0), f.read().decode(errors="replace"), f.close())[1] for f in p.outputs]
    assert p.returncode == 0, f"{p.args} exited {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    """cmd run as start() runs it, to its end."""
    timeout = kw.pop("timeout", 300)
    return finish(start(cmd, **kw), timeout)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel) as `python -m build` makes them: the wheel is built from the sdist."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], cwd=ROOT)
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return sdist, wheel


@pytest.fixture(scope="module")
def no_compiler(tmp_path_factory) -> dict[str, str]:
    """An environment whose PATH holds every command of this machine but its C compilers."""
    d = tmp_path_factory.mktemp("path")
    for bindir in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for f in sorted(Path(bindir).glob("*")) if Path(bindir).is_dir() else ():
            name = f.name
            if name.startswith(("gcc", "g++", "clang", "cpp", "x86_64-linux-gnu-")) or name in COMPILERS \
                    or (d / name).exists() or name.startswith("python") and bindir == "/usr/local/bin":
                continue
            (d / name).symlink_to(f)
    assert not any(shutil.which(c, path=str(d)) for c in COMPILERS)
    return {"PATH": str(d), "LANG": "C.UTF-8"}


@pytest.fixture(scope="module")
def steady_leak(tmp_path_factory) -> Path:
    return compile_c(WORKLOADS / "steady_leak.c", tmp_path_factory.mktemp("leak") / "steady_leak")


def tree(*roots: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under roots: (mode, size, mtime_ns)."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                st = os.lstat(os.path.join(dirpath, name))
                out[os.path.join(dirpath, name)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


VENV_LINE = "/usr/bin/python3 -m venv --system-site-packages /opt/as && /opt/as/bin/pip install dist/allocsampler-*.whl"


def test_the_wheel_needs_no_compiler_and_records_a_command_from_the_root(dist, no_compiler, leakext, tmp_path,
                                                                         bpf_ready):
    """The README's wheel install, then `record -- python serve.py` with the installed command, from
    `/`, with no compiler on PATH: the command's image gets the package's prebuilt sampler at its
    exec and both leaks are named at their rates; nothing is written into the install tree."""
    sdist, wheel = dist
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"sampler/inprocess/prebuilt/{n}" for n in PREBUILT} <= names
    assert {"sampler/bpf/programs/abi.h", "sampler/bpf/programs/common.h", "sampler/bpf/programs/alloc.bpf.c"} <= names
    assert not [n for n in names if n.endswith((".c", ".ld")) and n.startswith("sampler/inprocess/")]
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as t:
        members = set(t.getnames())
    assert {f"{top}/bpf/abi.h", f"{top}/sampler/inprocess/inject.c", f"{top}/sampler/inprocess/inject.ld",
            f"{top}/setup.py", f"{top}/packaging/allocsampler.service"} <= members

    venv = tmp_path / "venv"
    assert VENV_LINE in README.read_text()
    run(["bash", "-c", VENV_LINE.replace("/opt/as", str(venv)).replace("dist/allocsampler-*.whl", str(wheel))
         .replace("pip install", "pip install -q --disable-pip-version-check")], timeout=600)
    where = run([venv / "bin" / "python", "-c", "import sampler; print(sampler.__file__)"]).stdout
    site = Path(where.strip()).parents[1]
    assert site.is_relative_to(venv)
    installed = tree(site / "sampler", site / "analysis")
    env = {**no_compiler, "HOME": str(tmp_path), "PYTHONPATH": str(leakext)}
    exe = str(venv / "bin" / "allocsampler")

    # the in-process code is the package's, compiled when the wheel was built
    r = run([venv / "bin" / "python", "-m", "sampler.inprocess"], env=env)
    assert r.stdout.split() == [str(site / "sampler" / "inprocess" / "prebuilt" / n) for n in PREBUILT]
    assert run_readme("allocsampler check", exe=exe, env=env).stdout.startswith("allocsampler: this machine can record")

    out = tmp_path / "prof"
    rec = run_readme(RECORD_CMD, {"/var/tmp/prof": str(out), "python": SYSTEM_PY,
                                  "serve.py": [WORKLOADS / "serve.py", "--seconds", "12"]}, exe=exe, env=env)
    pid = int(pd.read_parquet(out / "processes")["pid"].iloc[0])
    assert inject_delay(out, pid) <= 1.0, pd.read_parquet(out / "targets")[["event", "detail"]]
    assert_both_leaks(out, truth_line(rec.stderr), exe, env)

    # nothing was compiled, written or rebuilt inside the installed package
    assert tree(site / "sampler", site / "analysis") == installed
    assert not (site / "build").exists()


REVISIONS = ("0~journey1", "0~journey2")      # this test's own builds, told apart from an admin's


def _dpkg_status() -> list[str]:
    """dpkg's status words and version for allocsampler ([] when dpkg knows no such package)."""
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", "allocsampler"], capture_output=True,
                       text=True)
    return r.stdout.split() if r.returncode == 0 else []


def _installed_version() -> str | None:
    status = _dpkg_status()
    return status[-1] if status[:3] == ["install", "ok", "installed"] else None


def _purge_leftover() -> None:
    """A package this test left behind (a run killed between install and purge), or dpkg's record of
    one not fully installed, is purged; an installed package of anyone else's stops the test."""
    status = _dpkg_status()
    if not status:
        return
    ours = status[-1].removeprefix("0.1.0-") in REVISIONS
    if status[:3] == ["install", "ok", "installed"] and not ours:
        pytest.fail(f"allocsampler {status[-1]} is installed on this machine: this test installs and purges its "
                    "own; apt-get purge allocsampler first")
    subprocess.run(["apt-get", "-y", "-q", "purge", "allocsampler"], capture_output=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    assert not _dpkg_status() or _installed_version() is None, _dpkg_status()


def apt(*args: str | Path) -> subprocess.CompletedProcess:
    # unsafe-io: dpkg does not fsync each of the package's files (what only a crash mid-install
    # would need: the upgrade took 26 s with the fsyncs, 9 s without, on the development machine)
    return run(["apt-get", "-y", "-q", "-o", "Dpkg::Options::=--force-unsafe-io", *args],
               env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=300)


def build_deb(wheel: Path, revision: str, out: Path) -> subprocess.Popen:
    # as a builder with Ubuntu's default umask (group-writable files) builds it
    return start(["bash", "-c", 'umask 0002 && exec bash "$0" "$@"', ROOT / "scripts" / "build-deb.sh", "--wheel",
                  wheel, "--revision", revision, "--out", out, "--compress", "gzip", "--python", sys.executable])


def built_deb(build: subprocess.Popen, revision: str) -> Path:
    deb = Path(finish(build).stdout.strip().splitlines()[-1])
    assert deb.name == f"allocsampler_0.1.0-{revision}_amd64.deb"
    return deb


def test_the_deb_installs_records_upgrades_keeping_its_config_and_purges_clean(dist, no_compiler, steady_leak,
                                                                              tmp_path, bpf_ready):
    _purge_leftover()
    first, second = REVISIONS
    _, wheel = dist
    debs = {first: built_deb(build_deb(wheel, first, tmp_path), first)}
    fields = run(["dpkg-deb", "-f", debs[first], "Depends", "Architecture"]).stdout
    assert "python3-bpfcc" in fields and "Architecture: amd64" in fields
    # no file or directory of it writable by its group or others, whatever the builder's umask
    modes = [ln.split()[0] for ln in run(["dpkg-deb", "--contents", debs[first]]).stdout.splitlines()]
    assert modes and not [m for m in modes if not m.startswith("l") and "w" in m[4:]], sorted(set(modes))

    # what the purge removes is shared with checkouts on this machine: set aside, put back after
    aside = {p: tmp_path / "aside" / p.strip("/").replace("/", "_") for p in ("/var/cache/allocsampler",
                                                                              "/run/allocsampler")}
    data_dir = Path("/var/lib/allocsampler")
    made_data_dir = not data_dir.exists()
    upgrade = build_deb(wheel, second, tmp_path)      # built while the first is installed and records
    try:
        apt("install", debs[first])
        assert _installed_version() == f"0.1.0-{first}"
        assert run(["/usr/bin/allocsampler", "--version"], env=no_compiler).stdout.strip() \
            == "allocsampler 0.1.0"
        assert Path("/lib/systemd/system/allocsampler.service").is_file()
        assert not Path("/etc/systemd/system/multi-user.target.wants/allocsampler.service").exists()   # not enabled
        shim = Path(run(["/usr/bin/allocsampler", "preload-path"], env=no_compiler).stdout.strip())
        assert shim == Path("/usr/lib/allocsampler/liballocsampler_preload.so").resolve()
        assert shim.is_relative_to("/opt/allocsampler")

        # the preload tier through the package's shim, and the dataset read by the package's own tools
        rec = tmp_path / "rec"
        run(["/usr/bin/allocsampler", "record", "--preload", "--sample-bytes", "64K", "--out", rec, "--duration",
             "6", "--", steady_leak], env=no_compiler)
        top = run(["/usr/bin/allocsampler", "top", rec], env=no_compiler).stdout
        first = next(ln for ln in top.splitlines() if ln.strip().startswith("1."))
        assert "leak_site (steady_leak)" in first, top
        # nothing of the package's changed, and nothing was added under its directories
        assert run(["dpkg", "--verify", "allocsampler"]).stdout == ""
        owned = set(run(["dpkg-query", "-L", "allocsampler"]).stdout.split())
        assert set(tree(Path("/opt/allocsampler"))) <= owned

        config = Path("/etc/allocsampler/config.toml")
        edited = config.read_text() + '\n[[targets]]\nname = "steady_leak"\ntier = "attach"\n'
        config.write_text(edited)
        debs[second] = built_deb(upgrade, second)
        apt("install", debs[second])
        assert _installed_version() == f"0.1.0-{second}"
        assert config.read_text() == edited

        for path, kept in aside.items():
            if os.path.lexists(path):
                kept.parent.mkdir(exist_ok=True)
                shutil.move(path, kept)
        Path("/var/cache/allocsampler/bpf").mkdir(parents=True)      # as the package's recorder left it
        data_dir.mkdir(exist_ok=True)
        (data_dir / "test-marker").write_text("the admin's data\n")
        apt("purge", "allocsampler")
        assert _installed_version() is None
        assert [p for p in DEB_PATHS if os.path.lexists(p)] == []
        assert (data_dir / "test-marker").read_text() == "the admin's data\n"
    finally:
        stop(upgrade)
        if _dpkg_status():
            subprocess.run(["apt-get", "-y", "-q", "purge", "allocsampler"], capture_output=True,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        for path, kept in aside.items():
            if kept.exists():
                shutil.rmtree(path, ignore_errors=True)
                shutil.move(kept, path)
        (data_dir / "test-marker").unlink(missing_ok=True)
        if made_data_dir and data_dir.is_dir() and not any(data_dir.iterdir()):
            data_dir.rmdir()
