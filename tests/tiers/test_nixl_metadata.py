"""The shape check a client's NIXL metadata passes at the peer before NIXL sees it (no NIXL
here: the blobs are built in NIXL 1.5's serialization, as ``get_agent_metadata`` writes it)."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.remote.nixl_metadata import MetadataError, check_client_metadata, parse_agent_metadata

NAME = "kvtier-remote-4242-" + "ab" * 4
POOL = 0x7F0000000000
PROBE = POOL + (1 << 20) - 64


def field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value + b"|"


def blob(
    name: str = NAME,
    regions: list[tuple[int, int, int]] | None = None,
    memory_type: bytes = bytes(4),
    backend: bytes = b"UCX",
) -> bytes:
    """Metadata as NIXL writes it: agent, one backend's connection info, one memory section."""
    regions = [(POOL, 1 << 20, 0)] if regions is None else regions
    out = b"nixlSerDes|" + field(b"Agent", name.encode()) + field(b"Conns", struct.pack("<Q", 1))
    out += field(b"t", backend) + field(b"c", bytes(range(200)))
    out += field(b"", b"MemSection") + field(b"nixlSecElms", struct.pack("<Q", 1))
    out += field(b"bknd", backend) + field(b"nixlDList", b"nixlSDList") + field(b"t", memory_type)
    out += field(b"n", struct.pack("<Q", len(regions)))
    for addr, length, device in regions:
        out += field(b"", struct.pack("<QQQ", addr, length, device) + b"\x01" + bytes(9) + b"\xff")
    return out


def test_a_well_formed_blob_parses():
    md = parse_agent_metadata(blob())
    assert (md.name, md.backends, md.regions) == (NAME, ("UCX",), ((POOL, 1 << 20, 0),))
    assert check_client_metadata(blob(), PROBE, 32).name == NAME


@pytest.mark.parametrize(
    "data, why",
    [
        (blob(name="kvtier-peer-someone-else"), "not a kvtier client"),
        (blob(memory_type=b"\x01\x00\x00\x00"), "host memory"),
        (blob(backend=b"GDS"), "no UCX"),
        (blob(regions=[(POOL, 1 << 19, 0)]), "probe"),  # ends before the probe bytes
        (blob(regions=[(PROBE + 8, 1 << 20, 0)]), "probe"),  # starts inside them
        (blob(regions=[(POOL, 1 << 20, 3)]), "probe"),  # a device, not host memory
        (blob(regions=[]), "no memory"),
    ],
)
def test_metadata_that_does_not_hold_the_announced_probe_is_refused(data, why):
    with pytest.raises(MetadataError, match=why):
        check_client_metadata(data, PROBE, 32)


def test_lengths_and_counts_are_bounded_before_use():
    good = blob()
    at = good.index(b"Agent") + 5
    with pytest.raises(MetadataError, match="does not fit"):
        parse_agent_metadata(good[:at] + struct.pack("<Q", 1 << 62) + good[at + 8 :])
    at = good.index(b"Conns") + 5 + 8
    with pytest.raises(MetadataError, match="at most"):
        parse_agent_metadata(good[:at] + struct.pack("<Q", 1 << 20) + good[at + 8 :])
    with pytest.raises(MetadataError, match="trailing"):
        parse_agent_metadata(good + b"\x00")
    with pytest.raises(MetadataError):
        parse_agent_metadata(b"")


@given(st.data())
@settings(max_examples=300)
def test_a_flipped_or_cut_blob_is_refused_or_parses_never_anything_else(data):
    good = blob()
    choice = data.draw(st.sampled_from(["flip", "cut", "junk"]))
    if choice == "flip":
        at = data.draw(st.integers(0, len(good) - 1))
        mutated = good[:at] + bytes([good[at] ^ data.draw(st.integers(1, 255))]) + good[at + 1 :]
    elif choice == "cut":
        mutated = good[: data.draw(st.integers(0, len(good) - 1))]
    else:
        mutated = data.draw(st.binary(max_size=600))
    try:
        md = parse_agent_metadata(mutated)
    except MetadataError:
        return
    assert len(md.regions) <= 1024 and len(md.backends) <= 8  # parsed: within every bound
