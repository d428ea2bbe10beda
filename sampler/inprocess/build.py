"""The code that runs inside targets (C): the preload shim, the injected sampler and the helper
that places it, and where each is.

- An installed package carries them prebuilt in `prebuilt/` beside this module: compiled once when
  the wheel was built (setup.py calls `compile_all`), used as they are, never rebuilt and never
  written at run time, so that a host needs no compiler.
- A checkout (no `prebuilt/`) builds each into <repo>/build when missing or older than its
  sources, atomically (a concurrent user sees the old file or the whole new one).

    python -m sampler.inprocess      # where each is, built first in a checkout (scripts/setup.sh)
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sampler.errors import EnvironmentProblem
from sampler.files import UnsafePath

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE.parents[1] / "build"     # <repo>/build
PREBUILT = HERE / "prebuilt"              # an installed package's


@dataclass(frozen=True)
class Artifact:
    what: str                       # for messages: "the preload shim"
    name: str                       # file name in the build directory
    source: str                     # the C file, beside this module
    cflags: tuple[str, ...]
    headers: tuple[str, ...] = ()   # headers it includes from beside it (part of "stale")


# Exported: the interposed functions and the allocsampler_preload_* symbols (-fvisibility=hidden).
# Default -fasynchronous-unwind-tables stays: the recorder unwinds through the shim with CFI.
SHIM = Artifact("the preload shim", "liballocsampler_preload.so", "preload.c",
                ("-O2", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-ftls-model=initial-exec",
                 "-fno-builtin", "-fasynchronous-unwind-tables", "-Wall", "-Wextra",
                 "-Wl,--build-id", "-Wl,-z,now", "-Wl,-z,relro"), ("sampling.h",))
# Freestanding and position-independent with no relocations: its bytes are copied into a memfd
# that the target maps (inject.py), where nothing would apply them.
SAMPLER = Artifact("the injected sampler", "allocsampler-inject.so", "inject.c",
                   ("-O2", "-g", "-ffreestanding", "-fPIC", "-fno-plt", "-fvisibility=hidden",
                    "-fno-stack-protector", "-fno-builtin", "-fasynchronous-unwind-tables", "-fcf-protection=none",
                    "-Wall", "-Wextra", "-nostdlib", "-shared", f"-Wl,-T,{HERE / 'inject.ld'}", "-Wl,--build-id",
                    "-Wl,--eh-frame-hdr", "-Wl,-z,noexecstack", "-Wl,-z,norelro", "-Wl,--hash-style=gnu"),
                   ("sampling.h", "inject_abi.h", "inject.ld"))
PLACE = Artifact("the placement helper", "allocsampler-place", "place.c",
                 ("-O2", "-Wall", "-Wextra", "-Wno-unused-function"), ("inject_abi.h", "sampling.h"))
ARTIFACTS = (SHIM, SAMPLER, PLACE)


def path(a: Artifact) -> Path:
    """Where the artifact is: the installed package's prebuilt file, else (a checkout) built."""
    if PREBUILT.is_dir():
        out = PREBUILT / a.name
        if not out.is_file():
            raise EnvironmentProblem(f"{out} ({a.what}) is missing from the installed allocsampler: reinstall it")
        _check_trusted(a, out)
        return out
    return build(a)


def compile_all(out_dir: Path) -> list[Path]:
    """Every artifact compiled into `out_dir` (building a wheel: setup.py)."""
    outs = []
    for a in ARTIFACTS:
        out = out_dir / a.name
        _compile(a, HERE / a.source, out)
        outs.append(out)
    return outs


def compiler() -> str:
    for name in ("cc", "gcc"):
        path = shutil.which(name)
        if path:
            return path
    raise EnvironmentProblem("no C compiler to build allocsampler's in-process code: apt install gcc, "
                             "or run scripts/setup.sh")


def build(a: Artifact, source_dir: Path = HERE, build_dir: Path = BUILD_DIR) -> Path:
    """The artifact's path, compiled first when missing or older than its sources."""
    out = build_dir / a.name
    sources = [source_dir / a.source, *(source_dir / h for h in a.headers)]
    try:
        fresh = out.stat().st_mtime >= max(s.stat().st_mtime for s in sources)
    except FileNotFoundError:
        fresh = False
    if not fresh:
        _compile(a, sources[0], out)
    _check_trusted(a, out)
    return out


def _check_trusted(a: Artifact, out: Path) -> None:
    """Root runs the placement helper and puts the other two into processes of every user: the
    directory and file must be changeable only by root, by us, or by whoever owns allocsampler's
    own code (who could change the recorder itself anyway); never by anyone else."""
    trusted = {0, os.geteuid(), HERE.stat().st_uid}
    for path, kind in ((out.parent, stat.S_ISDIR), (out, stat.S_ISREG)):
        st = os.lstat(path)
        why = ("is not a " + ("directory" if kind is stat.S_ISDIR else "regular file")) if not kind(st.st_mode) \
            else f"belongs to uid {st.st_uid}" if st.st_uid not in trusted \
            else f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})" if st.st_mode & 0o022 \
            else ""
        if why:
            raise UnsafePath(f"{path} ({a.what}) {why}: root would run it in other processes; make it root's "
                             f"and not group- or world-writable (chown root; chmod go-w), or rebuild it with "
                             f"scripts/setup.sh")


def _compile(a: Artifact, source: Path, out: Path) -> None:
    cc = compiler()
    try:
        out.parent.mkdir(parents=True, exist_ok=True, mode=0o755)     # not group-writable whatever the umask
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{a.name}.", suffix=".tmp")
    except OSError as e:
        raise EnvironmentProblem(f"cannot write {a.what} into {out.parent} ({e.strerror}): make it writable, "
                                 "or run scripts/setup.sh as its owner") from e
    os.close(fd)
    try:
        r = subprocess.run([cc, *a.cflags, "-o", tmp, str(source)], capture_output=True, text=True)
        if r.returncode != 0:
            err = r.stderr
            if "sys/sdt.h" in err:
                raise EnvironmentProblem(f"<sys/sdt.h> is missing to build {a.what}: apt install "
                                         "systemtap-sdt-dev, or run scripts/setup.sh")
            first = next((ln for ln in err.splitlines() if "error" in ln), err.strip()[:200])
            raise EnvironmentProblem(f"building {a.what} with {cc} failed ({first.strip()}): install gcc and "
                                     "libc6-dev, or run scripts/setup.sh")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

