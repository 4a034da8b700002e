"""``host:port``: the one parser of network addresses, for every tier and the configuration.

Peers, Mooncake's master, a peer's ``--listen`` and Mooncake's ``local_hostname`` are all
written as ``host:port`` (an IPv6 literal in brackets: ``[::1]:7400``). Parsing them in one
place keeps one grammar: the port is what follows the last colon, a number in 1..65535 (0
only where a listener lets the system choose), and the host is what precedes it, brackets
removed. Callers turn the ``ValueError`` into their own message (a ``ConfigError`` naming
the key, an ``argparse`` error), so the words a user sees stay those of the place that read
the address.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PORT = 65535


@dataclass(frozen=True)
class Address:
    """A parsed ``host:port``. ``text`` is the address as written, and what ``str`` gives:
    a remote tier spreads rows over its peers by hashing that text (``rendezvous_owner``),
    so it is kept, never re-spelled."""

    host: str  # without the brackets of an IPv6 literal
    port: int
    text: str

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, text: object, *, any_port: bool = False) -> Address:
        """``host:port``; ``any_port`` also takes port 0. ``ValueError`` if it is not one."""
        if not isinstance(text, str):
            raise ValueError(f"{text!r} is not 'host:port'")
        host, port = split_host_port(text, port_optional=False)
        lowest = 0 if any_port else 1
        if not host or not valid_port(port, lowest):
            raise ValueError(f"{text!r} is not 'host:port'")
        return cls(host, int(port), text)


def split_host_port(text: str, *, port_optional: bool = True) -> tuple[str, str]:
    """The host (brackets removed) and the port's text (``""`` if none) of ``host:port``.

    With ``port_optional``, ``host`` alone is allowed too, and an IPv6 literal without
    brackets (several colons) is a host; otherwise the port follows the last colon.
    """
    if text.startswith("[") and "]:" in text:
        host, _, port = text[1:].rpartition("]:")
        return host, port
    if port_optional and text.count(":") != 1:
        return text.strip("[]"), ""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), port


def valid_port(port: str, lowest: int = 1) -> bool:
    """Whether ``port`` is the decimal text of a port in ``lowest``..65535."""
    return port.isdigit() and lowest <= int(port) <= MAX_PORT
