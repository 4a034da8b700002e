"""Block-key traces: deterministic generators and the JSONL loader of the real trace.

A trace is a list of ``Request``\\ s in arrival order. A request carries the prefix-chained
keys of its prompt's full blocks: two requests share a key exactly where they share the
whole prefix up to and including that block, so a key names its whole prefix and its
predecessor is the key before it in any request that holds it. That is how vLLM hashes
blocks and how the production trace in ``../shared/traces/`` is written (with one more id
per prompt, its partial last block's, which the loader drops: vLLM hashes full blocks
only), and it is all a prefix cache can see.

Generators (every one deterministic from its ``seed``; sizes are chosen so a replay of
each takes about a second):

- ``multi_turn``: chat sessions whose context grows turn by turn, with think times
  between turns, under a system prompt shared by every session.
- ``long_doc_qa``: a few long documents, many short questions about them, in bursts on
  one document (a user reading it) over a Zipf popularity of documents.
- ``agentic``: tasks under one long shared system prompt (tool definitions); each step
  appends a tool call and its result, and some steps branch (retries, parallel calls).
- ``scan_mix``: one-off long prompts (summarise this file) between requests on a few hot
  prefixes: the pattern that flushes a plain LRU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REAL_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"
"""The production trace (Mooncake FAST'25 conversation trace, 512-token blocks)."""
TRACE_BLOCK_TOKENS = 512
"""Tokens per hash id in the production trace's format: its last id covers the prompt's
partial block whenever ``input_length`` is not a multiple of this (12,009 of its 12,031
requests, 4.2% of its ids)."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its arrival time in ms and its prompt's prefix-chained block keys."""

    timestamp: float
    keys: tuple[int, ...]


class _Blocks:
    """Hands out fresh block ids; a chain extended twice from one point gets distinct ids."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def new(self, n: int) -> tuple[int, ...]:
        return tuple(next(self._next) for _ in range(n))


def _sorted(requests: list[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.timestamp)


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int = 1, high: int = 400) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


THINK_MEDIAN_MS = 120_000.0
THINK_SIGMA = 0.95
"""``multi_turn``'s think time between turns: log-normal, this median and sigma."""


def continuation_probability(turn: int) -> float:
    """The chance that a ``multi_turn`` conversation goes on after its ``turn``-th turn."""
    return min(0.78, 0.22 + 0.09 * turn)


def multi_turn(
    seed: int = 0,
    sessions: int = 3_000,
    system_blocks: int = 1,
    mean_arrival_ms: float = 1_000.0,
    think_median_ms: float = THINK_MEDIAN_MS,
) -> list[Request]:
    """Chat sessions: each turn's prompt is the whole conversation so far plus a new message.

    Calibrated to the production trace (``../shared/traces``, 512-token blocks), where it
    was measured: the chance of another turn grows with the turns already taken (0.31
    after the first, 0.42, 0.51, 0.59, ... about 0.75 from the seventh: long chats go on),
    think times are log-normal (median 2 minutes, 90th percentile 8), a first prompt has
    ~11 blocks (log-normal, 90th percentile ~50) and a turn adds ~2 (heavy tail to ~20).
    Sessions arrive as a Poisson process under a system prompt shared by all.
    """
    rng = random.Random(seed)
    blocks = _Blocks()
    system = blocks.new(system_blocks)
    requests: list[Request] = []
    start = 0.0
    for _ in range(sessions):
        start += rng.expovariate(1.0 / mean_arrival_ms)
        context = system + blocks.new(_lognormal_int(rng, 11.0, 1.2))
        t = start
        turn = 1
        while True:
            requests.append(Request(t, context))
            if rng.random() >= continuation_probability(turn):
                break
            turn += 1
            t += rng.lognormvariate(math.log(think_median_ms), THINK_SIGMA)
            context = context + blocks.new(_lognormal_int(rng, 2.2, 1.4, high=60))
    return _sorted(requests)


def long_doc_qa(
    seed: int = 0,
    documents: int = 24,
    doc_blocks: tuple[int, int] = (80, 240),
    questions: int = 2_500,
    zipf_s: float = 1.1,
    mean_burst: float = 6.0,
) -> list[Request]:
    """Questions about long documents: system prompt, the document, then a 1-2 block question.

    Documents are picked by a Zipf law; a pick starts a burst of questions on it (a user
    reading it), so the same long prefix comes back in runs with gaps between runs.
    """
    rng = random.Random(seed)
    blocks = _Blocks()
    system = blocks.new(2)
    docs = [system + blocks.new(rng.randint(*doc_blocks)) for _ in range(documents)]
    weights = [1.0 / (i + 1) ** zipf_s for i in range(documents)]
    requests: list[Request] = []
    t = 0.0
    while len(requests) < questions:
        doc = rng.choices(docs, weights)[0]
        for _ in range(1 + int(rng.expovariate(1.0 / mean_burst))):
            t += rng.expovariate(1.0 / 800.0)
            requests.append(Request(t, doc + blocks.new(rng.randint(1, 2))))
    return requests[:questions]


def agentic(
    seed: int = 0,
    tasks: int = 400,
    system_blocks: int = 8,
    mean_arrival_ms: float = 1_000.0,
    step_median_ms: float = 6_000.0,
    steps_median: float = 10.0,
    branch_probability: float = 0.15,
) -> list[Request]:
    """Agent tasks: a long shared system prompt, then tool calls and results, with branches.

    Each step sends the task's whole trajectory and appends 1-4 blocks (call and result);
    steps are seconds apart (model plus tool time, log-normal, median 6 s) and a task runs
    ~10 steps (log-normal, some run 50). With ``branch_probability`` a step forks 2-3
    branches from the same point (parallel tool calls, or retries after a failed call),
    each continued for a few steps; then the task goes on from one of them. Tasks arrive
    every second, so ~60 run at once: together more than the tier holds.
    """
    rng = random.Random(seed)
    blocks = _Blocks()
    system = blocks.new(system_blocks)
    requests: list[Request] = []
    start = 0.0

    def pause() -> float:
        return rng.lognormvariate(math.log(step_median_ms), 0.6)

    for _ in range(tasks):
        start += rng.expovariate(1.0 / mean_arrival_ms)
        t = start
        trajectory = system + blocks.new(rng.randint(1, 3))
        for _step in range(_lognormal_int(rng, steps_median, 0.8, high=80)):
            requests.append(Request(t, trajectory))
            t += pause()
            if rng.random() < branch_probability:
                branches = []
                for _ in range(rng.randint(2, 3)):
                    branch = trajectory + blocks.new(rng.randint(1, 4))
                    for _ in range(rng.randint(1, 3)):
                        requests.append(Request(t, branch))
                        t += pause()
                        branch = branch + blocks.new(rng.randint(1, 3))
                    branches.append(branch)
                trajectory = rng.choice(branches)
            else:
                trajectory = trajectory + blocks.new(rng.randint(1, 4))
    return _sorted(requests)


def scan_mix(
    seed: int = 0,
    requests: int = 6_000,
    hot_prefixes: int = 400,
    hot_blocks: tuple[int, int] = (8, 40),
    scan_probability: float = 0.08,
    scan_blocks: tuple[int, int] = (100, 400),
) -> list[Request]:
    """Hot prefixes (Zipf) with a short unique suffix, interleaved with one-off long scans."""
    rng = random.Random(seed)
    blocks = _Blocks()
    system = blocks.new(2)
    hot = [system + blocks.new(rng.randint(*hot_blocks)) for _ in range(hot_prefixes)]
    weights = [1.0 / (i + 1) for i in range(hot_prefixes)]
    out: list[Request] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(1.0 / 500.0)
        if rng.random() < scan_probability:
            out.append(Request(t, system + blocks.new(rng.randint(*scan_blocks))))
        else:
            out.append(Request(t, rng.choices(hot, weights)[0] + blocks.new(rng.randint(1, 3))))
    return out


GENERATORS: dict[str, Callable[..., list[Request]]] = {
    "multi-turn": multi_turn,
    "long-doc-qa": long_doc_qa,
    "agentic": agentic,
    "scan-mix": scan_mix,
}


HELD_OUT: dict[str, tuple[Callable[..., list[Request]], dict[str, object]]] = {
    "multi-turn-quick": (multi_turn, {"think_median_ms": 15_000.0, "system_blocks": 4}),
    "long-doc-qa-wide": (long_doc_qa, {"documents": 120, "zipf_s": 0.8, "mean_burst": 2.0}),
    "agentic-branchy": (agentic, {"tasks": 300, "branch_probability": 0.4, "steps_median": 6.0}),
    "scan-mix-heavy": (scan_mix, {"scan_probability": 0.25, "hot_prefixes": 1_500}),
}
"""Variants of the four families with other parameters (faster chats under a longer system
prompt, many documents read in short bursts, agents that branch more, more scans over more
hot prefixes): shapes users run that no policy here was tuned on. A policy is judged on
these, not only on the traces its parameters were chosen on."""


def trace_names() -> list[str]:
    """Every generated trace ``generate`` knows: the four families, then the held-out variants."""
    return [*GENERATORS, *HELD_OUT]


def generate(name: str, seed: int = 0) -> list[Request]:
    """A generated trace by name (see ``GENERATORS`` and ``HELD_OUT``)."""
    if name in HELD_OUT:
        generator, params = HELD_OUT[name]
        return generator(seed=seed, **params)
    try:
        generator = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}: choose one of {trace_names()}") from None
    return generator(seed=seed)


REAL_SPLIT = 0.5
"""Where the production trace is cut in time: ``real-early`` before, ``real-late`` after."""


def split_in_time(requests: list[Request], at: float = REAL_SPLIT) -> tuple[list[Request], list[Request]]:
    """The requests before and after the fraction ``at`` of the trace's time span.

    A policy tuned on the first part and judged on the second is judged on requests it has
    not seen: the late part starts cold (its conversations began earlier), as a restarted
    engine would.
    """
    if not requests:
        return [], []
    first, last = requests[0].timestamp, requests[-1].timestamp
    cut = first + at * (last - first)
    early = [r for r in requests if r.timestamp < cut]
    return early, requests[len(early) :]


def iter_jsonl(path: str | Path, block_tokens: int | None = TRACE_BLOCK_TOKENS) -> Iterator[Request]:
    """Requests from a JSONL file, one ``{"timestamp": ms, "hash_ids": [...]}`` object a line.

    vLLM hashes a prompt's full blocks only, so a partial last block is never looked up,
    loaded or offloaded. With ``block_tokens``, a record whose ``input_length`` is not a
    multiple of it loses its last id (that partial block's), and a record left without a
    full block is skipped (nothing a prefix cache would see); its ids must number
    ``ceil(input_length / block_tokens)``, else it is a ``ValueError`` (the wrong block
    size). ``None`` keeps every id, as records without ``input_length`` are kept. (Kept,
    those ids were 4.2% of the production trace's, almost never read again: a policy could
    gain by evicting them first, which no vLLM engine would ever ask of it.)

    ``output_length`` is ignored; blank lines are skipped. A malformed line is a
    ``ValueError`` naming the file and line.
    """
    if block_tokens is not None and (isinstance(block_tokens, bool) or block_tokens < 1):
        raise ValueError(f"block_tokens must be a positive int or None, got {block_tokens!r}")
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                keys = tuple(int(k) for k in record["hash_ids"])
                timestamp = float(record.get("timestamp", 0))
                tokens = record.get("input_length")
                if block_tokens is not None and tokens is not None:
                    keys = _full_blocks(keys, int(tokens), block_tokens)
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record ({exc})") from exc
            if keys:
                yield Request(timestamp, keys)


def _full_blocks(keys: tuple[int, ...], tokens: int, block_tokens: int) -> tuple[int, ...]:
    """The ids of a prompt's full blocks: all of ``keys`` but a partial last one's."""
    if len(keys) != -(-tokens // block_tokens):
        raise ValueError(
            f"{len(keys)} hash ids for {tokens} input tokens: not {block_tokens}-token blocks "
            "(set the trace's block size, or none to keep every id)"
        )
    return keys if tokens % block_tokens == 0 else keys[:-1]


def add_block_tokens_option(parser: argparse.ArgumentParser) -> None:
    """``--trace-block-tokens`` for a command that loads a JSONL trace: the tokens per hash
    id (``args.trace_block_tokens``; 0 is ``None``: keep every id)."""

    def parse(text: str) -> int | None:
        value = int(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
        return value or None

    parser.add_argument(
        "--trace-block-tokens",
        type=parse,
        default=TRACE_BLOCK_TOKENS,
        metavar="N",
        help=f"tokens per hash id of a JSONL trace: a prompt's partial last block is dropped, as vLLM "
        f"hashes full blocks only (default {TRACE_BLOCK_TOKENS}, the production trace's; 0 keeps every id)",
    )


def load_jsonl(
    path: str | Path, fraction: float = 1.0, block_tokens: int | None = TRACE_BLOCK_TOKENS
) -> list[Request]:
    """The requests of a JSONL trace, in arrival order; ``fraction`` keeps the first part;
    ``block_tokens`` as ``iter_jsonl`` takes it (partial last blocks dropped).

    Keeping a leading fraction (not a sample) preserves what a prefix cache depends on:
    the reuse between neighbouring requests of the same conversation.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"trace fraction must be in (0, 1], got {fraction!r}")
    requests = _sorted(list(iter_jsonl(path, block_tokens)))
    return requests[: max(1, round(len(requests) * fraction))] if requests else []


def trace_stats(requests: list[Request]) -> dict[str, float]:
    """Size of a trace, and the block hit ratio an infinite prefix cache would reach."""
    seen: set[int] = set()
    accesses = hits = 0
    for request in requests:
        run = True
        for key in request.keys:
            accesses += 1
            if run and key in seen:
                hits += 1
            else:
                run = False
            seen.add(key)
    return {
        "requests": len(requests),
        "accesses": accesses,
        "distinct": len(seen),
        "infinite_hit_ratio": hits / accesses if accesses else 0.0,
    }
