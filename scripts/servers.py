"""Real servers that scripts/bench_servers.py and tests/record/test_servers.py record: PostgreSQL
and Redis from Debian's packages (scripts/setup.sh installs them), each started as nobody in its
own temporary directory, listening only on a unix socket there, and removed when stopped.

    with Postgres(scale=2) as pg:      pg.pid (the postmaster), pg.run("psql", ...), pg.client(...)
    with Redis() as r:                 r.pid, r.cli("info", "memory"), r.client("redis-benchmark", ...)
    with Gunicorn(workers=2) as g:     g.pid (the arbiter), g.workers(), g.get("/leak") -> (worker pid, bytes)
"""

from __future__ import annotations

import http.client
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOBODY = pwd.getpwnam("nobody").pw_uid
WORKLOADS = Path(__file__).resolve().parent.parent / "tests" / "workloads"
PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), None)


def drop_to_nobody() -> None:
    """preexec_fn: the child runs as nobody (uid and gid)."""
    os.setgid(NOBODY)
    os.setuid(NOBODY)


class _Server:
    """A server process run as nobody in a directory of its own."""

    def __init__(self, prefix: str):
        self.dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        os.chown(self.dir, NOBODY, NOBODY)
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _start(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, preexec_fn=drop_to_nobody, cwd="/", stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    def _wait_until(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not start")
            time.sleep(0.1)

    def client(self, argv: list[str], **kw) -> subprocess.Popen:
        """A client run as nobody (text mode)."""
        return subprocess.Popen(argv, preexec_fn=drop_to_nobody, cwd="/", text=True, **kw)

    def stop(self, sig: int = signal.SIGINT) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Postgres(_Server):
    """A cluster with pgbench's tables at `scale`; fsync off (a benchmark of the recorder, not of
    the disk)."""

    def __init__(self, scale: int = 2, max_connections: int = 40):
        if PG_BIN is None:
            raise RuntimeError("PostgreSQL is not installed: run scripts/setup.sh (apt package postgresql)")
        super().__init__("allocsampler-pg-")
        data = self.dir / "data"
        subprocess.run([str(PG_BIN / "initdb"), "-D", str(data), "-U", "nobody", "--auth=trust", "-E", "UTF8"],
                       preexec_fn=drop_to_nobody, cwd="/", check=True, capture_output=True, timeout=120)
        self._start([str(PG_BIN / "postgres"), "-D", str(data), "-k", str(self.dir), "-c", "listen_addresses=",
                     "-c", "shared_buffers=32MB", "-c", f"max_connections={max_connections}", "-c", "fsync=off"])
        self._wait_until(lambda: subprocess.run([str(PG_BIN / "pg_isready"), "-h", str(self.dir), "-q"]).returncode
                         == 0, "PostgreSQL")
        self.run("pgbench", "-i", "-s", str(scale), "-q", "postgres")

    def tool(self, name: str, *args: str, **kw) -> subprocess.Popen:
        """psql, pgbench, ... as nobody against this server."""
        return self.client([str(PG_BIN / name), "-h", str(self.dir), "-U", "nobody", *args], **kw)

    def run(self, name: str, *args: str, timeout: float = 300) -> str:
        p = self.tool(name, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{name} failed: {err.strip()[-300:]}")
        return out


class Redis(_Server):
    """Debian's redis-server (jemalloc), no persistence."""

    def __init__(self):
        super().__init__("allocsampler-redis-")
        self.socket = self.dir / "redis.sock"
        self._start(["redis-server", "--port", "0", "--unixsocket", str(self.socket), "--save", "",
                     "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no"])
        self._wait_until(self.socket.exists, "Redis")

    def cli(self, *args: str) -> str:
        return subprocess.run(["redis-cli", "-s", str(self.socket), *args], capture_output=True, text=True,
                              check=True, timeout=60).stdout

    def tool(self, name: str, *args: str, **kw) -> subprocess.Popen:
        return self.client([name, "-s", str(self.socket), *args], **kw)


class Gunicorn(_Server):
    """gunicorn's pre-fork server (sync workers) serving tests/workloads/wsgi_leak.py on a unix
    socket: GET /leak keeps 64 KiB in the worker that serves it; every answer says which worker
    and what it holds."""

    def __init__(self, workers: int = 2):
        super().__init__("allocsampler-gunicorn-")
        self.socket = self.dir / "app.sock"
        self.n = workers
        self._start([sys.executable, "-m", "gunicorn", "--workers", str(workers), "--bind", f"unix:{self.socket}",
                     "--chdir", str(WORKLOADS), "--worker-tmp-dir", str(self.dir), "wsgi_leak:app"])
        self._wait_until(lambda: self.socket.exists() and len(self.workers()) == workers, "gunicorn")

    def workers(self) -> list[int]:
        """The arbiter's live children."""
        try:
            tasks = Path(f"/proc/{self.pid}/task").iterdir()
            return sorted({int(c) for t in tasks for c in (t / "children").read_text().split()})
        except OSError:
            return []

    def get(self, path: str) -> tuple[int, int]:
        """(the worker that answered, what it holds)."""
        conn = _UnixHTTP(str(self.socket))
        try:
            conn.request("GET", path)
            pid, held = conn.getresponse().read().split()
        finally:
            conn.close()
        return int(pid), int(held)


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)
