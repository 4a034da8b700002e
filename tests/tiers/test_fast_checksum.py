"""``checksum_at`` (xxh3 by address, the widest vector unit the CPU has) is ``row_format.checksum``."""

import numpy as np
import pytest

from tiers import fast_checksum
from tiers.row_format import checksum


@pytest.mark.parametrize("size", [0, 1, 63, 240, 241, 1023, 1024, 4097, (2 << 20) + 13])
@pytest.mark.parametrize("offset", [0, 1, 61])
def test_checksum_at_matches_row_format(size, offset):
    data = np.random.default_rng(size).integers(0, 256, size + 64, dtype=np.uint8)
    view = memoryview(data)[offset : offset + size]
    assert fast_checksum.checksum_at(view, data.ctypes.data + offset) == checksum(view)


def test_checksum_at_uses_the_c_function_without_the_gil():
    assert fast_checksum._XXH3 is not None  # the wheel exports the xxHash C API
    assert fast_checksum._XXH3.__name__ in {"XXH3_64bits_dispatch", "XXH3_64bits"}
