"""The disk tier's directory and files: private, never reached through a link, only this user's own.

The files hold KV cache (what a model computed from users' prompts), so they are created
``0600`` in a directory created ``0700``. Every file the tier opens in its directory (the
rows file, LMDB's ``data.mdb``, the directory lock) is opened with ``O_NOFOLLOW``, and then
checked through its descriptor (``fstat``, so nothing can change between check and use): a
regular file, owned by this process's user, with one link. Anything else is a
``TierError`` naming the file, and nothing is written:

- a **symbolic link** is never followed, nor its target created: a link planted as
  ``rows.dat`` would otherwise have the tier write rows over whatever it points at;
- a file **of another user** is never written: its owner could read the rows put in it;
- a file with **another link** (a hard link) is never written: that would change the other
  name's file too;
- a FIFO or device is not a file of rows (opened non-blocking, so a FIFO cannot hang open).

A file of this user with looser modes (made by a kvtier before this check, ``0644``) is
made ``0600``. An existing directory that others may enter, list or write, or that another
user owns, is the operator's to choose (a volume shared by group, say): it gets a warning,
not an error, since the checks above keep the rows private and the tier's writes inside
the directory whatever the directory's modes; what such a directory still allows others is
to delete or replace the files, which costs the cache (misses), never a wrong row.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat

from tiers.base import TierError

log = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dir(path: str) -> None:
    """Create ``path`` (``0700``) if absent; warn if an existing one is open to others."""
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise TierError(f"disk tier at {path!r}: cannot create the directory: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise TierError(f"disk tier at {path!r}: not a directory")
    euid = os.geteuid()
    if st.st_uid != euid:
        log.warning(
            "disk tier at %s: the directory belongs to uid %d, not to this process's user (uid %d): "
            "that user may delete or replace the tier's files; give the tier a directory of its own",
            path,
            st.st_uid,
            euid,
        )
    if st.st_mode & 0o077:
        log.warning(
            "disk tier at %s: the directory's mode is %s, open to group or others (its files stay "
            "0600, but others may list, delete or replace them); chmod 700 it to keep the cache private",
            path,
            oct(stat.S_IMODE(st.st_mode)),
        )


def open_own_file(directory: str, name: str, flags: int) -> int:
    """A descriptor of ``directory/name``, created ``0600`` if absent; ``TierError`` if it is
    a link, not a regular file, another user's, or has another link (see the module)."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TierError(
                f"disk tier at {directory!r}: {path!r} is a symbolic link; the tier never follows a "
                "link in its directory (remove it; to keep the files elsewhere, point the tier's "
                "path at that directory)"
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO no one reads, or a device without one
            raise TierError(f"disk tier at {directory!r}: {path!r} is not a regular file") from None
        raise TierError(f"disk tier at {directory!r}: cannot open {path!r}: {exc}") from exc
    try:
        _check_own(fd, directory, path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except OSError as exc:
        os.close(fd)
        raise TierError(f"disk tier at {directory!r}: cannot use {path!r}: {exc}") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_own(fd: int, directory: str, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise TierError(f"disk tier at {directory!r}: {path!r} is not a regular file")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise TierError(
            f"disk tier at {directory!r}: {path!r} belongs to uid {st.st_uid}, not to this process's "
            f"user (uid {euid}); the tier never writes another user's file (remove it)"
        )
    if st.st_nlink != 1:
        raise TierError(
            f"disk tier at {directory!r}: {path!r} has {st.st_nlink} links; writing it would change "
            "the file under its other names too (remove it)"
        )
    if st.st_mode & 0o077:
        os.fchmod(fd, FILE_MODE)
        log.info("disk tier at %s: %s was %s, made 0600", directory, path, oct(stat.S_IMODE(st.st_mode)))


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` (not followed if a link) names the file open as ``fd``."""
    try:
        named = os.lstat(path)
    except OSError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
