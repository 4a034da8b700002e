"""Each tenant's share of the peer's data plane: transfers and bytes in flight, per tenant.

The peer has one NIXL agent and a few cores for every tenant. Without a bound, one tenant
that keeps many large PUTs or GETs in flight (many connections, each with its window full)
queues gigabytes of copies ahead of another tenant's small get, which then runs past its
deadline. ``TenantShares`` admits a tenant's transfer only while the tenant has fewer than
``max_transfers`` in flight and at most ``max_bytes`` of rows in flight (a single request
larger than that runs alone); the rest wait their turn in arrival order, until their
deadline. So another tenant's transfer waits behind at most one share of each busy tenant,
whatever they send, and a tenant that floods only queues behind itself.

A real engine keeps two requests of ``transfer_bytes`` in flight per peer
(``tiers/remote/tier.py``), well within a share: its transfers never wait here. A waiting
transfer whose connection ends gives up its place (``abandon``): nothing of a client that
left starts moving. Everything runs on the peer's event loop; no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


class Busy(Exception):
    """The tenant's share stayed full until the request's deadline (or its connection ended
    meanwhile): nothing was moved."""


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    nbytes: int
    owner: int


@dataclass
class _Share:
    transfers: int = 0
    nbytes: int = 0
    waiting: deque[_Waiter] = field(default_factory=deque)


class TenantShares:
    """Per tenant at most ``max_transfers`` transfers and ``max_bytes`` of rows in flight.

    ``async with admitted(tenant, owner, nbytes, deadline)`` around a transfer (or
    ``acquire`` then ``release``); ``Busy`` if it was not admitted by ``deadline``. Owners are
    connection ids: ``abandon(owner)`` when a connection ends.
    """

    def __init__(self, max_transfers: int, max_bytes: int) -> None:
        if max_transfers < 1 or max_bytes < 1:
            raise ValueError("a share admits one transfer at least")
        self.max_transfers = max_transfers
        self.max_bytes = max_bytes
        self._shares: dict[str, _Share] = {}

    def in_flight(self, tenant: str) -> tuple[int, int]:
        """``(transfers, bytes)`` the tenant has in flight now."""
        share = self._shares.get(tenant)
        return (0, 0) if share is None else (share.transfers, share.nbytes)

    @contextlib.asynccontextmanager
    async def admitted(self, tenant: str, owner: int, nbytes: int, deadline: float) -> AsyncIterator[None]:
        await self.acquire(tenant, owner, nbytes, deadline)
        try:
            yield
        finally:
            self.release(tenant, nbytes)

    async def acquire(self, tenant: str, owner: int, nbytes: int, deadline: float) -> None:
        share = self._shares.get(tenant)
        if share is None:
            share = self._shares[tenant] = _Share()
        if not share.waiting and self._fits(share, nbytes):
            self._take(share, nbytes)
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), nbytes, owner)
        share.waiting.append(waiter)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await waiter.future
        except BaseException as exc:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(tenant, nbytes)  # admitted as the deadline passed: give it back
            else:
                if waiter in share.waiting:
                    share.waiting.remove(waiter)
                self._wake(tenant, share)  # the head may have been all that blocked others
            if isinstance(exc, TimeoutError):
                raise Busy(f"the tenant's share of the peer stayed full ({self._describe(share)})") from None
            raise

    def abandon(self, owner: int) -> None:
        """The connection ``owner`` ended: its waiting transfers give up (``Busy``)."""
        for tenant, share in list(self._shares.items()):
            gone = [w for w in share.waiting if w.owner == owner]
            for waiter in gone:
                share.waiting.remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(Busy("its connection ended"))
            if gone:
                self._wake(tenant, share)

    def release(self, tenant: str, nbytes: int) -> None:
        share = self._shares[tenant]
        share.transfers -= 1
        share.nbytes -= nbytes
        self._wake(tenant, share)

    def _fits(self, share: _Share, nbytes: int) -> bool:
        if share.transfers == 0:
            return True  # one request larger than a share runs alone
        return share.transfers < self.max_transfers and share.nbytes + nbytes <= self.max_bytes

    def _take(self, share: _Share, nbytes: int) -> None:
        share.transfers += 1
        share.nbytes += nbytes

    def _wake(self, tenant: str, share: _Share) -> None:
        """Admit waiters from the head while they fit (in order: none overtakes another);
        forget a tenant with nothing in flight and nobody waiting."""
        while share.waiting and self._fits(share, share.waiting[0].nbytes):
            waiter = share.waiting.popleft()
            if waiter.future.done():  # gave up meanwhile
                continue
            self._take(share, waiter.nbytes)
            waiter.future.set_result(None)
        if share.transfers == 0 and not share.waiting:
            del self._shares[tenant]

    def _describe(self, share: _Share) -> str:
        return (
            f"{share.transfers} of {self.max_transfers} transfers, "
            f"{share.nbytes} of {self.max_bytes} B in flight"
        )
