"""Moving blocks between the engine's KV caches and host rows.

A ``RowCopier`` knows, for one KV group, every canonical ref as a pair of column views:
the device side ``(num_blocks, words)`` and the host side ``(host_rows, words)``. A store
or load is then one indexed op per ref per run of adjacent host rows:

- CPU: ``index_select(device, blocks, out=host[run])`` and ``device.index_copy_(blocks,
  host[run])`` write straight into the strided host view, one pass over the bytes. Views
  use the widest integer word that divides every offset (index kernels move elements, and
  a byte-wise gather is an order of magnitude slower than a word-wise one). The work is
  cut into independent tasks for a pool of single-threaded copy threads: measured here,
  that matches a plain ``copy_`` where one multi-threaded ``index_select`` reaches ~0.75.
- CUDA: host memory cannot be indexed from the device, so each run is assembled into
  whole rows in a device staging buffer (a gather in HBM, cheap next to PCIe) and moved
  with one contiguous DMA per run, on the copy stream.

A packed (cross-layer) group has one ref, so each run is a single op on both paths.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from offload.layout import CanonicalKVCaches, widest_int_dtype
from offload.row_layout import GroupRowLayout, convert_into

ROW_COPY_MIN_BYTES = 256 * 2**10
"""A CPU load scatters rows at least this big with one ``copy_`` each: measured here, a
single-threaded ``index_copy_`` reaches ~0.8 of ``copy_`` on 2 MiB rows, row copies ~1.0."""

Task = Callable[[], object]
"""One independent piece of a copy (tasks of one job may run concurrently)."""

STAGING_BYTES = 64 * 2**20
"""Upper bound of the device staging buffer per group on CUDA (a run is split to fit)."""


@dataclass(frozen=True)
class _RefColumns:
    device: torch.Tensor  # (num_blocks, words): this ref's bytes of every device block
    host: torch.Tensor  # (host_rows, words): the same bytes' place in every host row
    host_offset: int  # bytes from the start of a host row
    size: int  # bytes


def _copy_rows(device: torch.Tensor, blocks: Sequence[int], host: torch.Tensor) -> None:
    """Scatter host rows into device blocks one ``copy_`` each (for rows big enough to amortise a call)."""
    for row, block in enumerate(blocks):
        device[block].copy_(host[row])


def adjacent_runs(rows: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Split positions ``[0, len(rows))`` into maximal runs where ``rows`` counts up by one."""
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            yield start, i
            start = i


class RowCopier:
    """Copies one group's blocks to and from its host slab.

    ``blocks_per_row`` device blocks make one host row (vLLM's ``blocks_per_chunk``): the
    slab ``(slots, blocks_per_row * block_bytes)`` is seen as ``(slots * blocks_per_row,
    block_bytes)`` and slot ``s`` holds sub-rows ``s * blocks_per_row ...``.

    ``host_block_bytes`` (default ``block_bytes``) is the size of a host sub-row when it is
    larger than this device's block: the block's bytes then sit at ``host_offset_bytes`` in
    each sub-row, and the rest of the sub-row is another device's (a tensor-parallel rank's
    band) or padding. vLLM's scheduler sizes host rows before any worker has seen its
    tensors, so a sub-row is the engine's per-block page size, times its ranks.
    """

    def __init__(
        self,
        caches: CanonicalKVCaches,
        group: int,
        host_slab: torch.Tensor,
        blocks_per_row: int = 1,
        *,
        host_block_bytes: int | None = None,
        host_offset_bytes: int = 0,
    ) -> None:
        self.block_bytes = caches.row_bytes(group)
        self.blocks_per_row = blocks_per_row
        sub_row = self.block_bytes if host_block_bytes is None else host_block_bytes
        if host_offset_bytes < 0 or host_offset_bytes + self.block_bytes > sub_row:
            raise ValueError(
                f"group {group}: a {self.block_bytes} B block at offset {host_offset_bytes} does not fit "
                f"a {sub_row} B host sub-row"
            )
        if host_slab.shape[1] != sub_row * blocks_per_row:
            raise ValueError(
                f"group {group}: host rows have {host_slab.shape[1]} B, expected "
                f"{blocks_per_row} x {sub_row} B"
            )
        band = slice(host_offset_bytes, host_offset_bytes + self.block_bytes)
        self.host_slab = host_slab
        self.host_rows = host_slab.view(-1, sub_row)[:, band]
        self.device = caches.device
        self.columns: list[_RefColumns] = []
        host_offset = 0
        for ref in caches.group_data_refs[group]:
            page = caches.tensors[ref.tensor_idx].tensor
            word = widest_int_dtype(
                ref.offset_bytes,
                ref.page_size_bytes,
                page.stride(0),
                page.storage_offset(),
                host_offset,
                self.block_bytes,
                sub_row,
                host_offset_bytes,
            )
            device_cols = page[:, ref.offset_bytes : ref.offset_bytes + ref.page_size_bytes].view(word)
            host_cols = self.host_rows[:, host_offset : host_offset + ref.page_size_bytes].view(word)
            self.columns.append(_RefColumns(device_cols, host_cols, host_offset, ref.page_size_bytes))
            host_offset += ref.page_size_bytes
        self._staging: torch.Tensor | None = None
        self._conversion = threading.local()

    def sub_rows(self, slots: Sequence[int]) -> list[int]:
        """Host sub-row indices for ``slots``, in order (one per device block)."""
        per = self.blocks_per_row
        if per == 1:
            return list(slots)
        return [slot * per + j for slot in slots for j in range(per)]

    def tasks(
        self, blocks: Sequence[int], rows: Sequence[int], *, store: bool, parallelism: int = 1
    ) -> list[Task]:
        """The copy of device blocks ``blocks[i]`` to (``store``) or from host sub-rows ``rows[i]``.

        On CPU the work is cut into at least ``2 * parallelism`` independent tasks where it
        can be (a slice of a run for one ref each), so a pool of single-threaded workers
        shares it evenly; on CUDA it is one task that issues everything on the copy stream.
        """
        if self.device.type != "cpu":
            return [partial(self._staged_copy, list(blocks), list(rows), store)]
        runs = list(adjacent_runs(rows))
        pieces = max(1, -(-2 * parallelism // max(1, len(runs) * len(self.columns))))
        tasks: list[Task] = []
        for start, end in runs:
            step = max(1, -(-(end - start) // pieces))
            for lo in range(start, end, step):
                hi = min(end, lo + step)
                index = torch.tensor(blocks[lo:hi], dtype=torch.long)
                r0, r1 = rows[lo], rows[lo] + hi - lo
                for col in self.columns:
                    if store:
                        tasks.append(partial(torch.index_select, col.device, 0, index, out=col.host[r0:r1]))
                    elif col.size >= ROW_COPY_MIN_BYTES:
                        tasks.append(partial(_copy_rows, col.device, blocks[lo:hi], col.host[r0:r1]))
                    else:
                        tasks.append(partial(col.device.index_copy_, 0, index, col.host[r0:r1]))
        return tasks

    def converting_load(
        self,
        slot: int,
        blocks: Sequence[int],
        sub_rows: Sequence[int],
        source: GroupRowLayout,
        target: GroupRowLayout,
    ) -> Task:
        """The load of a host row written in ``source`` layout: ``sub_rows[i]`` of the row,
        rewritten into ``target`` (ours), into device block ``blocks[i]``.

        On CUDA the row is copied to the device whole (one DMA), rewritten there with torch
        (``convert_into``: one pass in device memory) and scattered into the blocks like a
        staged load. On CPU it is rewritten straight from the host row, then scattered.
        """
        if self.host_rows.shape[1] * self.blocks_per_row != self.host_slab.shape[1]:
            raise ValueError("rows of another layout cannot be converted into a host row with bands")
        return partial(self._converting_load, slot, list(blocks), list(sub_rows), source, target)

    def _converting_load(
        self,
        slot: int,
        blocks: list[int],
        sub_rows: list[int],
        source: GroupRowLayout,
        target: GroupRowLayout,
    ) -> None:
        row = self.host_slab[slot]
        if row.device != self.device:  # CUDA: the raw row goes over first, in one DMA
            row = self._conversion_buffer("staged").copy_(row, non_blocking=True)
        converted = self._conversion_buffer("converted")
        convert_into(row, converted, source, target)
        subs = converted.view(self.blocks_per_row, self.block_bytes)[sub_rows]
        index = torch.tensor(blocks, dtype=torch.long).to(self.device, non_blocking=True)
        for col, stage_cols in zip(self.columns, self._stage_columns(subs), strict=True):
            col.device.index_copy_(0, index, stage_cols)

    def _conversion_buffer(self, name: str) -> torch.Tensor:
        """A device row for a converting load, reused by this thread (on CUDA, by the copy
        stream, whose order makes reuse safe): a fresh one costs its page faults every row."""
        buffer = getattr(self._conversion, name, None)
        if buffer is None:
            buffer = torch.empty(self.host_slab.shape[1], dtype=torch.uint8, device=self.device)
            setattr(self._conversion, name, buffer)
        return buffer

    def _staged_copy(self, blocks: list[int], rows: list[int], store: bool) -> None:
        for r0, r1, index, stage in self._staged_runs(blocks, rows):
            if store:
                for col, stage_cols in zip(self.columns, self._stage_columns(stage), strict=True):
                    torch.index_select(col.device, 0, index, out=stage_cols)
                self.host_rows[r0:r1].copy_(stage, non_blocking=True)
            else:
                stage.copy_(self.host_rows[r0:r1], non_blocking=True)
                for col, stage_cols in zip(self.columns, self._stage_columns(stage), strict=True):
                    col.device.index_copy_(0, index, stage_cols)

    def _staged_runs(
        self, blocks: Sequence[int], rows: Sequence[int]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """Runs of adjacent rows cut to fit the staging buffer, with device indices and stage rows.

        Reusing one staging buffer across runs is safe because every op is issued on the
        same stream, in order.
        """
        rows_per_stage = max(1, STAGING_BYTES // self.block_bytes)
        if self._staging is None:
            capacity = min(rows_per_stage, self.host_rows.shape[0])
            self._staging = torch.empty((capacity, self.block_bytes), dtype=torch.uint8, device=self.device)
        for start, end in adjacent_runs(rows):
            for lo in range(start, end, rows_per_stage):
                hi = min(end, lo + rows_per_stage)
                index = torch.tensor(blocks[lo:hi], dtype=torch.long).to(self.device, non_blocking=True)
                yield rows[lo], rows[lo] + hi - lo, index, self._staging[: hi - lo]

    def _stage_columns(self, stage: torch.Tensor) -> Iterator[torch.Tensor]:
        for col in self.columns:
            yield stage[:, col.host_offset : col.host_offset + col.size].view(col.device.dtype)
