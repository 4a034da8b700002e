"""The disk tier: rows in a local file with an LMDB index (``tiers.disk.tier``).

``from tiers.disk import DiskTier`` is the public path; the modules inside are the tier
(``tier``), its in-memory index (``index``), the rows file and LMDB store (``lmdb_store``,
``page_allocator``), the crash-safe LMDB check (``lmdb_check``) and the directory lock
(``dir_lock``). Nothing here needs NIXL or Mooncake.
"""

from tiers.disk.tier import DiskTier

__all__ = ["DiskTier"]
