"""An engine host of the simulated cluster: a ``RemoteTier`` driven by JSON lines.

    python -m bench.cluster_engine --peers A:P,B:P [--rows N] [--row-bytes B] [--deadline-s S]

Run in a host of ``bench/cluster_net.py`` (``Cluster.start_engine``), so the engine is a
process of its own on its own host, as in a deployment. (It must be a fresh process per
cluster anyway: UCX reads the routing table once per process, so an agent of a process that
used UCX before a cluster's interfaces existed finds "no route" to them.)

Each line on stdin is one request, each answered by one line on stdout:

- ``{"op": "put"|"get"|"contains", "salt": S, "count": N}``: the verb on keys ``(S, 0..N-1)``
  whose rows are the host rows ``0..N-1``; answers ``result`` (a flag per key), ``elapsed_s``
  and, for ``get``, ``exact`` (every hit byte-identical to what was put) and ``abandoned``
  (a silent peer's rows were given up: ``RowsAbandoned``);
- ``{"op": "owners", "salt": S, "count": N}``: the peer that owns each key now;
- ``{"op": "state"}``: ``peers_up``, the tier's ``stats``, the ``warnings`` it logged and
  the ``ucx`` variables in force
  (``{"op": "state", "clear": true}`` forgets them);
- ``{"op": "raw_connect", "targets": [LINE, ...]}``: load raw NIXL targets (the lines
  ``python -m bench.remote --raw-target SIZE`` prints) into a second agent of this process,
  with the same UCX settings as the tier's;
- ``{"op": "raw", "dir": "WRITE"|"READ", "count": N}``: the baseline: rows ``0..N-1`` split
  over the targets (row ``i`` to target ``i mod T``), one NIXL request per target, all
  posted at once; ``elapsed_s``;
- ``{"op": "load_start", "salt": S, "interval_s": I}`` / ``{"op": "load_stop"}``: a steady
  load (``SteadyLoad``) in the background while hosts come and go; stop returns its
  ``timeline``;
- ``{"op": "quit"}``: close the tier and exit.

The first line out is ``{"ready": ...}`` once the tier is open. Nothing else is written to
stdout; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time

import numpy as np

from tiers.address import Address
from tiers.base import RowsAbandoned
from tiers.remote import RemoteTier
from tiers.remote.nixl_agent import create_agent, descriptors
from tiers.settings import RemoteSettings
from tiers.sizes import parse_size

LAYOUT = b"cluster-engine-1"
NAMESPACE = b"kvtier-cluster-0"


class Warnings(logging.Handler):
    """The warnings the remote tier logged: whom it blamed for what."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def key_of(salt: str, i: int) -> bytes:
    """An ``OffloadKey``-shaped key: 32 bytes naming (salt, i), then group 0."""
    return f"{salt}/{i}".encode().ljust(32, b".")[:32] + bytes(4)


async def get_rows(tier: RemoteTier, rows: list) -> tuple[list[bool], bool]:
    """``tier.get``: a flag per row, and whether a silent peer made it abandon some rows
    (``RowsAbandoned``: that peer's WRITE may still land in them). Here every row index
    always holds the same bytes, so a late WRITE writes what a later get expects."""
    try:
        return await tier.get(rows), False
    except RowsAbandoned as exc:
        return exc.ok, True


class RawTargets:
    """The baseline: an agent of its own moving the engine's rows to raw NIXL targets."""

    def __init__(self, buffer: np.ndarray, lines: list[str]) -> None:
        self.agent = create_agent(f"kvtier-cluster-raw-{os.getpid()}")
        self.agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
        self.base = buffer.ctypes.data
        self.targets = []
        for line in lines:
            addr, metadata = line.split()
            self.targets.append((self.agent.add_remote_agent(bytes.fromhex(metadata)), int(addr)))

    def move(self, op: str, count: int, row_bytes: int, timeout_s: float = 60.0) -> None:
        handles = []
        for t, (name, remote_base) in enumerate(self.targets):
            rows = list(range(t, count, len(self.targets)))
            if not rows:
                continue
            local = descriptors([self.base + i * row_bytes for i in rows], [row_bytes] * len(rows))
            remote = descriptors(
                [remote_base + n * row_bytes for n in range(len(rows))], [row_bytes] * len(rows)
            )
            handle = self.agent.initialize_xfer(
                op, self.agent.get_xfer_descs(local, "DRAM"), self.agent.get_xfer_descs(remote, "DRAM"), name
            )
            handles.append([handle, self.agent.transfer(handle)])
        end = time.monotonic() + timeout_s
        while any(state == "PROC" for _, state in handles):
            if time.monotonic() > end:
                raise TimeoutError(f"raw {op} did not finish in {timeout_s} s")
            for entry in handles:
                if entry[1] == "PROC":
                    entry[1] = self.agent.check_xfer_state(entry[0])
        for handle, state in handles:
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"raw {op} failed: {state}")


class SteadyLoad:
    """A steady load under which hosts come and go: every ``interval_s`` a get of all the
    engine's rows, then a put of the ones it missed (a cache refills what it lost), each
    call recorded: when, how long, hits, misses, and the owners of the rows per peer after it.
    Each miss is owed to a peer (``missed_at``): the row's holder if it is gone, else the peer
    asked, which lacks it (it came, came back empty, or failed during the get)."""

    def __init__(self, engine: Engine, salt: str, interval_s: float) -> None:
        self.engine = engine
        self.salt = salt
        self.interval_s = interval_s
        self.timeline: list[dict] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> None:
        engine = self.engine
        keys = engine.keys({"salt": self.salt})
        self._holder = [engine.tier.owner(k) for k in keys]  # the peer that holds each row
        await engine.tier.put(list(zip(keys, engine.src, strict=False)))
        self._began = time.monotonic()
        self._task = asyncio.create_task(self._run(keys))

    async def stop(self) -> list[dict]:
        self._stopping = True
        if self._task is not None:
            await self._task
        return self.timeline

    async def _run(self, keys: list[bytes]) -> None:
        engine, tier = self.engine, self.engine.tier
        while not self._stopping:
            routed = [tier.owner(k) for k in keys]  # where this get goes
            up = set(tier.peers_up())
            began = time.monotonic()
            engine.buffer[engine.rows * engine.row_bytes :] = 0
            loaded, abandoned = await get_rows(tier, list(zip(keys, engine.dst, strict=False)))
            took = time.monotonic() - began
            exact = all(bytes(engine.src[i]) == bytes(engine.dst[i]) for i, ok in enumerate(loaded) if ok)
            missed = [i for i, ok in enumerate(loaded) if not ok]
            missed_at: dict[str, list[int]] = {}  # who each miss is owed to: the rows missed
            for i in missed:
                holder = self._holder[i]
                # The row's holder is gone: its loss. Else the peer asked lacks it: a peer
                # that came (or came back empty), or one that failed during this get.
                who = holder if holder is not None and holder != routed[i] and holder not in up else routed[i]
                missed_at.setdefault(str(who), []).append(i)
            for i, ok in enumerate(loaded):
                if ok:
                    self._holder[i] = routed[i]
            owners: dict[str, int] = {}
            for k in keys:
                owner = tier.owner(k)
                if owner is not None:
                    owners[owner] = owners.get(owner, 0) + 1
            put_s, refills_failed = 0.0, 0
            if missed:
                began_put = time.monotonic()
                refill = [tier.owner(keys[i]) for i in missed]
                stored = await tier.put([(keys[i], engine.src[i]) for i in missed])
                put_s = time.monotonic() - began_put
                refills_failed = stored.count(False)
                for i, owner, ok in zip(missed, refill, stored, strict=True):
                    if ok:
                        self._holder[i] = owner
            self.timeline.append(
                {
                    "t": began - self._began,
                    "get_s": took,
                    "put_s": put_s,
                    "hits": len(keys) - len(missed),
                    "misses": len(missed),
                    "exact": exact,
                    "abandoned": abandoned,
                    "refills_failed": refills_failed,
                    "peers_up": len(tier.peers_up()),
                    "owners": owners,
                    "missed_at": missed_at,
                }
            )
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - began)))


class Engine:
    def __init__(self, tier: RemoteTier, rows: int, row_bytes: int) -> None:
        self.tier = tier
        self.raw: RawTargets | None = None
        self.load: SteadyLoad | None = None
        self.rows = rows
        self.row_bytes = row_bytes
        raw = np.zeros(2 * rows * row_bytes + 4096, dtype=np.uint8)
        self.buffer = raw[-raw.ctypes.data % 4096 :][: 2 * rows * row_bytes]
        self.buffer[: rows * row_bytes] = np.random.default_rng(0).integers(
            0, 256, rows * row_bytes, np.uint8
        )
        view = memoryview(self.buffer)
        self.src = [view[i * row_bytes : (i + 1) * row_bytes] for i in range(rows)]
        base = rows * row_bytes
        self.dst = [view[base + i * row_bytes : base + (i + 1) * row_bytes] for i in range(rows)]

    def keys(self, request: dict) -> list[bytes]:
        count = int(request.get("count", self.rows))
        if not 0 < count <= self.rows:
            raise ValueError(f"count must be within 1..{self.rows}")
        return [key_of(str(request["salt"]), i) for i in range(count)]

    async def handle(self, request: dict, warnings: Warnings) -> dict:
        op = request["op"]
        if op == "state":
            answer = {
                "peers_up": self.tier.peers_up(),
                "stats": dict(self.tier.stats()),
                "warnings": list(warnings.messages),
                "ucx": {name: value for name, value in os.environ.items() if name.startswith("UCX_")},
            }
            if request.get("clear"):
                warnings.messages.clear()
            return answer
        if op == "load_start":
            self.load = SteadyLoad(self, str(request["salt"]), float(request.get("interval_s", 0.1)))
            await self.load.start()
            return {"started": True}
        if op == "load_stop":
            if self.load is None:
                raise ValueError("load_start first")
            timeline = await self.load.stop()
            return {"timeline": timeline}
        if op == "raw_connect":
            self.raw = RawTargets(self.buffer, request["targets"])
            return {"targets": len(request["targets"])}
        if op == "raw":
            count = int(request.get("count", self.rows))
            began = time.monotonic()
            if self.raw is None:
                raise ValueError("raw_connect first")
            self.raw.move(str(request["dir"]), count, self.row_bytes)
            return {"elapsed_s": time.monotonic() - began}
        keys = self.keys(request)
        if op == "owners":
            return {"result": [self.tier.owner(k) for k in keys]}
        began = time.monotonic()
        answer: dict = {}
        if op == "put":
            result = await self.tier.put(list(zip(keys, self.src, strict=False)))
        elif op == "get":
            self.buffer[self.rows * self.row_bytes :] = 0
            result, answer["abandoned"] = await get_rows(self.tier, list(zip(keys, self.dst, strict=False)))
            answer["exact"] = all(
                bytes(self.src[i]) == bytes(self.dst[i]) for i, ok in enumerate(result) if ok
            )
        elif op == "contains":
            result = await self.tier.contains(keys)
        else:
            raise ValueError(f"unknown op {op!r}")
        answer.update(result=result, elapsed_s=time.monotonic() - began)
        return answer


async def serve(args: argparse.Namespace) -> int:
    warnings = Warnings()
    logging.getLogger("tiers.remote").addHandler(warnings)
    settings = RemoteSettings(
        capacity_bytes=1 << 30,
        peers=tuple(Address.parse(p) for p in args.peers.split(",")),
        deadline_s=args.deadline_s,
    )
    tier = RemoteTier(settings, NAMESPACE, LAYOUT, backoff_s=args.backoff_s, max_backoff_s=args.backoff_s)
    engine = Engine(tier, args.rows, args.row_bytes)
    await tier.open(memoryview(engine.buffer))
    loop = asyncio.get_running_loop()
    try:
        sys.stdout.write(json.dumps({"ready": True, "peers_up": tier.peers_up()}) + "\n")
        sys.stdout.flush()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            request = json.loads(line)
            if request.get("op") == "quit":
                break
            try:
                answer = await engine.handle(request, warnings)
            except Exception as exc:  # a bad request: say so, keep serving
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        await tier.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_engine")
    parser.add_argument("--peers", required=True, help="HOST:PORT,HOST:PORT,...")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--row-bytes", type=parse_size, default=256 << 10)
    parser.add_argument("--deadline-s", type=float, default=2.0)
    parser.add_argument("--backoff-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
