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

BENCHMARKS = {
    "copy": ("bench.copy", "device <-> host row copies, packed vs per-layer, against torch copy"),
    "policy": ("bench.policy", "eviction policies on traces against Belady's OPT and vLLM"),
    "disk": ("bench.disk", "LMDB disk tier row writes and reads against plain file I/O"),
    "remote": ("bench.remote", "peer tier gets and puts against a raw NIXL transfer"),
}
COMMANDS = {
    "peer": ("tiers.peer_server", "serve a pool of rows to remote kvtier clients over NIXL"),
}


def _run(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


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
    if command in COMMANDS:
        return _run(COMMANDS[command][0], rest)
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(_usage())
            return 0 if rest and rest[0] in ("-h", "--help") else 2
        return _run(BENCHMARKS[rest[0]][0], rest[1:])
    print(f"kvtier: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
