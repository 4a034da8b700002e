"""Import SGLang's model-config package where torchvision is absent (test-only).

Why: ``sglang.srt.mem_cache.memory_pool`` (imported by the cache controller, through
``mem_cache.l2_transfer`` -> ``mem_cache.pool_host`` -> ``pool_host.group``, and by the host
pools) and ``sglang.srt.observability.metrics_collector`` (through ``disaggregation.utils``)
import ``sglang.srt.configs``, whose ``__init__`` imports every model config. Two of those
import torchvision at module level, and no torchvision wheel loads against the CPU venv's
torch 2.13.0+cpu:

- ``sglang.srt.multimodal.internvl_utils`` (reached from ``configs/nano_nemotron_vl.py``,
  which takes only its ``IMAGENET_MEAN`` / ``IMAGENET_STD`` constants):
  ``torchvision.transforms`` and ``InterpolationMode``, for InternVL's image preprocessing;
- ``sglang.srt.configs.deepseek_ocr``: ``InterpolationMode`` and
  ``torchvision.transforms.functional``, for DeepSeek-OCR's image resizing.

Neither runs on a KV page path (no image is ever processed), so those two modules, and only
they, are imported while a stub ``torchvision`` stands in ``sys.modules``; the stub leaves
``sys.modules`` right after, so everything else (transformers' ``is_torchvision_available``
included) still sees torchvision absent. Any use of a stubbed name raises ``ImportError``.
SGLang's own classes are never replaced. Where torchvision imports, nothing is done.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any, NoReturn

_STUBBED = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
_IMPORTED_WITH_STUB = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr")


class _Unavailable:
    """A name taken from the stub: any call (or attribute of it, called) raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ImportError(f"{self._name}: torchvision is not installed (tests/sglang/without_torchvision.py)")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


def import_sglang_configs() -> None:
    """Import the two torchvision-importing SGLang modules with the stub in place (once),
    so that ``sglang.srt.configs`` and what imports it load. Raises what their import
    raises for any other reason."""
    if all(name in sys.modules for name in _IMPORTED_WITH_STUB):
        return
    importlib.import_module("sglang")  # imports transformers, which asks for torchvision: first
    if importlib.util.find_spec("torchvision") is not None:
        return  # a working torchvision: nothing to stand in for
    stubs = {name: _StubModule(name) for name in _STUBBED}
    stubs["torchvision"].transforms = stubs["torchvision.transforms"]  # type: ignore[attr-defined]
    stubs["torchvision.transforms"].functional = stubs["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    sys.modules.update(stubs)
    try:
        for name in _IMPORTED_WITH_STUB:
            importlib.import_module(name)
    finally:
        for name in _STUBBED:
            sys.modules.pop(name, None)
