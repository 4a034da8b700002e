"""Who owns a key among the remote tier's peers: **rendezvous hashing**.

Each key goes to the reachable peer with the highest ``xxh3(key, seed=hash(peer address))``,
so when a peer leaves only its keys move (each to its second choice) and when it comes back
they move back: no directory, no rebalancing. Keys that lived on a peer that left are misses
(a cache may lose rows; it may not invent them).

Pure functions of keys and addresses: which peers are up is ``membership``'s job, moving the
rows ``data_plane``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import xxhash

from tiers.remote.protocol import MAX_KEY_BYTES

_T = TypeVar("_T")


def peer_seed(address: str) -> int:
    """The hash seed of the peer at ``address`` (its share of the key space follows from it)."""
    return xxhash.xxh3_64_intdigest(address.encode())


def rendezvous_owner(key: bytes, addresses: Sequence[str]) -> str:
    """The address among ``addresses`` that owns ``key`` (the wire key: namespace + key)."""
    return max(addresses, key=lambda a: xxhash.xxh3_64_intdigest(key, seed=peer_seed(a)))


def wire_keys(namespace: bytes, keys: Sequence[bytes]) -> list[bytes]:
    """Keys as the peers see them: namespace first (which keeps tenants apart)."""
    wire = [namespace + bytes(k) for k in keys]
    if any(len(w) > MAX_KEY_BYTES for w in wire):
        raise ValueError(f"namespace + key longer than {MAX_KEY_BYTES} bytes")
    return wire


def group_by_owner(wire: Sequence[bytes], owners: Sequence[_T], seeds: Sequence[int]) -> dict[_T, list[int]]:
    """The indexes of ``wire`` keys per owner, each key to the owner (of ``owners``, whose
    seeds are ``seeds``) with the highest hash; one owner takes every key unhashed."""
    if not owners:
        return {}
    if len(owners) == 1:
        return {owners[0]: list(range(len(wire)))}
    groups: dict[_T, list[int]] = {}
    candidates = list(zip(seeds, owners, strict=True))
    for i, key in enumerate(wire):
        _, best = max(candidates, key=lambda c: xxhash.xxh3_64_intdigest(key, seed=c[0]))
        groups.setdefault(best, []).append(i)
    return groups


def batches(idxs: list[int], size: int) -> list[list[int]]:
    """``idxs`` cut into runs of at most ``size`` (keys per control request)."""
    return [idxs[i : i + size] for i in range(0, len(idxs), size)]


def batches_by_bytes(idxs: list[int], sizes: Sequence[int], max_bytes: int, max_keys: int) -> list[list[int]]:
    """``idxs`` cut into runs of at most ``max_bytes`` of rows (``sizes[i]`` each; one row at
    least) and at most ``max_keys`` keys: one request, and one transfer of the peer's, each.
    At most, not about: a peer refuses a request over its ``--max-request-bytes``."""
    out: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i in idxs:
        if run and (size + sizes[i] > max_bytes or len(run) >= max_keys):
            out.append(run)
            run, size = [], 0
        run.append(i)
        size += sizes[i]
    if run:
        out.append(run)
    return out
