"""KServe v2 / Triton HTTP/REST endpoint: Triton's paths, JSON and status codes.

    server = await start_http(backend, "127.0.0.1", 8000)   # binds now; OSError if it cannot
    ... server.port ... await server.close()

Routes are Triton's (its http_server.cc regexes); each handler parses the
request, makes one `Backend` call and writes the answer: Triton's JSON for
the call, `{"error": "..."}` with Triton's status for a failure (404 for an
unknown model, 400 for a bad argument, 503 unavailable, 501 unsupported,
`Backend.http_status`). HTTP itself is http_protocol.py; the infer body and
the binary tensor extension are http_binary.py.

Where torchpool has no counterpart, the answer is Triton's own for a server
built without the feature: tracing, dynamic logging ("the server does not
support ..."), CUDA shared memory (status empty, unregister a no-op,
register refused as on a server without GPUs).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import re
from typing import Callable, Coroutine, Optional
from urllib.parse import unquote

from ..protocol import errors
from ..protocol.errors import TorchpoolError
from ..protocol.messages import BAD_CUDA_HANDLE, CUDA_IPC_HANDLE_BYTES
from ..protocol.names import check_model_name
from .backend import Backend, bad, http_status
from .callers import Caller
from .http_binary import (control_document_off_loop, decompress_off_loop, decompressed_bound, encode_infer,
                          is_raw, parse_infer_off_loop, raw_call)
from .http_bodies import BodyBudget
from .http_messages import Handler, Limits, Request, Response, error_response, head
from .http_protocol import SCRATCH_BYTES, HttpConnection
from .offload import Offload

__all__ = ["HttpServer", "Limits", "start_http"]

log = logging.getLogger("torchpool.gateway.http")

REPORT_INTERVAL_S = 10.0    # at most one warning about refused or early-closed connections this often

_MODEL = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?"
                    r"(?:/(infer|generate|generate_stream|ready|config|stats|trace/setting))?")
_HEALTH = re.compile(r"/v2(?:/health/(live|ready))?")
_SYSTEM_SHM = re.compile(r"/v2/systemsharedmemory(?:/region/([^/]+))?/(status|register|unregister)")
_CUDA_SHM = re.compile(r"/v2/cudasharedmemory(?:/region/([^/]+))?/(status|register|unregister)")
_REPOSITORY = re.compile(r"/v2/repository(?:/([^/]+))?/(index|models/([^/]+)/(load|unload))")

_EMPTY = Response(200, [], None)


def _json(value: object) -> Response:
    return Response(200, [json.dumps(value, separators=(",", ":")).encode()])


def _not_allowed() -> Response:
    return error_response(405, "Method Not Allowed")


def _unavailable(message: str) -> TorchpoolError:
    return TorchpoolError(errors.UNAVAILABLE, message)


class _ErrorWithHeaders(TorchpoolError):
    def __init__(self, code: str, message: str, headers: tuple) -> None:
        super().__init__(code, message)
        self.headers = headers


def _name(text: Optional[str]) -> str:
    """A path segment as the client meant it (tritonclient quotes names)."""
    return unquote(text) if text else ""


def _caller(request: Request) -> Caller:
    """Who sent `request`: its connection's caller (connection_made names it
    before anything is read)."""
    assert request.caller is not None
    return request.caller


async def _body_json(request: Request, offload: Offload) -> Optional[dict]:
    """The body of a control call: None when empty (Triton allows that)."""
    if not len(request.body):
        return None
    doc = await control_document_off_loop(request.body, offload, deep_values=True)
    if not isinstance(doc, dict):
        raise bad("failed to parse the request JSON buffer: expected an object")
    return doc


class Router:
    """Request -> Response for Triton's HTTP API, over one `Backend`; large
    JSON parsed in `offload`'s helper process, decompressed bytes counted in
    `budget` (the body budget of the server's connections)."""

    def __init__(self, backend: Backend, limits: Limits, budget: BodyBudget, offload: Offload) -> None:
        self.backend = backend
        self.limits = limits
        self.budget = budget
        self.offload = offload

    async def __call__(self, request: Request) -> Response:
        path = request.path.partition("?")[0]
        try:
            return await self._route(request, path)
        except TorchpoolError as exc:
            return error_response(http_status(exc.code), exc.message, getattr(exc, "headers", ()))

    async def _route(self, request: Request, path: str) -> Response:
        if path == "/v2/models/stats":
            return await self._stats(request, "", "")
        if path == "/v2/logging":
            return self._unsupported(request, ("GET", "POST"), "the server does not support dynamic logging")
        m = _MODEL.fullmatch(path)
        if m and not (m.group(3) == "trace/setting" and m.group(2)):
            return await self._model(request, check_model_name(_name(m.group(1))), m.group(2) or "",
                                     m.group(3) or "")
        if (m := _HEALTH.fullmatch(path)) is not None:
            return await self._health(request, m.group(1))
        if (m := _SYSTEM_SHM.fullmatch(path)) is not None:
            return await self._system_shm(request, _name(m.group(1)), m.group(2))
        if (m := _CUDA_SHM.fullmatch(path)) is not None:
            return await self._cuda_shm(request, _name(m.group(1)), m.group(2))
        if (m := _REPOSITORY.fullmatch(path)) is not None:
            model = check_model_name(_name(m.group(3))) if m.group(3) is not None else ""
            return await self._repository(request, m.group(1), m.group(2), model, m.group(4))
        if path == "/v2/trace/setting":
            return self._unsupported(request, ("GET", "POST"), "the server does not support tracing")
        return error_response(404, "Not Found")

    @staticmethod
    def _unsupported(request: Request, methods: tuple, message: str) -> Response:
        if request.method not in methods:
            return _not_allowed()
        raise _unavailable(message)

    # --- health and metadata -----------------------------------------------------

    async def _health(self, request: Request, kind: Optional[str]) -> Response:
        if request.method != "GET":
            return _not_allowed()
        if kind is None:                                    # GET /v2
            return _json(await self.backend.server_metadata())
        ok = await (self.backend.live() if kind == "live" else self.backend.ready())
        return _EMPTY if ok else Response(400, [], None)

    async def _model(self, request: Request, model: str, version: str, kind: str) -> Response:
        if kind == "infer":
            return await self._infer(request, model, version) if request.method == "POST" else _not_allowed()
        if kind == "trace/setting":
            return self._unsupported(request, ("GET", "POST"), "the server does not support tracing")
        if kind in ("generate", "generate_stream"):
            return self._unsupported(request, ("POST",), "the server does not support the generate extension")
        if kind == "stats":
            return await self._stats(request, model, version)
        if request.method != "GET":
            return _not_allowed()
        if kind == "ready":
            if await self.backend.model_ready(model, version):
                return _EMPTY
            return error_response(400, "Model version not ready")
        if kind == "config":
            return _json(await self.backend.model_config(model, version))
        return _json(await self.backend.model_metadata(model, version))

    async def _stats(self, request: Request, model: str, version: str) -> Response:
        if request.method != "GET":
            return _not_allowed()
        return _json(await self.backend.statistics(model, version))

    # --- inference ------------------------------------------------------------------

    async def _infer(self, request: Request, model: str, version: str) -> Response:
        body = request.body
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding in ("gzip", "deflate"):
            body = await self._decompressed(request, encoding)
        elif encoding not in ("", "identity"):
            raise _ErrorWithHeaders(errors.UNSUPPORTED, "Unsupported compression type",
                                    (("Accept-Encoding", "gzip, deflate"),))
        if not is_raw(request.headers, len(body)):
            call = await parse_infer_off_loop(body, request.headers, model, version, self.offload)
        else:
            # a raw binary request: the model's config says what the body is
            try:
                call = raw_call(body, await self.backend.recent_config(model, version), model, version)
                result = await self.backend.infer(_caller(request), call)
            except TorchpoolError:
                self.backend.forget_config(model)       # it may have changed: ask again next time
                raise
            return await encode_infer(result, request.headers.get("accept-encoding"))
        result = await self.backend.infer(_caller(request), call)
        return await encode_infer(result, request.headers.get("accept-encoding"))

    async def _decompressed(self, request: Request, encoding: str) -> memoryview:
        """The body decompressed (within the body limit), its bytes counted
        in the budget until the request is answered: room for as much as
        the body could make is waited for first."""
        bound = decompressed_bound(len(request.body), self.limits.max_body)
        await self.budget.reserve(bound)
        request.held += bound
        body = await decompress_off_loop(request.body, encoding, self.limits.max_body)
        self.budget.give(bound - len(body))
        request.held -= bound - len(body)
        return body

    # --- repository ------------------------------------------------------------------

    async def _repository(self, request: Request, repository: Optional[str], kind: str,
                          model: str, action: Optional[str]) -> Response:
        if request.method != "POST":
            return _not_allowed()
        doc = await _body_json(request, self.offload)
        if kind == "index":
            ready = (doc or {}).get("ready", False)
            if not isinstance(ready, bool):
                raise bad("Invalid value for 'ready': expected a boolean")
            return _json(await self.backend.repository_index(ready))
        if repository:
            raise TorchpoolError(errors.UNSUPPORTED, "'repository_name' specification is not supported")
        params = (doc or {}).get("parameters", {})
        if not isinstance(params, dict):
            raise bad(f"Unable to parse 'parameters' of the {action} request for model '{model}': "
                      f"expected an object")
        if action == "unload":
            if not isinstance(params.get("unload_dependents", False), bool):
                raise bad("Unable to parse 'unload_dependents': expected a boolean")
            await self.backend.unload(model)
            return Response(200, [])
        await self.backend.load(model, *self._load_params(model, params))
        return Response(200, [])

    @staticmethod
    def _load_params(model: str, params: dict) -> tuple[Optional[str], dict]:
        config, files = None, {}
        for key, value in params.items():
            if not isinstance(value, str):
                raise bad(f"Unable to parse load parameter '{key}' for model '{model}': expected a string")
            if key == "config":
                config = value
            elif key.startswith("file:"):
                files[key] = value
            else:
                raise bad(f"unexpected load parameter '{key}' for model '{model}': expected 'config' "
                          f"or 'file:<path>'")
        return config, files

    # --- shared memory -----------------------------------------------------------------

    async def _system_shm(self, request: Request, region: str, action: str) -> Response:
        if request.method != ("GET" if action == "status" else "POST"):
            return _not_allowed()
        if action == "status":
            return _json(await self.backend.shm_status(_caller(request), region))
        if action == "unregister":
            await self.backend.unregister_shm(_caller(request), region)
            return Response(200, [])
        if not region:
            raise bad("'region name' is necessary to register system shared memory region")
        doc = await control_document_off_loop(request.body, self.offload)
        if not isinstance(doc, dict):
            raise bad("failed to parse the request JSON buffer: expected an object")
        key, offset, byte_size = self._register_fields(doc)
        await self.backend.register_shm(_caller(request), region, key, offset, byte_size)
        return Response(200, [])

    @staticmethod
    def _register_fields(doc: dict) -> tuple[str, int, int]:
        if "key" not in doc:
            raise bad("Shared memory register request has no 'key' field")
        if "byte_size" not in doc:
            raise bad("Shared memory register request has no 'byte_size' field")
        key, offset, byte_size = doc["key"], doc.get("offset", 0), doc["byte_size"]
        if not isinstance(key, str):
            raise bad("Unable to parse 'key': expected a string")
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise bad(f"Unable to parse '{what}': expected an unsigned integer")
        return key, offset, byte_size

    async def _cuda_shm(self, request: Request, region: str, action: str) -> Response:
        """Triton's CUDA shared-memory API, in its order: the method, then
        whether client shared memory is allowed, the name, the body."""
        if request.method != ("GET" if action == "status" else "POST"):
            return _not_allowed()
        if action == "status":
            return _json(await self.backend.cuda_shm_status(_caller(request), region))
        self.backend.shm.check_allowed()
        if action == "unregister":
            await self.backend.unregister_cuda_shm(_caller(request), region)
            return Response(200, [])
        if not region:
            raise bad("'region name' is necessary to register cuda shared memory region")
        doc = await control_document_off_loop(request.body, self.offload)
        if not isinstance(doc, dict):
            raise bad("failed to parse the request JSON buffer: expected an object")
        raw_handle, device_id, byte_size = self._cuda_register_fields(doc)
        await self.backend.register_cuda_shm(_caller(request), region, raw_handle, device_id, byte_size)
        return Response(200, [])

    @staticmethod
    def _cuda_register_fields(doc: dict) -> tuple[bytes, int, int]:
        """Triton's fields and checks, in its order and words."""
        if "raw_handle" not in doc:
            raise bad("Shared memory register request has no 'raw_handle' field")
        handle = doc["raw_handle"]
        b64 = handle.get("b64") if isinstance(handle, dict) else None
        if not isinstance(b64, str):
            raise bad("Unable to parse 'b64': expected a string in 'raw_handle'")
        for what in ("byte_size", "device_id"):
            value = doc.get(what)
            if type(value) is not int or value < 0:
                raise bad(f"Unable to parse '{what}': expected an unsigned integer")
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise bad(BAD_CUDA_HANDLE) from None
        if len(raw) != CUDA_IPC_HANDLE_BYTES:
            raise bad(BAD_CUDA_HANDLE)
        return raw, doc["device_id"], doc["byte_size"]


class HttpServer:
    """A listening socket and its connections; `port` is the bound one.
    What its connections share: the body budget and the read buffer; a
    connection that goes away is a caller gone (`forget` it).

    Connections are at most `limits.max_connections` (each costs an fd; the
    gateway process sets the cap below its limit). Those with no request in
    hand (idle, or still sending a request's headers) are kept in the order
    they came to be so: at the cap, a new connection takes the place of the
    oldest of them, or is refused (503, closed) when there is none; past
    half the cap, those so for `pressure_timeout` are closed, oldest first,
    down to half. So idle or stalling connections, however many, cannot lock
    other callers out, and a connection with a request in hand (its body
    arriving, or being answered) is never closed for another's sake."""

    def __init__(self, handler: Handler, limits: Limits, budget: BodyBudget,
                 forget: Optional[Callable[[Caller], Coroutine[object, object, None]]] = None) -> None:
        self.handler = handler
        self.limits = limits
        self.budget = budget
        self.scratch = memoryview(bytearray(SCRATCH_BYTES))
        self.forget = forget
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpConnection] = set()
        # connections with no request in hand -> since when; oldest first
        self.reclaimable: dict[HttpConnection, float] = {}
        self.port = 0
        self._server: Optional[asyncio.Server] = None
        self._sweeper: Optional[asyncio.Task[None]] = None
        self._forgetting: set[asyncio.Task[None]] = set()
        self.own_offload: Optional[Offload] = None  # closed with the server
        self.refusal = refusal(limits.max_connections)   # sent past the cap, none reclaimable
        self.refused = self.closed_early = 0        # since the last report
        self._reported_at = -math.inf

    def caller_gone(self, caller: Optional[Caller]) -> None:
        """A connection closed: what its caller registered goes (in a task:
        the daemon is told)."""
        if caller is None or self.forget is None or caller.owner is None:
            if caller is not None:
                caller.gone = True
            return
        task = self.loop.create_task(self.forget(caller))
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)

    def _accepted(self) -> HttpConnection:
        """The protocol factory, called as each connection is accepted (by
        uvloop in its accept loop, so an fd made free here is free for the
        next accept of the same burst)."""
        conn = HttpConnection(self)
        cap = self.limits.max_connections
        if cap and len(self.connections) >= cap:
            if not self.reclaimable:
                conn.turned_away = self.refusal
                self.refused += 1
                return conn
            self._reclaim(next(iter(self.reclaimable)))
        self.connections.add(conn)
        return conn

    def no_request(self, conn: HttpConnection) -> None:
        """`conn` holds no request from now on (idle, or a request's headers begun)."""
        self.reclaimable.pop(conn, None)
        self.reclaimable[conn] = self.loop.time()

    def has_request(self, conn: HttpConnection) -> None:
        """`conn` holds a request (or is gone)."""
        self.reclaimable.pop(conn, None)

    def _reclaim(self, conn: HttpConnection) -> None:
        """Closed early for room: it no longer counts (connection_lost follows)."""
        self.reclaimable.pop(conn, None)
        self.connections.discard(conn)
        conn.made_transport().close()       # (reclaimable: made, and idle or receiving headers)
        self.closed_early += 1

    async def start(self, host: str, port: int) -> "HttpServer":
        self._server = await self.loop.create_server(self._accepted, host, port,
                                                     reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = self.loop.create_task(self._sweep())
        return self

    async def _sweep(self) -> None:
        """One timer for all connections (a timer per request costs more)."""
        limits = self.limits
        interval = min(1.0, limits.header_timeout / 4, limits.io_timeout / 4, limits.idle_timeout / 4,
                       limits.pressure_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = self.loop.time()
            for conn in [c for c in self.connections if c.expired(now) or c.abandoned()]:
                conn.made_transport().abort()   # (a deadline is set once made)
            self._relieve(now)
            self._report(now)

    def _relieve(self, now: float) -> None:
        """Past half the cap: connections with no request in hand for
        `pressure_timeout` are closed, oldest first, down to half."""
        half = self.limits.max_connections // 2
        if not half:
            return
        while len(self.connections) > half and self.reclaimable:
            conn, since = next(iter(self.reclaimable.items()))
            if now - since < self.limits.pressure_timeout:
                return
            self._reclaim(conn)

    def _report(self, now: float) -> None:
        if not (self.refused or self.closed_early) or now - self._reported_at < REPORT_INTERVAL_S:
            return
        log.warning("HTTP connections: %d open of at most %d (--http-max-connections); since the "
                    "last report %d closed early for room (idle, or slow to send a request), %d "
                    "refused (every one with a request in hand)",
                    len(self.connections), self.limits.max_connections, self.closed_early, self.refused)
        self.refused = self.closed_early = 0
        self._reported_at = now

    async def close(self, grace: float = 60.0) -> None:
        """Stop listening and reading; the requests received are answered
        (within `grace` s, then cancelled: the daemon drains meanwhile), then
        every connection is closed."""
        server, sweeper = self._server, self._sweeper
        if server is None or sweeper is None:
            return
        server.close()
        sweeper.cancel()
        for conn in list(self.connections):
            conn.shutdown()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for conn in list(self.connections):
            if conn.transport is not None:  # (else connection_made closes it: shutdown above)
                conn.transport.close()
        await asyncio.gather(sweeper, *self._forgetting, return_exceptions=True)
        await server.wait_closed()
        self._server = None
        if self.own_offload is not None:
            self.own_offload.close()


def refusal(cap: int) -> bytes:
    """What a connection past the cap is sent before it is closed."""
    body = json.dumps({"error": f"the HTTP gateway holds {cap} connections, as many as it accepts "
                                f"(--http-max-connections), each with a request in hand: try again "
                                f"later"}).encode()
    return head(503, "application/json", len(body), (), close=True) + body


async def start_http(backend: Backend, host: str, port: int, limits: Limits = Limits(),
                     offload: Optional[Offload] = None) -> HttpServer:
    """Serve Triton's HTTP/REST API for `backend` on host:port (0 = any free
    port, then see `.port`). Binds before returning; raises OSError if the
    address cannot be bound. Large JSON is parsed in `offload`'s helper
    process (its own if none is given)."""
    budget = BodyBudget(limits.bodies_held)
    router = Router(backend, limits, budget, offload or Offload())
    server = HttpServer(router, limits, budget, backend.forget)
    server.own_offload = router.offload if offload is None else None
    return await server.start(host, port)
