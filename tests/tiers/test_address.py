"""``host:port``: the one grammar of peers, Mooncake's master, ``--listen`` and ``local_hostname``."""

import pytest

from tiers.address import Address, split_host_port
from tiers.mooncake.listen import check_hostname


def test_host_port_forms_and_the_text_as_written() -> None:
    assert Address.parse("[::1]:7400") == Address("::1", 7400, "[::1]:7400")
    assert Address.parse("::1:7400").host == "::1"  # the port follows the last colon
    assert str(Address.parse("peer-a:7400")) == "peer-a:7400"  # rendezvous hashes this text
    assert Address.parse("0.0.0.0:0", any_port=True).port == 0


@pytest.mark.parametrize("bad", ["nohost", ":1", "a:", "a:0", "a:65536", "a:x", "[x]", None, 5])
def test_what_is_not_host_port(bad: object) -> None:
    with pytest.raises(ValueError, match="is not 'host:port'"):
        Address.parse(bad)


def test_a_port_may_be_left_out_where_it_is_optional() -> None:
    assert split_host_port("fe80::1") == ("fe80::1", "")
    assert split_host_port("[fe80::1]:80") == ("fe80::1", "80")
    assert split_host_port("10.0.0.7:80") == ("10.0.0.7", "80")
    assert all(check_hostname(ok) is None for ok in ("10.0.0.7", "[::1]", "h:80", "[::1]:80", "::1"))
    assert check_hostname("host:99999") == "port '99999' is not in 1..65535"
    assert check_hostname("a b") and check_hostname("") and check_hostname("[foo]")
