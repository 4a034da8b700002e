"""A progress bar for long benchmark runs: one line on stderr, rewritten in place.

Only drawn on a terminal: in a log file or a pipe, carriage returns would leave a long
smear of partial lines, so there (and with ``--quiet``) it draws nothing. No dependency.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24


class Progress:
    """``progress(done)`` after each step of ``total``; redrawn at most every ``interval_s``."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval_s: float = 0.2,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label, self.total, self.interval_s = label, max(1, total), interval_s
        self.enabled = enabled and self.stream.isatty()
        self.start = self.last = time.monotonic()

    def line(self, done: int, now: float) -> str:
        """The text of the bar: fill, count, rate and time left."""
        filled = round(WIDTH * done / self.total)
        elapsed = now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f"{(self.total - done) / rate:4.0f} s left" if rate > 0 and done < self.total else ""
        bar = "#" * filled + "." * (WIDTH - filled)
        return f"  {self.label} [{bar}] {done}/{self.total} {rate:5.0f}/s {left}"

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        final = done >= self.total
        if not final and now - self.last < self.interval_s:
            return
        self.last = now
        # \x1b[K clears what a longer previous line left on the right.
        self.stream.write("\r" + self.line(done, now) + "\x1b[K" + ("\n" if final else ""))
        self.stream.flush()
