"""The ``kvtier`` command line.

``kvtier bench NAME [ARGS]`` runs a benchmark of ``bench/`` (each one prints the command
that reproduces it, its baseline and the ratio, and writes ``--json FILE``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

BENCHMARKS = {
    "copy": ("bench.copy", "device <-> host row copies, packed vs per-layer, against torch copy"),
    "policy": ("bench.policy", "eviction policies on traces against Belady's OPT and vLLM"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvtier", description="KV-cache offloading tier for LLM inference")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark", add_help=False)
    bench.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), metavar="NAME")
    bench.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "bench":
        if args.name is None:
            lines = [f"  {name:8} {text}" for name, (_module, text) in sorted(BENCHMARKS.items())]
            print("usage: kvtier bench NAME [--json FILE] ...\n\nbenchmarks:\n" + "\n".join(lines))
            return 0 if args.help else 2
        module = importlib.import_module(BENCHMARKS[args.name][0])
        return int(module.main(rest + (["--help"] if args.help else [])) or 0)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
