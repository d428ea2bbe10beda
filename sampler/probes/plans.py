"""Per-file probe plans (what to probe in a library, and where), built once per file and bounded."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from sampler.binary.elf import ElfImage
from sampler.binary.reader import format_errors

T = TypeVar("T")


class PlanCache(Generic[T]):
    """Plans by file identity (device, inode, path and what else the planner depends on)."""

    def __init__(self, limit: int = 512):
        self.limit = limit
        self._plans: dict[Hashable, T] = {}

    def get(self, key: Hashable, path: str, plan: Callable[[ElfImage], T]) -> T | None:
        """The plan of the file at `path`, planned now if new; None when it cannot be read as ELF."""
        got = self._plans.get(key)
        if got is None:
            try:
                image = ElfImage.open(path)
                got = format_errors(plan)(image)  # a malformed file's code or symbols: no plan
            except (OSError, ValueError):
                return None
            self._plans[key] = got
        return got

    def prune(self, shed: int = 0) -> None:
        """All go above the limit, or at `shed` 2 (memory is short): replanning costs a file read."""
        if shed >= 2 or len(self._plans) > self.limit:
            self._plans.clear()
