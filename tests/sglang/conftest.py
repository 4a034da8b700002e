"""Fixtures for the SGLang backend's tests: ``backend(...)`` opens a ``KVTierStorage`` over a
fake host pool and closes it after the test. Nothing here imports SGLang."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.sglang_pool import FakeHostPool, dynamic_config, make_pool, storage_config


def disk(path: Path, capacity: str = "64MiB") -> dict[str, Any]:
    return {"kind": "disk", "path": str(path), "capacity": capacity}


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``backend(pool=None, tiers=None, *, mla=False, tp_rank=0, tp_size=1, **extra)``: a
    registered ``KVTierStorage`` (default: a disk tier in ``tmp_path/disk``, an MHA
    page-first pool); every one is closed at the end (closing twice is harmless)."""
    from offload.sglang import KVTierStorage

    opened: list[Any] = []

    def make(
        pool: FakeHostPool | None = None,
        tiers: list[dict[str, Any]] | None = None,
        *,
        mla: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        metrics: bool = False,
        **extra: Any,
    ) -> Any:
        pool = pool if pool is not None else make_pool("mla" if mla else "mha")
        tiers = tiers if tiers is not None else [disk(tmp_path / "disk")]
        config = storage_config(
            dynamic_config(tiers, **extra), mla=mla, tp_rank=tp_rank, tp_size=tp_size, metrics=metrics
        )
        storage = KVTierStorage(config, {})
        storage.register_mem_pool_host(pool)
        opened.append(storage)
        return storage

    yield make
    for storage in opened:
        storage.close()
