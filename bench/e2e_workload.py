"""One engine's replay of a block-key trace through ``offload.api.Offloader``, moving real bytes.

The engine is modelled the way vLLM's scheduler and worker use the offloading connector,
one request at a time:

1. A device KV cache of ``device_blocks`` blocks (a CPU tensor here) with LRU prefix
   caching: the longest prefix it holds needs no transfer ("device" tokens).
2. ``Offloader.lookup`` for the rest. Rows found only in the disk or remote tier are
   promoted in the background; the request waits for them (polling, as a scheduler
   retries a ``HIT_PENDING`` request each step) and that wait is part of its load latency.
3. ``load`` of the hits into free device blocks, each then byte-checked against the
   pattern its key determines, so a wrong or torn row can never pass unnoticed.
4. "Recompute" of the misses: the key's pattern is written into its device block (prefill
   cost itself is modelled separately, see ``bench.ttft``), then ``store``.

Which tier served a promoted row is read from the tiers' own counters before and after
(``Offloader.stats()['tiers']``), as an operator would read them.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bench.traces import Request
from offload.api import Offloader
from offload.keys import OffloadKey, make_key
from offload.manager import Lookup

SOURCES = ("device", "host", "disk", "remote", "recomputed")
LOWER_TIERS = ("disk", "remote")
PROMOTION_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Shape:
    """The scaled Llama-like KV group the benchmark moves (a block is one packed row)."""

    layers: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    block_tokens: int = 32
    dtype: torch.dtype = torch.float16

    @property
    def block_bytes(self) -> int:
        return self.layers * 2 * self.block_tokens * self.kv_heads * self.head_dim * self.dtype.itemsize

    def describe(self) -> str:
        return (
            f"{self.layers} layers x K,V x {self.block_tokens} tokens x {self.kv_heads} KV heads x head dim "
            f"{self.head_dim}, {str(self.dtype).removeprefix('torch.')}: "
            f"{self.block_bytes // 1024} KiB per block"
        )


def block_key(salt: str, block: int) -> OffloadKey:
    """The ``OffloadKey`` of a trace block; ``salt`` keeps workloads (and the miss path) apart."""
    return make_key(hashlib.blake2b(f"{salt}:{block}".encode(), digest_size=16).digest(), 0)


def pattern(key: bytes, nbytes: int) -> torch.Tensor:
    """The bytes a block of ``key`` holds: what "prefill" writes and every load must give back."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1
    words = torch.randint(
        -(2**62), 2**62, (nbytes // 8,), dtype=torch.int64, generator=torch.Generator().manual_seed(seed)
    )
    return words.view(torch.uint8)  # 64-bit draws: 4x faster than bytes, every byte still random


TAIL_BLOCKS = 4


def clip(keys: Sequence[int], max_blocks: int) -> Sequence[int]:
    """A prompt cut to ``max_blocks``: its first blocks and its last ``TAIL_BLOCKS``.

    Keeping the tail keeps what makes a request distinct (the question after a long
    document, the newest turn); every request that holds a kept tail block holds the same
    dropped middle, so the cut trace is still prefix-consistent.
    """
    if len(keys) <= max_blocks:
        return keys
    tail = min(TAIL_BLOCKS, max_blocks // 4)
    return (*keys[: max_blocks - tail], *keys[len(keys) - tail :])


class DeviceCache:
    """The engine's KV cache (packed cross-layer layout) and its LRU prefix cache of block keys."""

    def __init__(self, shape: Shape, num_blocks: int) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.packed = torch.zeros(
            (num_blocks, shape.layers, 2, shape.block_tokens, shape.kv_heads, shape.head_dim),
            dtype=shape.dtype,
        )
        self.rows = self.packed.view(num_blocks, -1).view(torch.uint8)
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # least recent first: key -> block
        self.free = list(range(num_blocks))

    def kv_caches(self) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(self.shape.layers)]
        return {name: self.packed[:, i] for i, name in enumerate(names)}, [names]

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        hits = 0
        for key in keys:
            if key not in self.cached:
                break
            hits += 1
        return hits

    def drop(self, keys: Sequence[bytes]) -> None:
        """Free the blocks of ``keys`` (cached past a miss: a prefix cache cannot use them)."""
        for key in keys:
            block = self.cached.pop(key, None)
            if block is not None:
                self.free.append(block)

    def allocate(self, count: int, keep: Sequence[bytes]) -> list[int]:
        """``count`` free blocks, evicting least recently used cached blocks not in ``keep``."""
        protected = set(keep)
        victims = [key for key in self.cached if key not in protected][: max(0, count - len(self.free))]
        for key in victims:
            self.free.append(self.cached.pop(key))
        if len(self.free) < count:
            raise ValueError(f"a request of {count} new blocks does not fit {self.num_blocks} device blocks")
        out, self.free = self.free[:count], self.free[count:]
        return out

    def commit(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        """The request is done: its blocks stay cached, refreshed tail first (vLLM frees them so)."""
        for key, block in zip(reversed(keys), reversed(blocks), strict=True):
            self.cached[key] = block
            self.cached.move_to_end(key)


@dataclass
class Tally:
    """What one replay measured."""

    requests: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    latency_s: dict[str, list[float]] = field(default_factory=lambda: {"host": [], "disk": [], "remote": []})
    copy_s: dict[str, float] = field(default_factory=lambda: {"host": 0.0, "disk": 0.0, "remote": 0.0})
    rows: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0, "remote": 0})
    per_request: list[dict[str, int]] = field(default_factory=list)
    checked_blocks: int = 0
    stored_blocks: int = 0
    failed_stores: int = 0
    wall_s: float = 0.0


def _lower_hits(offloader: Offloader) -> dict[str, int]:
    tiers = offloader.stats().get("tiers", {})
    assert isinstance(tiers, dict)
    return {kind: int(tiers[kind].get("hits", 0)) for kind in tiers if kind in LOWER_TIERS}


def lookup_landed(offloader: Offloader, keys: Sequence[OffloadKey]) -> int:
    """Leading ``keys`` loadable now, after waiting for the promotions ``lookup`` started."""
    deadline = time.perf_counter() + PROMOTION_TIMEOUT_S
    lower = offloader.manager.lower
    failed = lower.stats.promotions_failed
    hits = offloader.lookup(keys)
    while hits < len(keys) and time.perf_counter() < deadline:
        if offloader.manager.lookup(keys[hits]) is not Lookup.HIT_PENDING:
            break  # a miss: the rest is recomputed
        if lower.stats.promotions_failed != failed:
            break  # a promotion failed (e.g. the peer evicted the row): recompute from there
        time.sleep(0.0002)
        offloader.poll()
        hits = offloader.lookup(keys)
    return hits


class Replay:
    """Runs requests through a device cache and (optionally) an ``Offloader``."""

    def __init__(self, device: DeviceCache, offloader: Offloader | None, salt: str, max_blocks: int) -> None:
        self.device = device
        self.offloader = offloader
        self.salt = salt
        self.max_blocks = max_blocks
        self.tally = Tally()

    def run(self, requests: Sequence[Request], progress: Callable[[int], None] | None = None) -> Tally:
        start = time.perf_counter()
        for index, request in enumerate(requests):
            self.request([block_key(self.salt, b) for b in clip(request.keys, self.max_blocks)])
            if progress is not None:
                progress(index + 1)
        if self.offloader is not None:
            self.offloader.wait()
            self.offloader.wait_tiers()
        self.tally.wall_s = time.perf_counter() - start
        return self.tally

    def request(self, keys: list[OffloadKey]) -> None:
        tally, device, bytes_per_block = self.tally, self.device, self.device.shape.block_bytes
        tokens = device.shape.block_tokens
        tally.requests += 1
        d = device.prefix_hits(keys)
        rest = keys[d:]
        blocks = [device.cached[k] for k in keys[:d]]
        device.drop(rest)
        new_blocks = device.allocate(len(rest), keys[:d])
        hits, lower, served = 0, {}, dict.fromkeys(("host", "disk", "remote"), 0)
        offloader = self.offloader
        if offloader is not None and rest:
            before = _lower_hits(offloader)  # the counters are read outside the timed spans
            t0 = time.perf_counter()
            hits = lookup_landed(offloader, rest)
            promote_s = time.perf_counter() - t0
            after = _lower_hits(offloader)
            lower = {kind: after[kind] - before.get(kind, 0) for kind in after}
            lower = {kind: n for kind, n in lower.items() if n > 0}
            t1 = time.perf_counter()
            if hits:
                job = offloader.load(rest[:hits], new_blocks[:hits])
                results = offloader.wait([job])
                if not all(r.success for r in results):
                    raise RuntimeError(f"{self.salt}: a load failed")
            load_s = time.perf_counter() - t1
            served = self._count_hits(hits, lower, promote_s, load_s, promote_s + load_s)
            self._check(rest[:hits], new_blocks[:hits])
        tally.tokens["device"] += d * tokens
        tally.tokens["recomputed"] += (len(rest) - hits) * tokens
        tally.per_request.append(
            {
                "device": d * tokens,
                **{k: n * tokens for k, n in served.items()},
                "recomputed": (len(rest) - hits) * tokens,
            }
        )
        for key, block in zip(rest[hits:], new_blocks[hits:], strict=True):
            device.rows[block].copy_(pattern(key, bytes_per_block))
        if offloader is not None and len(rest) > hits:
            job = offloader.store(rest[hits:], new_blocks[hits:])
            if job is None:
                tally.failed_stores += len(rest) - hits
            else:
                results = offloader.wait([job])
                tally.stored_blocks += len(rest) - hits
                tally.failed_stores += sum(not r.success for r in results)
        device.commit(keys, blocks + new_blocks)

    def _check(self, keys: Sequence[OffloadKey], blocks: Sequence[int]) -> None:
        """Every loaded block must hold the bytes its key was stored with (checked untimed)."""
        for key, block in zip(keys, blocks, strict=True):
            if not torch.equal(self.device.rows[block], pattern(key, self.device.shape.block_bytes)):
                raise RuntimeError(f"{self.salt}: block {key.hex()} loaded other bytes than were stored")
        self.tally.checked_blocks += len(keys)

    def _count_hits(
        self, hits: int, lower: dict[str, int], promote_s: float, load_s: float, total_s: float
    ) -> dict[str, int]:
        """Split ``hits`` into host and lower-tier rows (returned); a request's latency goes to the
        slowest tier it used."""
        tally, tokens = self.tally, self.device.shape.block_tokens
        from_lower = dict.fromkeys(("disk", "remote"), 0)
        left = hits
        for kind in ("disk", "remote"):  # promotions counted beyond the loaded prefix do not count
            from_lower[kind] = min(left, lower.get(kind, 0))
            left -= from_lower[kind]
        host = left
        for kind, n in (("host", host), *from_lower.items()):
            tally.tokens[kind] += n * tokens
            tally.rows[kind] += n
        lower_rows = sum(from_lower.values())
        for kind, n in from_lower.items():
            if n:
                tally.copy_s[kind] += promote_s * n / lower_rows
        if hits:
            tally.copy_s["host"] += load_s
            slowest = next((k for k in ("remote", "disk") if from_lower[k]), "host")
            tally.latency_s[slowest].append(total_s)
        return {"host": host, **from_lower}
