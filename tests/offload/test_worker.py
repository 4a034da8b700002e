import threading

import pytest
import torch

from offload.layout import canonicalize
from offload.streams import ThreadCopyStream
from offload.worker import OffloadingWorker
from tests.offload.layouts import LAYOUTS, NUM_BLOCKS, per_layer_blocks_first, scramble
from tiers.host import HostTier


def make_worker(kv, groups, slots=8, blocks_per_row=1, **kwargs):
    caches = canonicalize(kv, groups)
    rows = [caches.row_bytes(g) * blocks_per_row for g in range(caches.num_groups)]
    host = HostTier(rows, slots * sum(rows))
    return caches, OffloadingWorker(caches, host, blocks_per_row=blocks_per_row, **kwargs)


def finish(worker, job_id):
    worker.wait([job_id])
    results = worker.get_finished()
    assert [r.job_id for r in results] == [job_id]
    assert results[0].success
    return results[0]


@pytest.mark.parametrize("name", LAYOUTS)
def test_round_trip_is_byte_exact(name):
    kv, groups = LAYOUTS[name]()
    caches, worker = make_worker(kv, groups)
    g_count = caches.num_groups
    # Each group its own blocks (a hybrid model's groups share tensors, not blocks).
    blocks = (
        [[(g * 2 + i) % NUM_BLOCKS for i in range(2)] for g in range(g_count)] if g_count > 1 else [[9, 2, 7]]
    )
    slots = [[5, 1, 6][: len(b)] for b in blocks]
    before = {(g, b): caches.read_row(g, b) for g in range(g_count) for b in blocks[g]}

    assert worker.submit_store(1, blocks, slots)
    store = finish(worker, 1)
    assert store.transfer_size == sum(len(b) * caches.row_bytes(g) for g, b in enumerate(blocks))
    scramble(kv)
    assert all(caches.read_row(g, b) != before[g, b] for g, b in before)
    assert worker.submit_load(2, blocks, slots)
    finish(worker, 2)
    assert {(g, b): caches.read_row(g, b) for g, b in before} == before
    worker.shutdown()


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("parallelism", [1, 2])
def test_rows_scattered_over_the_slab_round_trip_in_a_bounded_number_of_tasks(name, parallelism):
    """Rows promoted into whatever slots were free fall in many short runs: they are copied
    by gather-then-scatter, at most two tasks per thread, and land byte for byte."""
    kv, groups = LAYOUTS[name]()
    caches, worker = make_worker(kv, groups, slots=NUM_BLOCKS)
    blocks = [3, 8, 0, 11, 5, 1, 9, 6, 2, 10]
    slots = [7, 2, 11, 0, 9, 4, 1, 6, 10, 3]  # ten runs of one row
    share = len(blocks) // caches.num_groups  # a hybrid model's groups share tensors, not blocks
    per_group = [blocks[g * share : (g + 1) * share] for g in range(caches.num_groups)]
    per_group_slots = [slots[g * share : (g + 1) * share] for g in range(caches.num_groups)]
    before = {(g, b): caches.read_row(g, b) for g, bs in enumerate(per_group) for b in bs}
    if caches.num_groups == 1:
        copier = worker.copiers[0]
        assert len(copier.tasks(blocks, slots, store=True, parallelism=parallelism)) <= 2 * parallelism
        assert len(copier.tasks(blocks, sorted(slots), store=True, parallelism=parallelism)) >= len(
            copier.columns
        )  # adjacent rows: one op per run and ref, as before

    assert worker.submit_store(1, per_group, per_group_slots)
    finish(worker, 1)
    scramble(kv)
    assert all(caches.read_row(g, b) != row for (g, b), row in before.items())
    assert worker.submit_load(2, per_group, per_group_slots)
    finish(worker, 2)
    assert {key: caches.read_row(*key) for key in before} == before
    worker.shutdown()


def test_load_into_other_blocks_leaves_the_rest_alone():
    kv, groups = per_layer_blocks_first()
    caches, worker = make_worker(kv, groups)
    stored = {b: caches.read_row(0, b) for b in (0, 1, 2)}
    assert worker.submit_store(1, [[0, 1, 2]], [[3, 4, 5]])
    finish(worker, 1)
    untouched = {b: caches.read_row(0, b) for b in range(6, NUM_BLOCKS)}
    assert worker.submit_load(2, [[5, 4, 3]], [[3, 4, 5]])
    finish(worker, 2)
    assert [caches.read_row(0, b) for b in (5, 4, 3)] == [stored[0], stored[1], stored[2]]
    assert {b: caches.read_row(0, b) for b in range(6, NUM_BLOCKS)} == untouched


def test_blocks_per_row_packs_consecutive_blocks_into_one_slot():
    kv, groups = per_layer_blocks_first()
    caches, worker = make_worker(kv, groups, slots=4, blocks_per_row=2)
    before = [caches.read_row(0, b) for b in (7, 3, 10, 0)]
    assert worker.submit_store(1, [[7, 3, 10, 0]], [[2, 0]])
    finish(worker, 1)
    host_row = worker.host.row(0, 2).numpy().tobytes()
    assert host_row == before[0] + before[1]
    scramble(kv)
    assert worker.submit_load(2, [[7, 3, 10, 0]], [[2, 0]])
    finish(worker, 2)
    assert [caches.read_row(0, b) for b in (7, 3, 10, 0)] == before


@pytest.mark.parametrize(
    ("blocks", "slots", "message"),
    [
        ([[1, 2]], [[1]], "2 device blocks for 1 slots"),
        ([[1, 2], [3]], [[1, 2], [3]], "expected block ids and slots for 1 groups"),
        ([[NUM_BLOCKS]], [[0]], "device blocks .* outside"),
        ([[0]], [[99]], "host slots .* outside"),
        ([[0, 1]], [[2, 2]], "a store writes a host slot twice"),
    ],
)
def test_bad_store_is_rejected_before_anything_moves(blocks, slots, message):
    kv, groups = per_layer_blocks_first()
    _caches, worker = make_worker(kv, groups)
    host_before = worker.host.buffer.clone()
    with pytest.raises(ValueError, match=message):
        worker.submit_store(1, blocks, slots)
    assert worker.get_finished() == []
    assert torch.equal(worker.host.buffer, host_before)


def test_load_writing_a_block_twice_is_rejected():
    kv, groups = per_layer_blocks_first()
    _caches, worker = make_worker(kv, groups)
    with pytest.raises(ValueError, match="writes a device block twice"):
        worker.submit_load(1, [[4, 4]], [[0, 1]])


def test_duplicate_job_id_is_rejected():
    kv, groups = per_layer_blocks_first()
    _caches, worker = make_worker(kv, groups)
    gate = threading.Event()
    blocked = ThreadCopyStream()
    blocked.submit([gate.wait])  # hold the stream so job 1 stays in flight
    worker._stream = blocked
    worker.submit_store(1, [[0]], [[0]])
    with pytest.raises(ValueError, match="job 1 is already in flight"):
        worker.submit_store(1, [[1]], [[1]])
    assert worker.get_finished() == []
    gate.set()
    worker.wait([1])
    assert [r.job_id for r in worker.get_finished()] == [1]


class FailingStream(ThreadCopyStream):
    """A stream whose copies raise, as a device error would."""

    def submit(self, tasks):
        def fail():
            raise RuntimeError("device lost")

        return super().submit([fail])


def test_a_failed_copy_is_a_failed_result_not_an_exception():
    kv, groups = per_layer_blocks_first()
    _caches, worker = make_worker(kv, groups, stream=FailingStream())
    worker.submit_store(7, [[0]], [[0]])
    worker.wait([7])
    (result,) = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (7, False, 0)


def test_jobs_finish_in_order_and_each_is_reported_once():
    kv, groups = per_layer_blocks_first()
    caches, worker = make_worker(kv, groups)
    original = caches.read_row(0, 0)
    worker.submit_store(1, [[0]], [[0]])
    worker.submit_load(2, [[11]], [[0]])  # must see job 1's bytes
    worker.wait([1, 2])
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
    assert worker.get_finished() == []
    assert caches.read_row(0, 11) == original
