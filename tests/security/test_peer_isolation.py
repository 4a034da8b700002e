"""Issue 36's attacks by a token holder on the data plane of ``kvtier peer``: hostile NIXL
metadata, CMA aimed at processes other than the client's own, descriptors that pile up, a
client whose memory stalls the copy. Each runs against a real peer on 127.0.0.1 and asserts
what the attacker wanted did not happen; each passed for the attacker on the peer before
tenant workers (one NIXL agent in the serving process).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.security.peer_processes import CLOSE_WAIT, open_descriptors, peer_processes, tcp_sockets
from tests.tiers.peer_fixtures import ROOT, HostRows, RawAgent, RawConnection, key, open_tier
from tiers.remote import protocol as proto

ROW = 64 << 10
VICTIM_TOKEN = b"victim-token-" + os.urandom(8).hex().encode()
ATTACKER_TOKEN = b"attacker-token-" + os.urandom(8).hex().encode()
TENANTS = {"victim": VICTIM_TOKEN, "attacker": ATTACKER_TOKEN}

multiprocess = pytest.mark.multiprocess


# -- the peer's processes, seen from outside ------------------------------------------------


def descriptors_of(pid: int) -> tuple[int, int]:
    """Open descriptors of the peer's processes, and how many of their sockets are in CLOSE-WAIT."""
    count, inodes = open_descriptors(pid)
    return count, sum(state == CLOSE_WAIT for _address, state in tcp_sockets(pid, inodes))


def find_in_memory(pid: int, needle: bytes) -> list[int]:
    """Addresses of ``needle`` in the writable memory of ``pid`` (the test runs as root)."""
    found = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if "rw" not in fields[1] or end - start > 1 << 30 or fields[-1].startswith("[v"):
                continue
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except OSError:
                continue
            at = data.find(needle)
            while at != -1:
                found.append(start + at)
                at = data.find(needle, at + 1)
    return found


def read_memory(pid: int, addr: int, n: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", 0) as mem:
        mem.seek(addr)
        return mem.read(n)


# -- metadata surgery -----------------------------------------------------------------------


def _blob_span(real: bytes) -> range:
    """The UCX worker address inside the metadata (NIXL's opaque connection info)."""
    at = real.index(b"UCX|c") + 5
    (length,) = struct.unpack_from("<Q", real, at)
    return range(at + 8, at + 8 + length)


def _descriptor_at(real: bytes) -> int:
    """Where the one registered region's descriptor starts (address, length, device, rkey)."""
    for size in range(24, 512):
        at = len(real) - 1 - size
        if struct.unpack_from("<Q", real, at - 8)[0] == size:
            return at
    raise AssertionError("no descriptor found")


def retarget(real: bytes, own: int, pid: int) -> bytes:
    """The metadata of process ``own``'s agent with its CMA pid (the first copy of the pid in
    the UCX worker address, as UCX 1.x packs it for NIXL 1.5.1) replaced by ``pid``, and its
    region widened to nearly the whole address space. (The announcing process's UCX may crash
    once the peer connects to it: ``announcer`` keeps it out of the test process.)"""
    blob = _blob_span(real)
    out = bytearray(real)
    at = bytes(out[blob.start : blob.stop]).index(struct.pack("<I", own))
    struct.pack_into("<I", out, blob.start + at, pid)
    struct.pack_into("<QQ", out, _descriptor_at(real), 0x1000, (1 << 47) - 0x1000)
    return bytes(out)


def fuzzed(real: bytes, count: int, seed: int) -> list[bytes]:
    """``count`` blobs that keep NIXL's framing but change bytes inside the UCX worker address,
    the rkey, a length, or a pid: what the shape check cannot judge."""
    rng = np.random.default_rng(seed)
    blob = _blob_span(real)
    desc = _descriptor_at(real)
    rkey = range(desc + 24, len(real) - 1)
    own = struct.pack("<I", os.getpid())
    pids = [blob.start + i for i in range(len(blob)) if real[blob.start + i : blob.start + i + 4] == own]
    out = []
    name = real[real.index(b"Agent") + 13 :].split(b"|")[0]
    for n in range(count):  # each under a name of its own: the peer loads one agent per name
        mutated = bytearray(real.replace(name, name[:-12] + os.urandom(6).hex().encode()))
        kind = n % 4
        if kind == 0:  # the UCX worker address
            for at in rng.choice(blob, int(rng.integers(1, 4)), replace=False):
                mutated[int(at)] ^= int(rng.integers(1, 256))
        elif kind == 1:  # the rkey
            for at in rng.choice(rkey, int(rng.integers(1, 4)), replace=False):
                mutated[int(at)] ^= int(rng.integers(1, 256))
        elif kind == 2:  # a length or count byte inside the worker address
            at = int(rng.choice(blob[: min(len(blob), 48)]))
            mutated[at] = int(rng.choice([0, 1, 0x7F, 0x80, 0xFF]))
        else:  # a pid
            at = int(rng.choice(pids))
            struct.pack_into("<I", mutated, at, int(rng.integers(1, 1 << 22)))
        out.append(bytes(mutated))
    return out


# -- the tests ------------------------------------------------------------------------------


def announce(port: int, token: bytes, tenant: str, agent: RawAgent, metadata: bytes, probe_addr=None):
    """Handshake and AGENT with ``metadata``; whether the peer answered READY."""
    raw = RawConnection(port, timeout=5.0)
    try:
        if raw.handshake(token, tenant=tenant) is None or raw.session is None:  # pragma: no cover
            return False
        agent.write_probe(raw.session.probe_value)
        addr = agent.probe_addr if probe_addr is None else probe_addr
        raw.request(proto.Msg.AGENT, 0, proto.encode_agent(addr, metadata))
        try:
            frame = raw.read_frame()
        except (OSError, ValueError):
            return False
        return frame is not None and frame.type == proto.Msg.READY
    finally:
        raw.close()


FUZZ_FRAMES = 2000
ATTACKER_RESTARTS = 10  # attackers that may die of their own UCX before the frames are all sent


@multiprocess
async def test_fuzzed_agent_frames_leave_the_peer_and_other_tenants_served(spawn_peers):
    """Thousands of AGENT frames (``fuzz_child``, a process of its own) whose metadata passes
    the shape check but carries changed bytes in the UCX worker address, the rkey, lengths and
    pids (single changes like these aborted or crashed the process that loaded them): the peer
    lives, its log shows the attacker's tenant worker ending (the frames reached NIXL), and
    another tenant's puts and gets all succeed meanwhile."""
    (peer,) = spawn_peers(tenants=TENANTS, capacity="2MiB", row_bytes="64KiB")
    rows = HostRows([ROW] * 4, seed=36)
    keys = [key(i, salt=b"fuzz") for i in range(4)]
    rounds = 0
    announced: set[int] = set()  # the frames' indices, over every attacker
    summary, crashes = "", []
    async with open_tier(  # a deadline for a shared, loaded machine: the attack adds no delay
        [peer.address], rows.view, token=VICTIM_TOKEN, tenant="victim", deadline_s=5.0
    ) as victim:
        # An attacker whose own UCX crashed on the way (SIGSEGV, answered by the peer's workers
        # that loaded its fuzzed metadata) is followed by another from the first frame not yet
        # announced, until every frame was: the claim is about the peer and the victim, not
        # the attacker's own process.
        while len(announced) < FUZZ_FRAMES and len(crashes) <= ATTACKER_RESTARTS:
            start = min(set(range(FUZZ_FRAMES)) - announced)  # the first frame not yet announced
            attacker = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.security.fuzz_child", str(peer.port),
                ATTACKER_TOKEN.decode(), "attacker", str(FUZZ_FRAMES), "36", str(start),
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                while attacker.returncode is None:
                    rounds += 1
                    assert await victim.put(list(zip(keys, rows.src, strict=True))) == [True] * 4, rounds
                    rows.clear_dst()
                    assert await victim.get(list(zip(keys, rows.dst, strict=True))) == [True] * 4, rounds
                    assert all(rows.same(i) for i in range(4))
                    await victim.delete(keys)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(attacker.wait(), 0.05)
                out, err = await attacker.communicate()
            finally:
                if attacker.returncode is None:
                    attacker.kill()
                    await attacker.wait()
            summary = out.decode(errors="replace")
            announced.update(
                int(line.split()[1]) for line in summary.splitlines() if line.startswith("frame ")
            )
            if attacker.returncode != 0:
                last = max(announced, default=None)
                crashes.append(
                    f"exit {attacker.returncode} after frame {last}: {err.decode(errors='replace')[-500:]}"
                )
    # (UCX writes its errors to stdout too: only the attacker's own lines are counted.)
    assert announced == set(range(FUZZ_FRAMES)), crashes
    assert f"sent {FUZZ_FRAMES} " in summary, crashes  # the last attacker ran to the end
    assert peer.proc.poll() is None and rounds >= 3
    assert "worker ended" in peer.log()  # some frames killed the attacker's worker, only it


@multiprocess
@pytest.mark.parametrize("whose", ["the peer's", "its tenant worker's", "another client's"])
def test_an_agent_naming_another_process_is_refused(spawn_peers, whose):
    """A token holder announces a real agent with the CMA pid replaced (the peer's own; the
    tenant worker's, which maps the attacker's rows; a process of another client that holds
    bytes the attacker chose), its region widened to the whole address space, and its probe
    address pointing where the session's probe bytes are (a row the attacker stored, or the
    other client's memory): the probe passes if the copy goes there. The peer refuses the
    agent, and its token (a canary outside the pool) reads the same after."""
    (peer,) = spawn_peers(tenants=TENANTS)
    agent = RawAgent()
    canaries = find_in_memory(peer.proc.pid, VICTIM_TOKEN)
    assert canaries, "the token is not in the peer's memory"
    other = holder = None
    try:
        raw = RawConnection(peer.port, timeout=5.0)
        assert raw.handshake(ATTACKER_TOKEN, tenant="attacker") is not None and raw.session is not None
        value = raw.session.probe_value
        if whose != "another client's":
            # the bytes the probe wants, stored as a row of the attacker's: in the peer's pool
            writer = RawConnection(peer.port, timeout=5.0)
            assert writer.handshake(ATTACKER_TOKEN, tenant="attacker", agent=agent) is not None
            agent.buffer[: proto.PROBE_BYTES] = np.frombuffer(value, dtype=np.uint8)
            writer.request(proto.Msg.PUT, 1, proto.encode_transfer([b"row"], [4096], [agent.addr], 2000))
            landed = writer.read_frame()
            assert landed is not None and landed.type == proto.Msg.LANDED
            writer.close()
            holding = [(p, a) for p in peer_processes(peer.proc.pid) for a in find_in_memory(p, value)]
            target, places = peer.proc.pid, [a for _, a in holding]
            if whose == "its tenant worker's":  # the process that maps the attacker's rows
                target = next((p for p, _ in holding if p != peer.proc.pid), target)
                places = [a for p, a in holding if p == target]
        else:
            other = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, value.hex()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert other.stdout is not None
            pid, addr = (int(x) for x in other.stdout.readline().split())
            target, places = pid, [addr]
        assert places, "the probe bytes are nowhere to point at"
        holder = subprocess.Popen(
            [sys.executable, "-c", _ANNOUNCER],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        own, metadata = holder.stdout.readline().split()
        metadata = retarget(bytes.fromhex(metadata), int(own), target)
        raw.request(proto.Msg.AGENT, 0, proto.encode_agent(places[0], metadata))
        try:
            frame = raw.read_frame()
        except (OSError, ValueError):
            frame = None
        raw.close()
        assert frame is None or frame.type != proto.Msg.READY, (
            f"the peer loaded an agent that reaches {whose} memory"
        )
        assert peer.proc.poll() is None
        for addr in canaries:
            assert read_memory(peer.proc.pid, addr, len(VICTIM_TOKEN)) == VICTIM_TOKEN
        control = RawConnection(peer.port, timeout=5.0)  # the attacker's own agent is still served
        assert control.handshake(ATTACKER_TOKEN, tenant="attacker", agent=agent) is not None
        control.close()
    finally:
        agent.close()
        for process in (other, holder):
            if process is not None:
                process.kill()
                process.wait()


_HOLDER = """
import ctypes, os, sys
value = bytes.fromhex(sys.argv[1])
held = ctypes.create_string_buffer(value, len(value))
print(os.getpid(), ctypes.addressof(held), flush=True)
sys.stdin.readline()
"""

_ANNOUNCER = """
import os, sys
from tests.tiers.peer_fixtures import RawAgent, die_with_parent
die_with_parent()
agent = RawAgent()
print(os.getpid(), agent.metadata.hex(), flush=True)
sys.stdin.readline()
"""

CONNECTIONS = 1000


@multiprocess
def test_descriptors_stay_flat_across_a_thousand_connections_of_one_agent(spawn_peers):
    """One client process announces the same agent on 1,000 connections, then exits: the
    peer's processes hold about what they held before (never a descriptor per connection), and
    none of their sockets is left in CLOSE-WAIT."""
    (peer,) = spawn_peers(token=VICTIM_TOKEN)
    before, _ = descriptors_of(peer.proc.pid)
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.security.reconnect_child",
            str(peer.port),
            VICTIM_TOKEN.decode(),
            str(CONNECTIONS),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("done")
        living, _ = descriptors_of(peer.proc.pid)
        assert living < before + 400, f"{living - before} more descriptors while the client lives"
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(10)
        deadline = time.monotonic() + 5
        while True:
            after, close_wait = descriptors_of(peer.proc.pid)
            if (close_wait == 0 and after < before + 16) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert close_wait == 0 and after < before + 16, (before, after, close_wait)
        assert peer.proc.poll() is None
    finally:
        child.kill()
        child.wait()


# -- a client whose memory stalls the copy --------------------------------------------------

_SYS_USERFAULTFD = 323  # x86_64
_UFFDIO_API = 0xC018AA3F
_UFFDIO_REGISTER = 0xC020AA00
_UFFD_API = 0xAA
_MODE_MISSING = 1


class _Stall:
    """Anonymous memory armed with userfaultfd and never served: any touch of it (a CMA copy
    from another process included) waits until ``close``."""

    def __init__(self, nbytes: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.syscall(_SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if self.fd < 0:
            pytest.skip(f"userfaultfd is not available here (errno {ctypes.get_errno()})")
        api = (ctypes.c_uint64 * 3)(_UFFD_API, 0, 0)
        if libc.ioctl(self.fd, _UFFDIO_API, api) != 0:
            os.close(self.fd)
            pytest.skip("UFFDIO_API failed")
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        register = (ctypes.c_uint64 * 4)(self.addr, nbytes, _MODE_MISSING, 0)
        if libc.ioctl(self.fd, _UFFDIO_REGISTER, register) != 0:
            os.close(self.fd)
            pytest.skip(f"UFFDIO_REGISTER failed (errno {ctypes.get_errno()})")

    def close(self) -> None:
        os.close(self.fd)  # the waiting faults are woken and served as ordinary ones


@multiprocess
async def test_a_client_whose_memory_stalls_the_copy_delays_only_itself(spawn_peers):
    """An attacker's PUT names rows in memory armed with userfaultfd: the copy out of it never
    finishes. The attacker is answered by its deadline (and its tenant's worker replaced); the
    victim tenant's put and get, started meanwhile, succeed within theirs."""
    (peer,) = spawn_peers(tenants=TENANTS)
    stall = _Stall(1 << 20)
    agent = RawAgent(extra=[(stall.addr, 1 << 20)])
    raw = RawConnection(peer.port, timeout=10.0)
    try:
        assert raw.handshake(ATTACKER_TOKEN, tenant="attacker", agent=agent) is not None
        raw.request(proto.Msg.PUT, 1, proto.encode_transfer([b"stall"], [ROW], [stall.addr], 1500))
        await asyncio.sleep(0.2)  # the attacker's copy has started and is stuck
        rows = HostRows([ROW] * 4, seed=6)
        keys = [key(i, salt=b"stall") for i in range(4)]
        async with open_tier(
            [peer.address], rows.view, token=VICTIM_TOKEN, tenant="victim", deadline_s=1.0
        ) as victim:
            assert await victim.put(list(zip(keys, rows.src, strict=True))) == [True] * 4
            rows.clear_dst()
            assert await victim.get(list(zip(keys, rows.dst, strict=True))) == [True] * 4
            assert all(rows.same(i) for i in range(4))
        reply = await asyncio.to_thread(raw.read_frame)
        assert reply is not None and reply.type == proto.Msg.ERROR
        assert proto.decode_error(reply.payload)[0] in (
            proto.ErrorCode.TRANSFER_TIMEOUT,
            proto.ErrorCode.TRANSFER_FAILED,
        )
        assert peer.proc.poll() is None
    finally:
        raw.close()
        stall.close()
        agent.close()
