"""Suite-wide checks.

``make test`` installs vLLM and sets ``KVTIER_REQUIRE_VLLM=1``: there, a vLLM that does not
import fails the run instead of letting the connector tests skip themselves. Likewise
``KVTIER_REQUIRE_MOONCAKE=1`` for the Mooncake client (the Mooncake Store tests).
"""

from __future__ import annotations

import importlib
import os

import pytest

# NIXL's wheel bundles its own libibverbs; where the system has one too (Debian's
# libibverbs1, which Mooncake needs), UCX's InfiniBand modules load both, and every process
# with a NIXL agent dies with SIGSEGV at exit. There is no RDMA device here: skip them.
os.environ.setdefault("UCX_MODULES", "^ib*")

try:  # hypothesis is in the test set-up; guarded so a bare pytest still collects
    from hypothesis import settings as _hypothesis_settings

    # No per-example deadline (hypothesis' default is 200 ms): on two shared cores an example
    # can take longer, and a deadline then fails a property that holds. Tests time nothing.
    _hypothesis_settings.register_profile("kvtier", deadline=None)
    _hypothesis_settings.load_profile("kvtier")
except ImportError:
    pass


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        try:
            importlib.import_module("vllm.v1.kv_offload.base")
        except Exception as exc:  # any import failure means the connector tests would not run
            raise pytest.UsageError(f"KVTIER_REQUIRE_VLLM=1 but vLLM does not import: {exc!r}") from exc
    if os.environ.get("KVTIER_REQUIRE_MOONCAKE") == "1":
        try:
            importlib.import_module("mooncake.store")
        except Exception as exc:  # a missing wheel, or its binaries missing libibverbs
            raise pytest.UsageError(
                f"KVTIER_REQUIRE_MOONCAKE=1 but mooncake does not import: {exc!r}"
            ) from exc


@pytest.fixture
def spawn_peers(tmp_path):
    """``spawn_peers(n, **kwargs)`` starts ``n`` real ``kvtier peer`` processes
    (``tests.tiers.peer_fixtures.start_peers``); every one is closed after the test."""
    from tests.tiers.peer_fixtures import start_peers  # NIXL only where a test asks for peers

    started = []

    def start(n: int = 1, **kwargs):
        peers = start_peers(tmp_path, n, **kwargs)
        started.extend(peers)
        return peers

    yield start
    for peer in started:
        peer.close()
