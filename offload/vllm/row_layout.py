"""The ``RowLayout`` of the host rows a vLLM engine writes, from what vLLM tells the spec.

vLLM hands its workers byte pages, not shapes, so the layout is put together from three
sources that the scheduler and every worker process read the same way:

- ``OffloadingConfig``: the groups (their layers and tokens per block), the chunking
  (``blocks_per_chunk``), the KV cache dtype, the parallel layout, and the resolved
  ``kv_cache_layout`` name (``LBNHC``, ``BLHNC``, ...: vLLM's RFC #42082 stride orders of
  the logical ``[L, B, H, N, C]`` cache);
- the model's ``config.json`` (its KV heads and head size);
- the host layout (``canonical.HostLayout``): one band per worker per block.

A vLLM page is ``[H, N, C]`` (heads outside tokens: ``HND``) or ``[N, H, C]`` (``NHD``)
where ``C`` is a head's K *and* V for one token (``(head_size + head_size_v) * itemsize``).
kvtier's canonical row concatenates a block's pages in layer order, so packed
(``B`` outermost) and per-layer (``L`` outermost) layouts give the same row bytes, and a
row is a ``GroupRowLayout`` with ``kv=1`` and ``head_bytes=C``: NHD and HND rows then
convert into each other (``offload.row_layout``).

The description is refused (``None``, with the reason logged) wherever the bytes vLLM
reports do not equal what that shape predicts: several workers' bands in a row (tensor or
pipeline parallel), padded pages, MLA or quantised caches, layouts with heads outside the
block (``LHBNC``, ``BHLNC``), a model whose ``config.json`` cannot be read. Such engines
keep the configuration fingerprint and share rows only with identically configured ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from offload.row_layout import HND, NHD, GroupRowLayout, RowLayout
from offload.vllm.canonical import HostLayout

log = logging.getLogger(__name__)

PAGE_ORDERS = {"LBNHC": NHD, "BLNHC": NHD, "LBHNC": HND, "BLHNC": HND}
"""vLLM's KV cache layouts whose pages are whole blocks, and the order inside a page."""

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class ModelShape:
    """What of the model's attention shapes a KV page: per-layer KV heads and head sizes."""

    num_kv_heads: int
    head_size: int
    head_size_v: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape | None:
        """From a Hugging Face ``config.json`` (its ``text_config`` for multimodal models);
        ``None`` where the keys are missing."""
        config = config.get("text_config") or config
        heads = config.get("num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim")
        if not head_dim and heads and config.get("hidden_size"):
            head_dim = config["hidden_size"] // heads
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or min(kv_heads, head_dim) < 1:
            return None
        head_dim_v = config.get("v_head_dim") or head_dim
        return cls(kv_heads, head_dim, head_dim_v)


def read_model_shape(model: str) -> ModelShape | None:
    """The shape from ``<model>/config.json`` (a local model directory), else from the
    Hugging Face cache without going online; ``None`` if neither has it."""
    path = Path(model) / "config.json"
    try:
        if path.is_file():
            return ModelShape.from_hf_config(json.loads(path.read_text()))
        from transformers import AutoConfig

        return ModelShape.from_hf_config(AutoConfig.from_pretrained(model, local_files_only=True).to_dict())
    except Exception as exc:  # an unreadable config: the engine keeps its fingerprint
        log.info(
            "kvtier: no config.json for %r (%s): rows keyed by the configuration fingerprint", model, exc
        )
        return None


def describe_rows(
    config: OffloadingConfig, host: HostLayout, shape: ModelShape | None
) -> tuple[RowLayout | None, str]:
    """The layout of this engine's host rows, or ``None`` and why it cannot be described."""
    if shape is None:
        return None, "the model's KV heads and head size are not known (no config.json)"
    order = PAGE_ORDERS.get(config.kv_cache_layout or "")
    if order is None:
        return None, f"vLLM's KV cache layout {config.kv_cache_layout!r} has no NHD/HND page"
    itemsize = DTYPE_BYTES.get(str(config.model.dtype).removeprefix("torch."))
    if itemsize is None:
        return None, f"KV cache dtype {config.model.dtype!r} has no known element size"
    if host.num_workers != 1:
        return None, f"{host.num_workers} workers' bands share a row (tensor/pipeline parallel)"
    if config.parallel.dcp_size > 1 or config.parallel.pcp_size > 1:
        return None, "context parallel: a block's tokens are split across workers"
    head_bytes = (shape.head_size + shape.head_size_v) * itemsize
    groups = []
    for group in config.groups:
        block_tokens = group.tokens_per_block
        predicted = len(group.layer_names) * shape.num_kv_heads * block_tokens * head_bytes
        if predicted != host.worker_block_bytes:
            return None, (
                f"group {group.group_id}: {len(group.layer_names)} layers x {shape.num_kv_heads} KV heads x "
                f"{block_tokens} tokens x {head_bytes} B is {predicted} B a block, vLLM reports a "
                f"{host.worker_block_bytes} B band (padding, MLA or a quantised cache)"
            )
        groups.append(
            GroupRowLayout(
                layers=len(group.layer_names),
                kv=1,  # a vLLM page keeps a head's K and V of a token together: C
                heads=shape.num_kv_heads,
                head_bytes=head_bytes,
                block_tokens=block_tokens,
                blocks_per_row=host.blocks_per_chunk,
                order=order,
            )
        )
    return RowLayout(tuple(groups), str(config.model.dtype).removeprefix("torch.")), "described"
