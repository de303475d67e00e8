"""A gRPC client that opens streams, writes requests on them and never
reads an answer (issue 39, item 1), run as a process of its own:

    python -m tests.support.grpc_unread_streams PORT CONNECTIONS STREAMS REQUESTS ELEMENTS

CONNECTIONS channels, each on an HTTP/2 connection of its own
(grpc.use_local_subchannel_pool) or, with CONNECTIONS negative, that many
channels of the same options, which grpc puts on one shared connection;
STREAMS ModelStreamInfer streams on each, REQUESTS requests of ELEMENTS
FP32 values to `identity` on each stream, written without waiting for
anything the server sends, and the streams left open until its stdin
closes. A stream the server has not opened (past what it lets one
connection open) waits in this client; so does a write the server does
not read. It prints a line `refused` for each stream the server refused
(RESOURCE_EXHAUSTED: past what one peer may hold open) as it sees it.
"""
from __future__ import annotations

import asyncio
import sys

import grpc
import numpy as np

METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"


def request(elements: int) -> bytes:
    from torchpool.gateway.proto import grpc_service_pb2 as pb

    message = pb.ModelInferRequest(model_name="identity")
    message.inputs.add(name="INPUT__0", datatype="FP32", shape=[elements])
    message.raw_input_contents.append(np.ones(elements, np.float32).tobytes())
    return message.SerializeToString()


async def offend(port: int, connections: int, streams: int, requests: int, elements: int) -> None:
    data = request(elements)
    own = [("grpc.use_local_subchannel_pool", 1)] if connections > 0 else []
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=own)
                for _ in range(abs(connections))]
    calls = [channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)()
             for channel in channels for _ in range(streams)]

    async def write(call: grpc.aio.StreamStreamCall) -> None:
        try:
            for _ in range(requests):
                await call.write(data)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass                    # the server ended the stream (refused it)

    async def watch(call: grpc.aio.StreamStreamCall, writer: asyncio.Future[None]) -> None:
        # its status only: no answer is read
        if await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            writer.cancel()         # a write pending on a refused stream keeps its place on the connection
            print("refused", flush=True)

    writers = [asyncio.ensure_future(write(call)) for call in calls]
    writers += [asyncio.ensure_future(watch(call, writer)) for call, writer in zip(calls, list(writers))]
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for w in writers:
        w.cancel()
    for call in calls:
        call.cancel()
    for channel in channels:
        await channel.close()


if __name__ == "__main__":
    asyncio.run(offend(*(int(a) for a in sys.argv[1:6])))
