"""``kvtier bench copy``: device <-> host throughput of canonical rows, packed vs per-layer.

The same bytes, a Llama-3-8B-shaped KV group (32 layers, 8 KV heads, head dim 128, bf16,
16-token blocks: 2 MiB per block), are laid out twice: cross-layer packed (one tensor,
one segment per block) and per layer (32 tensors, 32 segments per block). Each layout
stores random device blocks into host slots and loads them back into other device blocks
through ``OffloadingWorker``; the baseline is a plain ``torch`` copy of the same total
bytes, timed in the same run and interleaved with it. Reported per layout: store and load
GB/s, the baseline's GB/s, their ratios and segments per block.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench.report import write_json
from offload.layout import canonicalize
from offload.worker import OffloadingWorker
from tiers.host import HostTier

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16
DTYPE = torch.bfloat16


@dataclass
class LayoutFigures:
    store_gbps: float
    load_gbps: float
    baseline_gbps: float
    store_ratio: float
    load_ratio: float
    segments_per_block: int
    block_bytes: int
    blocks_per_op: int


def make_caches(layout: str, num_blocks: int) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """A Llama-3-8B-shaped group: ``packed`` (views of one cross-layer tensor) or ``per_layer``."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    block_shape = (2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    if layout == "packed":
        packed = torch.empty((num_blocks, LAYERS, *block_shape), dtype=DTYPE)
        packed.view(torch.int16).random_()
        kv = {name: packed[:, i] for i, name in enumerate(names)}
    else:
        kv = {name: torch.empty((num_blocks, *block_shape), dtype=DTYPE) for name in names}
        for tensor in kv.values():
            tensor.view(torch.int16).random_()
    return kv, [names]


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(layout: str, blocks_per_op: int, repeats: int, seed: int) -> LayoutFigures:
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 2 * blocks_per_op
    kv, groups = make_caches(layout, num_blocks)
    caches = canonicalize(kv, groups, block_size=BLOCK_TOKENS)
    block_bytes = caches.row_bytes(0)
    host = HostTier([block_bytes], block_bytes * blocks_per_op, pin=None)
    worker = OffloadingWorker(caches, host)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    store_blocks, load_blocks = order[:blocks_per_op], order[blocks_per_op:]
    slots = list(range(blocks_per_op))  # a fresh tier hands out adjacent slots
    total = block_bytes * blocks_per_op
    src = torch.empty(total, dtype=torch.uint8).random_(generator=generator)
    dst = torch.empty_like(src)
    job = iter(range(1, 1 << 30))

    def run(submit: Callable[..., bool], blocks: list[int]) -> None:
        job_id = next(job)
        submit(job_id, [blocks], [slots])
        worker.wait([job_id])
        if not all(result.success for result in worker.get_finished()):
            raise RuntimeError(f"{layout}: a copy failed")

    def store() -> None:
        run(worker.submit_store, store_blocks)

    def load() -> None:
        run(worker.submit_load, load_blocks)

    def baseline() -> None:
        dst.copy_(src)

    for fn in (baseline, store, load):  # warm caches and allocator
        fn()
    base_t, store_t, load_t = [], [], []
    for _ in range(repeats):  # interleaved, so drift hits all three alike
        base_t.append(_seconds(baseline))
        store_t.append(_seconds(store))
        load_t.append(_seconds(load))
    for b_store, b_load in zip(store_blocks, load_blocks, strict=True):  # loads hold what was stored
        if caches.read_row(0, b_store) != caches.read_row(0, b_load):
            raise RuntimeError(f"{layout}: block {b_load} does not hold the bytes of block {b_store}")
    worker.shutdown()
    gbps = {
        name: total / statistics.median(t) / 1e9 for name, t in (("b", base_t), ("s", store_t), ("l", load_t))
    }
    return LayoutFigures(
        store_gbps=gbps["s"],
        load_gbps=gbps["l"],
        baseline_gbps=gbps["b"],
        store_ratio=gbps["s"] / gbps["b"],
        load_ratio=gbps["l"] / gbps["b"],
        segments_per_block=caches.segments_per_block(0),
        block_bytes=block_bytes,
        blocks_per_op=blocks_per_op,
    )


TARGETS = {"packed": 0.9, "per_layer": 0.6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench copy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument(
        "--blocks",
        type=int,
        default=256,
        help="blocks per store/load (default 256 = 512 MiB, well past the L3 cache)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per figure (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    command = "kvtier bench copy " + " ".join(sys.argv[3:] if argv is None else argv)
    print(f"$ {command.strip()}")
    print(
        f"Llama-3-8B-shaped group: {LAYERS} layers x {KV_HEADS} KV heads x head dim {HEAD_DIM}, bf16, "
        f"{BLOCK_TOKENS}-token blocks; {args.blocks} random blocks per op; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}"
    )
    results = {}
    for layout in ("packed", "per_layer"):
        results[layout] = measure(layout, args.blocks, args.repeats, args.seed)
    header = f"{'layout':10} {'seg/blk':>7} {'store GB/s':>10} {'load GB/s':>9} {'copy GB/s':>9} "
    header += f"{'store/copy':>10} {'load/copy':>9} {'target':>6}"
    print(header)
    for layout, fig in results.items():
        print(
            f"{layout:10} {fig.segments_per_block:7d} {fig.store_gbps:10.2f} {fig.load_gbps:9.2f} "
            f"{fig.baseline_gbps:9.2f} {fig.store_ratio:10.2f} {fig.load_ratio:9.2f} {TARGETS[layout]:>6}"
        )
    if args.json:
        payload = {
            "command": command.strip(),
            "baseline": "torch.Tensor.copy_ of the same total bytes, same run",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "layouts": {layout: asdict(fig) for layout, fig in results.items()},
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
