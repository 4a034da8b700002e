"""Per-request TTFTs of a ``kvtier bench serve --client vllm`` row, and what each request met.

A row's p99 TTFT is one request (nearest rank: of 64 requests, the slowest), so a p99 worse
than vLLM alone's says nothing until that request is known. Per request, from the client's
own records (``--save-detailed``: ``start_times``, ``ttfts``) and the prompts it sent:

- ``prefix``: which shared prefix the prompt starts with (numbered as first sent), ``None``
  without one; ``first_of_prefix``: sent before any other request of its prefix (or it has
  none), so no cache of any row could serve it: a cold miss in every row;
- ``prefills_beside``: other requests whose time to first token overlapped this one's: the
  prefills (and the decode steps between them) it was queued or batched with;
- ``start_s``: when it was sent, seconds after the row's first request.

``slowest`` names a row's slowest requests with those facts, the evidence for what its p99 is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    index: int  # the client's order: the order it sent them in
    start_s: float
    ttft_s: float
    prompt_len: int
    prefix: int | None
    first_of_prefix: bool
    prefills_beside: int
    error: str


def prefix_ids(prompts: Sequence[str], shared_words: int) -> list[int | None]:
    """Per prompt, its shared prefix's number (the order it was first seen in): prompts whose
    first ``shared_words`` words match share it. The benchmark's tokenizer is a word a token
    (``bench.vllm_server.write_tokenizer``), so words are tokens. ``None`` for every prompt
    where ``shared_words`` is 0."""
    if shared_words <= 0:
        return [None] * len(prompts)
    seen: dict[tuple[str, ...], int] = {}
    return [seen.setdefault(tuple(prompt.split()[:shared_words]), len(seen)) for prompt in prompts]


def records(client: dict[str, Any], prompts: Sequence[str], shared_words: int) -> list[RequestRecord]:
    """The client's result (``vllm.benchmarks.serve.main`` with ``--save-detailed``, in the
    order it sent ``prompts``) as one record per request."""
    starts, ttfts, errors = client["start_times"], client["ttfts"], client["errors"]
    if not len(starts) == len(ttfts) == len(errors) == len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(starts)} start times and {len(ttfts)} TTFTs")
    prefixes = prefix_ids(prompts, shared_words)
    first_start: dict[int, float] = {}
    for prefix, start in zip(prefixes, starts, strict=True):
        if prefix is not None:
            first_start[prefix] = min(start, first_start.get(prefix, start))
    origin = min(starts) if starts else 0.0
    out = []
    for i, (start, ttft, error, prefix) in enumerate(zip(starts, ttfts, errors, prefixes, strict=True)):
        end = start + ttft
        spans = enumerate(zip(starts, ttfts, strict=True))
        beside = sum(1 for j, (s, t) in spans if j != i and s < end and start < s + t)
        out.append(
            RequestRecord(
                index=i,
                start_s=start - origin,
                ttft_s=ttft,
                prompt_len=client["input_lens"][i],
                prefix=prefix,
                first_of_prefix=prefix is None or start == first_start[prefix],
                prefills_beside=beside,
                error=error or "",
            )
        )
    return out


def slowest(rows: Sequence[RequestRecord], count: int = 3) -> list[dict[str, Any]]:
    """The ``count`` slowest answered requests (the first is the p99 of up to 100), as dicts."""
    answered = [r for r in rows if not r.error]
    return [asdict(r) for r in sorted(answered, key=lambda r: r.ttft_s, reverse=True)[:count]]


def describe(record: dict[str, Any]) -> str:
    """One request as the report prints it: ``#12 2.10 s (prefix 3, first; 3 beside, at 4.2 s)``."""
    if record["prefix"] is None:
        what = "no shared prefix"
    else:
        what = f"prefix {record['prefix']}{', first' if record['first_of_prefix'] else ''}"
    return (
        f"#{record['index']} {record['ttft_s']:.2f} s ({what}; {record['prefills_beside']} beside,"
        f" sent at {record['start_s']:.1f} s)"
    )
