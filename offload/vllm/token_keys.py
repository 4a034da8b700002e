"""Keys that two vLLM engines with other block sizes compute alike: digests of the tokens.

vLLM keys a chunk by its block hash, a chain over blocks of the engine's block size: an
engine with 16-token blocks and one with 64-token blocks compute different hashes for the
same 64 tokens, so neither finds what the other stored, whatever the rows hold. kvtier's
connector (``offload.vllm.connector.KVTierConnector``) therefore hands this manager every
request's tokens, and it keys rows by a chain over *tokens per key* (the same for every
engine that can share rows: the namespace holds it) instead:

    h_0 = H("kvtier-tokens-v1", cache salt, LoRA name and path)
    h_i = H(h_{i-1}, tokens of chunk i)         (chunks of tokens_per_key tokens)
    key(end) = h_{end / tokens_per_key} + group id, or H(h_k, "tail", the rest) + group id

The translation is a layer around ``KVTierOffloadingManager``: keys in from vLLM (whose
end position the scheduler records in the ``ReqContext``), keys back out in what the
manager returns (keys to store, evicted keys, events). A request kvtier cannot key by its
tokens (multimodal inputs or prompt embeddings, whose content is not in the tokens; one it
never saw) keeps vLLM's keys: it is served only to engines with the same block size.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

log = logging.getLogger(__name__)

KEY_MAP_ENTRIES = 1 << 20
"""vLLM key <-> token key pairs remembered (LRU), for keys vLLM hands back later (complete
a store, an eviction): about 100 MiB at the bound; a row lives long before it falls out."""


class RequestTokens:
    """One request's token chain, computed as far as keys have asked for it."""

    def __init__(self, request: Any, tokens_per_key: int) -> None:
        self.request = request
        self.tokens_per_key = tokens_per_key
        salt = getattr(request, "cache_salt", None) or ""
        seed = hashlib.blake2b(
            f"kvtier-tokens-v1\x1f{salt}\x1f{lora_identity(request)}".encode(), digest_size=32
        ).digest()
        self.chain = [seed]

    def digest(self, end: int) -> bytes:
        """32 bytes (a vLLM block hash's size) naming ``tokens[:end]`` (with its salt and adapter)."""
        tokens = self.request.all_token_ids
        per = self.tokens_per_key
        whole, rest = divmod(end, per)
        while len(self.chain) <= whole:
            i = len(self.chain) - 1
            chunk = tokens[i * per : (i + 1) * per]
            self.chain.append(_digest(self.chain[-1], b"", chunk))
        if not rest:
            return self.chain[whole]
        return _digest(self.chain[whole], b"tail", tokens[whole * per : end])


def lora_identity(request: Any) -> str:
    """The adapter's name and path, as vLLM's block hashes hold them (a name re-pointed at
    another adapter is another KV); ``""`` without an adapter."""
    lora = getattr(request, "lora_request", None)
    if not lora:
        return ""
    return f"{lora.lora_name}\x1f{getattr(lora, 'lora_path', '') or ''}"


def _digest(parent: bytes, tag: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=32)
    h.update(tag)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


def keyable(request: Any) -> bool:
    """Whether a request's KV is determined by its tokens (and salt, LoRA) alone."""
    return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None


class TokenKeyedManager(OffloadingManager):
    """``inner`` (kvtier's manager adapter) keyed by token digests (see the module doc).

    Attributes it does not define (``manager``, ``metrics_text``, ...) are the inner one's.
    """

    def __init__(self, inner: OffloadingManager, tokens_per_key: int) -> None:
        self.inner = inner
        self.tokens_per_key = tokens_per_key
        self._requests: dict[str, RequestTokens] = {}
        self._to_token: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._to_vllm: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.translated = 0  # keys given a token key so far

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def lock(self) -> Any:
        return self.inner.lock

    def register(self, request: Any) -> None:
        """Called by the connector as vLLM adds ``request`` (before any key of it is used)."""
        if keyable(request):
            self._requests[request.request_id] = RequestTokens(request, self.tokens_per_key)

    # -- translation -------------------------------------------------------------------

    def _in(self, key: OffloadKey, ctx: ReqContext) -> OffloadKey:
        known = self._to_token.get(key)
        if known is not None:
            self._to_token.move_to_end(key)
            return OffloadKey(known)
        tokens = self._requests.get(ctx.req_id)
        end = ctx.get_offload_key_position(key) if tokens is not None else None
        if tokens is None or end is None:
            return key
        token_key = tokens.digest(end) + bytes(key[-4:])
        self._remember(bytes(key), token_key)
        return OffloadKey(token_key)

    def _ins(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        return [self._in(key, ctx) for key in keys]

    def _outs(self, keys: Iterable[bytes]) -> list[OffloadKey]:
        out = []
        for key in keys:
            vllm_key = self._to_vllm.get(bytes(key))
            out.append(OffloadKey(vllm_key) if vllm_key is not None else OffloadKey(key))
        return out

    def _remember(self, vllm_key: bytes, token_key: bytes) -> None:
        self.translated += 1
        self._to_token[vllm_key] = token_key
        self._to_vllm[token_key] = vllm_key
        while len(self._to_token) > KEY_MAP_ENTRIES:
            old_vllm, old_token = self._to_token.popitem(last=False)
            if self._to_vllm.get(old_token) == old_vllm:
                del self._to_vllm[old_token]

    # -- OffloadingManager -------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> Any:
        return self.inner.lookup(self._in(key, req_context), req_context)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        return self.inner.get_load_source(self._in(key, req_context), req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        return self.inner.prepare_load(self._ins(keys, req_context), req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.inner.touch(self._ins(keys, req_context), req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.inner.complete_load(self._ins(keys, req_context), req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        prepared = self.inner.prepare_store(self._ins(keys, req_context), req_context)
        if prepared is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=self._outs(prepared.keys_to_store),
            store_spec=prepared.store_spec,
            evicted_keys=self._outs(prepared.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.inner.complete_store(self._ins(keys, req_context), req_context, success=success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.inner.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._requests.pop(req_context.req_id, None)  # after its last prepare_store (vLLM's order)
        self.inner.on_request_finished(req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return [replace(event, keys=self._outs(event.keys)) for event in self.inner.take_events()]

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.inner.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    def reset_cache(self) -> None:
        self.inner.reset_cache()

    def on_reset_flushed(self) -> None:
        self.inner.on_reset_flushed()

    def get_stats(self) -> Any:
        return self.inner.get_stats()

    def config_info(self) -> Any:
        return self.inner.config_info()

    def shutdown(self) -> None:
        self.inner.shutdown()
