"""The manager's contract, the same as vLLM's OffloadingManager's."""

import random

import pytest

from offload import manager as manager_module
from offload.keys import make_key
from offload.manager import HostTierManager, Lookup, TierEvent
from policies.lru import LRUPolicy

MISS, HIT, PENDING = Lookup.MISS, Lookup.HIT, Lookup.HIT_PENDING


def k(i: int, group: int = 0) -> bytes:
    return make_key(i.to_bytes(8, "big"), group)


def manager(slots: int = 4, groups: int = 1) -> HostTierManager:
    return HostTierManager(groups, slots, LRUPolicy)


def stored(m: HostTierManager, *ids: int, group: int = 0) -> None:
    keys = [k(i, group) for i in ids]
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)


def test_store_lifecycle_miss_pending_hit():
    m = manager()
    assert m.lookup(k(1)) is MISS
    out = m.prepare_store([k(1), k(2)])
    assert out.keys_to_store == [k(1), k(2)]
    assert len(set(out.store_spec.slots)) == 2
    assert out.evicted_keys == []
    assert m.lookup(k(1)) is PENDING
    m.complete_store([k(1), k(2)])
    assert m.lookup(k(1)) is HIT


def test_prepare_store_drops_keys_already_stored_or_in_flight():
    m = manager()
    stored(m, 1)
    m.prepare_store([k(2)])
    out = m.prepare_store([k(1), k(2), k(3), k(3)])
    assert out.keys_to_store == [k(3)]


def test_failed_store_frees_the_slot_and_stays_a_miss():
    m = manager(slots=1)
    out = m.prepare_store([k(1)])
    m.complete_store(out.keys_to_store, success=False)
    assert m.lookup(k(1)) is MISS
    assert m.take_events() == []
    assert m.prepare_store([k(2)]).store_spec.slots == out.store_spec.slots


def test_eviction_is_lru_and_reported():
    m = manager(slots=3)
    for i in (1, 2, 3):
        stored(m, i)
    m.touch([k(1)])
    out = m.prepare_store([k(4)])
    assert out.evicted_keys == [k(2)]
    assert m.lookup(k(2)) is MISS
    assert m.lookup(k(1)) is HIT


def test_a_chain_stored_in_one_call_is_evicted_from_its_tail():
    m = manager(slots=3)
    stored(m, 1, 2, 3)
    assert m.prepare_store([k(4)]).evicted_keys == [k(3)]


def test_touch_makes_the_head_of_a_prefix_most_recent():
    m = manager(slots=3)
    stored(m, 1, 2, 3)
    m.touch([k(1), k(2), k(3)])
    assert m.prepare_store([k(4)]).evicted_keys == [k(3)]


def test_never_evicts_pinned_in_flight_or_same_call_keys():
    m = manager(slots=4)
    stored(m, 1, 2)
    m.prepare_store([k(3)])  # in flight
    m.prepare_load([k(1)])  # pinned
    stored_4 = m.prepare_store([k(4)])
    m.complete_store(stored_4.keys_to_store)
    out = m.prepare_store([k(2), k(5)])  # k2 is in the call: protected
    assert out is not None
    assert out.evicted_keys == [k(4)]
    assert m.lookup(k(1)) is HIT and m.lookup(k(2)) is HIT and m.lookup(k(3)) is PENDING


def test_returns_none_and_changes_nothing_when_nothing_can_be_freed():
    m = manager(slots=2)
    stored(m, 1, 2)
    m.prepare_load([k(1), k(2)])
    before = (m.lookup(k(1)), m.lookup(k(2)), m.num_free_slots(0))
    assert m.prepare_store([k(3)]) is None
    assert (m.lookup(k(1)), m.lookup(k(2)), m.num_free_slots(0)) == before
    assert m.lookup(k(3)) is MISS
    assert m.stats.rejected_stores == 1


def test_pins_are_counted_so_shared_prefixes_load_together():
    m = manager(slots=2)
    stored(m, 1, 2)
    first = m.prepare_load([k(1)])
    second = m.prepare_load([k(1)])
    assert first.slots == second.slots
    m.complete_load([k(1)])
    assert m.prepare_store([k(3)]).evicted_keys == [k(2)]  # k1 still pinned by the second
    m.complete_load([k(1)])
    assert m.prepare_store([k(4)]).evicted_keys == [k(1)]


def test_held_by_caller_names_pins_and_unfinished_stores_and_events_drop_unread():
    m = manager(slots=4)
    stored(m, 1, 2)
    m.prepare_load([k(1)])
    m.prepare_load([k(1), k(2)])
    m.prepare_store([k(3)])
    assert m.held_by_caller() == ({k(1): 2, k(2): 1}, [k(3)])
    m.complete_load([k(1)])
    m.complete_store([k(3)])
    assert m.held_by_caller() == ({k(1): 1, k(2): 1}, [])
    m.drop_events()
    assert m.take_events() == []


def test_prepare_load_keeps_order_and_refuses_non_hits_without_pinning():
    m = manager(slots=4)
    for i in (1, 2, 3):
        stored(m, i)
    spec = m.prepare_load([k(3), k(1), k(2)])
    assert spec.keys == [k(3), k(1), k(2)]
    assert len(set(spec.slots)) == 3
    m.complete_load(spec.keys)
    m.prepare_store([k(9)])
    with pytest.raises(ValueError, match="not a readable host row"):
        m.prepare_load([k(1), k(9)])
    assert m.prepare_store([k(4), k(5)]).evicted_keys == [k(1), k(2)]  # k1 was not left pinned


def test_groups_have_their_own_slots():
    m = manager(slots=1, groups=2)
    stored(m, 1, group=0)
    out = m.prepare_store([k(1, 1)])
    assert out.evicted_keys == []
    m.complete_store(out.keys_to_store)
    assert m.prepare_store([k(2, 0)]).evicted_keys == [k(1, 0)]
    assert m.lookup(k(1, 1)) is HIT


def test_a_group_that_cannot_make_room_rejects_the_whole_call():
    m = manager(slots=1, groups=2)
    stored(m, 1, group=0)
    stored(m, 1, group=1)
    m.prepare_load([k(1, 1)])
    assert m.prepare_store([k(2, 0), k(2, 1)]) is None
    assert m.lookup(k(1, 0)) is HIT  # group 0's victim was given back


def test_unknown_group_is_an_error():
    with pytest.raises(ValueError, match="names group 3"):
        manager(groups=2).prepare_store([k(1, 3)])


def test_events_removals_first_each_once():
    m = manager(slots=2)
    stored(m, 1)
    stored(m, 2)
    events = m.take_events()
    assert [(e.removed, e.keys) for e in events] == [(False, [k(1), k(2)])]
    out = m.prepare_store([k(3)])
    m.complete_store(out.keys_to_store)
    events = m.take_events()
    assert [(e.removed, e.keys) for e in events] == [(True, [k(1)]), (False, [k(3)])]
    assert m.take_events() == []


def test_stored_then_removed_between_drains_is_not_reported():
    m = manager(slots=1)
    stored(m, 1)
    stored(m, 2)  # evicts k1 before anyone saw it stored
    assert [(e.removed, e.keys) for e in m.take_events()] == [(False, [k(2)])]


def test_reset_refused_while_pinned_then_clears():
    m = manager(slots=2)
    stored(m, 1, 2)
    m.take_events()
    m.prepare_load([k(1)])
    assert m.reset() is False
    assert m.lookup(k(1)) is HIT
    m.complete_load([k(1)])
    assert m.reset() is True
    assert m.lookup(k(1)) is MISS and m.lookup(k(2)) is MISS
    assert [(e.removed, sorted(e.keys)) for e in m.take_events()] == [(True, [k(1), k(2)])]
    assert m.num_free_slots(0) == 2


def test_reset_refused_while_a_store_is_in_flight():
    m = manager()
    m.prepare_store([k(1)])
    assert m.reset() is False


def test_completing_unknown_keys_is_harmless():
    m = manager()
    m.complete_store([k(5)])
    m.complete_load([k(5)])
    assert m.lookup(k(5)) is MISS


def test_a_hit_is_not_evicted_before_the_step_ends():
    m = manager(slots=2)
    stored(m, 1)
    stored(m, 2)
    assert m.lookup(k(1)) is HIT  # the scheduler will pin it with prepare_load later this step
    assert m.prepare_store([k(3)]).evicted_keys == [k(2)]
    assert m.prepare_store([k(4)]) is None  # k1 reported HIT, k3 in flight: nothing to evict
    m.on_schedule_end()
    assert m.prepare_store([k(4)]).evicted_keys == [k(1)]


def test_a_pinned_hit_needs_no_step_protection():
    m = manager(slots=2)
    stored(m, 1)
    stored(m, 2)
    assert m.lookup(k(1)) is HIT
    m.prepare_load([k(1)])
    m.complete_load([k(1)])  # loaded: nothing left to protect it for
    assert m.prepare_store([k(3)]).evicted_keys == [k(1)]


def _replay(m: HostTierManager, requests: list[list[bytes]], end_steps: bool, load: bool) -> int:
    """Drive ``m`` as vLLM's scheduler does, one request a step: lookups up to the first
    miss, the hits loaded (``load``) and touched, the rest stored; hits counted."""
    hits = 0
    for request in requests:
        h = 0
        while h < len(request) and m.lookup(request[h]) is HIT:
            h += 1
        if h and load:
            m.prepare_load(request[:h])
            m.complete_load(request[:h])
        if h:
            m.touch(request[:h])
        out = m.prepare_store(request[h:]) if h < len(request) else None
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store)
        if end_steps:
            m.on_schedule_end()
        hits += h
    return hits


def _documents(n: int = 600, docs: int = 40, blocks: int = 4, seed: int = 0) -> list[list[bytes]]:
    """Zipf-popular documents of ``blocks`` keys, the popular set moving on twice: a cache
    that stops taking new rows keeps the first set and misses the others."""
    rng = random.Random(seed)
    weights = [1 / (d + 1) for d in range(docs)]
    picks = [phase * docs + d for phase in range(3) for d in rng.choices(range(docs), weights, k=n)]
    return [[k(d * 100 + i) for i in range(blocks)] for d in picks]


@pytest.mark.parametrize("load", [True, False])
def test_a_caller_that_never_ends_its_steps_keeps_its_hit_ratio(load, caplog, monkeypatch):
    """Step protection is bounded: a driver that forgets ``on_schedule_end`` still stores and
    evicts, and hits about as often as one that ends every step (the floor scaled down to
    this 64-row tier)."""
    monkeypatch.setattr(manager_module, "STEP_HITS_MIN", 16)
    requests = _documents()
    ended = _replay(manager(slots=64), requests, end_steps=True, load=load)
    m = manager(slots=64)
    never = _replay(m, requests, end_steps=False, load=load)
    assert ended > len(requests)  # the workload reuses: the check can tell
    assert never >= 0.9 * ended
    assert len(m._step_hits) <= 16
    warned = [r for r in caplog.records if "on_schedule_end" in r.getMessage()]
    assert len(warned) == (0 if load else 1)  # loads pin their hits: nothing piles up


@pytest.mark.parametrize("groups", [1, 2])
def test_a_bad_key_is_an_error_that_changes_nothing(groups):
    m = manager(slots=2, groups=groups)
    stored(m, 1)
    with pytest.raises(ValueError, match="names group 5"):
        m.prepare_store([k(2), k(3, 5)])
    with pytest.raises(ValueError, match="too short"):
        m.prepare_store([k(2), b"\x00"])
    assert len(m) == 1 and m.lookup(k(2)) is MISS and m.lookup(k(1)) is HIT


class RunRecorder(LRUPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.runs: list[tuple[list[bytes], bytes | None]] = []

    def on_insert_run(self, keys, parent=None):
        self.runs.append((list(keys), parent))
        super().on_insert_run(keys, parent)


@pytest.mark.parametrize("groups", [1, 2])
def test_new_keys_reach_the_policy_as_runs_with_their_parent(groups):
    m = HostTierManager(groups, 8, RunRecorder)
    stored(m, 1, 2, 5)
    out = m.prepare_store([k(i) for i in (1, 2, 3, 4, 5, 6)])
    assert out.keys_to_store == [k(3), k(4), k(6)]
    runs = m._policies[0].runs
    assert runs[0] == ([k(1), k(2), k(5)], None)  # every key new: one run
    assert runs[1:] == [([k(6)], k(5)), ([k(3), k(4)], k(2))]  # tail first, as vLLM orders a request


class MissRecorder(LRUPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.told: list[tuple[list[bytes], int]] = []

    def on_miss(self, keys):
        self.told.append((list(keys), len(self)))  # before the eviction: what it holds then


@pytest.mark.parametrize("groups", [1, 2])
def test_a_policy_hears_of_a_stores_misses_before_its_eviction(groups):
    m = HostTierManager(groups, 3, MissRecorder)
    stored(m, 1, 2)
    keys = [k(3), k(1), k(4, group=groups - 1)]
    assert m.prepare_store(keys) is not None
    told = [(g, entry) for g, policy in enumerate(m._policies) for entry in policy.told]
    if groups == 1:
        assert told == [(0, ([k(1), k(2)], 0)), (0, ([k(3), k(4)], 2))]
    else:
        assert told == [(0, ([k(1), k(2)], 0)), (0, ([k(3)], 2)), (1, ([k(4, 1)], 0))]
    assert not HostTierManager(1, 2, LRUPolicy)._miss_hooks  # nobody listens: no call


def test_a_host_only_manager_has_no_work_below():
    m = manager()
    outcomes = []
    m.observe_results(outcomes.append)
    stored(m, 1, 2)
    assert m.lookup(k(3)) is MISS
    m.poll()
    assert (m.inflight_below(), m.wait_idle(0), outcomes) == (0, True, [])
    assert m.lower.tiers == [] and not m.lower.has_write_back


def test_host_lookup_answers_in_the_callers_values_and_is_lookup_otherwise():
    m = manager(slots=2)
    stored(m, 1)
    m.prepare_store([k(2)])
    look = m.host_lookup("hit", "miss", "pending")
    assert [look(k(1), "a context"), look(k(2)), look(k(3))] == ["hit", "pending", "miss"]
    assert (m.stats.lookups, m.stats.hits, m.stats.pending) == (3, 1, 1)
    m.complete_store([k(2)])
    out = m.prepare_store([k(3)])  # k(1), the older row, was a HIT this step: k(2) goes
    assert out is not None and out.evicted_keys == [k(2)]


def test_events_dropped_unread_leave_the_next_ones_intact():
    m = manager(slots=2)
    stored(m, 1)
    stored(m, 2)
    m.drop_events()
    stored(m, 3)  # evicts k(1), reported before: a removal
    assert m.take_events() == [
        TierEvent([k(1)], "host", removed=True),
        TierEvent([k(3)], "host", removed=False),
    ]


def test_a_stored_row_offered_again_is_used_again():
    m = manager(slots=3)
    for i in (1, 2, 3):
        stored(m, i)  # oldest first: 1, 2, 3
    first = m.prepare_store([k(1), k(4)])  # vLLM offers a whole prompt: k(1) is a use
    assert first is not None and first.evicted_keys == [k(2)]
    m.complete_store(first.keys_to_store)
    later = m.prepare_store([k(5)])
    assert later is not None and later.evicted_keys == [k(3)]  # not k(1): it was used after k(3)


def test_plan_store_and_pin_for_load_are_the_verbs_without_their_dataclasses():
    m = manager(slots=2)
    stored(m, 1, 2)
    planned = m.plan_store([k(1), k(3)])  # k(2), the older, makes room
    assert planned == ([k(3)], planned[1], [k(2)]) and len(planned[1]) == 1
    m.complete_store([k(3)])
    slots, layouts = m.pin_for_load([k(3), k(1)])
    assert slots == m.prepare_load([k(3), k(1)]).slots and layouts is None
    assert m.held_by_caller() == ({k(1): 2, k(3): 2}, [])


@pytest.mark.parametrize(("groups", "seed"), [(1, 1), (1, 2), (2, 3)])
def test_random_calls_keep_every_row_where_a_model_of_the_contract_says(groups, seed):
    """A model of the contract (each key: storing, ready with its pins; each row's slot) beside
    the manager through random calls, failed stores, loads, steps and resets included: every
    lookup, slot, victim and ``held_by_caller`` must agree with it, so no row's state is lost
    or left behind by any path that changes it."""
    rng = random.Random(seed)
    m = manager(slots=6, groups=groups)
    slot_of: dict[bytes, int] = {}
    storing: set[bytes] = set()
    pins: dict[bytes, int] = {}
    hit_this_step: set[bytes] = set()
    loads: list[list[bytes]] = []
    for _ in range(3_000):
        op = rng.random()
        group = rng.randrange(groups)
        if op < 0.4:
            keys = [k(rng.randrange(30), group) for _ in range(rng.randint(1, 4))]
            out = m.prepare_store(keys)
            if out is None:
                continue
            for victim in out.evicted_keys:
                assert victim not in storing and not pins.get(victim) and victim not in keys
                assert victim not in hit_this_step
                del slot_of[victim]
            assert out.keys_to_store == [key for key in dict.fromkeys(keys) if key not in slot_of]
            for key, slot in zip(out.keys_to_store, out.store_spec.slots, strict=True):
                assert slot not in {s for other, s in slot_of.items() if other[-4:] == key[-4:]}
                slot_of[key] = slot
            storing.update(out.keys_to_store)
            done = list(out.keys_to_store)
            success = rng.random() < 0.8
            m.complete_store(done, success=success)
            storing.difference_update(done)
            if not success:
                for key in done:
                    del slot_of[key]
        elif op < 0.65:
            key = k(rng.randrange(30), group)
            expected = MISS if key not in slot_of else PENDING if key in storing else HIT
            assert m.lookup(key) is expected
            if expected is HIT and rng.random() < 0.3:
                hit_this_step.add(key)  # kept from eviction until loaded or the step ends
            elif expected is HIT:
                hit_this_step.discard(key)  # the pin protects it now
                assert m.prepare_load([key]).slots == [slot_of[key]]
                pins[key] = pins.get(key, 0) + 1
                loads.append([key])
        elif op < 0.8 and loads:
            done = loads.pop(rng.randrange(len(loads)))
            m.complete_load(done)
            for key in done:
                pins[key] -= 1
        elif op < 0.95:
            m.on_schedule_end()
            m.drop_events()
            hit_this_step.clear()
        else:
            assert m.reset() is not any(pins.values())  # refused exactly while a load holds a row
            if not any(pins.values()):
                slot_of.clear()
        held_pins, held_storing = m.held_by_caller()
        assert held_pins == {key: n for key, n in pins.items() if n} and held_storing == []
        assert len(m) == len(slot_of)
        assert sum(m.num_free_slots(g) for g in range(groups)) == 6 * groups - len(slot_of)


def test_discard_forgets_one_groups_rows_and_frees_their_slots_for_the_policy_too():
    """A hybrid's state rows taken away from its attention rows (the engine tests' drop_rows):
    the state keys miss, the attention keys still hit, the slots are free again, and the
    policy never offers a discarded key for eviction."""
    m = manager(slots=2, groups=2)
    stored(m, 1, 2, group=0)  # attention rows
    stored(m, 2, group=1)  # the state row at the prefix's end
    m.take_events()

    assert m.discard([k(2, 1), k(9, 1)]) == 1  # an unknown key is nothing to forget

    assert [m.lookup(k(1, 0)), m.lookup(k(2, 0)), m.lookup(k(2, 1))] == [HIT, HIT, MISS]
    assert m.num_free_slots(1) == 2
    assert [e.removed for e in m.take_events()] == [True]
    stored(m, 3, 4, group=1)  # both slots usable: no eviction of a forgotten key
    assert m.lookup(k(3, 1)) == HIT and m.lookup(k(4, 1)) == HIT


def test_discard_leaves_pinned_rows():
    m = manager(slots=2)
    stored(m, 1)
    m.prepare_load([k(1)])
    assert m.discard([k(1)]) == 0
    assert m.lookup(k(1)) == HIT


def test_slot_of_is_the_slot_a_load_reads_and_none_once_the_row_is_gone():
    """The engine tests read a row's bytes where ``slot_of`` says (``row_bands``)."""
    m = manager(slots=2, groups=2)
    stored(m, 1, 2, group=1)
    slots = m.prepare_load([k(1, 1), k(2, 1)]).slots
    m.complete_load([k(1, 1), k(2, 1)])

    assert [m.slot_of(k(1, 1)), m.slot_of(k(2, 1))] == slots
    assert m.slot_of(k(1, 0)) is None  # the same block, another group: not held
    m.discard([k(1, 1)])
    assert m.slot_of(k(1, 1)) is None
