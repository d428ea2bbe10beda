"""Other local users and hostile names (docs/security.md): private outputs, foreign and linked
paths refused with one line, a dataset lock nobody else can hold, caches only of ours, a full
disk that ends a recording cleanly, and names with control characters escaped in every text
output. Real files, a real unprivileged user (`nobody`), real recordings where it matters."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import NOBODY, allocsampler_cmd, drop_to_nobody, tmpfs_at

from analysis.dataset import read_table
from analysis.export.collapsed import collapsed_lines
from sampler import files
from sampler.dataset import retention
from sampler.dataset.schema import RECORDER
from sampler.dataset.writer import LOCK_FILE, MARKER_FILE, DatasetWriter
from sampler.text import printable


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(allocsampler_cmd(*args), capture_output=True, text=True, timeout=timeout)


def one_line_error(p: subprocess.CompletedProcess, *words: str) -> str:
    assert p.returncode == 3, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("allocsampler: error: ") and all(w in lines[0] for w in words), lines[0]
    return lines[0]


def recorder_rows(n: int = 2) -> list[dict]:
    return [{"ts": pa.scalar(1_700_000_000_000_000 + i, pa.timestamp("us", tz="UTC")).as_py(), "interval_s": 1.0}
            for i in range(n)]


# -- private outputs -------------------------------------------------------------------------------

def test_a_new_dataset_is_private(tmp_path):
    root = tmp_path / "a" / "out"
    w = DatasetWriter(root, "rec")
    path = w.write(RECORDER, recorder_rows())
    for p in (tmp_path / "a", root, path.parent, path.parent.parent):
        assert p.stat().st_mode & 0o777 == 0o700, p
    assert path.stat().st_mode & 0o777 == 0o600
    assert (root / MARKER_FILE).is_file() and (root / LOCK_FILE).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("kind, words", [
    ("foreign", ("belongs to uid", "give a new path")),
    ("group_writable", ("writable by other users", "chmod go-w")),
    ("symlink", ("symbolic link",)),
])
def test_record_refuses_an_unsafe_output_dir_with_one_line(tmp_path, kind, words):
    out = tmp_path / "out"
    if kind == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        out.symlink_to(tmp_path / "real")
    else:
        out.mkdir(mode=0o700)
        if kind == "foreign":
            os.chown(out, NOBODY, NOBODY)
        else:
            os.chmod(out, 0o770)
    one_line_error(run_cli("record", "-o", str(out), "--pid", str(os.getpid()), "-d", "1"), *words)
    assert not list(Path(os.path.realpath(out)).iterdir())      # nothing written


def test_output_under_a_directory_another_user_owns_is_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)      # they could swap `out` for a link after our check
    with pytest.raises(files.UnsafePath, match="belongs to uid"):
        DatasetWriter(home / "out", "rec")


def test_a_linked_or_foreign_table_directory_is_refused(tmp_path):
    root = tmp_path / "out"
    w = DatasetWriter(root, "rec")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / RECORDER.name).symlink_to(elsewhere)
    with pytest.raises(files.UnsafePath, match="symbolic link"):
        w.write(RECORDER, recorder_rows())
    assert not list(elsewhere.iterdir())
    (root / RECORDER.name).unlink()
    (root / RECORDER.name).mkdir()
    os.chown(root / RECORDER.name, NOBODY, NOBODY)
    with pytest.raises(files.UnsafePath, match="owned by uid"):
        w.write(RECORDER, recorder_rows())


def test_recovery_does_not_follow_a_linked_work_area(tmp_path):
    root = tmp_path / "out"
    DatasetWriter(root, "rec").write(RECORDER, recorder_rows())
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "sub" / "precious").write_text("keep")
    (root / retention.STAGING).symlink_to(victim)
    done = retention.recover(root)
    assert (victim / "sub" / "precious").read_text() == "keep", done
    assert not os.path.lexists(root / retention.STAGING)


def test_daemon_refuses_a_data_dir_that_is_not_a_dataset(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('[daemon]\ndata_dir = "/"\n[metrics]\nenabled = false\n[[targets]]\nname = "x"\n')
    line = one_line_error(run_cli("daemon", "--config", str(cfg)), "data_dir = '/'", "no allocsampler dataset")
    assert "new or empty directory" in line
    etc = tmp_path / "etc"              # a directory with someone's files: not chowned, not chmodded
    etc.mkdir()
    (etc / "passwd").write_text("x")
    os.chown(etc / "passwd", NOBODY, NOBODY)
    with pytest.raises(files.UnsafePath, match="no allocsampler dataset"):
        retention.ensure_private(etc)
    assert (etc / "passwd").stat().st_uid == NOBODY
    new = tmp_path / "new"
    retention.ensure_private(new)       # new, or empty: taken, and marked
    assert (new / MARKER_FILE).is_file() and retention.ensure_private(new) == 0


# -- the dataset lock ------------------------------------------------------------------------------

def as_nobody(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=drop_to_nobody, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd="/")


@pytest.fixture
def shared_tmp():
    """A directory other users can reach (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="allocsampler-test-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_another_user_cannot_block_writes_by_locking_the_directory(shared_tmp):
    root = shared_tmp / "out"
    w = DatasetWriter(root, "rec")
    os.chmod(root, 0o755)               # readable by others (they may open it): allowed
    holder = as_nobody(textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({str(root)!r}, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.read()
    """))
    try:
        assert holder.stdout.readline().strip() == "locked"
        done = threading.Event()
        threading.Thread(target=lambda: (w.write(RECORDER, recorder_rows()), done.set()), daemon=True).start()
        assert done.wait(10), "a write waited on another user's lock"
        assert len(read_table(root, RECORDER.name)) == 2
    finally:
        holder.kill()
        holder.wait()


def test_a_foreign_lock_file_is_refused_with_one_line(tmp_path):
    root = tmp_path / "out"
    DatasetWriter(root, "rec")
    os.chown(root / LOCK_FILE, NOBODY, NOBODY)
    with pytest.raises(files.UnsafePath, match="lock file .* remove it"):
        DatasetWriter(root, "rec2").write(RECORDER, recorder_rows())
    os.unlink(root / LOCK_FILE)
    os.symlink(tmp_path / "target", root / LOCK_FILE)
    with pytest.raises(OSError):        # O_NOFOLLOW: never created through the link
        DatasetWriter(root, "rec3").write(RECORDER, recorder_rows())
    assert not (tmp_path / "target").exists()
    os.unlink(root / LOCK_FILE)
    DatasetWriter(root, "rec4").write(RECORDER, recorder_rows())     # ours again: created 0600
    assert (root / LOCK_FILE).stat().st_mode & 0o777 == 0o600


# -- caches ----------------------------------------------------------------------------------------

def test_caches_trust_only_our_own_files(tmp_path, monkeypatch):
    cache = files.cache_dir("probe-cost", str(tmp_path / "cache"))
    assert cache is not None and cache.stat().st_mode & 0o777 == 0o700
    planted = cache / "calibration.json"
    planted.write_text('{"x": 0}')      # a planted calibration could switch the governor off
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(ValueError, match="not ours alone"):
        files.read_private(planted, 1 << 20)
    os.chown(planted, 0, 0)
    os.chmod(planted, 0o666)
    with pytest.raises(ValueError, match="not ours alone"):
        files.read_private(planted, 1 << 20)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, NOBODY, NOBODY)
    monkeypatch.setenv("ALLOCSAMPLER_CACHE_DIR", str(foreign))
    assert files.cache_dir("unwind") is None        # nothing is cached in another user's tree


# -- reports and exports ---------------------------------------------------------------------------

def test_reports_and_exports_are_private_and_refuse_links(leaky, tmp_path):
    html, col, pb = tmp_path / "r.html", tmp_path / "c.txt", tmp_path / "p.pb.gz"
    p = run_cli("report", str(leaky.out), "--html", str(html))
    assert p.returncode == 0, p.stderr
    p = run_cli("export", str(leaky.out), "--collapsed", str(col), "--pprof", str(pb))
    assert p.returncode == 0, p.stderr
    for f in (html, col, pb):
        assert f.stat().st_mode & 0o777 == 0o600, f
    secret = tmp_path / "secret"
    secret.write_text("root's")
    html.unlink()
    html.symlink_to(secret)
    one_line_error(run_cli("report", str(leaky.out), "--html", str(html)), "symbolic link")
    assert secret.read_text() == "root's"
    col.unlink()
    col.write_text("theirs")
    os.chown(col, NOBODY, NOBODY)
    one_line_error(run_cli("export", str(leaky.out), "--collapsed", str(col)), "belongs to uid")


# -- escaping --------------------------------------------------------------------------------------

def test_printable_escapes_what_could_forge_lines_or_drive_a_terminal():
    assert printable("plain name") == "plain name"
    assert printable("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert printable("\x1b[31mred\x07") == "\\x1b[31mred\\x07"
    assert printable("rtl\u202eevil\u2028x\x85") == "rtl\\u202eevil\\u2028x\\x85"
    assert printable(b"\xff\xfe".decode("utf-8", "surrogateescape")) == "\\xff\\xfe"
    assert len(printable("x" * 10000)) < 5000


def test_collapsed_stacks_cannot_be_forged_by_names():
    import pandas as pd
    values = pd.DataFrame({"stack_id": [1], "comm": ["evil\nfake;frame 999"], "inuse_space": [100.0]})
    frames = {1: [{"kind": "python", "function": "f\nforged;x 1", "file": "a.py", "line": 3},
                  {"kind": "native", "function": "main\x1b[2J"}]}
    lines = collapsed_lines(values, frames, "inuse_space")
    assert len(lines) == 1, lines
    path, value = lines[0].rsplit(" ", 1)
    assert value == "100" and path.count(";") == 2, path
    assert "\x1b" not in path and "\\n" in path and "\\x1b" in path


HOSTILE_PY = r'''
import ctypes, sys, time
libc = ctypes.CDLL(None)
libc.prctl(15, b"ev\x1b[2Jil\nx", 0, 0, 0)       # PR_SET_NAME: an escape sequence and a newline

def grow(keep):
    for _ in range(64):
        keep.append(bytearray(1 << 20))

grow.__code__ = grow.__code__.replace(co_name="gr\now;x\x1b[0m", co_qualname="gr\now;x\x1b[0m")
keep = []
print("ready", flush=True)
sys.stdin.readline()
grow(keep)
print("grown", flush=True)
sys.stdin.readline()
'''


@pytest.mark.bpf
def test_hostile_names_are_escaped_in_top_analyze_and_collapsed(tmp_path, bpf_ready):
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE_PY)
    target = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out = tmp_path / "rec"
    try:
        assert target.stdout.readline().strip() == "ready"
        rec = subprocess.Popen(allocsampler_cmd("record", "-o", str(out), "-q", "--pid", str(target.pid),
                                                "--cpu-budget", "0", "-i", "1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (out / "targets").is_dir() and time.monotonic() < deadline:
            assert rec.poll() is None, rec.communicate()
            time.sleep(0.2)
        time.sleep(1.5)
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "grown"
        time.sleep(2.5)
        rec.send_signal(2)
        _, err = rec.communicate(timeout=60)
        assert rec.returncode == 0, err
    finally:
        target.kill()
        target.wait()
    assert "\x1b" not in err
    for args in (("top", str(out)), ("analyze", str(out)), ("export", str(out), "--collapsed", "-")):
        p = run_cli(*args)
        assert p.returncode == 0, p.stderr
        assert "\x1b" not in p.stdout and "\x1b" not in p.stderr, args
        if args[0] == "top":
            assert "ev\\x1b[2Jil\\nx" in p.stdout, p.stdout
        if args[0] == "export":
            lines = p.stdout.splitlines()
            assert lines and all(ln.rsplit(" ", 1)[1].isdigit() for ln in lines), lines
            assert all(ln.startswith("ev\\x1b[2Jil\\nx;") for ln in lines), lines
            assert any("gr\\now:x\\x1b[0m" in ln for ln in lines), lines


# -- disk full -------------------------------------------------------------------------------------

@pytest.fixture
def tiny_tmpfs(tmp_path):
    with tmpfs_at(tmp_path / "tiny", "512k") as mnt:
        yield mnt


@pytest.mark.bpf
def test_a_full_disk_ends_a_recording_cleanly(tiny_tmpfs, bpf_ready):
    """ENOSPC while writing Parquet: one line, exit 3, no traceback; what was written stays readable."""
    filler = tiny_tmpfs / "filler"
    out = tiny_tmpfs / "out"
    code = "import time\nkeep = []\nfor i in range(400):\n    keep.append(bytearray(1 << 18)); time.sleep(0.01)\n"
    p = subprocess.Popen(allocsampler_cmd("record", "-o", str(out), "-q", "--cpu-budget", "0", "-i", "0.5",
                                          "-d", "30", "--", sys.executable, "-c", code),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120

    def written() -> bool:      # a whole `recorder` file (its directory alone came before it, on a busy machine)
        return any(not f.name.startswith(".") for f in (out / "recorder").rglob("*.parquet"))

    while not written() and time.monotonic() < deadline:
        assert p.poll() is None, p.communicate()
        time.sleep(0.2)
    with open(filler, "wb") as f:       # the rest of the disk, now
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    _, err = p.communicate(timeout=90)
    assert p.returncode == 3, err
    assert "Traceback" not in err and err.count("cannot write to") == 1, err
    filler.unlink()
    assert len(read_table(out, RECORDER.name)) >= 1     # the files written before are whole
    assert not [q for q in out.rglob("*.tmp")]
