"""Deadlines hold for peers on other hosts, whatever one host does.

An engine host (``bench/cluster_engine.py``: a ``RemoteTier``) and three peer hosts; one
peer (the victim) is killed, stopped, cut off, partitioned one way or slowed to a trickle
after the rows went in. Then every verb of the remote tier (get, contains, put), the first
of them meeting the fault while the victim still counts as up, must end within the tier's
deadline plus ``SLACK_S``; the victim's rows are misses, the other peers' rows are served
byte for byte, the warnings and stats blame the victim and never a healthy peer, and only
the victim is marked down.
"""

from __future__ import annotations

import pytest

from bench.cluster_net import FAULTS

pytestmark = pytest.mark.multiprocess

DEADLINE_S = 1.0
SLACK_S = 1.5  # how far past its deadline a call may end and still count as "no stall"
ROWS = 48
VERBS = ["get", "contains", "put"]


@pytest.mark.parametrize("first", VERBS)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_peer_costs_a_call_at_most_its_deadline(make_cluster, fault, first) -> None:
    cluster = make_cluster(4)
    engine_host, victim, *healthy = cluster.hosts
    peers = cluster.start_peers([victim, *healthy], capacity="16MiB", row_bytes="64KiB")
    engine = cluster.start_engine(
        engine_host, [victim, *healthy], rows=ROWS, row_bytes="64KiB", deadline_s=DEADLINE_S
    )
    assert engine.request({"op": "put", "salt": "before"})["result"] == [True] * ROWS
    owners = engine.request({"op": "owners", "salt": "before"})["result"]
    on_victim = [owner == victim.peer_address() for owner in owners]
    assert any(on_victim) and not all(on_victim)
    engine.request({"op": "state", "clear": True})
    cluster.inflict(victim, peers[0], fault)  # "slow": 200 kbit/s, the victim's rows need ~10 s

    for n, verb in enumerate([first, *(v for v in VERBS if v != first)]):
        answer = engine.request({"op": verb, "salt": "after" if verb == "put" else "before"})
        took = answer["elapsed_s"]
        assert took < DEADLINE_S + SLACK_S, f"{verb} took {took:.2f} s after the victim was {fault}"
        if fault == "slow" and verb == "contains" and n == 0:
            # A slow link still carries a short question and its answer in time: the victim is
            # not at fault yet, and says what it holds (the rows' transfers are what fail).
            assert answer["result"] == [True] * ROWS
            continue
        if verb in ("get", "contains"):
            assert answer["result"] == [not mine for mine in on_victim]  # the others' rows still served
        if verb == "get":
            assert answer["exact"]
        if verb == "put" and verb != first:
            assert answer["result"] == [True] * ROWS  # the victim is down: its share went to the others
        if verb == "put" and verb == first:  # the victim's share failed, the others stored theirs
            stored = [ok for ok, owner in zip(answer["result"], owners, strict=True) if owner != victim]
            assert sum(answer["result"]) >= sum(stored) > 0

    state = engine.request({"op": "state"})
    assert state["peers_up"] == [host.peer_address() for host in healthy]
    assert state["stats"]["peer_failures"] == 1
    if fault not in ("killed", "slow"):  # a slow peer may say its transfer failed, in time
        assert state["stats"]["timeouts"] >= 1  # a silent host costs a deadline, then it is down
    blamed = state["warnings"]
    assert any(victim.peer_address() in message for message in blamed), blamed
    for host in healthy:
        assert not [m for m in blamed if host.address in m], f"a healthy peer was blamed: {blamed}"
