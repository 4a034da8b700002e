"""``vllm serve`` with kvtier's one-line ``--kv-transfer-config``: vLLM's OpenAI server on
127.0.0.1, a long completion sent as token ids twice with the device prefix cache reset in
between; the second reports the prefix cached (so it came from kvtier)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
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


@pytest.fixture
def server(model_dir: str, shm_dir: Path, tmp_path: Path):
    """vLLM's OpenAI server with kvtier (``vllm serve``'s module: the CPU wheel's ``vllm``
    script looks for a distribution named ``vllm`` and fails, the module does not)."""
    port = free_port()
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "offload.vllm",
            "cpu_bytes_to_use": 256 << 20,
            "shm_dir": str(shm_dir),
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


def complete(port: int, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
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
