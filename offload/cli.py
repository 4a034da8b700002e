"""The ``kvtier`` command line.

- ``kvtier bench NAME [ARGS]`` runs a benchmark of ``bench/``; each prints the command that
  reproduces it, the baseline it measured in the same run and the ratio, and writes
  ``--json FILE``.
- ``kvtier peer --listen HOST:PORT --capacity SIZE ...`` serves a pool of rows to remote
  kvtier clients over NIXL.

Each subcommand lives in its own module and is imported only when run, so ``kvtier
bench copy`` does not pay for NIXL, nor ``kvtier peer`` for the benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

BENCHMARKS = {
    "copy": ("bench.copy", "device <-> host row copies, packed vs per-layer, against torch copy"),
    "policy": ("bench.policy", "eviction policies on traces against Belady's OPT and vLLM"),
    "disk": ("bench.disk", "LMDB disk tier row writes and reads against plain file I/O"),
    "remote": ("bench.remote", "peer tier gets and puts against a raw NIXL transfer"),
    "cluster": (
        "bench.cluster",
        "peers on simulated hosts: GB/s per host count vs raw NIXL, idle CPU, faults",
    ),
    "convert": ("bench.convert", "loading rows stored by an engine of another layout vs the same layout"),
    "mooncake": ("bench.mooncake", "Mooncake Store tier puts and gets against the store's own batch calls"),
    "sglang": ("bench.sglang_backend", "the SGLang backend's page calls against its disk tier's own calls"),
    "e2e": ("bench.e2e", "long-context workloads end to end: hits per tier, load latency, TTFT"),
    "serve": ("bench.serve", "TTFT in a real vLLM engine: vLLM alone vs + kvtier host, disk, peer"),
}
COMMANDS = {
    "peer": ("tiers.remote.server", "serve a pool of rows to remote kvtier clients over NIXL"),
}


def _run(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


def _port(text: str) -> int:
    """A TCP port, 0 (the kernel picks one) to 65535: checked before the peer starts, so a bad
    one is a usage error (exit 2), not a peer that says it listens and then dies."""
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0..65535)")
    return int(text)


HEALTH_TIMEOUT_S = 1.0
"""A peer whose event loop does not answer within this is not serving (``/health`` 503)."""
SCRAPE_TIMEOUT_S = 2.0


def _peer(argv: list[str]) -> int:
    """``kvtier peer``: the server of ``tiers.remote.server``, plus ``--metrics-port PORT``:
    Prometheus text at ``/metrics`` (``offload.peer_metrics``) and ``/health``.

    The endpoint is added here because ``tiers/`` never imports ``offload/``.
    """
    from offload.metrics import render, serve
    from offload.peer_metrics import PREFIX, peer_families
    from tiers.remote import server as peer_server
    from tiers.remote.peer_metrics import PeerSnapshot

    parser = argparse.ArgumentParser(prog="kvtier peer", add_help=False)
    parser.add_argument("--metrics-port", type=_port, default=None)
    parser.add_argument("--metrics-host", default="127.0.0.1")
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(
            "kvtier peer also takes --metrics-port PORT [--metrics-host HOST]: "
            "Prometheus text at /metrics, 200 at /health while serving"
        )
    if args.metrics_port is None:
        return int(peer_server.main(rest) or 0)

    def on_ready(snapshot: Callable[[float], PeerSnapshot]) -> None:
        def collect() -> str:
            return render(peer_families(snapshot(SCRAPE_TIMEOUT_S)), prefix=PREFIX)

        def healthy() -> bool:
            snapshot(HEALTH_TIMEOUT_S)  # raises if the loop does not answer, or the peer stops
            return True

        server = serve(args.metrics_port, collect, host=args.metrics_host, health=healthy)
        host, port = server.server_address[:2]
        logging.getLogger("kvtier.peer").warning(
            "metrics at http://%s:%d/metrics, health at /health", host, port
        )

    return int(peer_server.main(rest, on_ready=on_ready) or 0)


def _usage() -> str:
    lines = ["usage: kvtier [--log-level LEVEL] COMMAND ...", "", "commands:"]
    lines += [f"  {name:14} {text}" for name, (_module, text) in COMMANDS.items()]
    lines += [f"  bench {name:8} {text}" for name, (_module, text) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="kvtier", add_help=False)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not rest or (args.help and rest[0] not in COMMANDS and rest[0] != "bench"):
        print(_usage())
        return 0 if args.help else 2
    command, rest = rest[0], rest[1:]
    if args.help:
        rest = [*rest, "--help"]
    if command == "peer":
        return _peer(rest)
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(_usage())
            return 0 if rest and rest[0] in ("-h", "--help") else 2
        return _run(BENCHMARKS[rest[0]][0], rest[1:])
    print(f"kvtier: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
