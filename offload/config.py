"""The tier configuration: one TOML file (or the same keys as a dict), parsed once at the edge.

.. code-block:: toml

    [namespace]              # optional: what must match for two engines to share rows
    model = "meta-llama/Llama-3.1-8B"
    tenant = "team-a"        # optional salt: tenants never see each other's rows

    [[tiers]]                # in order, fastest first; the first is the host tier
    kind = "host"
    capacity = "8GiB"
    eviction = "lru"         # or "arc", "s3fifo", ..., or "my_pkg.mod:MyPolicy"
    eviction_params = {}     # keyword arguments of the policy

    [[tiers]]
    kind = "disk"
    path = "/var/cache/kvtier"
    capacity = "200GiB"
    eviction = "lru"
    placement = "write-back" # or "write-through"
    admission = "seen-twice" # or "all"
    promotion = true         # copy a row found here up into the host tier on a hit

    [[tiers]]                # a Mooncake Store cluster (pip install 'kvtier[mooncake]')
    kind = "mooncake"
    master = "10.0.0.5:50051"
    capacity = "16GiB"       # the memory this process mounts into the store's pool
    metadata_server = "P2PHANDSHAKE"  # or "http://host:port/metadata", or an etcd address
    protocol = "tcp"         # or "rdma" (with device_name = "mlx5_0")
    local_hostname = "10.0.0.7"       # where other clients reach this one's memory
    listen_interface = ""    # its listeners only on the interface of local_hostname ("*": all)

Mooncake Store has no credentials: any client of the cluster reads, overwrites and removes
any object, and reaches the host tier's memory through this client's listeners (``tiers.mooncake``):
keep the cluster on a private network.

Sizes are bytes or a number with a unit (``tiers.sizes``): ``KB``/``MB``/``GB``/``TB`` are
decimal (``8GB`` = 8,000,000,000 B), ``KiB``/``MiB``/``GiB``/``TiB`` binary (``8GiB`` =
8,589,934,592 B); at most 8 PiB. A host tier larger than the machine's memory is refused
where it is allocated (``Offloader``: a ``ConfigError`` naming ``tiers[0].capacity``), not
here: a configuration may be checked on another machine than the one that runs it.

Everything is validated here into frozen dataclasses; the rest of kvtier never reads a
raw dict. Unknown keys are errors (a typo must not silently fall back to a default), and
every error is a ``ConfigError`` naming the key path and the value at fault: a bad size,
type or string (an empty path, a NUL byte), and a file that is not UTF-8 TOML.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from policies import make_policy
from policies.placement import ADMISSIONS
from tiers import sizes
from tiers.remote.protocol import valid_tenant


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names key and value."""


TIER_KINDS = ("host", "disk", "remote", "mooncake")
PLACEMENTS = ("write-back", "write-through")


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
class MooncakeConfig:
    """The keys of a ``kind = "mooncake"`` tier beside the common ones (``capacity`` is the
    segment this process mounts into the store's pool)."""

    master: str
    metadata_server: str = "P2PHANDSHAKE"
    local_buffer_bytes: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    listen_interface: str = ""  # "": the interface holding local_hostname; "*": every interface
    replicas: int = 1


@dataclass(frozen=True)
class TierConfig:
    kind: str
    capacity_bytes: int
    eviction: str = "lru"
    eviction_params: Mapping[str, Any] = field(default_factory=dict)
    placement: str = "write-back"
    admission: str = "all"
    promotion: bool = True
    path: str | None = None  # disk
    peers: tuple[str, ...] = ()  # remote
    token_file: str | None = None  # remote
    # remote: the tenant this engine claims at the peers; its token must grant it there
    # (a peer's single-token file grants only "default")
    peer_tenant: str = "default"
    checksum_thread: bool = True  # remote: hash each part beside the copies (False: after each copy)
    deadline_s: float = 2.0  # remote, mooncake
    # remote, mooncake: how long a vLLM request may wait (deferred, as vLLM's RETRY) for this
    # tier's answer to "do you hold the rest of my prefix?"; 0: never wait, the answer serves
    # later requests
    lookup_wait_s: float = 0.0
    mooncake: MooncakeConfig | None = None


@dataclass(frozen=True)
class KVTierConfig:
    tiers: tuple[TierConfig, ...]
    namespace: NamespaceConfig = NamespaceConfig()

    @property
    def host(self) -> TierConfig:
        return self.tiers[0]

    @property
    def lower_tiers(self) -> tuple[TierConfig, ...]:
        return self.tiers[1:]


_COMMON_KEYS = {"kind", "capacity", "eviction", "eviction_params"}
_KIND_KEYS = {
    "host": set(),
    "disk": {"path", "placement", "admission", "promotion"},
    "remote": {
        "peers",
        "token_file",
        "peer_tenant",
        "deadline_s",
        "lookup_wait_s",
        "checksum_thread",
        "placement",
        "admission",
        "promotion",
    },
    "mooncake": {
        "master",
        "metadata_server",
        "local_buffer",
        "protocol",
        "device_name",
        "local_hostname",
        "listen_interface",
        "replicas",
        "deadline_s",
        "lookup_wait_s",
        "placement",
        "admission",
        "promotion",
    },
}
_KIND_DEFAULT_ADMISSION = {"host": "all", "disk": "seen-twice", "remote": "all", "mooncake": "all"}
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
MAX_REPLICAS = 64  # more copies than a cluster has machines is a typo (and overflows the store's int)


def load_config(source: str | Path | Mapping[str, Any]) -> KVTierConfig:
    """Parse a TOML file path, or a dict with the same keys (vLLM's ``kv_connector_extra_config``)."""
    if isinstance(source, Mapping):
        return parse_config(source)
    path = Path(source)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a TOML file: byte {exc.start} (0x{raw[exc.start]:02x}) is not UTF-8 text"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(data)


def parse_config(data: Mapping[str, Any]) -> KVTierConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(f"the configuration = {data!r}: expected a table of 'tiers' and 'namespace'")
    _reject_unknown(data, {"tiers", "namespace"}, "")
    tiers_raw = data.get("tiers")
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError(f"tiers = {tiers_raw!r}: expected a non-empty list of tier tables ([[tiers]])")
    tiers = tuple(_parse_tier(raw, f"tiers[{i}]") for i, raw in enumerate(tiers_raw))
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


def _parse_tier(raw: Any, where: str) -> TierConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} = {raw!r}: expected a table")
    kind = raw.get("kind")
    if kind not in TIER_KINDS:
        raise ConfigError(f"{where}.kind = {kind!r}: expected one of {list(TIER_KINDS)}")
    _reject_unknown(raw, _COMMON_KEYS | _KIND_KEYS[kind], f"{where}.")
    prefix = f"{where}."
    if "capacity" not in raw:
        raise ConfigError(f"{where}.capacity is missing: give a size such as '8GiB'")
    capacity = parse_size(raw["capacity"], f"{where}.capacity")
    eviction = _string(raw, "eviction", prefix, "lru")
    params = raw.get("eviction_params", {})
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.eviction_params = {params!r}: expected a table of policy arguments")
    _check_policy(eviction, dict(params), where)
    placement = _choice(raw, "placement", prefix, PLACEMENTS, "write-back")
    admission = _choice(raw, "admission", prefix, ADMISSIONS, _KIND_DEFAULT_ADMISSION[kind])
    promotion = raw.get("promotion", True)
    if not isinstance(promotion, bool):
        raise ConfigError(f"{where}.promotion = {promotion!r}: expected true or false")
    tier = TierConfig(
        kind=kind,
        capacity_bytes=capacity,
        eviction=eviction,
        eviction_params=dict(params),
        placement=placement,
        admission=admission,
        promotion=promotion,
    )
    if kind == "disk":
        path = raw.get("path")
        if not isinstance(path, str) or not path or "\0" in path:
            raise ConfigError(f"{where}.path = {path!r}: the disk tier needs a directory path")
        tier = replace(tier, path=path)
    if kind == "remote":
        peers = raw.get("peers")
        if not isinstance(peers, list) or not peers or not all(isinstance(p, str) for p in peers):
            raise ConfigError(f"{where}.peers = {peers!r}: expected a non-empty list of 'host:port' strings")
        for peer in peers:
            host, sep, port = peer.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"{where}.peers: {peer!r} is not 'host:port'")
        deadline = raw.get("deadline_s", 2.0)
        if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not 0 < deadline <= 2.0:
            raise ConfigError(f"{where}.deadline_s = {deadline!r}: expected seconds in (0, 2]")
        token_file = raw.get("token_file")
        if token_file is not None and (
            not isinstance(token_file, str) or not token_file or "\0" in token_file
        ):
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
        tier = replace(
            tier,
            peers=tuple(peers),
            deadline_s=float(deadline),
            token_file=token_file,
            peer_tenant=peer_tenant,
            checksum_thread=checksum_thread,
        )
    if kind == "mooncake":
        tier = _parse_mooncake(raw, tier, where)
    if kind in ("remote", "mooncake"):
        wait = raw.get("lookup_wait_s", 0.0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 10:
            raise ConfigError(f"{where}.lookup_wait_s = {wait!r}: expected seconds in [0, 10]")
        tier = replace(tier, lookup_wait_s=float(wait))
    return tier


def _parse_mooncake(raw: Mapping[str, Any], tier: TierConfig, where: str) -> TierConfig:
    """The Mooncake keys; also checks that the Mooncake client imports (else: how to install it)."""
    from tiers.base import TierError
    from tiers.mooncake import MIN_SEGMENT_BYTES, store_class
    from tiers.mooncake import listen as mooncake_listen

    prefix = f"{where}."
    master = raw.get("master")
    host, sep, port = master.rpartition(":") if isinstance(master, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{where}.master = {master!r}: expected the master's 'host:port'")
    if tier.capacity_bytes < MIN_SEGMENT_BYTES:
        raise ConfigError(
            f"{where}.capacity = {tier.capacity_bytes!r}: the segment mounted into Mooncake Store "
            "must be at least 16MiB"
        )
    replicas = raw.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(
            f"{where}.replicas = {replicas!r}: expected a number of copies in [1, {MAX_REPLICAS}]"
        )
    deadline = raw.get("deadline_s", 2.0)
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not 0 < deadline <= 30:
        raise ConfigError(f"{where}.deadline_s = {deadline!r}: expected seconds in (0, 30]")
    local_hostname = _string(raw, "local_hostname", prefix, "127.0.0.1")
    problem = mooncake_listen.check_hostname(local_hostname)
    if problem:
        raise ConfigError(f"{where}.local_hostname = {local_hostname!r}: {problem}")
    listen_interface = _string(raw, "listen_interface", prefix, "")
    problem = mooncake_listen.check_listen_interface(listen_interface)
    if problem:
        raise ConfigError(f"{where}.listen_interface = {listen_interface!r}: {problem}")
    metadata = _string(raw, "metadata_server", prefix, "P2PHANDSHAKE")
    if not metadata:
        raise ConfigError(f"{where}.metadata_server = '': expected 'P2PHANDSHAKE' or the server's URL")
    settings = MooncakeConfig(
        master=master,  # type: ignore[arg-type]
        metadata_server=metadata,
        local_buffer_bytes=parse_size(raw.get("local_buffer", "16MiB"), f"{where}.local_buffer"),
        protocol=_choice(raw, "protocol", prefix, MOONCAKE_PROTOCOLS, "tcp"),
        device_name=_string(raw, "device_name", prefix, ""),
        local_hostname=local_hostname,
        listen_interface=listen_interface,
        replicas=replicas,
    )
    try:
        store_class()
    except TierError as exc:
        raise ConfigError(f"{where}.kind = 'mooncake': {exc}") from exc
    return replace(tier, mooncake=settings, deadline_s=float(deadline))


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
    """A host tier only, LRU: what ``Offloader`` uses without a config."""
    return parse_config({"tiers": [{"kind": "host", "capacity": host_capacity}]})
