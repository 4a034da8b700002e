"""A host pool with sglang 0.5.23's page geometry, for the backend's tests and benchmark
without SGLang (``tests/sglang``, ``bench.sglang_backend``).

``FakeHostPool`` allocates ``kv_buffer`` with the dims SGLang's MHA and MLA host pools use in
``layer_first``, ``page_first`` and ``page_first_direct`` and answers
``get_page_buffer_meta(indices)`` as they do (``srt/mem_cache/pool_host/mha.py`` and
``mla.py``): per page, MHA gives K then V of each layer (``layer_first``: 2·L regions) or K
then V of the whole page (``page_first*``: 2 regions, V half a buffer away); MLA gives one
region per layer (``layer_first``) or one for the page. Written from reading those files,
not copied.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class FakeHostPool:
    """A host pool of ``pages`` pages (``make_pool`` picks the MHA or the MLA one)."""

    kind = ""

    def __init__(
        self,
        layout: str = "page_first",
        *,
        dtype: torch.dtype = torch.float16,
        page_size: int = 4,
        pages: int = 16,
        layers: int = 3,
        heads: int = 2,
        head_dim: int = 8,
        kv_dim: int = 24,
    ) -> None:
        self.layout, self.dtype = layout, dtype
        self.page_size, self.page_num, self.size = page_size, pages, pages * page_size
        self.layer_num, self.head_num, self.head_dim, self.kv_cache_dim = layers, heads, head_dim, kv_dim
        self.kv_buffer = torch.zeros(self._dims(), dtype=dtype)

    def _dims(self) -> tuple[int, ...]:
        L, size, pages, ps = self.layer_num, self.size, self.page_num, self.page_size
        if self.kind == "mha":
            H, D = self.head_num, self.head_dim
            return {
                "layer_first": (2, L, size, H, D),
                "page_first": (2, size, L, H, D),
                "page_first_direct": (2, pages, L, ps, H, D),
            }[self.layout]
        K = self.kv_cache_dim
        return {
            "layer_first": (L, size, 1, K),
            "page_first": (size, L, 1, K),
            "page_first_direct": (pages, L, ps, 1, K),
        }[self.layout]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        it, L, base = self.dtype.itemsize, self.layer_num, self.kv_buffer.data_ptr()
        token = (self.head_num * self.head_dim if self.kind == "mha" else self.kv_cache_dim) * it
        v_offset = L * self.size * token  # MHA: V is the second half of the buffer
        starts = indices.tolist()[:: self.page_size]
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for start in starts:
                for layer in range(L):
                    k = base + start * token + layer * self.size * token
                    ptrs += [k, k + v_offset] if self.kind == "mha" else [k]
            size = self.page_size * token
        else:
            for start in starts:
                k = base + start * L * token
                ptrs += [k, k + v_offset] if self.kind == "mha" else [k]
            size = L * self.page_size * token
        return ptrs, [size] * len(ptrs)

    # -- for the tests ----------------------------------------------------------------------

    def slots(self, *pages: int) -> torch.Tensor:
        """The host indices of ``pages`` (page numbers), as SGLang passes them."""
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])

    def page_bytes(self, page: int) -> bytes:
        ptrs, sizes = self.get_page_buffer_meta(self.slots(page))
        return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))

    def fill(self, page: int, seed: int) -> bytes:
        """Random bytes into every region of ``page``; returns them."""
        ptrs, sizes = self.get_page_buffer_meta(self.slots(page))
        data = torch.randint(
            0, 256, (sum(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
        raw = data.numpy().tobytes()
        offset = 0
        for p, n in zip(ptrs, sizes, strict=True):
            ctypes.memmove(p, raw[offset : offset + n], n)
            offset += n
        return raw

    def wipe(self, page: int, value: int = 0xAB) -> None:
        ptrs, sizes = self.get_page_buffer_meta(self.slots(page))
        for p, n in zip(ptrs, sizes, strict=True):
            ctypes.memset(p, value, n)


class MHATokenToKVPoolHost(FakeHostPool):
    """Named as SGLang's MHA host pool (the backend's row description names the pool)."""

    kind = "mha"


class MLATokenToKVPoolHost(FakeHostPool):
    kind = "mla"


def make_pool(kind: str = "mha", layout: str = "page_first", **kwargs: Any) -> FakeHostPool:
    """An MHA (``kind="mha"``) or MLA host pool in ``layout``."""
    cls = MHATokenToKVPoolHost if kind == "mha" else MLATokenToKVPoolHost
    return cls(layout, **kwargs)


def storage_config(
    extra: dict[str, Any],
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str | None = "test/tiny-model",
    metrics: bool = False,
) -> SimpleNamespace:
    """The fields of sglang 0.5.23's ``HiCacheStorageConfig`` the backend reads."""
    return SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        dcp_rank=0,
        dcp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name=model,
        extra_config=extra,
    )


def dynamic_config(tiers: list[dict[str, Any]], **keys: Any) -> dict[str, Any]:
    """SGLang's extra config for the ``dynamic`` backend, naming kvtier's class."""
    return {
        "backend_name": "kvtier",
        "module_path": "offload.sglang",
        "class_name": "KVTierStorage",
        "interface_v1": 1,
        "tiers": tiers,
        **keys,
    }
