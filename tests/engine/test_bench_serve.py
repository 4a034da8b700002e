"""``kvtier bench serve`` end to end in vLLM's real CPU engine, at a small size: every row
starts, answers every request, and says where its prompt tokens came from. No timing is
asserted (figures belong to the benchmark's run, not to a test); what is checked is that
the accounting holds together and tells the rows apart."""

from __future__ import annotations

import json

from bench import serve


def test_bench_serve_runs_every_row_and_accounts_for_every_prompt_token(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["--workloads", "agentic,no-reuse", "--rows", "vllm,host,disk", "--scale", "0.25", "--quiet"]
    assert serve.main([*argv, "--json", str(out), "--plot", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out
    assert "targets (issue 15)" in printed
    result = json.loads(out.read_text())
    agentic, no_reuse = result["figures"]["agentic"], result["figures"]["no-reuse"]

    # The burst came after the device cache was emptied: vLLM alone recomputed the prefix
    # once; the burst's other request waited for it and found it in the device cache.
    assert agentic["classes"][:2] == ["first", "device-miss"]
    assert agentic["classes"][2] in ("device-hit", "device-miss")
    for name in ("host", "disk"):
        tokens = agentic["rows"][name]["tokens"]
        # kvtier's loaded tokens are the rows it reports loading, by tier, to the token.
        assert tokens["kvtier"] == sum(tokens["kvtier_by_tier"].values()) > 0
        assert tokens["prompt"] == tokens["computed"] + tokens["device"] + tokens["kvtier"]
        assert agentic["rows"][name]["same_tokens_as_vllm"] == 3
    assert set(agentic["rows"]["host"]["tokens"]["kvtier_by_tier"]) == {"host"}
    assert agentic["rows"]["vllm"]["tokens"]["kvtier"] == 0
    # Nothing to reuse: no row loads anything, every prompt token is computed.
    for row in no_reuse["rows"].values():
        assert row["tokens"]["computed"] == row["tokens"]["prompt"]
    assert {c["workload"] for c in result["targets"]} == {"agentic", "no-reuse"}
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "serve-agentic.png",
        "serve-no-reuse.png",
        "serve-summary.png",
    ]


def test_bench_serve_pd_loads_what_the_prefill_engine_stored(capsys):
    """``kvtier bench serve --pd`` at a small size: D loads every row P stored (another block
    size: 64-token rows into 32-token blocks) and computes the prompts nobody stored."""
    assert serve.main(["--pd", "--prompts", "1", "--prompt-tokens", "400"]) == 0
    printed = capsys.readouterr().out
    assert "tokens D loaded per stored prompt [384]" in printed  # (400 - 1) // 64 rows of 64
    assert "D computes it" in printed
