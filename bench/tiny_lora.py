"""A LoRA adapter for ``tiny_llama``'s model, with random weights, written to a folder vLLM loads.

A PEFT adapter is two files: ``adapter_config.json`` (rank, alpha, target modules) and
``adapter_model.safetensors`` with, per adapted module, ``...<module>.lora_A.weight``
``[rank, in]`` and ``...<module>.lora_B.weight`` ``[out, rank]`` under the prefix
``base_model.model.``. vLLM reads them itself (``vllm.lora.peft_helper``), so ``peft`` is not
needed to write or load one. Both matrices are random and non-zero (PEFT would start B at
zero, which leaves the model unchanged): the adapter adds ``alpha / rank * B @ A`` to the
K and V projections among others, so two adapters give other KV and other outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.tiny_llama import TinyLlama

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _shapes(model: TinyLlama, module: str) -> tuple[int, int]:
    """(in, out) features of one attention projection of ``model``."""
    head_dim = model.hidden // model.heads
    kv = model.kv_heads * head_dim
    return {
        "q_proj": (model.hidden, model.hidden),
        "k_proj": (model.hidden, kv),
        "v_proj": (model.hidden, kv),
        "o_proj": (model.hidden, model.hidden),
    }[module]


def write_adapter(
    root: str | Path,
    name: str,
    *,
    seed: int,
    model: TinyLlama | None = None,
    rank: int = 8,
    scale: float = 0.05,
) -> Path:
    """The adapter's folder ``root/name`` for ``model`` (``tiny_llama``'s default model unless
    given), written once and reused when already there."""
    model = model or TinyLlama()
    path = Path(root) / name
    if (path / "adapter_model.safetensors").exists():
        return path
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model.layers):
        for module in TARGETS:
            fan_in, fan_out = _shapes(model, module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for part, shape in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
                weight = torch.randn(shape, generator=generator) * scale
                tensors[f"{prefix}.{part}.weight"] = weight.to(torch.bfloat16).contiguous()
    staging = path.with_name(path.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(staging / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,  # scaling alpha / r = 1
        "target_modules": list(TARGETS),
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
    staging.rename(path)
    return path
