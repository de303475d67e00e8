"""inference.GRPCInferenceService (KServe v2 / Triton gRPC) on grpcio's
asyncio server.

Each RPC parses its protobuf request into `backend` calls and types, and
writes the answer back as Triton does: outputs always in
`raw_output_contents` (one entry per output, empty for one written to a
shared-memory region), errors as a gRPC status (Triton's code for the error)
with the daemon's message. ModelInfer and ModelStreamInfer bypass protobuf
for the tensor bytes (proto/wire.py); a request whose other fields are
large is parsed in the helper process (offload.py). Each peer is a caller
(grpc_peers.py): its share of the daemon, its own regions. Messages are at
most `MAX_INPUT_BYTES` by default. CUDA shared memory, trace and log
settings are not torchpool's: they answer UNIMPLEMENTED.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from typing import AsyncIterator, Awaitable, Callable, NoReturn, Optional, Sequence, TypeAlias, TypeVar, Union

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from .backend import Backend, InferResponse, KServeInfer, bad, grpc_status_name
from .callers import Caller, ReadAhead, StreamAhead
from .chunks import Chunk, tensor_bytes
from .defaults import MAX_INPUT_BYTES, MAX_STREAMS_PER_PEER
from .grpc_peers import GrpcCallers
from .grpc_requests import attach_raw, infer_call, infer_call_of_bytes
from .offload import OFFLOAD_BYTES, Offload
from .proto import grpc_service_pb2 as pb
from .proto import grpc_service_pb2_grpc as pb_grpc
from .proto import wire

log = logging.getLogger("torchpool.gateway.grpc")

SERVICE = "inference.GRPCInferenceService"
# Requests are at most MAX_INPUT_BYTES by default (--grpc-max-input-size):
# grpc holds a message whole before we see it, so this bounds what one call
# makes the gateway hold. Answers may be as large as Triton's (INT32_MAX).
MAX_OUTPUT_BYTES = 2**31 - 1
# In-flight calls get this long on close; the daemon waits 5 s for the
# gateway process before killing it.
CLOSE_GRACE = 4.0
# Connections (each an fd). What grpcio lets a server bound: how many at once
# (grpc.max_allowed_incoming_connections: one past it is accepted and closed
# at once, its client sees UNAVAILABLE), how long one may take to send its
# HTTP/2 preface and settings (grpc's default is 120 s: a socket that sends
# nothing held an fd that long), and how long one may stay open with no call
# (a GOAWAY; its client reconnects on its next call). What it does not: which
# connection goes when they run short (nothing like HTTP's oldest-idle-first),
# a bound per peer, or one on a connection that keeps a stream open and idle.
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0

Context: TypeAlias = grpc.aio.ServicerContext
# A ModelInfer request as _parse_infer_request leaves it: (the request, None, its raw
# inputs), or (None, its bytes without the raw inputs, those) when the rest is large; or
# the error it could not be parsed with.
ParsedInfer = Union[tuple[Optional[pb.ModelInferRequest], Optional[bytes], Sequence[Union[bytes, memoryview]]],
                    Exception]
# ModelInfer's answer, serialized by wire.serialize_infer_response: the response without
# its tensor bytes, and the bytes of each output
InferAnswer = tuple[pb.ModelInferResponse, list[Chunk]]
_Msg = TypeVar("_Msg")
_Req = TypeVar("_Req")
_Res = TypeVar("_Res")


def _unimplemented(what: str) -> TorchpoolError:
    return TorchpoolError(errors.UNSUPPORTED, what)


async def _answer(result: InferResponse) -> InferAnswer:
    """The response without its tensor bytes, and the bytes of each output."""
    header = pb.ModelInferResponse(model_name=result.model_name, model_version=result.model_version,
                                   id=result.id)
    chunks: list[Chunk] = []
    for t in result.outputs:
        header.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        chunks.append(b"" if t.region is not None else await tensor_bytes(t))
    return header, chunks


async def _abort(context: Context, code: str, message: str) -> NoReturn:
    """End the call with the gRPC status of error `code` (grpc's abort raises)."""
    await context.abort(getattr(grpc.StatusCode, grpc_status_name(code)), message)
    raise AssertionError("grpc.aio.ServicerContext.abort returned")


def _parse(values: dict, message: _Msg) -> _Msg:
    """A daemon answer (Triton's JSON form) as `message`; fields protobuf does
    not know (torchpool's extras) are left out."""
    try:
        return json_format.ParseDict(values, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise TorchpoolError(errors.INTERNAL, str(exc)) from None


# --- the service --------------------------------------------------------------------------------

Method = Callable[["InferenceServicer", _Req, Context], Awaitable[_Res]]


def _rpc(method: Method[_Req, _Res]) -> Method[_Req, _Res]:
    """An error becomes the call's gRPC status with the daemon's message."""
    @functools.wraps(method)
    async def call(self: InferenceServicer, request: _Req, context: Context) -> _Res:
        try:
            return await method(self, request, context)
        except TorchpoolError as exc:
            code, message = exc.code, exc.message
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:        # a bug here must not look like the client's fault
            log.exception("gRPC %s failed", method.__name__)
            code, message = errors.INTERNAL, f"{type(exc).__name__}: {exc}"
        await _abort(context, code, message)
    return call


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, backend: Backend, callers: GrpcCallers, offload: Offload) -> None:
        self.backend = backend
        self.callers = callers
        self.offload = offload
        # a caller's streamed requests read ahead of their responses: more
        # than it may have at the daemon would only wait in the gateway
        self.stream_depth = max(1, backend.share.per_caller)

    # --- health and metadata

    @_rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=await self.backend.live())

    @_rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.backend.ready())

    @_rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self.backend.model_ready(request.name, request.version))

    @_rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        return _parse(await self.backend.server_metadata(), pb.ServerMetadataResponse())

    @_rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        meta = await self.backend.model_metadata(request.name, request.version)
        return _parse(meta, pb.ModelMetadataResponse())

    @_rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        config = await self.backend.model_config(request.name, request.version)
        return _parse({"config": config}, pb.ModelConfigResponse())

    @_rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        stats = await self.backend.statistics(request.name, request.version)
        return _parse(stats, pb.ModelStatisticsResponse())

    # --- inference

    async def _call(self, parsed: ParsedInfer) -> KServeInfer:
        """A request as _parse_infer_request left it, parsed the rest of the
        way (in the helper process when its non-tensor part is large)."""
        if isinstance(parsed, Exception):
            raise bad(f"unable to parse the inference request: {parsed}")
        request, rest, raws = parsed
        if request is not None:
            call = infer_call(request, len(raws))
        else:
            call = await self.offload.run(infer_call_of_bytes, rest, len(raws))
        return attach_raw(call, raws)

    async def infer(self, call: KServeInfer, caller: Caller,
                    sent: Optional[Callable[[], None]] = None) -> InferAnswer:
        result = await self.backend.infer(caller, call, sent)
        return await _answer(result)

    @_rpc
    async def ModelInfer(self, request: ParsedInfer, context: Context) -> InferAnswer:
        caller = self.callers.enter(context.peer())
        try:
            return await self.infer(await self._call(request), caller)
        finally:
            self.callers.leave(caller)

    async def ModelStreamInfer(self, requests: AsyncIterator[ParsedInfer], context: Context
                               ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """One response per request, in order; an error is a response
        (error_message), and the stream goes on.

        Requests are read as they come, as Triton does, not one answer at a
        time: each goes to the daemon once the one before it is on its way
        (a sequence's requests reach its scheduler in the stream's order),
        and a sequence batcher or a dynamic batch sees all of a stream's
        requests in flight. A caller's requests read ahead of the responses
        written are at most `stream_depth`, all its streams together (what
        it may have at the daemon at once: more would only wait here), plus
        one of each stream, so that a stream never waits for another's
        reader: a client that sends without reading stops being read, and
        many streams on one connection hold about what one does. A peer's
        streams on all its connections are capped (grpc_peers.py)."""
        caller = self.callers.enter(context.peer())
        try:
            await self.callers.open_stream(caller)
        except TorchpoolError as exc:
            self.callers.leave(caller)
            await _abort(context, exc.code, exc.message)
        except BaseException:               # cancelled while its peer was looked up
            self.callers.leave(caller)
            raise
        if caller.read_ahead is None:
            caller.read_ahead = ReadAhead(self.stream_depth)
        room = caller.read_ahead
        ahead: asyncio.Queue = asyncio.Queue()      # bounded by `room`: a put never waits
        stream = StreamAhead()                      # this stream's requests read and not answered
        reader = asyncio.ensure_future(self._read_stream(requests, caller, ahead, room, stream))
        try:
            while True:
                answer = await ahead.get()
                if answer is None:
                    break
                yield await answer
                room.give(stream)
            await reader                    # its error (the stream's), if it had one
        finally:
            reader.cancel()
            while not ahead.empty():
                answer = ahead.get_nowait()
                if answer is not None:
                    answer.cancel()
            room.give(stream, stream.own)   # the caller's other streams read on
            self.callers.close_stream(caller)
            self.callers.leave(caller)

    async def _read_stream(self, requests: AsyncIterator[ParsedInfer], caller: Caller, ahead: asyncio.Queue,
                           room: ReadAhead, stream: StreamAhead) -> None:
        """Start each request of a stream as it arrives, in order, once the
        caller has room ahead of its responses; None after the last (or when
        the stream fails)."""
        before: Optional[asyncio.Event] = None
        try:
            async for parsed in requests:
                await room.take(stream)
                sent = asyncio.Event()
                ahead.put_nowait(asyncio.ensure_future(self._stream_one(parsed, caller, before, sent)))
                before = sent
        finally:
            ahead.put_nowait(None)

    async def _stream_one(self, parsed: ParsedInfer, caller: Caller, before: Optional[asyncio.Event],
                          sent: asyncio.Event) -> pb.ModelStreamInferResponse:
        call: Optional[KServeInfer] = None
        try:
            try:
                call = await self._call(parsed)
            finally:
                if before is not None:
                    await before.wait()     # in the stream's order, sent or failed
            header, chunks = await self.infer(call, caller, sent.set)
        except Exception as exc:      # one bad request must not end the stream
            if not isinstance(exc, TorchpoolError):
                log.exception("gRPC ModelStreamInfer failed")
            message = exc.message if isinstance(exc, TorchpoolError) else f"{type(exc).__name__}: {exc}"
            # with the request's id, as Triton: the client can tell which one failed
            return pb.ModelStreamInferResponse(
                error_message=message, infer_response=pb.ModelInferResponse(id=_request_id(parsed, call)))
        finally:
            sent.set()                  # failed before it was sent: the next one goes on
        header.raw_output_contents.extend(bytes(c) for c in chunks)
        return pb.ModelStreamInferResponse(infer_response=header)

    # --- model repository

    @_rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        _no_repository_name(request)
        index = await self.backend.repository_index(ready_only=request.ready)
        return _parse({"models": index}, pb.RepositoryIndexResponse())

    @_rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Context) -> pb.RepositoryModelLoadResponse:
        _no_repository_name(request)
        config, files = None, {}
        for key, value in request.parameters.items():
            which = value.WhichOneof("parameter_choice")
            if key == "config" or key.startswith("file:"):
                expected = "string_param" if key == "config" else "bytes_param"
                if which != expected:
                    raise bad(f"invalid value type for load parameter '{key}', expected {expected}.")
                if key == "config":
                    config = value.string_param
                else:
                    files[key] = value.bytes_param
            else:
                raise bad(f"unrecognized load parameter '{key}'.")
        await self.backend.load(request.model_name, config, files)
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Context) -> pb.RepositoryModelUnloadResponse:
        _no_repository_name(request)
        if "unload_dependents" in request.parameters \
                and request.parameters["unload_dependents"].WhichOneof("parameter_choice") != "bool_param":
            raise bad("invalid value type for 'unload_dependents' parameter, expected bool_param.")
        # torchpool has no ensembles: a model has no dependents to unload with it
        await self.backend.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # --- system shared memory

    @_rpc
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Context) -> pb.SystemSharedMemoryStatusResponse:
        caller = self.callers.enter(context.peer())
        try:
            regions = await self.backend.shm_status(caller)
        finally:
            self.callers.leave(caller)
        if request.name:
            # Triton's answer for a name that is not registered (the daemon's
            # is an INVALID_ARG in its own words)
            regions = [r for r in regions if r["name"] == request.name]
            if not regions:
                raise TorchpoolError(errors.NOT_FOUND,
                                     f"Unable to find system shared memory region: '{request.name}'")
        return _parse({"regions": {r["name"]: r for r in regions}}, pb.SystemSharedMemoryStatusResponse())

    @_rpc
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Context) -> pb.SystemSharedMemoryRegisterResponse:
        caller = self.callers.enter(context.peer())
        try:
            await self.backend.register_shm(caller, request.name, request.key, request.offset,
                                            request.byte_size)
            await self.callers.uses_regions(caller)
        finally:
            self.callers.leave(caller)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: Context) -> pb.SystemSharedMemoryUnregisterResponse:
        caller = self.callers.enter(context.peer())
        try:
            await self.backend.unregister_shm(caller, request.name)
        finally:
            self.callers.leave(caller)
        return pb.SystemSharedMemoryUnregisterResponse()

    # --- CUDA shared memory: a caller's GPU memory, by CUDA IPC handle

    @_rpc
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context: Context) -> pb.CudaSharedMemoryStatusResponse:
        caller = self.callers.enter(context.peer())
        try:
            regions = await self.backend.cuda_shm_status(caller, request.name)
        finally:
            self.callers.leave(caller)
        answer = pb.CudaSharedMemoryStatusResponse()
        for r in regions:
            answer.regions[r["name"]].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(
                name=r["name"], device_id=r["device_id"], byte_size=r["byte_size"]))
        return answer

    @_rpc
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest,
                                       context: Context) -> pb.CudaSharedMemoryRegisterResponse:
        caller = self.callers.enter(context.peer())
        try:
            await self.backend.register_cuda_shm(caller, request.name, request.raw_handle, request.device_id,
                                                 request.byte_size)
            await self.callers.uses_regions(caller)
        finally:
            self.callers.leave(caller)
        return pb.CudaSharedMemoryRegisterResponse()

    @_rpc
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context: Context) -> pb.CudaSharedMemoryUnregisterResponse:
        caller = self.callers.enter(context.peer())
        try:
            await self.backend.unregister_cuda_shm(caller, request.name)
        finally:
            self.callers.leave(caller)
        return pb.CudaSharedMemoryUnregisterResponse()

    @_rpc
    async def TraceSetting(self, request: pb.TraceSettingRequest, context: Context) -> pb.TraceSettingResponse:
        raise _unimplemented("the server does not support trace")

    @_rpc
    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> pb.LogSettingsResponse:
        raise _unimplemented("the server does not support dynamic logging")


def _parse_infer_request(data: bytes) -> ParsedInfer:
    """(request, None, raw_input_contents), or (None, the request without its
    raw_input_contents, those) when its other fields are too large to parse
    on the loop; or the error: raised here, grpc would answer UNKNOWN with a
    Python traceback's first line."""
    try:
        if len(data) < wire.SPLIT_MIN_BYTES:
            request = pb.ModelInferRequest.FromString(data)
            return request, None, request.raw_input_contents
        rest, raws = wire.split_infer_request(data)
        if len(rest) >= OFFLOAD_BYTES:
            return None, rest, raws
        return pb.ModelInferRequest.FromString(rest), None, raws
    except (wire.WireError, DecodeError) as exc:
        return exc


def _request_id(parsed: ParsedInfer, call: Optional[KServeInfer]) -> str:
    if call is not None:
        return call.id
    if isinstance(parsed, tuple) and parsed[0] is not None:
        return parsed[0].id
    return ""


def _no_repository_name(request: Union[pb.RepositoryIndexRequest, pb.RepositoryModelLoadRequest,
                                              pb.RepositoryModelUnloadRequest]) -> None:
    if request.repository_name:
        raise _unimplemented("'repository_name' specification is not supported")


# --- the server ----------------------------------------------------------------------------------

class GrpcServer:
    def __init__(self, server: grpc.aio.Server, port: int, callers: GrpcCallers,
                 own_offload: Optional[Offload]) -> None:
        self._server = server
        self.port = port
        self.callers = callers
        self.own_offload = own_offload

    async def close(self) -> None:
        """New calls are refused at once; those in flight get CLOSE_GRACE s."""
        await self._server.stop(CLOSE_GRACE)
        await self.callers.close()
        if self.own_offload is not None:
            self.own_offload.close()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_error(host: str, port: int) -> OSError:
    """Why grpc could not bind (it only says that it could not): the same bind
    tried on a plain socket tells."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        for family, kind, proto, _name, address in infos:
            with socket.socket(family, kind, proto) as probe:
                probe.bind(address)
    except OSError as exc:
        return OSError(exc.errno, f"{exc.strerror or exc} ({_address(host, port)})")
    return OSError(errno.EADDRNOTAVAIL, f"gRPC could not bind {_address(host, port)}")


async def start_grpc(backend: Backend, host: str, port: int, max_input: int = MAX_INPUT_BYTES,
                     offload: Optional[Offload] = None, max_connections: int = 0,
                     max_streams_per_peer: int = MAX_STREAMS_PER_PEER) -> GrpcServer:
    """Serve GRPCInferenceService for `backend` on host:port (0: any free
    port, see .port), taking requests of at most `max_input` bytes, at
    most `max_connections` connections at once (0: no cap) and at most
    `max_streams_per_peer` open streams of one peer (0: no cap). Raises
    OSError if the address cannot be bound."""
    cap = [("grpc.max_allowed_incoming_connections", max_connections)] if max_connections else []
    server = grpc.aio.server(options=cap + [
        ("grpc.max_receive_message_length", max_input),
        ("grpc.max_send_message_length", MAX_OUTPUT_BYTES),
        # a connection's calls at once: past a caller's share they would
        # only wait here, each holding its message
        ("grpc.max_concurrent_streams", 2 * backend.share.per_caller),
        # grpc's "overload protection" also counts streams the client has
        # seen end but the server has not yet freed, and refuses new ones
        # past the cap with RST_STREAM 7: a tritonclient with 1,000 async
        # calls on one connection had 732 of them fail UNAVAILABLE. The cap
        # as HTTP/2 counts it is what bounds a connection
        ("grpc.http.overload_protection", 0),
        # grpc sets SO_REUSEPORT by default: a second server on a busy port
        # would bind and share it instead of failing
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_connection_idle_ms", int(IDLE_TIMEOUT_S * 1000)),
    ])
    try:
        bound = server.add_insecure_port(_address(host, port))
    except RuntimeError:
        bound = 0
    if not bound:
        await server.stop(None)
        raise _bind_error(host, port)
    callers = GrpcCallers(bound, backend.forget, max_streams_per_peer)
    servicer = InferenceServicer(backend, callers, offload or Offload())
    own_offload = servicer.offload if offload is None else None
    # ModelInfer and ModelStreamInfer with the tensor bytes outside protobuf;
    # added first, so they are found before the generated handlers
    fast = {"ModelInfer": grpc.unary_unary_rpc_method_handler(
                servicer.ModelInfer, request_deserializer=_parse_infer_request,
                response_serializer=wire.serialize_infer_response),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                servicer.ModelStreamInfer, request_deserializer=_parse_infer_request,
                response_serializer=pb.ModelStreamInferResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, fast),))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    await server.start()
    return GrpcServer(server, bound, callers, own_offload)
