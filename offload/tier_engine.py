"""The tier engine: host <-> lower-tier transfers on one asyncio event loop (uvloop).

The manager lives on the scheduler thread and must never wait for a disk or a peer. It
hands the engine *operations* (put these host rows into that tier, get those rows into
these host slots) and later drains *results*; the engine runs each operation as a task
on its own event loop in a background thread, with

- a deadline on every operation: tiers keep their own (and must not touch a row after
  their call returns); the engine's is a safety net above it. An operation that overruns
  the safety net is reported failed and ``abandoned``: its thread may still be reading or
  writing the rows, so the manager never reuses those host slots. So is a get the tier
  itself gave up on (``RowsAbandoned``); when the tier says its transfer has ended, a
  ``RELEASE`` result (same op id) gives the slots back;
- bounded in-flight work per tier (a slow tier backs up into refusals, not memory),
- a result per key (``ok[i]``), so a partly failed batch loses only what failed.

Results are appended to a deque (thread-safe for append/popleft) and read by ``drain``; the
``call_*`` verbs return each result in a future instead, for callers that wait for every call
(SGLang's storage threads: ``offload.sglang``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TypeVar

from offload.keys import key_group
from offload.row_layout import RowConverter
from offload.streams import single_threaded_torch
from tiers.base import LowerTier, Row, RowsAbandoned, TierError

log = logging.getLogger(__name__)

T = TypeVar("T")


class OpKind(enum.Enum):
    PUT = "put"
    GET = "get"
    CONTAINS = "contains"
    DELETE = "delete"
    RELEASE = "release"
    """Not an operation: the rows of an abandoned ``GET`` (same ``op_id``) whose transfer has
    since ended (``RowsAbandoned.ended``): their buffers may be used again."""


@dataclass(frozen=True)
class OpResult:
    op_id: int
    kind: OpKind
    tier: int
    keys: list[bytes]
    ok: list[bool]
    seconds: float
    abandoned: bool = False
    """The tier overran the engine's safety deadline and may still touch the rows' memory."""
    layouts: list[bytes | None] | None = None
    """GET only: per key, the layout id of a row that landed in another engine's layout and
    was left for the worker to convert on load; ``None`` where the row is in ours."""
    ended: concurrent.futures.Future | None = field(default=None, compare=False)
    """A ``call_*`` result only (queued results get a ``RELEASE`` instead): for an abandoned
    get whose tier can tell, completes once its transfer has ended (``RowsAbandoned.ended``)."""


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


GIL_SWITCH_INTERVAL_S = 0.0005
"""The longest a thread waiting for the GIL waits before the holder must give it up, in a
process that runs a tier engine (Python's default: 5 ms)."""


def _shorten_gil_switch_interval() -> None:
    """Let the tier engine's thread take the GIL within half a millisecond.

    An engine's loop steps again at once while its requests wait for rows this thread
    promotes (vLLM's engine core does), pure Python that holds the GIL; at Python's default
    5 ms, each of the many GIL hand-offs a promotion needs waited that long: in vLLM's CPU
    engine (``kvtier bench serve``, doc-qa, a disk tier below a small host tier) a
    document's load then took up to 2.3 s instead of 0.1 s. Process-wide, and only ever
    shortened (a host that set a shorter one keeps it).
    """
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        log.info(
            "tier engine: GIL switch interval %.1f ms -> %.1f ms (promotions wait on the GIL less)",
            sys.getswitchinterval() * 1e3,
            GIL_SWITCH_INTERVAL_S * 1e3,
        )
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


class TierEngine:
    """Runs lower-tier operations on a background event loop; never blocks its callers.

    ``start(host_buffer)`` opens every tier (raising ``TierError`` if one cannot start),
    ``submit_put`` / ``submit_get`` queue an operation and return at once (``False`` when
    the tier already has ``max_inflight`` operations: the caller treats that as a miss or
    skips the spill), ``drain`` returns finished operations.
    """

    def __init__(
        self,
        tiers: Sequence[LowerTier],
        *,
        deadline_s: float = 2.0,
        max_inflight: int = 64,
        converter: RowConverter | None = None,
        convert_on_landing: bool = True,
    ) -> None:
        """``converter``: which layouts tiers may serve us (``offload.row_layout``). A row that
        lands in another engine's layout is rewritten into ours right after the read, before
        it counts as landed (``convert_on_landing``: the CPU path), or reported in
        ``OpResult.layouts`` for the worker to convert as it loads it (on the device)."""
        self.tiers = list(tiers)
        self.converter = converter
        self.convert_on_landing = convert_on_landing
        self.deadline_s = deadline_s
        self.safety_deadline_s = 2 * deadline_s + 1.0
        self.max_inflight = max_inflight
        self._inflight = [0] * len(self.tiers)
        self.submitted: collections.Counter[OpKind] = collections.Counter()  # operations, by kind
        self._results: collections.deque[OpResult] = collections.deque()
        self._idle = threading.Condition()
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._run_loop, name="kvtier-tiers", daemon=True)
        self._started = False

    def start(self, host_buffer: memoryview | None) -> None:
        _shorten_gil_switch_interval()
        self._thread.start()
        self._started = True
        for tier in self.tiers:
            try:
                self._call(tier.open(host_buffer), timeout=max(self.deadline_s, 30.0))
            except TierError:
                self.close()
                raise
            except Exception as exc:
                self.close()
                raise TierError(f"{tier.kind} tier failed to start: {exc!r}") from exc

    def submit_put(self, op_id: int, tier: int, rows: Sequence[Row]) -> bool:
        rows = list(rows)
        return self._submit(op_id, OpKind.PUT, tier, [k for k, _ in rows], lambda: self.tiers[tier].put(rows))

    def submit_get(self, op_id: int, tier: int, rows: Sequence[Row]) -> bool:
        rows = list(rows)
        keys = [k for k, _ in rows]
        if self.converter is None:
            return self._submit(op_id, OpKind.GET, tier, keys, lambda: self.tiers[tier].get(rows))
        layouts: list[bytes | None] = [None] * len(rows)
        return self._submit(
            op_id, OpKind.GET, tier, keys, lambda: self._get_in_any_layout(tier, rows, layouts), layouts
        )

    def submit_contains(self, op_id: int, tier: int, keys: Sequence[bytes]) -> bool:
        """Ask a tier which ``keys`` it holds (``ok[i]``: found); nothing moves."""
        keys = list(keys)
        return self._submit(op_id, OpKind.CONTAINS, tier, keys, lambda: self.tiers[tier].contains(keys))

    def call_put(self, tier: int, rows: Sequence[Row]) -> concurrent.futures.Future[OpResult]:
        """``submit_put`` for a caller that waits for each call (SGLang's storage threads):
        the same operation, deadlines and in-flight bound, its result in the future returned
        (never in ``drain``). A saturated tier's result is a failed one, at once."""
        rows = list(rows)
        return self._call_op(OpKind.PUT, tier, [k for k, _ in rows], lambda: self.tiers[tier].put(rows))

    def call_get(self, tier: int, rows: Sequence[Row]) -> concurrent.futures.Future[OpResult]:
        """``submit_get`` as ``call_put`` is ``submit_put`` (no converter: rows of our own
        layout only). An abandoned result names the rows not to reuse (``ok`` ``False``)
        until ``OpResult.ended`` completes, or ever, when it is ``None``."""
        rows = list(rows)
        return self._call_op(OpKind.GET, tier, [k for k, _ in rows], lambda: self.tiers[tier].get(rows))

    def call_contains(self, tier: int, keys: Sequence[bytes]) -> concurrent.futures.Future[OpResult]:
        """``submit_contains`` as ``call_put`` is ``submit_put``."""
        keys = list(keys)
        return self._call_op(OpKind.CONTAINS, tier, keys, lambda: self.tiers[tier].contains(keys))

    def call_delete(self, tier: int, keys: Sequence[bytes]) -> concurrent.futures.Future[OpResult]:
        """Delete ``keys`` from a tier, as ``call_put`` (``ok`` all ``True`` once it returned)."""
        keys = list(keys)

        async def delete() -> list[bool]:
            await self.tiers[tier].delete(keys)
            return [True] * len(keys)

        return self._call_op(OpKind.DELETE, tier, keys, delete)

    def drain(self) -> list[OpResult]:
        results = []
        while self._results:
            results.append(self._results.popleft())
        return results

    def has_results(self) -> bool:
        return bool(self._results)

    def inflight(self) -> int:
        return sum(self._inflight)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no operation is in flight (tests, shutdown); ``False`` on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self.inflight() == 0, timeout)

    def close(self) -> None:
        """Close every tier, then stop the loop and release it (its thread, its default
        executor's threads, and its descriptors: an epoll, an eventfd, a pipe, an io_uring)."""
        if not self._started:
            if not self._loop.is_closed() and not self._thread.is_alive():
                self._loop.close()  # never started (or a failed start already stopped it)
            return
        self.wait_idle(timeout=self.deadline_s * 2)
        for tier in self.tiers:
            try:
                self._call(tier.close(), timeout=self.deadline_s * 2)
            except Exception as exc:  # closing must not stop the other tiers from closing
                log.warning("closing the %s tier failed: %r", tier.kind, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            log.warning("the tier engine's loop did not stop in 5 s; it is left running")
        self._started = False

    def _run_loop(self) -> None:
        """The loop thread: run until ``close`` stops the loop, then cancel what is left (an
        operation abandoned past the safety deadline), shut the default executor down and
        close the loop, here, where the loop belongs."""
        loop = self._loop
        asyncio.set_event_loop(loop)
        # Rows converted on landing run torch ops here and on the default executor: never
        # with an OpenMP team of their own beside the engine's (see ``single_threaded_torch``).
        single_threaded_torch()
        loop.set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="kvtier-tiers", initializer=single_threaded_torch)
        )
        try:
            loop.run_forever()
        finally:
            try:
                pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            except Exception as exc:  # the loop still closes
                log.warning("stopping the tier engine's loop: %r", exc)
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def _submit(
        self,
        op_id: int,
        kind: OpKind,
        tier: int,
        keys: list[bytes],
        operation: Callable[[], Awaitable[list[bool]]],
        layouts: list[bytes | None] | None = None,
    ) -> bool:
        if not self._take_slot(kind, tier):
            return False
        asyncio.run_coroutine_threadsafe(self._run(op_id, kind, tier, keys, operation, layouts), self._loop)
        return True

    def _call_op(
        self, kind: OpKind, tier: int, keys: list[bytes], operation: Callable[[], Awaitable[list[bool]]]
    ) -> concurrent.futures.Future[OpResult]:
        if not self._take_slot(kind, tier):
            done: concurrent.futures.Future[OpResult] = concurrent.futures.Future()
            done.set_result(OpResult(0, kind, tier, keys, [False] * len(keys), 0.0))
            return done
        return asyncio.run_coroutine_threadsafe(
            self._run(0, kind, tier, keys, operation, queue=False), self._loop
        )

    def _take_slot(self, kind: OpKind, tier: int) -> bool:
        with self._idle:
            if self._inflight[tier] >= self.max_inflight:
                return False
            self._inflight[tier] += 1
            self.submitted[kind] += 1
        return True

    async def _run(
        self,
        op_id: int,
        kind: OpKind,
        tier: int,
        keys: list[bytes],
        operation: Callable[[], Awaitable[list[bool]]],
        layouts: list[bytes | None] | None = None,
        *,
        queue: bool = True,
    ) -> OpResult:
        """Run one operation; its result goes to the queue ``drain`` reads (``queue``), else
        only to the caller (``call_*``), with ``ended`` in it instead of a later ``RELEASE``."""
        start = self._loop.time()
        abandoned = False
        ended: concurrent.futures.Future | None = None
        try:
            ok = await asyncio.wait_for(operation(), self.safety_deadline_s)
            if len(ok) != len(keys):
                raise RuntimeError(f"{len(ok)} results for {len(keys)} keys")
        except TimeoutError:
            log.error(
                "%s tier %s of %d rows overran %.1f s: abandoned",
                self.tiers[tier].kind,
                kind.value,
                len(keys),
                self.safety_deadline_s,
            )
            ok, abandoned = [False] * len(keys), True
        except RowsAbandoned as exc:  # the tier may still touch the rows it did not finish
            log.warning(
                "%s tier %s of %d rows abandoned: %s", self.tiers[tier].kind, kind.value, len(keys), exc
            )
            ok, abandoned, ended = list(exc.ok), True, exc.ended
        except Exception as exc:  # a failed operation: every key of it failed
            log.warning("%s tier %s of %d rows failed: %r", self.tiers[tier].kind, kind.value, len(keys), exc)
            ok = [False] * len(keys)
        foreign = None
        if layouts is not None and any(layouts):  # rows the worker converts on load
            foreign = [layout if good else None for layout, good in zip(layouts, ok, strict=True)]
        result = OpResult(op_id, kind, tier, keys, list(ok), self._loop.time() - start, abandoned, foreign)
        if not queue:
            result = replace(result, ended=ended)
        else:
            self._results.append(result)
            if ended is not None:  # after the GET's result: whoever drains sees the two in order
                release = OpResult(op_id, OpKind.RELEASE, tier, keys, [True] * len(keys), 0.0)
                ended.add_done_callback(lambda _f: self._results.append(release))  # deque: thread-safe
        with self._idle:
            self._inflight[tier] -= 1
            self._idle.notify_all()
        return result

    async def _get_in_any_layout(self, tier: int, rows: list[Row], layouts: list[bytes | None]) -> list[bool]:
        """``get`` that accepts rows of the layouts we convert from; ``layouts[i]`` ends as the
        layout id of a row still to be converted on load, ``None`` for a row now in ours.

        Converting on landing runs off the loop (a permuted copy of each row, on the CPU)."""
        assert self.converter is not None
        converter = self.converter
        ok = await self.tiers[tier].get(rows, layouts)
        for i, hit in enumerate(ok):
            if not hit or layouts[i] == converter.own_id:
                layouts[i] = None
        foreign = [i for i, layout in enumerate(layouts) if layout is not None]
        if foreign and self.convert_on_landing:

            def convert() -> list[bool]:
                return [converter.convert(key_group(rows[i][0]), rows[i][1], layouts[i]) for i in foreign]

            converted = await self._loop.run_in_executor(None, convert)
            for i, good in zip(foreign, converted, strict=True):
                ok[i] = good
                layouts[i] = None
        return ok

    def _call(self, coroutine: Awaitable[T], timeout: float) -> T:
        """Run a coroutine on the engine loop from another thread and wait for it (start/close only)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]
        return future.result(timeout)
