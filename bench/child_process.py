"""What every wrapper of a child process the tests and benchmarks fault does with it.

A peer, a Mooncake storage process and a simulated host's process are all killed like a host
that loses power, frozen like a hung one, and thawed; this is the one place that knows how
(a frozen process must be thawed before a kill can be reaped).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess


class Faultable:
    """Mixin for a wrapper holding its child as ``self.proc``."""

    proc: subprocess.Popen

    def kill(self) -> None:
        """SIGKILL, as a host that loses power (a frozen child is thawed first)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGSTOP: a hung host (its sockets stay open, nothing answers on them)."""
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
