"""vLLM's own CPU offloading manager on the simulator's traces, through its public methods.

Optional: vLLM is not a dependency of kvtier. ``vllm_version()`` says whether it imports;
everything else here is only called when it does.

The manager is driven the way vLLM 0.33's offloading connector drives it for one request
(``offloading/scheduler.py``): ``on_new_request``; ``lookup`` of the blocks after the
device's hit until the first miss; ``prepare_load`` and ``complete_load`` of the hits;
``prepare_store`` of the recomputed blocks (of every block when nothing was loaded: the
connector then offers the whole prompt, and the manager skips what it holds) and
``complete_store`` of what it accepted; ``on_request_finished``. Each key's end-token
position is set on the ``ReqContext`` as the connector does, which is how vLLM's LRU
orders a request's blocks tail first. Keys are ``OffloadKey`` bytes (block id + group 0).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from bench.simulate import SimResult
from bench.traces import Request

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 512
"""Tokens per block for the key positions (the production trace's block size)."""


def vllm_version() -> str | None:
    """vLLM's version if its offloading manager imports here, else ``None``."""
    try:
        importlib.import_module("vllm.v1.kv_offload.cpu.manager")
        vllm = importlib.import_module("vllm")
    except Exception as exc:  # any import failure means "not available"
        logger.info("vLLM's offloading manager does not import: %s", exc)
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def offload_key(block: int) -> bytes:
    """The ``OffloadKey`` vLLM would build for block id ``block`` in KV group 0."""
    return block.to_bytes(8, "big") + (0).to_bytes(4, "big")


def request_context(request: int, keys: Sequence[bytes], first_block: int = 0) -> Any:
    """vLLM's ``ReqContext`` for request number ``request`` whose ``keys`` are its blocks from
    block ``first_block`` on, each key's position set to the token its block ends at (as the
    connector sets them; vLLM's LRU and ARC order a request's keys by it)."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=str(request))
    for block, key in enumerate(keys, first_block + 1):
        ctx.set_offload_key_position(key, block * BLOCK_TOKENS)
    return ctx


def make_manager(capacity: int, policy: str) -> Any:
    """A ``CPUOffloadingManager`` of ``capacity`` chunks with vLLM's policy ``policy``."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)


def simulate_vllm(
    trace: Sequence[Request], capacity: int, policy: str, device_hits: Sequence[int]
) -> SimResult:
    """Replay ``trace`` below the same device cache with vLLM's manager as the host tier."""
    hits, stores = replay_vllm(trace, capacity, policy, device_hits)
    return SimResult(
        accesses=sum(len(r.keys) for r in trace),
        device_hits=sum(device_hits),
        tier_names=[f"vllm-{policy}"],
        tier_hits=[sum(hits)],
        tier_stores=[stores],
    )


def replay_vllm(
    trace: Sequence[Request], capacity: int, policy: str, device_hits: Sequence[int]
) -> tuple[list[int], int]:
    """Each request's blocks served by vLLM's manager (after its ``device_hits``), and the
    blocks it stored in all: what ``simulate_vllm`` sums and ``bench.e2e`` turns into tokens."""
    from vllm.v1.kv_offload.base import LookupResult

    manager = make_manager(capacity, policy)
    keys_of: dict[int, bytes] = {}
    hits: list[int] = []
    stores = 0
    for r, (request, d) in enumerate(zip(trace, device_hits, strict=True)):
        keys = [keys_of.get(k) or keys_of.setdefault(k, offload_key(k)) for k in request.keys]
        ctx = request_context(r, keys)
        manager.on_new_request(ctx)
        h = 0
        for key in keys[d:]:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            h += 1
        if h:
            loaded = keys[d : d + h]
            manager.prepare_load(loaded, ctx)
            manager.complete_load(loaded, ctx)
        hits.append(h)
        offer = keys[d + h :] if h else keys
        if offer:
            output = manager.prepare_store(offer, ctx)
            if output is not None and output.keys_to_store:
                manager.complete_store(output.keys_to_store, ctx)
                stores += len(output.keys_to_store)
        manager.on_request_finished(ctx)
    return hits, stores
