import re

import pytest

from offload.config import ConfigError, load_config, parse_config, parse_size, parse_tier

GOOD = """
[namespace]
model = "meta-llama/Llama-3.1-8B"
tenant = "team-a"

[[tiers]]
kind = "host"
capacity = "8GiB"
eviction = "lru"

[[tiers]]
kind = "disk"
path = "/var/cache/kvtier"
capacity = "200GB"
placement = "write-through"

[[tiers]]
kind = "remote"
peers = ["127.0.0.1:7070", "127.0.0.1:7071"]
capacity = "64GiB"
deadline_s = 1.5
lookup_wait_s = 0.25
checksum_thread = false
"""


def test_full_file_parses(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_text(GOOD)
    config = load_config(path)
    assert [t.kind for t in config.tiers] == ["host", "disk", "remote"]
    assert config.host.capacity_bytes == 8 * 2**30
    disk = config.tiers[1]
    assert (disk.capacity_bytes, disk.placement, disk.admission, disk.path) == (
        200 * 10**9,
        "write-through",
        "seen-twice",
        "/var/cache/kvtier",
    )
    remote = config.tiers[2]
    assert tuple(map(str, remote.peers)) == ("127.0.0.1:7070", "127.0.0.1:7071")
    assert remote.deadline_s == 1.5
    assert (remote.lookup_wait_s, disk.lookup_wait_s) == (0.25, 0.0)
    assert remote.checksum_thread is False
    assert config.namespace.tenant == "team-a"


def test_dict_form_is_the_same_as_the_file():
    config = load_config(
        {"tiers": [{"kind": "host", "capacity": 1024}, {"kind": "disk", "path": "/tmp/x", "capacity": 1024}]}
    )
    assert config.host.capacity_bytes == 1024
    assert (config.host.eviction, config.tiers[1].eviction) == ("adaptive-ghosts", "lru")  # the defaults


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("8GiB", 8 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2kb", 2000),
        ("10", 10),
    ],
)
def test_sizes(value, expected):
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ([{"kind": "host", "capacity": "8XB"}], r"tiers\[0\]\.capacity = '8XB': unknown unit 'XB'"),
        ([{"kind": "host", "capacity": "-1GiB"}], r"tiers\[0\]\.capacity = '-1GiB'"),
        ([{"kind": "host", "capacity": 0}], r"tiers\[0\]\.capacity = 0: a size must be positive"),
        ([{"kind": "host", "capacity": True}], r"tiers\[0\]\.capacity = True"),
        ([{"kind": "host"}], r"tiers\[0\]\.capacity is missing"),
        ([{"kind": "host", "capacity": "1GiB", "capcity": 3}], r"tiers\[0\]\.capcity = 3: unknown key"),
        ([{"kind": "ssd", "capacity": "1GiB"}], r"tiers\[0\]\.kind = 'ssd': expected one of"),
        (
            [{"kind": "host", "capacity": "1GiB", "eviction": "fifo9"}],
            r"tiers\[0\]\.eviction = 'fifo9': unknown",
        ),
        (
            [{"kind": "host", "capacity": "1GiB", "eviction_params": {"nope": 1}}],
            r"tiers\[0\]\.eviction = 'adaptive-ghosts': .*bad parameters",
        ),
        (
            [{"kind": "disk", "capacity": "1GiB", "path": "/x"}],
            r"tiers\[0\]\.kind = 'disk': the first tier must be",
        ),
        (
            [{"kind": "host", "capacity": "1GiB"}, {"kind": "host", "capacity": "1GiB"}],
            r"tiers\[1\]\.kind = 'host': there is exactly one host tier",
        ),
        (
            [{"kind": "host", "capacity": "1GiB"}, {"kind": "disk", "capacity": "1GiB"}],
            r"tiers\[1\]\.path = None: the disk tier needs a directory path",
        ),
        (
            [
                {"kind": "host", "capacity": "1GiB"},
                {"kind": "disk", "capacity": "1GiB", "path": "/x", "placement": "x"},
            ],
            r"tiers\[1\]\.placement = 'x': expected one of",
        ),
        (
            [
                {"kind": "host", "capacity": "1GiB"},
                {"kind": "remote", "capacity": "1GiB", "peers": ["nohost"]},
            ],
            r"tiers\[1\]\.peers: 'nohost' is not 'host:port'",
        ),
        (
            [
                {"kind": "host", "capacity": "1GiB"},
                {"kind": "remote", "capacity": "1", "peers": ["a:1"], "deadline_s": 9},
            ],
            r"tiers\[1\]\.deadline_s = 9",
        ),
        (
            [
                {"kind": "host", "capacity": "1GiB"},
                {"kind": "remote", "capacity": "1", "peers": ["a:1"], "checksum_thread": "yes"},
            ],
            r"tiers\[1\]\.checksum_thread = 'yes': expected true or false",
        ),
        *(
            (
                [
                    {"kind": "host", "capacity": "1GiB"},
                    {"kind": "remote", "capacity": "1", "peers": ["a:1"], "lookup_wait_s": wait},
                ],
                rf"tiers\[1\]\.lookup_wait_s = {wait!r}: expected seconds in \[0, 10\]",
            )
            for wait in (-1, 11, "1s", True)
        ),
        (
            [
                {"kind": "host", "capacity": "1GiB"},
                {"kind": "disk", "capacity": "1GiB", "path": "/x", "lookup_wait_s": 1},
            ],
            r"tiers\[1\]\.lookup_wait_s .*unknown key",
        ),
        (
            [{"kind": "host", "capacity": "1GiB", "placement": "write-back"}],
            r"tiers\[0\]\.placement .*unknown key",
        ),
        ([], r"tiers = \[\]: expected a non-empty list"),
    ],
)
def test_errors_name_the_key_and_value(tiers, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"tiers": tiers})


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"teirs = .*unknown key"):
        parse_config({"teirs": []})


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[tiers]\nkind = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_user_policy_by_module_path():
    config = parse_config(
        {"tiers": [{"kind": "host", "capacity": "1GiB", "eviction": "policies.lru:LRUPolicy"}]}
    )
    assert config.host.eviction == "policies.lru:LRUPolicy"
    with pytest.raises(ConfigError, match="cannot import"):
        parse_config({"tiers": [{"kind": "host", "capacity": "1GiB", "eviction": "no_such_mod:Policy"}]})


def test_a_built_in_policy_and_its_parameters_by_name():
    tier = {"kind": "host", "capacity": "1GiB", "eviction": "prefix:tinylfu-adaptive"}
    config = parse_config({"tiers": [{**tier, "eviction_params": {"climb_sample": 2}}]})
    assert config.host.eviction == "prefix:tinylfu-adaptive"
    with pytest.raises(ConfigError, match="climb_sample"):
        parse_config({"tiers": [{**tier, "eviction_params": {"climb_sample": -1}}]})


def test_remote_peer_tenant_is_checked_and_defaults_to_default():
    base = {"tiers": [{"kind": "host", "capacity": 1}, {"kind": "remote", "capacity": 1, "peers": ["h:1"]}]}
    assert parse_config(base).tiers[1].peer_tenant == "default"
    base["tiers"][1]["peer_tenant"] = "team-a"
    assert parse_config(base).tiers[1].peer_tenant == "team-a"
    for bad in ("", "a/b", "x" * 65, 7):
        base["tiers"][1]["peer_tenant"] = bad
        with pytest.raises(ConfigError, match="peer_tenant"):
            parse_config(base)


def test_decimal_and_binary_units_are_what_their_names_say():
    assert parse_size("8GB", "x") == 8_000_000_000
    assert parse_size("8GiB", "x") == 8_589_934_592
    assert parse_size("8gib", "x") == parse_size("8GiB", "x")


@pytest.mark.parametrize(
    ("capacity", "message"),
    [
        ("99999999TiB", r"larger than 8 PiB"),
        (2**70, r"larger than 8 PiB"),
        ("9" * 400 + "B", r"larger than 8 PiB"),  # a float would be inf, int(inf) an OverflowError
        (1.5, r"expected a size"),
        (["8GiB"], r"expected a size"),
        ({"size": 1}, r"expected a size"),
        ("8 GiB GiB", r"not a size"),
    ],
)
def test_a_size_no_tier_can_have_or_of_the_wrong_type_names_its_key(capacity, message):
    tiers = [{"kind": "host", "capacity": "1MiB"}, {"kind": "disk", "path": "/x", "capacity": capacity}]
    with pytest.raises(ConfigError, match=rf"tiers\[1\]\.capacity = .*{message}"):
        parse_config({"tiers": tiers})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([{"kind": "host", "capacity": "1MiB"}], r"the configuration = .*expected a table"),
        ({"tiers": {"kind": "host", "capacity": "1MiB"}}, r"tiers = .*expected a non-empty list"),
        ({"tiers": [1]}, r"tiers\[0\] = 1: expected a table"),
        ({"tiers": ["host"]}, r"tiers\[0\] = 'host': expected a table"),
        ({"tiers": [{"kind": ["host"], "capacity": 1}]}, r"tiers\[0\]\.kind = \['host'\]"),
        ({"tiers": [{"kind": "host", "capacity": "1MiB", "eviction": 5}]}, r"tiers\[0\]\.eviction = 5"),
        ({"tiers": [{"kind": "host", "capacity": "1MiB"}], "namespace": "m"}, r"namespace = 'm'"),
        ({"tiers": [{"kind": "host", "capacity": "1MiB"}], "namespace": {"model": 7}}, r"namespace\.model"),
        (
            {"tiers": [{"kind": "host", "capacity": "1MiB"}], "namespace": {"tenant": "a\0b"}},
            r"namespace\.tenant = 'a\\x00b': a NUL character",
        ),
        (
            {"tiers": [{"kind": "host", "capacity": "1MiB"}, {"kind": "disk", "capacity": 1, "path": ""}]},
            r"tiers\[1\]\.path = '': the disk tier needs a directory path",
        ),
        (
            {
                "tiers": [
                    {"kind": "host", "capacity": "1MiB"},
                    {"kind": "disk", "capacity": 1, "path": "/a\0"},
                ]
            },
            r"tiers\[1\]\.path = '/a\\x00'",
        ),
        (
            {"tiers": [{"kind": "host", "capacity": "1MiB"}, {"kind": "disk", "capacity": 1, "path": 5}]},
            r"tiers\[1\]\.path = 5",
        ),
    ],
)
def test_tables_of_the_wrong_shape_or_type_name_their_key(config, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


def test_a_binary_file_is_a_config_error_naming_the_file_and_byte(tmp_path):
    binary = tmp_path / "tiers.toml"
    binary.write_bytes(b'[[tiers]]\nkind = "host"\n\xff\xfe\x00\x81garbage')
    with pytest.raises(ConfigError, match=r"tiers\.toml: not a TOML file: byte 24 \(0xff\) is not UTF-8"):
        load_config(binary)
    binary.write_bytes(bytes(range(256)) * 4)  # what `cp /bin/ls tiers.toml` gives, in short
    with pytest.raises(ConfigError, match=r"tiers\.toml: not a TOML file"):
        load_config(binary)
    binary.write_bytes(b'[[tiers]]\nkind = "host\x00"\n')  # UTF-8, but a NUL in TOML
    with pytest.raises(ConfigError, match=r"tiers\.toml: not valid TOML"):
        load_config(binary)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory


def test_one_tier_table_parses_on_its_own_into_its_kinds_settings():
    from offload.config import parse_tier
    from tiers.settings import DiskSettings

    disk = parse_tier({"kind": "disk", "path": "/x", "capacity": "1GiB"}, "tiers[1]")
    assert disk == DiskSettings(capacity_bytes=1 << 30, path="/x", admission="seen-twice")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.placement = 'x': expected one of"):
        parse_tier({"kind": "disk", "path": "/x", "capacity": 1, "placement": "x"}, "tiers[1]")


def nested(depth: int) -> dict:
    table: dict = {}
    inner = table
    for _ in range(depth):
        inner["x"] = {}
        inner = inner["x"]
    return table


@pytest.mark.parametrize(
    "text",
    [
        "[[tiers]]\nkind = 'host'\ncapacity = '1GiB'\nx = " + "[" * 10_000 + "]" * 10_000,
        "[[tiers]]\nkind = 'host'\ncapacity = '1GiB'\nx = " + "{a = " * 10_000 + "1" + "}" * 10_000,
        "[" + ".".join(["a"] * 10_000) + "]\n",  # dotted keys: tomllib nests them without recursing
    ],
    ids=["arrays", "inline-tables", "table-header"],
)
def test_a_toml_nested_10000_deep_is_a_config_error_not_a_recursion_error(tmp_path, text):
    path = tmp_path / "deep.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="nested"):
        load_config(path)


def test_a_table_nested_deeper_than_any_configuration_is_a_config_error():
    with pytest.raises(ConfigError, match="nested more than 32 deep"):
        load_config({"tiers": [{"kind": "host", "capacity": "1GiB", "eviction_params": nested(10_000)}]})
    with pytest.raises(ConfigError, match=r"tiers\[1\]: tables and lists nested"):
        parse_tier({"kind": "disk", "x": nested(40)}, "tiers[1]")  # vLLM's secondary tiers' way in


def test_a_disk_tiers_sync_is_a_bool_and_reaches_the_tier(tmp_path):
    from offload.tier_builder import build_tier

    disk = {"kind": "disk", "path": str(tmp_path), "capacity": "1MiB"}
    base = {"tiers": [{"kind": "host", "capacity": "1MiB"}, disk]}
    assert parse_config(base).tiers[1].sync is False
    base["tiers"][1]["sync"] = True
    disk = parse_config(base).tiers[1]
    assert disk.sync is True
    assert build_tier(disk, b"n" * 16, b"l" * 16, 4096).sync is True
    base["tiers"][1]["sync"] = "yes"
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.sync = 'yes'"):
        parse_config(base)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        *(
            ("max_promoting_rows", v, r"expected a number of host rows in \[1, 1073741824\]")
            for v in (0, -3, 1.5)
        ),
        ("max_promoting_rows", True, "expected a number of host rows"),
        ("max_spilling_rows", "16", "expected a number of host rows"),
        ("max_spilling_rows", 1 << 31, "expected a number of host rows"),
        *(("slow_tier_pause_s", v, r"expected seconds in \[0, 3600\]") for v in (-1, 3601, "10s", False)),
    ],
)
def test_the_host_tiers_in_flight_bounds_are_range_checked_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=rf"tiers\[0\]\.{key} = {re.escape(repr(value))}: {message}"):
        parse_config({"tiers": [{"kind": "host", "capacity": "1GiB", key: value}]})


def test_the_in_flight_bounds_are_host_keys_and_default_to_none():
    host = parse_config({"tiers": [{"kind": "host", "capacity": "1GiB"}]}).host
    assert (host.max_promoting_rows, host.max_spilling_rows, host.slow_tier_pause_s) == (None, None, None)
    bounds = {"max_promoting_rows": 300, "max_spilling_rows": 20, "slow_tier_pause_s": 0}
    host = parse_config({"tiers": [{"kind": "host", "capacity": "1GiB", **bounds}]}).host
    assert (host.max_promoting_rows, host.max_spilling_rows, host.slow_tier_pause_s) == (300, 20, 0.0)
    disk = {"kind": "disk", "capacity": "1GiB", "path": "/x", "max_spilling_rows": 20}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.max_spilling_rows = 20: unknown key"):
        parse_config({"tiers": [{"kind": "host", "capacity": "1GiB"}, disk]})
