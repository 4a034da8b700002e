import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiers.base import TierError
from tiers.host import HostTier, SlotAllocator, machine_memory_bytes


def test_allocator_lowest_first_all_or_nothing():
    allocator = SlotAllocator(5)
    assert allocator.allocate(3) == [0, 1, 2]
    allocator.free([1])
    assert allocator.allocate(2) == [1, 3]
    assert allocator.allocate(2) is None
    assert allocator.num_free == 1
    assert allocator.allocate(1) == [4]


def test_allocator_rejects_double_and_foreign_frees():
    allocator = SlotAllocator(2)
    allocator.allocate(1)
    allocator.free([0])
    with pytest.raises(ValueError, match="slot 0 is freed twice"):
        allocator.free([0])
    with pytest.raises(ValueError, match="outside"):
        allocator.free([7])


def test_capacity_splits_equal_slots_per_group():
    host = HostTier([100, 300], 4000 + 399)
    assert host.num_slots == 10
    assert [tuple(slab.shape) for slab in host.slabs] == [(10, 100), (10, 300)]
    assert host.capacity_bytes == 4000
    assert host.pinned is torch.cuda.is_available()


def test_slabs_do_not_overlap():
    host = HostTier([8, 16], 10 * 24)
    host.slabs[0].fill_(1)
    host.slabs[1].fill_(2)
    assert int(host.slabs[0].sum()) == 80
    assert int(host.slabs[1].sum()) == 2 * 160


def test_too_small_or_bad_rows():
    with pytest.raises(ValueError, match="holds no row"):
        HostTier([100], 99)
    with pytest.raises(ValueError, match="row_bytes must be positive"):
        HostTier([0], 1000)


def test_shared_memory_file_is_seen_by_another_mapping(tmp_path):
    path = str(tmp_path / "kvtier_host.mmap")
    host = HostTier([64], 64 * 4, shm_path=path)
    host.row(0, 2).copy_(torch.arange(64, dtype=torch.uint8))
    other = torch.from_file(path, shared=True, size=64 * 4, dtype=torch.uint8)
    assert other[128:192].tolist() == list(range(64))
    second = HostTier([64], 64 * 4, shm_path=path)  # a second process's view: same bytes
    assert second.row(0, 2).tolist() == list(range(64))
    with pytest.raises(ValueError, match="another layout"):
        HostTier([32], 32 * 4, shm_path=path)
    second.close()
    host.close(unlink=True)
    assert not (tmp_path / "kvtier_host.mmap").exists()


def test_the_filesystem_of_a_path_decides_whether_a_shared_file_can_be_pinned():
    """Pinning a file mapping needs tmpfs or hugetlbfs (Linux refuses long pins of disk-file pages)."""
    from tiers.host import PINNABLE_FILESYSTEMS, _filesystem

    assert _filesystem("/proc/self/status") == "proc"
    if os.path.ismount("/dev/shm"):
        assert _filesystem("/dev/shm/kvtier_host.mmap") in PINNABLE_FILESYSTEMS


def test_a_shared_file_is_unlinked_once_every_sharer_has_mapped_it(tmp_path):
    path = str(tmp_path / "kvtier_test.mmap")
    first = HostTier([64], 64 * 4, pin=False, shm_path=path, sharers=3)
    second = HostTier([64], 64 * 4, pin=False, shm_path=path, sharers=3)
    assert os.path.exists(path), "two of three mapped: the name is still needed"
    third = HostTier([64], 64 * 4, pin=False, shm_path=path, sharers=3)
    assert not os.path.exists(path)
    first.row(0, 1)[:] = 7  # one memory, whatever the name
    assert int(second.row(0, 1)[0]) == int(third.row(0, 1)[-1]) == 7
    for tier in (first, second, third):
        tier.close(unlink=True)  # the owner's unlink finds nothing to remove: no error


def test_a_host_tier_larger_than_the_machine_is_a_tier_error_before_torch_is_asked(monkeypatch):
    memory = machine_memory_bytes()
    assert memory is not None and memory > 1 << 30

    def no_allocation(*args, **kwargs):
        raise AssertionError("torch was asked for the memory")

    monkeypatch.setattr(torch, "empty", no_allocation)
    with pytest.raises(TierError, match=rf"host tier of {2 * memory} B: more than this machine's memory"):
        HostTier([4096], 2 * memory, pin=False)


def test_an_allocation_that_fails_is_a_tier_error_naming_the_size(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes.")

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(TierError, match=r"host tier: cannot allocate 4096 B: DefaultCPUAllocator"):
        HostTier([4096], 4096, pin=False)


def test_a_shared_file_not_every_sharer_mapped_is_removed_at_a_normal_exit(tmp_path):
    """Issue 36: a process that mapped the file, whose other sharers never came, exits
    without closing its tier: the name is gone all the same."""
    path = tmp_path / "kvtier_lonely.mmap"
    code = (
        "import sys; from tiers.host import HostTier; "
        "host = HostTier([64], 64 * 4, pin=False, shm_path=sys.argv[1], sharers=3); "
        "import os; assert os.path.exists(sys.argv[1])"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path) == []


def test_closing_a_shared_tier_removes_only_the_file_it_mapped(tmp_path):
    path = str(tmp_path / "kvtier_test.mmap")
    host = HostTier([64], 64 * 4, pin=False, shm_path=path, sharers=3)
    os.unlink(path)
    with open(path, "wb") as other:  # another engine's file under the same name since
        other.write(b"theirs")
    host.close()
    assert Path(path).read_bytes() == b"theirs"
    os.unlink(path)
    host = HostTier([64], 64 * 4, pin=False, shm_path=path, sharers=3)
    host.close()  # a worker's close: the sharers to come are not waited for
    assert not os.path.exists(path)
