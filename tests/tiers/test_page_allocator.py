"""The rows file's page allocator: runs handed out, merged back, and the limit kept."""

from __future__ import annotations

import random

from tiers.disk.page_allocator import PageAllocator


def test_pages_come_from_the_lowest_free_run_then_from_growth():
    alloc = PageAllocator(limit=100)
    assert alloc.allocate(10) == [(0, 10)] and alloc.allocate(10) == [(10, 10)]
    alloc.release([(0, 10)])
    assert alloc.allocate(4) == [(0, 4)]  # a free run long enough, before growing
    assert alloc.allocate(8) == [(20, 8)]  # the free run left (6 pages) is too short
    assert alloc.end == 28 and alloc.available() == 6 + 72


def test_released_runs_merge_and_a_free_tail_grows():
    alloc = PageAllocator(limit=30)
    runs = [alloc.allocate(5)[0] for _ in range(4)]  # pages 0..19
    alloc.release([runs[1], runs[3]])  # 5..9 and 15..19 (the tail)
    alloc.release([runs[2]])  # 10..14 joins both
    assert alloc._free == [(5, 15)] and alloc.free_pages == 15
    assert alloc.allocate(20) == [(5, 20)]  # the free tail run, grown by 5
    assert alloc.end == 25


def test_a_fragmented_file_still_fits_a_row_in_several_runs():
    alloc = PageAllocator(limit=12)
    runs = [alloc.allocate(3)[0] for _ in range(4)]  # the whole file
    alloc.release([runs[0], runs[2]])
    assert alloc.allocate(7) is None  # 6 pages free: nothing taken
    assert alloc.free_pages == 6
    assert alloc.allocate(5) == [(0, 3), (6, 2)]
    assert alloc.available() == 1


def test_load_frees_every_page_no_row_uses():
    alloc = PageAllocator(limit=50)
    alloc.load([(10, 5), (0, 3), (20, 10)], end=40)
    assert alloc._free == [(3, 7), (15, 5), (30, 10)]
    assert alloc.available() == 22 + 10


def test_random_use_never_hands_out_a_page_twice():
    rng = random.Random(5)
    alloc = PageAllocator(limit=400)
    held: list[list[tuple[int, int]]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            alloc.release(held.pop(rng.randrange(len(held))))
        else:
            want = rng.randint(1, 40)
            runs = alloc.allocate(want)
            if runs is None:
                assert alloc.available() < want
                continue
            assert sum(n for _, n in runs) == want
            held.append(runs)
        pages = [p for runs in held for start, n in runs for p in range(start, start + n)]
        assert len(pages) == len(set(pages)) and max(pages, default=0) < alloc.limit
        assert alloc.available() == alloc.limit - len(pages)
