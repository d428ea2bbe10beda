"""Separate debug files from debuginfod servers, only where $DEBUGINFOD_URLS names some.

The recorder asks from its loop, per new mapping, and a target chooses what it maps: so nothing
here waits for a server. `debug_file` answers at once from the cache, else queues the build-id
for one background thread and returns None; the caller looks again later (elf.ElfImage does,
while `pending` says an answer may come). The thread downloads `GET <url>/buildid/<hex>/debuginfo`
with short socket timeouts, a total deadline and a size cap, atomically into a private cache
(files.cache_dir("debuginfod")); a cached file is used only as a regular file of ours that is an
ELF file with the build-id asked for.

Bounds, so that a process mapping many files with distinct build-ids costs little:
- at most QUEUE_MAX requests pending; past it a request is dropped (asked again on a later call);
- new requests at most RATE_PER_S a second (a token bucket of BURST), WINDOW_MAX per WINDOW_S, and
  PER_REQUESTER_MAX per WINDOW_S per requester (a key the caller gives: elf.py gives a user's
  files their owner's uid, root's none); a refused request is counted and asked again on a later call;
- a build-id is asked at most once per process (the last ASKED_MAX are remembered); one no server
  has is not asked for again for MISS_TTL_S (a marker in the cache, across restarts); a server that
  fails (refused, timed out, 5xx, too slow) is not asked anything for BACKOFF_S;
- the cache holds at most CACHE_BYTES ($ALLOCSAMPLER_DEBUGINFOD_CACHE_BYTES) in CACHE_ENTRIES debug
  files and miss markers; past either the least recently used go (a use touches a file's mtime).
Which files may be asked for is the caller's choice: elf.py asks only for files root alone can
change, unless $ALLOCSAMPLER_DEBUGINFOD_ANY=1 (`any_file`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
import urllib.parse
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from sampler import files

if TYPE_CHECKING:
    import http.client
from sampler.binary.reader import ElfFormatError, ElfReader

URLS_ENV = "DEBUGINFOD_URLS"
ANY_ENV = "ALLOCSAMPLER_DEBUGINFOD_ANY"  # "1": ask for anyone's files, not only root's
CACHE_BYTES_ENV = "ALLOCSAMPLER_DEBUGINFOD_CACHE_BYTES"
TIMEOUT_S = 2.0  # connect, and each read
DEADLINE_S = 20.0  # a whole download (the socket timeout bounds each read only)
MAX_BYTES = 256 << 20
MISS_TTL_S = 600.0
BACKOFF_S = 300.0
CHUNK = 1 << 20
BUILD_ID = re.compile(r"[0-9a-f]{2,128}")
ENTRY = re.compile(r"[0-9a-f]{2,128}\.(debug|miss)")  # what the cache's accounting counts and evicts
# a download's temporary (files.atomic_file), left by a child killed or idled out mid-download
TEMPORARY = re.compile(r"\.[0-9a-f]{2,128}\.(debug|miss)\.[0-9]+-[0-9a-f]+\.tmp")
TEMPORARY_STALE_S = 2 * DEADLINE_S

QUEUE_MAX = 64  # queued or downloading
RATE_PER_S = 1.0
BURST = 8
WINDOW_S = 600.0
WINDOW_MAX = 120  # new requests per WINDOW_S, all requesters
PER_REQUESTER_MAX = 32  # new requests per WINDOW_S of one requester
REQUESTERS_MAX = 1024  # requesters whose requests are remembered (the oldest forgotten)
ASKED_MAX = 4096  # build-ids remembered as asked
CACHE_BYTES = 1 << 30
CACHE_ENTRIES = 512
IDLE_EXIT_S = 60.0  # the download thread ends after this long without work (started again on demand)


class Outcome(Enum):
    FETCHED = "fetched"
    MISSING = "missed"  # the server answered: it has no (usable) file
    FAILED = "failed"  # no answer: the server is backed off


class Asked(Enum):
    QUEUED = "queued"  # queued or downloading
    REFUSED = "refused"  # dropped or rate-limited: asked again on a later call
    DONE = "done"  # answered (or a recent miss marker): not asked again in this process


class TooBig(Exception):
    pass


class TooSlow(Exception):
    pass


class Requests:
    """The queue, limits, counters and memory of one process's debuginfod requests."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: deque[tuple[str, tuple[str, ...], Path]] = deque()
        self.busy = 0  # queued + downloading
        self.asked: OrderedDict[str, Asked] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.tokens: float | None = None  # BURST when first used (tests change BURST)
        self.filled_at = 0.0
        self.recent: deque[float] = deque()  # when requests were accepted, in the last WINDOW_S
        self.by_requester: OrderedDict[Hashable, deque[float]] = OrderedDict()
        self.down_until: dict[str, float] = {}  # the worker's alone
        self.worker: threading.Thread | None = None

    def state(self, build_id: str) -> Asked | None:
        with self.cond:
            return self.asked.get(build_id)

    def remember(self, build_id: str, state: Asked) -> None:
        """Under self.cond."""
        self.asked[build_id] = state
        self.asked.move_to_end(build_id)
        while len(self.asked) > ASKED_MAX:
            self.asked.popitem(last=False)

    def ask(self, build_id: str, urls: tuple[str, ...], cache: Path, requester: Hashable) -> None:
        """Queue `build_id` for the worker, unless the queue is full or a limit refuses it."""
        with self.cond:
            if self.asked.get(build_id) in (Asked.QUEUED, Asked.DONE):  # another thread was first
                return
            if self.busy >= QUEUE_MAX:
                self.counts["dropped"] += 1
                self.remember(build_id, Asked.REFUSED)
                return
            if not self.allow(requester, time.monotonic()):
                self.counts["rate_limited"] += 1
                self.remember(build_id, Asked.REFUSED)
                return
            self.remember(build_id, Asked.QUEUED)
            self.queue.append((build_id, urls, cache))
            self.busy += 1
            self.counts["queued"] += 1
            if self.worker is None or not self.worker.is_alive():
                self.worker = threading.Thread(target=self.work, name="debuginfod", daemon=True)
                self.worker.start()
            self.cond.notify_all()

    def allow(self, requester: Hashable, now: float) -> bool:
        """Take a token of the bucket and a place in the global and the requester's windows, or
        nothing when any is spent. Under self.cond."""
        if self.tokens is None:
            self.tokens = float(BURST)
        else:
            self.tokens = min(float(BURST), self.tokens + (now - self.filled_at) * RATE_PER_S)
        self.filled_at = now
        mine = self.by_requester.get(requester) if requester is not None else None
        for times in (self.recent, mine or ()):
            while times and times[0] <= now - WINDOW_S:
                times.popleft()
        if (self.tokens < 1 or len(self.recent) >= WINDOW_MAX
                or (requester is not None and len(mine or ()) >= PER_REQUESTER_MAX)):
            return False
        self.tokens -= 1
        self.recent.append(now)
        if requester is not None:
            self.by_requester.setdefault(requester, deque()).append(now)
            self.by_requester.move_to_end(requester)
            while len(self.by_requester) > REQUESTERS_MAX:
                self.by_requester.popitem(last=False)
        return True

    def work(self) -> None:
        """The download thread: one request at a time, until idle for IDLE_EXIT_S."""
        while True:
            with self.cond:
                if not self.cond.wait_for(lambda: self.queue, IDLE_EXIT_S):
                    self.worker = None
                    return
                build_id, urls, cache = self.queue.popleft()
            outcome, evicted = Outcome.FAILED, 0
            with contextlib.suppress(Exception):  # a bug must not end the thread with requests pending
                outcome, evicted = self.download(build_id, urls, cache)
            with self.cond:
                self.counts[outcome.value] += 1
                self.counts["evicted"] += evicted
                self.remember(build_id, Asked.DONE)
                self.busy -= 1
                self.cond.notify_all()

    def download(self, build_id: str, urls: tuple[str, ...], cache: Path) -> tuple[Outcome, int]:
        """Ask each server in turn; (outcome, cache entries evicted to make room)."""
        path, miss = cache / f"{build_id}.debug", cache / f"{build_id}.miss"
        outcomes, evicted = [], 0
        for url in urls:
            outcome = self.fetch(url, build_id, path)
            if outcome is Outcome.FETCHED:
                if cached(path, build_id) is not None:
                    evicted += trim(cache, path)
                    if os.path.lexists(path):  # else too big for the cache alone: as if missing
                        return Outcome.FETCHED, evicted
                outcome = Outcome.MISSING
            outcomes.append(outcome)
        if Outcome.FAILED in outcomes:
            return Outcome.FAILED, evicted
        # every server said no: not asked again for a while
        with contextlib.suppress(OSError), files.atomic_file(miss, durable=False):
            pass
        return Outcome.MISSING, evicted + trim(cache, miss)

    def fetch(self, url: str, build_id: str, dest: Path) -> Outcome:
        """Download `url`'s debuginfo of `build_id` to `dest` (atomically), unless `url` is backed off."""
        # here, not at import: http and ssl cost the recorder ~6 MiB, and debuginfod is opt-in
        import http.client
        import urllib.error
        import urllib.request

        now = time.monotonic()
        if self.down_until.get(url, 0.0) > now:
            return Outcome.FAILED
        req = urllib.request.Request(f"{url}/buildid/{build_id}/debuginfo", headers={"User-Agent": "allocsampler"})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                size = resp.headers.get("Content-Length")
                if size is not None and size.isdigit() and int(size) > MAX_BYTES:
                    return Outcome.MISSING
                with files.atomic_file(dest, durable=False) as f:
                    copy_bounded(resp, f, now + DEADLINE_S)
            return Outcome.FETCHED
        except urllib.error.HTTPError as e:
            e.close()
            if 400 <= e.code < 500:
                return Outcome.MISSING
        except TooBig:  # the server has it, too big for us
            return Outcome.MISSING
        except (OSError, http.client.HTTPException, TooSlow):
            pass
        self.down_until[url] = time.monotonic() + BACKOFF_S
        return Outcome.FAILED


_requests = Requests()


def reset() -> None:
    """Forget every request, limit, counter and backed-off server (tests; a forked child). A
    download under way finishes into the old state."""
    global _requests
    _requests = Requests()


# a child of a fork has no download thread, and the parent's may have held the lock: start afresh
os.register_at_fork(after_in_child=reset)


_here = [True]


def leave_to_workers() -> None:
    """Ask nothing from this process (the recorder, the table worker): frames are named in the
    name worker, which asks (sampler/stacks/name_worker.py); two processes would download the
    same files."""
    _here[0] = False


def servers() -> list[str]:
    """The http(s) base URLs of $DEBUGINFOD_URLS (space-separated); none after leave_to_workers."""
    urls = os.environ.get(URLS_ENV, "").split() if _here[0] else []
    return [u.rstrip("/") for u in urls if urllib.parse.urlsplit(u).scheme in ("http", "https")]


def any_file() -> bool:
    """$ALLOCSAMPLER_DEBUGINFOD_ANY=1: debug files may be asked for files root does not own alone."""
    return os.environ.get(ANY_ENV) == "1"


def cache_bytes() -> int:
    value = os.environ.get(CACHE_BYTES_ENV, "")
    return int(value) if value.isdigit() else CACHE_BYTES


def debug_file(build_id: str, requester: Hashable = None) -> ElfReader | None:
    """The debug file of `build_id` from the cache, at once. None when debuginfod is off, no
    server has it, or it is not cached yet: then it is queued for download (once per process,
    within the limits; `requester` is whom the limit per requester counts it for, None for none)."""
    urls = servers()
    if not urls or not BUILD_ID.fullmatch(build_id):
        return None
    cache = files.cache_dir("debuginfod")
    if cache is None:
        return None
    found = cached(cache / f"{build_id}.debug", build_id)
    if found is not None:
        return found
    r = _requests
    if r.state(build_id) in (Asked.QUEUED, Asked.DONE):
        return None
    if recent(cache / f"{build_id}.miss", MISS_TTL_S):
        with r.cond:
            r.remember(build_id, Asked.DONE)
        return None
    r.ask(build_id, tuple(urls), cache, requester)
    return None


def pending(build_id: str) -> bool:
    """Asking again for `build_id` may still give a file: it is being downloaded, or was refused
    for now (a full queue, a limit). False once answered, and for an id never asked."""
    return bool(servers()) and _requests.state(build_id) in (Asked.QUEUED, Asked.REFUSED)


def wait_idle(timeout: float | None = None) -> bool:
    """Wait until no download is queued or under way; False if `timeout` passed first."""
    r = _requests
    with r.cond:
        return r.cond.wait_for(lambda: r.busy == 0, timeout)


def stats() -> dict[str, int]:
    """Counters since start (or reset): queued, fetched, missed, failed, dropped, rate_limited,
    evicted; and now: pending (queued or downloading), remembered (build-ids asked)."""
    r = _requests
    with r.cond:
        keys = ("queued", "fetched", "missed", "failed", "dropped", "rate_limited", "evicted")
        return {**{k: r.counts[k] for k in keys}, "pending": r.busy, "remembered": len(r.asked)}


def cached(path: Path, build_id: str) -> ElfReader | None:
    """The cache file at `path` when it is ours, bounded, and an ELF file of `build_id` (its mtime
    touched: recently used); a file that is not is removed."""
    try:
        fd = files.open_private(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # not ours to use, nor to remove
    try:
        elf = ElfReader.from_fd(fd, str(path))
        if elf.build_id() == build_id:
            # on the descriptor checked; explicit nanoseconds: the kernel's own clock for file
            # times is coarse (a tick), and eviction goes by this order
            with contextlib.suppress(OSError):
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            return elf
    except ElfFormatError:
        pass
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def recent(path: Path, ttl_s: float) -> bool:
    """`path` is a file of ours modified less than `ttl_s` ago."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return files.is_private(st) and time.time() - st.st_mtime < ttl_s


def trim(cache: Path, keep: Path) -> int:
    """Remove the least recently used entries (by mtime) until the cache holds at most
    cache_bytes() and CACHE_ENTRIES; `keep` (just stored) last of all, when it alone is over.
    Counts only debug files and miss markers that are regular files of ours, seen with lstat:
    anything else there (a link, another user's file) is neither counted nor removed, but for our
    temporaries older than any download may take (a child killed mid-download left them). The
    number of entries removed."""
    entries = []
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(cache) as it:
        for e in it:
            if TEMPORARY.fullmatch(e.name):
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and files.is_private(st) and now - st.st_mtime > TEMPORARY_STALE_S:
                        os.unlink(cache / e.name)
                continue
            if not ENTRY.fullmatch(e.name):
                continue
            with contextlib.suppress(OSError):
                st = e.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and files.is_private(st):
                    entries.append((e.name == keep.name, st.st_mtime_ns, e.name, st.st_size))
    entries.sort()
    total, count, cap_bytes, removed = sum(e[3] for e in entries), len(entries), cache_bytes(), 0
    for _, _, name, size in entries:
        if total <= cap_bytes and count <= CACHE_ENTRIES:
            break
        try:
            os.unlink(cache / name)
            removed += 1
        except FileNotFoundError:  # another recorder's trim took it
            pass
        except OSError:
            continue
        total, count = total - size, count - 1
    return removed


def copy_bounded(src: http.client.HTTPResponse, dst: BinaryIO, deadline: float) -> None:
    """Copy `src` to `dst`. Raises TooBig past MAX_BYTES, TooSlow past `deadline`: read1 returns
    what one read brings, so a server that trickles bytes is stopped at the deadline too."""
    total = 0
    while chunk := src.read1(CHUNK):
        total += len(chunk)
        if total > MAX_BYTES:
            raise TooBig
        if time.monotonic() > deadline:
            raise TooSlow
        dst.write(chunk)
