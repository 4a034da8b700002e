"""Model families at tensor parallelism 2 in vLLM's real CPU engine, with kvtier's host tier:
a reset prefix comes back exact, and each rank loads its own band of every row.

At TP=2 each of vLLM's two workers holds its shard of every layer's cache: half the KV
heads, and for the hybrids half the recurrent state's heads (Mamba-2 heads, gated delta-net
heads); a host row holds both ranks' pages side by side, one band per rank
(``offload/vllm/canonical.py``). The Llama's TP=2 test (``test_real_engine``) covers one
attention group; these add the sharded recurrent states, the hybrids' state row beside
their attention rows: Nemotron-H's Mamba-2 and Qwen3-Next's gated delta-net (whose MoE
MLPs are sharded over the ranks too). Qwen3-MoE, Gemma-2 (sliding and global
groups) and Granite-4-H pass the same steps by hand, ``bench.family_tensor_parallel``: an
engine at TP=2 costs about a minute of CI time, so CI runs the two most distinct
(``docs/models.md``).

"Exact" is as in ``test_families``: greedy tokens and logprobs equal the engine's own run
over its device prefix cache, and another document differs. Then the rows' bands are
rotated between the ranks in kvtier's host tier (rank 0 would find rank 1's bytes): the
next load is still a hit of the whole prefix and its output is no longer the reference's,
so the exact check tells a rank's own shard from another's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.tiny_families import FAMILIES, write_family
from tests.engine.test_families import DOC, EXPECTED, MAX_MODEL_LEN, OTHER, blocks, from_device_then_host

TP = 2
STATE = {"qwen3-next": "MambaSpec", "nemotron-h": "MambaSpec"}
"""The hybrids: their recurrent state rows (vLLM's ``MambaSpec`` group) are the ones rotated."""


@pytest.fixture(scope="module")
def families_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def start(name: str, make_engine: Any, families_dir: Path) -> Any:
    """The family's engine at ``TP``, kvtier's host tier alone."""
    family = FAMILIES[name]
    return make_engine(
        model_dir=str(write_family(families_dir, family)),
        max_model_len=MAX_MODEL_LEN,
        tensor_parallel_size=TP,
        **family.engine,
    )


@pytest.mark.parametrize("name", ["nemotron-h", "qwen3-next"])
def test_a_family_at_tensor_parallel_2_comes_back_exact_each_rank_from_its_own_band(
    name, make_engine, families_dir
):
    block, rows = EXPECTED[name]
    prefix = blocks(block) * block
    engine = start(name, make_engine, families_dir)

    _cold, reference = from_device_then_host(engine, prefix)

    assert engine.kvtier_stats()["loaded_rows_by_tier"] == {"host": rows}
    rotated = STATE.get(name, "AttentionSpec")
    bands = engine.row_bands(rotated, TP)
    if name in STATE:
        assert len(bands) == 1, "one state row: the recurrent state at the prefix's end"
    for row in bands:  # each rank wrote its own shard: two bands, neither empty, not copies
        assert not any(row["zero"]) and len(set(row["digests"])) == TP, row
    assert engine.generate([OTHER])[0].tokens != reference.tokens

    engine.row_bands(rotated, TP, rotate=True)  # rank 0 now finds rank 1's bytes, and back
    assert engine.reset_prefix_cache()
    swapped = engine.generate([DOC])[0]

    assert swapped.external_cached_tokens == prefix
    assert swapped.logprobs != reference.logprobs, "another rank's shard gave the same output"
