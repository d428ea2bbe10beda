"""Separate debug files from debuginfod servers, only where $DEBUGINFOD_URLS names some.

`GET <url>/buildid/<hex>/debuginfo`, asked at most once per build-id per process, with short socket
timeouts, a total deadline and a size cap, written atomically into a private cache
(files.cache_dir("debuginfod")) and used only as a regular file of ours that is an ELF file with
the build-id asked for. A build-id no server has is not asked for again for MISS_TTL_S (a marker in
the cache, across restarts); a server that fails (refused, timed out, 5xx, too slow) is not asked
anything for BACKOFF_S, so a hanging server stalls the symbolizer once, not once per library.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
import urllib.parse
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from sampler import files

if TYPE_CHECKING:
    import http.client
from sampler.binary.reader import ElfFormatError, ElfReader

URLS_ENV = "DEBUGINFOD_URLS"
TIMEOUT_S = 2.0  # connect, and each read
DEADLINE_S = 20.0  # a whole download (the socket timeout bounds each read only)
MAX_BYTES = 256 << 20
MISS_TTL_S = 600.0
BACKOFF_S = 300.0
CHUNK = 1 << 20
BUILD_ID = re.compile(r"[0-9a-f]{2,128}")

_lock = threading.Lock()
_asked: set[str] = set()
_down_until: dict[str, float] = {}


class Outcome(Enum):
    FETCHED = "fetched"
    MISSING = "missing"  # the server answered: it has no (usable) file
    FAILED = "failed"  # no answer: the server is backed off


class TooBig(Exception):
    pass


class TooSlow(Exception):
    pass


def servers() -> list[str]:
    """The http(s) base URLs of $DEBUGINFOD_URLS (space-separated)."""
    urls = os.environ.get(URLS_ENV, "").split()
    return [u.rstrip("/") for u in urls if urllib.parse.urlsplit(u).scheme in ("http", "https")]


def debug_file(build_id: str) -> ElfReader | None:
    """The debug file of `build_id` from the cache, else fetched; None when debuginfod is off, no
    server has it, or it was asked for already in this process."""
    urls = servers()
    if not urls or not BUILD_ID.fullmatch(build_id):
        return None
    cache = files.cache_dir("debuginfod")
    if cache is None:
        return None
    path = cache / f"{build_id}.debug"
    found = cached(path, build_id)
    if found is not None:
        return found
    with _lock:
        if build_id in _asked:
            return None
        _asked.add(build_id)
    miss = cache / f"{build_id}.miss"
    if recent(miss, MISS_TTL_S):
        return None
    outcomes = []
    for url in urls:
        outcomes.append(fetch(url, build_id, path))
        if outcomes[-1] is Outcome.FETCHED:
            found = cached(path, build_id)
            if found is not None:
                return found
            outcomes[-1] = Outcome.MISSING
    if Outcome.FAILED not in outcomes:  # every server said no: do not ask again for a while
        with contextlib.suppress(OSError):
            files.write_atomic(miss, b"")
    return None


def cached(path: Path, build_id: str) -> ElfReader | None:
    """The cache file at `path` when it is ours, bounded, and an ELF file of `build_id`; a file
    that is not is removed."""
    try:
        fd = files.open_private(path, MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # not ours to use, nor to remove
    try:
        elf = ElfReader.from_fd(fd, str(path))
        if elf.build_id() == build_id:
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


def fetch(url: str, build_id: str, dest: Path) -> Outcome:
    """Download `url`'s debuginfo of `build_id` to `dest` (atomically), unless `url` is backed off."""
    # here, not at import: http and ssl cost the recorder ~6 MiB, and debuginfod is opt-in
    import http.client
    import urllib.error
    import urllib.request

    now = time.monotonic()
    with _lock:
        if _down_until.get(url, 0.0) > now:
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
    with _lock:
        _down_until[url] = time.monotonic() + BACKOFF_S
    return Outcome.FAILED


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
