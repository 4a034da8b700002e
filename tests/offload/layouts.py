"""KV-cache layouts engines use, built small with random bytes, for the round-trip tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

NUM_BLOCKS = 12
TOKENS, HEADS, HEAD_DIM = 4, 2, 8
DTYPE = torch.bfloat16

Layout = tuple[dict[str, torch.Tensor], list[list[str]]]


def _random(shape: tuple[int, ...]) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=DTYPE)
    tensor.view(torch.int16).random_()
    return tensor


def per_layer_blocks_first(layers: int = 3) -> Layout:
    """``[num_blocks, 2, tokens, heads, dim]`` per layer: K and V of a block adjoin."""
    kv = {f"layer.{i}": _random((NUM_BLOCKS, 2, TOKENS, HEADS, HEAD_DIM)) for i in range(layers)}
    return kv, [list(kv)]


def per_layer_kv_first(layers: int = 3) -> Layout:
    """``[2, num_blocks, tokens, heads, dim]`` per layer: K and V are apart."""
    kv = {f"layer.{i}": _random((2, NUM_BLOCKS, TOKENS, HEADS, HEAD_DIM)) for i in range(layers)}
    return kv, [list(kv)]


def packed_views(layers: int = 3) -> Layout:
    """vLLM's cross-layer layout: every layer a view into one ``[blocks, layers, 2, ...]`` tensor."""
    packed = _random((NUM_BLOCKS, layers, 2, TOKENS, HEADS, HEAD_DIM))
    kv = {f"layer.{i}": packed[:, i] for i in range(layers)}
    return kv, [list(kv)]


def packed_tensor(layers: int = 3) -> Layout:
    """The cross-layer tensor handed over whole, as one entry."""
    return {"packed": _random((NUM_BLOCKS, layers, 2, TOKENS, HEADS, HEAD_DIM))}, [["packed"]]


def mla(layers: int = 3) -> Layout:
    """MLA's latent cache ``[num_blocks, tokens, latent_dim]``."""
    kv = {f"layer.{i}": _random((NUM_BLOCKS, TOKENS, 72)) for i in range(layers)}
    return kv, [list(kv)]


def hybrid(layers: int = 34, tensors: int = 5) -> Layout:
    """A hybrid model (gemma-3-like): 34 layers in 7 groups over 5 shared tensors.

    Layer ``j`` of every group uses tensor ``j``: the groups' block tables index the same
    physical memory, as vLLM's hybrid allocator lays it out.
    """
    shared = [_random((NUM_BLOCKS, 2, TOKENS, HEADS, HEAD_DIM)) for _ in range(tensors)]
    kv: dict[str, torch.Tensor] = {}
    groups: list[list[str]] = []
    for first in range(0, layers, tensors):
        group = [f"layer.{i}" for i in range(first, min(layers, first + tensors))]
        for j, name in enumerate(group):
            kv[name] = shared[j]
        groups.append(group)
    return kv, groups


LAYOUTS: dict[str, Callable[[], Layout]] = {
    "per_layer_blocks_first": per_layer_blocks_first,
    "per_layer_kv_first": per_layer_kv_first,
    "packed_views": packed_views,
    "packed_tensor": packed_tensor,
    "mla": mla,
    "hybrid": hybrid,
}


def scramble(kv: dict[str, torch.Tensor]) -> None:
    """Overwrite every device byte (each shared tensor once is enough; twice is harmless)."""
    for tensor in kv.values():
        tensor.view(torch.int16).random_()
