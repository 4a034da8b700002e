"""What the spec can and cannot describe of vLLM's rows (``offload/vllm/row_layout.py``).

A row layout that does not match the bytes vLLM reports would convert into garbage, so
every doubt is a refusal: the engine then keys rows by its configuration fingerprint.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from offload.row_layout import HND, NHD, convert_row
from offload.vllm.canonical import HostLayout
from offload.vllm.row_layout import ModelShape, describe_rows

SHAPE = ModelShape(num_kv_heads=2, head_size=64, head_size_v=64)
PAGE = 4 * 2 * 16 * 128 * 2  # 4 layers x 2 heads x 16 tokens x (K + V) x 64 dims x 2 B


def config(
    layout: str = "LBNHC", per_block: int = PAGE, world: int = 1, dtype: str = "float16"
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, tuple(f"layer{i}" for i in range(4)), 0),),
        worker_kv_bytes_per_block=per_block,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=OffloadingModelConfig("m", dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(0, world, world, 1, 1, 1, 0, 1, None, False),
        kv_cache_layout=layout,
    )


def describe(cfg: OffloadingConfig, shape: ModelShape | None = SHAPE, split: str = "token"):
    return describe_rows(cfg, HostLayout.from_config(cfg), shape, split)


def test_token_pages_describe_nhd_and_hnd_rows_of_four_blocks():
    nhd, _ = describe(config("LBNHC"))
    hnd, _ = describe(config("BLHNC"))
    assert nhd is not None and hnd is not None
    (group,) = nhd.groups
    assert (group.layers, group.kv, group.heads, group.head_bytes) == (4, 1, 2, 256)
    assert (group.block_tokens, group.blocks_per_row, group.order) == (16, 4, NHD)
    assert hnd.groups[0].order == HND
    assert nhd.logical_description() == hnd.logical_description(), "they convert: one namespace"


def test_cpu_pages_describe_k_dim_major_and_v_token_major():
    layout, why = describe(config("LBHNC", per_block=4 * 2 * 32 * 128 * 2), split="cpu")
    if layout is None:  # another CPU kernel than vec here (amx, neon, ...): refused, as it must be
        assert "vec" in why
        return
    (group,) = layout.groups
    assert (group.layers, group.kv, group.heads, group.head_bytes, group.order, group.v_order) == (
        8,
        2,
        64,
        2,
        HND,
        NHD,
    )


@pytest.mark.parametrize(
    ("cfg", "shape", "reason"),
    [
        (config(per_block=PAGE + 64), SHAPE, "band"),  # padded pages, or another shape than config.json's
        (config(), ModelShape(4, 64, 64), "band"),  # config.json's head count is not the cache's
        (config(world=2, per_block=PAGE // 2), SHAPE, "workers"),  # tensor parallel: two bands a row
        (config(layout="LHBNC"), SHAPE, "NHD/HND"),
        (config(dtype="mystery"), SHAPE, "element size"),
        (config(), None, "config.json"),
    ],
    ids=["padded", "heads", "tensor-parallel", "heads-outside-block", "dtype", "no-config"],
)
def test_what_cannot_be_described_is_refused(cfg, shape, reason):
    layout, why = describe(cfg, shape)
    assert layout is None and reason in why


def test_cpu_pages_of_an_nhd_layout_are_refused():
    layout, why = describe(config("LBNHC"), split="cpu")
    assert layout is None and "CPU attention" in why


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_a_quantised_cache_is_described_on_token_pages_and_refused_on_cpu_pages(dtype):
    """An fp8 page is the float16 page's shape at one byte an element: described where K
    and V are split by token (its dtype in the layout, so e4m3 and e5m2 never convert into
    each other); on vLLM's CPU attention, whose quantised packing is not known, refused with
    the dtype named."""
    layout, _ = describe(config(dtype=dtype, per_block=PAGE // 2))
    assert layout is not None and layout.dtype == dtype and layout.groups[0].head_bytes == 128
    refused, why = describe(config("LBHNC", dtype=dtype, per_block=PAGE // 2), split="cpu")
    assert refused is None and f"KV cache dtype {dtype!r}" in why


def test_quantised_caches_of_other_dtypes_never_share_a_namespace():
    e4m3, _ = describe(config(dtype="fp8_e4m3", per_block=PAGE // 2))
    e5m2, _ = describe(config(dtype="fp8_e5m2", per_block=PAGE // 2))
    assert e4m3.logical_description() != e5m2.logical_description()


def test_model_shape_from_config_json():
    assert ModelShape.from_hf_config({"num_attention_heads": 8, "hidden_size": 512}) == ModelShape(8, 64, 64)
    assert ModelShape.from_hf_config(
        {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128}}
    ) == ModelShape(2, 128, 128)
    assert ModelShape.from_hf_config({"hidden_size": 512}) is None


def hybrid_config(layers: tuple[tuple[str, ...], ...]) -> OffloadingConfig:
    """Groups of one layer each, their pages all the attention page's size (vLLM pads a
    Mamba page to the attention page, so bytes alone cannot tell them apart)."""
    one_layer_page = 2 * 16 * 128 * 2
    cfg = config(per_block=one_layer_page)
    groups = tuple(OffloadingGroupConfig(16, names, i) for i, names in enumerate(layers))
    return OffloadingConfig(**{**cfg.__dict__, "groups": groups})


HYBRID_LAYERS = (("model.layers.1.self_attn.attn",), ("model.layers.0.linear_attn",))
HF_BASE = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


@pytest.mark.parametrize(
    ("hf", "layers", "named"),
    [
        (  # Qwen3-Next: gated delta-net layers
            {**HF_BASE, "layer_types": ["linear_attention", "full_attention"]},
            HYBRID_LAYERS,
            "layer model.layers.0.linear_attn is a 'linear_attention' layer",
        ),
        (  # Nemotron-H: M a Mamba-2 layer, * attention
            {**HF_BASE, "hybrid_override_pattern": "M*"},
            (("model.layers.1.mixer.attn",), ("model.layers.0.mixer",)),
            "layer model.layers.0.mixer is a 'mamba' layer",
        ),
        (  # Granite-4-H
            {**HF_BASE, "layer_types": ["mamba", "attention"]},
            (("model.layers.1.self_attn.attn",), ("model.layers.0.mamba",)),
            "layer model.layers.0.mamba is a 'mamba' layer",
        ),
        (  # Falcon-H1: every layer has a Mamba mixer beside its attention, no per-layer list
            {**HF_BASE, "mamba_d_state": 16, "mamba_n_heads": 8},
            (("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),),
            "recurrent layers (mamba_d_state",
        ),
    ],
    ids=["qwen3-next", "nemotron-h", "granite-4-h", "falcon-h1"],
)
def test_a_recurrent_state_group_is_never_described_as_attention(hf, layers, named):
    """A state page read as K and V heads would convert into garbage for engines of other
    block sizes or page orders: the description is refused, naming the layer and vLLM's
    spec type, and the rows stay keyed by the configuration fingerprint."""
    layout, why = describe(hybrid_config(layers), ModelShape.from_hf_config(hf))
    assert layout is None
    assert named in why and "MambaSpec" in why


DEEPSEEK_V2 = {  # bench/tiny_families.py's MLA model: only what the spec reads of it matters here
    "model_type": "deepseek_v2",
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_size": 256,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
}
MLA_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
LATENT_BYTES = 576 * 2  # (kv_lora_rank + qk_rope_head_dim) bf16


def mla_config(
    block: int,
    blocks_per_chunk: int = 1,
    *,
    world: int = 1,
    replicated: bool = False,
    page: int | None = None,
) -> OffloadingConfig:
    """vLLM's config for a DeepSeek-V2 engine: one group of MLA layers, a latent a token."""
    cfg = config(per_block=page or len(MLA_LAYERS) * block * LATENT_BYTES, world=world, dtype="bfloat16")
    return OffloadingConfig(
        **{
            **cfg.__dict__,
            "groups": (OffloadingGroupConfig(block, MLA_LAYERS, 0),),
            "cache": OffloadingCacheConfig(tokens_per_hash=block, blocks_per_chunk=blocks_per_chunk),
            "replicated_layout": replicated,
        }
    )


MLA_SHAPE = ModelShape.from_hf_config(DEEPSEEK_V2)


def test_an_mla_latent_is_described_as_one_latent_per_token_never_as_heads():
    """DeepSeek's MLA page is ``[tokens, kv_lora_rank + qk_rope_head_dim]`` per layer: one
    "head" of the latent's width, no K/V split. A page whose bytes match the config's heads
    instead (4 KV heads x 64 dims, K and V) is not an MLA page: refused, never read as heads."""
    layout, why = describe(mla_config(16), MLA_SHAPE)
    assert layout is not None, why
    (group,) = layout.groups
    assert (group.layers, group.kv, group.heads, group.head_bytes, group.block_tokens) == (
        2,
        1,
        1,
        LATENT_BYTES,
        16,
    )
    as_heads = 2 * 4 * 16 * 128 * 2  # layers x heads x tokens x (K + V) x 64 dims x 2 B
    refused, why = describe(mla_config(16, page=as_heads), MLA_SHAPE)
    assert refused is None and "MLA" in why and "1152 B latent" in why


def test_mla_rows_of_two_block_sizes_convert_bit_exact():
    """A CPU engine's 16-token MLA blocks (four a row) and a GPU engine's 64-token ones
    (FlashMLA) hold the same latents: one namespace, and a row converts byte for byte."""
    small, _ = describe(mla_config(16, blocks_per_chunk=4), MLA_SHAPE)
    large, _ = describe(mla_config(64), MLA_SHAPE)
    assert small is not None and large is not None
    assert small.logical_description() == large.logical_description(), "one namespace"
    assert small.layout_id() != large.layout_id(), "rows say which they are"
    latents = torch.randn(len(MLA_LAYERS), 64, 576, generator=torch.Generator().manual_seed(3))
    latents = latents.to(torch.bfloat16)

    def row(block: int) -> bytes:  # kvtier's canonical row: per block, each layer's page
        pages = [
            latents[layer, b * block : (b + 1) * block] for b in range(64 // block) for layer in range(2)
        ]
        return b"".join(page.contiguous().view(torch.uint8).numpy().tobytes() for page in pages)

    for source, target, block_from, block_to in ((small, large, 16, 64), (large, small, 64, 16)):
        converted = torch.frombuffer(bytearray(row(block_from)), dtype=torch.uint8)
        convert_row(converted, source.groups[0], target.groups[0])
        assert bytes(converted.numpy()) == row(block_to)


def test_byte_identical_tensor_parallel_ranks_share_one_described_band():
    """Under TP every rank holds the whole latent: vLLM says so (``replicated_layout``) and
    the host row is one band, described; without it, the ranks' bands are not."""
    shared, why = describe(mla_config(16, world=2, replicated=True), MLA_SHAPE)
    assert shared is not None, why
    assert HostLayout.from_config(mla_config(16, world=2, replicated=True)).num_workers == 1
    apart, why = describe(mla_config(16, world=2, page=2 * 16 * LATENT_BYTES), MLA_SHAPE)
    assert apart is None and "workers" in why


def test_sparse_mla_with_an_indexer_cache_is_refused():
    """DeepSeek-V3.2's indexer keeps keys of its own beside the latents: not described."""
    shape = ModelShape.from_hf_config({**DEEPSEEK_V2, "index_topk": 2048, "index_head_dim": 128})
    layout, why = describe(mla_config(16), shape)
    assert layout is None and "indexer" in why


def test_the_spec_built_for_deepseek_v2_describes_its_mla_rows(tmp_path, caplog):
    """Built as vLLM builds it for a DeepSeek-V2 engine (its ``config.json`` read from the
    model's folder): the rows are described, so engines of other block sizes find them."""
    import json
    import logging

    from offload.vllm.spec import KVTierOffloadingSpec

    model = tmp_path / "deepseek-v2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(DEEPSEEK_V2))
    cfg = mla_config(16)
    cfg = OffloadingConfig(
        **{
            **cfg.__dict__,
            "model": OffloadingModelConfig(str(model), "bfloat16"),
            "extra_config": {"cpu_bytes_to_use": 1 << 20, "shm_dir": str(tmp_path)},
        }
    )
    with caplog.at_level(logging.INFO, logger="offload.vllm.spec"):
        spec = KVTierOffloadingSpec(cfg)
    assert spec.row_layout is not None and spec.row_layout.groups[0].head_bytes == LATENT_BYTES
    assert "fingerprint only" not in caplog.text


def test_attention_only_models_are_still_described():
    hf = {**HF_BASE, "layer_types": ["sliding_attention", "full_attention"]}
    layout, why = describe(
        hybrid_config((("model.layers.0.self_attn.attn",), ("model.layers.1.self_attn.attn",))),
        ModelShape.from_hf_config(hf),
    )
    assert layout is not None, why


def test_the_spec_built_for_a_hybrid_model_keys_its_rows_by_fingerprint_and_says_why(tmp_path, caplog):
    """Built as vLLM builds it (``OffloadingConfig`` of an engine serving Qwen3-Next, whose
    ``config.json`` says which layers are gated delta-nets): no row layout, and the start
    log names the layer and vLLM's spec type."""
    import json
    import logging

    from offload.vllm.spec import KVTierOffloadingSpec

    model = tmp_path / "qwen3-next"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {**HF_BASE, "model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}
        )
    )
    cfg = hybrid_config(HYBRID_LAYERS)
    cfg = OffloadingConfig(
        **{
            **cfg.__dict__,
            "model": OffloadingModelConfig(str(model), "float16"),
            "extra_config": {"cpu_bytes_to_use": 1 << 20, "shm_dir": str(tmp_path)},
        }
    )
    with caplog.at_level(logging.INFO, logger="offload.vllm.spec"):
        spec = KVTierOffloadingSpec(cfg)
    assert spec.row_layout is None
    assert "layer model.layers.0.linear_attn is a 'linear_attention' layer" in caplog.text
    assert "MambaSpec" in caplog.text
