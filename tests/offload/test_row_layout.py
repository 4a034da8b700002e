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
    assert torch.equal(spec.read(kv, ids).view(torch.int16), logical.view(torch.int16))
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
