"""A real ``mooncake_master`` for tests, on 127.0.0.1 only, and tiers that join it.

The master is the binary inside the installed ``mooncake`` package. It listens for RPC on a
free port (and its admin/metrics server on another), both bound to 127.0.0.1; clients find
each other with ``P2PHANDSHAKE``, so no HTTP metadata server runs (the master's binds
0.0.0.0 whatever its host flag says). ``restart`` brings a killed master back on the same
port, as an operator would. Whoever starts a master must ``close()`` it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tests.tiers.peer_fixtures import LAYOUT, die_with_parent
from tiers.mooncake import MooncakeTier

READY_TIMEOUT_S = 30.0
SEGMENT = 32 << 20


def master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.origin is not None, "the mooncake package is not installed"
    return Path(spec.origin).parent / "mooncake_master"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MasterProcess:
    """One ``mooncake_master`` child; ``lease_ms`` is how long objects stay unevictable after
    a put or get (the default 10 s would make eviction tests slow)."""

    def __init__(self, log_dir: Path, *, lease_ms: int = 300) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"master-{self.port}.log"
        self.lease_ms = lease_ms
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [
            str(master_binary()),
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}",
            f"--default_kv_lease_ttl={self.lease_ms}",
            "--rpc_thread_num=2",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=die_with_parent
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited ({self.proc.returncode}):\n{self.log()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"mooncake_master did not listen on {self.address}:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def restart(self) -> None:
        self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.asynccontextmanager
async def open_tier(
    master: MasterProcess, host: memoryview, *, namespace: bytes = b"ns-mooncake", **kwargs
) -> AsyncIterator[MooncakeTier]:
    kwargs.setdefault("segment_bytes", SEGMENT)
    kwargs.setdefault("local_buffer_bytes", 16 << 20)
    tier = MooncakeTier(master.address, namespace.ljust(16, b"\x00"), LAYOUT, **kwargs)
    await tier.open(host)
    try:
        yield tier
    finally:
        await tier.close()
