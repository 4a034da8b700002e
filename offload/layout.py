"""Canonical KV layout: per KV group, one block is one full row of bytes.

Engines keep KV caches in many shapes. ``canonicalize`` reduces all of them to one picture,
the shape of vLLM's ``CanonicalKVCaches``:

- ``tensors``: the unique physical allocations, each a ``(num_blocks, page_size_bytes)``
  uint8 view whose row ``b`` holds that allocation's bytes of block ``b``. An allocation is
  found once, by address, however many layers or groups point into it (hybrid models share
  tensors between their full-attention and sliding-window groups).
- ``group_data_refs``: per group, the ordered byte ranges (``CanonicalRef``) of those pages
  that make up one block of the group. Concatenated, they are the group's **row**.

How many refs a group has is the number of descriptors a block costs to move:

=====================================  ==========================================
engine layout                          refs per block
=====================================  ==========================================
per layer ``[blocks, 2, t, h, d]``     one per layer (K and V of a block adjoin)
per layer ``[2, blocks, t, h, d]``     two per layer (K and V are apart)
cross-layer ``[blocks, L, 2, t, h, d]``  one for the whole group (zero-copy row)
MLA ``[blocks, t, latent]``            one per layer
=====================================  ==========================================

Only addresses, strides and sizes decide the refs. Where every layer of a group has the
same shape, the meaning of a row's bytes is also described (``offload.row_layout``:
tokens, heads, NHD or HND, read from the strides), so rows convert between engines whose
physical layouts differ; the fingerprint covers the rest.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from offload.row_layout import HND, NHD, ORDERS, GroupRowLayout, RowLayout


@dataclass(frozen=True)
class CanonicalTensor:
    """One physical allocation as ``(num_blocks, page_size_bytes)`` uint8 rows (maybe row-strided)."""

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass(frozen=True)
class CanonicalRef:
    """Bytes ``[offset_bytes, offset_bytes + page_size_bytes)`` of every row of ``tensors[tensor_idx]``."""

    tensor_idx: int
    page_size_bytes: int
    offset_bytes: int = 0


@dataclass(frozen=True)
class CanonicalKVCaches:
    """The engine's KV caches seen as one full row per block per KV group."""

    tensors: list[CanonicalTensor]
    group_data_refs: list[list[CanonicalRef]]
    num_blocks: int
    block_size: int
    fingerprint: str
    row_layout: RowLayout | None = None
    """What each group's row means, where it can be described (see ``offload.row_layout``);
    ``None``: rows are opaque, shared only with the same fingerprint."""

    @property
    def num_groups(self) -> int:
        return len(self.group_data_refs)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].tensor.device

    def row_bytes(self, group: int) -> int:
        """Bytes of one block of ``group`` across all of its layers."""
        return sum(ref.page_size_bytes for ref in self.group_data_refs[group])

    def segments_per_block(self, group: int) -> int:
        """Descriptors one block of ``group`` costs to move (1 for a packed layout)."""
        return len(self.group_data_refs[group])

    def read_row(self, group: int, block: int) -> bytes:
        """A block's row as bytes (slow; for tests and debugging, not the data path)."""
        parts = []
        for ref in self.group_data_refs[group]:
            page = self.tensors[ref.tensor_idx].tensor[block]
            parts.append(
                page[ref.offset_bytes : ref.offset_bytes + ref.page_size_bytes].cpu().numpy().tobytes()
            )
        return b"".join(parts)


@dataclass(frozen=True)
class _Segment:
    """A layer's bytes of every block: address of block 0's bytes, row stride, length."""

    layer: str
    storage_ptr: int
    storage_nbytes: int
    offset: int  # from the start of the storage
    row_stride: int
    size: int
    block_shape: tuple[int, ...]  # of one block's K or V (or K and V together) bytes


def canonicalize(
    kv_caches: Mapping[str, torch.Tensor],
    groups: Sequence[Sequence[str]],
    *,
    num_blocks: int | None = None,
    block_size: int = 16,
    block_dims: Mapping[str, int] | None = None,
    kv_layout: str = NHD,
) -> CanonicalKVCaches:
    """Find each group's full row in ``kv_caches`` (layer name -> tensor).

    ``kv_layout`` names the last three dims of each layer's per-block shape: ``"NHD"``
    (tokens, heads, head dim, the default) or ``"HND"``. A cache whose strides permute
    those dims (vLLM's HND stride order over an NHD shape) is read as its memory order.

    ``num_blocks`` defaults to what the first layer's shape says (dim 0, or dim 1 for a
    ``[2, num_blocks, ...]`` tensor). The block dimension of a layer is 0, or 1 when dim 0 is
    the K/V pair; ``block_dims`` overrides it per layer where a shape is ambiguous (a cache
    of exactly two blocks). Layers that are views of one packed
    tensor (vLLM's cross-layer layout) collapse into one segment per block.

    Raises ``ValueError`` naming the layer for a layer missing from ``kv_caches``, a tensor in
    no group, a wrong number of blocks, a block that is not dense in memory, mixed devices,
    or two layers whose bytes partly overlap.
    """
    if not groups or any(not group for group in groups):
        raise ValueError(f"groups must be a non-empty list of non-empty layer lists, got {groups!r}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if kv_layout not in ORDERS:
        raise ValueError(f"kv_layout must be one of {ORDERS}, got {kv_layout!r}")
    grouped = [name for group in groups for name in group]
    for name in grouped:
        if name not in kv_caches:
            raise ValueError(f"layer {name!r} is in a group but has no KV cache tensor")
    ungrouped = sorted(set(kv_caches) - set(grouped))
    if ungrouped:
        raise ValueError(f"layers {ungrouped} have KV cache tensors but are in no group")
    if num_blocks is None:
        num_blocks = _guess_num_blocks(kv_caches[groups[0][0]])
    devices = {str(t.device) for t in kv_caches.values()}
    if len(devices) > 1:
        raise ValueError(f"KV cache tensors are on several devices: {sorted(devices)}")

    overrides = dict(block_dims or {})
    unknown = sorted(set(overrides) - set(kv_caches))
    if unknown:
        raise ValueError(f"block_dims names layers {unknown} that have no KV cache tensor")
    dims = {name: _block_dim(name, kv_caches[name], num_blocks, overrides.get(name)) for name in kv_caches}
    segments = {name: _layer_segments(name, kv_caches[name], dims[name]) for name in kv_caches}

    allocations = _find_allocations([seg for segs in segments.values() for seg in segs])
    # Number allocations by where the groups first reach them, not by address: stable across runs.
    first_use = {name: i for i, name in enumerate(dict.fromkeys(grouped))}
    allocations.sort(key=lambda alloc: min((first_use[seg.layer], seg.offset) for seg in alloc[1]))
    tensors = [
        CanonicalTensor(_page_view(kv_caches[members[0].layer], start, num_blocks, stride, span), span)
        for (start, stride, span), members in allocations
    ]
    where = {
        id(seg): (index, seg.offset - start)
        for index, ((start, _stride, _span), members) in enumerate(allocations)
        for seg in members
    }

    group_refs = []
    for group in groups:
        refs: list[CanonicalRef] = []
        seen: set[tuple[int, int]] = set()
        for name in group:
            for seg in segments[name]:
                tensor_idx, offset = where[id(seg)]
                if (tensor_idx, offset) in seen:  # the same bytes reached twice: count once
                    continue
                seen.add((tensor_idx, offset))
                last = refs[-1] if refs else None
                if (
                    last
                    and last.tensor_idx == tensor_idx
                    and last.offset_bytes + last.page_size_bytes == offset
                ):
                    refs[-1] = CanonicalRef(tensor_idx, last.page_size_bytes + seg.size, last.offset_bytes)
                else:
                    refs.append(CanonicalRef(tensor_idx, seg.size, offset))
        group_refs.append(refs)

    fingerprint = layout_fingerprint(kv_caches, groups, block_size, group_refs, segments, kv_layout)
    row_layout = _describe_rows(kv_caches, groups, group_refs, dims, block_size, kv_layout)
    return CanonicalKVCaches(tensors, group_refs, num_blocks, block_size, fingerprint, row_layout)


def _guess_num_blocks(tensor: torch.Tensor) -> int:
    """Blocks come first, unless dim 0 is a K/V pair (``[2, num_blocks, ...]``)."""
    if tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] != 2:
        return tensor.shape[1]
    return tensor.shape[0]


def _block_dim(name: str, tensor: torch.Tensor, num_blocks: int, block_dim: int | None) -> int:
    """The dim that counts blocks: 0, or 1 after a leading K/V pair (``[2, num_blocks, ...]``)."""
    if tensor.dim() < 2:
        raise ValueError(f"layer {name!r}: a KV cache needs at least 2 dims, got shape {tuple(tensor.shape)}")
    if block_dim is None:
        block_dim = 1 if tensor.shape[0] == 2 and tensor.shape[0] != num_blocks else 0
    if block_dim not in (0, 1):
        raise ValueError(f"layer {name!r}: the block dim must be 0 or 1, got {block_dim}")
    if block_dim == 1 and tensor.shape[0] != 2:
        raise ValueError(
            f"layer {name!r}: block dim 1 needs the K/V pair first, got shape {tuple(tensor.shape)}"
        )
    if tensor.shape[block_dim] != num_blocks:
        raise ValueError(
            f"layer {name!r}: dim {block_dim} of shape {tuple(tensor.shape)} has "
            f"{tensor.shape[block_dim]} blocks, expected {num_blocks}"
        )
    return block_dim


def _layer_segments(name: str, tensor: torch.Tensor, block_dim: int) -> list[_Segment]:
    """Split one layer into segments: dense bytes of one block, at a fixed row stride."""
    inner = tensor.select(block_dim, 0)
    if block_dim == 1:
        inner = inner[0]
    if not _is_dense(inner):
        raise ValueError(
            f"layer {name!r}: one block's bytes are not contiguous "
            f"(shape {tuple(tensor.shape)}, stride {tensor.stride()})"
        )
    elem = tensor.element_size()
    size = inner.numel() * elem
    row_stride = tensor.stride(block_dim) * elem
    if tensor.shape[block_dim] > 1 and row_stride < size:
        raise ValueError(
            f"layer {name!r}: blocks overlap in memory (row stride {row_stride} < block bytes {size})"
        )
    storage = tensor.untyped_storage()
    base = tensor.data_ptr() - storage.data_ptr()
    halves = [0] if block_dim == 0 else [0, tensor.stride(0) * elem]
    return [
        _Segment(
            name, storage.data_ptr(), storage.nbytes(), base + half, row_stride, size, tuple(inner.shape)
        )
        for half in halves
    ]


def _is_dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill one gap-free range of memory, in some order of the dims
    (a contiguous tensor, or one whose strides permute its dims)."""
    expected = 1
    for stride, size in sorted(
        (st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz > 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _layer_row_shape(
    tensor: torch.Tensor, block_dim: int, block_size: int, kv_layout: str
) -> tuple[int, int, int, str] | None:
    """``(kv, heads, head_bytes, order)`` of one layer's block, or ``None`` if not describable."""
    inner = tensor.select(block_dim, 0)
    kv = 1
    if block_dim == 1:
        kv, inner = 2, inner[0]
    elif inner.dim() == 4 and inner.shape[0] == 2:
        if inner.stride(0) != inner[0].numel():  # K and V interleaved inside a block
            return None
        kv, inner = 2, inner[0]
    if inner.dim() == 2:
        names: tuple[str, ...] = ("T", "D")
    elif inner.dim() == 3:
        names = ("T", "H", "D") if kv_layout == NHD else ("H", "T", "D")
    else:
        return None
    size = dict(zip(names, inner.shape, strict=True))
    stride = dict(zip(names, inner.stride(), strict=True))
    if size["T"] != block_size or (size["D"] > 1 and stride["D"] != 1):
        return None
    heads = size.get("H", 1)
    token_major = heads == 1 or block_size == 1 or stride["T"] > stride["H"]
    return kv, heads, size["D"] * tensor.element_size(), NHD if token_major else HND


def _describe_rows(
    kv_caches: Mapping[str, torch.Tensor],
    groups: Sequence[Sequence[str]],
    group_refs: Sequence[Sequence[CanonicalRef]],
    block_dims: Mapping[str, int],
    block_size: int,
    kv_layout: str,
) -> RowLayout | None:
    """The ``RowLayout`` of the rows, if every group's layers share one describable shape."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in kv_caches.values()}
    if len(dtypes) != 1:
        return None
    layouts = []
    for group, refs in zip(groups, group_refs, strict=True):
        shapes = {_layer_row_shape(kv_caches[n], block_dims[n], block_size, kv_layout) for n in group}
        if len(shapes) != 1 or None in shapes:
            return None
        ((kv, heads, head_bytes, order),) = shapes  # type: ignore[misc]
        layout = GroupRowLayout(len(group), kv, heads, head_bytes, block_size, 1, order)
        if layout.row_bytes != sum(ref.page_size_bytes for ref in refs):  # layers sharing bytes
            return None
        layouts.append(layout)
    return RowLayout(tuple(layouts), dtypes.pop())


def _find_allocations(
    segments: list[_Segment],
) -> list[tuple[tuple[int, int, int], list[_Segment]]]:
    """Cluster segments into row-strided allocations: ``((start, row_stride, span), members)``.

    Segments of one storage with one row stride whose block-0 bytes fall within one row
    belong to one allocation (the layers of a packed tensor); segments a whole number of
    rows apart do not (K and V halves of a ``[2, blocks, ...]`` tensor).
    """
    by_storage: dict[tuple[int, int], list[_Segment]] = {}
    for seg in segments:
        by_storage.setdefault((seg.storage_ptr, seg.row_stride), []).append(seg)
    allocations = []
    for (_ptr, stride), members in sorted(by_storage.items()):
        members.sort(key=lambda s: (s.offset, s.size))
        cluster: list[_Segment] = []
        for seg in members:
            if cluster and seg.offset >= cluster[0].offset + stride:
                allocations.append(_close_cluster(cluster, stride))
                cluster = []
            cluster.append(seg)
        allocations.append(_close_cluster(cluster, stride))
    return allocations


def _close_cluster(cluster: list[_Segment], stride: int) -> tuple[tuple[int, int, int], list[_Segment]]:
    start = cluster[0].offset
    end = start
    previous: _Segment | None = None
    for seg in cluster:
        same = previous is not None and (previous.offset, previous.size) == (seg.offset, seg.size)
        if previous is not None and not same and seg.offset < previous.offset + previous.size:
            raise ValueError(f"layers {previous.layer!r} and {seg.layer!r} partly overlap in memory")
        end = max(end, seg.offset + seg.size)
        previous = seg
    span = end - start
    if span > stride and len(cluster) > 1:
        raise ValueError(f"layer {cluster[-1].layer!r} crosses into the next block's row")
    return (start, stride, span), cluster


def _page_view(like: torch.Tensor, start: int, num_blocks: int, stride: int, span: int) -> torch.Tensor:
    """``(num_blocks, span)`` uint8 rows ``stride`` bytes apart, starting ``start`` bytes into the storage."""
    storage_bytes = torch.empty(0, dtype=torch.uint8, device=like.device).set_(like.untyped_storage())
    needed = start + (num_blocks - 1) * stride + span
    if needed > storage_bytes.numel():
        raise ValueError(f"layer {like!r:.40}: its blocks run past the end of the allocation")
    return storage_bytes.as_strided((num_blocks, span), (stride, 1), start)


def layout_fingerprint(
    kv_caches: Mapping[str, torch.Tensor],
    groups: Sequence[Sequence[str]],
    block_size: int,
    group_refs: Sequence[Sequence[CanonicalRef]],
    segments: Mapping[str, Sequence[_Segment]],
    kv_layout: str = NHD,
) -> str:
    """A stable digest of what a stored row's bytes mean.

    It covers each layer's dtype, the shape of one block, its segments, the block size,
    group membership and the byte ranges that make each row; not the number of device
    blocks nor any address, so two engines with the same layout and different cache sizes
    (or two runs of one engine) share rows.
    """
    description = {
        "block_size": block_size,
        "kv_layout": kv_layout,
        "groups": [
            {
                "layers": [
                    {
                        "name": name,
                        "dtype": str(kv_caches[name].dtype).removeprefix("torch."),
                        "block_shape": list(segments[name][0].block_shape),
                        "segments": len(segments[name]),
                    }
                    for name in group
                ],
                "row": [[ref.offset_bytes, ref.page_size_bytes] for ref in refs],
            }
            for group, refs in zip(groups, group_refs, strict=True)
        ],
    }
    digest = hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16)
    return digest.hexdigest()


def widest_int_dtype(*byte_counts: int) -> torch.dtype:
    """The widest integer dtype whose size divides every count: index kernels move bytes in such words."""
    g = 0
    for count in byte_counts:
        g = math.gcd(g, count)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if g % dtype.itemsize == 0:
            return dtype
    return torch.uint8
