"""The workloads of ``kvtier bench serve``: token-id requests for a real vLLM engine.

Each workload is a list of phases run one after the other; a phase is a list of requests
vLLM gets on a schedule (``bench.vllm_engine``'s ``timed``), and may start by emptying
vLLM's device prefix cache (what an engine that served other traffic meanwhile would
have lost). Prompts are random token ids drawn from the workload's seed, so every engine
of a run is asked exactly the same thing, request for request.

- ``doc-qa``: questions about long documents (several thousand tokens), one after the
  other (each asked when the answer to the previous one is read), documents picked by a
  Zipf law: the hot ones come back while the device cache holds only about two.
- ``multi-turn``: chat sessions whose context grows turn by turn, interleaved, with the
  shape ``bench.traces.multi_turn`` was calibrated to on the production trace (the chance
  of another turn, the first prompt's and each turn's sizes), one ``traces`` block scaled
  to ``tokens_per_trace_block`` tokens.
- ``agentic``: one long shared prefix (system prompt and tool definitions), computed once,
  then lost from the device cache; then many requests on it arrive at once (vLLM #44294:
  requests queued behind one load there saw their TTFT inflate 12x).
- ``no-reuse``: fresh long prompts only: kvtier can only cost here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from bench.traces import THINK_SIGMA, _lognormal_int, continuation_probability

TOKEN_RANGE = (100, 30_000)  # ids the tiny model's vocabulary holds, clear of special tokens


@dataclass
class Phase:
    """Requests of one ``timed`` call; ``reset_device`` empties vLLM's device cache first."""

    requests: list[dict[str, Any]]
    reset_device: bool = False


@dataclass
class Workload:
    name: str
    phases: list[Phase]
    about: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> list[dict[str, Any]]:
        return [r for phase in self.phases for r in phase.requests]


class _Tokens:
    """Fresh random token ids: two calls never share a prefix by chance."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def new(self, n: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def document(seed: int, length: int) -> list[int]:
    """A prompt of ``length`` random token ids (a "document"), the same for the same seed."""
    return _Tokens(seed).new(length)


def _closed_loop(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "arrival_s": 0.0, "after_finish": True}


def doc_qa(
    seed: int = 0,
    documents: int = 6,
    doc_tokens: int = 3000,
    questions: int = 72,
    question_tokens: int = 32,
    zipf_s: float = 1.0,
    max_tokens: int = 16,
) -> Workload:
    tokens = _Tokens(seed)
    rng = random.Random(seed + 1)
    docs = [tokens.new(doc_tokens) for _ in range(documents)]
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(documents)]
    picks = rng.choices(range(documents), weights, k=questions)
    requests = [_closed_loop(docs[d] + tokens.new(question_tokens), max_tokens) for d in picks]
    return Workload(
        "doc-qa",
        [Phase(requests)],
        f"{questions} questions, one at a time, about {documents} documents of {doc_tokens} tokens"
        f" (Zipf {zipf_s})",
        {"documents": documents, "doc_tokens": doc_tokens, "questions": questions, "zipf_s": zipf_s},
    )


def multi_turn(
    seed: int = 0,
    sessions: int = 32,
    tokens_per_trace_block: int = 64,
    max_prompt_tokens: int = 4000,
    max_tokens: int = 16,
) -> Workload:
    """Sessions interleaved as their turns' arrival times interleave (``traces.multi_turn``'s
    laws: a session a second, think times of minutes, so a session's next turn comes back
    after many others, as in the production trace); each turn asked when the previous
    answer is read."""
    tokens = _Tokens(seed)
    rng = random.Random(seed + 1)
    system = tokens.new(tokens_per_trace_block)
    turns: list[tuple[float, list[int]]] = []
    start = 0.0
    for _ in range(sessions):
        start += rng.expovariate(1.0)  # a session a second (the trace's rate), minutes of thinking
        context = system + tokens.new(_lognormal_int(rng, 11.0, 1.2) * tokens_per_trace_block)
        t, turn = start, 1
        while len(context) <= max_prompt_tokens:
            turns.append((t, context))
            if rng.random() >= continuation_probability(turn):
                break
            turn += 1
            t += rng.lognormvariate(math.log(120.0), THINK_SIGMA)
            context = context + tokens.new(_lognormal_int(rng, 2.2, 1.4, high=60) * tokens_per_trace_block)
    turns.sort(key=lambda item: item[0])
    requests = [_closed_loop(prompt, max_tokens) for _, prompt in turns]
    return Workload(
        "multi-turn",
        [Phase(requests)],
        f"{len(requests)} turns of {sessions} chat sessions, interleaved, one at a time",
        {"sessions": sessions, "tokens_per_trace_block": tokens_per_trace_block, "turns": len(requests)},
    )


def agentic(
    seed: int = 0,
    prefix_tokens: int = 3000,
    concurrent: int = 8,
    suffix_tokens: int = 128,
    max_tokens: int = 16,
) -> Workload:
    tokens = _Tokens(seed)
    prefix = tokens.new(prefix_tokens)
    warm = Phase([{"prompt": prefix + tokens.new(suffix_tokens), "max_tokens": max_tokens, "arrival_s": 0.0}])
    burst = Phase(
        [
            {"prompt": prefix + tokens.new(suffix_tokens), "max_tokens": max_tokens, "arrival_s": 0.0}
            for _ in range(concurrent)
        ],
        reset_device=True,
    )
    return Workload(
        "agentic",
        [warm, burst],
        f"a {prefix_tokens}-token shared prefix computed once, lost from the device cache, "
        f"then {concurrent} requests on it at once",
        {"prefix_tokens": prefix_tokens, "concurrent": concurrent, "suffix_tokens": suffix_tokens},
    )


def no_reuse(seed: int = 0, prompts: int = 12, prompt_tokens: int = 2000, max_tokens: int = 16) -> Workload:
    tokens = _Tokens(seed)
    requests = [_closed_loop(tokens.new(prompt_tokens), max_tokens) for _ in range(prompts)]
    return Workload(
        "no-reuse",
        [Phase(requests)],
        f"{prompts} fresh prompts of {prompt_tokens} tokens, one at a time",
        {"prompts": prompts, "prompt_tokens": prompt_tokens},
    )


WORKLOADS = {"doc-qa": doc_qa, "multi-turn": multi_turn, "agentic": agentic, "no-reuse": no_reuse}
SIZE_KEYS = {
    "doc-qa": ("questions", 72),
    "multi-turn": ("sessions", 32),
    "agentic": ("concurrent", 8),
    "no-reuse": ("prompts", 12),  # single prompts vary by ~15% on 2 cores: enough of them to judge a 1.1x
}
"""The argument ``--scale`` multiplies in each workload, and its default."""


def warm_up(seed: int) -> list[list[int]]:
    """Prompts an engine computes once before it is timed: its first prefills of each size
    are slow (kernels built, memory touched), and no row should pay that in its figures."""
    tokens = _Tokens(seed)
    return [tokens.new(n) for n in (3000, 1000, 200)]


def build(name: str, seed: int, scale: float = 1.0) -> Workload:
    """Workload ``name``; ``scale`` multiplies its request (or session) count and nothing else."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: {', '.join(WORKLOADS)}")
    key, default = SIZE_KEYS[name]
    return WORKLOADS[name](seed=seed, **{key: max(1, round(default * scale))})


def seen_before(requests: list[dict[str, Any]], block: int) -> list[int]:
    """Per request, the prompt tokens (whole blocks) some earlier prompt began with: what a
    cache that kept everything could have served. Blocks are chained as vLLM hashes them."""
    seen: set[int] = set()
    out = []
    for request in requests:
        prompt = request["prompt"]
        full = (len(prompt) - 1) // block  # vLLM never caches a prompt's last token
        chain, hits, missed = 0, 0, False
        for i in range(full):
            chain = hash((chain, tuple(prompt[i * block : (i + 1) * block])))
            if not missed and chain in seen:
                hits += 1
            else:
                missed = True
            seen.add(chain)
        out.append(hits * block)
    return out
