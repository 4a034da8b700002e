"""``kvtier bench serve --pd``: a prefill/decode split through kvtier, in real vLLM engines.

Two engines of one model run side by side, as a P/D pair would (issue #19, vLLM #30448):

- P, the prefill engine: 64-token blocks; it computes each prompt (a few output tokens) and
  kvtier writes its rows through to a real ``kvtier peer``;
- D, the decode engine: 32-token blocks, two a row (64 tokens per key, as P). Both load
  ``KVTierConnector``: rows are keyed by their tokens, so D finds what P stored and loads
  it converted to its own block size.

D then answers prompts P has stored (``stored``), interleaved with prompts of the same
length nobody stored, which D computes itself (``computed``): one engine, one run, the
same conditions. The figure is D's time to first token for each, and their ratio.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import write_json
from bench.serve_workloads import _Tokens

log = logging.getLogger(__name__)

TOKENS_PER_KEY = 64


@dataclass(frozen=True)
class PDSizes:
    prompts: int = 4  # of each kind
    prompt_tokens: int = 3000
    max_tokens: int = 8
    dtype: str = "float32"  # prefills faster than bfloat16 on a CPU without AVX-512 BF16
    prefill_block: int = 64
    decode_block: int = 32
    device_blocks_tokens: int = 16384
    max_model_len: int = 4096
    lookup_wait_s: float = 2.0  # D waits this long for the peer's answer on a new prompt
    row_bytes: int = 256 << 10  # a 64-token row of the float32 model


def _engine(model_dir: str, sizes: PDSizes, block: int, peer: dict[str, Any], workdir: Path) -> Any:
    from bench.vllm_engine import EngineProcess, EngineSpec

    (workdir / "shm").mkdir(parents=True)
    tiers = [{"kind": "host", "eviction": "lru"}, {**peer, "capacity": 1 << 30, "placement": "write-through"}]
    extra = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm",
        "cpu_bytes_to_use": 256 << 20,
        "shm_dir": str(workdir / "shm"),
        "blocks_per_chunk": TOKENS_PER_KEY // block,
        "kvtier_config": {"tiers": tiers},
    }
    spec = EngineSpec(
        model_dir,
        kvtier=extra,
        kv_connector="KVTierConnector",
        dtype=sizes.dtype,
        block_size=block,
        device_blocks=sizes.device_blocks_tokens // block,
        max_model_len=sizes.max_model_len,
    )
    return EngineProcess(spec, workdir / "engine.log")


def run(sizes: PDSizes, seed: int = 0) -> dict[str, Any]:
    """One P/D run: D's TTFT for prompts P stored and for prompts D computes."""
    from bench.serve import Sizes, _peer
    from bench.tiny_llama import write_model

    tokens = _Tokens(seed)
    stored = [tokens.new(sizes.prompt_tokens) for _ in range(sizes.prompts)]
    computed = [tokens.new(sizes.prompt_tokens) for _ in range(sizes.prompts)]
    rows_per_prompt = (sizes.prompt_tokens - 1) // TOKENS_PER_KEY
    ttft: dict[str, list[float]] = {"stored": [], "computed": []}
    loaded_tokens: list[int] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-pd-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        model_dir = str(write_model(workdir / "models"))
        peer = stack.enter_context(_peer(workdir, Sizes(row_bytes=sizes.row_bytes)))
        peer = {**peer, "lookup_wait_s": sizes.lookup_wait_s}
        prefill = stack.enter_context(_engine(model_dir, sizes, sizes.prefill_block, peer, workdir / "P"))
        decode = stack.enter_context(_engine(model_dir, sizes, sizes.decode_block, peer, workdir / "D"))
        for engine in (prefill, decode):
            engine.generate([tokens.new(200)], max_tokens=2)  # warm up, tokens nobody asks again
        spilled = prefill.kvtier_stats()["lower"]["spills_done"]
        for mine, theirs in zip(stored, computed, strict=True):
            # A few tokens, not one: vLLM hands a step's stores to the workers at the next step.
            prefill.generate([mine], max_tokens=4)
            spilled += rows_per_prompt
            prefill.wait_spilled(spilled)
            for kind, prompt in (("stored", mine), ("computed", theirs)):
                request = {"prompt": prompt, "max_tokens": sizes.max_tokens, "arrival_s": 0.0}
                (output,) = decode.timed([request])["outputs"]
                ttft[kind].append(output.ttft_s)
                if kind == "stored":
                    loaded_tokens.append(output.external_cached_tokens or 0)
                else:
                    assert not output.external_cached_tokens, "nobody stored this prompt"
        decode_stats = decode.kvtier_stats()
    stored_s, computed_s = statistics.median(ttft["stored"]), statistics.median(ttft["computed"])
    return {
        "sizes": sizes.__dict__,
        "ttft_s": ttft,
        "median_s": {"stored": stored_s, "computed": computed_s},
        "speedup": computed_s / stored_s,
        "loaded_tokens": loaded_tokens,
        "decode_rows_loaded": decode_stats.get("loaded_rows_by_tier", {}),
    }


def main(argv: list[str]) -> int:
    """``kvtier bench serve --pd [--prompts N] [--prompt-tokens N] [--json FILE]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvtier bench serve --pd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=PDSizes.prompts, help="prompts of each kind")
    parser.add_argument("--prompt-tokens", type=int, default=PDSizes.prompt_tokens)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    sizes = PDSizes(prompts=args.prompts, prompt_tokens=args.prompt_tokens)
    result = run(sizes, args.seed)
    median = result["median_s"]
    print(
        f"P/D through a kvtier peer: P {sizes.prefill_block}-token blocks, D {sizes.decode_block}-token"
        f" blocks, {sizes.prompts} prompts of {sizes.prompt_tokens} tokens each kind\n"
        f"D's TTFT, prompt stored by P: median {median['stored'] * 1e3:.0f} ms"
        f" ({', '.join(f'{t * 1e3:.0f}' for t in result['ttft_s']['stored'])})\n"
        f"D's TTFT, D computes it:      median {median['computed'] * 1e3:.0f} ms"
        f" ({', '.join(f'{t * 1e3:.0f}' for t in result['ttft_s']['computed'])})\n"
        f"speedup {result['speedup']:.1f}x; tokens D loaded per stored prompt {result['loaded_tokens']}"
    )
    write_json(args.json, result)
    return 0
