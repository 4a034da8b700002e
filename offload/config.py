"""The tier configuration: one TOML file (or the same keys as a dict), parsed once at the edge.

.. code-block:: toml

    [namespace]              # optional: what must match for two engines to share rows
    model = "meta-llama/Llama-3.1-8B"
    tenant = "team-a"        # optional salt: tenants never see each other's rows

    [[tiers]]                # in order, fastest first; the first is the host tier
    kind = "host"
    capacity = "8GiB"
    eviction = "adaptive-ghosts"  # the default; or "lru", "arc", ..., or "my_pkg.mod:MyPolicy"
    eviction_params = {}     # keyword arguments of the policy
    max_promoting_rows = 4096  # host rows promoting at once (default: a quarter, at least 256)
    max_spilling_rows = 2048   # host rows being copied down at once (default: an eighth, at least 16)
    slow_tier_pause_s = 10.0   # a tier that failed a promotion whole and slowly promotes nothing

    [[tiers]]
    kind = "disk"
    path = "/var/cache/kvtier"
    capacity = "200GiB"
    eviction = "lru"         # the default below the host tier
    placement = "write-back" # or "write-through"
    admission = "seen-twice" # or "all"
    promotion = true         # copy a row found here up into the host tier on a hit

    [[tiers]]                # a Mooncake Store cluster (pip install 'kvtier[mooncake]')
    kind = "mooncake"
    master = "10.0.0.5:50051"
    capacity = "16GiB"       # the memory this process mounts into the store's pool
    metadata_server = "P2PHANDSHAKE"  # or "http://host:port/metadata", or an etcd address
    protocol = "tcp"         # or "rdma" (with device_name = "mlx5_0")
    local_hostname = "10.0.0.7"       # where other clients reach this one's memory (default:
                                      # this machine's address on the route to the master)
    listen_interface = ""    # its listeners only on the interface of local_hostname ("*": all)

Mooncake Store has no credentials: any client of the cluster reads, overwrites and removes
any object, and reaches the host tier's memory through this client's listeners (``tiers.mooncake``):
keep the cluster on a private network.

Sizes are bytes or a number with a unit (``tiers.sizes``): ``KB``/``MB``/``GB``/``TB`` are
decimal (``8GB`` = 8,000,000,000 B), ``KiB``/``MiB``/``GiB``/``TiB`` binary (``8GiB`` =
8,589,934,592 B); at most 8 PiB. A host tier larger than the machine's memory is refused
where it is allocated (``Offloader``: a ``ConfigError`` naming ``tiers[0].capacity``), not
here: a configuration may be checked on another machine than the one that runs it.

This module is kvtier's only reader of configuration (``offload.vllm.settings`` hands it
what vLLM passes, ``offload.vllm.secondary`` one tier table with ``parse_tier``).
Everything is validated here into frozen dataclasses, one per tier kind (``tiers.settings``:
``HostSettings``, ``DiskSettings``, ``RemoteSettings``, ``MooncakeSettings``, whose fields
are the keys above, ``host:port`` parsed into ``tiers.address.Address``), which each tier's
constructor takes whole; the rest of kvtier never reads a raw dict. Unknown keys are errors
(a typo must not silently fall back to a default), and every error is a ``ConfigError``
naming the key path and the value at fault: a bad size, type or string (an empty path, a
NUL byte), and a file that is not UTF-8 TOML.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies import make_policy
from policies.placement import ADMISSIONS, PLACEMENTS
from policies.registry import DEFAULT_POLICY, LOWER_TIER_POLICY
from tiers import sizes
from tiers.address import Address
from tiers.remote.protocol import valid_tenant
from tiers.settings import (
    DiskSettings,
    HostSettings,
    LowerTierSettings,
    MooncakeSettings,
    RemoteSettings,
    TierSettings,
)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names key and value."""


TIER_KINDS = ("host", "disk", "remote", "mooncake")
MAX_NESTING = 32
"""Tables and lists nested deeper than this are refused: a real configuration nests 4
deep (``tiers``, a tier, ``eviction_params``, a value), and a deeper one would only make
what reads it recurse (``repr`` in an error message, ``deepcopy``) until ``RecursionError``."""
_MAX_VALUES = 100_000  # nor is a configuration this large: it bounds the walk of check_nesting


def check_nesting(data: Any, where: str) -> None:
    """``ConfigError`` if ``data`` nests tables and lists deeper than ``MAX_NESTING`` (or holds
    more than ``_MAX_VALUES`` values); walks level by level, so it never recurses itself."""
    level = [data]
    seen = 0
    for _ in range(MAX_NESTING):
        level = [
            value
            for item in level
            if isinstance(item, Mapping | list | tuple)
            for value in (item.values() if isinstance(item, Mapping) else item)
        ]
        seen += len(level)
        if not level:
            return
        if seen > _MAX_VALUES:
            raise ConfigError(f"{where}: more than {_MAX_VALUES} values; not a kvtier configuration")
    if any(isinstance(item, Mapping | list | tuple) and item for item in level):
        raise ConfigError(f"{where}: tables and lists nested more than {MAX_NESTING} deep")


def parse_size(value: Any, where: str) -> int:
    """Bytes from an int or a string with a unit (``8GiB``, ``512MB``, ``1.5GiB``)."""
    if not isinstance(value, int | str) or isinstance(value, bool):
        raise ConfigError(f"{where} = {value!r}: expected a size such as '8GiB' or a number of bytes")
    try:
        return sizes.parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{where} = {value!r}: {exc}") from exc


@dataclass(frozen=True)
class NamespaceConfig:
    model: str = ""
    tenant: str = ""


@dataclass(frozen=True)
class KVTierConfig:
    tiers: tuple[TierSettings, ...]
    namespace: NamespaceConfig = NamespaceConfig()

    @property
    def host(self) -> HostSettings:
        host = self.tiers[0]
        assert isinstance(host, HostSettings)  # parse_config puts it first
        return host

    @property
    def lower_tiers(self) -> tuple[LowerTierSettings, ...]:
        return tuple(tier for tier in self.tiers[1:] if isinstance(tier, LowerTierSettings))


_COMMON_KEYS = {"kind", "capacity", "eviction", "eviction_params"}
_HOST_KEYS = {"max_promoting_rows", "max_spilling_rows", "slow_tier_pause_s"}
_LOWER_KEYS = {"placement", "admission", "promotion"}
_NETWORK_KEYS = {"deadline_s", "lookup_wait_s"}
_KIND_KEYS = {
    "host": _HOST_KEYS,
    "disk": {"path", "sync"} | _LOWER_KEYS,
    "remote": {"peers", "token_file", "peer_tenant", "checksum_thread"} | _LOWER_KEYS | _NETWORK_KEYS,
    "mooncake": {
        "master",
        "metadata_server",
        "local_buffer",
        "protocol",
        "device_name",
        "local_hostname",
        "listen_interface",
        "replicas",
    }
    | _LOWER_KEYS
    | _NETWORK_KEYS,
}
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
MAX_REPLICAS = 64  # more copies than a cluster has machines is a typo (and overflows the store's int)
MAX_INFLIGHT_ROWS = 1 << 30  # more rows than any host tier holds (8 PiB of 8 MiB rows): a typo
MAX_PAUSE_S = 3600.0  # an hour without promotions from a tier is an outage, not a pause


def load_config(source: str | Path | Mapping[str, Any]) -> KVTierConfig:
    """Parse a TOML file path, or a dict with the same keys (vLLM's ``kv_connector_extra_config``)."""
    if isinstance(source, Mapping):
        return parse_config(source)
    return parse_config(read_toml(Path(source)))


def read_toml(path: Path, key: str | None = None) -> dict[str, Any]:
    """The table of the TOML file at ``path``; ``ConfigError`` naming the file (and ``key``,
    where the path was the value of a key, such as vLLM's ``kvtier_config``)."""
    what = f"{key} = {str(path)!r}" if key else str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        if key:
            raise ConfigError(f"{what}: cannot read it: {exc.strerror}") from exc
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what}: not a TOML file: byte {exc.start} (0x{raw[exc.start]:02x}) is not UTF-8 text"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what}: not valid TOML: {exc}") from exc
    except RecursionError:  # tomllib recurses once per level of arrays and inline tables
        raise ConfigError(
            f"{what}: arrays or inline tables nested too deeply to read (past Python's recursion limit)"
        ) from None


def parse_config(data: Mapping[str, Any]) -> KVTierConfig:
    """The whole configuration: the tiers (the host tier first, each kind once) and the namespace."""
    check_nesting(data, "the configuration")
    if not isinstance(data, Mapping):
        raise ConfigError(f"the configuration = {data!r}: expected a table of 'tiers' and 'namespace'")
    _reject_unknown(data, {"tiers", "namespace"}, "")
    tiers_raw = data.get("tiers")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError(f"tiers = {tiers_raw!r}: expected a non-empty list of tier tables ([[tiers]])")
    tiers = tuple(parse_tier(raw, f"tiers[{i}]") for i, raw in enumerate(tiers_raw))
    if tiers[0].kind != "host":
        raise ConfigError(f"tiers[0].kind = {tiers[0].kind!r}: the first tier must be the host tier")
    for i, tier in enumerate(tiers[1:], start=1):
        if tier.kind == "host":
            raise ConfigError(f"tiers[{i}].kind = 'host': there is exactly one host tier, the first")
    kinds = [tier.kind for tier in tiers]
    for kind in set(kinds):
        if kinds.count(kind) > 1:
            raise ConfigError(f"tiers: kind {kind!r} appears {kinds.count(kind)} times; give each kind once")
    namespace_raw = data.get("namespace", {})
    if not isinstance(namespace_raw, Mapping):
        raise ConfigError(f"namespace = {namespace_raw!r}: expected a table")
    _reject_unknown(namespace_raw, {"model", "tenant"}, "namespace.")
    namespace = NamespaceConfig(
        model=_string(namespace_raw, "model", "namespace.", ""),
        tenant=_string(namespace_raw, "tenant", "namespace.", ""),
    )
    return KVTierConfig(tiers, namespace)


def parse_tier(raw: Any, where: str) -> TierSettings:
    """One ``[[tiers]]`` table on its own (``where``, such as ``tiers[1]``, prefixes every
    error): the settings of its kind. Also what vLLM's secondary tiers are parsed with."""
    check_nesting(raw, where)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} = {raw!r}: expected a table")
    kind = raw.get("kind")
    if kind not in TIER_KINDS:
        raise ConfigError(f"{where}.kind = {kind!r}: expected one of {list(TIER_KINDS)}")
    _reject_unknown(raw, _COMMON_KEYS | _KIND_KEYS[kind], f"{where}.")
    if "capacity" not in raw:
        raise ConfigError(f"{where}.capacity is missing: give a size such as '8GiB'")
    common: dict[str, Any] = {"capacity_bytes": parse_size(raw["capacity"], f"{where}.capacity")}
    default = DEFAULT_POLICY if kind == "host" else LOWER_TIER_POLICY
    common["eviction"] = eviction = _string(raw, "eviction", f"{where}.", default)
    params = raw.get("eviction_params", {})
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.eviction_params = {params!r}: expected a table of policy arguments")
    _check_policy(eviction, dict(params), where)
    common["eviction_params"] = dict(params)
    if kind == "host":
        return HostSettings(**common, **_host_keys(raw, where))
    return _PARSERS[kind](raw, where, common | _lower_keys(raw, where))


def _host_keys(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The bounds on the host rows lower tiers hold, those given only (the defaults are a
    share of the host rows, which are known once the rows' size is: ``offload.manager``)."""
    keys: dict[str, Any] = {}
    for key in ("max_promoting_rows", "max_spilling_rows"):
        if key in raw:
            keys[key] = _count(raw, key, where, 1, maximum=MAX_INFLIGHT_ROWS, what="host rows")
    if "slow_tier_pause_s" in raw:
        keys["slow_tier_pause_s"] = _seconds(
            raw, "slow_tier_pause_s", where, 0.0, maximum=MAX_PAUSE_S, zero=" (0: never pause)"
        )
    return keys


def _lower_keys(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keys of every tier below the host tier (placement, admission, promotion), those
    given only: the defaults are the settings' own (a disk admits rows seen twice)."""
    keys: dict[str, Any] = {}
    for key, choices in (("placement", PLACEMENTS), ("admission", ADMISSIONS)):
        if key in raw:
            keys[key] = _choice(raw, key, f"{where}.", choices, "")
    if "promotion" in raw:
        keys["promotion"] = raw["promotion"]
        if not isinstance(keys["promotion"], bool):
            raise ConfigError(f"{where}.promotion = {raw['promotion']!r}: expected true or false")
    return keys


def _parse_disk(raw: Mapping[str, Any], where: str, common: dict[str, Any]) -> DiskSettings:
    path = raw.get("path")
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConfigError(f"{where}.path = {path!r}: the disk tier needs a directory path")
    sync = raw.get("sync", False)
    if not isinstance(sync, bool):
        raise ConfigError(f"{where}.sync = {sync!r}: expected true or false")
    return DiskSettings(**common, path=path, sync=sync)


def _parse_remote(raw: Mapping[str, Any], where: str, common: dict[str, Any]) -> RemoteSettings:
    peers = raw.get("peers")
    if not isinstance(peers, list) or not peers or not all(isinstance(p, str) for p in peers):
        raise ConfigError(f"{where}.peers = {peers!r}: expected a non-empty list of 'host:port' strings")
    addresses = tuple(_address(peer, f"{where}.peers: {peer!r} is not 'host:port'") for peer in peers)
    deadline = _seconds(raw, "deadline_s", where, 2.0, maximum=2.0)
    token_file = raw.get("token_file")
    if token_file is not None and (not isinstance(token_file, str) or not token_file or "\0" in token_file):
        raise ConfigError(f"{where}.token_file = {token_file!r}: expected a path")
    peer_tenant = raw.get("peer_tenant", "default")
    if not isinstance(peer_tenant, str) or not valid_tenant(peer_tenant):
        raise ConfigError(
            f"{where}.peer_tenant = {peer_tenant!r}: expected 1..64 of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    checksum_thread = raw.get("checksum_thread", True)
    if not isinstance(checksum_thread, bool):
        raise ConfigError(f"{where}.checksum_thread = {checksum_thread!r}: expected true or false")
    return RemoteSettings(
        **common,
        peers=addresses,
        deadline_s=deadline,
        token_file=token_file,
        peer_tenant=peer_tenant,
        checksum_thread=checksum_thread,
        lookup_wait_s=_lookup_wait(raw, where),
    )


def _parse_mooncake(raw: Mapping[str, Any], where: str, common: dict[str, Any]) -> MooncakeSettings:
    """The Mooncake keys; also checks that the Mooncake client imports (else: how to install it)."""
    from tiers.base import TierError
    from tiers.mooncake import MIN_SEGMENT_BYTES, store_class
    from tiers.mooncake import hostname as mooncake_hostname
    from tiers.mooncake import listen as mooncake_listen

    prefix = f"{where}."
    master = raw.get("master")
    address = _address(master, f"{where}.master = {master!r}: expected the master's 'host:port'")
    if common["capacity_bytes"] < MIN_SEGMENT_BYTES:
        raise ConfigError(
            f"{where}.capacity = {common['capacity_bytes']!r}: the segment mounted into Mooncake Store "
            "must be at least 16MiB"
        )
    replicas = _count(raw, "replicas", where, 1, maximum=MAX_REPLICAS, what="copies")
    deadline = _seconds(raw, "deadline_s", where, 2.0, maximum=30.0)
    local_hostname = ""  # unset: the tier takes this machine's address on the route to the master
    if "local_hostname" in raw:
        local_hostname = _string(raw, "local_hostname", prefix, "")
        problem = mooncake_listen.check_hostname(local_hostname) or mooncake_hostname.loopback_problem(
            local_hostname, address
        )
        if problem:
            raise ConfigError(f"{where}.local_hostname = {local_hostname!r}: {problem}")
    listen_interface = _string(raw, "listen_interface", prefix, "")
    problem = mooncake_listen.check_listen_interface(listen_interface)
    if problem:
        raise ConfigError(f"{where}.listen_interface = {listen_interface!r}: {problem}")
    metadata = _string(raw, "metadata_server", prefix, "P2PHANDSHAKE")
    if not metadata:
        raise ConfigError(f"{where}.metadata_server = '': expected 'P2PHANDSHAKE' or the server's URL")
    settings = MooncakeSettings(
        **common,
        master=address,
        metadata_server=metadata,
        local_buffer_bytes=parse_size(raw.get("local_buffer", "16MiB"), f"{where}.local_buffer"),
        protocol=_choice(raw, "protocol", prefix, MOONCAKE_PROTOCOLS, "tcp"),
        device_name=_string(raw, "device_name", prefix, ""),
        local_hostname=local_hostname,
        listen_interface=listen_interface,
        replicas=replicas,
        deadline_s=deadline,
        lookup_wait_s=_lookup_wait(raw, where),
    )
    try:
        store_class()
    except TierError as exc:
        raise ConfigError(f"{where}.kind = 'mooncake': {exc}") from exc
    return settings


_PARSERS: dict[str, Callable[[Mapping[str, Any], str, dict[str, Any]], LowerTierSettings]] = {
    "disk": _parse_disk,
    "remote": _parse_remote,
    "mooncake": _parse_mooncake,
}


def _address(value: Any, message: str) -> Address:
    try:
        return Address.parse(value)
    except ValueError:
        raise ConfigError(message) from None


def _seconds(
    raw: Mapping[str, Any], key: str, where: str, default: float, *, maximum: float, zero: str | None = None
) -> float:
    """Seconds in (0, ``maximum``] (a deadline), or in [0, ``maximum``] where ``zero`` is
    given: what 0 means, said in the error (``""``: nothing to say)."""
    value = raw.get(key, default)
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not (0 < value <= maximum if zero is None else 0 <= value <= maximum):
        interval = f"(0, {maximum:g}]" if zero is None else f"[0, {maximum:g}]{zero}"
        raise ConfigError(f"{where}.{key} = {value!r}: expected seconds in {interval}")
    return float(value)


def _count(raw: Mapping[str, Any], key: str, where: str, default: int, *, maximum: int, what: str) -> int:
    """A whole number of ``what`` in [1, ``maximum``] (a bool is not one)."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigError(f"{where}.{key} = {value!r}: expected a number of {what} in [1, {maximum}]")
    return value


def _lookup_wait(raw: Mapping[str, Any], where: str) -> float:
    return _seconds(raw, "lookup_wait_s", where, 0.0, maximum=10, zero="")


def _check_policy(name: str, params: dict[str, Any], where: str) -> None:
    """Build the policy once to surface an unknown name or a bad parameter now, not at first store."""
    try:
        make_policy(name, 1024, **params)
    except ValueError as exc:
        raise ConfigError(f"{where}.eviction = {name!r}: {exc}") from exc


def _reject_unknown(raw: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]} = {raw[unknown[0]]!r}: unknown key (allowed: {sorted(allowed)})"
        )


def _string(raw: Mapping[str, Any], key: str, prefix: str, default: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"{prefix}{key} = {value!r}: expected a string")
    if "\0" in value:  # C code would read a shorter string than the one configured
        raise ConfigError(f"{prefix}{key} = {value!r}: a NUL character is not allowed")
    return value


def _choice(raw: Mapping[str, Any], key: str, prefix: str, choices: tuple[str, ...], default: str) -> str:
    value = raw.get(key, default)
    if value not in choices:
        raise ConfigError(f"{prefix}{key} = {value!r}: expected one of {list(choices)}")
    return value


def default_config(host_capacity: str | int = "1GiB") -> KVTierConfig:
    """A host tier only, with the default policy: what ``Offloader`` uses without a config."""
    return parse_config({"tiers": [{"kind": "host", "capacity": host_capacity}]})
