"""The tenant workers that hold and move the peer's rows; the serving process touches no
client's NIXL metadata, holds no NIXL agent and maps no row.

Each slot range (a tenant's quota, or the one shared range of a peer without a token file)
gets a **tenant worker** (``tiers/remote/tenant_worker.py``): a process that holds that range's
slots in its own memory and owns the NIXL agent that loads that tenant's clients' metadata
and READs and WRITEs their rows. (A memfd shared with this process would let the rows outlive
a worker, but this VM gives shared memory no huge pages and CMA copies into it ran about a
quarter slower: the rows live and die with their worker, and ``on_rows_lost`` tells the pool.)

``TenantWorker`` is this side of one worker: requests over a socketpair, each with a deadline.
A worker that does not answer by its deadline plus ``KILL_GRACE_S`` (a CMA copy from a
client's memory that does not fault in, an agent wedged by metadata) is killed; a worker
that died for any reason fails every call in flight (``TransferFailed``), each connection
whose agent it had loaded is closed (``on_lost``) and its rows are forgotten. A new one is
started (``RESTART_BACKOFF_S``). Other tenants' workers are untouched, and so is this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tiers.remote import worker_link as link

log = logging.getLogger("kvtier.peer")

WORKER_START_S = 120.0
"""A worker starts in about a second (Python, NIXL, UCX); many peers starting at once on a
loaded machine took more than 30 s."""
KILL_GRACE_S = 0.5
"""How long past a call's deadline a worker may take to answer before it is killed."""
MAX_STALE_FDS = 256
"""A worker holding more descriptors than this beyond its start and its loaded agents is
recycled once it has no call in flight. Measured (NIXL 1.5.1, UCX TCP and CMA on one host):
every ``add_remote_agent`` opens a socket to the client's UCX that ``remove_remote_agent``
does not close while that client's process lives (it goes once the client exits and the
worker progresses: ``tenant_worker.TEND_S``), so one agent reconnecting in a loop would
otherwise hold a descriptor per connection in its tenant's worker."""
RESTART_BACKOFF_S = (0.0, 0.25, 0.5, 1.0, 2.0, 5.0)
"""How long after its n-th death in a row a tenant's worker is started again. A start costs
about a second of CPU (Python, NIXL, UCX): metadata that kills the worker each time must not
make the peer spend the cores other tenants need. Calls meanwhile fail at once."""
HEALTHY_S = 10.0
"""A worker that lived this long resets the count of deaths in a row."""
ROOT = Path(__file__).resolve().parents[2]
_PR_SET_DUMPABLE = 4


class TransferFailed(Exception):
    """The peer's READ or WRITE of a client's rows failed (``timed_out``: ran out of the
    client's budget): answered, then the connection closes."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def make_undumpable() -> None:
    """``prctl(PR_SET_DUMPABLE, 0)``: processes of the same user then need ``CAP_SYS_PTRACE``
    to read or write this one's memory (CMA, ``/proc/PID/mem``); tenant workers drop it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0)


class TenantWorker:
    """This side of one tenant worker process: start, calls with deadlines, death."""

    def __init__(
        self, key: str, first: int, count: int, slot_bytes: int, on_rows_lost: Callable[[str], object]
    ) -> None:
        self.key = key
        self._spec = (first, count, slot_bytes)
        self._on_rows_lost = on_rows_lost
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._starting: asyncio.Task | None = None
        self._reading: asyncio.Task | None = None
        self.on_lost: dict[str, Callable[[], object]] = {}  # loaded agent -> close its connection
        self.pid = 0
        self.closing = False
        self.stale_fds = 0  # as the worker's last answer counted them
        self._deaths = 0  # in a row (see RESTART_BACKOFF_S)
        self._started_at = 0.0
        self._not_before = 0.0
        self._chores: set[asyncio.Task] = set()  # reaping and restarting, held until done

    @property
    def alive(self) -> bool:
        return self._writer is not None

    async def ready(self) -> None:
        """Start the process unless it runs (one start for concurrent callers)."""
        if self.alive:
            return
        if time.monotonic() < self._not_before:
            raise TransferFailed(f"the worker of tenant {self.key!r} is restarting")
        if self._starting is None or self._starting.done():
            self._starting = asyncio.create_task(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        first, count, slot_bytes = self._spec
        ours, theirs = socket.socketpair()
        try:
            args = [
                f"--link-fd={theirs.fileno()}",
                f"--first={first}",
                f"--count={count}",
                f"--slot-bytes={slot_bytes}",
                f"--name=kvtier-peer-{os.urandom(8).hex()}",
                f"--log-level={logging.getLevelName(logging.getLogger().getEffectiveLevel())}",
            ]
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tiers.remote.tenant_worker", *args,
                cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours, limit=link.MAX_MESSAGE + 64)
        try:
            hello = await asyncio.wait_for(link.read_message(reader), WORKER_START_S)
        except (link.LinkError, TimeoutError) as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            writer.close()
            why = str(exc) or type(exc).__name__
            raise TransferFailed(f"the worker of tenant {self.key!r} did not start: {why}") from None
        self._proc, self._writer, self.pid = proc, writer, int(hello.get("ok", 0))
        self._reading = asyncio.create_task(self._read(reader, writer, proc))
        self._started_at = time.monotonic()
        log.info("tenant %r: worker %d started", self.key, proc.pid)

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, proc) -> None:
        try:
            while True:
                reply = await link.read_message(reader)
                if isinstance(reply.get("stale_fds"), int):
                    self.stale_fds = reply["stale_fds"]
                future = self._pending.pop(reply.get("id"), None)  # type: ignore[arg-type]
                if future is not None and not future.done():
                    future.set_result(reply)
        except link.LinkError as exc:
            why = str(exc)
        except asyncio.CancelledError:
            why = "the peer is stopping"
        self._lost(writer, proc, why)

    def _lost(self, writer: asyncio.StreamWriter, proc, why: str) -> None:
        """The worker is gone (or is being killed): fail its calls, close its connections."""
        if self._writer is not writer:
            return  # a worker before this one
        self._writer = None
        writer.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        self._chore(proc.wait())  # reaped, never a zombie
        self._on_rows_lost(self.key)  # they were in its memory
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(TransferFailed(f"the tenant's worker ended: {why}"))
        lost, self.on_lost = self.on_lost, {}
        if lost:
            log.warning("tenant %r: worker ended (%s): closing %d connection(s)", self.key, why, len(lost))
        loop = asyncio.get_running_loop()
        for close in lost.values():  # after this step: a failed call's answer is written first
            loop.call_soon(close)
        now = time.monotonic()
        self._deaths = 1 if now - self._started_at > HEALTHY_S else self._deaths + 1
        delay = RESTART_BACKOFF_S[min(self._deaths - 1, len(RESTART_BACKOFF_S) - 1)]
        self._not_before = now + delay
        if not self.closing:  # the next client of this tenant finds a worker ready
            self._chore(self._restart(delay))

    def _chore(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _restart(self, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self.ready()
        except Exception as exc:
            log.error("tenant %r: no worker: %s", self.key, exc)

    async def call(self, op: str, deadline: float, **fields: Any) -> Any:
        """The worker's answer to ``op`` (``ok``); ``TransferFailed`` if it failed, timed out
        or the worker ended. Past ``deadline + KILL_GRACE_S`` the worker is killed."""
        await self.ready()
        if time.monotonic() >= deadline:  # the start took it all: not the worker's fault
            raise TransferFailed(f"{op}: the deadline passed while the worker started", timed_out=True)
        writer, proc = self._writer, self._proc
        assert writer is not None
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            writer.write(link.encode({"id": rid, "op": op, "deadline": deadline, **fields}))
            reply = await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()) + KILL_GRACE_S)
        except TimeoutError:
            log.warning("tenant %r: worker %s stuck past a deadline: killing it", self.key, self.pid)
            self._lost(writer, proc, "stuck past a deadline")
            raise TransferFailed(f"{op}: no answer by the deadline", timed_out=True) from None
        finally:
            self._pending.pop(rid, None)
        if "error" in reply:
            raise TransferFailed(str(reply["error"]), timed_out=bool(reply.get("timeout")))
        return reply.get("ok")

    def send(self, op: str, **fields: Any) -> None:
        """A request that has no answer (``forget``); nothing if the worker is not running."""
        if self._writer is not None:
            self._writer.write(link.encode({"id": 0, "op": op, **fields}))

    def recycle_if_bloated(self) -> None:
        """End a worker that holds more than ``MAX_STALE_FDS`` stale descriptors (see there)
        when it has nothing in flight; its connections are closed and reconnect."""
        if self.alive and not self._pending and self.stale_fds > MAX_STALE_FDS:
            self.stale_fds = 0
            self._lost(self._writer, self._proc, f"recycled: {MAX_STALE_FDS}+ stale descriptors")  # type: ignore[arg-type]

    async def close(self) -> None:
        self.closing = True
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.gather(self._reading, return_exceptions=True)
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._proc.wait(), 5.0)


class ServedMemory:
    """One ``TenantWorker`` per slot range (``ranges``: key -> (first slot, count); ``shared``:
    every tenant uses the range ``""``). ``on_rows_lost(key)``: that range's worker ended and
    its rows with it."""

    def __init__(
        self,
        ranges: Mapping[str, tuple[int, int]],
        slot_bytes: int,
        *,
        shared: bool,
        on_rows_lost: Callable[[str], object],
    ) -> None:
        self.slot_bytes = slot_bytes
        self._shared = shared
        self.workers = {
            key: TenantWorker(key, first, count, slot_bytes, on_rows_lost)
            for key, (first, count) in ranges.items()
            if count
        }
        self._agents: dict[str, TenantWorker] = {}  # loaded client agent -> its tenant's worker

    async def start(self) -> None:
        """Start every worker (in parallel; each faults its rows in)."""
        await asyncio.gather(*(w.ready() for w in self.workers.values()))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers.values()), return_exceptions=True)

    def worker_of(self, tenant: str) -> TenantWorker:
        return self.workers["" if self._shared else tenant]

    async def load(self, tenant: str, metadata: bytes, deadline: float, on_lost: Callable[[], object]) -> str:
        """Load a client's (shape-checked) metadata in its tenant's worker; the name NIXL gives
        its agent. ``on_lost`` is called if that worker ends while the agent is loaded."""
        worker = self.worker_of(tenant)
        name = str(await worker.call("load", deadline, metadata=metadata.hex()))
        self._agents[name] = worker
        worker.on_lost[name] = on_lost
        return name

    def forget(self, name: str) -> None:
        """Drop a client's agent, after whatever is queued towards it."""
        worker = self._agents.pop(name, None)
        if worker is not None and worker.on_lost.pop(name, None) is not None:
            worker.send("forget", name=name)
            worker.recycle_if_bloated()

    def _worker_for(self, name: str) -> TenantWorker:
        worker = self._agents.get(name)
        if worker is None or name not in worker.on_lost:
            raise TransferFailed(f"agent {name} is not loaded (its worker ended)")
        return worker

    async def read_probe(self, name: str, probe_addr: int, deadline: float) -> bytes:
        """The client's ``PROBE_BYTES`` at ``probe_addr``, read by its tenant's worker."""
        return bytes.fromhex(await self._worker_for(name).call("probe", deadline, name=name, addr=probe_addr))

    async def bind(self, name: str, pids: list[int], probe_addr: int, value: bytes, deadline: float) -> None:
        """``TransferFailed`` unless agent ``name`` reaches the one of ``pids`` that holds the
        probe ``value`` at ``probe_addr`` (``tenant_worker.Worker.bind``)."""
        await self._worker_for(name).call(
            "bind", deadline, name=name, pids=pids, addr=probe_addr, value=value.hex()
        )

    async def transfer(
        self,
        op: str,
        name: str,
        slots: list[int],
        client_addrs: list[int],
        lengths: list[int],
        deadline: float,
        *,
        part_sizes: list[int] | None = None,
        checksums: list[int] | None = None,
    ) -> list[Any]:
        """READ (client rows -> slots) or WRITE (slots -> client rows), one NIXL request per
        part (``part_sizes`` rows each; one part by default). With ``checksums`` (one per row),
        each part's rows are verified in their slots right after its copy: a list of verdicts
        per part; otherwise ``None`` per part. ``TransferFailed`` if it failed or ran late."""
        return await self._worker_for(name).call(
            "transfer",
            deadline,
            kind=op,
            name=name,
            slots=slots,
            addrs=client_addrs,
            lengths=lengths,
            parts=part_sizes,
            checksums=checksums,
        )
