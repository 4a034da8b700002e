"""Placement rules: pure decisions built from config, with clear errors."""

from __future__ import annotations

import pytest

from policies.placement import AdmitAll, Placement, SeenTwice, make_admission, make_placement


def test_defaults_are_write_back_admit_all_promote() -> None:
    placement = make_placement(None, 100)
    assert placement.copy_down_on_evict() and not placement.copy_down_on_store()
    assert isinstance(placement.admission, AdmitAll) and placement.admit("k")
    assert placement.promote_on_hit()


def test_write_through_and_none() -> None:
    through = make_placement({"write": "write-through", "promote": False}, 10)
    assert through.copy_down_on_store() and not through.copy_down_on_evict() and not through.promote_on_hit()
    last = make_placement({"write": "none"}, 10)
    assert not last.copy_down_on_store() and not last.copy_down_on_evict()


def test_seen_twice_admits_only_keys_requested_twice() -> None:
    placement = make_placement({"admit": "seen-twice"}, 1_000)
    admission = placement.admission
    assert isinstance(admission, SeenTwice)
    admission.observe("a")
    assert not placement.admit("a")
    admission.observe("a")
    assert placement.admit("a")
    assert not placement.admit("never-seen")
    memory = admission.sketch.memory_cells
    for key in range(50_000):
        admission.observe(key)
    assert admission.sketch.memory_cells == memory


def test_admission_table_with_parameters() -> None:
    placement = make_placement({"admit": {"name": "seen-twice", "threshold": 3}}, 100)
    assert isinstance(placement.admission, SeenTwice) and placement.admission.threshold == 3


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"write": "sideways"}, "write must be one of"),
        ({"admit": "sometimes"}, "unknown admission 'sometimes'"),
        ({"admit": 3}, "admit must be a name or a table"),
        ({"admit": {"threshold": 2}}, "needs a 'name'"),
        ({"admit": {"name": "seen-twice", "threshold": 0}}, "threshold"),
        ({"admit": {"name": "seen-twice", "bogus": 1}}, "bad parameters"),
        ({"admit": {"name": "all", "threshold": 1}}, "takes no parameters"),
        ({"promote": "yes"}, "promote must be true or false"),
        ({"colour": "blue"}, "unknown keys ['colour']"),
    ],
)
def test_bad_placement_config_is_a_value_error_naming_the_field(config: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        make_placement(config, 100)
    assert fragment in str(excinfo.value)


def test_placement_is_a_plain_value() -> None:
    assert Placement().write == "write-back"
    assert make_admission("all", 1).admit(object())
