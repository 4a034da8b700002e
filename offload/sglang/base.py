"""SGLang's ``HiCacheStorage`` base class where SGLang imports, else a stand-in of its shape.

SGLang's factory accepts only subclasses of its own ``HiCacheStorage``
(``storage/backend_factory.py``), so inside an SGLang server the backend must derive from
it; everywhere else (kvtier's tests, a machine without SGLang) the backend still imports,
on the stand-in, which has the two hooks the backend inherits (sglang 0.5.23's).
"""

from __future__ import annotations

from typing import Any


class _HostPoolHooks:
    """The part of sglang 0.5.23's ``HiCacheStorage`` the backend relies on."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def on_host_pools_registered(self) -> None:
        """SGLang's hook once the initial host pools are registered; nothing to do here."""


try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as StorageBase

    SGLANG_IMPORT_ERROR: str | None = None
except Exception as exc:  # not installed, or an install whose imports fail: the stand-in
    StorageBase = _HostPoolHooks  # type: ignore[assignment,misc]
    SGLANG_IMPORT_ERROR = repr(exc)
