"""A real vLLM engine in a child process, driven over a pipe: the tests' and ``bench serve``'s engine.

vLLM's ``LLM`` spawns its workers and grabs signals, threads and environment variables,
and a fault in it must not take the caller down; so the engine lives in a child process
(``python -m bench.vllm_engine``) that reads one JSON command a line on stdin and answers
one JSON line on a private copy of stdout (vLLM's own prints go to stderr, into the log).

The engine core runs inside that child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
child can read vLLM's scheduler and kvtier's manager directly: which requests waited on
a load, and where every loaded row came from. The model is a folder on disk (``tiny_llama``
writes one); prompts are token ids, and there is no tokenizer.

Commands (``EngineProcess`` methods): ``generate`` (greedy, with the sampled tokens'
logprobs; optionally under a LoRA adapter, or with ``kv_transfer_params``), ``timed``
(requests arriving on a schedule, with their time to first token), ``reset_prefix_cache``,
``kvtier_stats``, ``remote_owners`` (which peer holds each block of a prompt), ``drop_rows``
(forget kvtier's host rows of one kind of KV group: the tests' way to take a hybrid's state
rows away from its attention rows), ``groups`` (kvtier's indices of the KV groups of one
kind, as its keys carry them), ``row_bands`` (digests of each tensor-parallel rank's band of
those rows, and a way to swap them between ranks), ``shutdown``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import selectors
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
"""An engine start (a compiled model's first start compiles it) must not hang a test run."""


class EngineError(RuntimeError):
    """The engine process failed, or answered a command with an error."""


@dataclass(frozen=True)
class EngineSpec:
    """What one engine is: the model, its device cache and kvtier's configuration (or none)."""

    model_dir: str
    kvtier: dict[str, Any] | None = None  # kv_connector_extra_config; None: vLLM alone
    # "OffloadingConnector" (vLLM's keys) or "KVTierConnector" (keys by tokens: other block sizes share)
    kv_connector: str = "OffloadingConnector"
    dtype: str = "auto"  # the model's own (bfloat16); "float32" prefills ~3x faster on CPUs without AVX-512
    kv_cache_dtype: str = "auto"  # the model's dtype; or a quantised cache ("fp8", "fp8_e4m3", "fp8_e5m2")
    attention_backend: str | None = None  # vLLM's choice; or a name ("CPU_MLA": not AMX_MLA on AMX hosts)
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32
    device_blocks: int | None = None  # num_gpu_blocks_override: a device cache smaller than the work
    kvcache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    max_model_len: int = 8192
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = True  # starts in ~20 s; a compiled model prefills ~2.5x faster here
    prefix_caching: bool = True
    seed: int = 0
    max_lora_rank: int | None = None  # serve LoRA adapters up to this rank (two at a time); None: no LoRA
    env: dict[str, str] = field(default_factory=dict)
    # "module:function" the child calls before it builds the engine (a test's patch to vLLM)
    child_setup: str | None = None

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": self.dtype,
            "skip_tokenizer_init": True,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "enable_prefix_caching": self.prefix_caching,
            "enforce_eager": self.enforce_eager,
            "tensor_parallel_size": self.tensor_parallel_size,
            "seed": self.seed,
            "disable_log_stats": False,
        }
        if self.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        if self.attention_backend is not None:
            kwargs["attention_backend"] = self.attention_backend
        if self.device_blocks is not None:
            kwargs["num_gpu_blocks_override"] = self.device_blocks
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.max_lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=2)
        return kwargs


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter a request runs under: vLLM's ``LoRARequest(name, lora_id, path)``."""

    name: str
    lora_id: int  # vLLM's integer id, unique per adapter and > 0
    path: str


@dataclass
class Completion:
    """One request's result. ``external_cached_tokens`` are the prompt tokens a KV connector
    (kvtier) loaded; ``num_cached_tokens`` adds vLLM's own device prefix cache."""

    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int
    external_cached_tokens: int | None = None
    preemptions: int | None = None  # times vLLM preempted the request (where it reports stats)
    ttft_s: float | None = None
    arrival_s: float | None = None
    finish_s: float | None = None


class EngineProcess:
    """The parent side: start the child, send commands, read answers. A context manager."""

    def __init__(self, spec: EngineSpec, log_path: str | Path, *, python: str | None = None) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        env = dict(os.environ)
        env.update(
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": str(spec.kvcache_gib),
                "NIXL_LOG_LEVEL": env.get("NIXL_LOG_LEVEL", "WARN"),
                "PYTHONUNBUFFERED": "1",
                **spec.env,
            }
        )
        if spec.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(spec.tensor_parallel_size))
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [python or sys.executable, "-m", "bench.vllm_engine"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        self.start_s = time.monotonic()
        self._send({"op": "start", "spec": asdict(spec)})
        self.started = self._receive(START_TIMEOUT_S)
        self.start_s = time.monotonic() - self.start_s

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands ----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 8,
        timeout_s: float = 600.0,
        *,
        lora: Adapter | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> list[Completion]:
        """Greedy completions of ``prompts``; under ``lora`` (the engine started with
        ``max_lora_rank``), with ``kv_transfer_params`` (e.g. ``kv_load_tiers``) on each request;
        ``cache_salt``: the prompts' KV is keyed apart from unsalted runs' (the same KV
        computed, stored and found under other keys)."""
        command: dict[str, Any] = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens}
        if lora is not None:
            command["lora"] = asdict(lora)
        if kv_transfer_params is not None:
            command["kv_transfer_params"] = kv_transfer_params
        if cache_salt is not None:
            command["cache_salt"] = cache_salt
        answer = self.call(command, timeout_s)
        return [Completion(**c) for c in answer["outputs"]]

    def timed(self, requests: list[dict[str, Any]], timeout_s: float = 3600.0) -> dict[str, Any]:
        """``requests`` in arrival order: ``{"arrival_s", "prompt", "max_tokens"}`` each, arrival
        in seconds from the run's start; or, with ``"after_finish": true``, ``arrival_s`` after
        every earlier request has finished (a closed loop: a user who reads, then asks again);
        or, with ``"max_in_flight": n``, as soon as fewer than ``n`` are unfinished (a client
        at concurrency ``n``, as ``vllm bench serve --max-concurrency``).
        The answer: ``outputs`` (``Completion``\\ s with ``arrival_s``, ``ttft_s``, ``finish_s``),
        ``steps``, ``steps_waiting_on_loads`` and ``wall_s``."""
        answer = self.call({"op": "timed", "requests": requests}, timeout_s)
        answer["outputs"] = [Completion(**c) for c in answer["outputs"]]
        return answer

    def reset_prefix_cache(self, *, connector: bool = False) -> bool:
        """Empty vLLM's device prefix cache (and kvtier's host tier too with ``connector``)."""
        return bool(self.call({"op": "reset_prefix_cache", "connector": connector})["ok"])

    def kvtier_stats(self) -> dict[str, Any]:
        return self.call({"op": "kvtier_stats"})

    def wait_spilled(self, rows: int, timeout_s: float = 60.0) -> None:
        """Until ``rows`` rows in all went below the host tier and nothing is in flight there
        (a benchmark's next step must find them at the disk or the peers); ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.kvtier_stats()
            if stats["lower"]["spills_done"] >= rows and stats["lower_inflight"] == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{rows} rows not below the host tier in {timeout_s} s: {stats['lower']}")
            time.sleep(0.1)

    def remote_owners(self, prompt: list[int]) -> dict[str, Any]:
        """For each full block of ``prompt``: the peer that owns its row now (``owners``, an
        address or None) and whether the remote tier knows it holds it (``known``); and the
        peers up (``peers_up``). Needs kvtier with a remote tier."""
        return self.call({"op": "remote_owners", "prompt": prompt})

    def drop_rows(self, spec_type: str) -> int:
        """Forget kvtier's host rows of the KV groups whose vLLM spec is a ``spec_type``
        (``"MambaSpec"``: a hybrid's recurrent states); the number of rows dropped."""
        return int(self.call({"op": "drop_rows", "spec_type": spec_type})["dropped"])

    def groups(self, spec_type: str) -> list[int]:
        """kvtier's indices of the KV groups whose vLLM spec is a ``spec_type``: the group
        index a row's key ends with (``offload.keys.key_group``)."""
        return list(self.call({"op": "groups", "spec_type": spec_type})["groups"])

    def row_bands(self, spec_type: str, bands: int, *, rotate: bool = False) -> list[dict[str, Any]]:
        """kvtier's host rows of the KV groups whose vLLM spec is a ``spec_type``, cut into
        ``bands`` bands (one per tensor-parallel rank): per row, ``digests`` (one per band)
        and ``zero`` (per band: all zero bytes). ``rotate``: then move every row's bands one
        rank down, so each rank would load another rank's bytes (a test's way to show a
        load reads its own rank's band)."""
        answer = self.call({"op": "row_bands", "spec_type": spec_type, "bands": bands, "rotate": rotate})
        return list(answer["rows"])

    def call(self, command: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        self._send(command)
        return self._receive(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        if self._log.closed:
            return
        if self.process.poll() is None:
            with contextlib.suppress(EngineError, OSError):
                self.call({"op": "shutdown"}, timeout_s)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the engine process (its workers die with it: vLLM's workers watch their parent)."""
        self.process.kill()
        self.process.wait()

    # -- the pipe ----------------------------------------------------------------------

    def _send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(command).encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError as exc:
            raise EngineError(f"the engine process is gone ({self._tail()})") from exc

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                self.process.kill()
                raise EngineError(f"the engine did not answer in {timeout_s:.0f} s ({self._tail()})")
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise EngineError(f"the engine process exited with {self.process.returncode} ({self._tail()})")
        answer = json.loads(line)
        if "error" in answer:
            raise EngineError(answer["error"])
        return answer

    def _tail(self, lines: int = 15) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"log {self.log_path}: " + " | ".join(text[-lines:])


# -- the child -------------------------------------------------------------------------


class _Child:
    """The engine, and one handler per command."""

    def __init__(self, spec: EngineSpec) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        if spec.child_setup is not None:
            module_name, _, function = spec.child_setup.partition(":")
            getattr(importlib.import_module(module_name), function)()
        kwargs = spec.llm_kwargs()
        if spec.kvtier is not None:
            module = (
                {}
                if spec.kv_connector == "OffloadingConnector"
                else {"kv_connector_module_path": "offload.vllm.connector"}
            )
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector=spec.kv_connector,
                kv_role="kv_both",
                kv_connector_extra_config=spec.kvtier,
                **module,
            )
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.prefill_stats: dict[str, tuple[int, int]] = {}
        self._capture_prefill_stats()
        self._ids = 0

    def _capture_prefill_stats(self) -> None:
        """Record each request's (local, external) cached tokens as the engine core reports them."""
        client = self.engine.engine_core
        get_output = client.get_output

        def get_output_recorded() -> Any:
            outputs = get_output()
            for output in outputs.outputs:
                stats = getattr(output, "prefill_stats", None)
                if stats is not None and output.request_id not in self.prefill_stats:
                    self.prefill_stats[output.request_id] = (
                        stats.num_local_cached_tokens,
                        stats.num_external_cached_tokens,
                    )
            return outputs

        client.get_output = get_output_recorded

    @property
    def scheduler(self) -> Any:
        return self.engine.engine_core.engine_core.scheduler

    def kvtier_manager(self) -> Any | None:
        connector = getattr(self.scheduler, "connector", None)
        scheduler_side = getattr(connector, "connector_scheduler", None)
        return getattr(scheduler_side, "manager", None)

    # -- commands ----------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        lora: dict[str, Any] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, extra_args=extra
        )
        request = None if lora is None else LoRARequest(lora["name"], lora["lora_id"], lora["path"])
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p, **salt) for p in prompts],
            params,
            use_tqdm=False,
            lora_request=request,
        )
        return {"outputs": [self._completion(o) for o in outputs]}

    def timed(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        """Add each request when it arrives, step the engine, time each first token."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = self.engine
        pending = list(enumerate(requests))
        ids: dict[str, int] = {}
        arrived: dict[str, float] = {}
        first: dict[str, float] = {}
        results: dict[int, dict[str, Any]] = {}
        last_finish = 0.0  # when every request added so far had finished
        steps = waited = 0
        start = time.perf_counter()

        def due(request: dict[str, Any]) -> float | None:
            """When ``request`` arrives (seconds from the start); None: not before a finish."""
            if request.get("max_in_flight"):  # a client holding that many requests open
                if engine.get_num_unfinished_requests() >= request["max_in_flight"]:
                    return None
                return 0.0
            if not request.get("after_finish"):
                return request["arrival_s"]
            if engine.has_unfinished_requests():
                return None
            return last_finish + request["arrival_s"]

        while pending or engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and (at := due(pending[0][1])) is not None and at <= now:
                index, request = pending.pop(0)
                req_id = self._next_id()
                params = SamplingParams(
                    max_tokens=request["max_tokens"], temperature=0.0, logprobs=0, ignore_eos=True
                )
                engine.add_request(req_id, TokensPrompt(prompt_token_ids=request["prompt"]), params)
                ids[req_id] = index
                arrived[req_id] = time.perf_counter() - start
            if not engine.has_unfinished_requests():
                at = due(pending[0][1])
                time.sleep(max(0.0, min(0.05, (at if at is not None else now) - now)))
                continue
            waited += self._waiting_on_loads()
            outputs = engine.step()
            steps += 1
            stamp = time.perf_counter() - start
            for output in outputs:
                if output.outputs and output.outputs[0].token_ids:
                    first.setdefault(output.request_id, stamp)
                if output.finished:
                    completion = self._completion(output)
                    completion.update(
                        arrival_s=arrived[output.request_id],
                        ttft_s=first[output.request_id] - arrived[output.request_id],
                        finish_s=stamp,
                    )
                    results[ids[output.request_id]] = completion
                    last_finish = stamp
        return {
            "outputs": [results[i] for i in range(len(requests))],
            "steps": steps,
            "steps_waiting_on_loads": waited,
            "wall_s": time.perf_counter() - start,
        }

    def reset_prefix_cache(self, connector: bool) -> dict[str, Any]:
        if connector:
            return {"ok": self.llm.reset_prefix_cache(reset_connector=True)}
        return {"ok": self.llm.reset_prefix_cache()}

    def kvtier_stats(self) -> dict[str, Any]:
        adapter = self.kvtier_manager()
        if adapter is None or not hasattr(adapter, "loads_by_tier"):
            return {"kvtier": False}
        manager = adapter.manager
        with adapter.lock:
            manager.poll()  # finished spills and promotions
            stats = {
                "kvtier": True,
                "loaded_rows_by_tier": dict(adapter.loads_by_tier),
                "stored_rows": manager.stats.stored_rows,
                "host_rows": len(manager),
                "lookups": manager.stats.lookups,
                "hits": manager.stats.hits,
                "row_bytes": adapter.row_bytes,
            }
            if manager.lower.tiers:
                stats["lower"] = dataclasses.asdict(manager.lower.stats)
                stats["lower_inflight"] = manager.inflight_below()
                stats["rows_converted_on_landing"] = manager.lower.rows_converted
        return stats

    def remote_owners(self, prompt: list[int]) -> dict[str, Any]:
        """Where the remote tier would look for each full block of ``prompt``: the keys are
        the ones vLLM's offloading connector makes (its block hashes, group 0, one block per
        row), computed by the engine core's own hasher (its hash seed is this process's)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.request import Request

        adapter = self.kvtier_manager()
        if adapter is None or not hasattr(adapter, "manager"):
            raise ValueError("remote_owners: the engine runs without kvtier")
        remote = next((t for t in adapter.manager.lower.tiers if t.kind == "remote"), None)
        if remote is None:
            raise ValueError("remote_owners: kvtier has no remote tier")
        hasher = self.engine.engine_core.engine_core.request_block_hasher
        params = SamplingParams(max_tokens=1)
        request = Request("kvtier-owners", list(prompt), params, None, block_hasher=hasher)
        keys = [make_offload_key(block_hash, 0) for block_hash in request.block_hashes]
        with adapter.lock:
            return {
                "owners": [remote.owner(key) for key in keys],
                "known": [remote.may_contain(key) for key in keys],
                "peers_up": remote.peers_up(),
            }

    def groups(self, spec_type: str) -> dict[str, Any]:
        """kvtier's indices of the groups whose ``KVCacheSpec`` is a ``spec_type`` (by class
        name, subclasses included)."""
        adapter = self.kvtier_manager()
        if adapter is None or not hasattr(adapter, "manager"):
            raise ValueError("groups: the engine runs without kvtier")
        return {"groups": sorted(self._groups_of(adapter, spec_type))}

    def drop_rows(self, spec_type: str) -> dict[str, Any]:
        """Forget the host rows of every group whose ``KVCacheSpec`` is a ``spec_type`` (by class
        name, subclasses included), as if evicted; the host tier's other rows stay."""
        from offload.keys import key_group

        wanted = set(self.groups(spec_type)["groups"])
        adapter = self.kvtier_manager()
        manager = adapter.manager
        with adapter.lock:
            manager.poll()
            dropped = manager.discard([key for key in manager.held_keys() if key_group(key) in wanted])
        return {"dropped": dropped, "groups": sorted(wanted)}

    def row_bands(self, spec_type: str, bands: int, rotate: bool) -> dict[str, Any]:
        """The host rows of every group whose ``KVCacheSpec`` is a ``spec_type``, each cut
        into ``bands`` equal bands (one per tensor-parallel rank: ``canonical.HostLayout``):
        a digest of each band's bytes, and whether the band is all zeros. ``rotate``: then
        move every band one rank down (rank ``r`` finds rank ``r + 1``'s bytes), as a worker
        writing or reading another rank's band would leave them."""
        import hashlib

        from offload.keys import key_group

        adapter = self.kvtier_manager()
        if adapter is None or not hasattr(adapter, "manager"):
            raise ValueError("row_bands: the engine runs without kvtier")
        manager = adapter.manager
        wanted = self._groups_of(adapter, spec_type)
        rows = []
        with adapter.lock:
            manager.poll()
            for key in manager.held_keys():
                slot = manager.slot_of(key)
                if key_group(key) not in wanted or slot is None:
                    continue
                row = adapter.host.row(key_group(key), slot)
                if row.numel() % bands:
                    raise ValueError(f"row_bands: a {row.numel()} B row is not {bands} equal bands")
                parts = row.view(bands, -1)
                rows.append(
                    {
                        "digests": [
                            hashlib.blake2b(p.numpy().tobytes(), digest_size=8).hexdigest() for p in parts
                        ],
                        "zero": [not bool(p.any()) for p in parts],
                    }
                )
                if rotate:
                    parts.copy_(parts.roll(-1, dims=0))
        return {"rows": rows, "groups": sorted(wanted)}

    # -- helpers -----------------------------------------------------------------------

    def _groups_of(self, adapter: Any, spec_type: str) -> set[int]:
        """kvtier's indices of the KV groups whose vLLM spec is a ``spec_type`` (by class name)."""
        vllm_groups = self.scheduler.kv_cache_config.kv_cache_groups
        return {
            index
            for index, group_id in enumerate(adapter.group_ids)
            if any(cls.__name__ == spec_type for cls in type(vllm_groups[group_id].kv_cache_spec).__mro__)
        }

    def _next_id(self) -> str:
        self._ids += 1
        return f"kvtier-bench-{self._ids}"

    def _waiting_on_loads(self) -> int:
        """1 if some request waits for KV a connector is loading (vLLM's WAITING_FOR_REMOTE_KVS)."""
        from vllm.v1.request import RequestStatus

        requests = getattr(self.scheduler, "requests", {})
        return int(any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests.values()))

    def _completion(self, output: Any) -> dict[str, Any]:
        sample = output.outputs[0]
        logprobs = [
            entry[token].logprob
            for token, entry in zip(sample.token_ids, sample.logprobs or [], strict=False)
        ]
        # The engine core knows a request as "<its id>-<8 random characters>".
        internal = next(
            (key for key in self.prefill_stats if key.rpartition("-")[0] == output.request_id), None
        )
        local_external = None if internal is None else self.prefill_stats.pop(internal)
        return asdict(
            Completion(
                tokens=list(sample.token_ids),
                logprobs=logprobs,
                num_cached_tokens=int(output.num_cached_tokens or 0),
                external_cached_tokens=None if local_external is None else local_external[1],
                preemptions=getattr(output.metrics, "num_preemptions", None),
            )
        )


def _serve(commands: IO[str], answers: IO[str]) -> None:
    child: _Child | None = None

    def answer(payload: dict[str, Any]) -> None:
        answers.write(json.dumps(payload) + "\n")
        answers.flush()

    for line in commands:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "start":
                child = _Child(EngineSpec(**command["spec"]))
                answer({"ok": True, "pid": os.getpid()})
                continue
            if op == "shutdown":
                answer({"ok": True})
                return
            assert child is not None, "start the engine first"
            if op == "generate":
                answer(
                    child.generate(
                        command["prompts"],
                        command["max_tokens"],
                        command.get("lora"),
                        command.get("kv_transfer_params"),
                        command.get("cache_salt"),
                    )
                )
            elif op == "timed":
                answer(child.timed(command["requests"]))
            elif op == "reset_prefix_cache":
                answer(child.reset_prefix_cache(command.get("connector", False)))
            elif op == "kvtier_stats":
                answer(child.kvtier_stats())
            elif op == "remote_owners":
                answer(child.remote_owners(command["prompt"]))
            elif op == "drop_rows":
                answer(child.drop_rows(command["spec_type"]))
            elif op == "groups":
                answer(child.groups(command["spec_type"]))
            elif op == "row_bands":
                answer(child.row_bands(command["spec_type"], command["bands"], command.get("rotate", False)))
            else:
                answer({"error": f"unknown command {op!r}"})
        except Exception as exc:  # the parent gets the error; the engine stays up when it can
            log.exception("engine command %s failed", op)
            answer({"error": f"{op}: {type(exc).__name__}: {exc}"})
            if op == "start":
                return


def main() -> None:
    """The child: answers go to a private copy of stdout; everything else printed goes to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        _serve(sys.stdin, answers)
    finally:
        answers.close()
        # vLLM's engine core shuts down from atexit and finalizers; leave through them.


if __name__ == "__main__":
    main()
