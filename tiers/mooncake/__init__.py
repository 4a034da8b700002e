"""The Mooncake tier: rows kept in a Mooncake Store cluster (``tiers.mooncake.tier``).

``from tiers.mooncake import MooncakeTier`` is the public path; ``listen`` keeps the store's
listeners on one interface. The ``mooncake`` package itself is imported only when a tier is
built (``store_class``), so importing this package never needs it.
"""

from tiers.mooncake.tier import MIN_SEGMENT_BYTES, MooncakeTier, object_key, store_class

__all__ = ["MIN_SEGMENT_BYTES", "MooncakeTier", "object_key", "store_class"]
