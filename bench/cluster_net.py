"""A cluster simulated on one machine: hosts as network namespaces on one Linux bridge.

Every remote test on 127.0.0.1 lets UCX move rows through shared memory or CMA, so nothing
measures (or breaks) a network. Here each host is a network namespace with one veth pair:
its inside end is ``eth0`` (address ``10.77.K.(i+2)/24``), its outside end a port of the
bridge. The machine's own namespace (the test or benchmark process, an engine) is one more
host on the same wire, at ``10.77.K.1`` on a veth of its own (``Cluster.nic``), as a real
engine has a NIC (UCX ignores bridge devices unless ``UCX_TCP_BRIDGE_ENABLE=y``). ``K`` is
a /24 no route of this machine uses yet, so concurrent clusters (of this or another process)
do not collide.

Faults are set on a host's bridge port, so they act on that host's traffic only:

- ``set_rate``: a ``tbf`` qdisc on both ends of the veth (each direction limited);
- ``set_loss``: a classic-BPF ``clsact`` filter (direct action) that drops a random fraction
  (this kernel has no ``netem`` and no ``gact``: a BPF program returning ``TC_ACT_SHOT`` is
  how a packet is dropped);
- ``cut``: every packet to and from the host dropped; ``partition(host, "in"|"out")``: one
  direction only; ``heal`` removes them (``clear`` removes every fault of a host);
- ``set_delay``: every frame to and from the host ``delay_ms`` late, through a userspace
  relay (``bench/cluster_delay.py``: no ``netem`` here), which also caps the link at what
  one Python process relays;
- ``HostProcess.kill``/``stop``/``cont``: SIGKILL, SIGSTOP, SIGCONT of a process in a host.

``Cluster`` is a context manager: whatever ends the ``with`` (an exception, a failed test,
KeyboardInterrupt), its processes are killed and its namespaces and bridge deleted; every
child also dies with this process (``PR_SET_PDEATHSIG``). A process killed harder than that
leaves namespaces behind; their names carry the creating process's pid, and ``sweep()``
(run by every new ``Cluster``) deletes those whose creator is gone.

``probe()`` says why this machine cannot run a cluster (not root, no ``ip``/``tc``,
namespaces refused), or ``None``: tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.child_process import Faultable

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "kvt"
SUBNET_BASE = "10.77"  # 10.77.K.0/24, K chosen free per cluster
PEER_PORT = 7070
READY_TIMEOUT_S = 60.0
_LOCK_PATH = "/run/kvtier-cluster.lock"
_NAME = re.compile(rf"^{PREFIX}-?([0-9a-f]+)x")  # the creator's pid, in hex, then "x"
_counter = itertools.count()
_TC_ACT_OK, _TC_ACT_SHOT = 0, 2
_PRCTL = ctypes.CDLL(None).prctl
_PR_SET_PDEATHSIG = 1


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a simulated cluster (``probe()`` says why)."""


def _die_with_parent() -> None:
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterUnavailable(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


_probed: list[str | None] = []


def probe() -> str | None:
    """Why a cluster cannot run here (``None``: it can). Tried once per process: a namespace,
    a veth pair into it and a ``tc`` filter are made and removed."""
    if _probed:
        return _probed[0]
    reason: str | None = None
    if sys.platform != "linux":
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0:
        reason = "network namespaces need root"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "`ip` or `tc` (iproute2) is not installed"
    else:
        tag = f"{PREFIX}-{os.getpid():x}xp"
        dev = f"{PREFIX}{os.getpid():x}xpr"
        try:
            _run("ip", "netns", "add", tag)
            _run("ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", tag)
            _run("tc", "qdisc", "add", "dev", dev, "clsact")
            _run(
                "tc",
                "filter",
                "add",
                "dev",
                dev,
                "egress",
                "pref",
                "9",
                "bpf",
                "da",
                "bytecode",
                "1,6 0 0 0,",
            )
        except (ClusterUnavailable, OSError, subprocess.SubprocessError) as exc:
            reason = f"cannot build a namespace with a veth and a tc filter: {exc}"
        finally:
            _run("ip", "link", "del", dev, check=False)
            _run("ip", "netns", "del", tag, check=False)
    _probed.append(reason)
    return reason


def sweep() -> int:
    """Delete namespaces and links left by clusters whose creating process is gone (a
    crashed run); the number of things deleted."""
    if probe() is not None:
        return 0
    removed = 0
    for ns in _run("ip", "netns", "list", check=False).stdout.split():
        if _orphan(ns):
            _kill_in(ns)
            _run("ip", "netns", "del", ns, check=False)
            removed += 1
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            dev = parts[1].strip().split("@")[0]
            if _orphan(dev):
                _run("ip", "link", "del", dev, check=False)
                removed += 1
    if removed:
        log.warning("swept %d namespaces and links of crashed clusters", removed)
    return removed


def _orphan(name: str) -> bool:
    match = _NAME.match(name)
    return match is not None and not Path(f"/proc/{int(match.group(1), 16)}").exists()


def _kill_in(ns: str) -> None:
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGCONT)
            os.kill(int(pid), signal.SIGKILL)


def _loss_program(fraction: float) -> str:
    """Classic BPF (tc's ``bytecode`` syntax): drop a packet with probability ``fraction``."""
    threshold = min(int(fraction * 2**32), 2**32 - 1)
    random = 2**32 - 0x1000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM: a random 32-bit number
    return (
        f"4,32 0 0 {random},53 1 0 {threshold},6 0 0 {_TC_ACT_SHOT},6 0 0 {_TC_ACT_OK},"
        # ld rand; jge threshold -> pass; ret shot; ret ok
    )


_DROP_ALL = f"1,6 0 0 {_TC_ACT_SHOT},"
FAULTS = ("killed", "stopped", "cut", "partition-in", "partition-out", "slow")
"""What ``Cluster.inflict`` does to a host: SIGKILL or SIGSTOP its process, drop all its
traffic, only what goes to it (``in``) or comes from it (``out``), or limit its link to
``SLOW_RATE`` each way."""
SLOW_RATE = "200kbit"


@dataclass
class Host:
    """One simulated host: a namespace whose ``eth0`` holds ``address``."""

    index: int
    netns: str
    address: str
    port_dev: str  # the veth end on the bridge, in this machine's namespace

    def peer_address(self, port: int = PEER_PORT) -> str:
        return f"{self.address}:{port}"


class HostProcess(Faultable):
    """A process started in a host; its stderr goes to ``log_path``, and so does its stdout
    unless ``interactive`` (then ``request`` speaks JSON lines over stdin and stdout)."""

    def __init__(
        self, host: Host, argv: Sequence[str], log_path: Path, env: dict[str, str], interactive: bool = False
    ) -> None:
        self.host = host
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in close())
        self._start = self._log.tell()  # a log kept from an earlier run says nothing of this one
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, *argv],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE if interactive else subprocess.DEVNULL,
            stdout=subprocess.PIPE if interactive else self._log,
            stderr=self._log,
            text=True,
            preexec_fn=_die_with_parent,
        )

    def read_json(self, timeout: float) -> dict:
        """The next line of an interactive process's stdout, parsed (raises if none comes in time)."""
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if readable else ""
        if not line:
            raise RuntimeError(f"{self.argv[:4]} in {self.host.netns}: no answer\n{self.log()[-4000:]}")
        return json.loads(line)

    def request(self, message: dict, timeout: float = 60.0) -> dict:
        """Send one JSON line, return the answer line (an ``error`` in it raises)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        answer = self.read_json(timeout)
        if "error" in answer:
            raise RuntimeError(f"{message}: {answer['error']}")
        return answer

    @property
    def pid(self) -> int:
        return self.proc.pid  # ``ip netns exec`` execs the command: this is its pid

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as log_file:
            log_file.seek(self._start)
            return log_file.read().decode(errors="replace")

    def wait_for(self, text: str, timeout: float = READY_TIMEOUT_S) -> str:
        """Wait until a line of the log holds ``text``; that line (raises if it exits first)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in self.log().splitlines():
                if text in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.argv[:4]} in {self.host.netns}: no {text!r}\n{self.log()[-4000:]}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process and its living children so far (a peer's
        tenant workers are its children; ``/proc/PID/stat``)."""
        ticks = 0
        for pid in [self.pid, *_children(self.pid)]:
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._log.close()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return out


class Cluster:
    """``hosts`` namespaces on one bridge; see the module docstring. Use as a context manager."""

    def __init__(self, hosts: int, log_dir: Path | str, *, mtu: int | None = None) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"a cluster has 1..250 hosts, not {hosts}")
        self.size = hosts
        self.log_dir = Path(log_dir)
        self.mtu = mtu
        self._tag = f"{os.getpid():x}x{_base36(next(_counter))}"  # the pid lets sweep() find orphans
        self.bridge = f"{PREFIX}{self._tag}b"
        self.nic = f"{PREFIX}{self._tag}e"  # this namespace's interface on the bridge
        self._nic_port = f"{PREFIX}{self._tag}q"
        self.hosts: list[Host] = []
        self.subnet = ""
        self.address = ""  # this machine's address on the bridge
        self._processes: list[HostProcess] = []
        self._relays: dict[int, tuple[subprocess.Popen, str]] = {}  # host index -> relay, its veth
        self._up = False

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        reason = probe()
        if reason is not None:
            raise ClusterUnavailable(reason)
        sweep()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            with open(_LOCK_PATH, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # choosing a free /24 and taking it is one step
                self.subnet = _free_subnet()
                self.address = f"{self.subnet}.1"
                self._up = True
                _run("ip", "link", "add", self.bridge, "type", "bridge")
                _run("ip", "link", "add", self.nic, "type", "veth", "peer", "name", self._nic_port)
                _run("ip", "addr", "add", f"{self.address}/24", "dev", self.nic)
            for dev in (self.bridge, self.nic, self._nic_port):
                if self.mtu:
                    _run("ip", "link", "set", dev, "mtu", str(self.mtu))
            _run("ip", "link", "set", self._nic_port, "master", self.bridge)
            for dev in (self.bridge, self._nic_port, self.nic):
                _run("ip", "link", "set", dev, "up")
            for i in range(self.size):
                self.hosts.append(self._add_host(i))
        except BaseException:
            self.close()
            raise
        log.info("cluster %s: %d hosts on %s.0/24", self._tag, self.size, self.subnet)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _add_host(self, i: int) -> Host:
        host = Host(i, f"{PREFIX}-{self._tag}-h{i}", f"{self.subnet}.{i + 2}", f"{PREFIX}{self._tag}p{i}")
        _run("ip", "netns", "add", host.netns)
        _run("ip", "link", "add", host.port_dev, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _run("ip", "link", "set", host.port_dev, "master", self.bridge)
        if self.mtu:
            _run("ip", "link", "set", host.port_dev, "mtu", str(self.mtu))
            _run("ip", "-n", host.netns, "link", "set", "eth0", "mtu", str(self.mtu))
        _run("ip", "link", "set", host.port_dev, "up")
        _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        _run("tc", "qdisc", "add", "dev", host.port_dev, "clsact")
        return host

    def close(self) -> None:
        """Kill every process, delete every namespace and the bridge (idempotent)."""
        for process in self._processes:
            with contextlib.suppress(Exception):
                process.close()
        self._processes.clear()
        for host in self.hosts:
            with contextlib.suppress(Exception):
                self.clear_delay(host)
        for host in self.hosts:
            _kill_in(host.netns)
            _run("ip", "netns", "del", host.netns, check=False)
            _run("ip", "link", "del", host.port_dev, check=False)
        self.hosts.clear()
        if self._up:
            _run("ip", "link", "del", self.nic, check=False)  # its bridge port goes with it
            _run("ip", "link", "del", self.bridge, check=False)
            self._up = False

    # -- processes ------------------------------------------------------------------------

    def start(
        self, host: Host, argv: Sequence[str], *, env: dict[str, str] | None = None, interactive: bool = False
    ) -> HostProcess:
        """Start ``argv`` in ``host`` (cwd: the repository; env: this process's, plus ``env``).

        This process's ``UCX_*`` settings are left out (another host is another machine: a
        test's ``UCX_NET_DEVICES=lo`` would bind a peer to its loopback); ``env`` may set them.
        """
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("UCX_") or k == "UCX_MODULES"}
        full_env = {**inherited, "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1", **(env or {})}
        name = f"h{host.index}-{Path(argv[0]).name}-{len(self._processes)}.log"
        process = HostProcess(host, argv, self.log_dir / name, full_env, interactive)
        self._processes.append(process)
        return process

    def start_peer(
        self,
        host: Host,
        *,
        capacity: str = "64MiB",
        row_bytes: str = "256KiB",
        port: int = PEER_PORT,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> HostProcess:
        """A ``kvtier peer`` listening on ``host``'s address (``wait``: until it says so)."""
        argv = [
            sys.executable,
            "-m",
            "offload.cli",
            "peer",
            "--listen",
            host.peer_address(port),
            "--capacity",
            capacity,
            "--row-bytes",
            row_bytes,
            *extra,
        ]
        process = self.start(host, argv, env=env)
        if wait:
            process.wait_for("kvtier peer listening on")
        return process

    def start_engine(
        self,
        host: Host,
        peers: Sequence[Host],
        *,
        port: int = PEER_PORT,
        module: str = "bench.cluster_engine",
        **options: object,
    ) -> HostProcess:
        """An engine in ``host`` answering JSON requests: ``bench/cluster_engine.py`` (a
        ``RemoteTier`` over ``peers``) or another ``module`` that takes ``--peers``
        (``bench.cluster_offloader``); ``options`` are its flags (``rows=64`` -> ``--rows
        64``). Returns once it says it is ready."""
        argv = [sys.executable, "-m", module, "--peers"]
        argv.append(",".join(peer.peer_address(port) for peer in peers))
        for name, value in options.items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
        process = self.start(host, argv, interactive=True)
        ready = process.read_json(READY_TIMEOUT_S)
        if not ready.get("ready"):
            raise RuntimeError(f"engine in {host.netns} did not start: {ready}")
        return process

    def start_peers(self, hosts: Sequence[Host] | None = None, **kwargs) -> list[HostProcess]:
        """A peer on each of ``hosts`` (default: all), started together, then waited for."""
        processes = [self.start_peer(host, wait=False, **kwargs) for host in (hosts or self.hosts)]
        for process in processes:
            process.wait_for("kvtier peer listening on")
        return processes

    # -- faults ---------------------------------------------------------------------------

    def set_rate(self, host: Host, rate: str, *, latency: str = "50ms") -> None:
        """Limit ``host``'s link to ``rate`` (``200kbit``, ``100mbit``, ``1gbit``) each way.

        The bucket holds 10 ms of the rate, at least 16 KiB (a few full frames): a large
        one would let the first rows through at full speed (256 KiB at 200 kbit/s did)."""
        burst = str(max(16 << 10, bits_per_second(rate) // 8 // 100))
        for prefix in ([], ["-n", host.netns]):
            dev = host.port_dev if not prefix else "eth0"
            _run("tc", *prefix, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                 "latency", latency)  # fmt: skip

    def clear_rate(self, host: Host) -> None:
        _run("tc", "qdisc", "del", "dev", host.port_dev, "root", check=False)
        _run("tc", "-n", host.netns, "qdisc", "del", "dev", "eth0", "root", check=False)

    def set_loss(self, host: Host, fraction: float) -> None:
        """Drop ``fraction`` of the packets to and from ``host`` (each independently)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"loss must be within 0..1, not {fraction}")
        for direction in ("ingress", "egress"):
            self._filter(host, direction, 20, _loss_program(fraction))

    def cut(self, host: Host) -> None:
        """``host``'s cable pulled: nothing reaches it, nothing leaves it (sockets stay open)."""
        self.partition(host, "in")
        self.partition(host, "out")

    def partition(self, host: Host, direction: str) -> None:
        """Drop one direction of ``host``'s traffic: ``in`` (to it) or ``out`` (from it)."""
        if direction not in ("in", "out"):
            raise ValueError(f"direction is 'in' or 'out', not {direction!r}")
        # On the bridge port, egress carries traffic to the host, ingress traffic from it.
        self._filter(host, "egress" if direction == "in" else "ingress", 10, _DROP_ALL)

    def heal(self, host: Host) -> None:
        """Undo ``cut``/``partition``."""
        for direction in ("ingress", "egress"):
            _run("tc", "filter", "del", "dev", host.port_dev, direction, "pref", "10", check=False)

    def set_delay(self, host: Host, delay_ms: float) -> None:
        """Delay every frame to and from ``host`` by ``delay_ms`` (so a round trip by twice
        that): its bridge port leaves the bridge, and a relay (``bench/cluster_delay.py``)
        carries its frames to a veth on the bridge and back, each ``delay_ms`` late. Faults
        on the port (rate, loss, cut) still apply."""
        self.clear_delay(host)
        relay_dev, bridge_dev = f"{PREFIX}{self._tag}r{host.index}", f"{PREFIX}{self._tag}d{host.index}"
        _run("ip", "link", "set", host.port_dev, "nomaster")
        _run("ip", "link", "add", relay_dev, "type", "veth", "peer", "name", bridge_dev)
        _run("ip", "link", "set", bridge_dev, "master", self.bridge)
        for dev in (relay_dev, bridge_dev):
            if self.mtu:
                _run("ip", "link", "set", dev, "mtu", str(self.mtu))
            _run("ip", "link", "set", dev, "up")
        relay = subprocess.Popen(
            [sys.executable, "-m", "bench.cluster_delay", host.port_dev, relay_dev, str(delay_ms)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent,
        )
        self._relays[host.index] = (relay, relay_dev)
        assert relay.stdout is not None
        readable, _, _ = select.select([relay.stdout], [], [], READY_TIMEOUT_S)
        if not readable or "relaying" not in relay.stdout.readline():
            self.clear_delay(host)
            raise ClusterUnavailable(f"the delay relay for {host.netns} did not start")

    def clear_delay(self, host: Host) -> None:
        """Undo ``set_delay``: the relay stops, the port is on the bridge again."""
        relay, relay_dev = self._relays.pop(host.index, (None, ""))
        if relay is None:
            return
        relay.kill()
        relay.wait(10)
        if relay.stdout is not None:
            relay.stdout.close()
        _run("ip", "link", "del", relay_dev, check=False)  # its peer on the bridge goes with it
        _run("ip", "link", "set", host.port_dev, "master", self.bridge, check=False)

    def clear(self, host: Host) -> None:
        """Remove every fault of ``host``: rate, loss, delay, cut, partition."""
        self.clear_delay(host)
        self.heal(host)
        for direction in ("ingress", "egress"):
            _run("tc", "filter", "del", "dev", host.port_dev, direction, "pref", "20", check=False)
        self.clear_rate(host)

    def inflict(self, host: Host, process: HostProcess, fault: str) -> None:
        """One of ``FAULTS`` on ``host`` (whose ``process`` a ``killed``/``stopped`` is for)."""
        if fault == "killed":
            process.kill()
        elif fault == "stopped":
            process.stop()
        elif fault == "cut":
            self.cut(host)
        elif fault.startswith("partition-"):
            self.partition(host, fault.removeprefix("partition-"))
        elif fault == "slow":
            self.set_rate(host, SLOW_RATE)
        else:
            raise ValueError(f"fault is one of {FAULTS}, not {fault!r}")

    def _filter(self, host: Host, direction: str, pref: int, program: str) -> None:
        _run("tc", "filter", "del", "dev", host.port_dev, direction, "pref", str(pref), check=False)
        _run("tc", "filter", "add", "dev", host.port_dev, direction, "pref", str(pref), "bpf", "da",
             "bytecode", program)  # fmt: skip

    # -- counters -------------------------------------------------------------------------

    def wire_bytes(self, host: Host) -> tuple[int, int]:
        """Bytes that went ``(to, from)`` ``host`` over its link (its bridge port's counters)."""
        stats = Path(f"/sys/class/net/{host.port_dev}/statistics")
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def bits_per_second(rate: str) -> int:
    """``200kbit`` -> 200000 (units: bit, kbit, mbit, gbit; tc's meaning, powers of 1000)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r}: a number and bit, kbit, mbit or gbit")
    return int(float(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)])


def _base36(n: int) -> str:
    return "0123456789abcdefghijklmnopqrstuvwxyz"[n % 36]


def _free_subnet() -> str:
    """``10.77.K`` for the lowest K no address or route of this namespace is in."""
    taken = (
        _run("ip", "-4", "route", "show", check=False).stdout + _run("ip", "-4", "addr", check=False).stdout
    )
    for k in range(256):
        if f"{SUBNET_BASE}.{k}." not in taken:
            return f"{SUBNET_BASE}.{k}"
    raise ClusterUnavailable(f"every {SUBNET_BASE}.K.0/24 is in use")
