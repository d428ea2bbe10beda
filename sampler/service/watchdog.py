"""systemd's notify protocol (sd_notify(3)) without libsystemd: READY when recording starts, a
WATCHDOG ping from the loop, STOPPING at the end. With `WatchdogSec=` in the unit, systemd kills
and restarts a daemon whose loop stops (a hang in a target's file, a stalled read) instead of
leaving it up with its metrics still served."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass
class Watchdog:
    address: str | None          # $NOTIFY_SOCKET ("@name": abstract namespace); None: not under systemd
    interval_s: float | None     # ping period: half of $WATCHDOG_USEC; None: no watchdog
    last: float = float("-inf")

    @classmethod
    def from_env(cls) -> Watchdog:
        address = os.environ.get("NOTIFY_SOCKET") or None
        interval = None
        usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
        if address and usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            interval = int(usec) / 2e6
        return cls(address, interval)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog(self) -> bool:
        return self.interval_s is not None

    def ready(self, status: str = "") -> None:
        self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def pet(self, now: float) -> None:
        """From the loop (monotonic `now`): a ping at most every half of the watchdog period."""
        if self.interval_s is not None and now - self.last >= self.interval_s:
            self.last = now
            self._send("WATCHDOG=1")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def _send(self, msg: str) -> None:
        if not self.address:
            return
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(msg.encode(), addr)
        except OSError:
            pass                 # systemd gone or the socket refused: nothing to tell, nothing to stop
