"""``bench.serve_requests``: the per-request records behind a row's p99 (no server)."""

from __future__ import annotations

from bench import serve_requests


def client(starts, ttfts, errors=None):
    return {
        "start_times": starts,
        "ttfts": ttfts,
        "errors": errors or [""] * len(starts),
        "input_lens": [3] * len(starts),
    }


def test_prompts_are_grouped_by_their_shared_words_and_the_first_sent_of_each_is_marked():
    prompts = ["aaa bbb x1", "ccc ddd x2", "aaa bbb x3", "ccc ddd x4"]
    # Request 2 was sent before request 0 (the client's order is not the order of sending).
    rows = serve_requests.records(client([5.0, 5.0, 4.0, 6.0], [1.0, 3.0, 0.5, 0.2]), prompts, 2)
    assert [r.prefix for r in rows] == [0, 1, 0, 1]
    assert [r.first_of_prefix for r in rows] == [False, True, True, False]
    assert [r.start_s for r in rows] == [1.0, 1.0, 0.0, 2.0]
    # Prefills that overlap: 0 [5, 6) and 1 [5, 8); 3 [6, 6.2) overlaps 1 only; 2 [4, 4.5) none.
    assert [r.prefills_beside for r in rows] == [1, 2, 0, 1]
    (slowest, second) = serve_requests.slowest(rows, 2)
    assert (slowest["index"], second["index"]) == (1, 0)
    assert serve_requests.describe(slowest) == "#1 3.00 s (prefix 1, first; 2 beside, sent at 1.0 s)"


def test_without_a_shared_prefix_every_request_is_a_cold_one_and_failures_are_never_the_slowest():
    rows = serve_requests.records(client([0.0, 1.0], [0.0, 0.4], ["refused", ""]), ["a b", "a b"], 0)
    assert [(r.prefix, r.first_of_prefix) for r in rows] == [(None, True), (None, True)]
    assert [r["index"] for r in serve_requests.slowest(rows)] == [1]
    assert "no shared prefix" in serve_requests.describe(serve_requests.slowest(rows)[0])


def test_the_random_datasets_options_take_vllms_names_and_reach_its_client():
    from bench import serve_client

    args = serve_client.parse_args(
        [
            "--dataset",
            "random",
            "--random-input-len",
            "256",
            "--random-output-len",
            "32",
            "--random-prefix-len",
            "2000",
        ]
    )
    assert (args.input_len, args.output_len, args.random_prefix_len) == (256, 32, 2000)
    load = serve_client.Load(dataset="random", input_len=256, output_len=32, random_prefix_len=2000)
    argv = load.client_argv(8000, "m")
    for flag, value in (
        ("--random-input-len", "256"),
        ("--random-output-len", "32"),
        ("--random-prefix-len", "2000"),
    ):
        assert argv[argv.index(flag) + 1] == value
    assert (load.shared_len, load.longest_prompt) == (2000, 2256)
