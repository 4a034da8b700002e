"""``vllm serve`` with kvtier's one-line ``--kv-transfer-config`` (a host tier and a disk tier
written through, inline): vLLM's OpenAI server on 127.0.0.1, shared by this module's tests,
prompts sent as token ids.

- A long completion sent twice with the device prefix cache reset in between; the second
  reports the prefix cached (so it came from kvtier).
- Two cache salts over one prompt: kvtier serves a prefix only to its own salt.
- Per-request control through ``kv_transfer_params`` in the completions body: a request
  that stores nothing (``max_offload_tokens: 0``), one that stores a capped prefix, one that
  loads only from the host tier (``kv_load_tiers``), each beside the same kind of request
  without the parameter, checked in kvtier's metrics on vLLM's ``/metrics`` and in
  ``cached_tokens``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from tests.engine.conftest import document

PROMPT = document(3, 1200)
CACHED = (len(PROMPT) - 1) // 32 * 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(port: int, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read() or b"{}")


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """vLLM's OpenAI server with kvtier (``vllm serve``'s module: the CPU wheel's ``vllm``
    script looks for a distribution named ``vllm`` and fails, the module does not); one for
    the module (the CPU is shared), its host-tier file gone once it has stopped."""
    tmp_path = tmp_path_factory.mktemp("serve")
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    port = free_port()
    tiers = {
        "tiers": [
            {"kind": "host"},
            {
                "kind": "disk",
                "path": str(tmp_path / "disk"),
                "capacity": "64MiB",
                "placement": "write-through",
                "admission": "all",
            },
        ]
    }
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "offload.vllm",
            "cpu_bytes_to_use": 256 << 20,
            "shm_dir": str(shm_dir),
            "kvtier_config": tiers,
        },
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--block-size", "32", "--max-model-len", "2048",
        "--num-gpu-blocks-override", "80", "--enforce-eager", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "NIXL_LOG_LEVEL": "WARN"}
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start in 300 s"
                time.sleep(1)
        yield port, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # as a user's Ctrl-C
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()
    assert sorted(os.listdir(shm_dir)) == [], "the server left its kvtier host-tier file behind"


def complete(
    port: int,
    model: str,
    prompt: list[int],
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return post(port, "/v1/completions", body)


def cached_tokens(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_vllm_serve_with_kvtier_reports_the_reset_prefix_cached(server, model_dir):
    port, _process = server
    first = complete(port, model_dir, PROMPT)
    assert cached_tokens(first) == 0

    assert post(port, "/reset_prefix_cache")["success"]
    again = complete(port, model_dir, PROMPT)

    assert cached_tokens(again) == CACHED
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    other = complete(port, model_dir, document(4, 1200))
    assert cached_tokens(other) == 0
    assert other["choices"][0]["token_ids"] != first["choices"][0]["token_ids"]


BLOCK = 32
ROWS = 8  # full blocks of a prompt of ROWS * BLOCK + 1 tokens (the last token is never stored)


def kvtier_metrics(port: int) -> dict[tuple[str, str], float]:
    """kvtier's samples on vLLM's ``/metrics``: ``(name, tier) -> value``, summed over engines."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    found: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = re.match(r"vllm:kv_offload_kvtier_(\w+)\{([^}]*)\} (\S+)$", line)
        if match:
            tier = re.search(r'tier="(\w+)"', match[2])
            key = (match[1], tier[1] if tier else "")
            found[key] = found.get(key, 0.0) + float(match[3])
    return found


def metrics_reach(port: int, model: str, want: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """Wait until kvtier's metrics hold exactly ``want`` (vLLM reports them with each engine
    step's output: a two-token request, which stores and loads nothing, makes a step)."""
    deadline = time.monotonic() + 120
    while True:
        got = kvtier_metrics(port)
        if all(got.get(key, 0.0) == value for key, value in want.items()):
            return got
        assert time.monotonic() < deadline, f"kvtier's metrics never reached {want}: {got}"
        complete(port, model, [11, 12])
        time.sleep(0.2)


def reset_every_cache(port: int) -> None:
    """The device prefix cache and kvtier's host tier (``reset_external``); vLLM refuses while
    a transfer is in flight, so a refusal is retried."""
    deadline = time.monotonic() + 60
    while not post(port, "/reset_prefix_cache?reset_external=true")["success"]:
        assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix caches"
        time.sleep(0.2)


def test_per_request_kv_transfer_params_control_what_kvtier_stores_and_loads(server, model_dir):
    port, _process = server
    reset_every_cache(port)  # the host tier emptied; the disk tier settled (a reset drains its copies)
    start = metrics_reach(port, model_dir, {("rows", "host"): 0})
    disk_rows, disk_hits = start.get(("rows", "disk"), 0.0), start.get(("hits_total", "disk"), 0.0)
    private, plain, capped, host_only = (document(seed, ROWS * BLOCK + 1) for seed in (20, 21, 22, 23))

    # Private data: nothing of it is stored; the same kind of request without the parameter is.
    complete(port, model_dir, private, {"max_offload_tokens": 0})
    complete(port, model_dir, plain)
    metrics_reach(port, model_dir, {("rows", "host"): ROWS, ("rows", "disk"): disk_rows + ROWS})
    # A cap: the first 4 blocks only.
    complete(port, model_dir, capped, {"max_offload_tokens": 4 * BLOCK})
    complete(port, model_dir, host_only)
    stored = ROWS + 4 + ROWS
    metrics_reach(port, model_dir, {("rows", "host"): stored, ("rows", "disk"): disk_rows + stored})

    # The host tier and the device cache emptied: what is left is on disk.
    reset_every_cache(port)
    reply = complete(port, model_dir, host_only, {"kv_load_tiers": [{"medium": "CPU"}]})
    assert cached_tokens(reply) == 0  # on disk, but this request loads from the host tier only
    assert cached_tokens(complete(port, model_dir, plain)) == ROWS * BLOCK  # the same without: from disk
    assert cached_tokens(complete(port, model_dir, capped)) == 4 * BLOCK
    assert cached_tokens(complete(port, model_dir, private)) == 0  # not findable in any tier
    metrics_reach(port, model_dir, {("hits_total", "disk"): disk_hits + ROWS + 4})


def reset_device_cache(port: int) -> None:
    """vLLM's device prefix cache only: kvtier's tiers keep their rows."""
    deadline = time.monotonic() + 60
    while not post(port, "/reset_prefix_cache")["success"]:
        assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix cache"
        time.sleep(0.2)


def test_a_cache_salt_keeps_one_prompt_apart_in_kvtier(server, model_dir):
    """Two tenants' salts over one prompt never share kvtier's rows: with the device cache
    reset, another salt (or none) finds nothing, the same salt its whole prefix."""
    port, _process = server
    prompt = document(30, ROWS * BLOCK + 1)
    assert cached_tokens(complete(port, model_dir, prompt, cache_salt="tenant-a")) == 0
    reset_device_cache(port)
    assert cached_tokens(complete(port, model_dir, prompt, cache_salt="tenant-b")) == 0
    reset_device_cache(port)
    assert cached_tokens(complete(port, model_dir, prompt)) == 0
    reset_device_cache(port)
    assert cached_tokens(complete(port, model_dir, prompt, cache_salt="tenant-a")) == ROWS * BLOCK
