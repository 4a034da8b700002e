"""The CUDA path: the same round trips as the CPU tests, with the KV caches on a GPU.

Skipped where CUDA is absent (CI, this project's dev machines); run on a GPU server with
``pytest tests/offload/test_cuda.py``. What only this path exercises: the copy stream and
its events (``CudaCopyStream``), pinned host slabs, the device staging buffer of per-layer
layouts (gather in device memory, one DMA per run of rows), and conversion on load on the
device (a row of another layout is DMAed raw, rewritten in device memory, scattered).
"""

from __future__ import annotations

import os

import pytest
import torch

from offload.keys import make_key
from offload.streams import CudaCopyStream
from tests.offload.kv_engines import ENGINES, ROW_TOKENS, blocks_per_key, engine, logical_kv
from tests.offload.layouts import LAYOUTS, NUM_BLOCKS, per_layer_blocks_first, scramble
from tests.offload.test_worker import finish, make_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)


def on_device(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``kv`` moved to the GPU, with views of one allocation still views of one allocation
    (a packed layout's layers, a hybrid model's shared tensors)."""
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in kv.items():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in moved:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            moved[storage.data_ptr()] = whole.to(DEVICE)
        base = moved[storage.data_ptr()]
        view = torch.empty(0, dtype=tensor.dtype, device=DEVICE)
        out[name] = view.set_(base.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_round_trip_on_the_gpu_is_byte_exact(name):
    kv_cpu, groups = LAYOUTS[name]()
    kv = on_device(kv_cpu)
    caches, worker = make_worker(kv, groups)
    assert caches.device.type == "cuda"
    assert isinstance(worker._stream, CudaCopyStream)
    assert worker.host.pinned
    g_count = caches.num_groups
    blocks = [[(g * 2 + i) % NUM_BLOCKS for i in range(2)] for g in range(g_count)]
    slots = [[5, 1] for _ in range(g_count)]
    before = {(g, b): caches.read_row(g, b) for g in range(g_count) for b in blocks[g]}
    assert worker.submit_store(1, blocks, slots)
    finish(worker, 1)
    for g in range(g_count):  # the host rows hold the device bytes
        for b, s in zip(blocks[g], slots[g], strict=True):
            assert worker.host.row(g, s).numpy().tobytes() == before[g, b]
    scramble(kv)
    assert worker.submit_load(2, blocks, slots)
    finish(worker, 2)
    assert {(g, b): caches.read_row(g, b) for g, b in before} == before
    worker.shutdown()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_host_tier_shared_through_dev_shm_is_pinned():
    from tiers.host import HostTier

    path = f"/dev/shm/kvtier_test_{os.getpid()}.mmap"
    host = HostTier([4096], 4 * 4096, shm_path=path)
    try:
        assert host.pinned
        row = torch.arange(4096, device=DEVICE).to(torch.uint8)
        host.row(0, 1).copy_(row, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host.row(0, 1), row.cpu())
    finally:
        host.close(unlink=True)


def test_a_store_issued_right_after_a_kernel_sees_its_writes():
    """The copy stream waits for the compute stream: a store issued while the kernel that
    writes the blocks may still run copies what it wrote, not what was there before."""
    kv, groups = per_layer_blocks_first()
    kv = on_device(kv)
    _, worker = make_worker(kv, groups)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning on the compute stream, then the writes
    for tensor in kv.values():
        tensor.fill_(3.0)  # queued behind the spin; not waited for
    assert worker.submit_store(1, [[0, 1]], [[0, 1]])
    finish(worker, 1)
    expected = torch.full_like(kv["layer.0"][0], 3.0).cpu().view(torch.int16).numpy().tobytes()
    assert worker.host.row(0, 0).numpy().tobytes()[: len(expected)] == expected
    worker.shutdown()


def test_partial_rows_of_several_blocks_load_from_the_middle_of_a_slot():
    kv, groups = per_layer_blocks_first()
    kv = on_device(kv)
    caches, worker = make_worker(kv, groups, slots=4, blocks_per_row=2)
    before = [caches.read_row(0, b) for b in (7, 3, 10, 0)]
    assert worker.submit_store(1, [[7, 3, 10, 0]], [[2, 0]])
    finish(worker, 1)
    scramble(kv)
    # Blocks 3, 10 (second half of slot 2, first half of slot 0) into device blocks 5, 6.
    assert worker.submit_load(2, [[5, 6]], [[2, 0]], first_sub_rows=[1])
    finish(worker, 2)
    assert [caches.read_row(0, b) for b in (5, 6)] == before[1:3]
    worker.shutdown()


def _stored_prompt(tmp_path, writer, logical, rows):
    config = {
        "namespace": {"model": "test/cuda"},
        "tiers": [
            {"kind": "host", "capacity": "1MiB"},
            {"kind": "disk", "path": str(tmp_path / "lmdb"), "capacity": "8MiB",
             "placement": "write-through", "admission": "all"},
        ],
    }  # fmt: skip
    keys = [make_key(f"prompt/{i}".encode().ljust(16, b"."), 0) for i in range(rows)]
    engine_a, kv = writer.offloader(config, rows * blocks_per_key(writer), ROW_TOKENS, device=DEVICE)
    with engine_a:
        writer.fill(kv, logical, list(range(rows * blocks_per_key(writer))))
        engine_a.store(keys, list(range(rows * blocks_per_key(writer))))
        engine_a.wait()
        engine_a.wait_tiers()
    return config, keys


@pytest.mark.parametrize("convert_on_load", [True, False], ids=["in-worker", "on-landing"])
@pytest.mark.parametrize("reader", ENGINES, ids=lambda spec: spec.name)
def test_a_prefix_stored_by_another_layout_loads_on_the_gpu(tmp_path, reader, convert_on_load):
    """Written by a per-layer NHD engine with 64-token blocks through the disk tier, read by
    every other layout with its caches on the GPU: converted on the device as it loads
    (the GPU default) or on landing in the host tier."""
    rows = 3
    writer = engine("nhd", 64)
    logical = logical_kv(7, rows)
    config, keys = _stored_prompt(tmp_path, writer, logical, rows)
    per = blocks_per_key(reader)
    engine_b, kv = reader.offloader(config, rows * per + 2, ROW_TOKENS, convert_on_load=convert_on_load,
                                    device=DEVICE)  # fmt: skip
    with engine_b:
        for _ in range(3):
            engine_b.lookup(keys)
            engine_b.wait_tiers()
        assert engine_b.lookup(keys) == rows
        block_ids = list(range(2, 2 + rows * per))[::-1]
        job = engine_b.load(keys, block_ids)
        (result,) = engine_b.wait([job])
        assert result.success
        got = reader.read(kv, block_ids).cpu()
        assert torch.equal(got.view(torch.int16), logical.view(torch.int16))
        converted = engine_b.stats()["lower"]["rows_converted"]
        # Packed or per layer, NHD with 64-token blocks is the writer's very row layout.
        same_layout = reader.kind in ("nhd", "packed") and reader.block_tokens == writer.block_tokens
        assert converted == (0 if same_layout else rows)
        assert engine_b.worker.rows_converted == (converted if convert_on_load else 0)
