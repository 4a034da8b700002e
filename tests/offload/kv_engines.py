"""Small engines of every layout kind for the conversion tests (``bench.engine_layouts``)."""

from __future__ import annotations

import torch

from bench.engine_layouts import EngineLayout, ModelShape

ROW_TOKENS = 64  # tokens per stored row (per key) for every engine here
SHAPE = ModelShape(layers=2, heads=2, head_dim=8, dtype=torch.float16)


def engine(kind: str, block_tokens: int, shape: ModelShape = SHAPE) -> EngineLayout:
    return EngineLayout(kind, block_tokens, shape)


def blocks_per_key(spec: EngineLayout) -> int:
    return ROW_TOKENS // spec.block_tokens


def logical_kv(seed: int, rows: int, shape: ModelShape = SHAPE) -> torch.Tensor:
    return shape.logical_kv(rows * ROW_TOKENS, seed)


ENGINES = [
    engine("nhd", 64),
    engine("kv-apart", 16),
    engine("packed", 16),
    engine("packed", 64),
    engine("hnd", 64),
    engine("hnd-strides", 16),
    engine("packed-hnd", 16),
]
"""Every pair of these differs in at least one of: NHD/HND, packed/per-layer, K/V
together/apart, 16/64-token blocks."""
