"""Where kvtier's tiers sit in vLLM's terms, and which of them a request may load from.

vLLM (0.32, 0.33) describes a tier by its ``Medium`` (``CPU``, ``STORAGE``) and ``Locality``
(``LOCAL``, ``REMOTE``), and a request may name the tiers it loads from in its
``kv_transfer_params``: ``"kv_load_tiers": [{"medium": "CPU"}]``. vLLM's connector parses
that into ``ReqContext.load_tier_filter`` (a ``TierFilter``; an entry it cannot read is
skipped with a warning, a list of only such entries means every tier) and leaves it to the
manager. As in vLLM's own ``TieringOffloadingManager``, the filter chooses among the tiers
*below* the host tier: the host tier (vLLM's CPU primary) is always looked in, since every
load comes from it; a filter that lets no lower tier through loads from the host tier only.

kvtier's tiers: ``host`` is ``CPU``/``LOCAL``, ``disk`` ``STORAGE``/``LOCAL``, ``remote``
(a ``kvtier peer``) and ``mooncake`` ``STORAGE``/``REMOTE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import Locality, Medium, ReqContext, TierFilter

PLACES: dict[str, tuple[Medium, Locality]] = {
    "host": (Medium.CPU, Locality.LOCAL),
    "disk": (Medium.STORAGE, Locality.LOCAL),
    "remote": (Medium.STORAGE, Locality.REMOTE),
    "mooncake": (Medium.STORAGE, Locality.REMOTE),
}
"""Each tier kind's medium and locality, as vLLM's filters and KV events name them."""

ALL_TIERS = TierFilter.ALL


def place(kind: str) -> tuple[Medium, Locality]:
    """A tier kind's medium and locality (a kind not listed: remote storage)."""
    return PLACES.get(kind, (Medium.STORAGE, Locality.REMOTE))


@dataclass(frozen=True)
class LoadFrom:
    """The lower tiers (indices below the host tier) one request may load from: vLLM's
    ``kv_load_tiers`` read once per request, kept in its ``ReqContext`` (``set_state``)."""

    tiers: frozenset[int]


def lower_tiers_allowed(req_context: ReqContext, kinds: Sequence[str]) -> frozenset[int]:
    """The indices of ``kinds`` (the tiers below the host, in order) that ``req_context``'s
    ``load_tier_filter`` lets it load from; computed on the request's first call, then kept."""
    allowed = req_context.get_state(LoadFrom)
    if allowed is None:
        load_filter = req_context.load_tier_filter
        allowed = LoadFrom(frozenset(i for i, kind in enumerate(kinds) if load_filter.allows(*place(kind))))
        req_context.set_state(allowed)
    return allowed.tiers
