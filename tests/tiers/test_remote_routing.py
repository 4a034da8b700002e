"""How a remote tier cuts one call into requests (``tiers/remote/routing.py``)."""

from __future__ import annotations

from tiers.remote.routing import batches_by_bytes


def test_requests_stay_within_their_byte_bound_and_take_one_row_at_least():
    sizes = [3, 3, 3, 10, 1, 1]
    parts = batches_by_bytes(list(range(6)), sizes, max_bytes=6, max_keys=100)
    assert parts == [[0, 1], [2], [3], [4, 5]]  # the 10-byte row goes alone: one row at least
    assert all(sum(sizes[i] for i in part) <= 6 for part in parts if len(part) > 1)


def test_requests_stay_within_their_key_bound():
    assert batches_by_bytes(list(range(5)), [1] * 5, max_bytes=100, max_keys=2) == [[0, 1], [2, 3], [4]]
