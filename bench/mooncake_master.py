"""A local ``mooncake_master`` on 127.0.0.1: for tests, benchmarks, and trying the tier on one machine.

The master is the binary inside the installed ``mooncake`` package. It listens for RPC on a
free port (and its admin/metrics server on another), both bound to 127.0.0.1; clients find
each other with ``P2PHANDSHAKE``, so no HTTP metadata server runs (the master's own binds
0.0.0.0 whatever its host flag says). ``restart`` brings a killed master back on the same
port, as an operator would. Whoever starts a master must ``close()`` it. A production
cluster runs its masters (with HA) itself; kvtier only needs their address.
``StorageProcess`` runs Mooncake's storage-only client beside it (a storage host).
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from bench.child_process import Faultable

READY_TIMEOUT_S = 30.0


def master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise RuntimeError("the mooncake package is not installed")
    return Path(spec.origin).parent / "mooncake_master"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def master_argv(host: str, port: int, lease_ms: int) -> list[str]:
    """The command line of a master whose RPC port is ``host:port`` (P2P handshakes: no
    metadata server; its metrics server on the loopback)."""
    return [
        str(master_binary()),
        f"--rpc_port={port}",
        f"--rpc_address={host}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={free_port()}",
        f"--default_kv_lease_ttl={lease_ms}",
        "--rpc_thread_num=2",
    ]


def _wait_listening(process, host: str, port: int, what: str) -> None:
    """Until ``process.proc`` accepts connections on ``host:port``; closed and ``RuntimeError``
    if it exits or does not within ``READY_TIMEOUT_S``."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({process.proc.returncode}):\n{process.log()}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
            return
        time.sleep(0.05)
    process.close()
    raise RuntimeError(f"{what} did not listen on {host}:{port}:\n{process.log()}")


class MasterProcess(Faultable):
    """One ``mooncake_master`` child, logging to ``log_path``.

    ``lease_ms``: how long an object stays unevictable after a put or a get (the master's
    default, 10 s, makes eviction slow to observe). ``preexec_fn``: run in the child before
    the binary (e.g. to die with the parent). ``host``: the address its RPC port is bound to
    (another one of this machine's, or of a network namespace's, to be reached off the loopback).
    """

    def __init__(
        self,
        log_path: Path,
        *,
        lease_ms: int = 300,
        preexec_fn: Callable[[], None] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.port = free_port()
        self.address = f"{host}:{self.port}"
        self.log_path = log_path
        self.lease_ms = lease_ms
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen | None = None  # type: ignore[assignment]  # set by start()
        self.start()

    def start(self) -> None:
        args = master_argv(self.host, self.port, self.lease_ms)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=self.preexec_fn
            )
        _wait_listening(self, self.host, self.port, "mooncake_master")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """Freeze the master (SIGSTOP): it keeps its port, and answers nothing; returns once
        every thread of it is stopped."""
        super().stop()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # stopped only once every thread of it is
            with open(f"/proc/{self.proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.01)

    def restart(self) -> None:
        self.start()

    def close(self) -> None:
        if self.proc is not None:
            self.kill()


class StorageProcess(Faultable):
    """One ``mooncake_client`` child: Mooncake's own storage-only client, which mounts a
    ``segment_bytes`` segment of its memory into the pool of the master at ``master`` and
    serves it at ``host`` (its ``local_hostname``). What a storage host runs in a cluster;
    tests freeze (``stop``), resume and kill it. Whoever starts one must ``close()`` it."""

    def __init__(
        self,
        log_path: Path,
        master: str,
        *,
        segment_bytes: int = 64 << 20,
        host: str = "127.0.0.1",
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.host = host
        self.port = free_port()  # its own service port: open once the segment is mounted
        self.log_path = log_path
        args = [
            str(master_binary().parent / "mooncake_client"),
            f"--host={host}",
            f"--port={self.port}",
            f"--global_segment_size={segment_bytes}",
            "--local_buffer_size=16MB",
            f"--master_server_address={master}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
        ]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, preexec_fn=preexec_fn)
        _wait_listening(self, host, self.port, "mooncake_client")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        self.kill()
