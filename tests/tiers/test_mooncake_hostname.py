"""``local_hostname``: the address a Mooncake client tells the others (``tiers.mooncake.hostname``).

Across hosts, a client left on the loopback mounts its segment, and then every transfer
another host makes to it fails (issue #20: 760 of 1,200 rows dropped). Unset, the address is
this machine's on the route to the master; a loopback one with a master elsewhere is refused
by the configuration and by the tier. This machine's non-loopback address stands in for the
network (the cluster tests, ``tests/cluster``, use real network namespaces).
"""

from __future__ import annotations

import pytest

from tests.tiers.test_mooncake_listen import loopback_interface, needs_other_address
from tiers.address import Address
from tiers.mooncake import hostname as mooncake_hostname
from tiers.mooncake import listen as mooncake_listen


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_spellings(host):
    assert mooncake_hostname.is_loopback(host)


@pytest.mark.parametrize("host", ["10.0.0.7", "192.0.2.2", "fd00::2", "master.example", "0.0.0.0"])
def test_not_loopback(host):
    assert not mooncake_hostname.is_loopback(host)


def test_a_loopback_hostname_is_a_problem_only_with_a_master_elsewhere():
    elsewhere, here = Address.parse("10.0.0.5:50051"), Address.parse("127.0.0.1:50051")
    for loopback in ("127.0.0.1", "127.0.0.1:17000", "localhost", "::1"):
        assert "a loopback address" in (mooncake_hostname.loopback_problem(loopback, elsewhere) or "")
        assert mooncake_hostname.loopback_problem(loopback, here) is None
    assert mooncake_hostname.loopback_problem("10.0.0.7", elsewhere) is None


def test_unset_is_the_address_on_the_route_to_the_master():
    address = needs_other_address()
    assert mooncake_hostname.advertised_hostname("", Address.parse(f"{address}:50051")) == address
    assert mooncake_hostname.advertised_hostname("", Address.parse("127.0.0.1:50051")) == "127.0.0.1"
    assert mooncake_hostname.advertised_hostname("10.0.0.7", Address.parse(f"{address}:1")) == "10.0.0.7"


def test_a_loopback_hostname_with_a_master_elsewhere_is_refused_naming_the_key():
    address = needs_other_address()
    with pytest.raises(ValueError, match=r"local_hostname = '127\.0\.0\.1': a loopback address"):
        mooncake_hostname.advertised_hostname("127.0.0.1", Address.parse(f"{address}:50051"))


def test_a_master_name_that_resolves_to_the_loopback_allows_a_loopback_hostname():
    assert mooncake_hostname.advertised_hostname("127.0.0.1", Address.parse("localhost:50051")) == "127.0.0.1"


@pytest.mark.multiprocess
async def test_multiprocess_a_client_off_the_loopback_advertises_and_listens_on_the_masters_route(tmp_path):
    """A master on this machine's other address: a storage client left unset is told that
    address (and listens there only); an engine that mounts nothing puts rows into its
    segment and reads them back through it."""
    pytest.importorskip("mooncake.store")
    from tests.tiers.mooncake_fixtures import open_tier, start_master
    from tests.tiers.peer_fixtures import HostRows, key

    address = needs_other_address()
    master = start_master(tmp_path, host=address)
    storage_rows, rows = HostRows([64 << 10] * 2, seed=1), HostRows([64 << 10] * 8, seed=2)
    keys = [key(i, salt=b"route") for i in range(8)]
    try:
        async with (
            open_tier(master, storage_rows.view, namespace=b"route") as storage,
            open_tier(master, rows.view, namespace=b"route", capacity_bytes=0) as engine,
        ):
            for tier in (storage, engine):
                assert tier.local_hostname == address
                assert tier.listening_on == mooncake_listen.interface_for(address) != loopback_interface()
            assert await engine.put(list(zip(keys, rows.src, strict=True))) == [True] * 8
            rows.clear_dst()
            assert await engine.get(list(zip(keys, rows.dst, strict=True))) == [True] * 8
            assert all(rows.same(i) for i in range(8))
    finally:
        master.close()


@pytest.mark.multiprocess
async def test_multiprocess_the_tier_refuses_a_loopback_hostname_before_joining(tmp_path):
    pytest.importorskip("mooncake.store")
    from tests.tiers.mooncake_fixtures import open_tier, start_master
    from tests.tiers.peer_fixtures import aligned_buffer
    from tiers.base import TierError

    address = needs_other_address()
    master = start_master(tmp_path, host=address)
    before = mooncake_listen.listening_sockets()
    try:
        with pytest.raises(TierError, match=r"local_hostname = '127\.0\.0\.1': a loopback address.*master"):
            async with open_tier(master, memoryview(aligned_buffer(1 << 20)), local_hostname="127.0.0.1"):
                pass
        assert mooncake_listen.new_listeners(before) == []  # setup never ran
    finally:
        master.close()
