"""The host tier: one slab of fixed-size rows per KV group, in (pinned) CPU memory.

The host tier is the only tier that exchanges bytes with the device, and the one every
lower tier reads from and writes into, so its memory is laid out for both: one contiguous
buffer (one NIXL registration, one ``cudaHostRegister``), cut into a slab per group, each
slab ``(num_slots, row_bytes)``. It knows rows and slots, nothing of layers or engines.

Memory is pinned only where CUDA exists (pinning is what makes device copies asynchronous;
on a CPU-only machine it would only cost). With ``shm_path`` the buffer is a shared file
mapping (under ``/dev/shm``), so a scheduler process and worker processes see the same rows.
"""

from __future__ import annotations

import fcntl
import logging
import os
import weakref
from collections.abc import Iterable, Sequence

import torch

from tiers.base import TierError

log = logging.getLogger(__name__)


class SlotAllocator:
    """Hands out slot indices, lowest first.

    Lowest-first keeps the rows of one store call adjacent whenever the free space allows,
    and adjacent rows are what let a copy move many blocks in one strided operation (and a
    NIXL transfer merge descriptors). ``allocate`` is all-or-nothing.

    The free slots are one list sorted highest first, so an allocation is a slice off its
    end and a free a sort of what came back: in C, where a heap cost a Python step per slot
    (an eviction frees a store's worth of slots and the store takes them at once: 2.4x
    faster for 3 to 40 slots, measured, in a manager whose floor is its per-row work).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # highest first: allocate takes the end
        self._free_set = set(self._free)  # to refuse a slot freed twice

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free slots (ascending where possible), or ``None`` when fewer are free."""
        free = self._free
        if n > len(free):
            return None
        if n <= 0:
            return []
        slots = free[-n:]
        del free[-n:]
        slots.reverse()
        self._free_set.difference_update(slots)
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Return slots; freeing a slot twice is a bug in the caller and raises (nothing freed)."""
        returned = sorted(slots, reverse=True)
        if not returned:
            return
        if returned[0] >= self.num_slots or returned[-1] < 0:
            bad = returned[0] if returned[0] >= self.num_slots else returned[-1]
            raise ValueError(f"slot {bad} is outside 0..{self.num_slots - 1}")
        free_set = self._free_set
        if not free_set.isdisjoint(returned) or len(set(returned)) < len(returned):
            seen: set[int] = set()
            for slot in returned:
                if slot in free_set or slot in seen:
                    raise ValueError(f"slot {slot} is freed twice")
                seen.add(slot)
        free_set.update(returned)
        free = self._free
        if free and returned[0] > free[-1]:  # not all below the free ones: merge (two sorted runs)
            free.extend(returned)
            free.sort(reverse=True)
        else:
            free.extend(returned)


def cuda_available() -> bool:
    """Whether pinned memory means anything here."""
    return torch.cuda.is_available()


class HostTier:
    """Per-group slabs of rows in one buffer.

    Which slot holds what is the manager's bookkeeping (a ``SlotAllocator`` per group, kept
    in the scheduler process); this object is the memory, which may live in other processes.

    Capacity is given in bytes and split so that every group has the same number of slots
    (a prefix stored for a request has one key per group per chunk, so groups fill at the
    same pace). ``pin=None`` pins exactly when CUDA is available.
    """

    def __init__(
        self,
        row_bytes: Sequence[int],
        capacity_bytes: int,
        *,
        pin: bool | None = None,
        shm_path: str | None = None,
        sharers: int | None = None,
    ) -> None:
        """``sharers``: with ``shm_path``, how many mappings the file gets in all (the
        scheduler's and each worker's); the one that completes the count unlinks the file, so
        nothing is left in ``/dev/shm`` however the processes exit later. Until the count is
        complete (some sharer never maps it: a manager built without workers, an engine that
        fails to start), each process that mapped it removes the name when its tier is closed
        or collected, or the process exits normally, if the name still holds the file it
        mapped (``_remove_name``); only a process killed before every sharer mapped leaves it.
        ``None``: whoever owns the file unlinks it at ``close(unlink=True)``."""
        if not row_bytes or any(size <= 0 for size in row_bytes):
            raise ValueError(f"row_bytes must be positive per group, got {list(row_bytes)}")
        bytes_per_slot = sum(row_bytes)
        num_slots = capacity_bytes // bytes_per_slot
        if num_slots < 1:
            raise ValueError(
                f"host tier capacity {capacity_bytes} B holds no row: one slot across all groups "
                f"needs {bytes_per_slot} B"
            )
        memory = machine_memory_bytes()
        if memory is not None and num_slots * bytes_per_slot > memory:
            raise TierError(
                f"host tier of {num_slots * bytes_per_slot} B: more than this machine's memory "
                f"({memory / 2**30:.1f} GiB); it is allocated whole"
            )
        self.row_bytes = list(row_bytes)
        self.num_slots = num_slots
        self.pinned = cuda_available() if pin is None else pin
        self.shm_path = shm_path
        try:
            self.buffer, self.pinned, named = _allocate(
                num_slots * bytes_per_slot, pinned=self.pinned, shm_path=shm_path, sharers=sharers
            )
        except (RuntimeError, MemoryError, OSError) as exc:  # torch's, CUDA's or the file's own
            raise TierError(
                f"host tier: cannot allocate {num_slots * bytes_per_slot} B"
                f"{' pinned' if self.pinned else ''}{f' at {shm_path}' if shm_path else ''}: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from exc
        # Removes the file's name at close, collection or a normal exit (``sharers``, above).
        self._remove_name = (
            weakref.finalize(self, _remove_name, shm_path, *named, os.getpid())
            if named and shm_path
            else None
        )
        self.slabs: list[torch.Tensor] = []
        offset = 0
        for size in row_bytes:
            self.slabs.append(self.buffer[offset : offset + num_slots * size].view(num_slots, size))
            offset += num_slots * size
        log.info(
            "host tier: %d slots x %d groups, %.1f MiB, pinned=%s%s",
            num_slots,
            len(row_bytes),
            self.buffer.numel() / 2**20,
            self.pinned,
            f", shared at {shm_path}" if shm_path else "",
        )

    @property
    def num_groups(self) -> int:
        return len(self.slabs)

    @property
    def capacity_bytes(self) -> int:
        return self.buffer.numel()

    def row(self, group: int, slot: int) -> torch.Tensor:
        """The uint8 row of ``slot`` in ``group`` (a view: writing it writes the tier)."""
        return self.slabs[group][slot]

    def close(self, *, unlink: bool = False) -> None:
        """Drop this process's mapping; ``unlink`` also removes a shared-memory file (its owner does)."""
        self.slabs.clear()
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if self._remove_name is not None:
            self._remove_name()  # once: a name still needed by sharers to come is not kept for them
        elif unlink and self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)


def machine_memory_bytes() -> int | None:
    """This machine's memory, or its cgroup's memory limit where lower; ``None`` if unknown.

    The host tier is allocated whole (and pinned where CUDA is), so one larger than this can
    never be had; checked before torch is asked, whose error would name no size or key."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as limit_file:  # cgroup v2, as the container sees it
            limit = limit_file.read().strip()
    except OSError:
        limit = "max"
    if limit.isdigit():
        memory = min(memory, int(limit))
    return memory


PINNABLE_FILESYSTEMS = frozenset({"tmpfs", "hugetlbfs"})
"""Filesystems whose file pages the kernel lets a driver pin for long (``FOLL_LONGTERM``)."""


def _filesystem(path: str) -> str:
    """The type of the filesystem holding ``path`` (from ``/proc/self/mounts``; "" if unknown)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


MAPPINGS_TRAILER = 4096
"""A page after the rows of a shared file: a count of the mappings made so far (``sharers``)."""


def _allocate(
    nbytes: int, *, pinned: bool, shm_path: str | None, sharers: int | None = None
) -> tuple[torch.Tensor, bool, tuple[int, int] | None]:
    """The tier's buffer, whether it is pinned after all, and, with ``sharers``, the
    ``(device, inode)`` of the file while its name is still there (``None`` once removed)."""
    named: tuple[int, int] | None = None
    if shm_path is None:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned), pinned, named
    # Several processes map the same file (the scheduler and each worker): grow it to size
    # if needed, never truncate what another process may already be using.
    fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the count below is read, bumped and acted on by one process
        file_bytes = nbytes + MAPPINGS_TRAILER
        size = os.fstat(fd).st_size
        if size < file_bytes:
            os.ftruncate(fd, file_bytes)
        elif size > file_bytes:
            raise ValueError(
                f"{shm_path} holds {size} B, this host tier needs {file_bytes} B: another layout?"
            )
        buffer = torch.from_file(shm_path, shared=True, size=nbytes, dtype=torch.uint8)
        if sharers is not None and not _count_mapping(fd, shm_path, nbytes, sharers):
            st = os.fstat(fd)
            named = (st.st_dev, st.st_ino)
    finally:
        os.close(fd)  # also releases the lock
    filesystem = _filesystem(shm_path) if pinned else ""
    if pinned and filesystem not in PINNABLE_FILESYSTEMS:
        # Linux (>= 6.5) refuses to pin pages of a file on a disk filesystem for long: seen on
        # an H100 server with the file under /tmp, where cudaHostRegister failed (and left an
        # error behind for the next CUDA call). The tier still works unpinned, with device
        # copies that wait for the host.
        log.warning(
            "host tier at %s is not pinned: its filesystem (%s) cannot be pinned, so device "
            "copies will be synchronous; put the file on tmpfs (e.g. /dev/shm)",
            shm_path,
            filesystem,
        )
        pinned = False
    if pinned:
        # Register the mapping with the driver; torch.empty(pin_memory=True) cannot map a file.
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} B at {shm_path} failed: error {int(err)}")
    return buffer, pinned, named


def _count_mapping(fd: int, shm_path: str, nbytes: int, sharers: int) -> bool:
    """Count this mapping in the file's trailer; the last of ``sharers`` unlinks the file
    (and is told ``True``).

    Once every process has mapped it, the name is no longer needed: the memory lives as long
    as some mapping does, and no exit, however abrupt, can leave it behind (vLLM's own shared
    offload region does the same). The caller holds the file's lock.
    """
    mapped = int.from_bytes(os.pread(fd, 8, nbytes), "little") + 1
    os.pwrite(fd, mapped.to_bytes(8, "little"), nbytes)
    if mapped >= sharers:
        os.unlink(shm_path)
        log.info("host tier: %s mapped by all %d processes; its name is removed", shm_path, sharers)
        return True
    return False


def _remove_name(path: str, device: int, inode: int, pid: int) -> None:
    """Unlink ``path`` if it still names the file this process mapped: not a file of the same
    name made since (another engine's), and not from a forked child that inherited the hook."""
    if os.getpid() != pid:
        return
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == (device, inode):
            os.unlink(path)
            log.info("host tier: %s removed (not every sharer mapped it)", path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("host tier: cannot remove %s: %s", path, exc)
