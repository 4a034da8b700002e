"""The row checksum of ``row_format`` (xxh3-64), computed by address with the GIL released.

``row_format.checksum`` calls python-xxhash, which holds the GIL while it hashes. The
remote tier hashes on its NIXL agent's thread, next to the copies, and a thread that holds
the GIL for milliseconds makes the event loop (and the agent thread itself, after each
``transfer()``) wait up to the interpreter's 5 ms switch interval for it: measured, that
halved the tier's throughput. The xxhash wheel's extension exports the xxHash C API; called
through ``ctypes`` it releases the GIL. It exports ``XXH3_64bits_dispatch`` too, which picks
the widest vector unit the CPU has (AVX2/AVX-512) at first call, where ``XXH3_64bits`` is
built for SSE2: measured here on rows in cache, 41-44 GB/s against 18 GB/s (the same on rows
in DRAM, ~20 GB/s, where memory is the limit). The same hash either way: at import the
function is checked against ``row_format.checksum``; if no symbol is there or it disagrees,
the GIL-holding function is used instead (slower under load, never wrong).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import xxhash

from tiers.row_format import checksum

log = logging.getLogger(__name__)


def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)  # type: ignore[attr-defined]
    except (AttributeError, OSError) as exc:
        log.info("xxh3 by address unavailable (%s): checksums hold the GIL", exc)
        return None
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        fn = getattr(lib, name, None)
        if fn is not None and _agrees(fn):
            return fn
    log.info("xxh3 by address unavailable or disagreeing: checksums hold the GIL")
    return None


def _agrees(fn: ctypes._CFuncPtr) -> bool:  # type: ignore[name-defined]
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_uint64
    probe = np.frombuffer(bytes(range(256)) * 17, dtype=np.uint8)
    for size in (0, 1, 17, 240, 241, probe.nbytes):
        if fn(probe.ctypes.data, size) != checksum(memoryview(probe)[:size]):
            log.warning("xxh3 by address (%s) disagrees with row_format.checksum: not used", fn.__name__)
            return False
    return True


_XXH3 = _load()


def checksum_at(view: memoryview, addr: int) -> int:
    """``row_format.checksum(view)``; ``addr`` must be the address of ``view``'s first byte."""
    if _XXH3 is None:
        return checksum(view)
    return _XXH3(addr, len(view))
