"""KV caches laid out the way different engines lay them out, from one logical KV sequence.

A prompt's KV is generated once, logically, as ``[layers, 2, tokens, heads, head_dim]``.
An ``EngineLayout`` puts it into device blocks the way one kind of engine does (NHD or
HND, a tensor per layer or one packed tensor, K and V together or apart, a block size) and
reads it back in logical order, so caches of engines with different layouts can be filled
with, and compared against, the same tokens. Used by ``kvtier bench convert`` and the
conversion tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload.api import Offloader

KINDS = ("nhd", "kv-apart", "hnd", "hnd-strides", "packed", "packed-hnd")
"""``nhd``: ``[blocks, 2, T, H, D]`` per layer (K and V of a block adjoin); ``kv-apart``:
``[2, blocks, T, H, D]`` per layer; ``hnd``: ``[blocks, 2, H, T, D]`` per layer, declared
HND; ``hnd-strides``: vLLM's HND, an NHD shape whose strides put heads outside tokens;
``packed``: cross-layer ``[blocks, layers, 2, T, H, D]`` (layers are views of it);
``packed-hnd``: the same with ``H, T`` inside."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    heads: int  # KV heads
    head_dim: int
    dtype: torch.dtype

    def logical_kv(self, tokens: int, seed: int) -> torch.Tensor:
        """``[layers, 2, tokens, heads, head_dim]`` of random values from ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        shape = (self.layers, 2, tokens, self.heads, self.head_dim)
        words = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
        return words.view(self.dtype) if self.dtype.itemsize == 2 else words.to(self.dtype)


@dataclass(frozen=True)
class EngineLayout:
    """One engine's physical layout of ``shape``'s KV with ``block_tokens``-token blocks."""

    kind: str
    block_tokens: int
    shape: ModelShape

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown engine layout {self.kind!r}: choose one of {KINDS}")

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.block_tokens}"

    @property
    def kv_layout(self) -> str:
        """How ``canonicalize`` must read the per-block dims of these tensors."""
        return "HND" if self.kind in ("hnd", "packed-hnd") else "NHD"

    def make(
        self, num_blocks: int, device: str | torch.device = "cpu"
    ) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
        """Zeroed KV caches of ``num_blocks`` device blocks, and their one group of layers."""
        s, t = self.shape, self.block_tokens

        def zeros(*dims: int) -> torch.Tensor:
            return torch.zeros(dims, dtype=s.dtype, device=device)

        names = [f"layer.{i}" for i in range(s.layers)]
        if self.kind == "nhd":
            kv = {n: zeros(num_blocks, 2, t, s.heads, s.head_dim) for n in names}
        elif self.kind == "kv-apart":
            kv = {n: zeros(2, num_blocks, t, s.heads, s.head_dim) for n in names}
        elif self.kind == "hnd":
            kv = {n: zeros(num_blocks, 2, s.heads, t, s.head_dim) for n in names}
        elif self.kind == "hnd-strides":
            kv = {n: zeros(num_blocks, 2, s.heads, t, s.head_dim).transpose(2, 3) for n in names}
        else:
            inner = (t, s.heads) if self.kind == "packed" else (s.heads, t)
            packed = zeros(num_blocks, s.layers, 2, *inner, s.head_dim)
            kv = {n: packed[:, i] for i, n in enumerate(names)}
        return kv, [names]

    def block(self, kv: dict[str, torch.Tensor], layer: int, block: int) -> torch.Tensor:
        """``[2, block_tokens, heads, head_dim]``: a view of one layer's device block."""
        tensor = kv[f"layer.{layer}"]
        if self.kind == "kv-apart":
            return tensor[:, block]
        view = tensor[block]
        return view.transpose(1, 2) if self.kv_layout == "HND" else view

    def fill(self, kv: dict[str, torch.Tensor], logical: torch.Tensor, block_ids: list[int]) -> None:
        """Write logical tokens into device blocks: ``block_ids[i]`` gets the ``i``-th block's tokens."""
        t = self.block_tokens
        for i, block in enumerate(block_ids):
            for layer in range(self.shape.layers):
                self.block(kv, layer, block).copy_(logical[layer, :, i * t : (i + 1) * t])

    def read(self, kv: dict[str, torch.Tensor], block_ids: list[int]) -> torch.Tensor:
        """The logical tokens held by device blocks ``block_ids``, in that order."""
        layers = range(self.shape.layers)
        per_block = [torch.stack([self.block(kv, layer, block) for layer in layers]) for block in block_ids]
        return torch.cat(per_block, dim=2)

    def offloader(
        self,
        config: Mapping[str, Any] | str | Path,
        num_blocks: int,
        row_tokens: int,
        *,
        convert_on_load: bool | None = None,
        device: str | torch.device = "cpu",
    ) -> tuple[Offloader, dict[str, torch.Tensor]]:
        """An ``Offloader`` over fresh caches of this layout on ``device`` whose rows (keys)
        hold ``row_tokens`` tokens, and the caches."""
        if row_tokens % self.block_tokens:
            raise ValueError(f"{self.name}: {row_tokens} tokens per row is not a whole number of blocks")
        kv, groups = self.make(num_blocks, device)
        engine = Offloader(
            kv,
            groups,
            config,
            block_size=self.block_tokens,
            blocks_per_key=row_tokens // self.block_tokens,
            kv_layout=self.kv_layout,
            convert_on_load=convert_on_load,
        )
        return engine, kv
