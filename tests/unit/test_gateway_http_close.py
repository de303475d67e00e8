"""HttpServer.close with a connection accepted but not yet made.

The loop calls the protocol factory (HttpServer._accepted, which counts the
connection) as it accepts, and the protocol's connection_made soon after,
from its ready queue: a close that runs in between (SIGTERM under load)
finds a connection with no transport yet.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

from torchpool.gateway.http_bodies import BodyBudget
from torchpool.gateway.http_messages import Limits, Request, Response
from torchpool.gateway.http_server import HttpServer


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.written: list[bytes] = []

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def get_extra_info(self, name: str, default: Optional[object] = None) -> Any:
        return default


async def _handler(request: Request) -> Response:
    return Response(200, [])


def test_a_connection_accepted_as_the_server_closes_is_closed_once_made() -> None:
    async def main() -> _Transport:
        server = await HttpServer(_handler, Limits(), BodyBudget(1 << 20)).start("127.0.0.1", 0)
        conn = server._accepted()           # as the loop's accept does; connection_made is to come
        await server.close(grace=1.0)       # was: AttributeError ('NoneType' ... 'close'), in shutdown
        transport = _Transport()
        conn.connection_made(transport)
        return transport

    transport = asyncio.run(main())
    assert transport.closed and not transport.written
