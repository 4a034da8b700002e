"""A tenant worker: the process that moves one tenant's rows, and the only one that loads its
clients' NIXL metadata.

    python -m tiers.remote.tenant_worker --link-fd FD --first F --count C --slot-bytes B --name NAME

``kvtier peer`` (``tiers/remote/served_memory.py``) starts one per tenant. It holds **only its
tenant's run of slots** (``TenantRows``, in its own memory: the rows die with it), registers
them and a few probe landing areas with its own NIXL agent
(``AgentThread``), and on the peer's request loads a client's metadata, reads its probe
bytes, and READs or WRITEs rows between the client and the run, verifying a get's rows
against their checksums as each part lands. It answers over a socketpair
(``tiers/remote/worker_link.py``). It holds no secret: no token, no session key (the peer
compares the probe bytes itself).

Why a process: NIXL parses a client's metadata in C++ and trusts it (a changed byte in the
UCX worker address aborted the process that loaded it, three in an rkey crashed it), and over
CMA the copy runs in the kernel on this process's agent thread for as long as the client's
memory takes to fault in (userfaultfd held one for 15 s). Here the worst a token holder's
metadata does is end or stall its own tenant's worker: the peer fails that tenant's calls,
closes its connections, kills a stuck worker and starts a new one; other tenants and the
peer's own memory (its tokens, every other tenant's rows) are in other processes.

What CMA may reach from here: at start this process drops ``CAP_SYS_PTRACE`` from its
effective set, so the kernel refuses ``process_vm_readv``/``writev`` into any process that is
not dumpable (the peer makes itself non-dumpable; so does this process) or that runs as
another user. It still reaches, if hostile metadata names them, its **own** memory (only its
tenant's run of slots, its probe areas and its heap, which holds no secret) and any dumpable
process of the same user: run the peer under a user of its own (``docs/threat-model.md``).
``CAP_SYS_PTRACE`` stays in the permitted set: the kernel lets a process CMA into another of
the same user only if the target's permitted capabilities are a subset of its own, so a
worker without it could not copy to or from engines running as root with full capabilities.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import numpy as np
import uvloop

from tiers.fast_checksum import checksum_at
from tiers.remote import worker_link as link
from tiers.remote.nixl_agent import AgentThread, TransferTimeout, descriptors, quietly
from tiers.remote.protocol import PROBE_BYTES

log = logging.getLogger("kvtier.peer.worker")

PROBES = 64
"""Probe reads that may run at once (one per handshake in progress); more wait their turn."""
AGENT_START_S = 30.0
HUGE_PAGE = 2 << 20
TEND_S = 1.0
"""While this process holds more descriptors than it started with (and its loaded agents'), its UCX worker is
progressed this often: a client's endpoint socket is closed only by progress, after the
client left (an agent asleep between transfers kept them in CLOSE-WAIT for good)."""
CAP_SYS_PTRACE = 19
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_CAP_VERSION_3 = 0x20080522
_SYS_CAPGET = 125  # x86_64
_SYS_CAPSET = 126
_libc = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_effective_capability(cap: int) -> None:
    """Remove ``cap`` from this process's effective set (every thread started after)."""
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc.syscall(_SYS_CAPGET, ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    data[cap // 32].effective &= ~(1 << (cap % 32))
    if _libc.syscall(_SYS_CAPSET, ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def harden() -> None:
    """Die with the peer, be non-dumpable, and lose the capability to CMA into non-dumpable
    processes (the peer) and other users' processes."""
    _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    _libc.prctl(_PR_SET_DUMPABLE, 0)
    drop_effective_capability(CAP_SYS_PTRACE)


class TenantRows:
    """The tenant's run of slots, in this process's own memory, and the probe landing areas.

    A numpy allocation (numpy asks for transparent huge pages), 2 MiB aligned, every page
    faulted in at start rather than during a client's first transfer. Huge pages are a
    measured matter: CMA copies into a memfd's 4 KiB pages (shared memory gets no huge pages
    where ``shmem_enabled`` is ``never``) ran about a quarter slower. So are alignments: a CMA
    copy between buffers whose addresses differ mod 64 runs at about half speed, and host
    tiers are torch allocations (aligned), so slots are too. The rows die with this process;
    the peer then forgets them (``PeerPool.drop_run``).
    """

    def __init__(self, first: int, count: int, slot_bytes: int) -> None:
        self.first, self.count, self.slot_bytes = first, count, slot_bytes
        length = count * slot_bytes
        raw = np.zeros(length + HUGE_PAGE, dtype=np.uint8)
        raw[::4096] = 0  # fault every page in now
        start = -raw.ctypes.data % HUGE_PAGE
        self._raw = raw
        self.view = raw[start : start + length]
        self.base = self.view.ctypes.data
        self.probes = np.zeros(PROBES * PROBE_BYTES, dtype=np.uint8)
        self.probe_base = self.probes.ctypes.data

    def regions(self) -> list[tuple[int, int, int, str]]:
        return [(self.base, len(self.view), 0, ""), (self.probe_base, len(self.probes), 0, "")]

    def slot_addr(self, slot: int) -> int:
        if not self.first <= slot < self.first + self.count:
            raise ValueError(f"slot {slot} is not this tenant's")
        return self.base + (slot - self.first) * self.slot_bytes

    def verified(self, slot: int, length: int, expected: int) -> bool:
        """Whether the slot's first ``length`` bytes hash (xxh3) to ``expected``."""
        addr = self.slot_addr(slot)
        at = addr - self.base
        return checksum_at(memoryview(self.view[at : at + length]), addr) == expected


class Worker:
    """Serves the peer's requests over the link, each as a task (the agent thread orders them)."""

    def __init__(self, rows: TenantRows, agent: AgentThread) -> None:
        self.rows = rows
        self.agent = agent
        self._free_probes = asyncio.Queue[int]()
        for i in range(PROBES):
            self._free_probes.put_nowait(i)
        self.loaded: set[str] = set()
        self.baseline_fds = _fds()

    async def tend(self) -> None:
        """Progress the UCX worker every ``TEND_S`` while it holds more descriptors than its
        start and one socket per loaded agent (the stale ones of clients that left)."""
        while True:
            await asyncio.sleep(TEND_S)
            if _fds() > self.baseline_fds + len(self.loaded):
                self.agent.submit(_progress)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks: set[asyncio.Task] = {asyncio.create_task(self.tend())}
        while True:
            try:
                request = await link.read_message(reader)
            except link.LinkError:
                return  # the peer left: so do we
            task = asyncio.create_task(self._answer(request, writer))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _answer(self, request: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        op = request.get("op")
        reply: dict[str, Any] = {"id": request.get("id")}
        try:
            if op == "forget":
                self.forget(request["name"])
                return
            if op == "load":
                reply["ok"] = await self.load(bytes.fromhex(request["metadata"]), request["deadline"])
            elif op == "probe":
                reply["ok"] = (await self.probe(request["name"], request["addr"], request["deadline"])).hex()
            elif op == "bind":
                value = bytes.fromhex(request["value"])
                await self.bind(request["name"], request["pids"], request["addr"], value, request["deadline"])
                reply["ok"] = True
            elif op == "transfer":
                reply["ok"] = await self.transfer(request)
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:
            reply["error"] = f"{type(exc).__name__}: {exc}"
            reply["timeout"] = isinstance(exc, TransferTimeout | TimeoutError)
        reply["stale_fds"] = _fds() - self.baseline_fds - len(self.loaded)  # see MAX_STALE_FDS
        writer.write(link.encode(reply))

    async def load(self, metadata: bytes, deadline: float) -> str:
        raw = await self.agent.call(
            lambda a: a.add_remote_agent(metadata), max(0.0, deadline - time.monotonic())
        )
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.loaded.add(name)
        return name

    def forget(self, name: str) -> None:
        """Drop a client's agent after whatever is queued towards it, then progress the worker
        a little, so UCX can finish closing the endpoint (its socket is closed by progress only:
        an agent that went back to sleep kept it, in CLOSE-WAIT, for good)."""

        def drop(agent) -> None:
            quietly(agent.remove_remote_agent, name)
            _progress(agent)

        self.loaded.discard(name)
        self.agent.submit(drop)

    async def probe(self, name: str, addr: int, deadline: float) -> bytes:
        index = await asyncio.wait_for(self._free_probes.get(), max(0.0, deadline - time.monotonic()))
        try:
            at = index * PROBE_BYTES
            self.rows.probes[at : at + PROBE_BYTES] = 0
            await self._move("READ", name, [self.rows.probe_base + at], [addr], [PROBE_BYTES], deadline)
            return self.rows.probes[at : at + PROBE_BYTES].tobytes()
        finally:
            self._free_probes.put_nowait(index)

    async def bind(self, name: str, pids: list[int], addr: int, value: bytes, deadline: float) -> None:
        """Make sure agent ``name`` reaches the memory of one of ``pids`` (the processes that hold
        the client's end of its connection: ``socket_owner``). Those whose bytes at ``addr`` are
        the session's probe ``value`` (only these: nothing else of theirs is ever written) get a
        fresh secret there, written straight into their memory (``process_vm_writev``), and the
        secret must come back through the agent. Metadata naming any other process (the
        peer's, this worker's, another client's) fails it."""
        secret = os.urandom(PROBE_BYTES)
        holders = [pid for pid in pids if _read_memory(pid, addr, len(value)) == value]
        if not any(_write_memory(pid, addr, secret) for pid in holders):
            raise PermissionError(f"no process holding the connection ({pids}) holds the probe bytes")
        if await self.probe(name, addr, deadline) != secret:
            raise PermissionError("the agent does not reach the process that holds its connection")

    async def transfer(self, request: dict[str, Any]) -> list[Any]:
        slots: list[int] = request["slots"]
        lengths: list[int] = request["lengths"]
        checksums: list[int] | None = request.get("checksums")
        sizes: list[int] = request.get("parts") or [len(lengths)]
        local = [self.rows.slot_addr(s) for s in slots]
        after = None
        if checksums is not None:
            starts = [sum(sizes[:k]) for k in range(len(sizes))]

            def after(k: int) -> list[bool]:  # pure: it may run twice for a part
                rows = range(starts[k], starts[k] + sizes[k])
                return [self.rows.verified(slots[i], lengths[i], checksums[i]) for i in rows]

        return await self._move(
            request["kind"],
            request["name"],
            local,
            request["addrs"],
            lengths,
            request["deadline"],
            sizes,
            after,
        )

    async def _move(self, op, name, local, remote, lengths, deadline, sizes=None, after=None) -> list[Any]:
        """The agent thread's outcomes, however late: the peer enforces the deadline (and ends
        this process if a copy holds the agent thread past it)."""
        future = self.agent.transfer(
            op,
            descriptors(local, lengths),
            descriptors(remote, lengths),
            sizes or [len(lengths)],
            name,
            deadline,
            after=after,
        )
        outcomes = await asyncio.wrap_future(future)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _read_memory(pid: int, addr: int, n: int) -> bytes | None:
    """``process_vm_readv`` of ``n`` bytes at ``addr`` in ``pid``; ``None`` if refused or short."""
    buf = ctypes.create_string_buffer(n)
    local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), n)
    remote = _IoVec(addr, n)
    got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return buf.raw if got == n else None


def _write_memory(pid: int, addr: int, data: bytes) -> bool:
    """``process_vm_writev`` of ``data`` at ``addr`` in ``pid``; whether all of it was written."""
    buf = ctypes.create_string_buffer(data, len(data))
    local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), len(data))
    remote = _IoVec(addr, len(data))
    return _libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == len(data)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _progress(agent) -> None:
    for _ in range(8):
        quietly(agent.get_new_notifs)


async def _run(args: argparse.Namespace) -> int:
    rows = TenantRows(args.first, args.count, args.slot_bytes)
    agent = AgentThread(args.name)
    await agent.start(AGENT_START_S)
    await agent.call(lambda a: a.register_memory(rows.regions(), "DRAM"), AGENT_START_S)
    sock = socket.socket(fileno=args.link_fd)
    reader, writer = await asyncio.open_connection(sock=sock, limit=link.MAX_MESSAGE + 64)
    writer.write(link.encode({"id": 0, "ok": os.getpid()}))  # ready
    try:
        await Worker(rows, agent).serve(reader, writer)
    finally:
        await asyncio.to_thread(agent.close)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier-tenant-worker")
    for flag in ("--link-fd", "--first", "--count", "--slot-bytes"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    harden()
    return uvloop.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
