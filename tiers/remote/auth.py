"""Who may act as which tenant on a peer: tokens mapped to tenants, and each tenant's quota.

A peer's ``--token-file`` is either

- a **tenants file**: one ``tenant: token`` per line (``#`` comments and blank lines
  allowed). A token on several lines grants each of those tenants; a tenant on several
  lines accepts each of those tokens. Every tenant gets an equal share of the pool's slots
  as a hard quota (``quota_for``), so no tenant can evict another's rows by flooding; or
- a **single token** (the file holds one line that is not ``tenant: token``): kept for
  deployments from before tenants existed, it grants exactly one tenant, ``default``
  (``peer_protocol.DEFAULT_TENANT``), the tenant a client claims when it names none. It
  does **not** grant any other tenant: a client that claims another one is refused.

A client claims a tenant in its AUTH; the peer accepts it only when the client's MAC
verifies under one of the tokens that grant that tenant (``tokens_for``), so holding some
token never lets a client act as a tenant that token does not grant. Without a token file
(``Credentials.open``) every claim is accepted with the empty key and tenants share one pool
without quotas: namespaces only, no security (the peer warns at start).

Every token must be at least ``MIN_TOKEN_BYTES`` long: a short one is guessable offline
from one recorded handshake.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tiers.remote.protocol import DEFAULT_TENANT, valid_tenant

MIN_TOKEN_BYTES = 16
_LINE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]{0,63})\s*:\s*(\S+)\s*$")


@dataclass(frozen=True)
class Credentials:
    """Tokens per tenant (empty mapping and ``open=True``: no authentication at all)."""

    tokens: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict)
    open: bool = False

    @classmethod
    def unauthenticated(cls) -> Credentials:
        return cls({}, open=True)

    @property
    def tenants(self) -> list[str]:
        return sorted(self.tokens)

    def tokens_for(self, tenant: str) -> tuple[bytes, ...]:
        """The keys a client claiming ``tenant`` may prove: ``(b"",)`` when open, ``()`` if none."""
        if self.open:
            return (b"",)
        return self.tokens.get(tenant, ())

    def quotas(self, num_slots: int) -> dict[str, int] | None:
        """Each tenant's hard share of the slots (``None`` when open: one shared pool)."""
        if self.open:
            return None
        share = num_slots // max(1, len(self.tokens))
        return dict.fromkeys(self.tokens, share)


def parse_token_file(text: bytes, where: str = "token file") -> Credentials:
    """``Credentials`` from a tenants file or a single token; ``ValueError`` naming the line."""
    lines = [
        (n, line.strip())
        for n, line in enumerate(text.decode("utf-8", errors="strict").splitlines(), 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not lines:
        raise ValueError(f"{where} is empty")
    matches = [(n, _LINE.match(line)) for n, line in lines]
    if len(lines) == 1 and matches[0][1] is None:
        token = lines[0][1].encode()
        _check_token(token, f"{where}: the token")
        return Credentials({DEFAULT_TENANT: (token,)})
    tokens: dict[str, list[bytes]] = {}
    for n, match in matches:
        if match is None:
            raise ValueError(f"{where} line {n}: expected 'tenant: token'")
        tenant, token = match.group(1), match.group(2).encode()
        if not valid_tenant(tenant):
            raise ValueError(f"{where} line {n}: {tenant!r} is not a tenant name")
        _check_token(token, f"{where} line {n}")
        if token not in tokens.setdefault(tenant, []):
            tokens[tenant].append(token)
    return Credentials({tenant: tuple(keys) for tenant, keys in tokens.items()})


def read_token_file(path: str) -> Credentials:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror or exc}") from exc
    try:
        return parse_token_file(data, repr(path))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path!r} is not UTF-8 text") from exc


def _check_token(token: bytes, where: str) -> None:
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"{where} is {len(token)} bytes; a token must be at least {MIN_TOKEN_BYTES}")
