"""``KVTierConnector``: vLLM's ``OffloadingConnector`` that lets kvtier see each request's tokens.

vLLM's offloading managers get keys and request ids, never tokens, and its keys are chained
block hashes: engines with other block sizes key the same prompt differently. Loaded in
place of ``OffloadingConnector``, this connector hands kvtier's manager every request as it
is added, and the manager keys rows by their tokens (``offload.vllm.token_keys``), so an
engine with 64-token blocks and one with 16-token blocks find each other's rows (their
tokens per key agree, e.g. ``block_size: 64`` in ``kv_connector_extra_config``)::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
      "kv_connector_module_path": "offload.vllm.connector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "offload.vllm", "block_size": 64, ...}}'

Everything else is ``OffloadingConnector``'s, in both supported vLLM releases; with another
spec than kvtier's, it is exactly ``OffloadingConnector``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from offload.vllm.manager_adapter import KVTierOffloadingManager
from offload.vllm.token_keys import TokenKeyedManager

log = logging.getLogger(__name__)


class KVTierConnector(OffloadingConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.token_keys: TokenKeyedManager | None = None
        scheduler = self.connector_scheduler
        if scheduler is None:
            return  # the worker side: nothing to change
        manager = scheduler.manager
        if not isinstance(manager, KVTierOffloadingManager):
            log.warning("KVTierConnector without KVTierOffloadingSpec: keys stay vLLM's block hashes")
            return
        # Chunks of every group end on multiples of this: the token chain's step.
        tokens_per_key = math.gcd(*(group.tokens_per_chunk for group in scheduler.config.kv_group_configs))
        self.token_keys = TokenKeyedManager(manager, tokens_per_key)
        scheduler.manager = self.token_keys
        log.info("kvtier: rows keyed by their tokens, %d per key", tokens_per_key)

    def on_new_request(self, request: Any) -> None:
        if self.token_keys is not None:
            self.token_keys.register(request)
        super().on_new_request(request)
