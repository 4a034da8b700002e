"""What the spec can and cannot describe of vLLM's rows (``offload/vllm/row_layout.py``).

A row layout that does not match the bytes vLLM reports would convert into garbage, so
every doubt is a refusal: the engine then keys rows by its configuration fingerprint.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from offload.row_layout import HND, NHD
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


def test_model_shape_from_config_json():
    assert ModelShape.from_hf_config({"num_attention_heads": 8, "hidden_size": 512}) == ModelShape(8, 64, 64)
    assert ModelShape.from_hf_config(
        {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128}}
    ) == ModelShape(2, 128, 128)
    assert ModelShape.from_hf_config({"hidden_size": 512}) is None
