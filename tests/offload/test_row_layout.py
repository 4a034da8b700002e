"""Row layouts: what canonicalize reads from each engine layout, and byte-exact conversion."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bench.engine_layouts import EngineLayout
from offload.layout import canonicalize
from offload.row_layout import HND, NHD, GroupRowLayout, RowConverter, RowLayout, convert_row
from tests.offload.kv_engines import ENGINES, blocks_per_key, engine, logical_kv
from tests.offload.layouts import hybrid


def stored_row(spec: EngineLayout, logical: torch.Tensor) -> tuple[bytes, GroupRowLayout]:
    """The first row (``ROW_TOKENS`` tokens) ``spec``'s engine would store, and its layout."""
    kv, groups = spec.make(2 * blocks_per_key(spec) + 3)
    ids = list(range(3, 3 + 2 * blocks_per_key(spec)))
    spec.fill(kv, logical, ids)
    filled = logical[:, :, : len(ids) * spec.block_tokens]
    assert torch.equal(spec.read(kv, ids).view(torch.int16), filled.view(torch.int16))
    caches = canonicalize(kv, groups, block_size=spec.block_tokens, kv_layout=spec.kv_layout)
    assert caches.row_layout is not None, spec.name
    row = b"".join(caches.read_row(0, block) for block in ids[: blocks_per_key(spec)])
    return row, replace(caches.row_layout.groups[0], blocks_per_row=blocks_per_key(spec))


def test_canonicalize_reads_order_and_block_size_from_each_layout():
    orders = {}
    for spec in ENGINES:
        kv, groups = spec.make(4)
        layout = canonicalize(kv, groups, block_size=spec.block_tokens, kv_layout=spec.kv_layout).row_layout
        assert layout is not None and layout.dtype == "float16"
        (group,) = layout.groups
        assert (group.layers, group.kv, group.heads, group.head_bytes) == (2, 2, 2, 16)
        assert group.block_tokens == spec.block_tokens
        orders[spec.name] = group.order
    assert orders["nhd-64"] == orders["packed-16"] == orders["kv-apart-16"] == NHD
    assert orders["hnd-64"] == orders["hnd-strides-16"] == orders["packed-hnd-16"] == HND


@pytest.mark.parametrize("source", ENGINES, ids=lambda s: s.name)
def test_a_row_converts_byte_exact_into_every_other_layout(source):
    logical = logical_kv(7, 2)
    row, layout = stored_row(source, logical)
    for target in ENGINES:
        expected, target_layout = stored_row(target, logical)
        converted = torch.frombuffer(bytearray(row), dtype=torch.uint8)
        convert_row(converted, layout, target_layout)
        assert bytes(converted.numpy()) == expected, f"{source.name} -> {target.name}"


def test_rows_of_another_shape_do_not_convert():
    row, layout = stored_row(engine("nhd", 64), logical_kv(1, 2))
    other = replace(layout, heads=4)
    with pytest.raises(ValueError, match="another shape"):
        convert_row(torch.frombuffer(bytearray(row), dtype=torch.uint8), layout, other)
    with pytest.raises(ValueError, match="is not a"):
        convert_row(torch.zeros(10, dtype=torch.uint8), layout, layout)


def test_variants_cover_orders_and_block_sizes_with_distinct_ids():
    own = RowLayout((GroupRowLayout(2, 2, 2, 16, 16, 4, NHD),), "float16")
    variants = own.variants()
    ids = {variant.layout_id() for variant in variants}
    assert len(ids) == len(variants) == 2 * 7  # 2 orders x block sizes 1, 2, 4, ..., 64
    assert own.layout_id() in ids
    assert {v.logical_description() for v in variants} == {own.logical_description()}
    assert RowConverter(own).readable_ids == ids


def test_a_converter_refuses_layouts_it_does_not_know():
    own = RowLayout((GroupRowLayout(2, 2, 2, 16, 64, 1, NHD),), "float16")
    converter = RowConverter(own)
    row = memoryview(bytearray(own.groups[0].row_bytes))
    assert converter.convert(0, row, own.layout_id())  # own layout: nothing to do
    assert not converter.convert(0, row, b"\x01" * 16)
    assert converter.converted == 0


def test_layers_of_mixed_shapes_or_shared_bytes_stay_opaque():
    kv, groups = hybrid()  # groups over shared tensors: each group's rows are still described
    layout = canonicalize(kv, groups, block_size=4).row_layout
    assert layout is not None and sum(group.layers for group in layout.groups) == 34
    shared = torch.zeros(4, 2, 16, 2, 8)
    twice = canonicalize({"a": shared, "b": shared}, [["a", "b"]], block_size=16)
    assert twice.row_layout is None  # two layers, one layer's bytes per row
    mixed = {"a": torch.zeros(4, 2, 16, 2, 8), "b": torch.zeros(4, 2, 16, 4, 8)}
    assert canonicalize(mixed, [["a", "b"]], block_size=16).row_layout is None
    wrong_block = {"a": torch.zeros(4, 2, 16, 2, 8)}
    assert canonicalize(wrong_block, [["a"]], block_size=32).row_layout is None


@pytest.mark.parametrize("path", ["cpu", "staged"])
def test_the_worker_converts_rows_of_another_layout_as_it_loads_them(path, monkeypatch):
    """One load mixing a row in our layout (a plain copy) and rows written by an HND
    engine with 64-token blocks, the last of them only in part (3 of its 4 blocks).

    ``staged``: the GPU's copies (device staging buffers, chunked and pipelined), here on
    CPU tensors, where the pipeline's steps run in order."""
    from functools import partial

    from offload.row_copy import RowCopier
    from offload.worker import OffloadingWorker
    from tiers.host import HostTier

    if path == "staged":
        monkeypatch.setattr(
            RowCopier,
            "tasks",
            lambda self, blocks, rows, *, store, parallelism=1: [
                partial(self._staged_copy, list(blocks), list(rows), store)
            ],
        )
        monkeypatch.setattr(
            RowCopier,
            "converting_loads",
            lambda self, loads, target: [partial(self._staged_converting_loads, list(loads), target)],
        )

    reader, writer = engine("packed", 16), engine("hnd", 64)
    logical = logical_kv(3, 4)
    own_row, own_layout = stored_row(reader, logical)
    if path == "staged":  # one row per staging buffer: the two foreign rows alternate buffers
        monkeypatch.setattr("offload.row_copy.STAGING_BYTES", 2 * own_layout.row_bytes)
    foreign = [stored_row(writer, logical[:, :, 64 * i :]) for i in (1, 2)]
    (foreign_row_1, writer_layout), (foreign_row_2, _) = foreign

    kv, groups = reader.make(12)
    caches = canonicalize(kv, groups, block_size=16)
    own = RowLayout((own_layout,), "float16")
    host = HostTier([own_layout.row_bytes], 4 * own_layout.row_bytes)
    worker = OffloadingWorker(caches, host, blocks_per_row=4, converter=RowConverter(own))
    for slot, row in ((0, own_row), (1, foreign_row_1), (2, foreign_row_2)):
        host.slabs[0][slot].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))
    writer_id = RowLayout((writer_layout,), "float16").layout_id()

    blocks = [11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]  # slots 0 and 1 whole, slot 2's first 3 blocks
    rows_of = [[None, writer_id, writer_id]]
    assert worker.submit_load(1, [blocks], [[0, 1, 2]], first_sub_rows=[0], row_layouts=rows_of)
    worker.wait([1])
    assert all(r.success for r in worker.get_finished())
    assert worker.rows_converted == 2
    got = reader.read(kv, blocks)
    assert torch.equal(got.view(torch.int16), logical[:, :, : 11 * 16].view(torch.int16))


def test_a_load_of_rows_in_an_unknown_layout_is_refused_before_anything_moves():
    from offload.worker import OffloadingWorker
    from tiers.host import HostTier

    reader = engine("nhd", 64)
    kv, groups = reader.make(4)
    caches = canonicalize(kv, groups, block_size=64)
    host = HostTier([caches.row_bytes(0)], 2 * caches.row_bytes(0))
    bare = OffloadingWorker(caches, host)
    with pytest.raises(ValueError, match="no converter"):
        bare.submit_load(1, [[0]], [[0]], row_layouts=[[b"\x02" * 16]])
    assert caches.row_layout is not None
    worker = OffloadingWorker(caches, host, converter=RowConverter(caches.row_layout))
    with pytest.raises(ValueError, match="cannot convert"):
        worker.submit_load(2, [[0]], [[0]], row_layouts=[[b"\x02" * 16]])
    assert worker.get_finished() == [] and bare.get_finished() == []


def test_the_one_copy_conversion_of_the_gpu_path_matches_the_granule_copies():
    """On CUDA, ``convert_into`` moves a row with one strided copy where one block size
    divides the other; it must write exactly what the granule-by-granule copies write."""
    from itertools import product

    from offload.row_layout import _aligned_views, convert_into

    layouts = [GroupRowLayout(2, 2, 3, 16, t, 64 // t, order) for order in (NHD, HND) for t in (1, 4, 16, 64)]
    for source, target in product(layouts, layouts):
        row = torch.randint(0, 256, (source.row_bytes,), dtype=torch.uint8)
        by_granules, by_one_copy = torch.zeros_like(row), torch.zeros_like(row)
        convert_into(row, by_granules, source, target)
        views = _aligned_views(row.view(torch.int64), by_one_copy.view(torch.int64), source, target)
        assert views is not None
        views[1].copy_(views[0])
        assert torch.equal(by_granules, by_one_copy), (source, target)
    assert _aligned_views(row, row.clone(), replace(layouts[0], block_tokens=3), layouts[1]) is None


def cpu_attention_row(k: torch.Tensor, v: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """A row as vLLM's CPU attention pages it: per block and (layer x head), K as
    ``[dims, tokens]`` then V as ``[tokens, dims]``; ``k``, ``v``: ``[planes, tokens, dims]``."""
    blocks = []
    for start in range(0, k.shape[1], block_tokens):
        part = slice(start, start + block_tokens)
        blocks.append(torch.stack([k[:, part].transpose(1, 2).flatten(1), v[:, part].flatten(1)], dim=1))
    return torch.stack(blocks).contiguous().view(torch.uint8).flatten()


def test_k_and_v_halves_in_other_orders_convert_between_block_sizes():
    """The CPU attention layout (K dim-major, V token-major): 64-token rows become rows of two
    32-token blocks, byte for byte what such an engine would have written."""
    generator = torch.Generator().manual_seed(5)
    planes, tokens, dims = 3, 64, 8
    k = torch.randint(-1000, 1000, (planes, tokens, dims), dtype=torch.int16, generator=generator)
    v = torch.randint(-1000, 1000, (planes, tokens, dims), dtype=torch.int16, generator=generator)
    large = GroupRowLayout(planes, 2, dims, 2, 64, 1, HND, v_order=NHD)
    small = replace(large, block_tokens=32, blocks_per_row=2)
    row = cpu_attention_row(k, v, 64)
    convert_row(row, large, small)
    assert torch.equal(row, cpu_attention_row(k, v, 32))
    assert not torch.equal(row, cpu_attention_row(k, v, 64)), "the conversion moved bytes"
    converter = RowConverter(RowLayout((small,), "bfloat16"))
    assert RowLayout((large,), "bfloat16").layout_id() in converter.readable_ids


def test_a_layout_without_v_order_keeps_its_layout_id():
    """Rows already on disk keep their ids: ``v_order`` is in the digest only where set."""
    layout = RowLayout((GroupRowLayout(2, 2, 2, 16, 16, 1, NHD),), "float16")
    assert layout.layout_id().hex() == "535d3894844aface23169f0935a582d0"  # before v_order existed
    with_v = RowLayout((replace(layout.groups[0], v_order=HND),), "float16")
    assert with_v.layout_id() != layout.layout_id()
