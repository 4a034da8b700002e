"""The ``RowLayout`` of the host rows a vLLM engine writes, from what vLLM tells the spec.

vLLM hands its workers byte pages, not shapes, so the layout is put together from three
sources that the scheduler and every worker process read the same way:

- ``OffloadingConfig``: the groups (their layers and tokens per block), the chunking
  (``blocks_per_chunk``), the KV cache dtype (``model.dtype``: vLLM puts its
  ``--kv-cache-dtype`` there, the model's dtype only for ``auto``), the parallel layout, and the resolved
  ``kv_cache_layout`` name (``LBNHC``, ``BLHNC``, ...: vLLM's RFC #42082 stride orders of
  the logical ``[L, B, H, N, C]`` cache);
- the model's ``config.json`` (its KV heads and head size);
- the host layout (``canonical.HostLayout``): one band per worker per block.

A vLLM page is ``[H, N, C]`` (heads outside tokens: ``HND``) or ``[N, H, C]`` (``NHD``)
with ``C = (head_size + head_size_v) * itemsize`` bytes. kvtier's canonical row
concatenates a block's pages in layer order, so packed (``B`` outermost) and per-layer
(``L`` outermost) layouts give the same row bytes. Where K and V sit inside ``C`` is the
attention backend's reading (``kv_page_split``, ``settings.py``):

- ``token``: ``C`` is one token's K then its V (FlashAttention's split of the last dim):
  a row is a ``GroupRowLayout`` with ``kv=1`` and ``head_bytes=C``, and NHD and HND rows,
  and rows of other block sizes, convert into each other (``offload.row_layout``);
- ``cpu``: vLLM's CPU attention (its ``vec`` kernels, measured with
  ``cpu_attn_reshape_and_cache``): a head's ``[N, C]`` is its K stored dim-major
  (``[D, N]``), then its V token-major (``[N, D]``); a row is
  ``GroupRowLayout(layers=L*H, kv=2, heads=D, head_bytes=itemsize, order=HND,
  v_order=NHD)``: rows of other block sizes convert. Its other kernels (``amx``,
  ``vec16``, ``neon``, ...) pack K otherwise: not described.

The two readings have other logical shapes, so they never share rows.

The description is refused (``None``, with the reason logged) wherever the bytes vLLM
reports do not equal what that shape predicts: several workers' bands in a row (tensor or
pipeline parallel), padded pages, layouts with heads outside the
block (``LHBNC``, ``BHLNC``), a model whose ``config.json`` cannot be read, a quantised
cache (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``) on vLLM's CPU attention; and for any KV cache
dtype whose element size is not known (vLLM's per-token-head and 4-bit caches, which carry
scales in the page). A quantised cache with a known element size on the ``token`` split
(GPU backends) is described, its dtype in the layout and the namespace. It is refused
too, before any byte count, for a model whose ``config.json`` has recurrent layers (Mamba,
gated delta-net: vLLM pads their state pages to the attention page's size, so the bytes
match while the meaning does not) or sparse MLA's indexer cache (DeepSeek-V3.2's
``index_*`` keys). Such engines keep the configuration fingerprint and share rows only
with identically configured ones.

An MLA page (``kv_lora_rank`` in ``config.json``) is described as what it is: one latent
of ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer, a single "head" with
no K/V split (``_describe_mla``), in either page split; byte-identical tensor-parallel
ranks (vLLM's ``replicated_layout``) write one band, so MLA under TP is described too.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
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

QUANTISED_DTYPES = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2", "uint8", "int8"})
"""KV cache dtypes (vLLM's ``--kv-cache-dtype``) that are not the model's float type."""


NO_KV_LAYER_TYPES = frozenset({"mlp", "moe", "-", "E"})
"""Per-layer types (``layer_types``, ``layers_block_type``, ``hybrid_override_pattern``)
of layers that keep no cache at all."""

RECURRENT_KEY_PREFIXES = ("mamba_", "ssm_", "linear_num_", "linear_key_", "linear_value_")
"""Config keys that say a model has recurrent layers when no per-layer type list names them."""


def layer_index(layer_name: str) -> int | None:
    """The decoder layer's index in a vLLM layer name (``model.layers.3.self_attn.attn``)."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", layer_name)
    return int(match.group(1)) if match else None


def _layer_types(config: dict[str, Any]) -> list[str] | None:
    """Each decoder layer's type, where the config lists them (names vary by family)."""
    for key in ("layer_types", "layers_block_type"):
        value = config.get(key)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    pattern = config.get("hybrid_override_pattern")  # Nemotron-H: M mamba, * attention, - mlp, E moe
    if isinstance(pattern, str):
        return ["mamba" if c == "M" else "attention" if c == "*" else c for c in pattern]
    return None


@dataclass(frozen=True)
class ModelShape:
    """What of the model's attention shapes a KV page: per-layer KV heads and head sizes;
    and what makes a page something else: recurrent layers, an MLA latent."""

    num_kv_heads: int
    head_size: int
    head_size_v: int
    # layer index -> its type, for layers that keep a recurrent state (Mamba, gated delta-net)
    recurrent_layers: dict[int, str] = field(default_factory=dict)
    # every layer recurrent, or some, where the config has no per-layer list (e.g. Falcon-H1)
    recurrent_model: str | None = None
    mla_latent: int | None = None  # kv_lora_rank + qk_rope_head_dim: one latent per token and layer
    mla_indexer: bool = False  # sparse MLA (DeepSeek-V3.2): an indexer keeps a cache of its own

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
        types = _layer_types(config) or []
        recurrent = {
            i: kind
            for i, kind in enumerate(types)
            if kind not in NO_KV_LAYER_TYPES and ("linear" in kind or "attention" not in kind)
        }
        recurrent_model = None
        if not types:
            keys = sorted(k for k in config if k.startswith(RECURRENT_KEY_PREFIXES))
            recurrent_model = f"recurrent layers ({', '.join(keys[:3])} in config.json)" if keys else None
        mla = None
        if isinstance(config.get("kv_lora_rank"), int):
            mla = config["kv_lora_rank"] + int(config.get("qk_rope_head_dim") or 0)
        indexer = any(k in config for k in ("index_topk", "index_head_dim", "index_n_heads"))
        return cls(kv_heads, head_dim, head_dim_v, recurrent, recurrent_model, mla, indexer)

    def refusal(self, config: OffloadingConfig) -> str | None:
        """Why the groups' pages are not K and V heads (a recurrent state, an MLA latent),
        naming the first such layer and vLLM's spec type for it; ``None`` if they are."""
        for group in config.groups:
            for name in group.layer_names:
                index = layer_index(name)
                kind = None if index is None else self.recurrent_layers.get(index)
                if kind is not None:
                    return (
                        f"group {group.group_id}: layer {name} is a {kind!r} layer: its page is a "
                        "recurrent state (vLLM's MambaSpec), not K and V heads"
                    )
        if self.recurrent_layers or self.recurrent_model:
            what = self.recurrent_model or f"recurrent layers {sorted(self.recurrent_layers)}"
            return f"the model has {what}: vLLM's MambaSpec pages, not K and V heads"
        if self.mla_latent is not None and self.mla_indexer:
            first = next((name for g in config.groups for name in g.layer_names), "?")
            return (
                f"layer {first} is sparse MLA: its indexer's cache (index_* in config.json) is "
                "not a latent per token, and is not described"
            )
        return None


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


def resolve_page_split(setting: str) -> str:
    """``token`` or ``cpu`` for the ``kv_page_split`` setting (``auto``: by vLLM's platform)."""
    if setting != "auto":
        return setting
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "token"


def resolve_convert_on(setting: str) -> str:
    """``landing`` or ``load`` for the ``convert_on`` setting (``auto``: landing on vLLM's
    CPU platform, where the worker's copies share the CPU anyway; load on a GPU, where the
    worker rewrites a row in device memory, as ``Offloader`` does)."""
    if setting != "auto":
        return setting
    from vllm.platforms import current_platform

    return "landing" if current_platform.is_cpu() else "load"


def cpu_attention_isa(dtype: str, block_size: int, head_size: int) -> str | None:
    """The kernel vLLM's CPU attention picks for these caches (it decides the K packing)."""
    try:
        import torch
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(getattr(torch, dtype), block_size, head_size))
    except Exception as exc:  # another vLLM build: the packing is not known
        log.info("kvtier: vLLM's CPU attention kernel not known here (%s)", exc)
        return None


def describe_rows(
    config: OffloadingConfig, host: HostLayout, shape: ModelShape | None, page_split: str = "token"
) -> tuple[RowLayout | None, str]:
    """The layout of this engine's host rows, or ``None`` and why it cannot be described.
    ``page_split``: ``token`` or ``head`` (see the module doc)."""
    if shape is None:
        return None, "the model's KV heads and head size are not known (no config.json)"
    refusal = shape.refusal(config)
    if refusal is not None:
        return None, refusal
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
    dtype = str(config.model.dtype).removeprefix("torch.")
    if shape.mla_latent is not None:
        return _describe_mla(config, host, shape.mla_latent, itemsize, dtype)
    if page_split == "cpu":
        if dtype in QUANTISED_DTYPES:
            return None, (
                f"KV cache dtype {dtype!r} (a quantised cache) on vLLM's CPU attention: how its "
                "kernels lay out a quantised page is not known"
            )
        if order != HND or shape.head_size != shape.head_size_v:
            return None, f"vLLM's CPU attention with {config.kv_cache_layout} pages is not known"
        isas = {cpu_attention_isa(dtype, g.tokens_per_block, shape.head_size) for g in config.groups}
        if isas != {"vec"}:
            return None, f"vLLM's CPU attention kernels {sorted(map(str, isas))}: only 'vec' pages are known"
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
        if page_split == "cpu":  # per layer and head: K as [dims, tokens], then V as [tokens, dims]
            groups.append(
                GroupRowLayout(
                    layers=len(group.layer_names) * shape.num_kv_heads,
                    kv=2,
                    heads=shape.head_size,
                    head_bytes=itemsize,
                    block_tokens=block_tokens,
                    blocks_per_row=host.blocks_per_chunk,
                    order=HND,
                    v_order=NHD,
                )
            )
            continue
        groups.append(  # [layers, 1, heads, tokens, K and V of a token]
            GroupRowLayout(
                layers=len(group.layer_names),
                kv=1,
                heads=shape.num_kv_heads,
                head_bytes=head_bytes,
                block_tokens=block_tokens,
                blocks_per_row=host.blocks_per_chunk,
                order=order,
            )
        )
    return RowLayout(tuple(groups), dtype), "described"


def _describe_mla(
    config: OffloadingConfig, host: HostLayout, latent: int, itemsize: int, dtype: str
) -> tuple[RowLayout | None, str]:
    """An MLA page (vLLM's ``MLAAttentionSpec``) is ``[tokens, latent]``: one latent of
    ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer, no heads and no K/V
    split, in every MLA backend (CPU and GPU). Described as one "head" of the latent's
    width, so its rows convert between block sizes (a 16-token CPU engine, a 64-token
    FlashMLA one); with one head, NHD and HND are the same bytes. Byte-identical tensor
    parallel ranks (``replicated_layout``) share one band, so TP engines are described too."""
    head_bytes = latent * itemsize
    groups = []
    for group in config.groups:
        predicted = len(group.layer_names) * group.tokens_per_block * head_bytes
        if predicted != host.worker_block_bytes:
            return None, (
                f"group {group.group_id}: MLA, {len(group.layer_names)} layers x {group.tokens_per_block} "
                f"tokens x a {head_bytes} B latent is {predicted} B a block, vLLM reports a "
                f"{host.worker_block_bytes} B band (padding, or another MLA cache format)"
            )
        groups.append(
            GroupRowLayout(
                layers=len(group.layer_names),
                kv=1,
                heads=1,
                head_bytes=head_bytes,
                block_tokens=group.tokens_per_block,
                blocks_per_row=host.blocks_per_chunk,
                order=NHD,
            )
        )
    return RowLayout(tuple(groups), dtype), "described (MLA latents)"
