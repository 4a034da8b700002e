"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config``, read once.

SGLang hands its ``dynamic`` backend the whole extra config (a JSON object): its own keys
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, and the prefetch knobs
some SGLang paths leave in it) and the backend's. kvtier's keys:

- ``tiers``: the tiers below SGLang's host pool, fastest first, each a table with the keys
  of a ``[[tiers]]`` table of kvtier's TOML (``kind = "disk" | "remote" | "mooncake"``,
  ``capacity``, ...); or ``kvtier_config``: the path of a kvtier TOML, whose host tier
  (the first, which kvtier's TOML requires) is not used: SGLang's ``--hicache-ratio`` or
  ``--hicache-size`` sizes the host pool. Exactly one of the two.
- ``model`` and ``tenant``: the namespace's model (default: the model SGLang serves) and
  tenant salt (default: the TOML's ``[namespace]``, else none).
- ``staging``: the bytes of the rows the calls move pages through (default ``256MiB``,
  at least one page).

``placement``, ``admission`` and ``promotion`` are refused in a tier's table: SGLang
decides what is backed up (``--hicache-write-policy``) and every page it hands over is
stored in every tier; a key that would be silently ignored is an error instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.config import ConfigError, parse_config, parse_size, parse_tier, read_toml
from tiers.settings import LowerTierSettings

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
"""Keys SGLang reads from the same extra config (some of its paths leave them in it)."""
OWN_KEYS = frozenset({"tiers", "kvtier_config", "model", "tenant", "staging"})
PLACEMENT_KEYS = ("placement", "admission", "promotion")
DEFAULT_STAGING_BYTES = 256 << 20


@dataclass(frozen=True)
class BackendSettings:
    """What the backend runs with: the tiers below the host pool, fastest first, the
    namespace overrides and the staging size."""

    tiers: tuple[LowerTierSettings, ...]
    model: str | None = None
    tenant: str = ""
    staging_bytes: int = DEFAULT_STAGING_BYTES


def parse_extra_config(extra: Mapping[str, Any] | None) -> BackendSettings:
    """The backend's settings from SGLang's extra config; ``ConfigError`` naming the key."""
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"--hicache-storage-backend-extra-config = {extra!r}: expected a JSON object with "
            "'backend_name', 'module_path', 'class_name', 'interface_v1' and 'tiers' or 'kvtier_config'"
        )
    unknown = sorted(set(extra) - SGLANG_KEYS - OWN_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]} = {extra[unknown[0]]!r}: unknown key (kvtier's: {sorted(OWN_KEYS)})")
    if not extra.get("interface_v1"):
        raise ConfigError(
            f"interface_v1 = {extra.get('interface_v1')!r}: kvtier serves SGLang's zero-copy "
            'interface only; add "interface_v1": 1 to the extra config'
        )
    if ("tiers" in extra) == ("kvtier_config" in extra):
        raise ConfigError(
            "give exactly one of 'tiers' (a list of tier tables) and 'kvtier_config' (a TOML path)"
        )
    model, tenant = None, ""
    if "tiers" in extra:
        raw_tiers = extra["tiers"]
        if not isinstance(raw_tiers, list) or not raw_tiers:
            raise ConfigError(f"tiers = {raw_tiers!r}: expected a non-empty list of tier tables")
        names = [f"tiers[{i}]" for i in range(len(raw_tiers))]
        for raw, where in zip(raw_tiers, names, strict=True):
            _refuse_placement(raw, where)
        parsed = [parse_tier(raw, where) for raw, where in zip(raw_tiers, names, strict=True)]
        for tier, where in zip(parsed, names, strict=True):
            if not isinstance(tier, LowerTierSettings):
                raise ConfigError(
                    f"{where}.kind = 'host': SGLang's host pool is the host tier; list the tiers below it"
                )
        tiers = tuple(t for t in parsed if isinstance(t, LowerTierSettings))
        kinds = [t.kind for t in tiers]
        for kind in kinds:
            if kinds.count(kind) > 1:
                raise ConfigError(
                    f"tiers: kind {kind!r} appears {kinds.count(kind)} times; give each kind once"
                )
    else:
        path = extra["kvtier_config"]
        if not isinstance(path, str) or not path:
            raise ConfigError(f"kvtier_config = {path!r}: expected the path of a kvtier TOML file")
        raw_config = read_toml(Path(path), key="kvtier_config")
        for i, raw in enumerate(raw_config.get("tiers") or []):
            if isinstance(raw, Mapping):
                _refuse_placement(raw, f"{path}: tiers[{i}]")
        config = parse_config(raw_config)
        tiers = config.lower_tiers
        if not tiers:
            raise ConfigError(
                f"kvtier_config = {path!r}: no tier below the host tier (disk, remote, mooncake)"
            )
        model = config.namespace.model or None
        tenant = config.namespace.tenant
    model = _optional_string(extra, "model", model)
    tenant = _optional_string(extra, "tenant", tenant) or ""
    staging = parse_size(extra.get("staging", DEFAULT_STAGING_BYTES), "staging")
    if staging <= 0:
        raise ConfigError(f"staging = {extra.get('staging')!r}: expected a positive size")
    return BackendSettings(tiers=tiers, model=model, tenant=tenant, staging_bytes=staging)


def _refuse_placement(raw: Any, where: str) -> None:
    if not isinstance(raw, Mapping):
        return  # parse_tier says what is wrong with it
    for key in PLACEMENT_KEYS:
        if key in raw:
            raise ConfigError(
                f"{where}.{key} = {raw[key]!r}: not used under SGLang, which decides what is backed up "
                "(--hicache-write-policy) and has every tier store each page it hands over; remove it"
            )


def _optional_string(extra: Mapping[str, Any], key: str, default: str | None) -> str | None:
    if key not in extra:
        return default
    value = extra[key]
    if not isinstance(value, str) or "\0" in value:
        raise ConfigError(f"{key} = {value!r}: expected a string")
    return value
