"""The gateways' baselines: the least a server in the same framework does to
answer tritonclient's add/sub request, with no daemon behind it.

    python scripts/gateway_echo.py grpc|http [--port N]

prints `port <N>` once it listens on 127.0.0.1 (N = 0 or none: a free port)
and serves until SIGTERM or SIGINT. Both answer only `addsub`'s ModelInfer /
`POST /v2/models/addsub/infer` (INPUT0, INPUT1 FP32 -> OUTPUT0 = a + b,
OUTPUT1 = a - b), with the bytes torchpool's gateways send:

  * grpc: grpcio's asyncio server with the generated servicer
    (torchpool/gateway/proto); the request parsed whole by protobuf, the
    response built and serialized by protobuf, outputs in
    raw_output_contents;
  * http: asyncio.Protocol + httptools.HttpRequestParser, HTTP/1.1
    keep-alive; the request's JSON header parsed (json.loads: it says where
    each input's binary bytes are), the response's JSON header written
    (json.dumps), outputs as binary data after it
    (Inference-Header-Content-Length), in one write.

Each computes a + b and a - b with numpy on the received bytes (no
precomputed answer) and checks nothing else: no model lookup, no shapes,
no datatypes. Both run on the loop torchpool's gateway runs on (uvloop when
installed, as torchpool/gateway/process.py chooses).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "addsub"


def add_sub(a: Any, b: Any) -> tuple[bytes, bytes]:
    x, y = np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)
    return (x + y).tobytes(), (x - y).tobytes()


# ------------------------------------------------------------------- gRPC

async def serve_grpc(port: int, ready: Callable[[int], None], stop: asyncio.Event) -> None:
    import grpc

    sys.path.insert(0, str(ROOT))
    from torchpool.gateway.proto import grpc_service_pb2 as pb
    from torchpool.gateway.proto import grpc_service_pb2_grpc as pb_grpc

    class Echo(pb_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request: Any, context: Any) -> Any:
            raw = dict(zip((i.name for i in request.inputs), request.raw_input_contents))
            out0, out1 = add_sub(raw["INPUT0"], raw["INPUT1"])
            answer = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
            for name, shape in (("OUTPUT0", request.inputs[0].shape), ("OUTPUT1", request.inputs[0].shape)):
                answer.outputs.add(name=name, datatype="FP32", shape=shape)
            answer.raw_output_contents.extend((out0, out1))
            return answer

        # what perf_analyzer asks before it sends (fixed answers: addsub's)
        async def ModelMetadata(self, request: Any, context: Any) -> Any:
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=MODEL, versions=["1"], platform="pytorch_libtorch",
                inputs=[tensor(name=n, datatype="FP32", shape=[-1, 16]) for n in ("INPUT0", "INPUT1")],
                outputs=[tensor(name=n, datatype="FP32", shape=[-1, 16]) for n in ("OUTPUT0", "OUTPUT1")])

        async def ModelConfig(self, request: Any, context: Any) -> Any:
            from torchpool.gateway.proto import model_config_pb2 as mc
            fp32 = mc.DataType.Value("TYPE_FP32")
            return pb.ModelConfigResponse(config=mc.ModelConfig(
                name=MODEL, platform="pytorch_libtorch", max_batch_size=8,
                input=[mc.ModelInput(name=n, data_type=fp32, dims=[16]) for n in ("INPUT0", "INPUT1")],
                output=[mc.ModelOutput(name=n, data_type=fp32, dims=[16]) for n in ("OUTPUT0", "OUTPUT1")]))

        async def ServerMetadata(self, request: Any, context: Any) -> Any:
            return pb.ServerMetadataResponse(name="echo", version="0")

        async def ModelStatistics(self, request: Any, context: Any) -> Any:
            return pb.ModelStatisticsResponse(model_stats=[pb.ModelStatistics(name=MODEL, version="1")])

    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready(bound)
    await stop.wait()
    await server.stop(None)


# ------------------------------------------------------------------- HTTP

PATH = f"/v2/models/{MODEL}/infer".encode()
_MISSING = b'{"error":"only POST /v2/models/addsub/infer is served"}'
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" \
            % (len(_MISSING), _MISSING)


def _json_answer(value: object) -> bytes:
    body = json.dumps(value, separators=(",", ":")).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body), body)


# what perf_analyzer asks before it sends (fixed answers: addsub's)
_TENSORS = {"inputs": ["INPUT0", "INPUT1"], "outputs": ["OUTPUT0", "OUTPUT1"]}
FIXED_ANSWERS = {
    b"/v2": _json_answer({"name": "echo", "version": "0", "extensions": []}),
    f"/v2/models/{MODEL}".encode(): _json_answer({
        "name": MODEL, "versions": ["1"], "platform": "pytorch_libtorch",
        **{kind: [{"name": n, "datatype": "FP32", "shape": [-1, 16]} for n in names]
           for kind, names in _TENSORS.items()}}),
    f"/v2/models/{MODEL}/config".encode(): _json_answer({
        "name": MODEL, "platform": "pytorch_libtorch", "max_batch_size": 8,
        **{kind[:-1]: [{"name": n, "data_type": "TYPE_FP32", "dims": [16]} for n in names]
           for kind, names in _TENSORS.items()}}),
    f"/v2/models/{MODEL}/stats".encode(): _json_answer({"model_stats": [{"name": MODEL, "version": "1"}]}),
}


class EchoHttp(asyncio.Protocol):
    """One connection: requests parsed by httptools, answered in order."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpRequestParser(self)
        self.transport: Optional[asyncio.Transport] = None
        self.url = b""
        self.header_length = 0
        self.body: list[bytes] = []

    # asyncio
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:  # noqa: BLE001 - a malformed request ends its connection
            self.transport.close()

    # httptools
    def on_message_begin(self) -> None:
        self.url, self.header_length, self.body = b"", 0, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"inference-header-content-length":
            self.header_length = int(value)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        fixed = FIXED_ANSWERS.get(self.url) if self.parser.get_method() == b"GET" else None
        if fixed is not None:
            self.transport.write(fixed)
        elif self.parser.get_method() != b"POST" or self.url != PATH:
            self.transport.write(NOT_FOUND)
        else:
            self.transport.write(self.answer(b"".join(self.body)))
        if not self.parser.should_keep_alive():
            self.transport.close()

    def answer(self, body: bytes) -> bytes:
        n = self.header_length or len(body)
        request = json.loads(body[:n])
        raw, at = {}, n
        for i in request["inputs"]:
            size = i["parameters"]["binary_data_size"]
            raw[i["name"]] = body[at:at + size]
            at += size
        out0, out1 = add_sub(raw["INPUT0"], raw["INPUT1"])
        shape = request["inputs"][0]["shape"]
        header = {"model_name": MODEL, "model_version": "1"}
        if "id" in request:
            header["id"] = request["id"]
        header["outputs"] = [{"name": name, "datatype": "FP32", "shape": shape,
                              "parameters": {"binary_data_size": len(data)}}
                             for name, data in (("OUTPUT0", out0), ("OUTPUT1", out1))]
        head = json.dumps(header, separators=(",", ":")).encode()
        return b"".join((b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                         b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
                         % (len(head), len(head) + len(out0) + len(out1)), head, out0, out1))


async def serve_http(port: int, ready: Callable[[int], None], stop: asyncio.Event) -> None:
    server = await asyncio.get_running_loop().create_server(EchoHttp, "127.0.0.1", port)
    ready(server.sockets[0].getsockname()[1])
    await stop.wait()
    server.close()
    await server.wait_closed()


# ------------------------------------------------------------------- main

SERVERS: dict[str, Callable[[int, Callable[[int], None], asyncio.Event], Awaitable[None]]] = {
    "grpc": serve_grpc, "http": serve_http}


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


async def main_async(kind: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(bound: int) -> None:
        print(f"port {bound}", flush=True)

    await SERVERS[kind](port, ready, stop)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(SERVERS))
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    args = parser.parse_args(argv)
    if loop_name() == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main_async(args.kind, args.port))
    else:
        asyncio.run(main_async(args.kind, args.port))
    return 0


# ---------------------------------------------------------- for the callers

class EchoProcess:
    """One echo server in its own process (`kind`: grpc or http), on a free
    loopback port it reports once listening."""

    def __init__(self, kind: str, timeout: float = 30.0) -> None:
        import subprocess

        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), kind],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        try:
            self.port = self._read_port(timeout)
        except BaseException:
            self.stop()
            raise
        self.pid = self.proc.pid

    def _read_port(self, timeout: float) -> int:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RuntimeError(f"the {self.kind} echo server did not listen in {timeout:.0f} s")
        line = self.proc.stdout.readline().decode()
        if not line.startswith("port "):
            raise RuntimeError(f"the {self.kind} echo server exited ({self.proc.wait(10)}): {line!r}")
        return int(line.split()[1])

    def stop(self, timeout: float = 10.0) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.proc.stdout.close()

    def __enter__(self) -> "EchoProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
