"""The offloading worker: device <-> host copies of canonical rows, asynchronously.

One worker lives beside each device (in vLLM, in each GPU worker process). It is told
*which* device blocks and *which* host slots, never bytes, and it never decides anything:
the manager has already chosen slots and pinned what it loads.

Call contract (one caller thread, e.g. the engine's model runner):

- ``submit_store`` / ``submit_load`` validate, queue and return at once (``True``); bad
  input (lengths that differ, a slot or block out of range) raises ``ValueError`` before
  anything is queued, so a rejected job touches no memory.
- ``get_finished`` returns each finished job once, in finishing order, never blocking.
- ``wait`` blocks until the named jobs have finished; they are still reported by the next
  ``get_finished``.
- ``first_sub_rows`` (optional, per group) says where a job's first block lands inside its
  first slot when ``blocks_per_row > 1`` (vLLM's ``block_indices``: a load that starts in the
  middle of a chunk); blocks then fill sub-rows in order and the last slot may be partly
  used. Without it every slot is filled whole.

A copy that raises is a ``TransferResult`` with ``success=False`` (the manager then
treats the rows as never stored / the load as failed), never an exception on the
caller's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

from offload.layout import CanonicalKVCaches
from offload.row_copy import ForeignRowLoad, RowCopier, Task
from offload.row_layout import RowConverter
from offload.streams import Completion, CopyStream, make_copy_stream
from tiers.host import HostTier

log = logging.getLogger(__name__)

PARALLEL_MIN_BYTES = 4 * 2**20
"""Jobs smaller than this run as one task: spreading them over the copy pool costs more
(a thread hand-off per task, ~10-50 us) than the copy itself."""

PerGroup = Sequence[Sequence[int]]
"""One list per KV group (empty for a group the job does not touch)."""


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int  # bytes moved
    transfer_time: float  # seconds the copy took
    is_store: bool


@dataclass
class _Conversions:
    """A load's converting tasks and the bytes they move."""

    tasks: list[Task] = field(default_factory=list)
    size: int = 0


@dataclass
class _Job:
    job_id: int
    is_store: bool
    size: int
    completion: Completion


class OffloadingWorker:
    """Moves blocks of every KV group between the device caches and the host tier."""

    def __init__(
        self,
        caches: CanonicalKVCaches,
        host: HostTier,
        *,
        blocks_per_row: int = 1,
        stream: CopyStream | None = None,
        host_block_bytes: Sequence[int] | None = None,
        host_offset_bytes: Sequence[int] | None = None,
        converter: RowConverter | None = None,
    ) -> None:
        """``host_block_bytes`` / ``host_offset_bytes``: per group, a host sub-row larger than a
        device block and where this device's bytes sit in it (see ``RowCopier``).
        ``converter``: the layouts a load may find host rows in (``submit_load``'s
        ``row_layouts``), rewritten into ours on the device as they load."""
        if host.num_groups != caches.num_groups:
            raise ValueError(f"host tier has {host.num_groups} groups, the KV caches {caches.num_groups}")
        groups = caches.num_groups
        sub_rows = list(host_block_bytes) if host_block_bytes is not None else [None] * groups
        offsets = list(host_offset_bytes) if host_offset_bytes is not None else [0] * groups
        if len(sub_rows) != groups or len(offsets) != groups:
            raise ValueError(f"host_block_bytes and host_offset_bytes need one value per group ({groups})")
        self.caches = caches
        self.host = host
        self.blocks_per_row = blocks_per_row
        self.converter = converter
        self.rows_converted = 0  # rows of another layout converted on load
        self.copiers = [
            RowCopier(
                caches,
                group,
                host.slabs[group],
                blocks_per_row,
                host_block_bytes=sub_rows[group],
                host_offset_bytes=offsets[group],
            )
            for group in range(groups)
        ]
        self._stream = stream or make_copy_stream(caches.device)
        self._jobs: dict[int, _Job] = {}

    def submit_store(
        self,
        job_id: int,
        block_ids: PerGroup,
        slots: PerGroup,
        *,
        first_sub_rows: Sequence[int] | None = None,
    ) -> bool:
        """Copy device blocks into host slots (``blocks_per_row`` blocks per slot)."""
        plan = self._plan(job_id, block_ids, slots, first_sub_rows, is_store=True)
        return self._submit(job_id, plan, _Conversions(), is_store=True)

    def submit_load(
        self,
        job_id: int,
        block_ids: PerGroup,
        slots: PerGroup,
        *,
        first_sub_rows: Sequence[int] | None = None,
        row_layouts: Sequence[Sequence[bytes | None]] | None = None,
    ) -> bool:
        """Copy host slots into device blocks.

        ``row_layouts`` (per group, one per slot): the layout id of a row still in another
        engine's layout (``None``: ours); such rows are converted as they load.
        """
        plan = self._plan(job_id, block_ids, slots, first_sub_rows, is_store=False)
        plan, conversions = self._split_conversions(job_id, plan, slots, row_layouts)
        return self._submit(job_id, plan, conversions, is_store=False)

    def get_finished(self) -> list[TransferResult]:
        results = []
        for job_id, job in list(self._jobs.items()):
            if job.completion.done():
                del self._jobs[job_id]
                results.append(self._result(job))
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                job.completion.wait()

    def shutdown(self) -> None:
        self.wait(list(self._jobs))
        self._stream.close()

    def _plan(
        self,
        job_id: int,
        block_ids: PerGroup,
        slots: PerGroup,
        first_sub_rows: Sequence[int] | None,
        *,
        is_store: bool,
    ) -> list[tuple[RowCopier, list[int], list[int]]]:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        groups = len(self.copiers)
        if len(block_ids) != groups or len(slots) != groups:
            raise ValueError(
                f"job {job_id}: expected block ids and slots for {groups} groups, "
                f"got {len(block_ids)} and {len(slots)}"
            )
        if first_sub_rows is not None and len(first_sub_rows) != groups:
            raise ValueError(f"job {job_id}: expected first_sub_rows for {groups} groups")
        plan = []
        for group, (copier, blocks, group_slots) in enumerate(
            zip(self.copiers, block_ids, slots, strict=True)
        ):
            blocks = [int(b) for b in blocks]
            group_slots = [int(s) for s in group_slots]
            skip = 0 if first_sub_rows is None else int(first_sub_rows[group])
            if first_sub_rows is None:
                fits = len(blocks) == len(group_slots) * self.blocks_per_row
            else:
                fits = 0 <= skip < self.blocks_per_row and len(group_slots) == -(
                    -(len(blocks) + skip) // self.blocks_per_row
                )
            if not fits or (skip and not blocks):
                start = "" if first_sub_rows is None else f" from sub-row {skip}"
                raise ValueError(
                    f"job {job_id}, group {group}: {len(blocks)} device blocks{start} for "
                    f"{len(group_slots)} slots of {self.blocks_per_row} block(s) each"
                )
            _check_range(job_id, group, "device block", blocks, self.caches.num_blocks)
            _check_range(job_id, group, "host slot", group_slots, self.host.num_slots)
            if not is_store and len(set(blocks)) != len(blocks):
                raise ValueError(f"job {job_id}, group {group}: a load writes a device block twice")
            if is_store and len(set(group_slots)) != len(group_slots):
                raise ValueError(f"job {job_id}, group {group}: a store writes a host slot twice")
            if blocks:
                plan.append((copier, blocks, copier.sub_rows(group_slots)[skip : skip + len(blocks)]))
        return plan

    def _split_conversions(
        self,
        job_id: int,
        plan: list[tuple[RowCopier, list[int], list[int]]],
        slots: PerGroup,
        row_layouts: Sequence[Sequence[bytes | None]] | None,
    ) -> tuple[list[tuple[RowCopier, list[int], list[int]]], _Conversions]:
        """Take the blocks of rows in another layout out of ``plan`` into converting tasks."""
        conversions = _Conversions()
        if row_layouts is None or not any(any(group) for group in row_layouts):
            return plan, conversions
        if self.converter is None or len(row_layouts) != len(self.copiers):
            raise ValueError(f"job {job_id}: rows of other layouts, and no converter for them")
        plain_plan = []
        for copier, blocks, rows in plan:
            group = self.copiers.index(copier)
            if len(row_layouts[group]) != len(slots[group]):
                raise ValueError(f"job {job_id}, group {group}: one layout per slot expected")
            foreign = {
                int(slot): layout
                for slot, layout in zip(slots[group], row_layouts[group], strict=True)
                if layout
            }
            per = copier.blocks_per_row
            plain_blocks: list[int] = []
            plain_rows: list[int] = []
            by_slot: dict[int, list[tuple[int, int]]] = {}
            for block, row in zip(blocks, rows, strict=True):
                slot, sub_row = divmod(row, per)
                if slot in foreign:
                    by_slot.setdefault(slot, []).append((block, sub_row))
                else:
                    plain_blocks.append(block)
                    plain_rows.append(row)
            if plain_blocks:
                plain_plan.append((copier, plain_blocks, plain_rows))
            loads = []
            for slot, pairs in by_slot.items():
                source = self.converter.source(group, foreign[slot])
                if source is None:
                    raise ValueError(
                        f"job {job_id}, group {group}: slot {slot} is in a layout we cannot convert"
                    )
                loads.append(ForeignRowLoad(slot, [b for b, _ in pairs], [r for _, r in pairs], source))
            if loads:
                tasks = copier.converting_loads(loads, self.converter.own.groups[group])
                conversions.tasks += tasks
                conversions.size += sum(len(load.blocks) for load in loads) * copier.block_bytes
                self.rows_converted += len(loads)
        return plain_plan, conversions

    def _submit(
        self,
        job_id: int,
        plan: list[tuple[RowCopier, list[int], list[int]]],
        conversions: _Conversions,
        *,
        is_store: bool,
    ) -> bool:
        size = sum(len(blocks) * copier.block_bytes for copier, blocks, _ in plan) + conversions.size
        # A small job costs more to hand around a thread pool than to copy: one task.
        parallelism = self._stream.parallelism if size >= PARALLEL_MIN_BYTES else 1
        tasks = [
            task
            for copier, blocks, rows in plan
            for task in copier.tasks(blocks, rows, store=is_store, parallelism=parallelism)
        ]
        tasks += conversions.tasks
        if parallelism == 1 and len(tasks) > 1:
            tasks = [partial(_run_all, tasks)]
        self._jobs[job_id] = _Job(job_id, is_store, size, self._stream.submit(tasks))
        return True

    @staticmethod
    def _result(job: _Job) -> TransferResult:
        error = job.completion.error()
        if error is not None:
            log.error("%s job %d failed: %r", "store" if job.is_store else "load", job.job_id, error)
            return TransferResult(job.job_id, False, 0, 0.0, job.is_store)
        return TransferResult(job.job_id, True, job.size, job.completion.seconds(), job.is_store)


def _run_all(tasks: Sequence[Callable[[], object]]) -> None:
    for task in tasks:
        task()


def _check_range(job_id: int, group: int, what: str, values: list[int], limit: int) -> None:
    bad = [v for v in values if not 0 <= v < limit]
    if bad:
        raise ValueError(f"job {job_id}, group {group}: {what}s {bad[:8]} outside 0..{limit - 1}")
