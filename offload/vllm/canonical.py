"""What the scheduler and the workers must agree on: host rows, the layout fingerprint.

vLLM builds the manager (scheduler process) before, and apart from, the workers that see
the KV tensors, so the host layout is derived from ``OffloadingConfig`` alone, the same way
in every process:

- one host row per chunk (``blocks_per_chunk`` device blocks) per KV group;
- a row is ``blocks_per_chunk`` sub-rows, one per device block; a sub-row holds every
  worker's page of that block side by side, each in a band of ``worker_block_bytes``
  (vLLM's per-worker bytes per block, rounded up to ``ROW_ALIGNMENT``);
- a worker copies its group's canonical row (the refs' bytes, one after another) into its
  band; a group whose layers use fewer bytes than the band leaves the rest as padding.

The fingerprint digests what a row's bytes mean (groups, their layers and block sizes, the
bytes per block, chunking, dtype, parallel layout, vLLM's KV cache layout). It keys the
namespace of persisted rows, so it must not depend on anything a restart changes
(engine id, number of device blocks, addresses).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches as VllmCanonicalKVCaches
from vllm.v1.kv_offload.config import OffloadingConfig

from offload.layout import CanonicalKVCaches, CanonicalRef, CanonicalTensor
from offload.vllm.compat import sliding_window_chunks

ROW_ALIGNMENT = 64
"""Bands start at multiples of this: int64 copy words, and cache-line aligned rows."""


@dataclass(frozen=True)
class HostLayout:
    num_groups: int
    blocks_per_chunk: int
    worker_block_bytes: int  # one worker's band in a sub-row
    num_workers: int

    @classmethod
    def from_config(cls, config: OffloadingConfig) -> HostLayout:
        per_block = config.worker_kv_bytes_per_block
        if per_block <= 0:
            raise ValueError(
                f"vLLM reported {per_block} KV bytes per block (worker_kv_bytes_per_block): "
                "this KV cache layout cannot be offloaded by kvtier"
            )
        workers = 1 if config.replicated_layout else max(1, config.parallel.world_size)
        band = -(-per_block // ROW_ALIGNMENT) * ROW_ALIGNMENT
        return cls(len(config.groups), config.cache.blocks_per_chunk, band, workers)

    @property
    def sub_row_bytes(self) -> int:
        return self.num_workers * self.worker_block_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one host row (one chunk of one group)."""
        return self.blocks_per_chunk * self.sub_row_bytes

    def band_offset(self, rank: int) -> int:
        return 0 if self.num_workers == 1 else rank * self.worker_block_bytes


def config_fingerprint(config: OffloadingConfig, layout: HostLayout) -> str:
    """32 hex digits naming the meaning of a host row's bytes (see the module doc)."""
    parallel = config.parallel
    description = {
        "format": "kvtier-vllm-v1",
        "groups": [
            {
                "layers": list(group.layer_names),
                "tokens_per_block": group.tokens_per_block,
                "sliding_window_chunks": sliding_window_chunks(group),
            }
            for group in config.groups
        ],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "band": layout.worker_block_bytes,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "dtype": config.model.dtype,
        "kv_cache_layout": config.kv_cache_layout,
        "parallel": [
            layout.num_workers,
            parallel.tp_size,
            parallel.pp_size,
            parallel.pcp_size,
            parallel.dcp_size,
        ],
    }
    return hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16).hexdigest()


def to_kvtier_caches(
    kv_caches: VllmCanonicalKVCaches, *, fingerprint: str, block_size: int
) -> CanonicalKVCaches:
    """kvtier's view of the caches vLLM hands a worker: the same tensors (as uint8 rows) and refs.

    vLLM gives one ref per layer (a per-layer layout) or one per group covering the whole
    packed block (a cross-layer layout); a ref's page is the un-padded bytes at the start of
    its tensor's row.
    """
    if not kv_caches.tensors:
        raise ValueError("vLLM registered no KV cache tensors to offload")
    tensors = []
    for index, entry in enumerate(kv_caches.tensors):
        tensor = entry.tensor
        if tensor.dim() != 2 or tensor.element_size() != 1:
            raise ValueError(
                f"KV cache tensor {index}: expected (num_blocks, page bytes) int8 rows, got "
                f"shape {tuple(tensor.shape)} of {tensor.dtype}"
            )
        tensors.append(CanonicalTensor(tensor.view(torch.uint8), entry.page_size_bytes))
    num_blocks = tensors[0].tensor.shape[0]
    if any(t.tensor.shape[0] != num_blocks for t in tensors):
        raise ValueError(
            f"KV cache tensors disagree on the number of blocks: {[t.tensor.shape[0] for t in tensors]}"
        )
    refs = []
    for group, group_refs in enumerate(kv_caches.group_data_refs):
        if not group_refs:
            raise ValueError(f"KV cache group {group} has no tensors")
        for ref in group_refs:
            if ref.page_size_bytes > tensors[ref.tensor_idx].tensor.shape[1]:
                raise ValueError(
                    f"group {group}: a {ref.page_size_bytes} B page does not fit tensor {ref.tensor_idx}'s "
                    f"{tensors[ref.tensor_idx].tensor.shape[1]} B rows"
                )
        refs.append([CanonicalRef(ref.tensor_idx, ref.page_size_bytes, 0) for ref in group_refs])
    return CanonicalKVCaches(tensors, refs, num_blocks, block_size, fingerprint)
