"""kvtier's ``OffloadingWorker`` behind vLLM's worker interface (one per worker process).

The scheduler sends device blocks as a ``GPULoadStoreSpec`` (block ids ordered group by
group, ``group_sizes``, and ``block_indices``: the position of each group's first block in
its request) and host rows as the ``HostRowsSpec`` the manager returned. A group's first
block may sit in the middle of its first chunk (``block_indices[g] % blocks_per_chunk``):
that is where it lands in the chunk's host row.

The copies run on whatever device the KV caches are on: CPU tensors (a pool of copy
threads) or CUDA (a copy stream). A copy never fails below the host tier here: the only
failure is a bug, reported as a failed ``TransferResult`` (which vLLM asserts against).
"""

from __future__ import annotations

import logging

import numpy as np
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult

from offload.worker import OffloadingWorker as RowWorker
from tiers.host import HostTier

log = logging.getLogger(__name__)


class HostRowsSpec(LoadStoreSpec):
    """Host-tier slots, one list per KV group, in the order of the keys they hold; for a
    load, ``layouts``: the layout id of each row still in another engine's layout (``None``:
    ours; all ``None``: the field itself is), which the worker converts as it loads it."""

    def __init__(self, slots: list[list[int]], layouts: list[list[bytes | None]] | None = None) -> None:
        self.slots = slots
        self.layouts = layouts

    def __repr__(self) -> str:
        return f"HostRowsSpec({self.slots!r})"


class KVTierWorker(OffloadingWorker):
    def __init__(self, worker: RowWorker, host: HostTier) -> None:
        self.worker = worker
        self.host = host
        self.blocks_per_chunk = worker.blocks_per_row

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        blocks, first = self._device_blocks(src_spec)
        return self.worker.submit_store(job_id, blocks, _slots(dst_spec), first_sub_rows=first)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        blocks, first = self._device_blocks(dst_spec)
        layouts = src_spec.layouts if isinstance(src_spec, HostRowsSpec) else None
        if layouts is None or not any(any(group) for group in layouts):  # all ours: the plain copy
            return self.worker.submit_load(job_id, blocks, _slots(src_spec), first_sub_rows=first)
        return self.worker.submit_load(
            job_id, blocks, _slots(src_spec), first_sub_rows=first, row_layouts=layouts
        )

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time)
            for r in self.worker.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.host.close()

    def _device_blocks(self, spec: GPULoadStoreSpec) -> tuple[list[list[int]], list[int]]:
        block_ids = np.asarray(spec.block_ids).tolist()
        groups, start = [], 0
        for size in spec.group_sizes:
            groups.append(block_ids[start : start + size])
            start += size
        first = [
            int(index) % self.blocks_per_chunk if size else 0
            for index, size in zip(spec.block_indices, spec.group_sizes, strict=True)
        ]
        return groups, first


def _slots(spec: LoadStoreSpec) -> list[list[int]]:
    if not isinstance(spec, HostRowsSpec):
        raise TypeError(f"expected kvtier's HostRowsSpec for the host side, got {type(spec).__name__}")
    return spec.slots
