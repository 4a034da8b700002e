"""Tiny checkpoints of the model families vLLM serves, with random weights, written to a folder.

One per family whose KV cache kvtier must carry differently from a dense Llama's: MoE
(``qwen3_moe``: the same attention, other MLPs), sliding-window and global layers
(``gemma2``: two KV groups), a gated delta-net hybrid (``qwen3_next``: attention rows and
recurrent-state rows), Mamba-2 hybrids (``nemotron_h``, ``granitemoehybrid``: the same with
Mamba-2 states), and MLA (``deepseek_v2``: one latent row per token, no heads).

Sizes are the smallest vLLM's CPU engine (0.32) runs: hidden 256, 2-4 layers. Where its
kernels want more, the family says so: the CPU gated-delta-net kernels take 128-wide heads
only, and the CPU MLA backend wants a 576-wide latent (``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64). Weights are drawn at ``initializer_range`` 0.05, large enough
that the output depends on the prompt (see ``tiny_llama``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB = 32000  # bench.serve_workloads' token ids (100..30,000) fit

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "max_position_embeddings": 8192,
    "initializer_range": 0.05,
    "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class Family:
    """A model family: the Hugging Face ``model_type`` and the config keys of its tiny model."""

    name: str
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineSpec fields the family needs
    seed: int = 0

    def hf_config(self) -> dict[str, Any]:
        return {**_COMMON, **self.config}

    @property
    def folder(self) -> str:
        digest = hashlib.blake2b(
            json.dumps([self.model_type, self.hf_config(), self.seed], sort_keys=True).encode(), digest_size=6
        ).hexdigest()
        return f"tiny-{self.name}-{digest}"


SLIDING_WINDOW = 128
"""Gemma-2's sliding layers' window (tokens): a few blocks, well inside a test's prompt."""

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "qwen3-moe",
            "qwen3_moe",
            {
                "num_hidden_layers": 2,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "intermediate_size": 512,
                "moe_intermediate_size": 128,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "tie_word_embeddings": False,
            },
        ),
        Family(
            "gemma2",
            "gemma2",
            {
                "num_hidden_layers": 2,  # layer 0 slides, layer 1 is global
                "num_key_value_heads": 2,
                "head_dim": 64,
                "intermediate_size": 512,
                "sliding_window": SLIDING_WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
                "tie_word_embeddings": True,  # vLLM's Gemma-2 has no lm_head parameter
            },
        ),
        Family(
            "qwen3-next",
            "qwen3_next",
            {
                "num_hidden_layers": 2,  # a gated delta-net layer, then an attention layer
                "layer_types": ["linear_attention", "full_attention"],
                "full_attention_interval": 2,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 2,
                "linear_key_head_dim": 128,  # the CPU kernels reject narrower heads
                "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4,
                "intermediate_size": 512,
                "moe_intermediate_size": 128,
                "shared_expert_intermediate_size": 128,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "tie_word_embeddings": False,
            },
        ),
        Family(
            "deepseek-v2-mla",
            "deepseek_v2",
            {
                "num_hidden_layers": 2,
                "num_key_value_heads": 4,
                "kv_lora_rank": 512,  # + qk_rope_head_dim: the 576 the CPU MLA backend wants
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 64,
                "v_head_dim": 64,
                "q_lora_rank": None,
                "intermediate_size": 512,
                "moe_intermediate_size": 128,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 2,  # every layer dense: MLA is what is tested here
                "tie_word_embeddings": False,
            },
        ),
        Family(
            "nemotron-h",
            "nemotron_h",
            {
                "num_hidden_layers": 2,  # a Mamba-2 layer, then an attention layer
                "hybrid_override_pattern": "M*",
                "num_key_value_heads": 2,
                "head_dim": 64,
                "mamba_num_heads": 8,
                "mamba_head_dim": 32,
                "n_groups": 1,
                "ssm_state_size": 64,
                "expand": 1,
                "conv_kernel": 4,
                "intermediate_size": 512,
                # One SSD chunk per scheduled prefill (see ``engine``): vLLM 0.32's CPU SSD
                # kernel returns the final state only, not the per-chunk states vLLM's
                # prefix caching reads ("index 1 is out of bounds for dimension 0 with size 1").
                "chunk_size": 1024,
                "tie_word_embeddings": False,
            },
            # vLLM sets this model's blocks to 160 tokens; a prefill step of one block at most
            # keeps every step to one SSD chunk, the only case the CPU kernel gets right.
            engine={"max_num_batched_tokens": 160},
        ),
        Family(
            "granite-4-h",
            "granitemoehybrid",
            {
                "num_hidden_layers": 2,  # a Mamba-2 layer, then an attention layer
                "layer_types": ["mamba", "attention"],
                "num_key_value_heads": 2,
                "mamba_n_heads": 8,
                "mamba_d_head": 32,
                "mamba_n_groups": 1,
                "mamba_d_state": 64,
                "mamba_expand": 1,
                "mamba_d_conv": 4,
                "mamba_chunk_size": 1024,  # as Nemotron-H's: one SSD chunk per prefill step
                "intermediate_size": 512,
                "shared_intermediate_size": 512,
                "num_local_experts": 0,
                "position_embedding_type": "rope",
                "tie_word_embeddings": True,
            },
            engine={"max_num_batched_tokens": 160},  # vLLM's block for it, as Nemotron-H's
        ),
    )
}


def write_family(root: str | Path, family: Family) -> Path:
    """The family's tiny model under ``root`` (written once; reused when already there)."""
    path = Path(root) / family.folder
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(family.seed)
    config = AutoConfig.for_model(family.model_type, **family.hf_config())
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    staging = path.with_name(path.name + ".partial")
    model.save_pretrained(staging)
    staging.rename(path)
    return path
