"""How far an online policy could go: index policies handed the trace's own statistics.

Belady's OPT knows the future; an online policy knows only the past. Between the two sits
the best an online policy could do if it had learned *perfectly* how blocks like this one,
at this age, are reused: evict the chain tail whose state promises the fewest hits per
slot-time. This module replays such oracle-informed index policies, with true timestamps
(which kvtier's policies do not get: they count events). They are evidence, not proofs (a
policy that ranks blocks one by one is not the only kind, and sampling only approximates
the ranking), but a target they miss leaves an online policy of that kind, which must
learn what they are given, little room:

- ``generator`` (multi-turn only): the index is computed from the law ``multi_turn`` draws
  from (``bench.traces``): a conversation after turn ``k`` continues with probability
  ``min(0.78, 0.22 + 0.09 k)`` and the think time is log-normal (median 2 min, sigma
  0.95), independent of everything else. A block's state is its conversation's turn count
  and idle time; its value is the posterior probability that the conversation goes on,
  over the expected time until it does. Nothing else in that trace predicts reuse.
- ``horizon`` (multi-turn only): the same law and state, valued as LHD and ``hazard``
  value a class: the most returns per slot-time over any holding horizon from the block's
  idle time on (a block given up at the horizon frees its slot), instead of over the whole
  expected wait, which the think time's long tail stretches.
- ``fitted``: a table of hit density by class and age, fitted on a trace: for every use of
  a block, the time to its next use that the tiers must serve (a use the device serves
  does not count). Classes: turn count (capped at 8), uses so far (capped at 4), whether it
  is the request's last block, and the request's new blocks (six buckets). By default a
  generated trace's table is fitted on another draw of the same generator (the next
  seed): perfect knowledge of the law's statistics, none of this trace's future; the
  production trace's halves (``real-early``, ``real-late``) are fitted on each other, the
  same service at another time. Fitted on the replayed trace itself (``--fit-on same``, the
  default for the whole production trace) the table also knows, in its rare classes, that
  trace's own future: a figure that flatters. Refitted on the replayed trace's past as it
  goes (``--fit-on past``, ``PastTable``) it is an index policy that learns online, with
  true timestamps: a reference, not a bound (a better learner may beat it).

Both sample 64 chain tails per victim (``lhd``'s eviction, as ``hazard`` does). Run
``python -m bench.index_bound --help``.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from bench.learned_policies.hit_density import HitDensityPolicy
from bench.simulate import Tier, TierChain, device_prefix_hits
from bench.traces import (
    REAL_TRACE,
    THINK_MEDIAN_MS,
    THINK_SIGMA,
    Request,
    add_block_tokens_option,
    continuation_probability,
    generate,
    load_jsonl,
    split_in_time,
    trace_names,
    trace_stats,
)
from policies.base import Key
from policies.placement import make_placement

EDGES_MS = (
    [0.0]
    + [1000.0 * s for s in (2, 5, 10, 15, 20, 30, 45, 60, 80, 100, 130, 160, 200, 250, 300, 400)]
    + [1000.0 * s for s in (500, 650, 800, 1000, 1300, 1600, 2000, 2600, 3300, 4000, 6000)]
)
"""Age bins (ms) of the fitted table."""


def turns(trace: Sequence[Request]) -> list[int]:
    """Each request's turn: 1, or one more than the request whose stored blocks it extends
    (by at least two blocks, so that sharing only a system prompt is not a turn)."""
    first: dict[int, int] = {}
    out: list[int] = []
    for i, request in enumerate(trace):
        k = 0
        for key in request.keys:
            if key not in first:
                break
            k += 1
        out.append(out[first[request.keys[k - 1]]] + 1 if k > 1 else 1)
        for key in request.keys[k:]:
            first[key] = i
    return out


def new_blocks(trace: Sequence[Request]) -> list[int]:
    """Each request's blocks never seen before."""
    seen: set[int] = set()
    out = []
    for request in trace:
        k = 0
        for key in request.keys:
            if key not in seen:
                break
            k += 1
        out.append(len(request.keys) - k)
        seen.update(request.keys)
    return out


class ClockedIndex(HitDensityPolicy):
    """Evicts the sampled chain tail of least ``value(state, now - stamp)``: ``lhd``'s chain
    bookkeeping and sampling, with the value handed in instead of learned. The replay sets
    ``now`` and each request's ``state`` before the request's calls (an oracle's policy,
    for bounds)."""

    name = "clocked-index"

    def __init__(self, capacity: int, value: Callable[[object, float], float], samples: int = 64) -> None:
        super().__init__(capacity, samples=samples)
        self.value = value
        self.now = 0.0
        self.state: Callable[[Key], object] = lambda _key: None
        self._stamp: dict[Key, tuple[object, float]] = {}

    def density(self, key: Key) -> float:
        state, then = self._stamp[key]
        return self.value(state, self.now - then)

    def on_insert_run(self, keys: Sequence[Key], parent: Key | None = None) -> None:
        for key in keys:
            self._stamp[key] = (self.state(key), self.now)
        super().on_insert_run(keys, parent)

    def on_insert(self, key: Key, parent: Key | None = None) -> None:
        self.on_insert_run((key,), parent)

    def on_access(self, key: Key) -> None:
        if key in self._stamp:
            self._stamp[key] = (self.state(key), self.now)
        super().on_access(key)

    def _count_eviction(self, key: Key) -> None:
        """Nothing to learn: the value is given."""

    def _learn(self) -> None:
        """Nothing to learn: the value is given."""

    def _unlink(self, key: Key) -> None:
        del self._stamp[key]
        super()._unlink(key)


# -- the generator's law (multi-turn) ------------------------------------------------------


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def generator_value(
    turn: object, idle_ms: float, median_ms: float = THINK_MEDIAN_MS, sigma: float = THINK_SIGMA
) -> float:
    """P(the conversation goes on | turn, idle) / E[time until it does | it does, idle]."""
    mu = math.log(median_ms)
    survive = _survival(idle_ms, mu, sigma)
    posterior = _goes_on(int(turn), survive)  # type: ignore[call-overload]
    mean = math.exp(mu + sigma * sigma / 2)
    if idle_ms <= 0:
        residual = mean
    elif survive < 1e-12:
        residual = idle_ms
    else:
        residual = mean * _phi((mu + sigma * sigma - math.log(idle_ms)) / sigma) / survive - idle_ms
    return posterior / max(residual, 1.0)


HORIZON_AGES_MS = [0.0] + [1000.0 * 1.15**i for i in range(80)]
"""Idle-time grid of the ``horizon`` index (ms): 15% steps from 1 s to ~17 h."""


def _survival(t_ms: float, mu: float, sigma: float) -> float:
    """P(T > t) for the log-normal think time T."""
    return 1.0 if t_ms <= 0 else 1.0 - _phi((math.log(t_ms) - mu) / sigma)


def _goes_on(turn: int, survive: float) -> float:
    """P(another turn | ``turn`` turns taken, no new one while the think time survived
    with probability ``survive``)."""
    p = continuation_probability(turn)
    return p * survive / (p * survive + 1.0 - p)


def _partial_mean(a_ms: float, b_ms: float, mu: float, sigma: float) -> float:
    """E[T; a < T <= b] for the log-normal think time T."""

    def below(t: float) -> float:
        return (
            0.0
            if t <= 0
            else math.exp(mu + sigma * sigma / 2) * _phi((math.log(t) - mu - sigma * sigma) / sigma)
        )

    return below(b_ms) - below(a_ms)


@functools.cache
def _horizon_index(
    turn: int, age_bin: int, median_ms: float = THINK_MEDIAN_MS, sigma: float = THINK_SIGMA
) -> float:
    mu = math.log(median_ms)
    a = HORIZON_AGES_MS[age_bin]
    survive = _survival(a, mu, sigma)
    if survive < 1e-12:
        return 0.0
    q = _goes_on(turn, survive)  # P(another turn | idle a)
    best = 0.0
    for h in HORIZON_AGES_MS[1:]:
        b = a + h
        back = (survive - _survival(b, mu, sigma)) / survive  # P(T <= b | T > a)
        wait = _partial_mean(a, b, mu, sigma) / survive - a * back + h * (1.0 - back)
        slot_time = q * wait + (1.0 - q) * h  # a conversation that ended holds to the horizon
        best = max(best, q * back / slot_time)
    return best


def horizon_value(turn: object, idle_ms: float) -> float:
    """The law's most returns per slot-time over any holding horizon from ``idle_ms`` on."""
    age_bin = max(0, bisect.bisect_right(HORIZON_AGES_MS, idle_ms) - 1)
    return _horizon_index(int(turn), age_bin)  # type: ignore[call-overload]


# -- the table fitted on the trace ---------------------------------------------------------


def _bucket(n: int) -> int:
    return min(5, max(0, n.bit_length() - 2))  # < 4, < 8, < 16, < 32, < 64, >= 64


def _age_bin(age_ms: float) -> int:
    return bisect.bisect_right(EDGES_MS, age_ms) - 1


def request_classes(trace: Sequence[Request]) -> list[list[tuple]]:
    """Each request's blocks' classes after its use: the request's turn, the block's uses so
    far, whether it is the request's last block, and the request's new blocks (bucketed)."""
    turn, new = turns(trace), new_blocks(trace)
    uses: Counter[int] = Counter()
    out = []
    for i, request in enumerate(trace):
        n = len(request.keys)
        classes = []
        for p, key in enumerate(request.keys):
            uses[key] += 1
            classes.append(_class(turn[i], uses[key], p == n - 1, new[i]))
        out.append(classes)
    return out


def fit_table(trace: Sequence[Request], device_hits: Sequence[int]) -> dict[tuple, list[float]]:
    """Per class, per age bin: the best returns per slot-time over any horizon from that age
    (returns the tiers serve; a block never used again holds its slot to the horizon)."""
    past = PastTable()
    for request, d, classes in zip(trace, device_hits, request_classes(trace), strict=True):
        past.observe(request, d, classes)
    return past.final_table()


_BIN_ENDS = [*EDGES_MS[1:], EDGES_MS[-1] * 1.5]
_BIN_MIDS = [(a + b) / 2 for a, b in zip(EDGES_MS, _BIN_ENDS, strict=True)]


def _density_row(hits: Sequence[float], dead: float) -> list[float]:
    """Per age bin ``a``: the most returns per slot-time over any horizon ``b >= a``, of a
    class whose blocks returned ``hits[b]`` times at age bin ``b`` and ``dead`` times never
    (counts, or fractions of one block: only their proportions matter)."""
    bins = len(EDGES_MS)
    row = [0.0] * bins
    alive = dead + sum(hits)
    for a in range(bins):
        returned = held = best = 0.0
        for b in range(a, bins):
            returned += hits[b]
            held += hits[b] * max(1.0, _BIN_MIDS[b] - EDGES_MS[a])
            slot_time = held + (alive - returned) * (_BIN_ENDS[b] - EDGES_MS[a])
            if slot_time > 0:
                best = max(best, returned / slot_time)
        row[a] = best
        alive -= hits[a]
    return row


class PastTable:
    """The fitted table as an online policy could know it: refitted from the past alone.

    ``observe`` each request in order; ``table(now)`` fits on the gaps closed before ``now``.
    A block not yet used again is not taken for dead (on a prefix of the trace that would
    condemn every block used in the last minutes): it is censored at its idle time, and each
    class's returns per age bin are its Kaplan-Meier estimate (a bin's returns over the
    blocks still at risk in it). A reuse the device serves ends a gap with no return for the
    tiers, as in ``fit_table``.
    """

    BACK_OFF = 100
    """Blocks (gaps closed, dead or censored) a class needs before its own row is used. On
    the production trace 30 to 1,000 move the hit ratio by 0.2 point; none (every class its
    own row from its first block) costs 0.4 point there and 1.9 on multi-turn seed 1."""

    def __init__(self) -> None:
        self._returns: defaultdict[tuple, list[int]] = defaultdict(lambda: [0] * len(EDGES_MS))
        self._dead: Counter[tuple] = Counter()
        self._open: dict[Key, tuple[tuple, float]] = {}

    def observe(self, request: Request, device_hits: int, classes: Sequence[tuple]) -> None:
        """Close the gaps ``request`` ends and open one per block (``classes[p]``: the class
        of its ``p``-th block after this use)."""
        for p, (key, cls) in enumerate(zip(request.keys, classes, strict=True)):
            previous = self._open.get(key)
            if previous is not None:
                then_cls, then = previous
                if p >= device_hits:
                    self._returns[then_cls][_age_bin(request.timestamp - then)] += 1
                else:
                    self._dead[then_cls] += 1
            self._open[key] = (cls, request.timestamp)

    def final_table(self) -> dict[tuple, list[float]]:
        """``fit_table``'s table, once the whole trace is observed: a block not used again
        is counted dead (its trace is over), and each class has its own row."""
        dead = Counter(self._dead)
        for cls, _then in self._open.values():
            dead[cls] += 1
        zeros = [0] * len(EDGES_MS)
        return {
            cls: _density_row(self._returns.get(cls, zeros), dead[cls]) for cls in {*self._returns, *dead}
        }

    def table(self, now: float) -> dict[tuple, list[float]]:
        """Each class's row, or where the class has fewer than ``BACK_OFF`` blocks behind it,
        the row of its blocks pooled over every turn count, or else of all blocks (also the
        rows of classes not met yet): an online learner meets a class, a conversation's
        eighth turn, before it has seen one return."""
        bins = len(EDGES_MS)
        returns: defaultdict[tuple, list[int]] = defaultdict(lambda: [0] * bins)
        censored: defaultdict[tuple, list[int]] = defaultdict(lambda: [0] * bins)
        dead: Counter[tuple] = Counter()
        for cls, then in self._open.values():
            censored[cls][_age_bin(now - then)] += 1
        for cls, counts in self._returns.items():
            returns[cls] = list(counts)
        dead.update(self._dead)
        for cls in {*returns, *censored, *dead}:
            back, gone = returns[cls], censored[cls]
            for pooled in (_pooled(cls), ()):
                returns[pooled] = [a + b for a, b in zip(returns[pooled], back, strict=True)]
                censored[pooled] = [a + b for a, b in zip(censored[pooled], gone, strict=True)]
                dead[pooled] += dead[cls]
        table: dict[tuple, list[float]] = {}
        for cls in sorted({*returns, *censored}, key=_coarsest_first):
            if not cls or sum(returns[cls]) + dead[cls] + sum(censored[cls]) >= self.BACK_OFF:
                table[cls] = _kaplan_meier_row(returns[cls], dead[cls], censored[cls])
            else:
                table[cls] = table.get(_pooled(cls)) or table[()]
        return table


def _pooled(cls: tuple) -> tuple:
    """``cls`` over every turn count."""
    return (None, *cls[1:])


def _coarsest_first(cls: tuple) -> tuple[int, bool]:
    """All blocks (``()``), then the pooled classes, then the exact ones."""
    return len(cls), bool(cls) and cls[0] is not None


def _kaplan_meier_row(returns: Sequence[int], dead: int, censored: Sequence[int]) -> list[float]:
    at_risk = float(sum(returns) + dead + sum(censored))
    survive, hits = 1.0, [0.0] * len(returns)
    for b, (back, gone) in enumerate(zip(returns, censored, strict=True)):
        at_risk -= gone  # censored in this bin: not known to survive it
        if at_risk > 0 and back:
            hazard = back / at_risk
            hits[b] = survive * hazard
            survive *= 1.0 - hazard
        at_risk -= back
    return _density_row(hits, survive)


def _class(turn: int, uses: int, last: bool, new: int) -> tuple:
    return (min(turn, 8), min(uses, 4), last, _bucket(new))


# -- replays -------------------------------------------------------------------------------


def replay(
    trace: Sequence[Request],
    host: int,
    device_hits: Sequence[int],
    policy: ClockedIndex,
    state: Callable[[int, Request], Callable[[Key], object]],
) -> float:
    """Host-tier hit ratio of ``policy``, told the time and each request's state first."""
    tier = Tier("host", host, policy, make_placement(None, host))
    chain = TierChain([tier])
    accesses = 0
    for i, (request, d) in enumerate(zip(trace, device_hits, strict=True)):
        policy.now = request.timestamp
        policy.state = state(i, request)
        chain.request(request.keys, d)
        accesses += len(request.keys)
    return tier.hits / accesses if accesses else 0.0


def _sizes(trace: Sequence[Request], device_fraction: float, host_fraction: float) -> tuple[int, int]:
    distinct = trace_stats(trace)["distinct"]
    return max(1, round(distinct * device_fraction)), max(1, round(distinct * host_fraction))


BOUNDS = ("generator", "horizon", "fitted")
REAL_HALVES = ("real-early", "real-late")
"""The production trace split in time (``bench.traces.split_in_time``), named as in
``kvtier bench policy``."""


def bounds(
    trace: Sequence[Request],
    which: Sequence[str],
    device_fraction: float = 0.02,
    host_fraction: float = 0.10,
    fit_trace: Sequence[Request] | None = None,
    refit_every: int = 0,
) -> dict[str, float]:
    """Host hit ratio of the sampled-LRU control and of each bound in ``which``, at the
    sizes ``kvtier bench policy`` uses. ``fit_trace`` is what the ``fitted`` table is fitted
    on (below the same device fraction); ``None`` fits it on ``trace`` itself, and with
    ``refit_every`` on the part of ``trace`` already replayed (a ``PastTable`` refitted every
    that many requests; recency decides until the first fit)."""
    if refit_every and fit_trace is not None:
        raise ValueError("a table refitted on the past is fitted on the replayed trace: no fit_trace")
    device, host = _sizes(trace, device_fraction, host_fraction)
    device_hits = device_prefix_hits(trace, device)
    out = {
        "sampled-lru": replay(
            trace, host, device_hits, ClockedIndex(host, lambda _s, idle: -idle), lambda *_: lambda _k: None
        )
    }
    out.update(law_indexes(trace, host, device_hits, [b for b in which if b in LAW_VALUES]))
    if "fitted" in which:
        if refit_every:
            table = None
        elif fit_trace is None:
            table = fit_table(trace, device_hits)
        else:
            fit_device, _ = _sizes(fit_trace, device_fraction, host_fraction)
            table = fit_table(fit_trace, device_prefix_hits(fit_trace, fit_device))
        out["fitted"] = fitted_replay(trace, host, device_hits, table, refit_every)
    return out


LAW_VALUES: dict[str, Callable[[object, float], float]] = {
    "generator": generator_value,
    "horizon": horizon_value,
}
"""The indexes handed multi-turn's law, by bound name."""


def law_indexes(
    trace: Sequence[Request], host: int, device_hits: Sequence[int], which: Sequence[str] = tuple(LAW_VALUES)
) -> dict[str, float]:
    """Host hit ratio of each index in ``which`` valued by the multi-turn generator's law (a
    block's conversation's turn count and idle time): the online bound on a trace that law
    drew, which knows all that can be known of a block there and none of the future."""
    turn = turns(trace)

    def by_turn(i: int, _request: Request) -> Callable[[Key], object]:
        return lambda _key: turn[i]

    return {
        name: replay(trace, host, device_hits, ClockedIndex(host, LAW_VALUES[name]), by_turn)
        for name in which
    }


def online_index(
    trace: Sequence[Request], host: int, device_hits: Sequence[int], refit_every: int = 0
) -> float:
    """Host hit ratio of the class index whose table is refitted on the replayed past (every
    ``refit_every`` requests, by default 1% of them): an index policy that learns online,
    the reference ``kvtier bench policy`` prints beside OPT."""
    return fitted_replay(trace, host, device_hits, None, refit_every or default_refit_every(trace))


def default_refit_every(trace: Sequence[Request]) -> int:
    """Requests between refits of a table fitted on the past, unless told: 1% of them."""
    return max(1, len(trace) // 100)


def fitted_replay(
    trace: Sequence[Request],
    host: int,
    device_hits: Sequence[int],
    table: dict[tuple, list[float]] | None,
    refit_every: int = 0,
) -> float:
    """Host hit ratio of the index valued by ``table``, or with ``table=None`` by a
    ``PastTable`` refitted every ``refit_every`` requests (recency decides until the first
    fit)."""
    if table is None and refit_every <= 0:
        raise ValueError("without a table, the index refits one on the past: refit_every > 0")
    past = PastTable() if table is None else None
    fitted = table or {}
    classes_of = request_classes(trace)

    def fitted_state(i: int, request: Request) -> Callable[[Key], object]:
        nonlocal fitted
        classes = classes_of[i]
        if past is not None:
            if i and i % refit_every == 0:
                fitted = past.table(request.timestamp)
            past.observe(request, device_hits[i], classes)
        return dict(zip(request.keys, classes, strict=True)).__getitem__

    def fitted_value(cls: object, idle: float) -> float:
        if not fitted:
            return -idle
        row = fitted.get(cls)  # type: ignore[call-overload]
        if row is None and past is not None:  # a class not met yet: what its like did
            row = fitted.get(_pooled(cls)) or fitted[()]  # type: ignore[arg-type]
        return row[_age_bin(idle)] if row else 0.0

    return replay(trace, host, device_hits, ClockedIndex(host, fitted_value), fitted_state)


FIT_ON = ("other", "same", "past")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.index_bound", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace",
        default="multi-turn",
        help="a generated trace's name, or 'real', 'real-early', 'real-late' (the production trace, "
        "whole or split in time)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bounds", default="generator,horizon,fitted", help=f"comma-separated: {', '.join(BOUNDS)}"
    )
    parser.add_argument(
        "--fit-on",
        choices=FIT_ON,
        default=None,
        help="fit the 'fitted' table on another draw of the generator (seed + 1; the default for "
        "generated traces) or the production trace's other half; on the replayed trace itself "
        "(the default for 'real'); or on its past, refitted as it is replayed (an online reference)",
    )
    parser.add_argument(
        "--refit-every",
        type=int,
        default=0,
        help="--fit-on past: requests between refits (default: 1%% of the trace)",
    )
    add_block_tokens_option(parser)
    args = parser.parse_args(argv)
    which = [b for b in args.bounds.split(",") if b]
    bad = [b for b in which if b not in BOUNDS]
    if bad:
        parser.error(f"unknown bounds {bad}: choose from {', '.join(BOUNDS)}")
    law = [b for b in which if b in LAW_VALUES]
    if law and args.trace != "multi-turn":
        parser.error(
            f"the {' and '.join(law)} bound{'s know' if len(law) > 1 else ' knows'} only multi-turn's law"
        )
    real = args.trace in REAL_HALVES or args.trace == "real"
    fit_on = args.fit_on or ("same" if real else "other")
    if args.trace == "real" and fit_on == "other":
        parser.error("there is one real trace: --fit-on other needs a generated trace or a half of it")
    if args.refit_every < 0 or (args.refit_every and fit_on != "past"):
        parser.error("--refit-every is a positive count of requests, with --fit-on past")
    fit_trace, fitted_on = None, "fitted on this trace: knows its future"
    if real:
        whole = load_jsonl(REAL_TRACE, block_tokens=args.trace_block_tokens)
        halves = dict(zip(REAL_HALVES, split_in_time(whole), strict=True))
        trace = halves.get(args.trace, whole)
        if fit_on == "other":
            other = REAL_HALVES[1 - REAL_HALVES.index(args.trace)]
            fit_trace, fitted_on = halves[other], f"fitted on {other}"
        source = f" --trace-block-tokens {args.trace_block_tokens or 0}"
    else:
        if args.trace not in trace_names():
            names = ", ".join([*trace_names(), "real", *REAL_HALVES])
            parser.error(f"unknown trace {args.trace!r}: choose one of {names}")
        trace = generate(args.trace, seed=args.seed)
        if fit_on == "other":
            fit_trace, fitted_on = generate(args.trace, seed=args.seed + 1), f"fitted on seed {args.seed + 1}"
        source = f" --seed {args.seed}"
    refit_every = (args.refit_every or default_refit_every(trace)) if fit_on == "past" else 0
    flags = f"--trace {args.trace}{source} --bounds {','.join(which)} --fit-on {fit_on}"
    if refit_every:
        flags += f" --refit-every {refit_every}"
        fitted_on = f"refitted on its past every {refit_every} requests"
    print(f"command: python -m bench.index_bound {flags}")
    for name, ratio in bounds(trace, which, fit_trace=fit_trace, refit_every=refit_every).items():
        note = f" ({fitted_on})" if name == "fitted" else ""
        print(f"   {name:<12} host hit ratio {100 * ratio:6.2f}%{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
