"""Which build of which program a process runs: the `targets` columns exe_build_id, exe_package and
exe_version, so that versions of a service can be compared across a fleet.

- The build-id is read from the executable the process has mapped (/proc/PID/map_files, the
  inode itself: a replaced or deleted file, a container's file), under the untrusted-file policy
  (sampler.files.open_untrusted through sampler.binary.elf).
- The package comes from dpkg's database (Debian, Ubuntu): the `info/*.list` file that lists
  the path, and the version from `status`. Only when the host's file at that path is the very
  inode the process runs: a container's /usr/bin/python or a file replaced since installation is
  no package's. Other distributions, a virtualenv's copy of an interpreter or a build of your
  own: null.

Everything is cached per executable inode (bounded), and the dpkg lists are read once per
lookup of a new path (about 10-20 ms for 750 packages, a few MB of lists) and cached per path
until dpkg's database changes, so that attaching to the 100th copy of a worker costs nothing.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from sampler import files

DPKG_DIR = "/var/lib/dpkg"
MAX_CACHED = 1024               # executables (inodes) and paths remembered
MAX_LIST_BYTES = 64 << 20       # one package's file list; larger is not dpkg's
MAX_STATUS_BYTES = 256 << 20
MAX_EXE_BYTES = 4 << 30         # a larger executable is not read for its build-id


@dataclass(frozen=True)
class ExeIdentity:
    build_id: str | None = None
    package: str | None = None
    version: str | None = None

    def columns(self) -> dict[str, str | None]:
        return {"exe_build_id": self.build_id, "exe_package": self.package, "exe_version": self.version}


def _remember(cache: OrderedDict, key: object, value: object) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)


class DpkgDatabase:
    """path -> (package, version) from dpkg's lists and status file, cached until they change."""

    def __init__(self, root: str = DPKG_DIR):
        self.root = Path(root)
        self._stamp: tuple | None = None
        self._owners: OrderedDict[str, tuple[str, str | None] | None] = OrderedDict()
        self._versions: dict[str, str] | None = None

    def _changed(self) -> None:
        try:
            stamp = tuple((st.st_mtime_ns, st.st_size) for st in
                          (os.stat(self.root / "info"), os.stat(self.root / "status")))
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._stamp, self._versions = stamp, None
            self._owners.clear()

    def owner(self, path: str) -> tuple[str, str | None] | None:
        """(package, version) of the package whose file list has `path`, or None. /usr-merged
        systems list some files under /bin, /sbin, /lib: the other spelling is tried too."""
        self._changed()
        if self._stamp is None:
            return None
        if path in self._owners:
            self._owners.move_to_end(path)
            return self._owners[path]
        spellings = [path]
        if path.startswith("/usr/") and path.count("/") > 2:
            spellings.append(path[4:])
        elif path.count("/") > 1:
            spellings.append("/usr" + path)
        found = self._search([s.encode() for s in spellings])
        result = None
        if found is not None:
            result = (found.split(":", 1)[0], self.version(found))
        _remember(self._owners, path, result)
        return result

    def _search(self, paths: list[bytes]) -> str | None:
        """The package (`name` or `name:arch`) whose info/<package>.list has one of `paths`."""
        needles = [b"\n" + p + b"\n" for p in paths]
        try:
            entries = sorted(os.scandir(self.root / "info"), key=lambda e: e.name)
        except OSError:
            return None
        for e in entries:
            if not e.name.endswith(".list"):
                continue
            try:
                with open(e.path, "rb") as f:
                    text = b"\n" + f.read(MAX_LIST_BYTES)
            except OSError:
                continue
            if any(n in text for n in needles):
                return e.name[: -len(".list")]
        return None

    def version(self, package: str) -> str | None:
        """The installed version of `package` (`name` or `name:arch`)."""
        if self._versions is None:
            self._versions = self._read_status()
        name, _, arch = package.partition(":")
        return self._versions.get(f"{name}:{arch}" if arch else name) or self._versions.get(name)

    def _read_status(self) -> dict[str, str]:
        out: dict[str, str] = {}
        try:
            with open(self.root / "status", "rb") as f:
                text = f.read(MAX_STATUS_BYTES).decode("utf-8", "replace")
        except OSError:
            return out
        for stanza in text.split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if line and not line[0].isspace():
                    k, _, v = line.partition(":")
                    fields[k] = v.strip()
            name, version = fields.get("Package"), fields.get("Version")
            if not name or not version or not fields.get("Status", "").endswith(" installed"):
                continue
            out.setdefault(name, version)
            if arch := fields.get("Architecture"):
                out[f"{name}:{arch}"] = version
        return out


class ExeIdentities:
    """The identity of processes' executables, cached per inode."""

    def __init__(self, dpkg: DpkgDatabase | None = None):
        self.dpkg = dpkg or DpkgDatabase()
        self._by_inode: OrderedDict[tuple, ExeIdentity] = OrderedDict()

    def of(self, pid: int, exe: str) -> ExeIdentity:
        """The identity of what `pid` runs (`exe`: its /proc/PID/exe path); empty when the
        process is gone or nothing can be read."""
        try:
            st = os.stat(f"/proc/{pid}/exe")        # the inode it runs, in whatever namespace
        except OSError:
            return ExeIdentity()
        key = (*files.identity(st), exe)
        if (known := self._by_inode.get(key)) is not None:
            return known
        package = None
        try:
            host = os.stat(exe) if exe.startswith("/") else None
            if host is not None and (host.st_dev, host.st_ino) == (st.st_dev, st.st_ino):
                package = self.dpkg.owner(exe)
        except (OSError, ValueError):
            package = None
        ident = ExeIdentity(_build_id(pid, st), *(package or (None, None)))
        _remember(self._by_inode, key, ident)
        return ident


def _build_id(pid: int, st: os.stat_result) -> str | None:
    from sampler.binary.elf import open_untrusted
    from sampler.binary.reader import MALFORMED
    from sampler.proc.maps import open_path, read_maps

    try:
        maps = read_maps(pid)
    except ProcessLookupError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    m = next((m for m in maps if m.inode == st.st_ino and m.offset == 0 and m.dev == dev), None)
    m = m or next((m for m in maps if m.inode == st.st_ino and m.offset == 0), None)
    if m is None:
        return None
    try:
        return open_untrusted(open_path(pid, m), MAX_EXE_BYTES).build_id()
    except (OSError, *MALFORMED):        # what a malformed file makes the parser raise (ElfFormatError...)
        return None
