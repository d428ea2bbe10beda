"""The daemon's dataset writer: private modes, and a full disk or an I/O error never stops the
recording (rows are skipped, new stacks held, bounded, and written when writing resumes)."""

from __future__ import annotations

from typing import Protocol

from sampler.dataset.schema import FRAMES, RECORDER, RECORDINGS, STACKS, TARGETS
from sampler.dataset.writer import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, DatasetWriter, DiskFull

STACK_HOLD = 20_000             # stacks kept while writing is paused (their frames: up to 20 x)
TARGETS_FLUSH = 5_000           # targets rows buffered at most before a write


class WriterOwner(Protocol):
    writing_paused: bool

    def observe(self, table, rows) -> None: ...
    def disk_full(self, e: OSError) -> None: ...
    def write_failed(self, table: str, e: OSError) -> None: ...


class DaemonWriter(DatasetWriter):
    """Observes every row for the metrics; skips writing while paused; never raises for a full
    disk or an I/O error (the recording goes on in memory)."""

    def __init__(self, owner: WriterOwner, root: str, recording_id: str, host: str):
        super().__init__(root, recording_id, host=host, dir_mode=PRIVATE_DIR_MODE, file_mode=PRIVATE_FILE_MODE)
        self.owner = owner
        self.targets_rows: list[dict] = []
        self.held: dict[str, list] = {STACKS.name: [], FRAMES.name: []}
        self.held_dropped = 0
        self.skipped_rows = 0

    def write(self, table, rows, **kw):
        if len(rows) == 0:
            return None
        self.owner.observe(table, rows)
        if table is TARGETS:                 # one file per interval, not per event
            self.targets_rows += rows
            if len(self.targets_rows) < TARGETS_FLUSH:
                return None
            rows, self.targets_rows = self.targets_rows, []
        elif table in (RECORDER, RECORDINGS):
            self.flush_targets()
        if self.owner.writing_paused:
            if table.name in self.held:
                held = self.held[table.name]
                if len(self.held[STACKS.name]) < STACK_HOLD:
                    held += rows
                else:
                    self.held_dropped += len(rows)
            else:
                self.skipped_rows += len(rows)
            return None
        return self._write(table, rows, **kw)

    def _write(self, table, rows, **kw):
        try:
            return super().write(table, rows, **kw)
        except DiskFull as e:
            self.owner.disk_full(e)
        except OSError as e:
            self.owner.write_failed(table.name, e)
        if table.name in self.held:
            self.held[table.name] += rows
        else:
            self.skipped_rows += len(rows)
        return None

    def flush_targets(self) -> None:
        if self.targets_rows:
            rows, self.targets_rows = self.targets_rows, []
            if self.owner.writing_paused:
                self.skipped_rows += len(rows)
            else:
                self._write(TARGETS, rows)

    def flush_held(self) -> None:
        """After a pause: the stacks first seen meanwhile (outstanding rows reference them)."""
        for name, table in ((STACKS.name, STACKS), (FRAMES.name, FRAMES)):
            rows, self.held[name] = self.held[name], []
            if rows and not self.owner.writing_paused:
                self._write(table, rows)
            elif rows:
                self.held[name] = rows
