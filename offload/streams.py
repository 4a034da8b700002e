"""The one seam between device-agnostic copy code and CUDA streams and events.

A ``CopyStream`` runs copy work (a job: a list of independent tasks) off the caller's
critical path and answers whether it has finished, without blocking:

- ``ThreadCopyStream`` (CPU tensors): a dispatcher thread takes jobs in order and spreads
  each job's tasks over a pool of single-threaded copy threads, one per core. torch
  releases the GIL inside copy kernels, so the scheduler thread keeps running.
- ``CudaCopyStream``: the work is *issued* at once on a dedicated CUDA stream (issuing is
  cheap); an event recorded after it says when the device has finished.

Both run jobs in submission order, which the worker relies on: a load issued after a store
sees its bytes.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch


class Completion(ABC):
    """The end of one submitted piece of copy work."""

    @abstractmethod
    def done(self) -> bool:
        """Whether the work finished (successfully or not); never blocks."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the work finished."""

    @abstractmethod
    def error(self) -> BaseException | None:
        """The exception the work raised, once done."""

    @abstractmethod
    def seconds(self) -> float:
        """How long the work took, once done."""


Task = Callable[[], object]


class CopyStream(ABC):
    parallelism: int = 1
    """How many tasks of one job run at once (cut jobs into at least this many)."""

    @abstractmethod
    def submit(self, tasks: Sequence[Task]) -> Completion:
        """Start a job (independent tasks issuing copies); return at once."""

    @abstractmethod
    def close(self) -> None:
        """Finish queued work and release resources."""


class _FutureCompletion(Completion):
    def __init__(self, future: Future[float]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.exception()

    def error(self) -> BaseException | None:
        return self._future.exception()

    def seconds(self) -> float:
        return 0.0 if self._future.exception() else self._future.result()


def single_threaded_torch() -> None:
    """Run this thread's torch ops on this thread alone (no OpenMP team of its own).

    Through ``torch._C``: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op
    once it has bound its OpenMP threads to the cores, and a copy thread left at the
    default then starts a second team on the same cores: the engine's prefill ran ~2x
    slower whenever kvtier copied (measured with ``kvtier bench serve``'s no-reuse
    workload). The setting is per thread under OpenMP: the engine's own threads keep theirs.
    """
    torch._C.set_num_threads(1)


class ThreadCopyStream(CopyStream):
    """CPU copies: jobs in submission order, each job's tasks spread over a thread pool.

    Each pool thread runs torch single-threaded: a few independent copies side by side
    use the memory bus better than one copy kernel split by OpenMP (measured in
    ``offload/row_copy.py``'s notes), and two OpenMP teams would oversubscribe the cores.
    """

    def __init__(self, threads: int | None = None, name: str = "kvtier-copy") -> None:
        self.parallelism = threads or torch.get_num_threads()
        # The dispatcher runs one-task jobs itself: single-threaded too.
        self._dispatcher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{name}-dispatch", initializer=single_threaded_torch
        )
        self._pool = ThreadPoolExecutor(
            max_workers=self.parallelism, thread_name_prefix=name, initializer=single_threaded_torch
        )

    def submit(self, tasks: Sequence[Task]) -> Completion:
        return _FutureCompletion(self._dispatcher.submit(self._run, list(tasks)))

    def _run(self, tasks: list[Task]) -> float:
        start = time.perf_counter()
        if len(tasks) == 1:
            tasks[0]()
        else:
            futures = [self._pool.submit(task) for task in tasks]
            wait(futures)
            for future in futures:
                future.result()  # re-raise the first failure
        return time.perf_counter() - start

    def close(self) -> None:
        self._dispatcher.shutdown(wait=True)
        self._pool.shutdown(wait=True)


class _EventCompletion(Completion):
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event, error: BaseException | None) -> None:
        self._start, self._end, self._error = start, end, error

    def done(self) -> bool:
        return self._error is not None or self._end.query()

    def wait(self) -> None:
        if self._error is None:
            self._end.synchronize()

    def error(self) -> BaseException | None:
        return self._error

    def seconds(self) -> float:
        return 0.0 if self._error else self._start.elapsed_time(self._end) / 1000.0


class CudaCopyStream(CopyStream):
    """Copies issued on a dedicated CUDA stream; completion is an event on that stream."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        self._lock = threading.Lock()

    def submit(self, tasks: Sequence[Task]) -> Completion:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        error: BaseException | None = None
        compute = torch.cuda.current_stream(self._device)
        with self._lock, torch.cuda.stream(self._stream):
            # The engine's compute stream wrote the KV caches; order our reads after it.
            self._stream.wait_stream(compute)
            start.record(self._stream)
            try:
                for task in tasks:
                    task()
            except Exception as exc:  # reported through the completion, like the CPU path
                error = exc
            end.record(self._stream)
        return _EventCompletion(start, end, error)

    def close(self) -> None:
        self._stream.synchronize()


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def pipelined(
    device: torch.device,
    count: int,
    first: Callable[[int, int], object],
    second: Callable[[int, int], object],
    buffers: int = 2,
) -> None:
    """Issue ``first(i, buf)`` then ``second(i, buf)`` for ``i`` in ``range(count)``, where
    ``buf = i % buffers`` names the buffer step ``i`` may use, so that on CUDA ``first(i + 1)``
    runs while ``second(i)`` does (a gather kernel beside a DMA: the SMs and the copy engine
    work at once, where one stream would leave one of them idle).

    On CUDA, ``second`` runs on the current stream (the copy stream) and ``first`` on a
    side stream; events order ``second(i)`` after ``first(i)``, and ``first(i)`` after
    ``second(i - buffers)``, the last user of its buffer. The side stream starts after the
    work already queued on the current stream, and everything issued later on the current
    stream comes after every step. Elsewhere the steps simply run in order.
    """
    if device.type != "cuda":
        for i in range(count):
            first(i, i % buffers)
            second(i, i % buffers)
        return
    main = torch.cuda.current_stream(device)
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device=device)
    side.wait_stream(main)
    released: list[torch.cuda.Event] = []
    for i in range(count):
        if i >= buffers:
            side.wait_event(released[i - buffers])
        with torch.cuda.stream(side):
            first(i, i % buffers)
        landed = torch.cuda.Event()
        landed.record(side)
        main.wait_event(landed)
        second(i, i % buffers)
        released.append(torch.cuda.Event())
        released[-1].record(main)


def make_copy_stream(device: torch.device) -> CopyStream:
    """The copy stream for tensors on ``device``."""
    if device.type == "cuda":
        return CudaCopyStream(device)
    return ThreadCopyStream()
