"""The spec's settings: vLLM's ``kv_connector_extra_config``, read and validated once.

vLLM's own keys keep the meaning they have for its ``CPUOffloadingSpec``, so switching to
kvtier changes only ``spec_name`` and ``spec_module_path``:

- ``cpu_bytes_to_use``: the host tier's size (bytes, or a size such as ``"8GiB"``);
- ``eviction_policy``: the host tier's eviction policy (``lru``, ``arc``, ... or
  ``"pkg.module:Class"``);
- ``block_size`` / ``blocks_per_chunk``: read by vLLM itself (one host row per chunk).

kvtier's keys:

- ``kvtier_config``: the tier configuration, a path to its TOML file or the same keys
  inline (``{"tiers": [...], "namespace": {...}}``). Without it the host tier is the only
  tier. Its host ``capacity`` / ``eviction`` may be left out when the vLLM keys give them;
  given twice with different values, it is an error.
- ``shm_dir``: where the shared host-tier file lives (default ``/dev/shm``).
- ``kv_page_split``: where a page keeps K and V apart, for ``offload.vllm.row_layout``:
  ``"token"`` (each token's K then V: the ``C`` of vLLM's ``[B, H, N, C]`` view, as
  FlashAttention reads it), ``"cpu"`` (vLLM's CPU attention: a head's K dim-major, then
  its V) or ``"auto"`` (the default: ``cpu`` on vLLM's CPU platform, else ``token``).
- ``convert_on``: where rows of another layout are rewritten into the engine's:
  ``"landing"`` (on the scheduler's tier-engine thread, once, as they reach the host tier),
  ``"load"`` (by the worker, on its device, as it loads them) or ``"auto"`` (the default:
  ``landing`` on vLLM's CPU platform, ``load`` elsewhere).

A key that neither vLLM nor kvtier reads is logged once as a warning (vLLM adds keys
between releases, so it is not an error).

Only vLLM's keys are read here: the tier configuration is read and validated by
``offload.config`` (its TOML file, its keys, its errors), after vLLM's host-tier keys are
put into its first tier.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.config import ConfigError, KVTierConfig, check_nesting, parse_config, parse_size, read_toml

log = logging.getLogger(__name__)

VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "cpu_bytes_to_use",
        "block_size",
        "blocks_per_chunk",
        "eviction_policy",
        "offload_prompt_only",
        "self_describing_kv_events",
        "sync_load_budget_bytes",
        "canonical_layout",
    }
)
"""Keys of ``kv_connector_extra_config`` that vLLM reads for every offloading spec."""

IGNORED_CPU_SPEC_KEYS = frozenset({"store_threshold", "max_tracker_size"})
"""``CPUOffloadingSpec`` keys with no equivalent on the host tier (admission is per lower tier)."""

KVTIER_KEYS = frozenset({"kvtier_config", "shm_dir", "kv_page_split", "convert_on"})

KV_PAGE_SPLITS = ("auto", "token", "cpu")
CONVERT_ON = ("auto", "landing", "load")

DEFAULT_SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SpecSettings:
    tiers: KVTierConfig
    shm_dir: str
    config_source: str  # "inline", the TOML path, or "vLLM keys": for the start-up log line
    kv_page_split: str = "auto"
    convert_on: str = "auto"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *, model: str) -> SpecSettings:
        """Parse ``extra`` (vLLM's ``kv_connector_extra_config``); ``model`` is the default
        namespace model id. Raises ``ConfigError`` naming the key and the value at fault."""
        check_nesting(extra, "kv_connector_extra_config")
        unknown = sorted(set(extra) - VLLM_KEYS - IGNORED_CPU_SPEC_KEYS - KVTIER_KEYS)
        if unknown:
            log.warning(
                "kv_connector_extra_config keys %s are not read by vLLM's connector nor kvtier", unknown
            )
        for key in sorted(IGNORED_CPU_SPEC_KEYS & set(extra)):
            log.warning(
                "kv_connector_extra_config.%s = %r has no effect with KVTierOffloadingSpec: "
                "use admission = 'seen-twice' on a lower tier instead",
                key,
                extra[key],
            )
        module_path = extra.get("cache_policy_module_path")
        if module_path is not None:
            raise ConfigError(
                f"kv_connector_extra_config.cache_policy_module_path = {module_path!r}: "
                "kvtier loads its own policies; give eviction_policy = 'pkg.module:Class' instead"
            )
        if extra.get("canonical_layout"):
            raise ConfigError(
                "kv_connector_extra_config.canonical_layout = true: KVTierOffloadingSpec stores the "
                "direct layout only; remove canonical_layout"
            )

        raw, source = _raw_tier_config(extra.get("kvtier_config"))
        cpu_bytes = extra.get("cpu_bytes_to_use")
        if isinstance(cpu_bytes, float) and cpu_bytes.is_integer():
            cpu_bytes = int(cpu_bytes)  # vLLM takes int(cpu_bytes_to_use): 1e10 is a byte count
        _merge_host(raw, "capacity", "cpu_bytes_to_use", cpu_bytes, _same_size)
        _merge_host(raw, "eviction", "eviction_policy", extra.get("eviction_policy"), _same_value)
        if "capacity" not in raw["tiers"][0]:
            raise ConfigError(
                "kv_connector_extra_config.cpu_bytes_to_use is missing: give the host tier's size "
                "(or tiers[0].capacity in kvtier_config)"
            )
        namespace = raw.setdefault("namespace", {})
        if isinstance(namespace, dict) and not namespace.get("model"):
            namespace["model"] = model
        tiers = parse_config(raw)

        shm_dir = extra.get("shm_dir", DEFAULT_SHM_DIR)
        if not isinstance(shm_dir, str) or not shm_dir:
            raise ConfigError(f"kv_connector_extra_config.shm_dir = {shm_dir!r}: expected a directory path")
        if shm_dir == DEFAULT_SHM_DIR and not os.path.isdir(shm_dir):
            shm_dir = tempfile.gettempdir()  # no /dev/shm (macOS): a plain file still maps
        split = extra.get("kv_page_split", "auto")
        if split not in KV_PAGE_SPLITS:
            raise ConfigError(
                f"kv_connector_extra_config.kv_page_split = {split!r}: expected one of {KV_PAGE_SPLITS}"
            )
        convert_on = extra.get("convert_on", "auto")
        if convert_on not in CONVERT_ON:
            raise ConfigError(
                f"kv_connector_extra_config.convert_on = {convert_on!r}: expected one of {CONVERT_ON}"
            )
        return cls(tiers, shm_dir, source, split, convert_on)


def _raw_tier_config(value: Any) -> tuple[dict[str, Any], str]:
    """The tier configuration as a fresh dict, from a TOML path, an inline dict or nothing."""
    if value is None:
        return {"tiers": [{"kind": "host"}]}, "vLLM keys"
    if isinstance(value, Mapping):
        raw = copy.deepcopy(dict(value))
        source = "inline"
    elif isinstance(value, str | Path):
        path = Path(value)
        raw = read_toml(path, "kvtier_config")
        source = str(path)
    else:
        raise ConfigError(f"kvtier_config = {value!r}: expected a path to a TOML file or a table of tiers")
    tiers = raw.get("tiers")
    if not isinstance(tiers, list) or not tiers or not isinstance(tiers[0], dict):
        raise ConfigError(f"kvtier_config: tiers = {tiers!r}: expected a non-empty list of tier tables")
    return raw, source


def _merge_host(raw: dict[str, Any], key: str, vllm_key: str, value: Any, same: Any) -> None:
    """Put vLLM's ``vllm_key`` into the host tier's ``key``; both given and different is an error."""
    if value is None:
        return
    host = raw["tiers"][0]
    if key in host and not same(host[key], value, key):
        raise ConfigError(
            f"kv_connector_extra_config.{vllm_key} = {value!r} but kvtier_config tiers[0].{key} = "
            f"{host[key]!r}: give the host tier's {key} once"
        )
    host[key] = value


def _same_size(a: Any, b: Any, key: str) -> bool:
    return parse_size(a, f"tiers[0].{key}") == parse_size(b, f"tiers[0].{key}")


def _same_value(a: Any, b: Any, _key: str) -> bool:
    return a == b
