"""The remote tier: rows in the memory of ``kvtier peer`` processes, moved by NIXL.

``from tiers.remote import RemoteTier`` is the public path. The tier (``tier``) composes
``membership`` (which peers are up; backoff), ``routing`` (rendezvous owner of a key) and
``data_plane`` (parts, checksums, NIXL transfers), which speak the wire protocol
(``protocol``) through the control-plane client (``client``) and drive the NIXL agent's
thread (``nixl_agent``) after peer-metadata checks (``nixl_metadata``); ``stats`` holds
their counters. The peer server is ``server`` (``python -m tiers.remote.server``,
``kvtier peer``) with its pool (``pool``), tokens (``auth``) and interface binding
(``net_iface``); its rows move in one worker process per tenant (``served_memory``,
``tenant_worker``, over ``worker_link``), bound to the client's process (``socket_owner``).

The tier is imported lazily (module ``__getattr__``): NIXL is an import of ``tier``, and
``offload/config.py`` reads ``protocol`` (tenant names) where NIXL need not be present.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiers.remote.tier import RemoteTier, rendezvous_owner

__all__ = ["RemoteTier", "rendezvous_owner"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tiers.remote import tier

        return getattr(tier, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
