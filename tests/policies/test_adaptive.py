"""The adaptive policy: LRU or ARC as its sampled shadows say, each in its own lists."""

from __future__ import annotations

import random

import pytest

from policies.adaptive import ARC, LRU, AdaptivePolicy
from policies.arc import ARCPolicy
from policies.lru import LRUPolicy
from policies.registry import make_policy


def replay(policy, keys) -> int:
    hits = 0
    for key in keys:
        if key in policy:
            policy.on_access(key)
            hits += 1
        else:
            if len(policy) >= policy.capacity:
                assert policy.evict(1) is not None
            policy.on_insert(key)
    return hits


def scan_heavy(seed: int, hot: int = 200, length: int = 40_000) -> list[int]:
    """Hot keys (``hot`` of them, come back often) between one-off scans: ARC's case, LRU's worst."""
    rng = random.Random(seed)
    keys, fresh = [], 10_000
    for _ in range(length):
        if rng.random() < 0.5:
            keys.append(rng.randrange(hot))
        else:
            keys.append(fresh)
            fresh += 1
    return keys


def recency_friendly(seed: int) -> list[int]:
    """A window that slides: what was used lately comes back, frequency means nothing."""
    rng = random.Random(seed)
    return [max(0, i // 4 - int(rng.expovariate(1 / 60))) for i in range(40_000)]


@pytest.mark.parametrize("trace", [scan_heavy, recency_friendly])
def test_it_follows_the_better_expert(trace) -> None:
    keys = trace(1)
    scores = {cls: replay(cls(400), keys) for cls in (LRUPolicy, ARCPolicy)}
    adaptive = replay(AdaptivePolicy(400, sample_bits=2), keys)
    assert adaptive >= 0.97 * max(scores.values())


def switches(policy: AdaptivePolicy, keys) -> list[int]:
    """The experts ``policy`` changed to while replaying ``keys``."""
    taken: list[int] = []
    take_over = policy._take_over

    def spy(expert: int) -> None:
        if expert != policy.expert:
            taken.append(expert)
        take_over(expert)

    policy._take_over = spy  # type: ignore[method-assign]
    replay(policy, keys)
    return taken


@pytest.mark.parametrize(("burst", "confirm", "expected"), [(2_000, None, []), (2_000, 1.0, [ARC, LRU])])
def test_a_lead_of_a_few_capacities_needs_the_long_memory_to_agree(burst, confirm, expected) -> None:
    """A scan burst (ARC's case) of five capacities between two long sliding windows: the
    short memory alone switches to ARC and back (``confirm=1``); the long one keeps LRU."""
    keys = (
        recency_friendly(1)
        + [k + 100_000 for k in scan_heavy(2)[:burst]]
        + [k + 200_000 for k in recency_friendly(3)]
    )
    kwargs = {} if confirm is None else {"confirm": confirm}
    assert switches(AdaptivePolicy(400, sample_bits=2, **kwargs), keys) == expected


def test_a_lasting_lead_still_switches() -> None:
    keys = recency_friendly(1) + [k + 100_000 for k in scan_heavy(2)]
    assert switches(AdaptivePolicy(400, sample_bits=2), keys) == [ARC]


def test_under_lru_it_makes_lrus_decisions() -> None:
    """With the referee silenced, the live list evicts exactly as ``LRUPolicy``, whole
    stores and pinned keys included."""
    own = LRUPolicy(300)
    adaptive = AdaptivePolicy(300)
    adaptive._referee = lambda key: None  # type: ignore[method-assign]
    keys = scan_heavy(2)[:12_000]
    pinned = lambda key: key % 7 != 0  # noqa: E731
    for i in range(0, len(keys), 3):
        run = [key for key in dict.fromkeys(keys[i : i + 3]) if key not in own]
        for key in keys[i : i + 3]:
            if key in own:
                own.on_access(key)
                adaptive.on_access(key)
        if len(own) + len(run) > 300:
            assert adaptive.evict(len(run), pinned) == own.evict(len(run), pinned)
        own.on_insert_run(run)
        adaptive.on_insert_run(run)
    assert list(adaptive) == list(own)


def test_under_arc_victims_follow_arcs_rule_and_ghosts_move_p() -> None:
    """ARC's rule on the live lists: T1's oldest while |T1| > p, else T2's oldest; a key
    back from T1's ghosts enters T2 and raises p, one back from T2's lowers it."""
    policy = AdaptivePolicy(4)
    policy._referee = lambda key: None  # type: ignore[method-assign]
    policy._take_over(ARC)
    for key in (1, 2, 3, 4):
        policy.on_insert(key)
    policy.on_access(3)
    policy.on_access(4)  # T1 = [1, 2], T2 = [3, 4], p = 0
    assert policy.evict(1) == [1]  # |T1| = 2 > p: T1's oldest
    policy.on_insert(1)  # back from T1's ghosts: T2, p up
    assert list(policy._t2) == [3, 4, 1] and policy.p >= 1
    p = policy.p
    policy.p = 0.5
    assert policy.evict(1) == [2]  # |T1| = 1 > 0.5
    assert policy.evict(1) == [3]  # T1 empty: T2's oldest
    policy.on_insert(3)  # back from T2's ghosts: p down
    assert policy.p < 0.5 and 3 in policy._t2
    assert p != policy.p


def _arc_state(arc: ARCPolicy) -> tuple:
    """An ARC's four lists, in order, and its target."""
    return (*(list(part) for part in (arc._t1, arc._t2, arc._b1, arc._b2)), arc.p)


def _parts_from(shadow, reference, keys, state) -> bool:
    """Replay ``keys`` in a shadow (``request``) and in a policy (a miss: ``evict(1)`` when
    full, then ``on_insert``); whether ``state`` of the two ever differs. While it does not,
    the shadow must report the policy's hits."""
    for key in keys:
        hit = key in reference
        if hit:
            reference.on_access(key)
        else:
            if len(reference) >= reference.capacity:
                assert reference.evict(1) is not None
            reference.on_insert(key)
        shadow_hit = shadow.request(key)
        if state(shadow) != state(reference):
            return True
        assert shadow_hit == hit
    return False


def test_the_referees_arc_makes_arcpolicys_decisions() -> None:
    """The shadow ARC's inlined request decides as ``ARCPolicy``'s own calls do (a miss:
    ``evict(1)`` when full, then ``on_insert``), list by list and ``p`` after every request;
    vLLM's variant (``VLLMARCPolicy``) parts from it on the same keys, so the check can
    fail."""
    from policies.adaptive import _ShadowARC
    from policies.arc import VLLMARCPolicy

    keys = scan_heavy(4)[:20_000]
    for reference, parts in ((ARCPolicy(64), False), (VLLMARCPolicy(64), True)):
        assert _parts_from(_ShadowARC(64), reference, keys, _arc_state) == parts


def test_a_switch_keeps_every_key_and_the_order_of_last_use() -> None:
    """LRU -> ARC -> LRU rebuilds the lists; nothing is lost and the LRU order comes back.
    The control: ARC's own order differs, so the check can tell."""
    policy = AdaptivePolicy(200)
    policy._referee = lambda key: None  # type: ignore[method-assign]
    replay(policy, scan_heavy(3)[:5_000])
    before = list(policy)
    policy._take_over(ARC)
    assert set(policy) == set(before) and len(policy) == len(before)
    assert list(policy._t1) + list(policy._t2) != before  # ARC's own order is not LRU's
    policy._take_over(LRU)
    assert list(policy) == before


def test_lists_stay_disjoint_and_ordered_and_ghosts_bounded() -> None:
    policy = make_policy("adaptive", 64, sample_bits=1)
    rng = random.Random(5)
    experts = []
    for step in range(8_000):
        key = rng.randrange(300) if step % 2000 < 1000 else rng.choice((rng.randrange(40), 1000 + step))
        if step % 2000 == 1000:
            policy._take_over(LRU)  # each scan phase starts under LRU: ARC must win it again
        if key in policy:
            policy.on_access(key)
        elif step % 7 == 0 and len(policy):
            policy.on_remove(next(iter(policy)))
        else:
            if len(policy) >= 64:
                assert policy.evict(1, lambda k: k % 5 != 0) is not None
            policy.on_insert(key)
        order, t1, t2 = policy._order, policy._t1, policy._t2
        assert len(order) + len(t1) + len(t2) == len(set(order) | set(t1) | set(t2)) == len(policy) <= 64
        assert not order or not (t1 or t2)  # only the live expert keeps lists
        for part in (t1, t2):
            assert list(part.values()) == sorted(part.values())  # each list by last use
        assert not (set(policy._ghosts) | set(policy._ghosts_old)) & set(policy)
        if policy.expert == ARC:  # the count ARC's ghost rule reads
            assert policy._ghosts_b2 == sum(policy._ghosts.values()) + sum(policy._ghosts_old.values())
        assert policy.ghost_count() <= 2 * policy._generation + 1
        if not experts or experts[-1] != policy.expert:
            experts.append(policy.expert)
    assert experts.count(ARC) >= 3  # the referee took ARC in every scan phase
    policy.clear()
    assert len(policy) == 0 and not policy.ghost_count() and policy.expert == LRU


def test_bad_parameters_are_errors() -> None:
    with pytest.raises(ValueError, match="sample_bits"):
        make_policy("adaptive", 8, sample_bits=20)
    with pytest.raises(ValueError, match="horizon"):
        make_policy("adaptive", 8, horizon=0)
    with pytest.raises(ValueError, match="confirm"):
        make_policy("adaptive", 8, confirm=0.5)
    for bad in ((), (0.5, 0.0), (float("nan"),), (0.5, 9.0), ("0.5",)):
        with pytest.raises(ValueError, match="ghost_sizes"):
            make_policy("adaptive", 8, ghost_sizes=bad)


def _live_arc_state(policy) -> tuple:
    """The live ARC's lists in order, its target and its ghosts (both generations, marked)."""
    return list(policy._t1), list(policy._t2), policy.p, {**policy._ghosts_old, **policy._ghosts}


@pytest.mark.parametrize(("generation", "parts"), [(32, False), (8, True)])
def test_a_ghost_shadow_makes_the_live_arcs_decisions(generation: int, parts: bool) -> None:
    """``_ShadowLiveARC`` with the live policy's ghost generation decides as ``AdaptivePolicy``
    under ARC does (a miss: ``evict(1)`` when full, then ``on_insert``): lists, target and
    ghosts after every request. With another generation it parts from it, so the check can
    fail."""
    from policies.adaptive import _ShadowLiveARC

    live = AdaptivePolicy(64, ghost_sizes=(0.5,))  # one size: generations of 32 keys
    live._referee = lambda key: None  # type: ignore[method-assign]
    live._take_over(ARC)
    assert _parts_from(_ShadowLiveARC(64, generation), live, scan_heavy(6)[:20_000], _live_arc_state) == parts


def test_the_ghost_referee_decides_as_eagerly_decayed_counts_would() -> None:
    """``_GhostReferee`` decays lazily (scaled counts); a plain version that decays every
    count on every request must pick the same shadow at every step, over streams long enough
    to fold the scale back many times. Evaluating the test without the scale (a mutation)
    switches at other steps."""
    from policies.adaptive import SWITCH_Z2, _GhostReferee

    def eager(hit_rates: list[float], decay: float, steps: int, rng: random.Random) -> tuple[list, list]:
        n = len(hit_rates)
        current, scores, apart = 1, [0.0] * n, [0.0] * n
        lazy = _GhostReferee(n, 1)
        chosen_eager, chosen_lazy = [], []
        for step in range(steps):
            phase = hit_rates if (step // 3000) % 2 == 0 else hit_rates[::-1]
            hits = [rng.random() < rate for rate in phase]
            for i in range(n):
                scores[i] = scores[i] * decay + hits[i]
                apart[i] = apart[i] * decay + (hits[i] != hits[current])
            best, lead = current, 0.0
            for i in range(n):
                ahead = scores[i] - scores[current]
                if ahead > lead and ahead * ahead > SWITCH_Z2 * apart[i]:
                    best, lead = i, ahead
            if best != current:
                current, apart = best, [0.0] * n
            lazy.request(hits, decay)
            chosen_eager.append(current)
            chosen_lazy.append(lazy.current)
        return chosen_eager, chosen_lazy

    rng = random.Random(3)
    for decay in (1 - 1 / 32, 1 - 1 / 1024):
        chosen_eager, chosen_lazy = eager([0.30, 0.32, 0.45], decay, 24_000, rng)
        assert chosen_eager == chosen_lazy
        assert len(set(chosen_eager)) >= 2  # it did switch, back and forth with the phases


def test_the_ghosts_grow_where_reuse_outlasts_a_capacity() -> None:
    """Hot keys (1.3 capacities of them) that come back after about two capacities of other
    keys, one-off scans between them: a ghost of two capacities remembers more of them than
    the former fixed half capacity does, and hits more. The referee must find that size and
    beat the fixed one (choosing a quarter, or staying, would not)."""
    keys = scan_heavy(7, hot=520, length=60_000)
    fixed = ((0.5,), (2.0,))
    hits = {sizes: replay(AdaptivePolicy(400, sample_bits=2, ghost_sizes=sizes), keys) for sizes in fixed}
    assert hits[(2.0,)] > hits[(0.5,)]
    sized = make_policy("adaptive-ghosts", 400, sample_bits=2)
    assert replay(sized, keys) > hits[(0.5,)] and sized.ghost_size == 2.0
    assert AdaptivePolicy(400).ghost_size == 0.5 and not AdaptivePolicy(400)._ghost_shadows  # the default


def test_kvtier_keys_are_sampled_by_a_hash_byte_the_same_in_every_process() -> None:
    from policies.adaptive import _sample_byte

    key = bytes(range(8)) + (0).to_bytes(4, "big")
    assert _sample_byte(key) == 7 and _sample_byte(12) == 12


def test_without_the_compiled_shadows_the_python_ones_run() -> None:
    """Where ``policies._shadows`` was not built (no C compiler at install), the policy runs
    on the Python shadows; where it was, on the compiled ones."""
    import subprocess
    import sys

    probe = (
        "import sys; sys.modules['policies._shadows'] = None\n"  # import fails, as when not built
        "import policies.adaptive as a\n"
        "p = a.SizedGhostsAdaptivePolicy(64, sample_bits=1)\n"
        "assert (type(p._experts), type(p._ghost_shadows)) == (a._ExpertReferee, a._GhostShadows)\n"
        "evicted = 0\n"
        "for k in range(5000):\n"
        "    key = k % 300\n"
        "    if key in p:\n"
        "        p.on_access(key)\n"
        "        continue\n"
        "    if len(p) >= 64:\n"
        "        evicted += len(p.evict(1))\n"
        "    p.on_insert(key)\n"
        "assert len(p) == 64 and evicted > 0, (len(p), evicted)\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
    try:
        from policies import _shadows
    except ImportError:
        return
    sized = make_policy("adaptive-ghosts", 64)
    assert type(sized._experts) is _shadows.ExpertReferee
    assert type(sized._ghost_shadows) is _shadows.GhostShadows
