import pytest
import torch

from offload.layout import canonicalize
from tests.offload.layouts import (
    LAYOUTS,
    NUM_BLOCKS,
    hybrid,
    packed_tensor,
    packed_views,
    per_layer_blocks_first,
)

EXPECTED_SEGMENTS = {
    "per_layer_blocks_first": [3],
    "per_layer_kv_first": [6],
    "packed_views": [1],
    "packed_tensor": [1],
    "mla": [3],
    "hybrid": [5, 5, 5, 5, 5, 5, 4],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_segments_per_block(name):
    kv, groups = LAYOUTS[name]()
    caches = canonicalize(kv, groups)
    assert [caches.segments_per_block(g) for g in range(caches.num_groups)] == EXPECTED_SEGMENTS[name]
    assert caches.num_blocks == NUM_BLOCKS
    for canonical in caches.tensors:
        assert canonical.tensor.dtype == torch.uint8
        assert tuple(canonical.tensor.shape) == (NUM_BLOCKS, canonical.page_size_bytes)


@pytest.mark.parametrize("name", LAYOUTS)
def test_row_is_every_byte_of_the_block_once(name):
    kv, groups = LAYOUTS[name]()
    caches = canonicalize(kv, groups)
    for g, group in enumerate(groups):
        storages = {kv[layer].untyped_storage().data_ptr(): kv[layer].untyped_storage() for layer in group}
        expected = sum(storage.nbytes() for storage in storages.values()) // NUM_BLOCKS
        assert caches.row_bytes(g) == expected


def test_packed_views_are_zero_copy_rows():
    kv, groups = packed_views()
    caches = canonicalize(kv, groups)
    (canonical,) = caches.tensors
    packed_base = kv["layer.0"].untyped_storage().data_ptr()
    assert canonical.tensor.data_ptr() == packed_base
    block_5 = torch.stack([kv[name][5] for name in groups[0]])
    assert caches.read_row(0, 5) == block_5.view(torch.uint8).numpy().tobytes()


def test_hybrid_counts_each_allocation_once():
    kv, groups = hybrid()
    caches = canonicalize(kv, groups)
    assert len(kv) == 34
    assert len(caches.tensors) == 5
    used = {ref.tensor_idx for refs in caches.group_data_refs for ref in refs}
    assert used == set(range(5))


def test_kv_first_splits_k_and_v():
    kv = {"l": torch.arange(2 * NUM_BLOCKS * 8, dtype=torch.int32).view(2, NUM_BLOCKS, 8)}
    caches = canonicalize(kv, [["l"]])
    row = torch.frombuffer(bytearray(caches.read_row(0, 3)), dtype=torch.int32)
    assert row.tolist() == kv["l"][0, 3].tolist() + kv["l"][1, 3].tolist()


def test_fingerprint_is_stable_and_ignores_addresses_and_cache_size():
    kv_a, groups = per_layer_blocks_first()
    kv_b = {name: torch.zeros(NUM_BLOCKS * 2, *t.shape[1:], dtype=t.dtype) for name, t in kv_a.items()}
    assert canonicalize(kv_a, groups).fingerprint == canonicalize(kv_b, groups).fingerprint


def test_fingerprint_changes_with_what_the_bytes_mean():
    kv, groups = per_layer_blocks_first()
    base = canonicalize(kv, groups).fingerprint
    assert canonicalize(kv, groups, block_size=32).fingerprint != base
    as_half = {name: t.view(torch.float16) for name, t in kv.items()}
    assert canonicalize(as_half, groups).fingerprint != base
    assert canonicalize(kv, [list(reversed(groups[0]))]).fingerprint != base
    assert canonicalize(kv, [groups[0][:1], groups[0][1:]]).fingerprint != base
    packed, packed_groups = packed_views()
    assert canonicalize(packed, packed_groups).fingerprint != canonicalize(*packed_tensor()).fingerprint


def test_explicit_block_dims_resolve_a_two_block_cache():
    kv = {"l": torch.zeros(2, 2, 4, 8)}
    assert canonicalize(kv, [["l"]]).segments_per_block(0) == 1
    assert canonicalize(kv, [["l"]], block_dims={"l": 1}).segments_per_block(0) == 2


@pytest.mark.parametrize(
    ("kv", "groups", "kwargs", "message"),
    [
        ({"a": torch.zeros(4, 2, 8)}, [["a", "b"]], {}, "layer 'b' is in a group but has no KV cache tensor"),
        ({"a": torch.zeros(4, 8), "b": torch.zeros(4, 8)}, [["a"]], {}, r"layers \['b'\] .* in no group"),
        (
            {"a": torch.zeros(4, 8), "b": torch.zeros(5, 8)},
            [["a", "b"]],
            {},
            "layer 'b'.*5 blocks, expected 4",
        ),
        ({"a": torch.zeros(8, 4).t()}, [["a"]], {}, "layer 'a': one block's bytes are not contiguous"),
        ({"a": torch.zeros(4, 8)}, [["a"]], {"block_dims": {"zz": 0}}, "block_dims names layers"),
        (
            {"a": torch.zeros(4, 8)},
            [["a"]],
            {"block_dims": {"a": 2}},
            "layer 'a': the block dim must be 0 or 1",
        ),
        ({"a": torch.zeros(4)}, [["a"]], {}, "layer 'a': a KV cache needs at least 2 dims"),
        ({"a": torch.zeros(4, 8)}, [], {}, "groups must be a non-empty list"),
        ({"a": torch.zeros(4, 8)}, [["a"]], {"block_size": 0}, "block_size must be positive"),
    ],
)
def test_bad_layouts_name_the_layer(kv, groups, kwargs, message):
    with pytest.raises(ValueError, match=message):
        canonicalize(kv, groups, **kwargs)


def test_partly_overlapping_layers_are_rejected():
    base = torch.zeros(4, 16)
    kv = {"a": base[:, 0:8], "b": base[:, 4:12]}
    with pytest.raises(ValueError, match="partly overlap"):
        canonicalize(kv, [["a", "b"]])
