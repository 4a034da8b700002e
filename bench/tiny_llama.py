"""A small Llama-shaped model with random weights, written to a folder vLLM loads (no hub).

Weights drawn at the usual init scale (``transformers``' ``initializer_range``) make the
output depend on the prompt: two documents give different greedy tokens, and the same KV
attended gives the same logprobs. (vLLM's ``load_format="dummy"`` weights are so small
that the output ignores the prompt, so a check built on them could not fail.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlama:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2  # GQA
    intermediate: int = 1024
    vocab: int = 32000
    max_positions: int = 16384
    seed: int = 0
    sliding_window: int | None = None  # every other layer attends only this far back (a hybrid model)

    @property
    def name(self) -> str:
        digest = hashlib.blake2b(json.dumps(asdict(self), sort_keys=True).encode(), digest_size=6).hexdigest()
        return f"tiny-llama-{self.layers}l-{self.hidden}h-{digest}"


def write_model(root: str | Path, model: TinyLlama = TinyLlama()) -> Path:
    """The model's folder under ``root`` (written once; reused when already there)."""
    path = Path(root) / model.name
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(model.seed)
    config = LlamaConfig(
        hidden_size=model.hidden,
        intermediate_size=model.intermediate,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        num_hidden_layers=model.layers,
        vocab_size=model.vocab,
        max_position_embeddings=model.max_positions,
        torch_dtype="bfloat16",
    )
    if model.sliding_window is not None:
        # vLLM's Llama reads these: sliding-window layers between full-attention ones.
        config.sliding_window = model.sliding_window
        config.layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(model.layers)
        ]
    staging = path.with_name(path.name + ".partial")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(staging)
    staging.rename(path)
    return path
