"""The Mooncake tier's fault bookkeeping (``tiers.mooncake.faults``): Mooncake's TCP timeouts
from the deadline (an operator's setting wins), storage hosts that rest after a late call,
and drops logged by reason at a bounded rate. The behaviour against real processes is in
``test_mooncake.py`` (a SIGSTOPped storage process) and ``tests/cluster``."""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest

from tiers.mooncake import faults
from tiers.shared import Backoff


def test_store_timeouts_follow_the_deadline_unless_the_operator_set_them(monkeypatch):
    for name in faults.STORE_TIMEOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "7")
    assert faults.bound_store_timeouts(5.0) == {
        "MC_TCP_PROGRESS_TIMEOUT_SEC": "2",
        "MC_TCP_STATUS_TIMEOUT_SEC": "7",
    }
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC")
    assert faults.bound_store_timeouts(0.5)["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "1"  # whole seconds, at least 1


def test_a_suspect_host_rests_doubling_per_repeat_and_others_are_untouched():
    hosts = faults.SuspectHosts(Backoff(0.2, 10.0))
    first = hosts.suspect(["10.0.0.3:15000"])
    assert hosts.active() == {"10.0.0.3:15000"}
    second = hosts.suspect(["10.0.0.3:15000"])
    assert 0.15 <= first <= 0.2 and 0.3 <= second <= 0.4  # jittered down by at most a quarter
    assert "10.0.0.4:15000" not in hosts.active()


def test_a_host_whose_rest_ended_is_asked_again():
    hosts = faults.SuspectHosts(Backoff(0.05, 0.05))
    hosts.suspect(["10.0.0.3:15000"])
    time.sleep(0.06)
    assert hosts.active() == frozenset()


def test_drops_are_logged_by_reason_at_most_once_per_interval(caplog):
    drops = faults.DropLog(interval_s=60.0)
    with caplog.at_level(logging.WARNING, logger="tiers.mooncake.faults"):
        drops.add(Counter({"no space in the store (-200)": 3}), 8)
        drops.add(Counter({"past the deadline": 2}), 2)  # within the interval: held back, kept
        drops.add(Counter(), 4)  # nothing dropped: nothing to say
    assert len(caplog.records) == 1
    assert "3 no space in the store (-200)" in caplog.text and "3 of 8" in caplog.text
    drops._next_at = 0.0  # the interval is over
    with caplog.at_level(logging.WARNING, logger="tiers.mooncake.faults"):
        drops.add(Counter({"past the deadline": 1}), 1)
    assert "3 past the deadline" in caplog.records[-1].getMessage()  # the held-back ones, counted


@pytest.mark.parametrize("missing", [{}, {"a": []}])
def test_objects_the_store_does_not_place_name_no_host(missing):
    assert faults.replica_hosts(missing) == {}
