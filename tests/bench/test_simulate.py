"""The trace generators, the JSONL loader, the simulator and its offline optimum."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from bench import traces
from bench.policy import main
from bench.simulate import TierSpec, device_prefix_hits, opt_hits, simulate
from bench.traces import (
    REAL_TRACE,
    TRACE_BLOCK_TOKENS,
    Request,
    add_block_tokens_option,
    iter_jsonl,
    load_jsonl,
    trace_stats,
)
from bench.vllm_baseline import vllm_version
from policies.registry import DEFAULT_POLICY

POLICIES = ["lru", "slru", "arc", "s3fifo", "tinylfu", "cost", "prefix:lru", "prefix:arc", "prefix:tinylfu"]


def small_traces(seed: int) -> dict[str, list[Request]]:
    return {
        "multi-turn": traces.multi_turn(seed=seed, sessions=150),
        "long-doc-qa": traces.long_doc_qa(seed=seed, documents=6, doc_blocks=(20, 60), questions=150),
        "agentic": traces.agentic(seed=seed, tasks=25),
        "scan-mix": traces.scan_mix(seed=seed, requests=300, hot_prefixes=20, scan_blocks=(20, 80)),
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_opt_bounds_every_policy_and_every_chain(seed: int) -> None:
    for name, trace in small_traces(seed).items():
        distinct = trace_stats(trace)["distinct"]
        device, host = max(1, distinct // 50), max(2, distinct // 10)
        hits = device_prefix_hits(trace, device)
        accesses = sum(len(r.keys) for r in trace)
        opt = opt_hits(trace, host, hits)
        results = {p: simulate(trace, [TierSpec("host", host, p)], device, hits) for p in POLICIES}
        for policy, result in results.items():
            assert sum(result.tier_hits) <= opt, (name, policy)
        assert opt > 0 and opt >= max(sum(r.tier_hits) for r in results.values()), name
        assert opt <= accesses - sum(hits)
        chain = simulate(
            trace,
            [
                TierSpec("host", host, "arc", placement={"write": "write-back"}),
                TierSpec("disk", 3 * host, "lru", placement={"write": "none", "admit": "seen-twice"}),
            ],
            device,
            hits,
        )
        assert sum(chain.tier_hits) <= opt_hits(trace, 4 * host, hits), name


def test_opt_is_belady_on_a_small_case() -> None:
    # One slot, no device: a, b, a, b, ... Belady keeps one of them; LRU thrashes.
    trace = [Request(t, (k,)) for t, k in enumerate([1, 2, 1, 2, 1, 2])]
    hits = device_prefix_hits(trace, 0)
    assert opt_hits(trace, 1, hits) == 2
    assert sum(simulate(trace, [TierSpec("host", 1, "lru")], 0, hits).tier_hits) == 0
    # A block the device serves is offered, not demanded: holding it below earns nothing.
    trace = [Request(0, (1, 2)), Request(1, (1, 2)), Request(2, (1, 3))]
    assert device_prefix_hits(trace, 10) == [0, 2, 1]
    assert opt_hits(trace, 5, device_prefix_hits(trace, 10)) == 0


def test_device_cache_is_an_lru_of_blocks_serving_prefixes() -> None:
    trace = [Request(0, (1, 2, 3)), Request(1, (1, 2, 4)), Request(2, (5, 6)), Request(3, (1, 2, 3))]
    # Capacity 4: after request 2 the device holds 5, 6 (newest), 1, 2; 3 and 4 are gone.
    assert device_prefix_hits(trace, 4) == [0, 2, 0, 2]
    assert device_prefix_hits(trace, 0) == [0, 0, 0, 0]


def test_tiers_serve_the_run_after_the_device_and_write_back_spills_down() -> None:
    first = [Request(i, (100 + i, 200 + i)) for i in range(6)]
    trace = first + [Request(6 + i, r.keys) for i, r in enumerate(reversed(first))]
    hits = device_prefix_hits(trace, 0)
    host_only = simulate(trace, [TierSpec("host", 4, "lru")], 0, hits)
    assert host_only.tier_hits == [4]  # only the last two requests' blocks are still in the host tier
    chain = simulate(
        trace,
        [TierSpec("host", 4, "lru", placement={"write": "write-back"}), TierSpec("disk", 20, "lru")],
        0,
        hits,
    )
    assert chain.tier_hits[0] + chain.tier_hits[1] == 12  # nothing is lost: the disk holds the rest
    assert chain.tier_hits[1] > 0
    assert chain.total_hit_ratio == pytest.approx(1.0 * 12 / 24)


def test_generators_are_deterministic_from_their_seed() -> None:
    for name in traces.GENERATORS:
        a, b = traces.generate(name, seed=3), traces.generate(name, seed=3)
        assert a == b and len(a) > 100
        assert traces.generate(name, seed=4) != a
        assert all(x.timestamp <= y.timestamp for x, y in itertools.pairwise(a))
    with pytest.raises(ValueError, match="unknown trace"):
        traces.generate("nope")


def test_generated_keys_are_prefix_chained() -> None:
    """A key names its whole prefix: wherever it appears, the key before it is the same."""
    for trace in small_traces(0).values():
        parent: dict[int, int | None] = {}
        for request in trace:
            for i, key in enumerate(request.keys):
                assert parent.setdefault(key, request.keys[i - 1] if i else None) == (
                    request.keys[i - 1] if i else None
                )
                assert len(set(request.keys)) == len(request.keys)


def test_jsonl_loader_reads_the_production_format(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 30, "input_length": 1536, "output_length": 7, "hash_ids": [0, 3, 4]},
        {"timestamp": 10, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 20, "hash_ids": [0, 1, 2]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    loaded = load_jsonl(path)
    assert [r.keys for r in loaded] == [(0, 1), (0, 1, 2), (0, 3, 4)]  # arrival order
    assert [r.timestamp for r in loaded] == [10.0, 20.0, 30.0]
    assert trace_stats(loaded) == {"requests": 3, "accesses": 8, "distinct": 5, "infinite_hit_ratio": 3 / 8}
    assert [r.keys for r in load_jsonl(path, fraction=0.34)] == [(0, 1)]
    with pytest.raises(ValueError, match="fraction"):
        load_jsonl(path, fraction=0)
    path.write_text('{"timestamp": 1, "hash_ids": [1]}\n{"timestamp": 2}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:2"):
        load_jsonl(path)


def test_jsonl_loader_drops_the_partial_last_block_vllm_never_hashes(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 1, "input_length": 1500, "hash_ids": [0, 3, 4]},  # 2 full blocks and 476 tokens
        {"timestamp": 2, "input_length": 1024, "hash_ids": [0, 1]},  # 2 full blocks
        {"timestamp": 3, "input_length": 300, "hash_ids": [9]},  # no full block: nothing to look up
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    assert [r.keys for r in load_jsonl(path)] == [(0, 3), (0, 1)]
    assert [r.keys for r in load_jsonl(path, block_tokens=None)] == [(0, 3, 4), (0, 1), (9,)]
    with pytest.raises(ValueError, match=r"trace.jsonl:1: .*not 256-token blocks"):
        load_jsonl(path, block_tokens=256)  # 1500 tokens are 6 such blocks, not 3
    with pytest.raises(ValueError, match="block_tokens"):
        load_jsonl(path, block_tokens=0)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason="the production trace is not checked out beside main")
def test_the_first_lines_of_the_production_trace_load_and_replay() -> None:
    head = list(itertools.islice(iter_jsonl(REAL_TRACE), 300))
    assert len(head) == 300 and all(r.keys and r.keys[0] == 0 for r in head)
    stats = trace_stats(head)
    assert 0 < stats["infinite_hit_ratio"] < 1
    hits = device_prefix_hits(head, 20)
    result = simulate(head, [TierSpec("host", 3_000, "prefix:arc")], 20, hits)
    assert 0 < sum(result.tier_hits) <= opt_hits(head, 3_000, hits)


def test_benchmark_runs_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "policy.json"
    argv = ["--traces", "scan-mix", "--policies", "lru,arc", "--no-vllm", "--no-throughput"]
    assert main([*argv, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    report = figures["traces"]["scan-mix"]
    assert set(report["policies"]) == {"lru", "arc"}
    assert all(0 <= v <= report["opt"] for v in report["policies"].values())
    assert 0 < report["online_index"] <= report["opt"] and report["law_index"] is None  # scan-mix has no law
    printed = capsys.readouterr().out
    assert "kvtier bench policy --traces scan-mix" in printed and "OPT (Belady)" in printed
    assert "index, online" in printed
    with pytest.raises(SystemExit):
        main(["--trace-fraction", "0"])


def test_the_host_size_sweep_reports_every_size_and_its_targets(tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    argv = ["--traces", "agentic", "--policies", "lru,arc", "--no-vllm", "--no-index", "--jobs", "1"]
    assert main([*argv, "--host-fractions", "0.2,0.05", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    small, large = figures["sweep"]["agentic"]  # smallest first
    assert small["host_blocks"] < large["host_blocks"]
    assert small["opt"] <= large["opt"]  # OPT never loses from a larger tier
    for report in (small, large):
        assert set(report["policies"]) == {"lru", "arc"} and not report["chain"]
        assert all(0 < v <= report["opt"] for v in report["policies"].values())
    assert set(figures["targets"]) == {"0.05", "0.2"}
    for fraction, report in (("0.05", small), ("0.2", large)):
        entry = figures["targets"][fraction]["agentic"]
        assert entry["hit_ratio"] == max(report["policies"].values())
        assert entry["within_5pct_of_opt"] == (entry["hit_ratio"] >= 0.95 * report["opt"])
    printed = capsys.readouterr().out
    assert "host size swept" in printed and "targets by host size" in printed
    for bad in ("0,0.1", "0.1,x", ","):
        with pytest.raises(SystemExit):
            main(["--host-fractions", bad])


def test_a_gain_over_vllm_that_even_opt_misses_is_flagged_out_of_reach() -> None:
    from bench.policy import TraceReport, targets

    def report(arc: float, opt: float) -> TraceReport:
        return TraceReport("agentic", {}, 1, 1, 0.0, policies={"adaptive": 0.705}, vllm={"arc": arc}, opt=opt)

    saturated = targets({"agentic": report(arc=0.70, opt=0.7332)})["agentic"]
    assert saturated["gain_beyond_opt"] and not saturated["beats_vllm_arc_by_10pct"]
    assert saturated["within_5pct_of_opt"]
    roomy = targets({"agentic": report(arc=0.50, opt=0.90)})["agentic"]
    assert (
        not roomy["gain_beyond_opt"] and roomy["beats_vllm_arc_by_10pct"] and not roomy["within_5pct_of_opt"]
    )


@pytest.mark.skipif(vllm_version() is None, reason="vLLM's offloading manager does not import")
def test_the_scheduler_table_drives_the_policy_directly_and_through_vllm(tmp_path, capsys) -> None:
    out = tmp_path / "drive.json"
    argv = ["--traces", "real-late", "--trace-fraction", "0.2", "--policies", "lru", "--jobs", "1"]
    argv += [
        "--drive-policies",
        f"lru,{DEFAULT_POLICY}",  # the targets are the default's
        "--drive-traces",
        "real-late",
        "--drive-host-fractions",
        "0.1,0.2",
    ]
    assert main([*argv, "--rounds", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    small, large = figures["drive"]["real-late"]
    for sizes in (small, large):
        assert sizes["direct:lru"]["hit_ratio"] == sizes["factory:lru"]["hit_ratio"] > 0
        assert {"vllm:lru", "vllm:arc"} <= set(sizes) and len(sizes["factory:lru"]["adapter"]) == 2
    assert small["host_blocks"] < large["host_blocks"]
    assert set(figures["drive_targets"]) == {"real-late@0.1", "real-late@0.2"}
    printed = capsys.readouterr().out
    assert "as vLLM drives it" in printed and "targets for the default" in printed


def test_the_block_size_option_parses_at_the_edge() -> None:
    parser = argparse.ArgumentParser()
    add_block_tokens_option(parser)
    assert parser.parse_args([]).trace_block_tokens == TRACE_BLOCK_TOKENS
    assert parser.parse_args(["--trace-block-tokens", "0"]).trace_block_tokens is None  # keep every id
    assert parser.parse_args(["--trace-block-tokens", "16"]).trace_block_tokens == 16
    with pytest.raises(SystemExit):
        parser.parse_args(["--trace-block-tokens", "-1"])


def test_on_multi_turn_the_gain_target_is_the_index_handed_the_generators_law(capsys) -> None:
    from bench.policy import TraceReport, print_targets, targets

    def report(law: float) -> TraceReport:
        return TraceReport(
            "multi-turn", {}, 1, 1, 0.0, policies={"lru": 0.255}, vllm={"arc": 0.24}, opt=0.33, law_index=law
        )

    assert targets({"multi-turn": report(law=0.25)})["multi-turn"]["reaches_law_index"]
    summary = targets({"multi-turn": report(law=0.26)})
    assert not summary["multi-turn"]["reaches_law_index"]
    print_targets(summary)
    printed = capsys.readouterr().out
    assert "[bound: NOT met]" in printed and "[+10%" not in printed  # not vLLM arc +10% there


def test_the_law_index_runs_on_multi_turn_only(tmp_path) -> None:
    out = tmp_path / "policy.json"
    argv = ["--traces", "multi-turn", "--policies", "lru", "--no-vllm", "--no-throughput", "--jobs", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())["traces"]["multi-turn"]
    assert report["online_index"] < report["law_index"] <= report["opt"]


def test_the_targets_judge_policies_a_configuration_can_name_not_the_learned_references() -> None:
    from bench.policy import TraceReport, targets

    def report(policies: dict[str, float]) -> TraceReport:
        return TraceReport("agentic", {}, 1, 1, 0.0, policies=policies, vllm={"arc": 0.40}, opt=0.60)

    mixed = report({"hazard": 0.49, "lhd": 0.47, "adaptive": 0.43, "lru": 0.40})
    assert mixed.best() == ("adaptive", 0.43) and mixed.best_reference() == ("hazard", 0.49)
    entry = targets({"agentic": mixed})["agentic"]
    assert entry["best"] == "adaptive" and not entry["beats_vllm_arc_by_10pct"]
    # Only references ran (``--policies hazard``): they are what there is to report.
    alone = report({"hazard": 0.49})
    assert alone.best() == ("hazard", 0.49)
    assert targets({"agentic": alone})["agentic"]["beats_vllm_arc_by_10pct"]
    assert report({"lru": 0.40}).best_reference() is None
