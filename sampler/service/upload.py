"""The daemon's side of [upload]: when to run the upload child (sampler.dataset.upload.run), the
backoff after failures, and the local backlog that retention keeps.

- Runs every `interval_s` while they succeed (at once again when a run ran out of time with files
  left). After a failure the wait doubles per failure from `interval_s` up to `backoff_max_s`,
  each drawn in [half, all] of that (jitter: a fleet that lost its store at once does not come
  back at once). An offline store never blocks the loop: the upload runs in a child process,
  stopped past `timeout_s`.
- The backlog is every file of the fleet layout not uploaded yet (closed or not: unsealed files
  are uploaded once sealed). Retention never deletes the newest `max_backlog_bytes` of it, nor
  its recordings/stacks/frames; data files of it beyond that are deleted oldest first, counted
  as lost (persisted in ROOT/.upload/lost.json), logged, and shown in status and metrics.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from sampler import files
from sampler.dataset import upload as shipping
from sampler.dataset.retention import METADATA_TABLES, DataFile, RetentionReport
from sampler.service.config import UploadConfig
from sampler.service.metrics import UploadHealth

LOG_EVERY_S = 600.0


class Uploads:
    def __init__(self, cfg: UploadConfig, root: Path, log: Callable[[str], None],
                 rand: Callable[[], float] = random.random):
        self.cfg, self.root, self.log, self.rand = cfg, Path(root), log, rand
        self.next_at = 0.0                  # monotonic: the first run comes at the first tick
        self.failures = 0                   # consecutive failed runs
        self.failed_runs = 0
        self.uploaded_files = self.uploaded_bytes = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.last_success: float | None = None
        self.last_run: dict = {}
        self.backlog_files = self.backlog_bytes = 0
        self.backlog_oldest: float | None = None     # mtime of the oldest file not uploaded
        self._pending: dict[Path, int] = {}          # not uploaded at the last retention: path -> bytes
        self._logged_failure = -1e9
        self.lost_files, self.lost_bytes = self._load_lost()

    # -- the child ------------------------------------------------------------------------------
    def due(self, now: float) -> bool:
        return now >= self.next_at

    def job_args(self) -> tuple[list[str], float]:
        c = self.cfg
        args = [str(self.root), "--uri", c.uri, "--retries", str(c.retries),
                "--budget", f"{max(1.0, 0.8 * c.timeout_s - 2):g}"]      # room to save its state
        if c.endpoint:
            args += ["--endpoint", c.endpoint]
        if c.region:
            args += ["--region", c.region]
        return args, c.timeout_s

    def probe_args(self) -> list[str]:
        args, _ = self.job_args()
        return args

    def done(self, doc: dict | None, state: dict, now: float, wall: float) -> None:
        """A finished upload child: its JSON document (None: it failed or was stopped)."""
        error = (doc or {}).get("error") if doc is not None else state.get("error") or "the upload child failed"
        self.last_run = {**state, **(doc or {})}
        if doc is not None:
            self.uploaded_files += int(doc.get("uploaded_files") or 0)
            self.uploaded_bytes += int(doc.get("uploaded_bytes") or 0)
        if error is None:
            if self.failures:
                self.log(f"upload: {self.cfg.uri} works again after {self.failures} failed runs; backlog "
                         f"{self.backlog_files} files ({self.backlog_bytes / (1 << 20):.1f} MiB)")
            self.failures = 0
            self.last_success = wall
            more = bool(doc and doc.get("pending_files"))
            self.next_at = now if more else now + self.cfg.interval_s
            return
        self.failures += 1
        self.failed_runs += 1
        self.last_error, self.last_error_at = str(error), wall
        wait = min(self.cfg.backoff_max_s, self.cfg.interval_s * 2 ** (self.failures - 1))
        wait *= 0.5 + 0.5 * self.rand()
        self.next_at = now + wait
        if now - self._logged_failure >= LOG_EVERY_S:
            self._logged_failure = now
            self.log(f"upload: to {self.cfg.uri} failed ({error}); retrying in {wait:.0f} s, with backoff; "
                     f"backlog {self.backlog_files} files ({self.backlog_bytes / (1 << 20):.1f} MiB) kept, up to "
                     f"upload.max_backlog_bytes (said at most every {LOG_EVERY_S / 60:.0f} minutes)")

    # -- retention --------------------------------------------------------------------------------
    def plan(self, listed: list[DataFile]) -> tuple[set[Path], set[Path]]:
        """For retention (under its lock): (files it must keep, backlog files to delete now)."""
        state = shipping.load_state(self.root, self.cfg.uri)
        pending = [f for f in listed if f.host is not None and not state.done(f, self.root)]
        self._pending = {f.path: f.disk_bytes for f in pending}
        self.backlog_files = len(pending)
        self.backlog_bytes = sum(f.disk_bytes for f in pending)
        self.backlog_oldest = min((f.mtime for f in pending), default=None)
        keep, drop, size = set(), set(), 0
        for f in sorted(pending, key=lambda f: f.age_key(), reverse=True):        # newest first
            size += f.disk_bytes
            if size <= self.cfg.max_backlog_bytes or f.table in METADATA_TABLES:
                keep.add(f.path)
            else:
                drop.add(f.path)
        return keep, drop

    def retention_done(self, report: RetentionReport) -> None:
        """Count the backlog files that retention deleted: lost."""
        lost = [self._pending[p] for d in report.deleted if (p := self.root / d) in self._pending]
        if not lost:
            return
        self.lost_files += len(lost)
        self.lost_bytes += sum(lost)
        self.backlog_files -= len(lost)
        self.backlog_bytes -= sum(lost)
        self._save_lost()
        self.log(f"upload: {len(lost)} files ({sum(lost) / (1 << 20):.1f} MiB) deleted before they could be "
                 f"uploaded: the backlog is over upload.max_backlog_bytes or the dataset over its budget "
                 f"({self.lost_files} files lost in all); {self.cfg.uri}: {self.last_error or 'no error'}")

    def _load_lost(self) -> tuple[int, int]:
        try:
            doc = json.loads(files.read_private(shipping.state_dir(self.root) / shipping.LOST_FILE, 1 << 16))
            return int(doc["files"]), int(doc["bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0

    def _save_lost(self) -> None:
        try:
            d = files.subdir(self.root, shipping.state_dir(self.root).name, 0o700)
            files.write_atomic(d / shipping.LOST_FILE,
                               json.dumps({"files": self.lost_files, "bytes": self.lost_bytes}).encode())
        except OSError as e:
            self.log(f"upload: could not record the lost files ({e.strerror or e})")

    # -- status and metrics ----------------------------------------------------------------------
    def health(self, wall: float | None = None) -> UploadHealth:
        wall = time.time() if wall is None else wall
        return UploadHealth(
            backlog_files=self.backlog_files, backlog_bytes=self.backlog_bytes,
            backlog_oldest_age_seconds=max(0.0, wall - self.backlog_oldest) if self.backlog_oldest else None,
            uploaded_files_total=self.uploaded_files, uploaded_bytes_total=self.uploaded_bytes,
            failures_total=self.failed_runs, lost_files_total=self.lost_files, lost_bytes_total=self.lost_bytes,
            last_success_timestamp=self.last_success)

    def status(self, now: float) -> dict:
        h = self.health()
        return {"uri": self.cfg.uri, "state": "failing" if self.failures else "ok",
                "backlog_files": h.backlog_files, "backlog_bytes": h.backlog_bytes,
                "backlog_oldest_age_s": round(h.backlog_oldest_age_seconds, 1)
                if h.backlog_oldest_age_seconds is not None else None,
                "max_backlog_bytes": self.cfg.max_backlog_bytes,
                "uploaded_files": self.uploaded_files, "uploaded_bytes": self.uploaded_bytes,
                "failed_runs": self.failed_runs, "consecutive_failures": self.failures,
                "last_error": self.last_error, "last_error_at": self.last_error_at,
                "last_success": self.last_success, "next_run_in_s": round(max(0.0, self.next_at - now), 1),
                "lost_files": self.lost_files, "lost_bytes": self.lost_bytes, "last_run": self.last_run}
