"""``kv_connector_extra_config`` as kvtier reads it: vLLM's keys keep their meaning."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from offload.config import ConfigError
from offload.vllm.settings import SpecSettings


def parse(**extra):
    return SpecSettings.from_extra_config({"spec_name": "KVTierOffloadingSpec", **extra}, model="m/x")


def test_vllm_keys_alone_give_a_host_tier():
    settings = parse(cpu_bytes_to_use=1 << 30, eviction_policy="arc")
    (host,) = settings.tiers.tiers
    assert (host.kind, host.capacity_bytes, host.eviction) == ("host", 1 << 30, "arc")
    assert settings.tiers.namespace.model == "m/x"
    assert settings.config_source == "vLLM keys"


def test_a_float_byte_count_is_taken_as_vllm_takes_it():
    assert parse(cpu_bytes_to_use=1e9).tiers.host.capacity_bytes == 10**9


def test_inline_tiers_take_their_host_size_from_cpu_bytes_to_use(tmp_path):
    inline = {
        "namespace": {"model": "shared-id", "tenant": "team-a"},
        "tiers": [{"kind": "host"}, {"kind": "disk", "path": str(tmp_path), "capacity": "1GiB"}],
    }
    settings = parse(cpu_bytes_to_use="2GiB", kvtier_config=inline)
    assert [t.kind for t in settings.tiers.tiers] == ["host", "disk"]
    assert settings.tiers.host.capacity_bytes == 2 << 30
    assert settings.tiers.namespace.model == "shared-id"
    assert inline["tiers"][0] == {"kind": "host"}, "the caller's dict is not modified"


def test_a_toml_path_is_read(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_text('[[tiers]]\nkind = "host"\ncapacity = "64MiB"\neviction = "s3fifo"\n')
    settings = parse(kvtier_config=str(path))
    assert settings.tiers.host.capacity_bytes == 64 << 20
    assert settings.tiers.host.eviction == "s3fifo"
    assert settings.config_source == str(path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, r"cpu_bytes_to_use is missing"),
        (
            {"cpu_bytes_to_use": "1GiB", "kvtier_config": {"tiers": [{"kind": "host", "capacity": "2GiB"}]}},
            r"cpu_bytes_to_use = '1GiB' but kvtier_config tiers\[0\]\.capacity = '2GiB'",
        ),
        (
            {
                "cpu_bytes_to_use": 1 << 30,
                "eviction_policy": "arc",
                "kvtier_config": {"tiers": [{"kind": "host", "eviction": "lru"}]},
            },
            r"eviction_policy = 'arc' but kvtier_config tiers\[0\]\.eviction = 'lru'",
        ),
        ({"cpu_bytes_to_use": 1 << 30, "cache_policy_module_path": "my.mod"}, r"cache_policy_module_path"),
        ({"cpu_bytes_to_use": 1 << 30, "canonical_layout": True}, r"canonical_layout"),
        ({"cpu_bytes_to_use": 1 << 30, "eviction_policy": "nope"}, r"tiers\[0\]\.eviction = 'nope'"),
        ({"kvtier_config": "/nonexistent/tiers.toml", "cpu_bytes_to_use": 1}, r"cannot read it"),
        ({"kvtier_config": 42}, r"kvtier_config = 42"),
        ({"cpu_bytes_to_use": 1 << 30, "shm_dir": ""}, r"shm_dir"),
    ],
)
def test_bad_settings_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse(**extra)


def test_cpu_spec_keys_without_an_equivalent_are_warned_about(caplog):
    parse(cpu_bytes_to_use=1 << 30, store_threshold=2, my_typo=1)
    text = caplog.text
    assert "store_threshold = 2 has no effect" in text
    assert "['my_typo']" in text


def test_a_kvtier_config_file_is_read_by_offload_config(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_bytes(b'[[tiers]]\nkind = "host"\n\xff')
    with pytest.raises(ConfigError, match=r"kvtier_config = .*tiers\.toml': not a TOML file: byte 24"):
        parse(kvtier_config=str(path), cpu_bytes_to_use=1 << 30)
    path.write_text("[[tiers]\n")
    with pytest.raises(ConfigError, match=r"kvtier_config = .*: not valid TOML"):
        parse(kvtier_config=str(path), cpu_bytes_to_use=1 << 30)


def test_an_inline_config_nested_10000_deep_is_a_config_error():
    deep: dict = {}
    inner = deep
    for _ in range(10_000):
        inner["x"] = {}
        inner = inner["x"]
    with pytest.raises(ConfigError, match="kv_connector_extra_config: tables and lists nested"):
        parse(cpu_bytes_to_use=1 << 30, kvtier_config={"tiers": [{"kind": "host", "x": deep}]})
