"""Real ``kvtier peer`` processes for tests, and a blocking protocol client to poke them with.

Peers listen on 127.0.0.1 with a port of the kernel's choosing (``:0``, read back from the
ready line), or a given port to restart one in place. Whoever starts a peer must
``close()`` it (the test modules do it in fixture teardown): ``close`` continues a stopped
peer and kills it, so no test leaves a process behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.child_process import Faultable
from tiers.address import Address
from tiers.remote import RemoteTier
from tiers.remote import protocol as proto
from tiers.settings import RemoteSettings

# Peers and clients here talk over 127.0.0.1 only; without this UCX also listens on every
# other interface of the machine for its wire-up.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 30.0
LAYOUT = b"test-layout-v1\0\0"


_PRCTL = ctypes.CDLL(None).prctl  # resolved here: the child, after fork, only calls it
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: be killed when the test process dies, even by SIGKILL (no orphan peers)."""
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


class PeerProcess(Faultable):
    """One ``python -m tiers.remote.server`` child."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        """``env``: the child's whole environment (default: this process's, NIXL quiet)."""
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in close())
        env = env if env is not None else {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiers.remote.server", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            preexec_fn=die_with_parent,
        )
        self.address = ""
        self.port = 0

    def wait_ready(self) -> PeerProcess:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        line = self.proc.stdout.readline() if readable else ""
        if "listening on" not in line:
            self.close()
            raise RuntimeError(f"peer did not start: {line!r}\n{self.log()}")
        self.address = line.split()[4].rstrip(":")
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def start_peers(
    log_dir: Path,
    n: int = 1,
    *,
    capacity: str = "16MiB",
    row_bytes: str = "64KiB",
    token: bytes | None = None,
    tenants: dict[str, bytes] | None = None,
    port: int = 0,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> list[PeerProcess]:
    """Start ``n`` peers at once (they boot in parallel) and wait until all listen.

    ``token``: a single-token file (it grants tenant ``default``); ``tenants``: a tenants
    file, ``tenant: token`` per entry."""
    args = ["--listen", f"{host}:{port}", "--capacity", capacity, "--row-bytes", row_bytes, *extra]
    if token is not None or tenants is not None:
        token_path = log_dir / f"token-{os.urandom(4).hex()}"
        if tenants is not None:
            token_path.write_bytes(b"".join(t.encode() + b": " + tok + b"\n" for t, tok in tenants.items()))
        else:
            assert token is not None
            token_path.write_bytes(token + b"\n")
        args += ["--token-file", str(token_path)]
    peers = []
    try:
        for _ in range(n):
            peers.append(PeerProcess(args, log_dir / f"peer-{os.urandom(4).hex()}.log", env))
        return [peer.wait_ready() for peer in peers]
    except BaseException:
        for peer in peers:
            peer.close()
        raise


def aligned_buffer(nbytes: int, align: int = 4096) -> np.ndarray:
    """Host memory for a tier, aligned as torch allocations are (CMA copies prefer it)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]


def key(n: int, group: int = 0, salt: bytes = b"") -> bytes:
    """An ``OffloadKey``-shaped key: a 32-byte block hash and a 4-byte big-endian group."""
    digest = (salt + n.to_bytes(8, "big")).ljust(32, b"\x00")[:32]
    return digest + group.to_bytes(4, "big")


class HostRows:
    """A host buffer cut into rows of given sizes, with ``src`` rows and ``dst`` rows."""

    def __init__(self, sizes: Sequence[int], seed: int = 0) -> None:
        self.sizes = list(sizes)
        total = sum(self.sizes)
        self.buffer = aligned_buffer(2 * total)
        rng = np.random.default_rng(seed)
        self.buffer[:total] = rng.integers(0, 256, total, dtype=np.uint8)
        view = memoryview(self.buffer)
        self.src: list[memoryview] = []
        self.dst: list[memoryview] = []
        offset = 0
        for size in self.sizes:
            self.src.append(view[offset : offset + size])
            self.dst.append(view[total + offset : total + offset + size])
            offset += size

    @property
    def view(self) -> memoryview:
        return memoryview(self.buffer)

    def clear_dst(self) -> None:
        self.buffer[sum(self.sizes) :] = 0

    def same(self, i: int) -> bool:
        return bytes(self.src[i]) == bytes(self.dst[i])


def remote_settings(addresses: Sequence[str], **keys: Any) -> RemoteSettings:
    """The settings of a remote tier over ``addresses`` (strings, as a TOML file has them)."""
    return RemoteSettings(capacity_bytes=1 << 30, peers=tuple(Address.parse(a) for a in addresses), **keys)


@contextlib.asynccontextmanager
async def open_tier(
    addresses: Sequence[str],
    host: memoryview,
    *,
    namespace: bytes = b"ns-test-0000000",
    tenant: str = "default",
    deadline_s: float = 2.0,
    checksum_thread: bool = True,
    **kwargs,
) -> AsyncIterator[RemoteTier]:
    """A ``RemoteTier`` over ``addresses``, opened on ``host``; ``kwargs`` go to its constructor."""
    tier = RemoteTier(
        remote_settings(
            addresses, peer_tenant=tenant, deadline_s=deadline_s, checksum_thread=checksum_thread
        ),
        namespace.ljust(16, b"\x00"),
        LAYOUT,
        **kwargs,
    )
    await tier.open(host)
    try:
        yield tier
    finally:
        await tier.close()


class RawAgent:
    """A client's NIXL agent for ``RawConnection``: a registered buffer, its metadata, and a
    thread that progresses the worker (a peer's transfers into it need that over UCX TCP,
    and so does the transport's wire-up). Only that thread touches the agent after setup."""

    def __init__(self, nbytes: int = 1 << 20, extra: Sequence[tuple[int, int]] = ()) -> None:
        """``extra``: more ``(address, length)`` regions to register (memory of the caller's)."""
        from tiers.remote.nixl_agent import create_agent

        self.buffer = np.zeros(nbytes, dtype=np.uint8)
        self.addr = self.buffer.ctypes.data
        self.name = f"kvtier-remote-raw-{os.urandom(6).hex()}"
        self.agent = create_agent(self.name)
        regions = [(self.addr, nbytes, 0, ""), *((a, n, 0, "") for a, n in extra)]
        self.agent.register_memory(regions, "DRAM")
        self.metadata = self.agent.get_agent_metadata()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._progress, daemon=True)
        self._thread.start()

    @property
    def probe_addr(self) -> int:
        return self.addr + len(self.buffer) - proto.PROBE_BYTES

    def write_probe(self, value: bytes) -> None:
        self.buffer[-proto.PROBE_BYTES :] = np.frombuffer(value, dtype=np.uint8)

    def _progress(self) -> None:
        while not self._stop.wait(0.0005):
            with contextlib.suppress(Exception):
                self.agent.get_new_notifs()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class RawConnection:
    """A blocking socket that speaks frames, for auth, fuzz and relay tests.

    After ``handshake`` it holds the session: ``request`` seals a frame and ``read_frame``
    verifies one (raising ``AuthenticationError`` on a bad tag), as a real client does;
    ``send`` writes raw bytes, sealed or not.
    """

    def __init__(self, port: int, timeout: float = 2.0, host: str = "127.0.0.1", source: str = "") -> None:
        self.sock = socket.create_connection(
            (host, port), timeout=timeout, source_address=(source, 0) if source else None
        )
        self.sock.settimeout(timeout)
        self.session: proto.Session | None = None

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, msg: proto.Msg, request_id: int, payload: bytes = b"") -> None:
        assert self.session is not None, "handshake first"
        self.send(self.session.seal(msg, request_id, payload))

    def _exact(self, n: int) -> bytes | None:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                return None
            out += chunk
        return out

    def read_frame(self) -> proto.Frame | None:
        """The next frame, or ``None`` when the peer closed the connection."""
        head = self._exact(4)
        if head is None:
            return None
        (length,) = struct.unpack("<I", head)
        body = self._exact(length)
        if body is None:
            return None
        if self.session is not None:
            body = self.session.open(body)
        msg_type, request_id = struct.unpack_from("<BI", body)
        return proto.Frame(proto.Msg(msg_type), request_id, body[5:])

    def closed_by_peer(self) -> bool:
        """Whether the peer closed (reads EOF, skipping any frames it sent first)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if self.read_frame() is None:
                    return True
            except (ConnectionResetError, ValueError):
                return True
            except TimeoutError:  # nothing to read yet: still open
                continue
        return False

    def handshake(
        self, token: bytes | None, tenant: str = proto.DEFAULT_TENANT, agent: RawAgent | None = None
    ) -> proto.Welcome | None:
        """Authenticate as ``tenant``; the WELCOME, or ``None`` if the peer closed instead (or
        refused: over a connection cap). With ``agent``, announce it too (AGENT, then READY),
        so requests may follow."""
        challenge = self.read_frame()
        assert challenge is not None and challenge.type == proto.Msg.CHALLENGE
        proto.decode_challenge(challenge.payload)
        auth = proto.encode_auth_body(os.urandom(proto.NONCE_BYTES), tenant)
        transcript = challenge.payload + auth
        self.send(proto.encode_frame(proto.Msg.AUTH, 0, auth + proto.client_mac(token or b"", transcript)))
        self.session = proto.Session(token or b"", transcript, is_client=True)
        try:
            frame = self.read_frame()
        except ConnectionResetError:
            frame = None
        if frame is None or frame.type == proto.Msg.ERROR:  # closed, or refused (a cap)
            self.session = None
            return None
        assert frame.type == proto.Msg.WELCOME
        welcome = proto.decode_welcome(frame.payload)
        if agent is not None:
            agent.write_probe(self.session.probe_value)
            self.request(proto.Msg.AGENT, 0, proto.encode_agent(agent.probe_addr, agent.metadata))
            ready = self.read_frame()
            assert ready is not None and ready.type == proto.Msg.READY, ready
        return welcome
