"""Fixtures for the vLLM tests: a tiny model config, and engines shut down after each test.

The test modules guard themselves with ``pytest.importorskip("vllm")``; this file imports
nothing from vLLM at import time, so the suite runs where vLLM is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.vllm.harness import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def make_engine(model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``make_engine(**options)`` builds a ``harness.Engine``; every one is shut down at the end,
    and its shared host-tier file must be gone then."""
    from tests.vllm.harness import Engine

    engines: list[Engine] = []
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()

    def make(**options: Any) -> Engine:
        engine = Engine(options.pop("model_dir", model_dir), shm_dir, **options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
    assert os.listdir(shm_dir) == [], "the scheduler side must remove the shared host-tier file"
