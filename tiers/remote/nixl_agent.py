"""NIXL agents the way they work on these machines: no progress thread, one thread per agent.

Three measured facts (``NIXL_NOTES.md``) shape this module:

- An agent's own progress thread busy-spins a core; on a 2-core machine that halves
  bandwidth. Agents here are created with it off, and whoever drives the agent polls.
- One agent used from several threads crashes in the default sync mode. ``AgentThread``
  therefore owns its agent and runs *every* call on one thread of its own; the event loop
  only submits work and awaits futures, so a copy (``transfer()`` over CMA blocks for the
  whole copy, with the GIL released) never stalls the loop.
- A stopped or hung peer leaves a transfer in PROC indefinitely, without an error. Every
  transfer therefore has a deadline; when it passes, the handle is released and the remote
  agent removed (in that order), and the waiter gets ``TransferTimeout``. Whoever added the
  remote agent must add it again (from fresh metadata) before using that peer again.

NIXL's Python logger writes INFO lines to stdout; ``NIXL_LOG_LEVEL`` defaults to WARN here,
before NIXL is imported, so nothing that speaks over stdout is broken by it.

On a machine with libibverbs installed (the Mooncake wheel needs it) but no RDMA device,
UCX's IB module makes the process die of SIGSEGV at exit (measured: ``kvtier peer`` after
SIGTERM). ``UCX_MODULES`` defaults to ``^ib`` there, before NIXL is imported: with no
device, the module has nothing to offer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
    os.environ.setdefault("UCX_MODULES", "^ib")

import numpy as np
from nixl_cu12._api import nixl_agent, nixl_agent_config

log = logging.getLogger(__name__)

T = TypeVar("T")

_POLL_MAX_SLEEP_S = 1e-3
_FAST_INCOMING_SLEEP_S = 20e-6
"""While a peer on another host moves rows into or out of this agent's memory (UCX TCP: the
bytes land only as the target's worker is progressed, and each progress call takes a bounded
amount), the worker is progressed about this often."""
# The after-thread helps only where it runs beside the agent's thread, not instead of it.
# A call whose copies all ran inside ``transfer()`` (CMA) while the agent's thread was on a
# CPU less than ``_BESIDE_MIN_CPU`` of the time (set aside for the after-thread or for other
# work: no core was free) makes the next calls keep their parts' work on the agent's thread,
# where the rows are in cache: ``_SERIAL_CALLS`` calls, doubling (up to ``_MAX_SERIAL_CALLS``)
# while each try finds the cores as crowded. Measured on the shared 2-core VM with every call
# offering its parts: the after-thread cost 1-2 ms more CPU per 128 MiB call (rows hashed
# from L3 instead of L2), overlapped nothing, and the agent's thread was on a CPU 0.55-0.95
# of the time (median 0.79); on a core of its own it is there all the time.
_BESIDE_MIN_PARTS = 4  # a call of fewer parts measures nothing
_BESIDE_MIN_CPU = 0.8
_SERIAL_CALLS = 8
_MAX_SERIAL_CALLS = 256


class TransferError(Exception):
    """A transfer failed (the peer went away, its memory is not registered, ...)."""


class TransferTimeout(TransferError):
    """A transfer missed its deadline; its handle is released and the remote agent removed."""


def create_agent(name: str) -> nixl_agent:
    """A UCX agent with the progress thread off (the caller polls)."""
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def descriptors(addrs: np.ndarray | list[int], lengths: np.ndarray | list[int]) -> np.ndarray:
    """An Nx3 ``(address, length, device 0)`` array: the cheapest way to build a descriptor list."""
    out = np.zeros((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lengths
    return out


@dataclass(eq=False)
class _Call:
    fn: Callable[[nixl_agent], Any]
    future: concurrent.futures.Future


@dataclass(eq=False)
class _Batch:
    """The parts of one ``transfer``: posted by one job, resolved by one future once every
    part has its outcome (so the event loop wakes once per call, not once per part).

    Both descriptor lists are prepared once per call (``prep_xfer_dlist``) and each part is
    a range of them (``make_prepped_xfer``): measured, a few percent faster than building
    each part's request from its own lists when a call has tens of parts.

    Outcomes come from two threads (the agent's, and the one that runs ``after`` beside it),
    so ``pending`` and each part's ``settled`` are kept under ``lock``; ``requests_left`` is
    the agent thread's alone: when it reaches 0 no request uses the prepared lists any more,
    and that thread releases them (a NIXL object is only ever touched by the agent's thread).
    """

    op: str  # "READ" or "WRITE", seen from the local side
    local: np.ndarray  # Nx3, every row of the call
    remote: np.ndarray
    remote_agent: str
    deadline: float  # time.monotonic()
    after: Callable[[int], Any] | None
    future: concurrent.futures.Future
    parts: list[_Transfer] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    pending: int = 0
    requests_left: int = 0
    prepared: tuple[Any, Any] | None = None  # the two prepped descriptor lists
    lock: threading.Lock = field(default_factory=threading.Lock)
    offer: bool = False  # whether its parts' after work may go to the after-thread

    def request_ended(self) -> None:
        """On the agent's thread: one more part's NIXL request is over (or was never posted)."""
        self.requests_left -= 1
        if self.requests_left == 0 and self.prepared is not None:
            for side in self.prepared:
                quietly(side.release)
            self.prepared = None


@dataclass(eq=False)
class _Transfer:
    """One part of a batch: one NIXL request for descriptors ``start:stop`` of the call."""

    batch: _Batch
    index: int
    start: int
    stop: int
    handle: Any = None
    settled: bool = False
    ended: bool = False  # the request is over (agent thread only)

    @property
    def op(self) -> str:
        return self.batch.op

    @property
    def remote_agent(self) -> str:
        return self.batch.remote_agent

    @property
    def deadline(self) -> float:
        return self.batch.deadline

    def settle(self, outcome: Any) -> None:
        """Report this part's outcome to its batch, once (later reports are ignored); from
        either thread."""
        batch = self.batch
        with batch.lock:
            if self.settled:
                return
            self.settled = True
            batch.results[self.index] = outcome
            batch.pending -= 1
            done = batch.pending == 0
        if done:
            batch.future.set_result(batch.results)


@dataclass(frozen=True)
class _Incoming:
    """A job: one more (``+1``) or one fewer (``-1``) transfer of another agent into this one's
    memory is awaited (``AgentThread.incoming``); ``fast``: it needs frequent progress."""

    delta: int
    fast: bool


_STOP = object()
_NO_OUTCOME = object()


class AgentThread:
    """One NIXL agent and the only thread that ever touches it.

    ``submit``/``call`` run a function of the agent on that thread; ``transfer`` posts the
    parts of one call (one NIXL request each) as one job and resolves once every part is
    DONE (and its ``after`` work has run), failed, or past its deadline. One job and one
    future per call, not per part, because every hand-off between threads costs a wake-up
    (tens to hundreds of microseconds on a loaded VM). Between jobs the thread polls the
    requests in flight (``check_xfer_state`` never blocks), backing off from a few
    microseconds to 1 ms while nothing completes, and sleeps on its queue when nothing is in
    flight.

    Each part may carry work to run once it is DONE (the remote tier checksums the part's
    rows). On loopback, UCX copies with CMA (``process_vm_readv``/``writev``) inside
    ``transfer()`` on this thread, which returns DONE after the copy (measured: 2 MiB parts,
    never PROC): posting part k+1 before hashing part k therefore overlaps nothing, the post
    *is* the copy. Only another thread hashing part k while this one copies part k+1 does
    (the hash releases the GIL). With ``after_thread`` (the default) that thread exists and
    takes a part whenever it keeps up (``_AfterThread``); a part it cannot take at once runs
    here, right after its copy, as all do without it. A call during which this thread was
    kept off the CPU (``_BESIDE_MIN_CPU``: no core was free for both) makes the next calls
    (``_SERIAL_CALLS``, doubling while the cores stay crowded) run their parts' work here.
    Over a transport that returns PROC (TCP, RDMA), the after-thread also keeps the polling
    going while parts are hashed.
    """

    def __init__(self, name: str, *, after_thread: bool = True) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name=f"nixl-{name}", daemon=True)
        self._agent: nixl_agent | None = None
        self._after: _AfterThread | None = _AfterThread(f"nixl-after-{name}") if after_thread else None
        self._serial_calls = 0  # calls left that keep their after work here (agent thread only)
        self._serial_span = _SERIAL_CALLS  # how many the next crowded call sets

    async def start(self, timeout: float) -> None:
        """Create the agent on its thread (the first UCX agent of a process takes ~0.5 s)."""
        self._thread.start()
        if self._after is not None:
            self._after.start()
        await asyncio.wait_for(asyncio.wrap_future(self._ready), timeout)

    def submit(self, fn: Callable[[nixl_agent], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put(_Call(fn, future))
        return future

    async def call(self, fn: Callable[[nixl_agent], T], timeout: float) -> T:
        """Run ``fn(agent)`` on the agent's thread; ``TimeoutError`` if it does not finish in time."""
        return await asyncio.wait_for(asyncio.wrap_future(self.submit(fn)), timeout)

    @contextlib.contextmanager
    def incoming(self, fast: bool = True) -> Iterator[None]:
        """While inside, progress the agent's worker: another agent (a peer) is READing or
        WRITing this one's registered memory, and the transport's wire-up, and over UCX TCP the
        bytes themselves, move only when the target's worker is progressed. ``fast`` (a peer
        on another host): every ``_FAST_INCOMING_SLEEP_S``; otherwise (a peer on this host,
        whose CMA kernel call moves the bytes) backing off to ``_POLL_MAX_SLEEP_S``, because
        frequent wake-ups here slowed the peer's copies on a 2-core machine. Outside, an agent
        with nothing of its own in flight sleeps on its queue and costs nothing."""
        self._jobs.put(_Incoming(+1, fast))
        try:
            yield
        finally:
            self._jobs.put(_Incoming(-1, fast))

    def transfer(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        part_sizes: Sequence[int],
        remote_agent: str,
        deadline: float,
        *,
        after: Callable[[int], Any] | None = None,
    ) -> concurrent.futures.Future[list[Any]]:
        """Post ``op`` of the Nx3 descriptor arrays ``local`` -> ``remote`` as one NIXL request
        per part (``part_sizes`` descriptors each, in order), each part followed by
        ``after(k)`` once part ``k`` is DONE (on the after-thread or on the agent's thread;
        ``after`` must not touch the agent, and must be pure: it may run twice for a part,
        and the first outcome counts).

        The future resolves once every part has finished, failed or timed out, to one
        outcome per part: ``after(k)``'s result (``None`` without ``after``), or the
        ``TransferError`` (``TransferTimeout``) or exception of ``after`` that failed it. When
        it resolves, no request of the call is in flight any more. Once a part fails to
        post, the parts after it are not posted (they fail alike).
        """
        if sum(part_sizes) != len(local) or len(local) != len(remote):
            raise ValueError(
                f"parts of {sum(part_sizes)} descriptors for lists of {len(local)}, {len(remote)}"
            )
        future: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        batch = _Batch(op, local, remote, remote_agent, deadline, after, future)
        start = 0
        for k, size in enumerate(part_sizes):
            batch.parts.append(_Transfer(batch, k, start, start + size))
            start += size
        batch.results = [None] * len(batch.parts)
        batch.pending = batch.requests_left = len(batch.parts)
        if not batch.parts:
            future.set_result([])
        else:
            self._jobs.put(batch)
        return future

    def close(self, timeout: float = 5.0) -> None:
        """Fail what is in flight, drop the agent and stop the threads (blocking, bounded)."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("NIXL agent %s: its thread did not stop within %.1f s", self.name, timeout)
        if self._after is not None:
            self._after.close(timeout)

    # -- the agent's thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._agent = create_agent(self.name)
        except Exception as exc:
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        inflight: list[_Transfer] = []
        incoming = 0  # transfers of other agents into our memory being awaited
        fast = 0  # of them, those that need frequent progress
        sleep_s = 0.0
        while True:
            try:
                job = self._jobs.get(block=not inflight and not incoming)
            except queue.Empty:
                job = None
            if job is _STOP:
                break
            try:
                if isinstance(job, _Incoming):
                    incoming = max(0, incoming + job.delta)
                    fast = max(0, fast + job.delta) if job.fast else fast
                    job, sleep_s = None, 0.0
                elif job is not None:
                    self._start(job, inflight)
                    sleep_s = 0.0
                progressed = bool(inflight) and self._poll(inflight)
                if incoming:
                    quietly(self._agent.get_new_notifs)  # type: ignore[union-attr]
                if (inflight or incoming) and not progressed and job is None:
                    time.sleep(sleep_s)
                    cap = _FAST_INCOMING_SLEEP_S if fast else _POLL_MAX_SLEEP_S
                    sleep_s = min(max(sleep_s * 2, 10e-6), cap)
            except Exception:  # a bug here must not leave any waiter hanging
                log.exception("NIXL agent %s: failing the transfers in flight", self.name)
                stranded = [*inflight, *(job.parts if isinstance(job, _Batch) else ())]
                for xfer in stranded:
                    self._end(xfer, TransferError("agent thread error"))
                inflight.clear()
        for xfer in inflight:
            self._end(xfer, TransferError("agent closed"))
        while True:  # jobs queued behind the stop
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP and not isinstance(job, _Incoming):
                _fail(job.future, TransferError("agent closed"))
        self._agent = None

    def _start(self, job: _Call | _Batch, inflight: list[_Transfer]) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # the waiter gave up before the job started
        agent = self._agent
        assert agent is not None
        if isinstance(job, _Call):
            try:
                job.future.set_result(job.fn(agent))
            except Exception as exc:
                job.future.set_exception(exc)
            return
        job.offer = self._after is not None and self._serial_calls == 0
        self._serial_calls = max(0, self._serial_calls - 1)
        wall, cpu = time.perf_counter(), time.thread_time()
        self._post(job, inflight)
        if (
            job.offer
            and job.after is not None
            and len(job.parts) >= _BESIDE_MIN_PARTS
            and job.requests_left == 0
        ):
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            if cpu < _BESIDE_MIN_CPU * wall:
                self._serial_calls = self._serial_span
                self._serial_span = min(2 * self._serial_span, _MAX_SERIAL_CALLS)
            else:
                self._serial_span = _SERIAL_CALLS
            log.debug(
                "%s: %d parts, agent thread on CPU %.2f of the time", self.name, len(job.parts), cpu / wall
            )

    def _post(self, job: _Batch, inflight: list[_Transfer]) -> None:
        """Post ``job``'s parts, one NIXL request each (over CMA each copies at once)."""
        agent = self._agent
        assert agent is not None
        failed = self._prepare(job)
        for part in job.parts:
            if failed is None and time.monotonic() >= part.deadline:
                failed = TransferTimeout(f"{part.op} to {part.remote_agent}: deadline passed")
            if failed is not None:
                self._end(part, failed)
                continue
            try:
                local_side, remote_side = job.prepared  # type: ignore[misc]
                indices = list(range(part.start, part.stop))
                part.handle = agent.make_prepped_xfer(job.op, local_side, indices, remote_side, indices)
                state = agent.transfer(part.handle)
            except Exception as exc:
                failed = TransferError(f"{part.op} to {part.remote_agent}: {exc}")
                self._end(part, failed)
                continue
            if state == "PROC":
                inflight.append(part)
            else:
                self._finish(part, state)

    def _prepare(self, job: _Batch) -> TransferError | None:
        """Prepare both descriptor lists of ``job`` once; the error that fails it, if any."""
        agent = self._agent
        assert agent is not None
        if time.monotonic() >= job.deadline:
            return TransferTimeout(f"{job.op} to {job.remote_agent}: deadline passed in queue")
        try:
            local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", job.local, "DRAM")
        except Exception as exc:
            return TransferError(f"{job.op}: local descriptors: {exc}")
        try:
            job.prepared = (local_side, agent.prep_xfer_dlist(job.remote_agent, job.remote, "DRAM"))
        except Exception as exc:  # the remote agent is gone (removed after a failure)
            quietly(local_side.release)
            return TransferError(f"{job.op} to {job.remote_agent}: {exc}")
        return None

    def _poll(self, inflight: list[_Transfer]) -> bool:
        """Check every transfer in flight; whether any of them finished."""
        agent = self._agent
        assert agent is not None
        now = time.monotonic()
        timed_out: set[str] = set()
        progressed = False
        for job in list(inflight):
            try:
                state = agent.check_xfer_state(job.handle)
            except Exception as exc:
                state = f"ERR ({exc})"
            if state == "PROC":
                if now < job.deadline:
                    continue
                timed_out.add(job.remote_agent)
                continue
            inflight.remove(job)
            self._finish(job, state)
            progressed = True
        for name in timed_out:  # release every handle towards that agent, then remove it
            for job in [j for j in inflight if j.remote_agent == name]:
                inflight.remove(job)
                self._end(job, TransferTimeout(f"{job.op} to {name}: no completion by its deadline"))
            try:
                agent.remove_remote_agent(name)
            except Exception as exc:
                log.debug("removing remote agent %s after a timeout: %s", name, exc)
            progressed = True
        return progressed

    def _finish(self, job: _Transfer, state: str) -> None:
        """Part ``job``'s request is over in ``state``: settle it, or hand it to ``after``."""
        if state != "DONE":
            self._end(job, TransferError(f"{job.op} to {job.remote_agent}: {state}"))
            return
        self._end(job)
        if job.batch.after is None:
            job.settle(None)
        elif not job.batch.offer or job.batch.requests_left == 0 or not self._after.offer(job):  # type: ignore[union-attr]
            _run_after(job)  # the call's last part too: nothing is left to overlap it with
        self._reclaim(job.batch)

    def _end(self, job: _Transfer, outcome: Any = _NO_OUTCOME) -> None:
        """On the agent's thread: ``job``'s request is over (release its handle, and the
        call's prepared lists after its last part); settle it with ``outcome``, if given."""
        if job.handle is not None:
            handle, job.handle = job.handle, None
            try:
                handle.release()
            except Exception as exc:  # an unfinished transfer: NIXL keeps the handle on its leak list
                log.debug("releasing a %s handle towards %s: %s", job.op, job.remote_agent, exc)
        if not job.ended:
            job.ended = True
            job.batch.request_ended()
        if outcome is not _NO_OUTCOME:
            job.settle(outcome)
            self._reclaim(job.batch)

    def _reclaim(self, batch: _Batch) -> None:
        """Once no request of ``batch`` is in flight, run here what the after-thread has not
        finished: no call waits for a thread that the scheduler may have set aside."""
        if self._after is not None and batch.requests_left == 0:
            for part in self._after.reclaim():
                _run_after(part)


def _run_after(part: _Transfer) -> None:
    """Settle ``part`` with its batch's ``after(k)``, or with the exception it raised."""
    try:
        outcome = part.batch.after(part.index)  # type: ignore[misc]
    except Exception as exc:
        outcome = exc
    part.settle(outcome)


class _AfterThread:
    """A thread that runs parts' ``after`` work beside the agent's thread, never touching the
    agent, and never more than one part behind it.

    The agent's thread *offers* each part as it lands. The offer is taken only if no part is
    waiting for this thread; otherwise this thread is behind (or not scheduled: other work
    holds the cores) and the agent's thread runs the part itself, at once, while the copy
    has left its rows in cache; so does a call's last part (nothing is left to overlap it
    with). Once no request of a call is in flight, the agent's thread *reclaims* what this
    thread has not finished: the part waiting here, and the part it is running, which the
    agent's thread runs a second time (``after`` is pure and a part's first outcome counts),
    because the scheduler may have set this thread aside mid-part for milliseconds. So with
    a core to spare, hashing hides behind the copies; with none, copy and hash alternate on
    the agent's thread as they would without this thread (``AgentThread`` then stops
    offering for a while), and no call waits for a thread that does not run.
    """

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._waiting: collections.deque[_Transfer] = collections.deque()
        self._wake = threading.Semaphore(0)
        self._stopping = False
        self._running: _Transfer | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, part: _Transfer) -> bool:
        """On the agent's thread: queue ``part`` unless a part is waiting already (``False``:
        the caller runs it)."""
        with self._lock:
            if self._waiting:
                return False
            self._waiting.append(part)
        self._wake.release()
        return True

    def reclaim(self) -> list[_Transfer]:
        """On the agent's thread: the parts this thread has not finished (the caller runs them)."""
        with self._lock:
            parts = list(self._waiting)
            self._waiting.clear()
            running = self._running
        if running is not None and not running.settled:
            parts.append(running)
        return parts

    def close(self, timeout: float) -> None:
        """Run what is waiting, then stop (blocking, bounded)."""
        if self._thread.is_alive():
            self._stopping = True
            self._wake.release()
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.acquire()
            while True:
                with self._lock:
                    part = self._running = self._waiting.popleft() if self._waiting else None
                if part is None:
                    break
                _run_after(part)
                self._running = None
            if self._stopping:
                return


def quietly(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)``, an error only logged (at debug): for clean-up that may find nothing to do."""
    try:
        fn(*args)
    except Exception as exc:
        log.debug("%s%s: %s", getattr(fn, "__qualname__", fn), args, exc)


def _fail(future: concurrent.futures.Future, exc: Exception) -> None:
    if future.set_running_or_notify_cancel():
        future.set_exception(exc)


GRACE_S = 0.5
"""How long past a deadline the agent's thread may take to report the parts it timed out."""


async def settle(future: concurrent.futures.Future[list[Any]], deadline: float, parts: int) -> list[Any]:
    """Wait until every part of a ``transfer`` has finished, failed or timed out: one outcome
    per part.

    The agent's thread resolves each part by its deadline; the extra grace only guards
    against a NIXL call that itself blocks, which no measurement has shown.
    """
    try:
        return await asyncio.wait_for(
            asyncio.shield(asyncio.wrap_future(future)),
            max(0.0, deadline - time.monotonic()) + GRACE_S,
        )
    except TimeoutError:
        log.error("NIXL agent did not report %d transfers %.1f s past their deadline", parts, GRACE_S)
        return [TransferTimeout("the NIXL agent is not answering")] * parts
