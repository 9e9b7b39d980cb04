"""What ``kvferry up`` prints while it works: a live status line on a terminal, and otherwise (a log
file, CI) one line per state change and nothing for the ticking waits."""

from __future__ import annotations

import sys
from typing import TextIO


class Console:
    # Starts every state-change line (a detached start's follower echoes those from the log).
    EVENT_PREFIX = "  -> "

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._live = self._stream.isatty()
        self._showing = False

    def event(self, message: str) -> None:
        """A state change: always its own line."""
        self._clear()
        print(f"{self.EVENT_PREFIX}{message}", file=self._stream, flush=True)

    def waiting(self, message: str) -> None:
        """A wait that ticks ("12 s so far"): rewrites the live line on a terminal, silent otherwise."""
        if not self._live:
            return
        print(f"\r\033[K  .. {message}", end="", file=self._stream, flush=True)
        self._showing = True

    def line(self, text: str = "") -> None:
        """Plain output (tables, summaries)."""
        self._clear()
        print(text, file=self._stream, flush=True)

    def _clear(self) -> None:
        if self._showing:
            print("\r\033[K", end="", file=self._stream)
            self._showing = False
