"""Patches the MLA P/D test (``test_mla_pd``) makes in an engine's process before it starts
(``EngineSpec.child_setup``): an MLA model keeps the block size it was given
(``keep_mla_block_size``); one converted row is corrupted (``swap_a_token_pair_after``).

vLLM's reference CPU MLA backend (``CPU_MLA``) decodes 16-token blocks only, and the CPU
platform sets every MLA engine's block size to 16 whatever was asked
(``CpuPlatform.check_and_update_config``). vLLM's GPU runner, which the CPU one subclasses,
already splits a KV manager block into kernel blocks a backend takes
(``prepare_kernel_block_sizes``: a 64-token block is four 16-token kernel blocks, the
block table widened to match), so with the override undone an MLA engine runs 64-token
blocks over the same 16-token kernel: what a FlashMLA engine's block size is, on CPU. The
KV pages are the same bytes, ``[64, 576]`` a layer and block; what changes is how vLLM,
and so kvtier, groups them into blocks and rows.
"""

from __future__ import annotations

from typing import Any


def keep_mla_block_size() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        cache = vllm_config.cache_config
        asked = cache.block_size if cache.user_specified_block_size else None
        original(cls, vllm_config)
        model = vllm_config.model_config
        if asked is not None and model is not None and getattr(model, "use_mla", False):
            cache.block_size = asked

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


CORRUPT_AFTER_ENV = "KVTIER_TEST_CORRUPT_AFTER"
"""Rows converted right before one is corrupted: the exactness check's own check."""


def swap_a_token_pair_after() -> None:
    """The row kvtier converts after the first
    ``$KVTIER_TEST_CORRUPT_AFTER`` is converted right, then two of its tokens are swapped
    (layer 0's latents of its first two tokens): one row's conversion off by one token
    pair. The test shows that its exactness check tells that from a right conversion."""
    import os

    import torch

    from offload import row_layout

    right_rows = int(os.environ[CORRUPT_AFTER_ENV])
    original = row_layout.convert_row
    converted = 0

    def convert_row(row: torch.Tensor, source: Any, target: Any, scratch: Any = None) -> None:
        nonlocal converted
        original(row, source, target, scratch)
        converted += 1
        if converted == right_rows + 1:
            first, second = (target.granule(row, index, 1)[0].clone() for index in (0, 1))
            target.granule(row, 0, 1)[0].copy_(second)
            target.granule(row, 1, 1)[0].copy_(first)

    row_layout.convert_row = convert_row
