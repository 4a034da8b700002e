"""What an engine sees when a peer's host fails: misses, never a stall.

A standalone ``Offloader`` (``bench/cluster_offloader.py``: a host tier and a write-through
remote tier over three peer hosts) stores rows, then more rows that push the first out of
its host tier, so the first live on the peers only. One peer fails; then a lookup of the
first rows returns at once (it starts their promotions), the promotions end within the
deadline plus ``SLACK_S``, and the next lookup hits exactly the rows of the healthy peers,
byte for byte.
"""

from __future__ import annotations

import pytest

from bench.cluster_net import FAULTS

pytestmark = pytest.mark.multiprocess

DEADLINE_S = 1.0
SLACK_S = 1.5
ROWS = 16


@pytest.mark.parametrize("fault", FAULTS)
def test_an_engine_sees_misses_never_a_stall(make_cluster, fault) -> None:
    cluster = make_cluster(4)
    engine_host, victim, *healthy = cluster.hosts
    peers = cluster.start_peers([victim, *healthy], capacity="16MiB", row_bytes="64KiB")
    engine = cluster.start_engine(
        engine_host,
        [victim, *healthy],
        module="bench.cluster_offloader",
        deadline_s=DEADLINE_S,
        host_rows=ROWS,
    )
    engine.request({"op": "store", "salt": "first", "count": ROWS}, timeout=120)
    engine.request({"op": "store", "salt": "filler", "count": ROWS, "first_block": ROWS}, timeout=120)
    owners = engine.request({"op": "owners", "salt": "first", "count": ROWS})["result"]
    on_victim = [owner == victim.peer_address() for owner in owners]
    assert any(on_victim) and not all(on_victim)
    cluster.inflict(victim, peers[0], fault)

    first = engine.request({"op": "lookup", "salt": "first", "count": ROWS})
    assert first["result"] == [0] * ROWS  # on the peers only: misses now, promotions started
    assert first["elapsed_s"] < DEADLINE_S  # a lookup does not wait for the network
    settle = engine.request({"op": "settle", "timeout_s": DEADLINE_S + SLACK_S + 10})
    assert "error" not in settle, settle
    assert settle["elapsed_s"] < DEADLINE_S + SLACK_S  # the promotions ended by their deadline
    second = engine.request({"op": "lookup", "salt": "first", "count": ROWS})
    assert second["result"] == [0 if mine else 1 for mine in on_victim]
    check = engine.request({"op": "load_check", "salt": "first", "count": ROWS})
    assert check["loaded"] == on_victim.count(False) and check["exact"]
