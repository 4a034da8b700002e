"""``kvtier bench serve`` without an engine: its workloads, the request classes that keep a
device-cache hit from counting as kvtier's, the figures and the targets. The benchmark run
in a real engine is tested in ``tests/engine/test_bench_serve.py``."""

from __future__ import annotations

import pytest

from bench import serve
from bench.serve_workloads import WORKLOADS, Phase, Workload, build, seen_before

BLOCK = 32


def _request(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "arrival_s": 0.0}


def test_workloads_are_deterministic_and_share_no_prefix_with_each_other():
    first = {name: build(name, seed=1000 + i) for i, name in enumerate(WORKLOADS)}
    again = {name: build(name, seed=1000 + i) for i, name in enumerate(WORKLOADS)}
    assert all(first[n].requests == again[n].requests for n in WORKLOADS)
    heads = [{tuple(r["prompt"][:BLOCK]) for r in w.requests} for w in first.values()]
    assert all(not (a & b) for i, a in enumerate(heads) for b in heads[i + 1 :])
    assert build("doc-qa", seed=1).requests != build("doc-qa", seed=2).requests


def test_scale_multiplies_the_request_count_only():
    small, large = build("doc-qa", 0, scale=0.5), build("doc-qa", 0, scale=2.0)
    assert (len(small.requests), len(large.requests)) == (36, 144)
    assert {len(r["prompt"]) for r in small.requests} == {len(r["prompt"]) for r in large.requests}
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        build("chat", 0)


def test_seen_before_counts_whole_blocks_of_a_prefix_an_earlier_prompt_began_with():
    a = list(range(100, 100 + 4 * BLOCK))
    requests = [
        _request(a),
        _request(a[: 3 * BLOCK] + [7] * BLOCK),  # shares three blocks
        _request([9] * BLOCK + a[BLOCK : 3 * BLOCK]),  # same blocks 2-3, another first block: no hit
        _request([*a, 1]),  # the whole of a (a's last token was never cacheable; now it is)
    ]
    assert seen_before(requests, BLOCK) == [0, 3 * BLOCK, 0, 3 * BLOCK]


def test_the_agentic_burst_reuses_the_prefix_and_no_reuse_reuses_nothing():
    agentic = build("agentic", 0)
    assert [p.reset_device for p in agentic.phases] == [False, True]
    reuse = seen_before(agentic.requests, BLOCK)
    assert reuse[0] == 0 and all(r >= 3000 - BLOCK for r in reuse[1:])
    assert sum(seen_before(build("no-reuse", 0).requests, BLOCK)) == 0
    assert sum(seen_before(build("doc-qa", 0).requests, BLOCK)) > 0


def _outputs(ttfts: list[float], cached: list[int], external: list[int] | None = None) -> dict:
    external = external or [0] * len(ttfts)
    return {
        "outputs": [
            {"ttft_s": t, "num_cached_tokens": c, "external_cached_tokens": e, "tokens": [1, 2]}
            for t, c, e in zip(ttfts, cached, external, strict=True)
        ],
        "steps": 10,
        "steps_waiting_on_loads": 0,
        "wall_s": 2.0,
        "loaded_rows_by_tier": {},
    }


def _three_requests_on_one_document():
    doc = list(range(1000, 1000 + 10 * BLOCK))
    other = list(range(5000, 5000 + 10 * BLOCK))
    return Workload("doc-qa", [Phase([_request([*doc, 1]), _request([*doc, 2]), _request(other)])])


def test_classes_keep_a_device_hit_apart_from_what_kvtier_serves():
    workload = _three_requests_on_one_document()
    alone_hit = _outputs([1.0, 0.05, 1.0], [0, 320, 0])
    assert serve.classify(workload, alone_hit["outputs"], BLOCK) == ["first", "device-hit", "first"]
    alone_miss = _outputs([1.0, 1.0, 1.0], [0, 0, 0])
    assert serve.classify(workload, alone_miss["outputs"], BLOCK) == ["first", "device-miss", "first"]


def test_figures_and_targets_tell_a_kvtier_that_helps_from_one_that_does_not():
    workload = _three_requests_on_one_document()
    alone = _outputs([1.0, 1.0, 1.0], [0, 0, 0])
    fast = _outputs([1.0, 0.1, 1.0], [0, 320, 0], [0, 320, 0])
    fast["loaded_rows_by_tier"] = {"host": 10}
    slow = _outputs([1.0, 0.5, 1.0], [0, 320, 0], [0, 320, 0])
    figures = serve.workload_figures(workload, {"vllm": alone, "host": fast, "disk": slow}, BLOCK)
    rows = figures["rows"]
    assert rows["host"]["classes"]["device-miss"]["speedup_vs_vllm"] == pytest.approx(10.0)
    assert rows["disk"]["classes"]["device-miss"]["speedup_vs_vllm"] == pytest.approx(2.0)
    assert rows["host"]["tokens"] == {
        "prompt": 3 * 10 * BLOCK + 2,
        "computed": 3 * 10 * BLOCK + 2 - 320,
        "device": 0,
        "kvtier": 320,
        "kvtier_by_tier": {"host": 320},
    }
    assert rows["vllm"]["tokens"]["kvtier"] == 0
    met = {(c["row"], c["target"].split()[0]): c["met"] for c in serve.targets({"doc-qa": figures})}
    assert met[("host", "device-miss")] is True
    assert met[("disk", "device-miss")] is False
    assert met[("host", "mean")] is True and met[("disk", "mean")] is True


def test_no_reuse_is_judged_against_noise_not_against_a_win():
    workload = build("no-reuse", 0, scale=1 / 6)
    alone = _outputs([1.0, 1.0], [0, 0])
    same = _outputs([1.05, 1.05], [0, 0])
    worse = _outputs([1.5, 1.5], [0, 0])
    figures = serve.workload_figures(workload, {"vllm": alone, "host": same, "disk": worse}, BLOCK)
    met = {c["row"]: c["met"] for c in serve.targets({"no-reuse": figures})}
    assert met == {"host": True, "disk": False}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workloads", "chat"], "unknown workload 'chat'"),
        (["--rows", "gpu"], "unknown row 'gpu'"),
        (["--scale", "0"], "--scale must be positive"),
        (["--device-blocks", "10"], "--device-blocks must hold"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_an_engine_it_says_how_to_get_one(monkeypatch, capsys):
    monkeypatch.setattr(serve, "engine_missing", lambda: "vLLM does not import here; make bench ...")
    assert serve.main(["--rows", "vllm"]) == 2
    assert "runs a real vLLM engine: vLLM does not import here" in capsys.readouterr().err
