"""``kvtier bench e2e`` at tiny sizes: the JSON it writes, byte checks, token accounting."""

import io
import json
import sys

import pytest

from bench.e2e import main
from bench.e2e_workload import SOURCES, DeviceCache, Replay, Shape, block_key, clip, pattern
from bench.progress import Progress
from bench.traces import Request
from bench.vllm_baseline import vllm_version
from offload.api import Offloader

TINY = ["--requests", "30", "--miss-requests", "4", "--max-blocks", "12", "--prompt-blocks", "2", "--quiet"]


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
    assert main(["--workload", "agentic", "--no-remote", *TINY, "--json", str(out)]) == 0
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
    side = run["side_by_side"]
    assert {"kvtier host", "kvtier host+disk"} <= set(side["rows"]) and "per_request" not in side
    assert side["rows"]["kvtier host+disk"]["tokens"] == tokens
    printed, err = capsys.readouterr()
    assert "$ kvtier bench e2e" in printed and "side by side" in printed
    assert err == ""  # --quiet: no progress bar


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


def reversed_revisit_trace(path):
    """20 six-block conversations, then the same in reverse: the device keeps the last few,
    a host tier of half the blocks serves the next six, the rest is recomputed (under LRU)."""
    order = [*range(20), *reversed(range(20))]
    lines = [{"timestamp": t, "hash_ids": [c * 100 + j for j in range(6)]} for t, c in enumerate(order)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_side_by_side_with_vllm_on_the_same_key_stream(tmp_path):
    trace = reversed_revisit_trace(tmp_path / "revisit.jsonl")
    out = tmp_path / "e2e.json"
    argv = ["--workload", str(trace), "--real-fraction", "1", "--host-fraction", "0.5", "--no-remote"]
    assert main([*argv, *TINY, "--json", str(out)]) == 0
    side = json.loads(out.read_text())["workloads"]["revisit"]["side_by_side"]
    assert side["host_blocks"] == 60 and side["device_blocks"] == 24 and "modelled" in side["method"]
    rows = side["rows"]
    total = 40 * 6 * Shape().block_tokens
    for name, row in rows.items():
        assert sum(row["tokens"].values()) == total, name
        assert row["tokens"]["device"] == rows["kvtier host"]["tokens"]["device"], name  # one device cache
        assert row["ttft"]["achieved"]["mean_ms"] > 0 and row["ttft"]["ceiling"]["mean_ms"] > 0
    host = rows["kvtier host"]
    assert host["served_tokens"] == host["tokens"]["host"] > 0
    if vllm_version() is None:
        assert side["vllm"] is None and not any(name.startswith("vLLM") for name in rows)
        return
    assert {"vLLM CPU lru", "vLLM CPU arc"} <= set(rows)
    # One LRU host tier of the same size on the same key stream: the same blocks served.
    assert rows["vLLM CPU lru"]["tokens"] == host["tokens"]
    assert rows["vLLM CPU arc"]["tier_hit_ratio"] > 0


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    plots = tmp_path / "plots"
    assert main(["--workload", "agentic", "--no-remote", *TINY, "--plot", str(plots)]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install" in err and ".[bench]" in err
    assert not plots.exists()  # refused before running anything


def test_plot_writes_the_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra: make test installs it")
    trace = reversed_revisit_trace(tmp_path / "revisit.jsonl")
    plots = tmp_path / "plots"
    argv = ["--workload", f"agentic,{trace}", "--real-fraction", "1", "--no-remote", *TINY]
    assert main([*argv, "--plot", str(plots)]) == 0
    names = {"e2e_hit_ratio.png", "e2e_load_latency_cdf.png", "e2e_ttft.png", "e2e_tokens.png"}
    assert {p.name for p in plots.iterdir()} == names
    for name in names:
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_draws_on_a_terminal_only():
    tty = Terminal()
    bar = Progress("replay", 4, stream=tty, interval_s=0.0)
    for done in range(1, 5):
        bar(done)
    lines = tty.getvalue()
    assert lines.count("\r") == 4 and lines.endswith("\n") and "4/4" in lines and "#" * 24 in lines
    for stream, enabled in ((io.StringIO(), True), (Terminal(), False)):  # a log file; --quiet
        bar = Progress("replay", 4, stream=stream, enabled=enabled, interval_s=0.0)
        for done in range(1, 5):
            bar(done)
        assert stream.getvalue() == ""
