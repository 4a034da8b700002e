"""A man in the middle for the peer protocol: a TCP relay that sees every frame and may
drop, rewrite, replay or inject frames. It knows no token; it is what an attacker on the
network between an engine and its peer can do to the control channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable

C2S = "client->peer"
S2C = "peer->client"

Hook = Callable[[str, int, bytes], list[bytes]]
"""``(direction, index of the frame in that direction, whole frame)`` -> frames to forward."""


def frame_type(frame: bytes) -> int:
    return frame[4]


def forward(_direction: str, _index: int, frame: bytes) -> list[bytes]:
    return [frame]


class Relay:
    """Listens on 127.0.0.1; each connection goes on to ``target`` through ``hook``."""

    def __init__(self, target_port: int, hook: Hook = forward) -> None:
        self.target_port = target_port
        self.hook = hook
        self.port = 0
        self.seen: dict[str, list[bytes]] = {C2S: [], S2C: []}
        self._server: asyncio.AbstractServer | None = None
        self._upstreams: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def inject_to_peer(self, frame: bytes) -> None:
        """Write ``frame`` into the newest connection's stream towards the peer."""
        self._upstreams[-1].write(frame)

    async def _on_client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        p_reader, p_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._upstreams.append(p_writer)
        pumps = [
            asyncio.create_task(self._pump(C2S, c_reader, p_writer)),
            asyncio.create_task(self._pump(S2C, p_reader, c_writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for writer in (c_writer, p_writer):
            writer.close()

    async def _pump(self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = 0
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readexactly(4)
                (length,) = struct.unpack("<I", head)
                frame = head + await reader.readexactly(length)
                self.seen[direction].append(frame)
                for out in self.hook(direction, index, frame):
                    writer.write(out)
                await writer.drain()
                index += 1
