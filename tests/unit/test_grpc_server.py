"""The gRPC endpoint without a daemon: ModelInfer's tensor bytes split from
protobuf (proto/wire.py), request parameters as Triton reads them, and
binding (start_grpc)."""
from __future__ import annotations

import asyncio
import errno
import socket

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from torchpool.gateway import grpc_requests, grpc_server
from torchpool.gateway.backend import Backend, InferResponse, KServeInfer
from torchpool.gateway.grpc_peers import GrpcCallers
from torchpool.gateway.offload import Offload
from torchpool.gateway.proto import grpc_service_pb2 as pb
from torchpool.gateway.proto import wire
from torchpool.protocol.errors import TorchpoolError


def infer_request(raw_sizes: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", model_version="2", id="x")
    request.parameters["sequence_id"].int64_param = 7
    for i, size in enumerate(raw_sizes):
        request.inputs.add(name=f"IN{i}", datatype="UINT8", shape=[size])
        request.raw_input_contents.append(bytes([i + 1]) * size)
    request.outputs.add(name="OUT").parameters["classification"].int64_param = 2
    return request


@pytest.mark.parametrize("sizes", [[3, 0, 5], [200_000, 0, 70_000]], ids=["small", "large"])
def test_raw_inputs_are_split_from_the_request(sizes: list[int]) -> None:
    request = infer_request(sizes)
    data = request.SerializeToString()
    parsed, rest, raws = grpc_server._parse_infer_request(data)    # what grpc's deserializer gives
    assert rest is None
    assert [bytes(r) for r in raws] == list(request.raw_input_contents)
    whole = pb.ModelInferRequest.FromString(data)
    if len(data) >= wire.SPLIT_MIN_BYTES:
        # views of the received message, not copies; the rest parsed by protobuf
        assert all(isinstance(r, memoryview) and r.obj is data for r in raws)
        assert not parsed.raw_input_contents
        whole.ClearField("raw_input_contents")
    assert parsed == whole


def test_the_split_keeps_runs_of_fields_and_stops_at_max_fields() -> None:
    request = infer_request([100_000, 0, 3])
    rest, raws = wire.split_infer_request(request.SerializeToString())
    whole = pb.ModelInferRequest.FromString(request.SerializeToString())
    whole.ClearField("raw_input_contents")
    assert pb.ModelInferRequest.FromString(rest) == whole
    assert [bytes(r) for r in raws] == list(request.raw_input_contents)
    tiny = b"\x3a\x00" * (wire.MAX_FIELDS + 1)            # empty raw_input_contents, one too many
    with pytest.raises(wire.WireError, match=f"more than {wire.MAX_FIELDS} fields"):
        wire.split_infer_request(tiny)
    assert len(wire.split_infer_request(tiny[:-2])[1]) == wire.MAX_FIELDS


def test_raw_entries_no_input_takes_are_refused() -> None:
    request = infer_request([4])
    with pytest.raises(TorchpoolError, match="raw_input_contents has 2 entries but 1 of the inputs"):
        grpc_requests.infer_call(request, raw_count=2)
    call = grpc_requests.infer_call(request, raw_count=1)
    assert [t.raw_index for t in call.inputs] == [0]


def test_a_truncated_request_is_refused() -> None:
    data = infer_request([100_000]).SerializeToString()
    assert isinstance(grpc_server._parse_infer_request(data[:-10]), (wire.WireError, DecodeError))


def test_raw_outputs_appended_to_the_response() -> None:
    header = pb.ModelInferResponse(model_name="m", model_version="1", id="r")
    header.outputs.add(name="A", datatype="FP32", shape=[2])
    header.outputs.add(name="B", datatype="FP32", shape=[0])
    header.outputs.add(name="C", datatype="UINT8", shape=[300])
    a = np.array([1.5, -2.0], np.float32)
    chunks = [memoryview(a).cast("B"), b"", bytes(range(256)) + bytes(44)]
    parsed = pb.ModelInferResponse.FromString(wire.serialize_infer_response((header, chunks)))
    assert list(parsed.raw_output_contents) == [a.tobytes(), b"", chunks[2]]
    parsed.ClearField("raw_output_contents")
    assert parsed == header


def test_varints_round_trip() -> None:
    for value in (0, 1, 127, 128, 300, 2**31 - 1, 2**63):
        encoded = wire.encode_varint(value)
        assert wire._varint(encoded, 0) == (value, len(encoded))


def test_request_parameters_as_triton_reads_them() -> None:
    params = pb.ModelInferRequest().parameters
    params["sequence_id"].string_param = "abc"
    params["sequence_start"].bool_param = True
    params["sequence_end"].bool_param = False
    params["priority"].uint64_param = 3
    params["timeout"].int64_param = 5000
    params["custom"].double_param = 1.0          # passed on by Triton, not torchpool's
    call = KServeInfer("m", "", [])
    grpc_requests._read_parameters(params, call)
    assert (call.sequence_id, call.sequence_start, call.sequence_end, call.priority, call.timeout_us) == (
        "abc", True, False, 3, 5000)
    params["timeout"].string_param = "soon"
    with pytest.raises(TorchpoolError) as exc:
        grpc_requests._read_parameters(params, KServeInfer("m", "", []))
    assert exc.value.message == "invalid value type for 'timeout' parameter, expected int64_param."


def test_requested_outputs() -> None:
    request = pb.ModelInferRequest()
    assert grpc_requests._outputs(request) is None        # none named: every output
    out = request.outputs.add(name="OUT")
    out.parameters["shared_memory_region"].string_param = "r"
    out.parameters["shared_memory_byte_size"].int64_param = 64
    out.parameters["shared_memory_offset"].int64_param = 8
    (wanted,) = grpc_requests._outputs(request)
    assert (wanted.name, wanted.region, wanted.byte_size, wanted.offset) == ("OUT", "r", 64, 8)
    out.parameters["classification"].int64_param = 2
    with pytest.raises(TorchpoolError) as exc:
        grpc_requests._outputs(request)
    assert exc.value.message == "output can't set both 'shared_memory_region' and 'classification'"
    del out.parameters["shared_memory_byte_size"]
    with pytest.raises(TorchpoolError) as exc:
        grpc_requests._outputs(request)
    assert exc.value.message == ("'shared_memory_byte_size' must be specified along with "
                                 "'shared_memory_region' parameter for tensor 'OUT'")


def test_start_grpc_binds_or_says_why(tmp_path) -> None:
    async def main() -> None:
        backend = Backend(f"ipc://{tmp_path / 'nobody.sock'}")
        try:
            server = await grpc_server.start_grpc(backend, "127.0.0.1", 0)
            try:
                assert server.port > 0
                with pytest.raises(OSError) as exc:      # no second server on a bound port
                    await grpc_server.start_grpc(backend, "127.0.0.1", server.port)
                assert exc.value.errno == errno.EADDRINUSE
            finally:
                await server.close()
            with socket.socket() as other:               # a port another program holds
                other.bind(("127.0.0.1", 0))
                other.listen()
                with pytest.raises(OSError) as exc:
                    await grpc_server.start_grpc(backend, "127.0.0.1", other.getsockname()[1])
                assert exc.value.errno == errno.EADDRINUSE and "Address already in use" in str(exc.value)
        finally:
            await backend.close()
    asyncio.run(main())


def test_a_malformed_infer_request_is_invalid_argument(tmp_path) -> None:
    import grpc

    async def main() -> None:
        backend = Backend(f"ipc://{tmp_path / 'nobody.sock'}")
        server = await grpc_server.start_grpc(backend, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                           request_serializer=bytes, response_deserializer=bytes)
                # a raw_input_contents entry claiming more bytes than follow, and junk
                for data in (b"\x3a\xff\xff\xff\x0f" + bytes(70_000), b"\xff" * 10):
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await call(data)
                    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert exc.value.details().startswith("unable to parse the inference request: ")
        finally:
            await server.close()
            await backend.close()
    asyncio.run(main())


class _HeldBackend(Backend):
    """The daemon held: every request starts (and counts) and waits for `go`."""

    def __init__(self, url: str, per_caller: int) -> None:
        super().__init__(url, per_caller=per_caller)
        self.started: list[str] = []
        self.go = asyncio.Event()

    async def infer(self, caller, call, sent=None):
        self.started.append(call.id)
        if sent is not None:
            sent()
        await self.go.wait()
        return InferResponse(call.model, "1", call.id, [])


class _Peer:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"         # every stream of one HTTP/2 connection


def test_a_callers_streams_together_read_at_most_its_share_ahead(tmp_path) -> None:
    """Two streams of one peer that send without their answers being written:
    the gateway starts the caller's share (3 here) of their requests in all,
    plus one of a stream that had none (never waiting for another stream),
    not 3 per stream; each stream's answers come in its order once the
    daemon answers, also when one stream's answers are read only after the
    other's; the caller goes with its streams."""
    async def main() -> None:
        backend = _HeldBackend(f"ipc://{tmp_path / 'nobody.sock'}", per_caller=3)
        servicer = grpc_server.InferenceServicer(backend, GrpcCallers(0, backend.forget), Offload())
        pulled = {"a": 0, "b": 0}

        async def requests(stream: str):
            for i in range(10):
                pulled[stream] += 1
                yield pb.ModelInferRequest(model_name="m", id=f"{stream}{i}"), None, []

        streams = {s: servicer.ModelStreamInfer(requests(s), _Peer()) for s in pulled}
        firsts = {s: asyncio.ensure_future(streams[s].__anext__()) for s in streams}
        # settled: a's three, b's one of its own, and each reader holds one more it pulled
        for _ in range(200):
            await asyncio.sleep(0)                 # turns of the loop, no time
        assert backend.started == ["a0", "a1", "a2", "b0"] and pulled == {"a": 4, "b": 2}
        backend.go.set()
        got = {s: [(await firsts[s]).infer_response.id] for s in streams}
        for s, stream in streams.items():
            got[s] += [r.infer_response.id async for r in stream]
        assert got == {s: [f"{s}{i}" for i in range(10)] for s in streams}
        assert servicer.callers.by_peer == {}      # the caller is gone with its streams
        await backend.close()
    asyncio.run(main())
