"""LoRA adapters in vLLM's real CPU engine, with kvtier: each adapter's KV is its own.

An adapter of the K and V projections changes the KV of every token, so a prefix computed
under one adapter must never be loaded under another, nor under the base model. vLLM's block
hashes hold the adapter's name and path, and so do kvtier's keys: vLLM's block hashes
themselves with vLLM's ``OffloadingConnector``, a token chain seeded with the adapter's name
and path with ``KVTierConnector`` (``offload.vllm.token_keys``); so the rows each stores are
disjoint. Two adapters with random non-zero weights (``bench.tiny_lora``) over
the tiny Llama; "exact" as in ``test_real_engine``: tokens and logprobs equal the engine's
own device-cache run under the same adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_lora import write_adapter
from bench.vllm_engine import Adapter
from tests.engine.conftest import document
from tests.engine.test_real_engine import BLOCK, assert_exact

DOC = document(1, 600)
PREFIX = (len(DOC) - 1) // BLOCK * BLOCK  # vLLM caches whole blocks, never the prompt's last token
ROWS = PREFIX // BLOCK
RANK = 8


@pytest.mark.parametrize("connector", ["OffloadingConnector", "KVTierConnector"])
def test_two_adapters_and_the_base_model_never_share_a_row_and_each_comes_back_exact(
    make_engine, tmp_path: Path, connector: str
):
    sql = Adapter("sql", 1, str(write_adapter(tmp_path / "adapters", "sql", seed=1, rank=RANK)))
    chat = Adapter("chat", 2, str(write_adapter(tmp_path / "adapters", "chat", seed=2, rank=RANK)))
    engine = make_engine(max_lora_rank=RANK, kv_connector=connector)

    cold = engine.generate([DOC], lora=sql)[0]
    reference = engine.generate([DOC], lora=sql)[0]
    assert cold.num_cached_tokens == 0
    assert reference.num_cached_tokens == PREFIX and reference.external_cached_tokens == 0
    assert engine.kvtier_stats()["stored_rows"] == ROWS

    # The same prompt under the other adapter, then the base model: neither vLLM's device
    # cache nor kvtier hits, and each stores rows of its own (a shared key is stored once).
    for other in (chat, None):
        out = engine.generate([DOC], lora=other)[0]
        assert out.num_cached_tokens == 0 and out.external_cached_tokens == 0
        assert out.logprobs != reference.logprobs, "the adapter must change the output"
    stats = engine.kvtier_stats()
    assert stats["stored_rows"] == stats["host_rows"] == 3 * ROWS, "three disjoint sets of rows"
    assert stats["loaded_rows_by_tier"] == {}

    assert engine.reset_prefix_cache()
    again = engine.generate([DOC], lora=sql)[0]

    assert again.external_cached_tokens == PREFIX, "the adapter's own prefix from kvtier's host tier"
    assert_exact(again, reference)
    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {"host": ROWS}
