"""The compiled referees (``policies/_shadows.c``) decide as their Python twins in
``policies.adaptive``: what a request returns, targets ``p``, every list and ghost, and the
referees' counts, after every request."""

from __future__ import annotations

import random
import sys

import pytest

from policies.adaptive import CONFIRM_Z2, SIZED_GHOSTS, SWITCH_Z2, _ExpertReferee, _GhostShadows

shadows = pytest.importorskip("policies._shadows", reason="the compiled shadows were not built")


def _mixed(seed: int, universe: int, length: int = 12_000) -> list[int]:
    """A hot set between scans and a sliding window: hits, evictions and ghosts of both kinds."""
    rng = random.Random(seed)
    keys, fresh = [], universe
    for i in range(length):
        phase = (i // 3_000) % 3
        if phase == 0 and rng.random() < 0.5:  # a scan: a key never seen before
            keys.append(fresh)
            fresh += 1
        elif phase == 0:
            keys.append(rng.randrange(universe // 4))
        elif phase == 1:
            keys.append(max(0, i // 3 - int(rng.expovariate(1 / 40))))
        else:
            keys.append(rng.randrange(universe))
    return keys


def _as_bytes(keys: list[int]) -> list[bytes]:
    """kvtier-shaped keys (a hash, then a 4-byte group), each a fresh object: found by value."""
    return [key.to_bytes(8, "big") * 4 + b"\0\0\0\0" for key in keys]


def _state(referee) -> tuple:
    return referee.state()


def _first_difference(python, python_state, compiled, compiled_state, keys, *args) -> int | None:
    """The first request after which the two shadows differ (what ``request`` returned, the
    lists, ghosts, targets or the referee's counts), if any."""
    for step, key in enumerate(keys):
        if python.request(key, *args) != compiled.request(key, *args):
            return step
        if python_state(python) != compiled_state(compiled):
            return step
    return None


def _ghost_shadows(make, capacity: int, sizes: tuple[float, ...]):
    generations = [max(1, int(capacity * size)) for size in sizes]
    return make(capacity, generations, len(sizes) // 2, SWITCH_Z2)


def _experts(make, capacity: int, confirm: float = 32.0, switch_z2: float = SWITCH_Z2):
    """A referee with the policy's decays for a shadow of ``capacity`` (a horizon of two)."""
    decay = 1.0 - 1.0 / (2 * capacity)
    return make(capacity, decay, 1.0 - 1.0 / (confirm * 2 * capacity), switch_z2, CONFIRM_Z2)


KINDS = {
    "experts": (
        lambda c: _experts(_ExpertReferee, c),
        lambda c: _experts(shadows.ExpertReferee, c),
    ),
    # a long memory as short as the short one: the referee switches often
    "experts-eager": (
        lambda c: _experts(_ExpertReferee, c, confirm=1.0),
        lambda c: _experts(shadows.ExpertReferee, c, confirm=1.0),
    ),
    # one size: the live ARC alone; three: adaptive-ghosts' shadows and their referee
    "live": (
        lambda c: _ghost_shadows(_GhostShadows, c, (0.5,)),
        lambda c: _ghost_shadows(shadows.GhostShadows, c, (0.5,)),
    ),
    "sized-ghosts": (
        lambda c: _ghost_shadows(_GhostShadows, c, SIZED_GHOSTS),
        lambda c: _ghost_shadows(shadows.GhostShadows, c, SIZED_GHOSTS),
    ),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("capacity", [1, 16, 64])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_compiled_shadows_decide_as_python_ones(kind: str, capacity: int, as_bytes: bool) -> None:
    make_python, make_compiled = KINDS[kind]
    keys = _mixed(capacity, universe=8 * capacity + 8)
    if as_bytes:
        keys = _as_bytes(keys)
    args = (1.0 - 1.0 / (2 * capacity),) if kind in ("live", "sized-ghosts") else ()  # the policy's decay
    python, compiled = make_python(capacity), make_compiled(capacity)
    assert _first_difference(python, _state, compiled, _state, keys, *args) is None
    if hasattr(compiled, "clear"):  # cleared, each is as a fresh one
        python.clear()
        compiled.clear()
        assert _state(python) == _state(compiled) == _state(make_python(capacity))
    else:
        python, compiled = make_python(capacity), make_compiled(capacity)
    assert _first_difference(python, _state, compiled, _state, keys[::-1], *args) is None


@pytest.mark.parametrize(
    ("make", "args", "choices"),
    [
        (lambda: _experts(shadows.ExpertReferee, 64, confirm=1.0), (), {0, 1}),  # to ARC and back
        (lambda: _ghost_shadows(shadows.GhostShadows, 64, SIZED_GHOSTS), (1.0 - 1.0 / 128,), {2}),
    ],
)
def test_the_referees_switch_in_the_lockstep_run(make, args, choices) -> None:
    """The runs above change expert and ghost size (so the switches are compared too)."""
    referee = make()
    switches = [referee.request(key, *args) for key in _mixed(64, universe=520)]
    assert {choice for choice in switches if choice is not None} == choices


def test_the_lockstep_check_can_fail() -> None:
    """Compiled ghost shadows of other generations, or another decay, or a referee with
    another threshold, part from the Python ones on the same keys."""
    keys = _mixed(3, universe=520)
    decay = 1.0 - 1.0 / 128
    python = _ghost_shadows(_GhostShadows, 64, SIZED_GHOSTS)
    other_sizes = _ghost_shadows(shadows.GhostShadows, 64, (0.25, 0.5, 1.0))
    assert _first_difference(python, _state, other_sizes, _state, keys, decay)
    python = _ghost_shadows(_GhostShadows, 64, SIZED_GHOSTS)
    compiled = _ghost_shadows(shadows.GhostShadows, 64, SIZED_GHOSTS)
    assert _first_difference(python, _state, compiled, _state, keys[:2000], decay) is None
    for key in keys[:2000]:
        python.request(key, decay)
        compiled.request(key, decay * 0.999)
    assert python.state()[1:4] != compiled.state()[1:4]
    python_referee = _experts(_ExpertReferee, 64, confirm=1.0)
    assert (
        _first_difference(
            python_referee, _state, _experts(shadows.ExpertReferee, 64, confirm=1.0), _state, keys
        )
        is None
    )
    python_referee = _experts(_ExpertReferee, 64, confirm=1.0)
    bolder = _experts(shadows.ExpertReferee, 64, confirm=1.0, switch_z2=1.0)
    assert _first_difference(python_referee, _state, bolder, _state, keys)


def test_equal_keys_of_one_hash_are_told_apart() -> None:
    """-1 and -2 share a hash in CPython: the index must compare keys, not hashes."""
    assert hash(-1) == hash(-2)
    referee = _experts(shadows.ExpertReferee, 4)
    for key in (-1, -2, -1, -2):
        referee.request(key)
    lru_keys, (t1, t2, _, _) = referee.state()[5:7]
    assert lru_keys == [-1, -2] and t1 == [] and t2 == [-1, -2]  # both hit the second time


def test_keys_are_released() -> None:
    """A key pushed out of every list is let go, and every key when a shadow is cleared or
    goes (ARC keeps a key used twice through any scan: the check there is ``clear``)."""
    key = b"k" * 40
    before = sys.getrefcount(key)
    referee = _experts(shadows.ExpertReferee, 2)
    referee.request(key)
    assert sys.getrefcount(key) == before + 2  # in the LRU shadow and ARC's T1
    for other in range(10):
        referee.request(other)
    assert sys.getrefcount(key) == before
    for make, args in (
        (lambda: _experts(shadows.ExpertReferee, 2), ()),
        (lambda: shadows.GhostShadows(2, [1, 2], 0, 4.0), (0.5,)),
    ):
        shadow = make()
        for other in range(20):
            shadow.request(key, *args)
            shadow.request(other, *args)
        assert sys.getrefcount(key) > before
        if hasattr(shadow, "clear"):
            shadow.clear()
            assert sys.getrefcount(key) == before
            shadow.request(key, *args)
        del shadow
        assert sys.getrefcount(key) == before


def test_bad_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="capacity"):
        shadows.ExpertReferee(0, 0.5, 0.5, SWITCH_Z2, CONFIRM_Z2)
    with pytest.raises(ValueError, match="generation"):
        shadows.GhostShadows(4, [2, 0], 0, 4.0)
    with pytest.raises(ValueError, match="current"):
        shadows.GhostShadows(4, [2, 1], 2, 4.0)
    with pytest.raises(TypeError):
        shadows.GhostShadows(4, 2, 0, 4.0)
    referee = _experts(shadows.ExpertReferee, 4)
    with pytest.raises(TypeError):
        referee.request([1])  # unhashable
    with pytest.raises(ValueError, match="expert"):
        referee.expert = 2
    referee.expert = 1
    assert referee.state()[0] == 1
    twin = _experts(shadows.ExpertReferee, 4)
    twin.expert = 1
    with pytest.raises(ValueError, match="capacity"):
        referee.__init__(0, 0.1, 0.1, 1.0, 1.0)  # refused: left as it was, not half changed
    assert _first_difference(twin, _state, referee, _state, _mixed(4, universe=40, length=400)) is None
    requests = ((shadows.ExpertReferee, (1,)), (shadows.GhostShadows, (1, 0.5)))
    for kind, args in requests:
        uninitialised = kind.__new__(kind)
        with pytest.raises(RuntimeError, match="__init__"):
            uninitialised.request(*args)
        getattr(uninitialised, "clear", lambda: None)()  # no crash either
    assert shadows.ExpertReferee.__new__(shadows.ExpertReferee).state()[5:7] == ([], ([], [], [], []))
    assert shadows.GhostShadows.__new__(shadows.GhostShadows).state()[4] == []


def test_a_comparison_that_raises_is_an_error() -> None:
    class Key:
        def __hash__(self) -> int:
            return 7

        def __eq__(self, other: object) -> bool:
            raise RuntimeError("no")

    referee = _experts(shadows.ExpertReferee, 4)
    referee.request(Key())
    with pytest.raises(RuntimeError, match="no"):
        referee.request(Key())


@pytest.mark.parametrize("sizes", [(0.5,), SIZED_GHOSTS])
def test_the_policy_decides_alike_with_either_shadows(monkeypatch: pytest.MonkeyPatch, sizes) -> None:
    """``adaptive`` and ``adaptive-ghosts`` evict the same keys, switch expert and ghost size
    at the same requests, with the compiled shadows or the Python ones."""
    import policies.adaptive as adaptive

    keys = _as_bytes(_mixed(5, universe=4_000, length=30_000))
    runs = []
    for types in (adaptive.SHADOWS, (_ExpertReferee, _GhostShadows)):
        monkeypatch.setattr(adaptive, "SHADOWS", types)
        policy = adaptive.AdaptivePolicy(500, sample_bits=2, ghost_sizes=sizes)
        trail = []
        for key in keys:
            evicted = None
            if key in policy:
                policy.on_access(key)
            else:
                if len(policy) >= policy.capacity:
                    evicted = policy.evict(1)
                policy.on_insert(key)
            trail.append((evicted, policy.expert, policy.ghost_size))
        runs.append(trail)
    assert runs[0] == runs[1]
    assert len({(expert, size) for _, expert, size in runs[0]}) > 1  # the run switched something
