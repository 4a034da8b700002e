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
  with one contiguous DMA per run, on the copy stream. Runs are cut into chunks that
  alternate between two staging buffers, the gather of one chunk beside the DMA of the
  other (``streams.pipelined``): measured on an H100 (PCIe 5), a store of random 2 MiB
  blocks then reaches 0.92-0.96 (packed) and 0.91-0.93 (per layer) of one plain DMA of
  the same bytes, where gather-then-DMA on one stream reached 0.90 and 0.80.

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
from offload.streams import pipelined

ROW_COPY_MIN_BYTES = 256 * 2**10
"""A CPU load scatters rows at least this big with one ``copy_`` each: measured here, a
single-threaded ``index_copy_`` reaches ~0.8 of ``copy_`` on 2 MiB rows, row copies ~1.0."""

SCATTERED_RUNS_PER_PIECE = 2
"""A CPU copy whose host rows fall in more than this many runs of adjacent rows per task
it would be cut into is copied by gather-then-scatter instead (``RowCopier._scattered_tasks``):
two passes over the bytes, but a bounded number of ops. One op per run and ref is one GIL
hand-off each, and in vLLM's CPU engine, whose loop spins while a request waits for its
load, each hand-off waits out the switch interval: a load of 93 rows promoted into scattered
slots took 0.1-0.4 s where adjacent rows took 0.04-0.1 s (``kvtier bench serve``, doc-qa)."""

Task = Callable[[], object]
"""One independent piece of a copy (tasks of one job may run concurrently)."""

STAGING_BYTES = 64 * 2**20
"""Upper bound of the device staging buffers per group on CUDA (two halves; runs are split
into chunks of half this)."""

STAGING_BUFFERS = 2


@dataclass(frozen=True)
class ForeignRowLoad:
    """A load from a host row stored in another engine's layout."""

    slot: int
    blocks: Sequence[int]  # device blocks, in order
    sub_rows: Sequence[int]  # the row's sub-row for each block
    source: GroupRowLayout  # the layout the row is in


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


def _move_scattered(
    columns: Sequence[_RefColumns], blocks: torch.Tensor, rows: torch.Tensor, store: bool
) -> None:
    """Device blocks ``blocks[i]`` to (``store``) or from host sub-rows ``rows[i]``, two ops per ref."""
    for col in columns:
        if store:
            col.host.index_copy_(0, rows, col.device.index_select(0, blocks))
        else:
            col.device.index_copy_(0, blocks, col.host.index_select(0, rows))


def _device_index(blocks: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on ``device``. On CUDA it goes up from pinned memory: a
    copy from pageable memory would first wait for every copy already queued on the stream,
    blocking the engine's thread that submits the job."""
    if device.type != "cuda":
        return torch.tensor(blocks, dtype=torch.long)
    return torch.tensor(blocks, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


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
        if len(runs) > SCATTERED_RUNS_PER_PIECE * 2 * parallelism:
            return self._scattered_tasks(blocks, rows, store=store, pieces=2 * parallelism)
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

    def _scattered_tasks(
        self, blocks: Sequence[int], rows: Sequence[int], *, store: bool, pieces: int
    ) -> list[Task]:
        """The copy as ``pieces`` tasks of two indexed ops per ref (a gather into a scratch
        tensor, then a scatter), whatever the rows' order: for rows spread over the slab."""
        step = -(-len(blocks) // pieces)
        tasks: list[Task] = []
        for lo in range(0, len(blocks), step):
            block_index = torch.tensor(blocks[lo : lo + step], dtype=torch.long)
            row_index = torch.tensor(rows[lo : lo + step], dtype=torch.long)
            tasks.append(partial(_move_scattered, self.columns, block_index, row_index, store))
        return tasks

    def converting_loads(self, loads: Sequence[ForeignRowLoad], target: GroupRowLayout) -> list[Task]:
        """The loads of host rows written in other layouts, each rewritten into ``target``
        (ours) on the way: ``load.sub_rows[i]`` of the row into device block ``load.blocks[i]``.

        On CPU, one task per row: rewritten straight from the host row into a scratch row,
        then scattered. On CUDA, one task for all, chunk by chunk (as many rows as fill one
        staging buffer): each row goes to the device whole (one DMA), is rewritten there
        (``convert_into``, one pass in device memory), and the chunk is scattered like a
        staged load (a kernel per ref per chunk, not per row: a per-layer layout with K and
        V apart has 64 refs); the DMAs of the next chunk run beside the rewrite of this one
        (``streams.pipelined``).
        """
        if self.host_rows.shape[1] * self.blocks_per_row != self.host_slab.shape[1]:
            raise ValueError("rows of another layout cannot be converted into a host row with bands")
        if self.device.type == "cpu":
            return [partial(self._converting_load, load, target) for load in loads]
        return [partial(self._staged_converting_loads, list(loads), target)]

    def _converting_load(self, load: ForeignRowLoad, target: GroupRowLayout) -> None:
        converted = self._conversion_rows(1)
        convert_into(self.host_slab[load.slot], converted[0], load.source, target)
        self._scatter(converted, [load])

    def _staged_converting_loads(self, loads: list[ForeignRowLoad], target: GroupRowLayout) -> None:
        row_bytes = self.host_slab.shape[1]
        per_chunk = max(1, STAGING_BYTES // STAGING_BUFFERS // row_bytes)
        chunks = [loads[i : i + per_chunk] for i in range(0, len(loads), per_chunk)]
        rows = self._conversion_rows((STAGING_BUFFERS + 1) * per_chunk).view(-1, per_chunk, row_bytes)
        staged, converted = rows[:STAGING_BUFFERS], rows[STAGING_BUFFERS]

        def dma(i: int, buf: int) -> None:
            for j, load in enumerate(chunks[i]):
                staged[buf, j].copy_(self.host_slab[load.slot], non_blocking=True)

        def rewrite_and_scatter(i: int, buf: int) -> None:
            for j, load in enumerate(chunks[i]):
                convert_into(staged[buf, j], converted[j], load.source, target)
            self._scatter(converted, chunks[i])  # the chunk's rows at once: a kernel per ref

        pipelined(self.device, len(chunks), dma, rewrite_and_scatter, STAGING_BUFFERS)

    def _scatter(self, rows: torch.Tensor, loads: Sequence[ForeignRowLoad]) -> None:
        """Scatter ``loads[j]``'s sub-rows of ``rows[j]`` (converted rows) into its device blocks."""
        subs = rows.view(-1, self.block_bytes)
        picked = [j * self.blocks_per_row + sub for j, load in enumerate(loads) for sub in load.sub_rows]
        if picked == list(range(picked[0], picked[0] + len(picked))):
            subs = subs[picked[0] : picked[0] + len(picked)]  # a view: no index to send to the device
        else:
            subs = subs.index_select(0, _device_index(picked, self.device))
        self._scatter_stage(
            subs, _device_index([block for load in loads for block in load.blocks], self.device)
        )

    def _scatter_stage(self, stage: torch.Tensor, index: torch.Tensor) -> None:
        """Write whole rows ``stage[i]`` (on the device) into device block ``index[i]``, ref by ref."""
        for col, stage_cols in zip(self.columns, self._stage_columns(stage), strict=True):
            col.device.index_copy_(0, index, stage_cols)

    def _conversion_rows(self, count: int) -> torch.Tensor:
        """``count`` device rows for converting loads, reused by this thread (on CUDA, by the
        copy stream, whose order makes reuse safe): a fresh one costs its page faults every row."""
        rows = getattr(self._conversion, "rows", None)
        if rows is None or rows.shape[0] < count:
            rows = torch.empty((count, self.host_slab.shape[1]), dtype=torch.uint8, device=self.device)
            self._conversion.rows = rows
        return rows[:count]

    def _staged_copy(self, blocks: list[int], rows: list[int], store: bool) -> None:
        chunks = self._staged_chunks(rows)
        index = _device_index(blocks, self.device)

        def gather(i: int, buf: int) -> None:
            lo, hi = chunks[i]
            stage = self._staging[buf, : hi - lo]
            for col, stage_cols in zip(self.columns, self._stage_columns(stage), strict=True):
                torch.index_select(col.device, 0, index[lo:hi], out=stage_cols)

        def scatter(i: int, buf: int) -> None:
            lo, hi = chunks[i]
            self._scatter_stage(self._staging[buf, : hi - lo], index[lo:hi])

        def dma(i: int, buf: int) -> None:
            lo, hi = chunks[i]
            host = self.host_rows[rows[lo] : rows[lo] + hi - lo]
            stage = self._staging[buf, : hi - lo]
            if store:
                host.copy_(stage, non_blocking=True)
            else:
                stage.copy_(host, non_blocking=True)

        first, second = (gather, dma) if store else (dma, scatter)
        pipelined(self.device, len(chunks), first, second, STAGING_BUFFERS)

    def _staged_chunks(self, rows: Sequence[int]) -> list[tuple[int, int]]:
        """Positions ``[lo, hi)`` of ``rows``: runs of adjacent host rows, cut to fit one
        staging buffer (allocated here the first time)."""
        rows_per_stage = max(1, STAGING_BYTES // STAGING_BUFFERS // self.block_bytes)
        if self._staging is None:
            capacity = min(rows_per_stage, self.host_rows.shape[0])
            self._staging = torch.empty(
                (STAGING_BUFFERS, capacity, self.block_bytes), dtype=torch.uint8, device=self.device
            )
        return [
            (lo, min(end, lo + rows_per_stage))
            for start, end in adjacent_runs(rows)
            for lo in range(start, end, rows_per_stage)
        ]

    def _stage_columns(self, stage: torch.Tensor) -> Iterator[torch.Tensor]:
        for col in self.columns:
            yield stage[:, col.host_offset : col.host_offset + col.size].view(col.device.dtype)
