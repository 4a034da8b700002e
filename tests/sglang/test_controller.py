"""SGLang 0.5.23's own ``HiCacheController`` moving pages between its own CPU host pools
(``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``, built on SGLang's device pools with
``device="cpu"``) and kvtier, attached as SGLang attaches it: ``storage_backend="dynamic"``
with kvtier's extra config (``interface_v1``: the zero-copy ``batch_get_v1`` /
``batch_set_v1`` path), a disk tier in a tmp dir.

The test plays the scheduler: it queues a backup (``write_storage``) and waits for the backup
thread's ack; it queues a prefetch (``prefetch``), waits for the prefetch thread's hit query
(``batch_exists``), allocates host pages as the radix cache does and hands the operation to
the IO thread (``batch_get_v1``), then waits for the ``PrefetchAck`` that ends the request.
Every wait is on one of the controller's own queues, with a deadline.

Where torchvision does not import, ``tests.sglang.without_torchvision`` lets SGLang's model
configs import (its docstring says which two modules need torchvision and why they are
unused here). Skipped where SGLang does not import, unless ``KVTIER_REQUIRE_SGLANG=1``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    from tests.sglang.without_torchvision import import_sglang_configs

    import_sglang_configs()
    from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel
except Exception as exc:  # not installed, or its imports fail on this machine
    if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
        raise
    pytest.skip(f"SGLang's cache controller does not import here: {exc!r}", allow_module_level=True)

from bench.sglang_pool import dynamic_config
from offload.sglang import KVTierStorage, page_key
from tests.sglang.conftest import disk

PAGE = 16  # tokens per page
DEVICE_TOKENS = 160  # the host pool holds twice that, plus SGLang's padding page: 21 pages
DEADLINE_S = 30.0  # for one of the controller's threads to answer (it answers in milliseconds)
LAYOUTS = ["page_first", "layer_first", "page_first_direct"]


def build_pools(kind: str, layout: str) -> tuple[Any, Any]:
    """SGLang's device pool on the CPU and its host pool, as ``hybrid_pool_assembler``
    builds them (without pinning: pinning needs CUDA)."""
    if kind == "mha":
        device = MHATokenToKVPool(
            size=DEVICE_TOKENS,
            page_size=PAGE,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=32,
            layer_num=3,
            device="cpu",
            enable_memory_saver=False,
        )
        info = device.get_device_pool_infos()[0].buffer_info
        host = MHATokenToKVPoolHost(
            info,
            2.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
        )
        return device, host
    device = MLATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        override_kv_cache_dim=device.kv_cache_dim,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        target_layer_num=device.layer_num,
    )
    return device, host


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Callable[..., HiCacheController]]:
    """``controller(kind, layout)``: a ``HiCacheController`` over a fresh host pool with kvtier
    attached (one TP rank); detached (threads joined, kvtier closed) at the end."""
    made: list[HiCacheController] = []

    def make(kind: str = "mha", layout: str = "page_first") -> HiCacheController:
        device, host = build_pools(kind, layout)
        allocator = TokenToKVPoolAllocator(DEVICE_TOKENS, torch.bfloat16, "cpu", device, need_sort=False)
        with get_parallel().override(
            attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1
        ):
            cc = HiCacheController(
                allocator,
                host,
                PAGE,
                tp_group=None,
                load_cache_event=threading.Event(),
                storage_backend="dynamic",
                model_name="test/tiny-model",
                storage_backend_extra_config=dynamic_config([disk(tmp_path / "disk")]),
            )
        made.append(cc)
        assert isinstance(cc.storage_backend, KVTierStorage)
        assert cc.page_get_func == cc._page_get_zero_copy  # interface_v1: batch_get_v1 / batch_set_v1
        assert cc.storage_config.is_mla_model == (kind == "mla")
        return cc

    yield make
    for cc in made:
        cc.detach_storage_backend()


def answer(q: queue.Queue) -> Any:
    """The next item a controller thread puts on ``q``, within the deadline."""
    try:
        return q.get(timeout=DEADLINE_S)
    except queue.Empty:
        pytest.fail(f"no answer from the cache controller within {DEADLINE_S} s")


def tokens(doc: int, pages: int) -> list[int]:
    return [1000 * doc + i for i in range(pages * PAGE)]


def fill(host: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Random bytes into every page of ``host_indices`` (each layer, K and V)."""
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, len(host_indices), PAGE):
        flat = host.get_data_page(int(host_indices[start]), flat=True)
        data = torch.randint(
            0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8, generator=generator
        )
        host.set_from_flat_data_page(int(host_indices[start]), data.view(flat.dtype).reshape(flat.shape))


def pages(host: Any, host_indices: torch.Tensor) -> list[bytes]:
    """The bytes of each page of ``host_indices``, as SGLang's host pool gathers them."""
    return [
        host.get_data_page(int(host_indices[start]), flat=True).view(torch.uint8).numpy().tobytes()
        for start in range(0, len(host_indices), PAGE)
    ]


def backup(cc: HiCacheController, host_indices: torch.Tensor, token_ids: list[int]) -> list[str]:
    """The controller's backup path (``write_storage`` -> backup thread -> ``batch_set_v1``);
    returns the page keys, chained over the tokens as SGLang computes them."""
    hashes = get_storage_hash_str(token_ids, None, page_size=PAGE)
    op_id = cc.write_storage(host_indices, token_ids, hash_value=hashes)
    ack = answer(cc.ack_backup_queue)
    assert ack.id == op_id
    assert ack.completed_tokens == len(token_ids)  # every batch_set_v1 returned all True
    return hashes


def query(cc: HiCacheController, rid: str, token_ids: list[int]) -> PrefetchOperation:
    """The prefetch thread's hit query (``batch_exists``) for ``token_ids``."""
    operation = cc.prefetch(rid, token_ids)
    assert answer(cc.prefetch_hit_queue) is operation
    return operation


def load(
    cc: HiCacheController, operation: PrefetchOperation, before_io: Callable[[], None] = lambda: None
) -> tuple[torch.Tensor, int]:
    """What the radix cache does with a hit: host pages for it, then the IO thread
    (``batch_get_v1``); returns the host indices and the tokens the acks report loaded."""
    host_indices = cc.alloc_prefetch_host_buffers(operation, operation.storage_hit_count)
    assert host_indices is not None
    operation.host_indices = host_indices
    before_io()
    cc.prefetch_buffer.put(operation)
    loaded = 0
    while True:
        ack = answer(cc.ack_prefetch_queue)
        assert ack.rid == operation.request_id
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.completed_req:
            return host_indices, loaded


def wipe_host_pool(host: Any) -> None:
    host.kv_buffer.view(torch.uint8).fill_(0x5A)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_the_controller_backs_up_and_prefetches_pages_bit_exact(controller, kind, layout):
    cc = controller(kind, layout)
    host = cc.mem_pool_host
    doc_a, doc_b = tokens(1, 4), tokens(2, 4)
    src_a, src_b = host.alloc(len(doc_a)), host.alloc(len(doc_b))
    fill(host, src_a, seed=1)
    fill(host, src_b, seed=2)
    sent_a, sent_b = pages(host, src_a), pages(host, src_b)
    backup(cc, src_a, doc_a)
    backup(cc, src_b, doc_b)
    wipe_host_pool(host)
    assert pages(host, src_a) != sent_a

    op_a = query(cc, "doc-a", doc_a)
    assert op_a.storage_hit_count == len(doc_a)
    dst_a, loaded = load(cc, op_a)
    assert loaded == len(doc_a)
    assert set(dst_a.tolist()).isdisjoint(src_a.tolist())  # other host pages than the sources
    assert pages(host, dst_a) == sent_a

    op_b = query(cc, "doc-b", doc_b)
    dst_b, loaded = load(cc, op_b)
    assert loaded == len(doc_b)
    assert pages(host, dst_b) == sent_b  # its own pages, not doc A's
    assert all(a != b for a, b in zip(pages(host, dst_b), sent_a, strict=True))

    unknown = doc_a.copy()
    unknown[0] += 1  # one token differs: every chained page key differs
    assert query(cc, "doc-c", unknown).storage_hit_count == 0


@pytest.mark.parametrize("when", ["before_the_query", "after_the_query"])
def test_a_hole_at_page_k_stops_the_controllers_prefetch_at_k(controller, when):
    cc = controller()
    host, storage = cc.mem_pool_host, cc.storage_backend
    doc, k = tokens(3, 5), 2
    src = host.alloc(len(doc))
    fill(host, src, seed=3)
    sent = pages(host, src)
    hashes = backup(cc, src, doc)
    wipe_host_pool(host)
    wiped = pages(host, src)[0]

    def delete_page_k() -> None:  # kvtier's own delete (what the backend's clear uses)
        assert all(storage._engine.call_delete(0, [page_key(hashes[k])]).result(DEADLINE_S).ok)

    if when == "before_the_query":
        delete_page_k()
    operation = query(cc, "holed", doc)
    if when == "before_the_query":  # batch_exists stops at the hole
        assert operation.storage_hit_count == k * PAGE
        assert operation.hash_value == hashes[:k]
        dst, loaded = load(cc, operation)
    else:  # found by batch_exists, gone when batch_get_v1 runs
        assert operation.storage_hit_count == len(doc)
        dst, loaded = load(cc, operation, before_io=delete_page_k)
    assert loaded == k * PAGE
    got = pages(host, dst)
    assert got[:k] == sent[:k]
    assert got[k:] == [wiped] * (len(got) - k)  # nothing at or past the hole was written
