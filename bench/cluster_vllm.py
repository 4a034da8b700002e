"""``kvtier bench cluster --vllm-peers N``: time to first token of a real vLLM engine (the CPU
build, ``bench.tiny_llama``) for a prefix served by ``kvtier peer``\\ s on other simulated
hosts, against the same engine computing it, in the same run.

The engine runs in this machine's namespace, at the cluster's ``10.77.K.1`` (a child process
started after the cluster exists: UCX reads the routing table once per process), with a host
tier and a remote tier written through to N peers, each on a host of its own; kvtier leaves
UCX's shared-memory transports out (``UCX_TLS``) from their addresses, so the rows cross the
peers' links. Per round, a new
document (token ids): its first request is computed (every row also goes to its peer); the
same request again is served by vLLM's device cache; then the device cache and kvtier's host
tier are emptied, and the request once more is served by the peers. TTFT is the engine's,
from a request's arrival to its first token; the figures are medians over the rounds. The
peers' request must load the whole prefix and give the device-cache request's first token
and its logprob, to the bit.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.cluster_net import Cluster
from bench.serve_workloads import document
from tiers.remote import net_iface

BLOCK = 32
DEVICE_BLOCKS = 80  # 2,560 tokens: one document and a little more
MAX_MODEL_LEN = 2048
ROW_BYTES = "128KiB"  # one block of the float32 model: 4 layers x K,V x 2 heads x 64 x 32 x 4 B
DEADLINE_S = 1.0
SPILL_TIMEOUT_S = 60.0


@contextlib.contextmanager
def _ucx_from_the_peers() -> Iterator[None]:
    """Without this process's UCX variables of ``net_iface.VARIABLES`` while the engine starts
    (it inherits the environment): kvtier sets them from the peers' addresses, as on a
    machine of its own, and a value meant for this machine would win."""
    saved = {name: os.environ.pop(name) for name in net_iface.VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _ttft(engine: Any, prompt: list[int]) -> Any:
    """One request alone, its first token only: the completion, with ``ttft_s``."""
    return engine.timed([{"arrival_s": 0.0, "prompt": prompt, "max_tokens": 1}])["outputs"][0]


def run(peers: int, rounds: int, tokens: int, log_dir: Path) -> dict[str, Any]:
    """The figures of the module docstring with ``peers`` peer hosts and ``tokens``-token documents."""
    from bench.tiny_llama import TinyLlama, write_model
    from bench.vllm_engine import EngineProcess, EngineSpec

    if not BLOCK < tokens < MAX_MODEL_LEN:
        raise ValueError(f"a document of {tokens} tokens: between {BLOCK} and {MAX_MODEL_LEN}")
    full_blocks = (tokens - 1) // BLOCK  # vLLM caches whole blocks, never the prompt's last token
    model_dir = str(write_model(log_dir / "models"))
    (log_dir / "shm").mkdir(parents=True, exist_ok=True)
    with Cluster(peers, log_dir / "vllm-cluster") as cluster:
        cluster.start_peers(capacity="256MiB", row_bytes=ROW_BYTES)
        remote = {
            "kind": "remote",
            "peers": [host.peer_address() for host in cluster.hosts],
            "capacity": "1GiB",
            "placement": "write-through",
            "deadline_s": DEADLINE_S,
        }
        spec = EngineSpec(
            model_dir,
            kvtier={
                "spec_name": "KVTierOffloadingSpec",
                "spec_module_path": "offload.vllm",
                "cpu_bytes_to_use": 128 << 20,
                "shm_dir": str(log_dir / "shm"),
                "kvtier_config": {"tiers": [{"kind": "host", "eviction": "lru"}, remote]},
            },
            dtype="float32",  # as kvtier bench serve: prefills faster on CPUs without AVX-512
            block_size=BLOCK,
            device_blocks=DEVICE_BLOCKS,
            max_model_len=MAX_MODEL_LEN,
            env={"OMP_NUM_THREADS": "1"},
        )
        with _ucx_from_the_peers():
            engine = EngineProcess(spec, log_dir / "vllm-engine.log")
        with engine:
            _ttft(engine, document(-1, 64))  # warm-up: tokens no round holds
            engine.wait_spilled(0, SPILL_TIMEOUT_S)
            spilled = engine.kvtier_stats()["lower"]["spills_done"]
            per_round: list[dict[str, Any]] = []
            for i in range(rounds):
                doc = document(i, tokens)
                computed = _ttft(engine, doc)
                device = _ttft(engine, doc)
                spilled += full_blocks
                engine.wait_spilled(spilled, SPILL_TIMEOUT_S)
                if not engine.reset_prefix_cache(connector=True):
                    raise RuntimeError("vLLM refused a cache reset")
                before = sum(cluster.wire_bytes(host)[1] for host in cluster.hosts)
                served = _ttft(engine, doc)
                wire = sum(cluster.wire_bytes(host)[1] for host in cluster.hosts) - before
                if served.external_cached_tokens != full_blocks * BLOCK:
                    raise RuntimeError(f"round {i}: {served.external_cached_tokens} tokens from the peers")
                if (served.tokens, served.logprobs) != (device.tokens, device.logprobs):
                    raise RuntimeError(f"round {i}: the peers' output is not the device cache's")
                per_round.append(
                    {
                        "computed_s": computed.ttft_s,
                        "device_s": device.ttft_s,
                        "peers_s": served.ttft_s,
                        "bytes_from_peer_hosts": wire,
                    }
                )
            stats = engine.kvtier_stats()
    leftover = os.listdir(log_dir / "shm")
    if leftover:
        raise RuntimeError(f"the engine left {leftover} in its shm folder")
    computed_s = statistics.median(r["computed_s"] for r in per_round)
    peers_s = statistics.median(r["peers_s"] for r in per_round)
    return {
        "peers": peers,
        "rounds": rounds,
        "prompt_tokens": tokens,
        "model": TinyLlama().name,
        "dtype": spec.dtype,
        "rows_per_prefix": full_blocks,
        "computed_ttft_s": computed_s,
        "device_cache_ttft_s": statistics.median(r["device_s"] for r in per_round),
        "peers_ttft_s": peers_s,
        "speedup": computed_s / peers_s,
        "bytes_from_peer_hosts": statistics.median(r["bytes_from_peer_hosts"] for r in per_round),
        "rows_loaded_by_tier": stats["loaded_rows_by_tier"],
        "engine_start_s": engine.start_s,
        "per_round": per_round,
    }
