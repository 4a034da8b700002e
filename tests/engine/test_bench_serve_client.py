"""``kvtier bench serve --client vllm`` end to end at its smallest: a real ``vllm serve`` per row
(vLLM alone, + kvtier host, disk, peer) driven by vLLM's own benchmark client. No timing is
asserted; what is checked is that every row ran every request and that the rows tell
themselves apart by where their prompt tokens came from, as the server's own metrics say."""

from __future__ import annotations

import json

from bench import serve

ROWS = ("vllm", "host", "disk", "peer")


def test_bench_serve_client_vllm_has_every_row_and_kvtier_rows_hit(tmp_path, capsys):
    out = tmp_path / "client.json"
    # Three prefixes of 9 blocks each over a device cache of 11 blocks (one vLLM keeps aside):
    # a prefix that comes back after another one was served is gone from the device cache,
    # and only kvtier has it.
    argv = [
        "--client", "vllm", "--rows", ",".join(ROWS), "--num-prompts", "6", "--num-prefixes", "3",
        "--prefix-len", "256", "--suffix-len", "32", "--output-len", "2", "--concurrency", "1",
        "--device-blocks", "11", "--json", str(out),
    ]  # fmt: skip
    assert serve.main(argv) == 0
    printed = capsys.readouterr().out
    assert "+ kvtier host + peer" in printed
    result = json.loads(out.read_text())
    figures = result["figures"]

    assert tuple(figures) == ROWS
    for name, row in figures.items():
        assert row["completed"] == 6 and row["failed"] == 0, name
        assert row["tokens"]["prompt"] == 6 * 288, name
        assert row["ttft_s"]["mean"] > 0, name
    assert figures["vllm"]["tokens"]["kvtier"] == 0
    assert "vs_vllm" not in figures["vllm"]
    for name in ("host", "disk", "peer"):
        assert figures[name]["tokens"]["kvtier"] > 0, f"{name}: kvtier loaded nothing"
        assert set(figures[name]["vs_vllm"]) == {"mean", "median", "p99", "requests_per_s"}
    assert result["load"]["dataset"] == "prefix_repetition"
