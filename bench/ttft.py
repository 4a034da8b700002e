"""Time to first token: what a cached prefix saves, modelled and measured.

Modelled: a token's prefill costs ``2 x parameters`` FLOPs (plus attention, ignored: it
favours recompute) of a stated model at a stated accelerator throughput; a cached token
costs its KV bytes (of the same model) at a GB/s per tier. So a request's TTFT is
``recomputed x t_flop + sum over tiers of tokens x kv_bytes / GB/s``. Two GB/s are used,
both from this run: what each tier achieved on the benchmark's small blocks (latency-bound,
a pessimistic bound) and the ceiling measured under each tier (what the large blocks of
the stated model approach, an optimistic bound).

Measured on this machine: a small random-weight transformer (no download) prefills a
prompt, and the same prompt's KV cache, as blocks of the benchmark's scaled shape, is
loaded from kvtier's host tier into the device cache. Both run here on the CPU, so the
ratio says how the two costs compare at this model size, not on an accelerator.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from bench.e2e_workload import DeviceCache, Shape, block_key, pattern
from offload.api import Offloader


@dataclass(frozen=True)
class CostModel:
    """The stated model and accelerator of the modelled TTFT (Llama-3.1-8B on one H100)."""

    model: str = "Llama-3.1-8B (32 layers, 8 KV heads, head dim 128, bf16)"
    params: float = 8.03e9
    kv_bytes_per_token: int = 32 * 2 * 8 * 128 * 2
    accelerator: str = "H100 SXM bf16 dense 989 TFLOP/s at 40% MFU"
    flops_per_s: float = 989e12 * 0.4

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.params

    @property
    def recompute_s_per_token(self) -> float:
        return self.flops_per_token / self.flops_per_s

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "flops_per_token": self.flops_per_token,
            "recompute_s_per_token": self.recompute_s_per_token,
        }


def modelled_ttft(
    per_request_tokens: Sequence[dict[str, int]], gbps: dict[str, float], cost: CostModel
) -> dict[str, float]:
    """Mean and p50/p99 TTFT with kvtier and without (recompute all that the device lacks)."""
    with_tier, without = [], []
    for tokens in per_request_tokens:
        load, recompute = 0.0, tokens["recomputed"]
        for kind in ("host", "disk", "remote"):
            if gbps.get(kind):
                load += tokens.get(kind, 0) * cost.kv_bytes_per_token / (gbps[kind] * 1e9)
            else:  # no figure for the tier: count its tokens as recomputed
                recompute += tokens.get(kind, 0)
        with_tier.append(recompute * cost.recompute_s_per_token + load)
        missing = sum(tokens[k] for k in ("host", "disk", "remote", "recomputed"))
        without.append(missing * cost.recompute_s_per_token)
    if not with_tier:
        return {}
    return {
        "mean_ms": statistics.fmean(with_tier) * 1e3,
        "p50_ms": percentile(with_tier, 50) * 1e3,
        "p99_ms": percentile(with_tier, 99) * 1e3,
        "no_kvtier_mean_ms": statistics.fmean(without) * 1e3,
        "no_kvtier_p50_ms": percentile(without, 50) * 1e3,
        "no_kvtier_p99_ms": percentile(without, 99) * 1e3,
        "speedup_mean": statistics.fmean(without) / max(1e-12, statistics.fmean(with_tier)),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


class TinyTransformer(nn.Module):
    """A random-weight decoder whose KV cache has the benchmark's scaled shape."""

    def __init__(self, shape: Shape, heads: int = 4, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.shape = shape
        self.heads = heads
        width = heads * shape.head_dim
        self.width = width
        self.embed = nn.Embedding(32_000, width)
        self.layers = nn.ModuleList()
        for _ in range(shape.layers):
            layer = nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(width),
                    "q": nn.Linear(width, width, bias=False),
                    "kv": nn.Linear(width, 2 * shape.kv_heads * shape.head_dim, bias=False),
                    "o": nn.Linear(width, width, bias=False),
                    "norm2": nn.LayerNorm(width),
                    "up": nn.Linear(width, mlp_ratio * width, bias=False),
                    "down": nn.Linear(mlp_ratio * width, width, bias=False),
                }
            )
            self.layers.append(layer)

    def params(self) -> int:
        return sum(p.numel() for name, p in self.named_parameters() if not name.startswith("embed"))

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Run the prompt; the per-layer KV (``[2, tokens, kv_heads, head_dim]``) it produced."""
        s = self.shape
        x = self.embed(tokens)[None]
        n = tokens.numel()
        kvs = []
        for layer in self.layers:
            h = layer["norm1"](x)
            q = layer["q"](h).view(1, n, self.heads, s.head_dim).transpose(1, 2)
            k, v = layer["kv"](h).view(1, n, 2, s.kv_heads, s.head_dim).unbind(2)
            kvs.append(torch.stack((k[0], v[0])).to(s.dtype))
            attn = nn.functional.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=self.heads != s.kv_heads
            )
            x = x + layer["o"](attn.transpose(1, 2).reshape(1, n, self.width))
            x = x + layer["down"](nn.functional.gelu(layer["up"](layer["norm2"](x))))
        return kvs


def measure_ttft(shape: Shape, prompt_blocks: int, repeats: int = 3) -> dict[str, float]:
    """Prefill of a ``prompt_blocks``-block prompt vs loading its KV from kvtier's host tier."""
    torch.manual_seed(0)
    model = TinyTransformer(shape).eval()
    n_tokens = prompt_blocks * shape.block_tokens
    prompt = torch.randint(0, 32_000, (n_tokens,))
    model.prefill(prompt[: shape.block_tokens])  # warm up
    prefill = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.prefill(prompt)
        prefill.append(time.perf_counter() - start)
    device = DeviceCache(shape, 2 * prompt_blocks)
    kv, groups = device.kv_caches()
    keys = [block_key("ttft", b) for b in range(prompt_blocks)]
    for block, key in enumerate(keys):
        device.rows[block].copy_(pattern(key, shape.block_bytes))
    config = {"tiers": [{"kind": "host", "capacity": 2 * prompt_blocks * shape.block_bytes}]}
    load = []
    with Offloader(kv, groups, config, block_size=shape.block_tokens) as offloader:
        offloader.wait([offloader.store(keys, list(range(prompt_blocks)))])
        targets = list(range(prompt_blocks, 2 * prompt_blocks))
        for _ in range(repeats):
            start = time.perf_counter()
            hits = offloader.lookup(keys)
            offloader.wait([offloader.load(keys[:hits], targets[:hits])])
            load.append(time.perf_counter() - start)
        for key, block in zip(keys, targets, strict=True):
            if not torch.equal(device.rows[block], pattern(key, shape.block_bytes)):
                raise RuntimeError("ttft: a loaded block does not hold its stored bytes")
    prefill_s, load_s = statistics.median(prefill), statistics.median(load)
    flops = 2.0 * model.params() * n_tokens
    return {
        "prompt_tokens": n_tokens,
        "model_params": model.params(),
        "model": f"{shape.layers} layers, width {model.width}, {model.heads} heads, random weights, float32",
        "prefill_ms": prefill_s * 1e3,
        "cached_load_ms": load_s * 1e3,
        "speedup": prefill_s / max(1e-12, load_s),
        "cpu_gflops": flops / prefill_s / 1e9,
        "kv_bytes": prompt_blocks * shape.block_bytes,
    }
