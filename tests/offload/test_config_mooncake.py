"""The ``kind = "mooncake"`` tier's keys: parsed into ``MooncakeSettings``, each error naming its key."""

import sys

import pytest

from offload.config import ConfigError, load_config, parse_config
from tiers.address import Address
from tiers.settings import MooncakeSettings

GOOD = """
[[tiers]]
kind = "host"
capacity = "1GiB"

[[tiers]]
kind = "mooncake"
master = "10.0.0.5:50051"
capacity = "16GiB"
metadata_server = "http://10.0.0.5:8080/metadata"
local_buffer = "64MiB"
protocol = "rdma"
device_name = "mlx5_0"
local_hostname = "10.0.0.7"
replicas = 2
deadline_s = 5
"""


def tiers(**mooncake) -> list[dict]:
    return [{"kind": "host", "capacity": "1GiB"}, {"kind": "mooncake", "capacity": "1GiB", **mooncake}]


def test_full_table_parses(tmp_path):
    pytest.importorskip("mooncake.store")
    path = tmp_path / "tiers.toml"
    path.write_text(GOOD)
    tier = load_config(path).tiers[1]
    assert (tier.kind, tier.capacity_bytes, tier.deadline_s, tier.admission) == (
        "mooncake",
        16 << 30,
        5.0,
        "all",
    )
    assert tier == MooncakeSettings(
        capacity_bytes=16 << 30,
        deadline_s=5.0,
        master=Address.parse("10.0.0.5:50051"),
        metadata_server="http://10.0.0.5:8080/metadata",
        local_buffer_bytes=64 << 20,
        protocol="rdma",
        device_name="mlx5_0",
        local_hostname="10.0.0.7",
        replicas=2,
    )


def test_defaults():
    pytest.importorskip("mooncake.store")
    tier = parse_config({"tiers": tiers(master="127.0.0.1:50051")}).tiers[1]
    assert tier == MooncakeSettings(capacity_bytes=1 << 30, master=Address.parse("127.0.0.1:50051"))
    assert (tier.placement, tier.promotion, tier.deadline_s) == ("write-back", True, 2.0)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({}, r"tiers\[1\]\.master = None: expected the master's 'host:port'"),
        ({"master": "nohost"}, r"tiers\[1\]\.master = 'nohost'"),
        ({"master": "a:1", "capacity": "8MiB"}, r"tiers\[1\]\.capacity = 8388608: .*at least 16MiB"),
        (
            {"master": "a:1", "protocol": "udp"},
            r"tiers\[1\]\.protocol = 'udp': expected one of \['tcp', 'rdma'\]",
        ),
        ({"master": "a:1", "replicas": 0}, r"tiers\[1\]\.replicas = 0"),
        ({"master": "a:1", "deadline_s": 60}, r"tiers\[1\]\.deadline_s = 60"),
        ({"master": "a:1", "local_buffer": "lots"}, r"tiers\[1\]\.local_buffer = 'lots'"),
        ({"master": "a:1", "metadata_server": ""}, r"tiers\[1\]\.metadata_server = ''"),
        ({"master": "a:1", "peers": ["a:2"]}, r"tiers\[1\]\.peers = .*unknown key"),
    ],
)
def test_errors_name_the_key_and_value(keys, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"tiers": tiers(**keys)})


def test_local_hostname_unset_is_left_to_the_tier_and_a_loopback_one_needs_a_loopback_master():
    pytest.importorskip("mooncake.store")
    assert parse_config({"tiers": tiers(master="10.0.0.5:50051")}).tiers[1].local_hostname == ""
    here = parse_config({"tiers": tiers(master="127.0.0.1:50051", local_hostname="127.0.0.1")}).tiers[1]
    assert here.local_hostname == "127.0.0.1"
    for loopback in ("127.0.0.1", "localhost", "127.0.0.1:17001"):
        with pytest.raises(
            ConfigError,
            match=rf"tiers\[1\]\.local_hostname = '{loopback}': a loopback address, while the master "
            r"\(10\.0\.0\.5:50051\) is not",
        ):
            parse_config({"tiers": tiers(master="10.0.0.5:50051", local_hostname=loopback)})


def test_without_the_package_the_error_names_the_tier_and_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # what an absent package looks like
    with pytest.raises(
        ConfigError, match=r"tiers\[1\]\.kind = 'mooncake': .*pip install 'kvtier\[mooncake\]'"
    ):
        parse_config({"tiers": tiers(master="127.0.0.1:50051")})
    # Nothing else needs it: a configuration without the tier is untouched.
    assert parse_config({"tiers": tiers(master="x")[:1]}).tiers[0].kind == "host"


def test_listen_interface_reaches_the_tier():
    pytest.importorskip("mooncake.store")
    from offload.tier_builder import build_tier

    for value in ("", "lo", "10.0.0.7", "*"):
        tier = parse_config({"tiers": tiers(master="127.0.0.1:50051", listen_interface=value)}).tiers[1]
        assert isinstance(tier, MooncakeSettings) and tier.listen_interface == value
        built = build_tier(tier, b"n" * 16, b"L" * 16, 4096, frozenset())
        assert built.listen_interface == value  # what open() ties the listeners to after setup


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"listen_interface": "0.0.0.0 "},
            r"tiers\[1\]\.listen_interface = '0\.0\.0\.0 ': expected an interface",
        ),
        ({"listen_interface": "eth0/1"}, r"tiers\[1\]\.listen_interface = 'eth0/1'"),
        ({"listen_interface": 0}, r"tiers\[1\]\.listen_interface = 0: expected a string"),
        ({"listen_interface": "lo\0"}, r"tiers\[1\]\.listen_interface = 'lo\\x00': a NUL"),
        ({"local_hostname": ""}, r"tiers\[1\]\.local_hostname = '': expected an IP address or a host name"),
        ({"local_hostname": "a b"}, r"tiers\[1\]\.local_hostname = 'a b'"),
        ({"local_hostname": "host:99999"}, r"tiers\[1\]\.local_hostname = 'host:99999': port"),
        ({"replicas": 2**70}, r"tiers\[1\]\.replicas = \d+: expected a number of copies in \[1, 64\]"),
        ({"local_buffer": "99999999TiB"}, r"tiers\[1\]\.local_buffer = '99999999TiB': .*8 PiB"),
    ],
)
def test_bad_listener_and_address_values_name_their_key(keys, message):
    pytest.importorskip("mooncake.store")
    with pytest.raises(ConfigError, match=message):
        parse_config({"tiers": tiers(master="127.0.0.1:50051", **keys)})
