"""What the bytes of a stored row mean, so that an engine with another layout can use them.

Two engines that run the same model compute the same keys and values, but rarely keep them
in the same physical order: one is NHD (``[tokens, heads, head_dim]`` per K or V half),
another HND; one has 16-token blocks, another 64; one packs layers together, another keeps
a tensor per layer, with K and V side by side or apart. A canonical row (``offload.layout``)
concatenates a block's segments in layer order, K before V, so packing and K/V placement do
not change a row's bytes; what does is the order *inside* each half and how many device
blocks (of how many tokens) make one row. A row of one group is therefore, in bytes::

    [blocks_per_row, layers, kv, block_tokens, heads, head_bytes]   (NHD)
    [blocks_per_row, layers, kv, heads, block_tokens, head_bytes]   (HND)

``GroupRowLayout`` records those numbers. Rows with the same *logical* content (layers,
kv, heads, head bytes, tokens per row, dtype) convert into each other with one permuted
copy; that is what lets a row written by one engine be served, byte-exact in its own
layout, to another. Layers of other shapes (mixed head counts in a group, a layer whose
bytes are shared with another group only in part) have no ``RowLayout``: their rows are
opaque and served only to the same layout.

A row's 16-byte layout id (in its header, ``tiers.row_format``) is a digest of its
``RowLayout``; a reader recognises a foreign id by digesting every layout its own rows
convert from (``RowLayout.variants``), so no registry of layouts is needed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

import torch

NHD = "NHD"
HND = "HND"
ORDERS = (NHD, HND)


@dataclass(frozen=True)
class GroupRowLayout:
    """The shape of one KV group's row (see the module doc)."""

    layers: int
    kv: int  # 2 for K and V halves, 1 for a single latent (MLA)
    heads: int
    head_bytes: int  # head_dim * element size: never permuted
    block_tokens: int
    blocks_per_row: int
    order: str  # NHD or HND

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"row order must be one of {ORDERS}, got {self.order!r}")
        if min(self.layers, self.kv, self.heads, self.head_bytes, self.block_tokens, self.blocks_per_row) < 1:
            raise ValueError(f"every dimension of a row layout must be positive: {self}")

    @property
    def row_tokens(self) -> int:
        return self.block_tokens * self.blocks_per_row

    @property
    def row_bytes(self) -> int:
        return self.layers * self.kv * self.row_tokens * self.heads * self.head_bytes

    def logical(self) -> tuple[int, int, int, int, int]:
        """What two layouts must share to convert: ``(layers, kv, heads, head_bytes, row_tokens)``."""
        return (self.layers, self.kv, self.heads, self.head_bytes, self.row_tokens)

    def token_view(self, row: torch.Tensor) -> torch.Tensor:
        """A flat row of this layout as ``[layers, kv, blocks, tokens, heads, words]`` (a view).

        ``row`` is 1-d of any element type whose size divides ``head_bytes``; the last dim
        counts those elements.
        """
        words = self.head_bytes // row.element_size()
        b, layers, kv, t, h = self.blocks_per_row, self.layers, self.kv, self.block_tokens, self.heads
        if self.order == NHD:
            return row.view(b, layers, kv, t, h, words).permute(1, 2, 0, 3, 4, 5)
        return row.view(b, layers, kv, h, t, words).permute(1, 2, 0, 4, 3, 5)


@dataclass(frozen=True)
class RowLayout:
    """The row layouts of every KV group of an engine, with the dtype of its caches."""

    groups: tuple[GroupRowLayout, ...]
    dtype: str

    def layout_id(self) -> bytes:
        """16 bytes naming this exact layout (the ``layout id`` of a row header)."""
        text = json.dumps({"v": 1, "dtype": self.dtype, "groups": [asdict(g) for g in self.groups]})
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def logical_description(self) -> str:
        """What must match between two engines for rows to convert (for the namespace)."""
        return json.dumps({"dtype": self.dtype, "groups": [g.logical() for g in self.groups]})

    def variants(self) -> list[RowLayout]:
        """Every layout whose rows convert into this one's: the same logical content, each
        order, and each block size that divides the row (every group the same way)."""
        row_tokens = {g.row_tokens for g in self.groups}
        if len(row_tokens) != 1:
            return [self]
        (tokens,) = row_tokens
        found = []
        for order in ORDERS:
            for block_tokens in (t for t in range(1, tokens + 1) if tokens % t == 0):
                groups = tuple(
                    replace(g, order=order, block_tokens=block_tokens, blocks_per_row=tokens // block_tokens)
                    for g in self.groups
                )
                found.append(RowLayout(groups, self.dtype))
        return found


def convert_row(row: torch.Tensor, source: GroupRowLayout, target: GroupRowLayout) -> None:
    """Rewrite ``row`` (1-d uint8, a host row) from ``source`` layout into ``target``, in place.

    Two passes: the row is read once into a token-ordered copy, then written back in the
    target order. Raises ``ValueError`` if the layouts hold different content.
    """
    if source.logical() != target.logical():
        raise ValueError(f"rows of {source} cannot become rows of {target}: another shape")
    if row.numel() != source.row_bytes:
        raise ValueError(f"a row of {row.numel()} B is not a {source.row_bytes} B row of {source}")
    if source == target:
        return
    words = row.view(_word_dtype(source.head_bytes, row))
    layers, kv, heads, _, tokens = source.logical()
    as_tokens = source.token_view(words)
    ordered = torch.empty(as_tokens.shape, dtype=as_tokens.dtype, device=row.device)  # never aliases the row
    ordered.copy_(as_tokens)
    target.token_view(words).copy_(
        ordered.view(layers, kv, tokens, heads, -1).view(
            layers, kv, target.blocks_per_row, target.block_tokens, heads, -1
        )
    )


def _word_dtype(head_bytes: int, row: torch.Tensor) -> torch.dtype:
    """The widest integer type that divides a head's bytes and the row's alignment."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if head_bytes % dtype.itemsize == 0 and row.data_ptr() % dtype.itemsize == 0:
            return dtype
    return torch.uint8


class RowConverter:
    """Rewrites rows that landed in another engine's layout into this engine's, by layout id.

    Built from this engine's ``RowLayout``; ``readable_ids`` are the layout ids a lower
    tier may serve to it (its own and every variant it converts from).
    """

    def __init__(self, own: RowLayout) -> None:
        self.own = own
        self.own_id = own.layout_id()
        self._sources = {variant.layout_id(): variant for variant in own.variants()}
        self.converted = 0  # rows rewritten so far

    @property
    def readable_ids(self) -> frozenset[bytes]:
        return frozenset(self._sources)

    def source(self, group: int, layout_id: bytes) -> GroupRowLayout | None:
        """The layout of ``group``'s rows written under ``layout_id``, if we convert from it."""
        variant = self._sources.get(layout_id)
        if variant is None or not 0 <= group < len(variant.groups):
            return None
        return variant.groups[group]

    def convert(self, group: int, row: memoryview, layout_id: bytes | None) -> bool:
        """Make ``row`` (a host row of ``group`` in layout ``layout_id``) a row of our layout.

        ``None`` or our own id: nothing to do. ``False`` for a layout not convertible here
        (the caller treats the row as a miss).
        """
        if layout_id is None or layout_id == self.own_id:
            return True
        source = self.source(group, layout_id)
        if source is None:
            return False
        convert_row(torch.frombuffer(row, dtype=torch.uint8), source, self.own.groups[group])
        self.converted += 1
        return True
