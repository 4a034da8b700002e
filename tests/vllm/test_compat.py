"""The supported vLLM window: releases inside it pass, others are one clear error."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm

from offload.vllm import compat
from offload.vllm.compat import UnsupportedVLLMVersion, check_vllm_version


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1.dev4+g1234abc", "0.33.9rc1"])
def test_releases_in_the_window_pass(found):
    assert check_vllm_version(found).release[:2] in {(0, 32), (0, 33)}


@pytest.mark.parametrize("found", ["0.25.1", "0.31.9", "0.34.0", "0.34.0rc1", "1.0.0"])
def test_releases_outside_the_window_name_the_version_and_the_range(found):
    with pytest.raises(UnsupportedVLLMVersion) as raised:
        check_vllm_version(found)
    message = str(raised.value)
    assert f"found vLLM {found}" in message
    assert ">=0.32, <0.34" in message


def test_an_unreadable_version_is_a_clear_error():
    with pytest.raises(UnsupportedVLLMVersion, match=r"cannot read the installed vLLM's version 'banana'"):
        check_vllm_version("banana")


def test_the_installed_vllm_is_in_the_window():
    assert compat.VLLM_VERSION.base_version == vllm.__version__.split("+")[0].split(".dev")[0]


def test_building_the_spec_under_an_unsupported_vllm_fails_before_anything_else(monkeypatch):
    from offload.vllm.spec import KVTierOffloadingSpec

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(UnsupportedVLLMVersion, match=r"found vLLM 0\.31\.0"):
        KVTierOffloadingSpec(config=None)  # type: ignore[arg-type]
