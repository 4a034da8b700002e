"""``kvtier bench convert``: loading a prefix stored by an engine of another layout.

Engine A (per-layer NHD, 64-token blocks, Llama-3-8B-shaped: 32 layers, 8 KV heads, head
dim 128, bf16; 64 tokens per stored row = 8 MiB) stores a prompt into a disk tier. Engine
B then loads it, from a cold host tier, the way an engine does: lookups until the
promotions land, then one load into its device blocks. B runs once in A's own layout (the
baseline: the row is used as it lies, no extra pass) and twice in each other layout
(``--readers``: HND, packed cross-layer, K/V apart, 16-token blocks): with every row
rewritten into B's layout as it lands in the host tier (the CPU default), and with rows
left as written and rewritten by the worker as it loads them (the GPU default, here on
CPU tensors). Both read the same LMDB file, warm in the page
cache, in the same run, alternating; figures are medians over ``--repeats``. Every load is
checked token by token against what A computed.

Reported per reader: load GB/s both ways (bytes of KV loaded over the time from the first
lookup to the load's end), the same-layout GB/s, their ratios, and the conversion alone
(rows rewritten per second, as GB/s, beside a plain ``torch`` copy of the same bytes).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import torch

from bench.engine_layouts import EngineLayout, ModelShape
from bench.report import write_json
from offload.keys import make_key
from offload.layout import canonicalize
from offload.row_layout import convert_row

SHAPE = ModelShape(layers=32, heads=8, head_dim=128, dtype=torch.bfloat16)
ROW_TOKENS = 64
WRITER = EngineLayout("nhd", 64, SHAPE)
READERS = ("hnd-64", "packed-16", "kv-apart-16", "hnd-strides-16")


@dataclass
class ReaderFigures:
    reader: str
    load_gbps: float  # converted as rows land in the host tier
    in_worker_gbps: float  # converted by the worker as it loads
    same_layout_gbps: float
    load_ratio: float
    in_worker_ratio: float
    convert_gbps: float
    torch_copy_gbps: float
    convert_ratio: float
    rows: int
    row_bytes: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier bench convert", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="rows of 64 tokens (8 MiB) per load")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--readers", default=",".join(READERS), help="reader layouts, KIND-BLOCKTOKENS")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--device", default="cpu", help="where both engines' KV caches live: cpu or cuda")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    return args


def engine(name: str) -> EngineLayout:
    kind, _, tokens = name.rpartition("-")
    if not kind or not tokens.isdigit() or ROW_TOKENS % int(tokens):
        raise SystemExit(
            f"--readers: {name!r} is not KIND-BLOCKTOKENS with block tokens dividing {ROW_TOKENS}"
        )
    try:
        return EngineLayout(kind, int(tokens), SHAPE)
    except ValueError as exc:
        raise SystemExit(f"--readers: {exc}") from exc


def keys(rows: int) -> list[bytes]:
    return [make_key(f"prompt/{i}".encode().ljust(16, b"."), 0) for i in range(rows)]


def config(path: str, rows: int, row_bytes: int) -> dict:
    capacity = (rows + 2) * row_bytes
    return {
        "namespace": {"model": "bench/llama-3-8b-shaped"},
        "tiers": [
            {"kind": "host", "capacity": capacity},
            {"kind": "disk", "path": path, "capacity": 2 * capacity, "admission": "all",
             "placement": "write-through"},
        ],
    }  # fmt: skip


def store_prompt(cfg: dict, logical: torch.Tensor, rows: int, device: str = "cpu") -> None:
    engine_a, kv = WRITER.offloader(cfg, rows, ROW_TOKENS, device=device)
    with engine_a:
        WRITER.fill(kv, logical, list(range(rows)))
        engine_a.store(keys(rows), list(range(rows)))
        engine_a.wait()
        engine_a.wait_tiers()


def timed_load(
    layout: EngineLayout,
    cfg: dict,
    logical: torch.Tensor,
    rows: int,
    convert_on_load: bool = False,
    device: str = "cpu",
) -> float:
    """Seconds from the first lookup to the end of the load, for a cold host tier."""
    per = ROW_TOKENS // layout.block_tokens
    engine_b, kv = layout.offloader(
        cfg, rows * per, ROW_TOKENS, convert_on_load=convert_on_load, device=device
    )
    wanted = keys(rows)
    block_ids = list(range(rows * per))
    with engine_b:
        start = time.perf_counter()
        while engine_b.lookup(wanted) < rows:
            engine_b.wait_tiers()
        engine_b.load(wanted, block_ids)
        results = engine_b.wait()
        seconds = time.perf_counter() - start
        if not all(r.success for r in results) or not torch.equal(
            layout.read(kv, block_ids).cpu().view(torch.int16), logical.view(torch.int16)
        ):
            raise RuntimeError(f"{layout.name}: the loaded KV differs from what was stored")
    return seconds


def conversion_rate(reader: EngineLayout, repeats: int, device: str = "cpu") -> tuple[float, float]:
    """GB/s of ``convert_row`` from the writer's layout into ``reader``'s (with a reused
    scratch row, as ``RowConverter`` runs it), and of ``torch`` copy, on ``device``."""
    source = _row_layout(WRITER)
    target = _row_layout(reader)
    row = torch.empty(source.row_bytes, dtype=torch.uint8, device=device).random_()
    copy_into = torch.empty_like(row)
    scratch = torch.empty_like(row)
    sync = torch.cuda.synchronize if row.is_cuda else (lambda: None)
    convert_s, copy_s = [], []
    for _ in range(repeats * 4):
        start = time.perf_counter()
        convert_row(row, source, target, scratch)
        convert_row(row, target, source, scratch)
        sync()
        convert_s.append((time.perf_counter() - start) / 2)
        start = time.perf_counter()
        copy_into.copy_(row)
        sync()
        copy_s.append(time.perf_counter() - start)
    return row.numel() / statistics.median(convert_s) / 1e9, row.numel() / statistics.median(copy_s) / 1e9


def _row_layout(layout: EngineLayout):
    kv, groups = layout.make(1)
    described = canonicalize(
        kv, groups, block_size=layout.block_tokens, kv_layout=layout.kv_layout
    ).row_layout
    assert described is not None
    return replace(described.groups[0], blocks_per_row=ROW_TOKENS // layout.block_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    readers = [engine(name) for name in args.readers.split(",") if name]
    row_bytes = _row_layout(WRITER).row_bytes
    logical = SHAPE.logical_kv(args.rows * ROW_TOKENS, seed=0)
    figures: list[ReaderFigures] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-convert-") as tmp:
        cfg = config(f"{tmp}/lmdb", args.rows, row_bytes)
        store_prompt(cfg, logical, args.rows, args.device)
        total = args.rows * row_bytes
        for reader in readers:
            same, landing, in_worker = [], [], []
            for _ in range(args.repeats):  # alternate, so drift hits all alike
                same.append(timed_load(WRITER, cfg, logical, args.rows, device=args.device))
                landing.append(timed_load(reader, cfg, logical, args.rows, device=args.device))
                in_worker.append(
                    timed_load(reader, cfg, logical, args.rows, convert_on_load=True, device=args.device)
                )
            convert_gbps, copy_gbps = conversion_rate(reader, args.repeats, args.device)
            load_gbps = total / statistics.median(landing) / 1e9
            worker_gbps = total / statistics.median(in_worker) / 1e9
            same_gbps = total / statistics.median(same) / 1e9
            figures.append(
                ReaderFigures(
                    reader.name,
                    load_gbps,
                    worker_gbps,
                    same_gbps,
                    load_gbps / same_gbps,
                    worker_gbps / same_gbps,
                    convert_gbps,
                    copy_gbps,
                    convert_gbps / copy_gbps,
                    args.rows,
                    row_bytes,
                )
            )
    command = "kvtier bench convert " + " ".join(argv if argv is not None else sys.argv[2:])
    print(f"$ {command.strip()}")
    print(
        f"writer {WRITER.name} (per-layer NHD), {args.rows} rows of {row_bytes >> 20} MiB from a warm "
        f"LMDB, median of {args.repeats}; {platform.processor() or platform.machine()}, "
        f"KV caches on {args.device}"
    )
    print(
        f"{'reader':<16}{'same GB/s':>10}{'landing GB/s':>13}{'ratio':>7}{'worker GB/s':>12}{'ratio':>7}"
        f"{'convert GB/s':>14}{'copy GB/s':>10}"
    )
    for f in figures:
        print(
            f"{f.reader:<16}{f.same_layout_gbps:>10.2f}{f.load_gbps:>13.2f}{f.load_ratio:>7.2f}"
            f"{f.in_worker_gbps:>12.2f}{f.in_worker_ratio:>7.2f}{f.convert_gbps:>14.2f}{f.torch_copy_gbps:>10.2f}"
        )
    write_json(
        args.json, {"command": command, "writer": WRITER.name, "readers": [asdict(f) for f in figures]}
    )
    return 0
