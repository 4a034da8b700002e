"""What configures each tier: one frozen dataclass per tier kind, taken whole by its constructor.

``offload.config`` is the only reader of configuration: it validates a TOML file (or the
same keys as a dict) into these, naming the key at fault. They live here, not there, because
tiers never import ``offload``: a tier takes its settings as a value and never parses. Field
names are the TOML keys (``capacity`` in bytes is ``capacity_bytes``, ``local_buffer`` is
``local_buffer_bytes``), so there is one vocabulary from the file to the tier; what is not
configuration (a namespace, layout ids, row sizes, test knobs) stays a constructor argument.

No validation here: values reach a tier through ``offload.config``, or from tests and
benchmarks that build them on purpose; a tier still refuses what it cannot run with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from policies.registry import DEFAULT_POLICY, LOWER_TIER_POLICY
from tiers.address import Address

DEFAULT_DEADLINE_S = 2.0


@dataclass(frozen=True, kw_only=True)
class TierSettings:
    """What every tier has: its size (``capacity``) and its eviction policy (``policies/``)."""

    kind: ClassVar[str] = ""
    capacity_bytes: int
    eviction: str = LOWER_TIER_POLICY
    eviction_params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class HostSettings(TierSettings):
    """The host tier (the first): size and eviction (``adaptive`` unless named:
    ``policies.registry.DEFAULT_POLICY``), and the bounds on what the tiers below may hold of
    it, read by ``offload.stack`` (they bound host rows, so they are the host tier's keys):

    - ``max_promoting_rows``: host rows being promoted into at once;
    - ``max_spilling_rows``: host rows being copied down at once;
    - ``slow_tier_pause_s``: how long a lower tier that failed a promotion whole and slowly
      promotes nothing.

    ``None``: ``offload``'s defaults (``offload.manager.PROMOTING_*`` / ``SPILLING_*``, a
    share of the host rows; ``offload.tiering.SLOW_TIER_PAUSE_S``).
    """

    kind: ClassVar[str] = "host"
    eviction: str = DEFAULT_POLICY
    max_promoting_rows: int | None = None
    max_spilling_rows: int | None = None
    slow_tier_pause_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class LowerTierSettings(TierSettings):
    """A tier below the host tier: how rows reach it and come back (``policies.placement``),
    and how long the tier engine waits for it.

    ``placement``: ``"write-back"`` or ``"write-through"``. ``admission``: ``"all"`` or
    ``"seen-twice"``. ``promotion``: a hit here is copied up into the host tier.
    ``deadline_s``: the most a call to the tier may take. ``lookup_wait_s``: how long a
    vLLM request may wait (deferred) for this tier's answer to "do you hold the rest of my
    prefix?"; 0: never wait. Only the network tiers let the TOML set those two: a disk's
    answers are local, and it keeps the defaults.
    """

    placement: str = "write-back"
    admission: str = "all"
    promotion: bool = True
    deadline_s: float = DEFAULT_DEADLINE_S
    lookup_wait_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class DiskSettings(LowerTierSettings):
    """The LMDB disk tier (``tiers.disk``) in directory ``path``; it admits rows seen twice
    by default, so a disk is not worn by rows never read again."""

    kind: ClassVar[str] = "disk"
    path: str
    admission: str = "seen-twice"
    sync: bool = False
    """Flush each batch to the device before its put returns (``DiskTier``'s ``sync``)."""


@dataclass(frozen=True, kw_only=True)
class RemoteSettings(LowerTierSettings):
    """``kvtier peer`` processes reached over NIXL (``tiers.remote``).

    ``token_file``: the shared token (``None``: the peers take any client). ``peer_tenant``:
    the tenant this engine claims at the peers; its token must grant it there (a peer's
    single-token file grants only ``"default"``).
    ``checksum_thread``: hash each part beside the copies (``False``: after each copy).
    """

    kind: ClassVar[str] = "remote"
    peers: tuple[Address, ...]
    token_file: str | None = None
    peer_tenant: str = "default"
    checksum_thread: bool = True


@dataclass(frozen=True, kw_only=True)
class MooncakeSettings(LowerTierSettings):
    """A Mooncake Store cluster (``tiers.mooncake``, whose class docstring says what each
    key does); ``capacity_bytes`` is the segment this process mounts into the store's pool
    (0: a client that only uses others' memory)."""

    kind: ClassVar[str] = "mooncake"
    master: Address
    metadata_server: str = "P2PHANDSHAKE"
    local_buffer_bytes: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = ""  # "": this machine's address on the route to the master
    listen_interface: str = ""  # "": the interface holding local_hostname; "*": every interface
    replicas: int = 1
