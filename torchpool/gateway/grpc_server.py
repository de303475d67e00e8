"""inference.GRPCInferenceService (KServe v2 / Triton gRPC) on grpcio's
asyncio server.

Each RPC parses its protobuf request into `backend` calls and types, and
writes the answer back as Triton does: outputs always in
`raw_output_contents` (one entry per output, empty for one written to a
shared-memory region), errors as a gRPC status (Triton's code for the error)
with the daemon's message. ModelInfer bypasses protobuf for the tensor bytes
(proto/wire.py). CUDA shared memory, trace and log settings are not
torchpool's: they answer UNIMPLEMENTED.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from typing import Any, Awaitable, Callable, Optional, Sequence

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from .backend import Backend, InferResponse, InputTensor, OutputRequest, bad, grpc_status_name
from .proto import grpc_service_pb2 as pb
from .proto import grpc_service_pb2_grpc as pb_grpc
from .proto import wire

log = logging.getLogger("torchpool.gateway.grpc")

SERVICE = "inference.GRPCInferenceService"
# Triton's limit in both directions (INT32_MAX): a 1 GiB tensor must pass.
MAX_MESSAGE_BYTES = 2**31 - 1
# In-flight calls get this long on close; the daemon waits 5 s for the
# gateway process before killing it.
CLOSE_GRACE = 4.0

# The `contents` field of each datatype, and the datatype Triton names for a
# field given with the wrong datatype. FP16/BF16 have none: only raw bytes.
_CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                   "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                   "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                   "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_FIELD_DATATYPE = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64",
                   "uint_contents": "UINT32", "uint64_contents": "UINT64", "fp32_contents": "FP32",
                   "fp64_contents": "FP64", "bytes_contents": "BYTES"}


def _unimplemented(what: str) -> TorchpoolError:
    return TorchpoolError(errors.UNSUPPORTED, what)


# --- request parameters ------------------------------------------------------------------

def _param(params: Any, key: str, kinds: tuple[str, ...], where: str = "") -> Any:
    """The value of parameter `key` (None if absent), which must be set as one
    of `kinds` (InferParameter oneof fields); Triton's error text otherwise."""
    if key not in params:        # not params[key]: that would insert an entry
        return None
    value = params[key]
    which = value.WhichOneof("parameter_choice")
    if which not in kinds:
        raise bad(f"invalid value type for '{key}' parameter{where}, expected {' or '.join(kinds)}.")
    return getattr(value, which)


def _region(tensor: Any) -> Optional[tuple[str, int, int]]:
    """(region, byte_size, offset) of a tensor in system shared memory, or None."""
    where = f" for tensor '{tensor.name}'"
    params = tensor.parameters
    region = _param(params, "shared_memory_region", ("string_param",), where)
    offset = _param(params, "shared_memory_offset", ("int64_param",), where)
    size = _param(params, "shared_memory_byte_size", ("int64_param",), where)
    if region is None:
        for key, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", size)):
            if value is not None:
                raise bad(f"'{key}' can not be specified without 'shared_memory_region' "
                          f"parameter for tensor '{tensor.name}'")
        return None
    if size is None:
        raise bad(f"'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
                  f"parameter for tensor '{tensor.name}'")
    return region, size, offset or 0


def _request_options(params: Any) -> dict:
    """Backend.infer's keyword arguments from the request's parameters."""
    options: dict[str, Any] = {}
    sequence_id = _param(params, "sequence_id", ("int64_param", "string_param"))
    if sequence_id is not None:
        options["sequence_id"] = sequence_id
    for flag in ("sequence_start", "sequence_end"):
        if _param(params, flag, ("bool_param",)):
            options[flag] = True
    priority = _param(params, "priority", ("int64_param", "uint64_param"))
    if priority is not None:
        if priority < 0:
            raise bad("invalid value for 'priority', expected value >= 0.")
        options["priority"] = priority
    timeout = _param(params, "timeout", ("int64_param",))
    if timeout:
        options["timeout_us"] = max(timeout, 0)
    return options


# --- tensors --------------------------------------------------------------------------------

def _typed_values(tensor: Any, model: str) -> list:
    """The elements of an input given in `contents`, checked as Triton does."""
    given = [field.name for field, _ in tensor.contents.ListFields()]
    if not given:
        return []
    where = f"input tensor '{tensor.name}' for model '{model}'"
    if len(given) > 1:
        raise bad(f"unexpected explicit tensor data for {where}, binary data was already supplied.")
    if _CONTENTS_FIELD.get(tensor.datatype) != given[0]:
        raise bad(f"unexpected explicit tensor data for {where} of type "
                  f"'{_FIELD_DATATYPE[given[0]]}', expected datatype '{tensor.datatype}'")
    return list(getattr(tensor.contents, given[0]))


def _inputs(request: pb.ModelInferRequest, raws: Sequence[Any]) -> list[InputTensor]:
    model = request.model_name
    inputs = []
    next_raw = 0
    for t in request.inputs:
        parsed = InputTensor(t.name, t.datatype, list(t.shape))
        region = _region(t)
        if region is not None:
            if t.HasField("contents"):
                raise bad(f"unexpected 'content' provided when using shared memory for input "
                          f"tensor '{t.name}' for model '{model}'")
            parsed.region, parsed.byte_size, parsed.offset = region
        elif t.HasField("contents"):
            if len(raws):
                raise bad(f"contents field must not be specified when using raw_input_contents "
                          f"for '{t.name}' for model '{model}'")
            parsed.values = _typed_values(t, model)
        elif next_raw < len(raws):
            # raw entries are taken in order by the inputs that have no other data
            parsed.raw = raws[next_raw]
            next_raw += 1
        else:
            raise bad(f"unable to find data for input tensor '{t.name}' for model '{model}' in request.")
        inputs.append(parsed)
    return inputs


def _outputs(request: pb.ModelInferRequest) -> Optional[list[OutputRequest]]:
    if not request.outputs:
        return None                 # every output of the model
    wanted = []
    for o in request.outputs:
        region = _region(o)
        classes = _param(o.parameters, "classification", ("int64_param",))
        if region is not None and classes is not None:
            raise bad("output can't set both 'shared_memory_region' and 'classification'")
        if classes is not None and classes <= 0:
            raise bad("invalid value for 'classification' parameter, expected >= 0")
        out = OutputRequest(o.name, binary=True, classification=classes or 0)
        if region is not None:
            out.region, out.byte_size, out.offset = region
        wanted.append(out)
    return wanted


def _answer(result: InferResponse) -> tuple[pb.ModelInferResponse, list[Any]]:
    """The response without its tensor bytes, and the bytes of each output."""
    header = pb.ModelInferResponse(model_name=result.model_name, model_version=result.model_version,
                                   id=result.id)
    chunks = []
    for t in result.outputs:
        header.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        chunks.append(b"" if t.region is not None else t.raw())
    return header, chunks


def _parse(values: dict, message: Any) -> Any:
    """A daemon answer (Triton's JSON form) as `message`; fields protobuf does
    not know (torchpool's extras) are left out."""
    try:
        return json_format.ParseDict(values, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise TorchpoolError(errors.INTERNAL, str(exc)) from None


# --- the service --------------------------------------------------------------------------------

def _rpc(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """An error becomes the call's gRPC status with the daemon's message."""
    @functools.wraps(method)
    async def call(self: "InferenceServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except TorchpoolError as exc:
            code, message = exc.code, exc.message
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:        # a bug here must not look like the client's fault
            log.exception("gRPC %s failed", method.__name__)
            code, message = errors.INTERNAL, f"{type(exc).__name__}: {exc}"
        await context.abort(getattr(grpc.StatusCode, grpc_status_name(code)), message)
    return call


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    # --- health and metadata

    @_rpc
    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=await self.backend.live())

    @_rpc
    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self.backend.ready())

    @_rpc
    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=await self.backend.model_ready(request.name, request.version))

    @_rpc
    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return _parse(await self.backend.server_metadata(), pb.ServerMetadataResponse())

    @_rpc
    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        meta = await self.backend.model_metadata(request.name, request.version)
        return _parse(meta, pb.ModelMetadataResponse())

    @_rpc
    async def ModelConfig(self, request: Any, context: Any) -> pb.ModelConfigResponse:
        config = await self.backend.model_config(request.name, request.version)
        return _parse({"config": config}, pb.ModelConfigResponse())

    @_rpc
    async def ModelStatistics(self, request: Any, context: Any) -> pb.ModelStatisticsResponse:
        stats = await self.backend.statistics(request.name, request.version)
        return _parse(stats, pb.ModelStatisticsResponse())

    # --- inference

    async def infer(self, request: pb.ModelInferRequest,
                    raws: Sequence[Any]) -> tuple[pb.ModelInferResponse, list[Any]]:
        result = await self.backend.infer(
            request.model_name, request.model_version, _inputs(request, raws), _outputs(request),
            request_id=request.id, binary_default=True, **_request_options(request.parameters))
        return _answer(result)

    @_rpc
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        if isinstance(request, Exception):      # from _parse_infer_request
            raise bad(f"unable to parse the inference request: {request}")
        if isinstance(request, tuple):
            return await self.infer(*request)
        header, chunks = await self.infer(request, request.raw_input_contents)
        header.raw_output_contents.extend(bytes(c) for c in chunks)
        return header

    async def ModelStreamInfer(self, requests: Any, context: Any) -> Any:
        """One response per request, in order; an error is a response
        (error_message), and the stream goes on."""
        async for request in requests:
            try:
                header, chunks = await self.infer(request, request.raw_input_contents)
            except Exception as exc:      # one bad request must not end the stream
                if not isinstance(exc, TorchpoolError):
                    log.exception("gRPC ModelStreamInfer failed")
                message = exc.message if isinstance(exc, TorchpoolError) else f"{type(exc).__name__}: {exc}"
                # with the request's id, as Triton: the client can tell which one failed
                yield pb.ModelStreamInferResponse(error_message=message,
                                                  infer_response=pb.ModelInferResponse(id=request.id))
                continue
            header.raw_output_contents.extend(bytes(c) for c in chunks)
            yield pb.ModelStreamInferResponse(infer_response=header)

    # --- model repository

    @_rpc
    async def RepositoryIndex(self, request: Any, context: Any) -> pb.RepositoryIndexResponse:
        _no_repository_name(request)
        index = await self.backend.repository_index(ready_only=request.ready)
        return _parse({"models": index}, pb.RepositoryIndexResponse())

    @_rpc
    async def RepositoryModelLoad(self, request: Any, context: Any) -> pb.RepositoryModelLoadResponse:
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
    async def RepositoryModelUnload(self, request: Any, context: Any) -> pb.RepositoryModelUnloadResponse:
        _no_repository_name(request)
        if "unload_dependents" in request.parameters \
                and request.parameters["unload_dependents"].WhichOneof("parameter_choice") != "bool_param":
            raise bad("invalid value type for 'unload_dependents' parameter, expected bool_param.")
        # torchpool has no ensembles: a model has no dependents to unload with it
        await self.backend.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # --- system shared memory

    @_rpc
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> pb.SystemSharedMemoryStatusResponse:
        regions = await self.backend.shm_status()
        if request.name:
            # Triton's answer for a name that is not registered (the daemon's
            # is an INVALID_ARG in its own words)
            regions = [r for r in regions if r["name"] == request.name]
            if not regions:
                raise TorchpoolError(errors.NOT_FOUND,
                                     f"Unable to find system shared memory region: '{request.name}'")
        return _parse({"regions": {r["name"]: r for r in regions}}, pb.SystemSharedMemoryStatusResponse())

    @_rpc
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> pb.SystemSharedMemoryRegisterResponse:
        await self.backend.register_shm(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @_rpc
    async def SystemSharedMemoryUnregister(self, request: Any,
                                           context: Any) -> pb.SystemSharedMemoryUnregisterResponse:
        await self.backend.unregister_shm(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # --- what torchpool does not do. Listing and unregistering every CUDA
    # region succeed (there are none): Triton's clients and perf_analyzer
    # clean up both kinds before they start.

    @_rpc
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> pb.CudaSharedMemoryStatusResponse:
        if request.name:
            raise TorchpoolError(errors.NOT_FOUND,
                                 f"Unable to find cuda shared memory region: '{request.name}'")
        return pb.CudaSharedMemoryStatusResponse()

    @_rpc
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        raise _unimplemented(f"failed to register CUDA shared memory region: '{request.name}', "
                             f"torchpool does not support CUDA shared memory: register the "
                             f"region as system shared memory")

    @_rpc
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    @_rpc
    async def TraceSetting(self, request: Any, context: Any) -> Any:
        raise _unimplemented("the server does not support trace")

    @_rpc
    async def LogSettings(self, request: Any, context: Any) -> Any:
        raise _unimplemented("the server does not support dynamic logging")


def _parse_infer_request(data: bytes) -> Any:
    """wire.parse_infer_request, or the error: raised here, grpc would
    answer UNKNOWN with a Python traceback's first line."""
    try:
        return wire.parse_infer_request(data)
    except (wire.WireError, DecodeError) as exc:
        return exc


def _no_repository_name(request: Any) -> None:
    if request.repository_name:
        raise _unimplemented("'repository_name' specification is not supported")


# --- the server ----------------------------------------------------------------------------------

class GrpcServer:
    def __init__(self, server: grpc.aio.Server, port: int) -> None:
        self._server = server
        self.port = port

    async def close(self) -> None:
        """New calls are refused at once; those in flight get CLOSE_GRACE s."""
        await self._server.stop(CLOSE_GRACE)


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


async def start_grpc(backend: Backend, host: str, port: int) -> GrpcServer:
    """Serve GRPCInferenceService for `backend` on host:port (0: any free
    port, see .port). Raises OSError if the address cannot be bound."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # grpc sets SO_REUSEPORT by default: a second server on a busy port
        # would bind and share it instead of failing
        ("grpc.so_reuseport", 0),
    ])
    servicer = InferenceServicer(backend)
    # ModelInfer with the tensor bytes outside protobuf; added first, so it
    # is found before the generated handler for the same method
    fast_infer = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer, request_deserializer=_parse_infer_request,
        response_serializer=wire.serialize_infer_response)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ModelInfer": fast_infer}),))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    try:
        bound = server.add_insecure_port(_address(host, port))
    except RuntimeError:
        bound = 0
    if not bound:
        await server.stop(None)
        raise _bind_error(host, port)
    await server.start()
    return GrpcServer(server, bound)
