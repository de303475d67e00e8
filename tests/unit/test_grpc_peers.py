"""grpc_peers.GrpcCallers: open ModelStreamInfer streams counted by peer
(an address for another host), all its connections together, and capped."""
from __future__ import annotations

import asyncio

import pytest

from torchpool.gateway.callers import Caller
from torchpool.gateway.grpc_peers import GrpcCallers
from torchpool.gateway.tcp_table import peer_address
from torchpool.protocol import errors
from torchpool.protocol.errors import TorchpoolError


async def _forget(caller: Caller) -> None:
    return None


def test_a_peers_streams_on_all_its_connections_are_capped_and_another_peers_are_not() -> None:
    async def scenario() -> None:
        callers = GrpcCallers(8001, _forget, max_streams_per_peer=3)
        # one host's two connections, and another host's
        a1, a2 = callers.enter("ipv4:10.0.0.7:40001"), callers.enter("ipv4:10.0.0.7:40002")
        b = callers.enter("ipv6:[2001:db8::9]:40003")
        for caller in (a1, a1, a2):
            await callers.open_stream(caller)
        with pytest.raises(TorchpoolError) as refused:
            await callers.open_stream(a2)       # a new connection buys no more
        assert refused.value.code == errors.RESOURCE_EXHAUSTED
        assert "gRPC peer 10.0.0.7 has 3 ModelStreamInfer streams open" in refused.value.message
        assert "--grpc-max-streams-per-peer" in refused.value.message
        for _ in range(3):
            await callers.open_stream(b)        # another peer: a count of its own
        assert callers.open_streams() == {("address", "10.0.0.7"): 3, ("address", "2001:db8::9"): 3}
        callers.close_stream(a1)
        await callers.open_stream(a2)           # one ended: room for one
        for caller in (a1, a2, a2, b, b, b):
            callers.close_stream(caller)
        assert callers.open_streams() == {}

    asyncio.run(scenario())


def test_an_ipv4_peer_seen_through_ipv6_is_the_same_peer() -> None:
    async def scenario() -> None:
        callers = GrpcCallers(8001, _forget, max_streams_per_peer=1)
        await callers.open_stream(callers.enter("ipv4:10.0.0.7:40001"))
        with pytest.raises(TorchpoolError):
            await callers.open_stream(callers.enter("ipv6:[::ffff:10.0.0.7]:40002"))

    asyncio.run(scenario())


def test_no_cap_never_refuses() -> None:
    async def scenario() -> None:
        callers = GrpcCallers(8001, _forget)
        caller = callers.enter("ipv4:10.0.0.7:40001")
        for _ in range(1000):
            await callers.open_stream(caller)
        for _ in range(1000):
            callers.close_stream(caller)
        assert callers.open_streams() == {}

    asyncio.run(scenario())


def test_a_peer_whose_address_grpc_does_not_give_is_its_connection_alone() -> None:
    async def scenario() -> None:
        callers = GrpcCallers(8001, _forget, max_streams_per_peer=1)
        assert peer_address("unix:/tmp/x.sock") is None
        one, two = callers.enter("unix:/tmp/x.sock"), callers.enter("unix:abstract")
        await callers.open_stream(one)
        await callers.open_stream(two)
        with pytest.raises(TorchpoolError):
            await callers.open_stream(one)

    asyncio.run(scenario())
