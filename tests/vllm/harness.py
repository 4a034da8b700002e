"""An engine made of vLLM's real pieces, on CPU tensors, with kvtier loaded by module path.

``Engine`` builds vLLM's ``VllmConfig`` (for a tiny model registered in-process, so nothing
is downloaded), lets vLLM's planner lay out the KV cache (``LBHNC``: a tensor region per
layer; ``BLHNC``: every layer a view into one block-major allocation, which vLLM hands the
spec as one full-row tensor per group), allocates it as CPU tensors, and builds vLLM's
``Scheduler`` (with the scheduler-role ``OffloadingConnector``) and a worker-role
``OffloadingConnector`` that registers those tensors. ``step`` is one engine step, in the
order vLLM's model runner drives a connector. The "model" writes, for every token it
computes, bytes that depend only on (layer, position, token): a block loaded from kvtier
must hold exactly those bytes, and ``verify`` checks them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm import ModelRegistry, SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, create_kv_cache_views
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

try:  # vLLM 0.33 moved the KV cache planner out of kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

ARCH = "KVTierTinyForCausalLM"
BLOCK_SIZE = 16
NUM_LAYERS = 4
SLIDING_WINDOW = 48
SAMPLED_TOKEN = 7
HEAD_SIZE = 8
KV_CACHE_TORCH_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
"""The element type of vLLM's quantised KV caches (``--kv-cache-dtype``)."""


class KVTierTinyForCausalLM(nn.Module):
    """Enough of a model class for vLLM's registry to inspect; it is never run."""

    def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def tiny_model_dir(root: Path, name: str = "tiny-model", kv_heads: int = 2) -> Path:
    """A Hugging Face config for the tiny model (no weights, no tokenizer: none are loaded).
    Its KV heads and head size are those of ``Engine``'s layers (the spec reads them here)."""
    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, KVTierTinyForCausalLM)
    path = root / name
    path.mkdir(exist_ok=True)
    config = {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": kv_heads,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "torch_dtype": "float16",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def kv_byte(layer: int, position: int, token: int, width: int) -> torch.Tensor:
    """The bytes the model writes for one token of one layer and head (``width`` bytes)."""
    digest = hashlib.blake2b(f"{layer}/{position}/{token}".encode(), digest_size=64).digest()
    raw = (digest * (width // 64 + 1))[:width]
    return torch.frombuffer(bytearray(raw), dtype=torch.int8)


@dataclass
class RequestRecord:
    prompt: list[int]
    computed: set[int] = field(default_factory=set)  # positions the model computed
    loaded: list[tuple[int, int]] = field(default_factory=list)  # token ranges verified after a load
    block_ids: tuple[list[int], ...] = ()
    block_hashes: list[bytes] = field(default_factory=list)
    finished: bool = False
    preempted: bool = False


class Engine:
    def __init__(
        self,
        model_dir: Path,
        shm_dir: Path,
        *,
        layout: str = "LBHNC",
        hybrid: bool = False,
        num_gpu_blocks: int = 64,
        blocks_per_chunk: int = 1,
        cpu_bytes_to_use: int = 4 << 20,
        kvtier_config: Any = None,
        enable_events: bool = False,
        extra: dict[str, Any] | None = None,
        kv_heads: int = 2,
        dtype: str = "float16",
        kv_cache_dtype: str = "auto",
        block_size: int = BLOCK_SIZE,
        connector: str = "OffloadingConnector",
        sync_loads: bool = False,
    ) -> None:
        """``connector``: ``OffloadingConnector`` (vLLM's, keys are block hashes) or
        ``KVTierConnector`` (``offload.vllm.connector``: keys are token digests).
        ``sync_loads``: kvtier's default, vLLM 0.33 loading small hits within the step;
        off by default here, so that every load goes the asynchronous way, reported in
        ``finished_recving`` and checked there (``_verify_load``). ``kv_cache_dtype``:
        vLLM's ``--kv-cache-dtype`` (``auto``: the model's ``dtype``)."""
        self.block_size = block_size
        extra_config: dict[str, Any] = {
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "offload.vllm",
            "cpu_bytes_to_use": cpu_bytes_to_use,
            "shm_dir": str(shm_dir),
            # The "model" below writes C bytes per token and head: K and V of a token together.
            "kv_page_split": "token",
            **({} if sync_loads else {"sync_load_budget_bytes": 0}),
            **({"blocks_per_chunk": blocks_per_chunk} if blocks_per_chunk != 1 else {}),
            **({"kvtier_config": kvtier_config} if kvtier_config is not None else {}),
            **(extra or {}),
        }
        model_config = ModelConfig(model=str(model_dir), dtype=dtype, seed=0, skip_tokenizer_init=True)
        cache_config = CacheConfig(
            block_size=self.block_size, enable_prefix_caching=True, cache_dtype=kv_cache_dtype
        )
        cache_config.kv_cache_layout = layout
        config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=2048,
                max_model_len=4096,
                is_encoder_decoder=False,
            ),
            cache_config=cache_config,
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector,
                kv_role="kv_both",
                kv_connector_extra_config=extra_config,
                **(
                    {"kv_connector_module_path": "offload.vllm.connector"}
                    if connector != "OffloadingConnector"
                    else {}
                ),
            ),
            device_config=DeviceConfig("cpu"),
        )
        if enable_events:
            from vllm.config import KVEventsConfig

            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        # vLLM runs hybrid models with one block table per group only on GPU platforms.
        config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
        self.config = config
        torch_dtype = getattr(torch, KV_CACHE_TORCH_DTYPES.get(kv_cache_dtype, dtype))
        self.layer_specs = {
            f"layer{i}": (
                SlidingWindowSpec(
                    block_size=self.block_size,
                    num_kv_heads=kv_heads,
                    head_size=HEAD_SIZE,
                    dtype=torch_dtype,
                    sliding_window=SLIDING_WINDOW,
                )
                if hybrid and i % 2
                else FullAttentionSpec(
                    block_size=self.block_size, num_kv_heads=kv_heads, head_size=HEAD_SIZE, dtype=torch_dtype
                )
            )
            for i in range(NUM_LAYERS)
        }
        groups = get_kv_cache_groups(config, dict(self.layer_specs))
        page = sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in groups[:1])
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, page * num_gpu_blocks)
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.kv_cache_config = kv_cache_config
        self.num_blocks = kv_cache_config.num_blocks
        self.kv_caches = self._allocate(kv_cache_config, config.cache_config.get_resolved_kv_cache_layout())
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=self.block_size,
        )
        worker_class = OffloadingConnector
        if connector != "OffloadingConnector":
            from offload.vllm.connector import KVTierConnector

            worker_class = KVTierConnector
        self.worker = worker_class(config, KVConnectorRole.WORKER, kv_cache_config)
        with set_current_vllm_config(config):
            self.worker.register_kv_caches(self.kv_caches)
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        self.connector = connector
        self.manager = connector.connector_scheduler.manager  # type: ignore[union-attr]
        self.manager = getattr(self.manager, "inner", self.manager)  # KVTierConnector's token keys
        self.spec = self.worker.connector_worker.spec  # type: ignore[union-attr]
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)
        self._ids = itertools.count()
        self._lora_ids: dict[tuple[str, str], int] = {}
        self.requests: dict[str, RequestRecord] = {}
        self.steps = 0
        self._ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})

    @staticmethod
    def _allocate(kv_cache_config: Any, layout: Any) -> dict[str, torch.Tensor]:
        """vLLM's ``allocate_kv_cache``, on CPU (its module needs a GPU build to import)."""
        buffer = torch.zeros(kv_cache_config.kv_cache_tensors[0].size, dtype=torch.int8)
        caches: dict[str, torch.Tensor] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            spec = next(
                g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if tensor.layers[0] in g.layer_names
            )
            views = create_kv_cache_views(buffer, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor)
            caches.update(zip(tensor.layers, views, strict=True))
        return caches

    # -- requests ------------------------------------------------------------------------

    def add(
        self,
        prompt: Sequence[int],
        max_tokens: int = 1,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora: tuple[str, str] | None = None,
    ) -> str:
        """Queue a request; ``kv_transfer_params`` travel as vLLM's OpenAI server sends them
        (``SamplingParams.extra_args``). ``lora``: the request's adapter (name, path), which
        only keys its blocks here (the "model" computes no adapter)."""
        req_id = f"req-{next(self._ids)}"
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        lora_request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(
                lora[0], self._lora_ids.setdefault(lora, len(self._lora_ids) + 1), lora[1]
            )
        request = Request(
            req_id,
            list(prompt),
            params,
            None,
            lora_request=lora_request,
            cache_salt=cache_salt,
            block_hasher=self._hasher,
        )
        self.requests[req_id] = RequestRecord(
            list(prompt), block_hashes=[bytes(h) for h in request.block_hashes]
        )
        self.scheduler.add_request(request)
        return req_id

    def run(self, max_steps: int = 2000) -> None:
        """Step until every request has finished and every transfer has been reported."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"the engine did not go idle in {max_steps} steps")

    def step(self) -> None:
        scheduler, worker = self.scheduler, self.worker
        output = scheduler.schedule()
        self.steps += 1
        for req_id in output.preempted_req_ids or ():
            self.requests[req_id].preempted = True
        meta = output.kv_connector_metadata
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(self._ctx)
        for req_id, count in output.num_scheduled_tokens.items():
            self._compute(req_id, count)
        if output.total_num_scheduled_tokens > 0:
            worker.wait_for_save()
        else:
            time.sleep(0.001)  # only transfers are in flight: let the copy threads run
        sending, recving = worker.get_finished(output.finished_req_ids)
        for req_id in recving or ():
            self._verify_load(req_id)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        running = [r for r in scheduler.running if r.request_id in output.num_scheduled_tokens]
        model_output = ModelRunnerOutput(
            req_ids=[r.request_id for r in running],
            req_id_to_index={r.request_id: i for i, r in enumerate(running)},
            sampled_token_ids=[[SAMPLED_TOKEN] if not r.is_prefill_chunk else [] for r in running],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, kv_connector_worker_meta=worker_meta
            ),
        )
        scheduler.update_from_output(output, model_output)
        for req_id, record in self.requests.items():
            request = scheduler.requests.get(req_id)
            if request is None or request.is_finished():
                record.finished = True

    # -- the "model" ---------------------------------------------------------------------

    def _compute(self, req_id: str, count: int) -> None:
        request = self.scheduler.requests[req_id]
        end = request.num_computed_tokens
        record = self.requests[req_id]
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        record.block_ids = tuple(list(ids) for ids in block_ids)
        tokens = request.all_token_ids
        for position in range(end - count, end):
            record.computed.add(position)
            for group, ids in zip(self.kv_cache_config.kv_cache_groups, block_ids, strict=True):
                block = ids[position // self.block_size]
                if block == 0:
                    continue  # outside a sliding window: no block
                for name in group.layer_names:
                    self._slot(name, block, position)[...] = self._expected(name, position, tokens[position])

    def _slot(self, name: str, block: int, position: int) -> torch.Tensor:
        """One token's bytes of one layer: ``[heads, bytes]``."""
        view = self.kv_caches[name][block]  # [H, N, C] in the layer's dtype
        return view[:, position % self.block_size].view(torch.int8)

    def _expected(self, name: str, position: int, token: int) -> torch.Tensor:
        layer = int(name.removeprefix("layer"))
        heads, width = self._slot(name, 1, 0).shape
        return torch.stack([kv_byte(layer * 8 + h, position, token, width) for h in range(heads)])

    # -- checks --------------------------------------------------------------------------

    def _verify_load(self, req_id: str) -> None:
        request = self.scheduler.requests[req_id]
        end = request.num_computed_tokens
        self.verify(req_id, 0, end)
        self.requests[req_id].loaded.append((0, end))

    def verify(self, req_id: str, start: int, end: int) -> int:
        """Assert every allocated block of the request holds the model's bytes for tokens
        ``[start, end)``; returns how many token slots were checked."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        tokens = self.scheduler.requests[req_id].all_token_ids
        checked = 0
        for group, ids in zip(self.kv_cache_config.kv_cache_groups, block_ids, strict=True):
            for position in range(start, end):
                index = position // self.block_size
                if index >= len(ids) or ids[index] == 0:
                    continue
                for name in group.layer_names:
                    actual = self._slot(name, ids[index], position)
                    expected = self._expected(name, position, tokens[position])
                    assert torch.equal(actual, expected), (
                        f"{req_id}: {name} token {position} in block {ids[index]} differs from what "
                        "the model computed"
                    )
                    checked += 1
        return checked

    def scramble(self) -> None:
        """Fill the whole device KV cache with noise: only a load can bring the bytes back."""
        generator = torch.Generator().manual_seed(1234)
        for tensor in {t.untyped_storage().data_ptr(): t for t in self.kv_caches.values()}.values():
            raw = torch.empty(0, dtype=torch.int8).set_(tensor.untyped_storage())
            raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=generator))

    def evict_device_cache(self) -> None:
        assert self.scheduler.kv_cache_manager.reset_prefix_cache(), "requests still hold device blocks"

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
