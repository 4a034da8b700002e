"""A strict reader of a client's NIXL agent metadata, run by the peer before the bytes reach NIXL.

NIXL parses metadata (``add_remote_agent``) in C++ and trusts every length in it: fuzzed
metadata made the receiving process abort (SIGABRT) or crash (SIGSEGV). A peer loads the
metadata of each client that authenticated (it arrives in an AGENT frame whose tag has
verified: ``tiers/remote/protocol.py``); this module makes even an authenticated client's
bytes pass a shape check first: the serialization NIXL 1.5 writes (``nixlSerDes``: ``tag,
u64 length, value, '|'``, in a fixed order), every length inside the blob, small counts, a
kvtier client's agent name, a UCX backend, host memory only, and a registered region that
holds the probe bytes the client announced. Anything else is refused, never half-parsed. It
does not look inside the UCX worker address (an opaque blob), so it narrows what reaches
NIXL; it cannot prove NIXL safe from every blob, which is why the blob reaches NIXL only in
the tenant's own worker process (``tenant_worker.py``, ``docs/threat-model.md``).

Pure Python, no NIXL import: testable alone.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

MAX_BACKENDS = 8
MAX_SECTIONS = 8
MAX_DESCRIPTORS = 1024
MAX_BLOB_BYTES = 16 << 10
CLIENT_AGENT_PREFIX = "kvtier-remote-"
"""Every remote tier names its agent so (``tiers/remote/tier.py``); nothing else is loaded."""
_CLIENT_AGENT_NAME = re.compile(re.escape(CLIENT_AGENT_PREFIX) + r"[A-Za-z0-9._-]{1,100}")
_DRAM_SEG = bytes(4)  # NIXL's memory type of host memory: a client registers nothing else
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


def check_client_metadata(data: bytes, probe_addr: int, probe_len: int) -> AgentMetadata:
    """``parse_agent_metadata``, plus: a kvtier client's agent (``CLIENT_AGENT_PREFIX``) that
    speaks UCX and registers host memory (device 0) holding ``[probe_addr, probe_addr +
    probe_len)``, the probe bytes its AGENT frame announced."""
    md = parse_agent_metadata(data)
    if _CLIENT_AGENT_NAME.fullmatch(md.name) is None:
        raise MetadataError(f"agent {md.name[:64]!r} is not a kvtier client's")
    if "UCX" not in md.backends:
        raise MetadataError("the client's agent has no UCX backend")
    if not md.regions:
        raise MetadataError("the client's agent registers no memory")
    if not any(
        device == 0 and addr <= probe_addr and probe_addr + probe_len <= addr + length
        for addr, length, device in md.regions
    ):
        raise MetadataError("no registered region holds the announced probe bytes")
    return md
