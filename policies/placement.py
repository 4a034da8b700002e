"""Placement: where a block goes between tiers. Small pure decisions, no I/O.

Eviction policies decide *which* block leaves a tier; placement decides what that means
for the tier below, and what enters a tier at all. One ``Placement`` per tier, read by the
owner of the tier chain (the manager, the simulator):

- ``write``: ``"write-back"`` copies a block to the next tier when this tier evicts it (the
  next tier holds what this one could not keep); ``"write-through"`` copies it down when it
  is stored here (the next tier holds a superset, so an eviction here costs nothing to spill
  and a crash loses nothing); ``"none"`` never copies down (the last tier, or a tier whose
  victims are simply dropped). The names are the configuration's (``placement`` in the
  TOML), so no layer translates them.
- ``admission``: which offered blocks a tier accepts. ``AdmitAll``, or ``SeenTwice``: only
  blocks requested at least twice lately (by a bounded frequency sketch), so a disk tier is
  not worn by blocks that are never read again.
- ``promote``: on a hit in this tier (below the host tier), copy the block up into the host
  tier, so its next hit is served from memory.

Built from configuration with ``make_placement``; every error is a ``ValueError`` that names
the field and the value at fault.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from policies.sketch import FrequencySketch

WriteMode = Literal["write-through", "write-back", "none"]
WRITE_MODES: tuple[str, ...] = ("write-through", "write-back", "none")
PLACEMENTS: tuple[str, ...] = ("write-back", "write-through")
"""What a configured lower tier's ``placement`` may be (``"none"`` is the simulator's only)."""


class Admission(ABC):
    """Decides whether a tier accepts a block offered to it.

    ``observe(key)`` is called once for every block a request asks for (hit or miss, in
    every tier), ``admit(key)`` when the block is offered for storage in this tier.
    """

    name: str = ""

    def observe(self, key: Hashable) -> None:
        """Count one request for ``key`` (the default keeps no history)."""
        del key

    @abstractmethod
    def admit(self, key: Hashable) -> bool:
        """Whether ``key`` may be stored in the tier now."""


class AdmitAll(Admission):
    """Every offered block is stored."""

    name = "all"

    def admit(self, key: Hashable) -> bool:
        return True


class SeenTwice(Admission):
    """Store a block only once it has been requested ``threshold`` times lately.

    Counts live in a ``FrequencySketch`` sized from ``capacity`` (the tier's rows), with
    a doorkeeper and periodic halving: memory is a constant times ``capacity``, however
    many distinct blocks pass. Counts can only over-estimate, so a block seen twice is
    always admitted; a few seen once are admitted too (hash collisions).
    """

    name = "seen-twice"

    def __init__(self, capacity: int, threshold: int = 2, sample_factor: int = 10) -> None:
        if not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"admission 'seen-twice': threshold must be an int >= 1, got {threshold!r}")
        self.threshold = threshold
        self.sketch = FrequencySketch(capacity, sample_factor=sample_factor)

    def observe(self, key: Hashable) -> None:
        self.sketch.record(key)

    def admit(self, key: Hashable) -> bool:
        return self.sketch.frequency(key) >= self.threshold


@dataclass
class Placement:
    """How one tier relates to the next: copy-down mode, admission, promotion on hit."""

    write: WriteMode = "write-back"
    admission: Admission = field(default_factory=AdmitAll)
    promote: bool = True

    def __post_init__(self) -> None:
        if self.write not in WRITE_MODES:
            raise ValueError(f"placement: write must be one of {list(WRITE_MODES)}, got {self.write!r}")
        if not isinstance(self.admission, Admission):
            raise ValueError(f"placement: admission must be an Admission, got {self.admission!r}")
        if not isinstance(self.promote, bool):
            raise ValueError(f"placement: promote must be true or false, got {self.promote!r}")

    def copy_down_on_store(self) -> bool:
        """Write-through: a block stored here is also offered to the next tier."""
        return self.write == "write-through"

    def copy_down_on_evict(self) -> bool:
        """Write-back: a block evicted here is offered to the next tier."""
        return self.write == "write-back"

    def admit(self, key: Hashable) -> bool:
        """Whether this tier stores ``key`` when it is offered."""
        return self.admission.admit(key)

    def promote_on_hit(self) -> bool:
        """Whether a hit here copies the block up into the host tier."""
        return self.promote


ADMISSIONS = ("all", "seen-twice")


def make_admission(name: str, capacity: int, **params: Any) -> Admission:
    """An admission rule by name: ``"all"`` or ``"seen-twice"`` (``threshold``, ``sample_factor``)."""
    if name == "all":
        if params:
            raise ValueError(f"admission 'all' takes no parameters, got {sorted(params)}")
        return AdmitAll()
    if name in ("seen-twice", "seen_twice"):
        try:
            return SeenTwice(capacity, **params)
        except TypeError as exc:
            raise ValueError(f"admission 'seen-twice': bad parameters {params}: {exc}") from exc
    raise ValueError(f"unknown admission {name!r}: choose one of {list(ADMISSIONS)}")


def make_placement(config: Mapping[str, Any] | None, capacity: int) -> Placement:
    """A placement from a table: ``{"write": "write-back", "admit": "seen-twice", "promote": true}``.

    ``admit`` may also be a table: ``{"name": "seen-twice", "threshold": 3}``. Missing keys take
    the defaults (write-back, admit all, promote on hit); unknown keys are errors.
    """
    config = dict(config or {})
    unknown = set(config) - {"write", "admit", "promote"}
    if unknown:
        raise ValueError(f"placement: unknown keys {sorted(unknown)}; expected write, admit, promote")
    admit = config.get("admit", "all")
    if isinstance(admit, Mapping):
        params = dict(admit)
        admit_name = params.pop("name", None)
        if not isinstance(admit_name, str):
            raise ValueError(f"placement: admit table needs a 'name', got {dict(admit)!r}")
        admission = make_admission(admit_name, capacity, **params)
    elif isinstance(admit, str):
        admission = make_admission(admit, capacity)
    else:
        raise ValueError(f"placement: admit must be a name or a table, got {admit!r}")
    return Placement(
        write=config.get("write", "write-back"), admission=admission, promote=config.get("promote", True)
    )
