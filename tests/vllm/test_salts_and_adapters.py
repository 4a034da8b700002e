"""Two cache salts, or two LoRA adapters, over the same prompt never share a row.

vLLM's block hashes hold a request's ``cache_salt`` and its adapter's name and path, so
``OffloadingConnector`` keys rows apart; kvtier's token keys (``KVTierConnector``) seed their
chain with the same (``offload.vllm.token_keys``). Each case stores a prompt under one salt or
adapter, asks for it under another (a miss: it is computed, and stores its own rows), then
under the first again (a hit: the check can fail).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.vllm.harness import BLOCK_SIZE

PREFIX = list(range(100, 260))  # 160 tokens: 10 blocks
ROWS = len(PREFIX) // BLOCK_SIZE

KEYS = {
    "cache-salt": ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
    "lora-name": ({"lora": ("sql", "/adapters/sql")}, {"lora": ("chat", "/adapters/chat")}),
    # vLLM keys a name re-pointed at another adapter apart: so must the token keys
    "lora-path": ({"lora": ("sql", "/adapters/sql-v1")}, {"lora": ("sql", "/adapters/sql-v2")}),
    "salt-vs-none": ({"cache_salt": "tenant-a"}, {}),
}


def ask(engine, tail: int, **key) -> tuple[str, set]:
    """The prompt under ``key``, after the device cache was emptied and filled with noise:
    (its id, the host rows it added)."""
    engine.evict_device_cache()
    engine.scramble()  # a block kvtier did not write now holds noise
    before = set(engine.manager.manager.held_keys())
    req = engine.add([*PREFIX, tail], **key)
    engine.run()  # verifies every loaded block against the model's bytes
    return req, set(engine.manager.manager.held_keys()) - before


@pytest.mark.parametrize("connector", ["OffloadingConnector", "KVTierConnector"])
@pytest.mark.parametrize("case", list(KEYS))
def test_two_salts_or_adapters_over_one_prompt_never_share_a_row(make_engine, connector, case):
    first, second = KEYS[case]
    engine = make_engine(connector=connector)

    _, stored_first = ask(engine, 7000, **first)
    other, stored_other = ask(engine, 7001, **second)
    again, stored_again = ask(engine, 7002, **first)

    assert len(stored_first) == ROWS
    assert engine.requests[other].loaded == [], "another salt or adapter must not read these rows"
    assert set(range(len(PREFIX))) <= engine.requests[other].computed
    assert len(stored_other) == ROWS and not stored_other & stored_first, "its own rows, under other keys"
    assert engine.requests[again].loaded == [(0, len(PREFIX))], "the same salt or adapter hits"
    assert stored_again == set()
