"""Oracle-informed index bounds: the replays, the fitted table, and the helpers they share."""

from __future__ import annotations

import pytest

from bench.index_bound import (
    ClockedIndex,
    PastTable,
    bounds,
    generator_value,
    horizon_value,
    main,
    new_blocks,
    turns,
)
from bench.simulate import device_prefix_hits, opt_hits
from bench.traces import Request, multi_turn, trace_stats


def test_turns_and_new_blocks_follow_the_chains() -> None:
    trace = [
        Request(0, (0, 1, 2)),  # a first turn
        Request(1, (0, 5)),  # shares only the system block: a new conversation
        Request(2, (0, 1, 2, 3)),  # extends the first: turn 2
        Request(3, (0, 1, 2, 3, 4, 6)),  # turn 3
        Request(4, (0, 1, 7)),  # a branch off the first conversation
    ]
    assert turns(trace) == [1, 1, 2, 3, 2]
    assert new_blocks(trace) == [3, 1, 1, 2, 1]


def test_the_generator_value_falls_with_idle_time_and_rises_with_turns() -> None:
    assert generator_value(1, 30_000) > generator_value(1, 600_000) > generator_value(1, 3_600_000) > 0
    assert generator_value(6, 60_000) > generator_value(1, 60_000)


def test_the_horizon_value_rises_with_turns_and_dies_with_a_long_idle_conversation() -> None:
    assert horizon_value(6, 60_000) > horizon_value(1, 60_000) > 0
    # A conversation idle for hours has almost surely ended: its blocks are worth little.
    assert horizon_value(1, 60_000) > 100 * horizon_value(1, 8 * 3_600_000)


def test_the_clocked_index_evicts_chain_tails_of_least_value_and_is_all_or_nothing() -> None:
    policy = ClockedIndex(8, lambda state, idle: float(state) - idle)
    policy.state = lambda _key: 0
    policy.on_insert_run([1, 2, 3])
    policy.now = 10.0
    policy.state = lambda _key: 100
    policy.on_insert_run([4, 5])
    assert policy.evict(2) == [3, 2]  # the low-valued chain, from its tail
    assert set(policy) == {1, 4, 5}
    assert policy.evict(3, lambda key: key != 4) is None
    assert set(policy) == {1, 4, 5}


def test_bounds_stay_under_belady_and_are_deterministic() -> None:
    trace = multi_turn(seed=3, sessions=300)
    which = ["generator", "horizon", "fitted"]
    first = bounds(trace, which)
    assert first == bounds(trace, which)
    out_of_sample = bounds(trace, ["fitted"], fit_trace=multi_turn(seed=4, sessions=300))
    assert out_of_sample["sampled-lru"] == first["sampled-lru"]
    distinct = trace_stats(trace)["distinct"]
    device, host = max(1, round(distinct * 0.02)), max(1, round(distinct * 0.10))
    hits = device_prefix_hits(trace, device)
    opt = opt_hits(trace, host, hits) / sum(len(r.keys) for r in trace)
    assert set(first) == {"sampled-lru", *which}
    for name, ratio in [*first.items(), ("fitted out of sample", out_of_sample["fitted"])]:
        assert 0.0 < ratio <= opt, name


def test_the_command_line_rejects_what_it_cannot_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--trace", "real", "--bounds", "generator"])
    with pytest.raises(SystemExit):
        main(["--trace", "real", "--bounds", "fitted", "--fit-on", "other"])
    with pytest.raises(SystemExit):
        main(["--bounds", "oracle"])
    with pytest.raises(SystemExit):
        main(["--trace", "nope", "--bounds", "fitted"])
    with pytest.raises(SystemExit):
        main(["--bounds", "fitted", "--refit-every", "10"])  # refits are of a table fitted on the past
    assert "generator" in capsys.readouterr().err


def test_the_past_table_censors_blocks_not_yet_back_instead_of_taking_them_for_dead() -> None:
    cls = (1, 1, False, 0)
    before, after = PastTable(), PastTable()
    for past in (before, after):
        for t in (0.0, 10_000.0):  # four blocks used twice, 10 s apart
            past.observe(Request(t, (1, 2, 3, 4)), 0, [cls] * 4)
    # Four more blocks of the class, used a second ago: not known to be dead. Counted as
    # dead they would lower the class's returns per slot-time.
    after.observe(Request(60_000.0, (5, 6, 7, 8)), 0, [cls] * 4)
    assert before.table(now=61_000.0)[cls][0] > 0
    assert after.table(now=61_000.0)[cls] == pytest.approx(before.table(now=61_000.0)[cls])
    # Left unused for an hour they are evidence: the class's value falls.
    assert after.table(now=3_660_000.0)[cls][0] < 0.9 * before.table(now=3_660_000.0)[cls][0]


def test_the_past_table_counts_a_reuse_the_device_serves_as_no_return() -> None:
    cls = (1, 1, False, 0)
    tiers, device = PastTable(), PastTable()
    for past, device_hits in ((tiers, 0), (device, 2)):
        past.observe(Request(0.0, (1, 2, 3, 4)), 0, [cls] * 4)
        past.observe(Request(10_000.0, (1, 2, 3, 4)), device_hits, [(2, 2, False, 0)] * 4)
    # Two of the four returns went to the device: the tiers saw half as many.
    assert 0 < device.table(now=20_000.0)[cls][0] < 0.6 * tiers.table(now=20_000.0)[cls][0]


def test_a_table_refitted_on_the_past_fits_on_requests_already_replayed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = multi_turn(seed=3, sessions=300)
    seen: list[float] = []
    fits: list[tuple[float, float]] = []
    observe, table = PastTable.observe, PastTable.table

    def observing(self: PastTable, request: Request, device_hits: int, classes: list[tuple]) -> None:
        seen.append(request.timestamp)
        observe(self, request, device_hits, classes)

    def fitting(self: PastTable, now: float) -> dict[tuple, list[float]]:
        fits.append((now, max(seen)))
        return table(self, now)

    monkeypatch.setattr(PastTable, "observe", observing)
    monkeypatch.setattr(PastTable, "table", fitting)
    out = bounds(trace, ["fitted"], refit_every=30)
    assert len(fits) == (len(trace) - 1) // 30
    assert all(latest < now for now, latest in fits)  # nothing from now on was observed
    assert len(seen) == len(trace)
    assert 0.0 < out["fitted"] <= 1.0
    with pytest.raises(ValueError, match="past"):
        bounds(trace, ["fitted"], fit_trace=trace, refit_every=30)


def test_a_class_the_past_table_has_seen_little_of_gets_the_row_of_its_like() -> None:
    past = PastTable()
    common, rare = (1, 1, False, 0), (8, 1, False, 0)
    keys = tuple(range(PastTable.BACK_OFF))
    for t in (0.0, 10_000.0):
        past.observe(Request(t, keys), 0, [common] * len(keys))
    past.observe(Request(20_000.0, (-1,)), 0, [rare])  # one block of a conversation's eighth turn
    table = past.table(now=30_000.0)
    # One block idle for 10 s says little; its own row would value it as never returning.
    assert table[rare] == table[(None, 1, False, 0)]
    assert table[rare][0] > 0
