"""``kvtier bench cluster``: the remote tier across simulated hosts, against raw NIXL over the
same links, at rest, and when one host fails.

Every host is a network namespace on one bridge (``bench/cluster_net.py``); the engine
(``bench/cluster_engine.py``: a ``RemoteTier``) runs on a host of its own, so UCX moves
the rows over the veth links by TCP (kvtier sets ``UCX_TLS``/``UCX_NET_DEVICES`` from the
peers' addresses). Three parts, each skippable:

- **throughput**, per peer count of ``--hosts``: put and get GB/s of ``--rows`` rows
  through the tier, against raw NIXL WRITE/READ of the same rows spread over the same hosts
  (a bare agent on each peer host, one request per host, all posted at once). Only one
  side runs at a time: the other side's processes are SIGSTOPped, so neither pays for the
  other's polling (and nothing is timed until ``SETTLE_S`` after a switch). Medians of
  ``--repeats`` interleaved rounds; every get is checked byte for byte. ``scaling``: each
  count's GB/s over the ``--scaling-base`` count's (target: 16 peers within 20% of 4).
  ``peer_cores_during_tier``: the peer processes' CPU while the tier's calls ran.
- **idle**: ``--idle-peers`` peers with a connected engine that sends nothing: the CPU of
  all the peer processes together over ``--idle-s`` seconds, in cores (target under 0.05).
- **membership** (``bench/cluster_membership.py``): ``--membership`` peers killed, cut,
  leaving and joining under a steady load: rows lost per event against the share of the
  peer that went or came, the slowest get, the load balance, and a timeline plot.
- **faults**: per fault of ``cluster_net.FAULTS``, an engine and three peers, one of which
  fails after the rows went in; the first get after it: its deadline, how long it took, rows
  missed against the victim's share, and which hosts the tier's warnings named.
- **vllm** (``bench/cluster_vllm.py``, off unless ``--vllm-peers N``; needs vLLM's CPU build or
  a GPU): a real vLLM engine's time to first token for a prefix served by N peers across the
  bridge, against the same engine computing it.

Figures from this machine share its cores with every simulated host: read the ratios, not
the GB/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import cluster_membership, cluster_vllm
from bench.cluster_net import FAULTS, Cluster, HostProcess, probe
from bench.report import write_json
from tiers.sizes import parse_size

QUIET_S = 3.0
"""How long the peers are left alone before their idle CPU is read (after the handshakes)."""

SCALING_TARGET = 0.8  # GB/s at 16 peers over GB/s at 4
IDLE_TARGET = 0.05  # cores, all idle peers together


def _hosts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part]  # '': no throughput part
    if counts and min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: peer counts, comma-separated, each >= 1")
    return counts


def _gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


SETTLE_S = 0.3
"""After one side is stopped and the other continued, this long passes before anything is
timed: 16 processes woken at once first run their overdue timers."""


def _switch(stop: list[HostProcess], cont: list[HostProcess]) -> None:
    for process in stop:
        process.stop()
    for process in cont:
        process.cont()
    time.sleep(SETTLE_S)


def throughput(peers: int, args: argparse.Namespace, log_dir: Path) -> dict:
    """Tier and raw GB/s with ``peers`` peer hosts (see the module docstring)."""
    rows, row_bytes = args.rows, args.row_bytes
    with Cluster(peers + 1, log_dir / f"throughput-{peers}") as cluster:
        engine_host, *peer_hosts = cluster.hosts
        capacity = 3 * rows * row_bytes // peers + 4 * row_bytes  # three rounds' share, then LRU
        tier_side = cluster.start_peers(peer_hosts, capacity=str(capacity), row_bytes=str(row_bytes))
        raw_side = [
            cluster.start(
                host,
                [sys.executable, "-m", "bench.remote", "--raw-target", str(-(-rows // peers) * row_bytes)],
                env={"UCX_NET_DEVICES": "eth0"},
                interactive=True,
            )
            for host in peer_hosts
        ]
        lines = []
        for process in raw_side:
            assert process.proc.stdout is not None
            lines.append(process.proc.stdout.readline().strip())
        engine = cluster.start_engine(engine_host, peer_hosts, rows=rows, row_bytes=row_bytes)
        if len(engine.request({"op": "state"})["peers_up"]) != peers:
            raise RuntimeError(f"not every one of {peers} peers is up")
        engine.request({"op": "raw_connect", "targets": lines})
        times: dict[str, list[float]] = {"raw_write": [], "put": [], "raw_read": [], "get": []}
        peer_cpu = tier_wall = 0.0
        for repeat in range(args.repeats + 1):  # round 0 warms up (wire-up, page faults)
            salt = f"r{repeat}"
            _switch(stop=tier_side, cont=raw_side)
            raw_write = engine.request({"op": "raw", "dir": "WRITE"})["elapsed_s"]
            raw_read = engine.request({"op": "raw", "dir": "READ"})["elapsed_s"]
            _switch(stop=raw_side, cont=tier_side)
            cpu_before, wall_before = sum(p.cpu_seconds() for p in tier_side), time.monotonic()
            put = engine.request({"op": "put", "salt": salt})
            get = engine.request({"op": "get", "salt": salt})
            if repeat:
                peer_cpu += sum(p.cpu_seconds() for p in tier_side) - cpu_before
                tier_wall += time.monotonic() - wall_before
            if not all(put["result"]) or not all(get["result"]) or not get["exact"]:
                raise RuntimeError(f"{peers} peers: a row was not stored or not read back intact")
            if repeat:
                for name, seconds in (
                    ("raw_write", raw_write),
                    ("raw_read", raw_read),
                    ("put", put["elapsed_s"]),
                    ("get", get["elapsed_s"]),
                ):
                    times[name].append(seconds)
        _switch(stop=[], cont=raw_side)  # nothing is left stopped for the teardown
        wire = sum(cluster.wire_bytes(host)[0] for host in peer_hosts)
    nbytes = rows * row_bytes
    gbps = {name: _gbps(nbytes, t) for name, t in times.items()}
    return {
        "peers": peers,
        "put_gbps": gbps["put"],
        "get_gbps": gbps["get"],
        "raw_write_gbps": gbps["raw_write"],
        "raw_read_gbps": gbps["raw_read"],
        "put_ratio": gbps["put"] / gbps["raw_write"],
        "get_ratio": gbps["get"] / gbps["raw_read"],
        "bytes_to_peer_hosts": wire,  # over the links: proof the rows crossed them
        # the peer processes' CPU while the tier's puts and gets ran (polling included), in cores
        "peer_cores_during_tier": peer_cpu / tier_wall if tier_wall else 0.0,
    }


def idle(peers: int, seconds: float, log_dir: Path) -> dict:
    """CPU of ``peers`` idle peers whose client is connected, in cores."""
    with Cluster(peers + 1, log_dir / "idle") as cluster:
        engine_host, *peer_hosts = cluster.hosts
        processes = cluster.start_peers(peer_hosts, capacity="4MiB", row_bytes="64KiB")
        engine = cluster.start_engine(engine_host, peer_hosts, rows=8, row_bytes="64KiB")
        up = len(engine.request({"op": "state"})["peers_up"])
        time.sleep(QUIET_S)  # the handshakes are over
        before, began = sum(p.cpu_seconds() for p in processes), time.monotonic()
        time.sleep(seconds)
        used, elapsed = sum(p.cpu_seconds() for p in processes) - before, time.monotonic() - began
        engine_cpu = engine.cpu_seconds()
        answer = engine.request({"op": "put", "salt": "after-idle"})  # still serving
        served = sum(answer["result"])
    return {
        "peers": peers,
        "peers_up": up,
        "seconds": elapsed,
        "cores": used / elapsed,
        "target_cores": IDLE_TARGET,
        "engine_cpu_s": engine_cpu,
        "rows_put_after": served,
    }


def fault(name: str, deadline_s: float, log_dir: Path) -> dict:
    """The first get after one of three peers suffers ``name``."""
    rows = 48
    with Cluster(4, log_dir / f"fault-{name}") as cluster:
        engine_host, victim, *healthy = cluster.hosts
        peers = cluster.start_peers([victim, *healthy], capacity="16MiB", row_bytes="64KiB")
        engine = cluster.start_engine(
            engine_host, [victim, *healthy], rows=rows, row_bytes="64KiB", deadline_s=deadline_s
        )
        if not all(engine.request({"op": "put", "salt": "before"})["result"]):
            raise RuntimeError("the rows did not go in before the fault")
        owners = engine.request({"op": "owners", "salt": "before"})["result"]
        engine.request({"op": "state", "clear": True})
        cluster.inflict(victim, peers[0], name)
        answer = engine.request({"op": "get", "salt": "before"})
        state = engine.request({"op": "state"})
        named = sorted(
            {
                host.peer_address()
                for host in cluster.hosts
                if any(host.peer_address() in warning for warning in state["warnings"])
            }
        )
    return {
        "fault": name,
        "deadline_s": deadline_s,
        "took_s": answer["elapsed_s"],
        "rows": rows,
        "rows_missed": answer["result"].count(False),
        "victims_rows": owners.count(victim.peer_address()),
        "exact": answer["exact"],
        "host_at_fault": victim.peer_address(),
        "hosts_named": named,
        "peers_up_after": len(state["peers_up"]),
    }


def _vllm(args: argparse.Namespace, log_dir: Path) -> dict | None:
    """The vLLM engine's TTFT run, printed; ``None`` (and why) where no engine runs here."""
    from bench.serve import engine_missing, engine_version

    missing = engine_missing()
    if missing:
        print(f"vllm: skipped: {missing}")
        return None
    fig = cluster_vllm.run(args.vllm_peers, args.vllm_rounds, args.vllm_tokens, log_dir)
    fig["engine"] = engine_version()
    print(
        f"vllm: {fig['engine']}, {fig['model']} ({fig['dtype']}), a {fig['prompt_tokens']}-token prefix"
        f" ({fig['rows_per_prefix']} rows) over {fig['peers']} peers, median of {fig['rounds']} documents:"
        f" TTFT computed {fig['computed_ttft_s']:.3f} s, from the peers {fig['peers_ttft_s']:.3f} s"
        f" ({fig['speedup']:.1f}x), device cache {fig['device_cache_ttft_s']:.3f} s;"
        f" {fig['bytes_from_peer_hosts'] / 1e6:.1f} MB came over the peers' links per prefix"
    )
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--hosts", type=_hosts, default=[1, 2, 4, 8, 16], help="peer counts (1,2,4,8,16)")
    parser.add_argument("--rows", type=int, default=64, help="rows per put/get (64)")
    parser.add_argument("--row-bytes", type=parse_size, default=256 << 10, help="bytes per row (256KiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per figure (median)")
    parser.add_argument("--scaling-base", type=int, default=4, help="the peer count scaling is against (4)")
    parser.add_argument("--idle-peers", type=int, default=32, help="peers of the idle measure (0: skip)")
    parser.add_argument("--idle-s", type=float, default=10.0, help="seconds the idle CPU is measured over")
    parser.add_argument("--faults", default=",".join(FAULTS), help="faults of the fault table ('': skip)")
    parser.add_argument(
        "--deadline-s", type=float, default=1.0, help="the tier's deadline in the fault table"
    )
    parser.add_argument("--membership", type=int, default=16, help="peers of the membership run (0: skip)")
    parser.add_argument("--membership-rows", type=int, default=256, help="rows of its steady load (256)")
    parser.add_argument(
        "--plot", metavar="DIR", help="write the membership timeline to DIR/cluster-membership.png"
    )
    parser.add_argument(
        "--vllm-peers", type=int, default=0, help="peers of the vLLM engine's TTFT run (0: skip)"
    )
    parser.add_argument("--vllm-rounds", type=int, default=5, help="documents of that run (median)")
    parser.add_argument("--vllm-tokens", type=int, default=1900, help="tokens per document (1900)")
    args = parser.parse_args(argv)
    reason = probe()
    if reason is not None:
        print(f"kvtier bench cluster: cannot simulate a cluster here: {reason}", file=sys.stderr)
        return 2
    faults = [name for name in args.faults.split(",") if name]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; known: {','.join(FAULTS)}")
    command = "kvtier bench cluster " + " ".join(sys.argv[3:] if argv is None else argv)
    print(f"$ {command.strip()}")
    print(
        f"{args.rows} rows of {args.row_bytes} B per op; every host a network namespace on one bridge "
        f"(UCX over TCP on veth), {os.cpu_count()} cores shared by all, {platform.machine()}"
    )
    figures: dict = {"throughput": [], "idle": None, "faults": [], "membership": None, "vllm": None}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-cluster-") as workdir:
        log_dir = Path(workdir)
        if args.hosts:
            head = f"{'put GB/s':>8} {'raw':>6} {'ratio':>5}"
            print(f"{'peers':>5} {head} {head.replace('put', 'get')}")
        for peers in args.hosts:
            row = throughput(peers, args, log_dir)
            figures["throughput"].append(row)
            print(
                f"{peers:5} {row['put_gbps']:8.2f} {row['raw_write_gbps']:6.2f} {row['put_ratio']:5.2f} "
                f"{row['get_gbps']:8.2f} {row['raw_read_gbps']:6.2f} {row['get_ratio']:5.2f} "
                f"  peers on CPU {row['peer_cores_during_tier']:.2f} cores"
            )
        base = next((r for r in figures["throughput"] if r["peers"] == args.scaling_base), None)
        if base is not None:
            for row in figures["throughput"]:
                row["put_scaling"] = row["put_gbps"] / base["put_gbps"]
                row["get_scaling"] = row["get_gbps"] / base["get_gbps"]
            print(
                f"scaling against {args.scaling_base} peers (target >= {SCALING_TARGET} at 16): "
                + ", ".join(
                    f"{r['peers']}: put {r['put_scaling']:.2f} get {r['get_scaling']:.2f}"
                    for r in figures["throughput"]
                )
            )
        if args.idle_peers:
            figures["idle"] = idle(args.idle_peers, args.idle_s, log_dir)
            fig = figures["idle"]
            print(
                f"idle: {fig['peers']} peers with a connected client: {fig['cores']:.3f} of a core "
                f"over {fig['seconds']:.1f} s (target < {IDLE_TARGET}); "
                f"{fig['rows_put_after']} rows put after it"
            )
        if faults:
            print(f"{'fault':14} {'deadline':>8} {'took s':>6} {'missed':>6} {'share':>5}  named")
        for name in faults:
            row = fault(name, args.deadline_s, log_dir)
            figures["faults"].append(row)
            print(
                f"{name:14} {row['deadline_s']:8.2f} {row['took_s']:6.2f} {row['rows_missed']:6} "
                f"{row['victims_rows']:5}  {','.join(row['hosts_named']) or '-'} "
                f"(at fault: {row['host_at_fault']})"
            )
        if args.membership:
            figures["membership"] = fig = cluster_membership.run(
                args.membership, args.membership_rows, args.deadline_s, log_dir
            )
            print(
                f"membership: {fig['peers']} peers, {fig['rows']} rows got every "
                f"{cluster_membership.INTERVAL_S} s; balance over {fig['balance_keys']} keys "
                f"{fig['balance']:.3f} (target <= {fig['balance_target']}); slowest get "
                f"{fig['slowest_get_s']:.2f} s, {fig['stalls']} past deadline + "
                f"{cluster_membership.SLACK_S} s"
            )
            print(
                f"{'event':15} {'at s':>5} {'share':>5} {'lost':>5} {'others':>6} {'slowest get s':>13}  host"
            )
            for row in fig["events"]:
                print(
                    f"{row['event']:15} {row['t']:5.1f} {row['share']:5} {row['rows_lost']:5} "
                    f"{row['rows_lost_elsewhere']:6} {row['slowest_get_s']:13.2f}  {row['host']}"
                )
            if args.plot:
                print(f"timeline: {cluster_membership.plot(fig, Path(args.plot) / 'cluster-membership.png')}")
        if args.vllm_peers:
            figures["vllm"] = _vllm(args, log_dir)
    if args.json:
        write_json(
            args.json,
            {
                "command": command.strip(),
                "baseline": "raw NIXL WRITE/READ of the same rows to a bare agent on each peer host,"
                " over the same links",
                "scaling_target": SCALING_TARGET,
                "idle_target_cores": IDLE_TARGET,
                **figures,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
