"""The peer's slot bookkeeping: two-phase puts, leases, eviction, expiry (no processes)."""

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import make_policy
from tiers.remote.pool import PeerPool, PoolLimitError, UnknownAllocation
from tiers.remote.protocol import EXISTS, NO_SLOT
from tiers.row_format import RowHeader

SLOT = 100


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool(slots: int = 4, clock: Clock | None = None, **kw) -> PeerPool:
    return PeerPool(slots, SLOT, make_policy("lru", slots), clock=clock or Clock(), **kw)


def header(length: int = SLOT) -> bytes:
    return RowHeader(b"L" * 16, length, 1).pack()


def put(p: PeerPool, owner: int, keys: list[bytes], length: int = SLOT) -> list[int]:
    alloc_id, slots = p.allocate(owner, keys, [length] * len(keys))
    written = [s for s in slots if s < EXISTS]
    if written:
        assert p.commit(owner, alloc_id, [header(length)] * len(written)) == [True] * len(written)
    return slots


def test_two_phase_put_then_lease():
    p = pool()
    alloc_id, slots = p.allocate(1, [b"a", b"b"], [SLOT, 50])
    assert slots == [0, 1]
    assert p.lookup(2, [b"a"])[1] == [None]  # not visible before commit
    assert p.commit(1, alloc_id, [header(), header(50)]) == [True, True]
    lease, entries = p.lookup(2, [b"a", b"zz", b"b"])
    assert lease and entries == [(0, header()), None, (1, header(50))]
    assert p.allocate(1, [b"a", b"c"], [SLOT, SLOT])[1] == [EXISTS, 2]
    p.release(2, lease)
    p.check()


def test_commit_rejects_missing_or_wrong_headers_and_strangers():
    p = pool()
    alloc_id, _ = p.allocate(1, [b"a", b"b", b"c"], [SLOT, SLOT, SLOT])
    with pytest.raises(UnknownAllocation):
        p.commit(2, alloc_id, [header()] * 3)  # another connection's allocation
    assert p.commit(1, alloc_id, [header(), bytes(40), header(7)]) == [True, False, False]
    assert p.contains([b"a", b"b", b"c"]) == [True, False, False]
    with pytest.raises(UnknownAllocation):
        p.commit(1, alloc_id, [header()])  # committed already
    assert p.allocate(1, [b"big"], [SLOT + 1])[1] == [NO_SLOT]
    p.check()


def test_eviction_never_takes_a_leased_slot():
    p = pool(slots=2)
    put(p, 1, [b"old", b"new"])
    lease, _ = p.lookup(9, [b"old"])
    touch, _ = p.lookup(9, [b"new"])  # "old" is least recent now, but leased
    p.release(9, touch)
    assert put(p, 1, [b"x"]) == [1]  # took "new"'s slot
    assert p.contains([b"old", b"new", b"x"]) == [True, False, True]
    assert p.allocate(1, [b"y", b"z"], [SLOT, SLOT])[1] == [1, NO_SLOT]  # only "x" could go
    p.check()
    p.release(9, lease)


def test_a_deleted_leased_row_keeps_its_slot_until_released():
    p = pool(slots=1)
    put(p, 1, [b"a"])
    lease, _entries = p.lookup(2, [b"a"])
    assert p.delete([b"a"]) == 1
    assert p.allocate(1, [b"b"], [SLOT])[1] == [NO_SLOT]  # slot 0 is retired, not free
    p.check()
    p.release(2, lease)
    assert put(p, 1, [b"b"]) == [0]
    p.check()


def test_uncommitted_allocations_and_forgotten_leases_expire():
    clock = Clock()
    p = pool(slots=2, clock=clock, alloc_ttl_s=1.0, lease_ttl_s=2.0)
    p.allocate(1, [b"a"], [SLOT])
    put(p, 1, [b"b"])
    p.lookup(3, [b"b"])
    clock.now = 1.5
    p.expire()
    assert p.stats()["pending_slots"] == 0 and p.stats()["leases"] == 1
    clock.now = 2.5
    p.expire()
    assert p.stats()["leases"] == 0
    assert p.counters["allocs_expired"] == 1 and p.counters["leases_expired"] == 1
    p.check()


def test_a_closed_connection_gives_everything_back():
    p = pool(slots=3)
    put(p, 1, [b"a"])
    p.allocate(7, [b"b", b"c"], [SLOT, SLOT])
    p.lookup(7, [b"a"])
    p.drop_owner(7)
    assert p.stats()["free_slots"] == 2 and p.stats()["leases"] == 0
    p.check()


def test_limits_per_connection():
    p = pool(slots=8, max_allocs_per_owner=2, max_leases_per_owner=1)
    p.allocate(1, [b"a"], [SLOT])
    p.allocate(1, [b"b"], [SLOT])
    with pytest.raises(PoolLimitError):
        p.allocate(1, [b"c"], [SLOT])
    put(p, 2, [b"d"])
    p.lookup(3, [b"d"])
    with pytest.raises(PoolLimitError):
        p.lookup(3, [b"d"])


def _apply(
    p: PeerPool,
    op: str,
    owner: int,
    keys: list[bytes],
    allocs: list[tuple[int, int, int]],
    leases: list[tuple[int, int]],
    **tenant: str,
) -> list:
    """One verb of a random sequence against ``p``; ``allocs`` and ``leases`` carry what is
    open between steps. Returns the entries of a ``get``, ``[]`` otherwise."""
    if op in ("put", "alloc"):
        alloc_id, slots = p.allocate(owner, keys, [SLOT] * len(keys), **tenant)
        n = sum(s < EXISTS for s in slots)
        if op == "put" and n:
            p.commit(owner, alloc_id, [header()] * n)
        elif n:
            allocs.append((owner, alloc_id, n))
    elif op == "commit" and allocs:
        owner, alloc_id, n = allocs.pop()
        with contextlib.suppress(UnknownAllocation):  # expired or dropped meanwhile
            p.commit(owner, alloc_id, [header()] * n)
    elif op == "abort" and allocs:
        p.abort(*allocs.pop()[:2])
    elif op == "get":
        lease, entries = p.lookup(owner, keys, **tenant)
        if lease:
            leases.append((owner, lease))
        return entries
    elif op == "release" and leases:
        p.release(*leases.pop())
    elif op == "delete":
        p.delete(keys, **tenant)
    elif op == "expire":
        p.expire()
    elif op == "drop":
        p.drop_owner(owner)
    return []


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "alloc", "commit", "abort", "get", "release", "delete", "expire", "drop"]),
        st.integers(0, 3),  # owner
        st.lists(st.integers(0, 11), min_size=1, max_size=5),  # keys
    ),
    max_size=60,
)


@given(OPS)
@settings(max_examples=150, deadline=None)
def test_every_slot_is_in_exactly_one_state(ops):
    clock = Clock()
    p = pool(slots=6, clock=clock, alloc_ttl_s=3.0, lease_ttl_s=3.0)
    allocs: list[tuple[int, int, int]] = []
    leases: list[tuple[int, int]] = []
    for op, owner, ks in ops:
        clock.now += 0.5
        keys = [bytes([k]) for k in ks]
        entries = _apply(p, op, owner, keys, allocs, leases)
        if op == "get":
            found = {key: entry[0] for key, entry in zip(keys, entries, strict=True) if entry}
            assert len(set(found.values())) == len(found)  # distinct keys, distinct slots
        p.check()
        stored = [p._index[k][0] for k in p._index]
        assert len(stored) == len(set(stored))  # no two keys share a slot


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "tinylfu"])
def test_any_policy_evicts_into_a_consistent_pool(policy):
    p = PeerPool(8, SLOT, make_policy(policy, 8), clock=Clock())
    for round_no in range(6):
        keys = [bytes([round_no, i]) for i in range(5)]
        slots = put(p, 1, keys)
        assert all(s < EXISTS for s in slots)  # nothing leased: eviction always makes room
        lease, entries = p.lookup(2, keys[:2])
        assert all(entries)
        p.check()
        p.release(2, lease)
    assert p.stats()["rows"] == 8 and p.counters["evictions"] == 6 * 5 - 8


# -- tenants --------------------------------------------------------------------------------


def test_each_verb_acts_in_its_tenants_namespace_only():
    p = pool(slots=8, quotas={"a": 4, "b": 4})
    alloc_id, slots = p.allocate(1, [b"k"], [SLOT], tenant="a")
    p.commit(1, alloc_id, [header()])
    assert p.contains([b"k"], tenant="b") == [False] and p.contains([b"k"], tenant="a") == [True]
    assert p.lookup(2, [b"k"], tenant="b") == (0, [None])
    assert p.delete([b"k"], tenant="b") == 0
    alloc_b, slots_b = p.allocate(2, [b"k"], [SLOT], tenant="b")
    assert slots_b[0] < EXISTS and slots_b[0] != slots[0]  # a row of its own, not EXISTS
    p.commit(2, alloc_b, [header()])
    assert p.stats("a")["rows"] == 1 and p.stats("b")["rows"] == 1 and p.stats()["rows"] == 2
    assert p.delete([b"k"], tenant="a") == 1 and p.contains([b"k"], tenant="b") == [True]
    p.check()


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "tinylfu"])
def test_a_flooding_tenant_evicts_only_its_own_rows(policy):
    p = PeerPool(8, SLOT, make_policy(policy, 8), quotas={"victim": 4, "flood": 4}, clock=Clock())
    victim = [b"v%d" % i for i in range(4)]
    alloc_id, slots = p.allocate(1, victim, [SLOT] * 4, tenant="victim")
    p.commit(1, alloc_id, [header()] * 4)
    for round_no in range(10):
        keys = [b"f%d-%d" % (round_no, i) for i in range(3)]
        alloc_id, slots = p.allocate(2, keys, [SLOT] * 3, tenant="flood")
        assert all(s < EXISTS for s in slots)  # it always has room: its own old rows
        p.commit(2, alloc_id, [header()] * 3)
        p.check()
    assert p.contains(victim, tenant="victim") == [True] * 4
    assert p.stats("flood")["used_slots"] == 4 and p.stats("victim")["evictions"] == 0


def test_a_tenant_at_its_quota_with_everything_leased_is_refused_not_served_from_others():
    p = pool(slots=4, quotas={"a": 2, "b": 2})
    put_a = p.allocate(1, [b"a1", b"a2"], [SLOT] * 2, tenant="a")
    p.commit(1, put_a[0], [header()] * 2)
    p.lookup(1, [b"a1", b"a2"], tenant="a")  # leased: not evictable
    assert p.allocate(1, [b"a3"], [SLOT], tenant="a") == (0, [NO_SLOT])
    assert p.stats()["free_slots"] == 2  # b's share stays free for b
    p.check()


TENANT_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "alloc", "commit", "get", "release", "delete", "expire", "drop"]),
        st.integers(0, 3),  # owner; tenant = "t%d" % (owner % 2)
        st.lists(st.integers(0, 11), min_size=1, max_size=5),
    ),
    max_size=60,
)


@given(TENANT_OPS)
@settings(max_examples=150, deadline=None)
def test_quotas_and_namespaces_hold_under_any_sequence(ops):
    clock = Clock()
    p = pool(slots=7, clock=clock, alloc_ttl_s=3.0, lease_ttl_s=3.0, quotas={"t0": 3, "t1": 3})
    allocs: list[tuple[int, int, int]] = []
    leases: list[tuple[int, int]] = []
    for op, owner, ks in ops:
        clock.now += 0.5
        _apply(p, op, owner, [bytes([k]) for k in ks], allocs, leases, tenant=f"t{owner % 2}")
        p.check()  # includes: no tenant holds more than its quota; rows counted per tenant
        assert p.stats("t0")["used_slots"] <= 3 and p.stats("t1")["used_slots"] <= 3


def test_a_lost_run_forgets_only_its_tenants_rows_and_keeps_leased_slots_retired():
    """A tenant worker ended with the rows it held: ``drop_run`` forgets them (counted as
    corrupt), leaves the other tenant's rows, and a slot still leased stays out of use."""
    p = pool(slots=8, quotas={"a": 4, "b": 4})
    for tenant, owner in (("a", 1), ("b", 2)):
        alloc_id, _ = p.allocate(owner, [b"k1", b"k2"], [SLOT] * 2, tenant=tenant)
        p.commit(owner, alloc_id, [header()] * 2)
    lease_id, _ = p.lookup(3, [b"k1"], tenant="a")
    assert p.drop_run("a") == 2
    assert p.contains([b"k1", b"k2"], tenant="a") == [False, False]
    assert p.contains([b"k1", b"k2"], tenant="b") == [True, True]
    assert p.stats("a")["rows_corrupt"] == 2 and p.stats("a")["rows_deleted"] == 0
    p.release(3, lease_id)
    p.check()
