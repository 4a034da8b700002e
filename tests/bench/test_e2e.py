"""``kvtier bench e2e`` at tiny sizes: the JSON it writes, byte checks, token accounting."""

import json

import pytest

from bench.e2e import main
from bench.e2e_workload import SOURCES, DeviceCache, Replay, Shape, block_key, clip, pattern
from bench.traces import Request
from offload.api import Offloader

TINY = ["--requests", "30", "--miss-requests", "4", "--max-blocks", "12", "--prompt-blocks", "2"]


def prompt_tokens(requests, max_blocks: int, block_tokens: int) -> int:
    return sum(len(clip(r.keys, max_blocks)) for r in requests) * block_tokens


def test_clip_keeps_head_and_tail():
    assert clip(tuple(range(5)), 8) == tuple(range(5))
    assert clip(tuple(range(20)), 8) == (0, 1, 2, 3, 4, 5, 18, 19)


def test_a_replay_checks_every_loaded_block_and_tokens_add_up():
    shape = Shape()
    device = DeviceCache(shape, 8)
    kv, groups = device.kv_caches()
    prefixes = [(1, 2, 3, 4, 5), (11, 12, 13, 14, 15)]  # together more than the device holds
    requests = [Request(float(i), (*prefixes[i % 2], 100 + i)) for i in range(6)]
    config = {"tiers": [{"kind": "host", "capacity": 64 * shape.block_bytes}]}
    with Offloader(kv, groups, config, block_size=shape.block_tokens) as offloader:
        tally = Replay(device, offloader, "t", max_blocks=8).run(requests)
    assert sum(tally.tokens.values()) == prompt_tokens(requests, 8, shape.block_tokens)
    assert set(tally.tokens) == set(SOURCES)
    assert tally.tokens["host"] > 0  # the 8-block device cache cannot keep both prefixes
    assert tally.checked_blocks * shape.block_tokens == tally.tokens["host"]
    for per_request, request in zip(tally.per_request, requests, strict=True):
        assert sum(per_request.values()) == len(request.keys) * shape.block_tokens


def test_a_load_of_other_bytes_is_caught():
    shape = Shape()
    device = DeviceCache(shape, 8)
    kv, groups = device.kv_caches()
    config = {"tiers": [{"kind": "host", "capacity": 8 * shape.block_bytes}]}
    with Offloader(kv, groups, config, block_size=shape.block_tokens) as offloader:
        replay = Replay(device, offloader, "t", max_blocks=8)
        key = block_key("t", 1)
        device.rows[0].copy_(pattern(block_key("t", 2), shape.block_bytes))  # the wrong block's bytes
        offloader.wait([offloader.store([key], [0])])
        assert offloader.lookup([key]) == 1
        offloader.wait([offloader.load([key], [1])])
        with pytest.raises(RuntimeError, match="other bytes"):
            replay._check([key], [1])


def test_e2e_without_a_peer_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert (
        main(["--workload", "agentic", "--no-remote", *TINY, "--json", str(out), "--plot", str(tmp_path)])
        == 0
    )
    fig = json.loads(out.read_text())
    assert {"command", "shape", "ceilings_gbps", "tiers", "workloads", "ttft"} <= set(fig)
    assert fig["ceilings_gbps"]["torch_copy"] > 0 and fig["ceilings_gbps"]["raw_nixl_read"] is None
    assert set(fig["tiers"]) == {"host", "disk"}
    run = fig["workloads"]["agentic"]
    assert run["requests"] == 30
    tokens = run["tokens"]
    assert set(tokens) == set(SOURCES) and tokens["remote"] == 0
    hits = sum(fig["tiers"][kind]["hits"] for kind in fig["tiers"])
    assert run["checked_blocks"] == hits > 0  # every block served by a tier was byte-checked
    assert tokens["host"] + tokens["disk"] == hits * fig["shape"]["block_tokens"]
    miss = run["miss_path"]
    assert miss["kvtier_hits"] == 0 and miss["no_kvtier_s"] > 0 and miss["kvtier_s"] > 0
    assert {"p50_ms", "p99_ms", "gbps", "ceiling_gbps", "bytes_read", "bytes_written"} <= set(
        fig["tiers"]["host"]
    )
    assert fig["ttft"]["measured"]["prefill_ms"] > 0 and fig["ttft"]["measured"]["cached_load_ms"] > 0
    for bound in ("achieved", "ceiling"):
        assert fig["ttft"]["modelled"]["agentic"][bound]["no_kvtier_mean_ms"] >= 0
    printed = capsys.readouterr().out
    assert "$ kvtier bench e2e" in printed
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped" in printed
    else:
        assert (tmp_path / "e2e_tokens.png").exists()


@pytest.mark.multiprocess
def test_e2e_with_a_peer_and_a_jsonl_trace(tmp_path):
    # 20 conversations of 6 blocks, twice: the second pass finds them only at the peer.
    lines = [
        {"timestamp": p * 100 + c, "hash_ids": [c * 100 + j for j in range(6)]}
        for p in range(2)
        for c in range(20)
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "e2e.json"
    args = [
        "--workload",
        str(trace),
        "--real-fraction",
        "1",
        "--remote-fraction",
        "1",
        *TINY,
        "--no-raw-nixl",
    ]
    assert main([*args, "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    run = fig["workloads"]["trace"]
    assert set(fig["tiers"]) == {"host", "disk", "remote"}
    assert run["requests"] == 40
    assert sum(run["tokens"].values()) == 40 * 6 * fig["shape"]["block_tokens"]
    assert fig["tiers"]["remote"]["hits"] > 0 and run["tokens"]["remote"] > 0
    assert run["checked_blocks"] == sum(fig["tiers"][k]["hits"] for k in fig["tiers"])
    assert fig["tiers"]["remote"]["bytes_written"] > 0  # write-through to the peer this run started


def test_an_unknown_workload_is_refused(capsys):
    assert main(["--workload", "no-such-trace"]) == 2
    assert "unknown workload" in capsys.readouterr().err
