"""SGLang's host pages as kvtier rows: where a page's bytes are, what they mean, and the copies.

SGLang's host pool describes a page by ``get_page_buffer_meta(indices)``: for each page of
``indices`` (``page_size`` token slots each, page-aligned), the address and size of each of
its regions, in order (sglang 0.5.23: K and V for an MHA pool in ``page_first`` or
``page_first_direct``, K and V of each layer for ``layer_first``, one region for an MLA page
first, one per layer for MLA ``layer_first``). A kvtier row is those regions end to end.

The order of a page's bytes differs between layouts (``page_first`` interleaves tokens and
layers one way, ``page_first_direct`` the other), so the layout, the dtype, the page size
and the region sizes are the row's meaning (``PageGeometry.description``): they go into the
namespace and the row's layout id, and a pool of another layout or dtype never reads these
rows (a miss, not bytes in the wrong order).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiers.row_format import LAYOUT_ID_BYTES

Region = tuple[int, int]
"""The address and byte size of one region of a host page."""


@dataclass(frozen=True)
class PageGeometry:
    """The shape of one host page as a row: ``tokens`` token slots (the controller's page),
    regions of ``region_bytes`` each, ``row_bytes`` in all; ``description`` says what the
    bytes mean (the namespace's layout), ``layout_id`` is its 16-byte digest (row headers)."""

    tokens: int
    region_bytes: tuple[int, ...]
    description: str

    @property
    def row_bytes(self) -> int:
        return sum(self.region_bytes)

    @property
    def layout_id(self) -> bytes:
        return hashlib.blake2b(self.description.encode(), digest_size=LAYOUT_ID_BYTES).digest()

    @classmethod
    def of(cls, pool: Any) -> PageGeometry:
        """The geometry of ``pool``'s pages, read from its first page's buffer meta.
        ``ValueError`` for a pool whose pages cannot be rows (no regions, a zero size)."""
        tokens = int(getattr(pool, "logical_page_size", pool.page_size))
        addresses, sizes = pool.get_page_buffer_meta(torch.arange(tokens, dtype=torch.int64))
        sizes = _sizes(sizes, len(addresses)) if isinstance(sizes, int) else [int(s) for s in sizes]
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"the host pool describes a page as regions of {sizes} bytes")
        described = {
            "format": "sglang-hicache-v1",
            "pool": type(pool).__name__,
            "layout": str(pool.layout),
            "dtype": str(pool.dtype),
            "page_tokens": tokens,
            "layers": int(getattr(pool, "layer_num", 0)),
            "regions": sizes,
        }
        return cls(tokens, tuple(sizes), json.dumps(described, sort_keys=True))

    def pages(self, pool: Any, host_indices: torch.Tensor, count: int) -> list[list[Region]]:
        """The regions of each of the ``count`` pages of ``host_indices``; ``ValueError`` where
        the indices or the pool's answer do not match this geometry (a call never copies a
        byte then: a short or longer region would overrun a row or a page)."""
        if host_indices.numel() != count * self.tokens:
            raise ValueError(f"{host_indices.numel()} host slots for {count} pages of {self.tokens} tokens")
        if count == 0:
            return []
        addresses, sizes = pool.get_page_buffer_meta(host_indices)
        per_page = len(self.region_bytes)
        if len(addresses) != count * per_page:
            raise ValueError(f"{len(addresses)} regions for {count} pages of {per_page}")
        sizes = _sizes(sizes, len(addresses)) if isinstance(sizes, int) else [int(s) for s in sizes]
        if tuple(sizes) != self.region_bytes * count:
            raise ValueError(
                f"page regions of {sizes[:per_page]}... bytes, expected {list(self.region_bytes)}"
            )
        return [
            list(zip(addresses[i * per_page : (i + 1) * per_page], self.region_bytes, strict=True))
            for i in range(count)
        ]


def gather(regions: Sequence[Region], row_address: int) -> None:
    """Copy a page's regions, end to end, into the row at ``row_address``."""
    offset = 0
    for address, size in regions:
        ctypes.memmove(row_address + offset, address, size)
        offset += size


def scatter(row_address: int, regions: Sequence[Region]) -> None:
    """Copy the row at ``row_address`` back into a page's regions."""
    offset = 0
    for address, size in regions:
        ctypes.memmove(address, row_address + offset, size)
        offset += size


def _sizes(size: int, count: int) -> list[int]:
    return [int(size)] * count
