"""The worker's optional sub-row placement, as vLLM's spec uses it.

``first_sub_rows``: a job's first block lands in the middle of its first slot (vLLM's
``block_indices`` for a load that starts mid-chunk), the last slot may be partly used.
``host_block_bytes`` / ``host_offset_bytes``: host sub-rows wider than a device block, this
device's bytes in a band of them (the other bands are other ranks' or padding).
"""

from __future__ import annotations

import pytest
import torch

from offload.layout import canonicalize
from offload.worker import OffloadingWorker
from tests.offload.layouts import packed_views, per_layer_blocks_first, scramble
from tiers.host import HostTier


def finish(worker, job_id):
    worker.wait([job_id])
    (result,) = worker.get_finished()
    assert result.job_id == job_id and result.success
    return result


def test_a_job_can_start_in_the_middle_of_a_slot_and_end_in_one():
    kv, groups = per_layer_blocks_first()
    caches = canonicalize(kv, groups)
    row = caches.row_bytes(0)
    host = HostTier([row * 4], 8 * row * 4)
    worker = OffloadingWorker(caches, host, blocks_per_row=4)
    rows = {b: caches.read_row(0, b) for b in range(12)}

    # Blocks 0..9 fill slots 2, 5, 1 from their first sub-row: slot 1 is half used.
    assert worker.submit_store(1, [list(range(10))], [[2, 5, 1]], first_sub_rows=[0])
    finish(worker, 1)
    scramble(kv)
    # Load the logical blocks 6..9 (sub-rows 2, 3 of slot 5 and 0, 1 of slot 1) into blocks 11, 3, 7, 0.
    assert worker.submit_load(2, [[11, 3, 7, 0]], [[5, 1]], first_sub_rows=[2])
    finish(worker, 2)
    assert [caches.read_row(0, b) for b in (11, 3, 7, 0)] == [rows[6], rows[7], rows[8], rows[9]]
    worker.shutdown()


@pytest.mark.parametrize(
    ("blocks", "slots", "first", "message"),
    [
        ([[0, 1, 2]], [[0]], [2], "3 device blocks from sub-row 2 for 1 slots"),  # needs 2 slots
        ([[0]], [[0, 1]], [0], "1 device blocks from sub-row 0 for 2 slots"),  # a slot left unused
        ([[0]], [[0]], [4], "from sub-row 4"),  # past the slot
        ([[]], [[]], [1], "0 device blocks from sub-row 1"),
    ],
)
def test_sub_row_placement_that_does_not_fit_is_rejected(blocks, slots, first, message):
    kv, groups = per_layer_blocks_first()
    caches = canonicalize(kv, groups)
    host = HostTier([caches.row_bytes(0) * 4], 4 * caches.row_bytes(0) * 4)
    worker = OffloadingWorker(caches, host, blocks_per_row=4)
    with pytest.raises(ValueError, match=message):
        worker.submit_store(1, blocks, slots, first_sub_rows=first)
    assert worker.get_finished() == []


@pytest.mark.parametrize("layout", [per_layer_blocks_first, packed_views])
def test_two_devices_share_padded_sub_rows_without_touching_each_other(layout):
    kv_a, groups = layout()
    kv_b, _ = layout()
    caches_a, caches_b = canonicalize(kv_a, groups), canonicalize(kv_b, groups)
    block = caches_a.row_bytes(0)
    band = block + 64  # padding after each device's bytes
    sub_row = 2 * band
    host = HostTier([2 * sub_row], 6 * 2 * sub_row)
    host.buffer.zero_()
    workers = [
        OffloadingWorker(
            caches, host, blocks_per_row=2, host_block_bytes=[sub_row], host_offset_bytes=[rank * band]
        )
        for rank, caches in enumerate((caches_a, caches_b))
    ]
    rows = [{b: caches.read_row(0, b) for b in range(4)} for caches in (caches_a, caches_b)]
    for rank, worker in enumerate(workers):
        assert worker.submit_store(rank + 1, [[0, 1, 2, 3]], [[4, 1]])
        finish(worker, rank + 1)
    slab = host.slabs[0]
    # Slot 4's first sub-row: device A's block 0, then device B's block 0, each in its band.
    assert slab[4, :block].numpy().tobytes() == rows[0][0]
    assert slab[4, band : band + block].numpy().tobytes() == rows[1][0]
    assert torch.count_nonzero(slab[4, block:band]) == 0  # padding untouched
    for kv in (kv_a, kv_b):
        scramble(kv)
    for rank, worker in enumerate(workers):
        assert worker.submit_load(rank + 10, [[3, 2, 1, 0]], [[4, 1]])
        finish(worker, rank + 10)
    for caches, stored in zip((caches_a, caches_b), rows, strict=True):
        assert [caches.read_row(0, b) for b in (3, 2, 1, 0)] == [stored[b] for b in range(4)]


def test_a_band_that_does_not_fit_its_sub_row_is_an_error():
    kv, groups = per_layer_blocks_first()
    caches = canonicalize(kv, groups)
    block = caches.row_bytes(0)
    host = HostTier([2 * block], 4 * 2 * block)
    with pytest.raises(ValueError, match="does not fit"):
        OffloadingWorker(caches, host, host_block_bytes=[2 * block], host_offset_bytes=[block + 8])
