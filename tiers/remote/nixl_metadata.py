"""A strict reader of a peer's NIXL agent metadata, run before the bytes reach NIXL.

NIXL parses metadata (``add_remote_agent``) in C++ and trusts every length in it: fuzzed
metadata made a client abort (SIGABRT) or crash (SIGSEGV). The metadata a client receives
comes in a WELCOME whose tag has verified (``tiers/remote/protocol.py``), so only a peer that
knows the token can send it; this module makes even that peer's bytes pass a shape check
first: the serialization NIXL 1.5 writes (``nixlSerDes``: ``tag, u64 length, value, '|'``,
in a fixed order), every length inside the blob, small counts, exactly the agent name the
peer announced (``kvtier-peer-<instance id>``) and a registered region that covers the pool
and probe the WELCOME announced. Anything else is refused, never half-parsed. It does not
look inside the UCX worker address (an opaque blob), so it narrows what reaches NIXL; it
cannot prove NIXL safe from a hostile peer (``docs/threat-model.md``).

Pure Python, no NIXL import: testable alone.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAX_BACKENDS = 8
MAX_SECTIONS = 8
MAX_DESCRIPTORS = 1024
MAX_BLOB_BYTES = 16 << 10
REGION_SLACK = 4096
"""How much larger than pool + probe a peer's registered region may be: it registers each
run of slots with a probe area of a few bytes after it (``tiers/remote/server.py``)."""
_DRAM_SEG = bytes(4)  # NIXL's memory type of host memory: a peer serves nothing else
_U64 = struct.Struct("<Q")
_DESC = struct.Struct("<QQQ")  # address, length, device id; NIXL's own meta info follows


class MetadataError(ValueError):
    """Metadata that is not what a kvtier peer's NIXL agent sends."""


@dataclass(frozen=True)
class AgentMetadata:
    name: str
    backends: tuple[str, ...]
    regions: tuple[tuple[int, int, int], ...]  # (address, length, device) per registered descriptor


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def literal(self, text: bytes) -> None:
        if self.data[self.pos : self.pos + len(text)] != text:
            raise MetadataError(f"expected {text!r} at byte {self.pos}")
        self.pos += len(text)

    def field(self, tag: bytes, limit: int = MAX_BLOB_BYTES) -> bytes:
        """``tag``, a u64 length (checked against ``limit`` and the bytes left), the value, ``|``."""
        self.literal(tag)
        if self.pos + 8 > len(self.data):
            raise MetadataError(f"truncated in field {tag!r}")
        (length,) = _U64.unpack_from(self.data, self.pos)
        self.pos += 8
        if length > limit or self.pos + length + 1 > len(self.data):
            raise MetadataError(f"field {tag!r} of {length} bytes does not fit")
        value = self.data[self.pos : self.pos + length]
        self.pos += length
        self.literal(b"|")
        return value

    def count(self, tag: bytes, limit: int) -> int:
        raw = self.field(tag, 8)
        if len(raw) != 8:
            raise MetadataError(f"field {tag!r} is not a count")
        (n,) = _U64.unpack(raw)
        if n > limit:
            raise MetadataError(f"{n} entries in {tag!r} (at most {limit})")
        return n


def parse_agent_metadata(data: bytes, max_bytes: int = 64 << 10) -> AgentMetadata:
    """The parts of ``get_agent_metadata()`` bytes kvtier checks; ``MetadataError`` if malformed."""
    if not isinstance(data, bytes | bytearray) or not 0 < len(data) <= max_bytes:
        raise MetadataError(f"metadata of {len(data) if isinstance(data, bytes | bytearray) else '?'} bytes")
    cur = _Cursor(bytes(data))
    cur.literal(b"nixlSerDes|")
    raw_name = cur.field(b"Agent", 256)
    backends = []
    for _ in range(cur.count(b"Conns", MAX_BACKENDS)):
        backends.append(cur.field(b"t", 64))
        cur.field(b"c")  # the backend's connection info (the UCX worker address): opaque
    if cur.field(b"", 64) != b"MemSection":
        raise MetadataError("no memory section")
    regions = []
    for _ in range(cur.count(b"nixlSecElms", MAX_SECTIONS)):
        backends_of_section = cur.field(b"bknd", 64)
        if backends_of_section not in backends:
            raise MetadataError("a memory section for a backend that has no connection info")
        if cur.field(b"nixlDList", 64) != b"nixlSDList":
            raise MetadataError("a memory section that is not a descriptor list")
        if cur.field(b"t", 8) != _DRAM_SEG:
            raise MetadataError("a memory section that is not host memory (DRAM)")  # a flip here crashed NIXL
        for _ in range(cur.count(b"n", MAX_DESCRIPTORS)):
            desc = cur.field(b"", 1024)
            if len(desc) < _DESC.size:
                raise MetadataError("a descriptor shorter than address, length and device")
            addr, length, device = _DESC.unpack_from(desc)
            if length == 0 or addr + length > 1 << 64:
                raise MetadataError("a descriptor that is empty or wraps around")
            regions.append((addr, length, device))
    if cur.pos != len(cur.data):
        raise MetadataError(f"{len(cur.data) - cur.pos} trailing bytes")
    try:
        name = raw_name.decode("ascii")
        names = tuple(b.decode("ascii") for b in backends)
    except UnicodeDecodeError as exc:
        raise MetadataError("a name that is not ASCII") from exc
    return AgentMetadata(name, names, tuple(regions))


def check_peer_metadata(
    data: bytes, agent_name: str, start: int, end: int, slack: int = REGION_SLACK
) -> AgentMetadata:
    """``parse_agent_metadata``, plus: the agent is ``agent_name``, speaks UCX and registers
    one host region (device 0) covering ``[start, end)`` (the pool and probe its WELCOME
    announced) and at most ``slack`` bytes more (the rest of the probe area)."""
    md = parse_agent_metadata(data)
    if md.name != agent_name:
        raise MetadataError(f"metadata of agent {md.name!r}, the peer announced {agent_name!r}")
    if "UCX" not in md.backends:
        raise MetadataError("the peer's agent has no UCX backend")
    if not any(
        device == 0 and addr <= start and end <= addr + length and length <= end - start + slack
        for addr, length, device in md.regions
    ):
        raise MetadataError("no registered region matches the pool the peer announced")
    return md
