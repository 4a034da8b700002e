"""``kvtier bench copy``: device <-> host throughput of canonical rows, packed vs per-layer.

The same bytes, a Llama-3-8B-shaped KV group (32 layers, 8 KV heads, head dim 128, bf16,
16-token blocks: 2 MiB per block), are laid out twice: cross-layer packed (one tensor,
one segment per block) and per layer (32 tensors, 32 segments per block). Each layout
stores random device blocks into host slots and loads them back into other device blocks
through ``OffloadingWorker``; the baseline is a plain ``torch`` copy of the same total
bytes, timed in the same run and interleaved with it: on CPU a memcpy, on CUDA
(``--device cuda``) one contiguous DMA between device memory and pinned host memory in the
same direction (device -> host for stores, host -> device for loads), i.e. the PCIe link's
limit as torch reaches it. Reported per layout: store and load GB/s, the baselines' GB/s,
their ratios and segments per block.
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
    baseline_gbps: float  # the store's direction (device -> host)
    load_baseline_gbps: float  # the load's direction (host -> device)
    store_ratio: float
    load_ratio: float
    segments_per_block: int
    block_bytes: int
    blocks_per_op: int


def make_caches(
    layout: str, num_blocks: int, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """A Llama-3-8B-shaped group: ``packed`` (views of one cross-layer tensor) or ``per_layer``."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    block_shape = (2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    if layout == "packed":
        packed = torch.empty((num_blocks, LAYERS, *block_shape), dtype=DTYPE, device=device)
        packed.view(torch.int16).random_()
        kv = {name: packed[:, i] for i, name in enumerate(names)}
    else:
        kv = {name: torch.empty((num_blocks, *block_shape), dtype=DTYPE, device=device) for name in names}
        for tensor in kv.values():
            tensor.view(torch.int16).random_()
    return kv, [names]


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(layout: str, blocks_per_op: int, repeats: int, seed: int, device: str = "cpu") -> LayoutFigures:
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 2 * blocks_per_op
    kv, groups = make_caches(layout, num_blocks, device)
    caches = canonicalize(kv, groups, block_size=BLOCK_TOKENS)
    block_bytes = caches.row_bytes(0)
    host = HostTier([block_bytes], block_bytes * blocks_per_op, pin=None)
    worker = OffloadingWorker(caches, host)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    store_blocks, load_blocks = order[:blocks_per_op], order[blocks_per_op:]
    slots = list(range(blocks_per_op))  # a fresh tier hands out adjacent slots
    total = block_bytes * blocks_per_op
    on_gpu = caches.device.type == "cuda"
    # The baseline moves the same bytes the way the hardware moves them fastest: on CUDA, one
    # contiguous DMA each way between device memory and pinned host memory (the PCIe limit,
    # timed per direction); on CPU, one memcpy.
    host_bytes = torch.empty(total, dtype=torch.uint8, pin_memory=on_gpu).random_(generator=generator)
    device_bytes = torch.empty(total, dtype=torch.uint8, device=caches.device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
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

    def to_device() -> None:  # a load's direction
        device_bytes.copy_(host_bytes, non_blocking=True)
        sync()

    def to_host() -> None:  # a store's direction
        host_bytes.copy_(device_bytes, non_blocking=True)
        sync()

    for fn in (to_device, to_host, store, load):  # warm caches and allocator
        fn()
    down_t, up_t, store_t, load_t = [], [], [], []
    for _ in range(repeats):  # interleaved, so drift hits all of them alike
        up_t.append(_seconds(to_host))
        store_t.append(_seconds(store))
        down_t.append(_seconds(to_device))
        load_t.append(_seconds(load))
    for b_store, b_load in zip(store_blocks, load_blocks, strict=True):  # loads hold what was stored
        if caches.read_row(0, b_store) != caches.read_row(0, b_load):
            raise RuntimeError(f"{layout}: block {b_load} does not hold the bytes of block {b_store}")
    worker.shutdown()
    gbps = {
        name: total / statistics.median(t) / 1e9
        for name, t in (("up", up_t), ("down", down_t), ("s", store_t), ("l", load_t))
    }
    return LayoutFigures(
        store_gbps=gbps["s"],
        load_gbps=gbps["l"],
        baseline_gbps=gbps["up"],
        load_baseline_gbps=gbps["down"],
        store_ratio=gbps["s"] / gbps["up"],
        load_ratio=gbps["l"] / gbps["down"],
        segments_per_block=caches.segments_per_block(0),
        block_bytes=block_bytes,
        blocks_per_op=blocks_per_op,
    )


TARGETS = {"packed": 0.9, "per_layer": 0.6}


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


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
    parser.add_argument("--device", default="cpu", help="where the KV caches live: cpu (default) or cuda")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    command = "kvtier bench copy " + " ".join(sys.argv[3:] if argv is None else argv)
    print(f"$ {command.strip()}")
    print(
        f"Llama-3-8B-shaped group: {LAYERS} layers x {KV_HEADS} KV heads x head dim {HEAD_DIM}, bf16, "
        f"{BLOCK_TOKENS}-token blocks; {args.blocks} random blocks per op; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}, KV caches on {_device_name(args.device)}"
    )
    results = {}
    for layout in ("packed", "per_layer"):
        results[layout] = measure(layout, args.blocks, args.repeats, args.seed, args.device)
    header = f"{'layout':10} {'seg/blk':>7} {'store GB/s':>10} {'load GB/s':>9} {'copy GB/s':>13} "
    header += f"{'store/copy':>10} {'load/copy':>9} {'target':>6}"
    print(header)
    for layout, fig in results.items():
        copies = f"{fig.baseline_gbps:.2f}/{fig.load_baseline_gbps:.2f}"
        print(
            f"{layout:10} {fig.segments_per_block:7d} {fig.store_gbps:10.2f} {fig.load_gbps:9.2f} "
            f"{copies:>13} {fig.store_ratio:10.2f} {fig.load_ratio:9.2f} {TARGETS[layout]:>6}"
        )
    print("copy GB/s: the baseline in a store's direction / in a load's direction")
    if args.json:
        payload = {
            "command": command.strip(),
            "device": _device_name(args.device),
            "baseline": "torch.Tensor.copy_ of the same total bytes in the same direction, same run "
            "(CUDA: one DMA to / from pinned host memory)",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "layouts": {layout: asdict(fig) for layout, fig in results.items()},
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
