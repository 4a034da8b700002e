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
import threading
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
    # The V half's order where it is not K's (kv == 2): vLLM's CPU attention keeps a head's
    # K dim-major ([head_dim, tokens]: HND with one "head" per dim) and its V token-major.
    v_order: str | None = None

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"row order must be one of {ORDERS}, got {self.order!r}")
        if self.v_order is not None and (self.v_order not in ORDERS or self.kv != 2):
            raise ValueError(f"v_order {self.v_order!r} needs kv = 2 and one of {ORDERS}")
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
        if self.v_order is not None:
            raise ValueError("K and V halves in other orders have no one token view: use half_granules")
        words = self.head_bytes // row.element_size()
        b, layers, kv, t, h = self.blocks_per_row, self.layers, self.kv, self.block_tokens, self.heads
        if self.order == NHD:
            return row.view(b, layers, kv, t, h, words).permute(1, 2, 0, 3, 4, 5)
        return row.view(b, layers, kv, h, t, words).permute(1, 2, 0, 4, 3, 5)

    def half_granules(self, row: torch.Tensor, index: int, tokens: int) -> list[torch.Tensor]:
        """``granule`` one K/V half at a time (each in its own order): ``kv`` views of
        ``[layers, tokens, heads, words]``."""
        words = self.head_bytes // row.element_size()
        b, layers, kv, t, h = self.blocks_per_row, self.layers, self.kv, self.block_tokens, self.heads
        block, start = divmod(index * tokens, t)
        halves = []
        for half in range(kv):
            order = self.v_order if half == 1 and self.v_order is not None else self.order
            if order == NHD:
                view = row.view(b, layers, kv, t, h, words)[block, :, half]
            else:
                view = row.view(b, layers, kv, h, t, words)[block, :, half].transpose(1, 2)
            halves.append(view[:, start : start + tokens])
        return halves

    def granule(self, row: torch.Tensor, index: int, tokens: int) -> torch.Tensor:
        """Tokens ``[index * tokens, (index + 1) * tokens)`` of a flat row, as a
        ``[layers, kv, tokens, heads, words]`` view (``tokens`` divides the block size)."""
        view = self.token_view(row)  # [layers, kv, blocks, block_tokens, heads, words]
        per_block = self.block_tokens // tokens
        block, start = divmod(index, per_block)
        return view[:, :, block, start * tokens : (start + 1) * tokens]


@dataclass(frozen=True)
class RowLayout:
    """The row layouts of every KV group of an engine, with the dtype of its caches."""

    groups: tuple[GroupRowLayout, ...]
    dtype: str

    def layout_id(self) -> bytes:
        """16 bytes naming this exact layout (the ``layout id`` of a row header)."""
        groups = [
            {k: v for k, v in asdict(g).items() if k != "v_order" or v is not None} for g in self.groups
        ]
        text = json.dumps({"v": 1, "dtype": self.dtype, "groups": groups})
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


def convert_row(
    row: torch.Tensor, source: GroupRowLayout, target: GroupRowLayout, scratch: torch.Tensor | None = None
) -> None:
    """Rewrite ``row`` (1-d uint8, a host row, on any device) from ``source`` layout into
    ``target``, in place. Raises ``ValueError`` if the layouts hold different content.
    ``scratch``: a uint8 buffer of at least the row's size on its device, to reuse (a fresh
    8 MiB buffer per row costs its page faults every time).

    Two passes: a plain copy of the row, so the rewrite never reads what it has written,
    then the rewrite (``convert_into``), one granule of ``min(block tokens)`` tokens at a
    time (for every layer and K/V half at once). Copying granule by granule keeps each
    copy's inner dimension a run of whole heads (or whole tokens); one permuted copy of the
    whole row ran up to 2x slower on CPU (measured here), torch's copy kernel then walking
    the row in an unlucky order.
    """
    if source.logical() != target.logical():
        raise ValueError(f"rows of {source} cannot become rows of {target}: another shape")
    if row.numel() != source.row_bytes:
        raise ValueError(f"a row of {row.numel()} B is not a {source.row_bytes} B row of {source}")
    if source == target:
        return
    if scratch is None or scratch.numel() < row.numel() or scratch.device != row.device:
        staged = row.clone()
    else:
        staged = scratch[: row.numel()]
        staged.copy_(row)
    convert_into(staged, row, source, target)


def convert_into(
    src: torch.Tensor, dst: torch.Tensor, source: GroupRowLayout, target: GroupRowLayout
) -> None:
    """Write the row ``src`` (``source`` layout) into ``dst`` in ``target`` layout: one pass.

    ``src`` and ``dst`` are flat uint8 rows of one device that must not overlap. On a GPU,
    where every copy is a kernel launch, the whole row moves in one strided copy when one
    block size divides the other (``_aligned_views``); on CPU, granule by granule (see
    ``convert_row``)."""
    word = _word_dtype(source.head_bytes, src)
    if _word_dtype(source.head_bytes, dst) != word:
        word = torch.uint8
    src_words, dst_words = src.view(word), dst.view(word)
    granule = min(source.block_tokens, target.block_tokens)
    if source.v_order is not None or target.v_order is not None:  # K and V in other orders
        for index in range(source.row_tokens // granule):
            pairs = zip(
                target.half_granules(dst_words, index, granule),
                source.half_granules(src_words, index, granule),
                strict=True,
            )
            for dst_half, src_half in pairs:
                dst_half.copy_(src_half)
        return
    if src.is_cuda:
        views = _aligned_views(src_words, dst_words, source, target)
        if views is not None:
            views[1].copy_(views[0])
            return
    for index in range(source.row_tokens // granule):
        target.granule(dst_words, index, granule).copy_(source.granule(src_words, index, granule))


def _aligned_views(
    src: torch.Tensor, dst: torch.Tensor, source: GroupRowLayout, target: GroupRowLayout
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both rows as ``[layers, kv, coarse blocks, fine blocks per coarse, fine tokens, heads,
    words]`` views, the same index naming the same value in each, so one ``copy_`` converts;
    ``None`` when neither block size divides the other."""
    fine, coarse = sorted((source.block_tokens, target.block_tokens))
    if coarse % fine:
        return None

    def split(row: torch.Tensor, layout: GroupRowLayout) -> torch.Tensor:
        view = layout.token_view(row)  # [layers, kv, blocks, block tokens, heads, words]
        if layout.block_tokens == fine:  # its blocks, grouped by the coarse layout's blocks
            return view.unflatten(2, (-1, coarse // fine))
        return view.unflatten(3, (-1, fine))  # its block's tokens, cut into fine blocks

    return split(src, source), split(dst, target)


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
        self._scratch = threading.local()  # per converting thread: a reused staging row

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
        target = self.own.groups[group]
        scratch = getattr(self._scratch, "row", None)
        if scratch is None or scratch.numel() < target.row_bytes:
            scratch = self._scratch.row = torch.empty(target.row_bytes, dtype=torch.uint8)
        convert_row(torch.frombuffer(row, dtype=torch.uint8), source, target, scratch)
        self.converted += 1
        return True
