"""An exclusive, non-blocking lock on a directory, held for the life of one process's tier.

The disk tier keeps its index in memory and trusts it (``may_contain`` is exact), which is
only true while no other process writes the same LMDB file. The store opens LMDB without
its own locking (``lock=False``: no ``lock.mdb``), so this lock is also what keeps a second
process from writing the index at the same time: ``flock`` on a lock file, because
the kernel drops it when the holder dies (a SIGKILLed process leaves no stale lock to clean
up), and a second open of the same path, even in the same process, is refused. The lock
file is opened as the tier's other files are (``own_files``): never through a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from tiers.base import TierError
from tiers.disk.own_files import open_own_file

LOCK_NAME = "kvtier.lock"


class DirLock:
    """``acquire()`` takes the lock or raises ``TierError`` naming the path and the holder."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        fd = open_own_file(self.directory, LOCK_NAME, os.O_RDWR)  # never through a link
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"process {holder}" if holder else "another process"
            raise TierError(
                f"disk tier at {self.directory!r} is locked by {who} (lock file {self.path!r}); "
                "one process per disk-tier path"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise TierError(f"disk tier at {self.directory!r}: cannot lock {self.path!r}: {exc}") from exc
        # The pid is only a diagnostic for the next process that finds the lock taken.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the flock


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
