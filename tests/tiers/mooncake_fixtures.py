"""A real ``mooncake_master`` for tests (``bench.mooncake_master``), and tiers that join it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from bench.mooncake_master import MasterProcess, free_port
from tests.tiers.peer_fixtures import LAYOUT, die_with_parent
from tiers.address import Address
from tiers.mooncake import MooncakeTier
from tiers.settings import MooncakeSettings

__all__ = ["SEGMENT", "MasterProcess", "free_port", "open_tier", "start_master"]

SEGMENT = 32 << 20


def start_master(log_dir: Path, host: str = "127.0.0.1") -> MasterProcess:
    """A master with short leases (300 ms) on ``host``, killed with the test process."""
    return MasterProcess(log_dir / f"master-{free_port()}.log", preexec_fn=die_with_parent, host=host)


@contextlib.asynccontextmanager
async def open_tier(
    master: MasterProcess, host: memoryview, *, namespace: bytes = b"ns-mooncake", **kwargs
) -> AsyncIterator[MooncakeTier]:
    """A tier with its own 32 MiB segment (so each test's rows live in its own memory);
    ``kwargs`` are ``MooncakeSettings`` fields, or the constructor's other arguments."""
    keys = {f.name for f in dataclasses.fields(MooncakeSettings)}
    fields = {"capacity_bytes": SEGMENT, **{k: kwargs.pop(k) for k in list(kwargs) if k in keys}}
    settings = MooncakeSettings(master=Address.parse(master.address), **fields)
    tier = MooncakeTier(settings, namespace.ljust(16, b"\x00"), LAYOUT, **kwargs)
    await tier.open(host)
    try:
        yield tier
    finally:
        await tier.close()
