"""HTTP/1.1 for the gateway: an asyncio protocol per connection, httptools
(llhttp, in C) for the request line and headers, no framework.

Why not a framework: a tiny inference request is a few hundred bytes each way
and every microsecond in the server is latency the client sees; uvicorn's
ASGI layer and aiohttp's request objects cost more per request than this
whole module (figures in the commit that added it).

A connection serves its requests one at a time, in order. Pipelined requests
wait parsed: once more than MAX_PIPELINED wait, reading pauses (what one
read of SCRATCH_BYTES held is parsed whole, so that bounds the queue too);
between two of them the loop serves other connections.
A body whose size is known (Content-Length) is received straight into one
buffer of that size: the socket reads into it, nothing is copied before the
gateway's single copy into shared memory; its memory is taken as the bytes
arrive (http_bodies.py). Responses are written as a header plus the caller's
chunks (memoryviews of the worker's shared memory are written as they are).
Headers and small bodies are read into one scratch buffer that every
connection of the server shares (a read is parsed whole before the next).

Limits on what a client can make us hold (`Limits`): the body size, the
body bytes held by all connections together (`max_bodies_held`), the
header size, the requests parsed ahead, and deadlines (the headers of a
request must arrive within `header_timeout` of its first byte, a body or a
response must make progress every `io_timeout`, an idle keep-alive
connection is closed after `idle_timeout`, sooner when connections run
short: http_server.HttpServer). A malformed request is answered
400 in its turn and the connection closed. Each connection is one caller
(callers.py): what it registered goes when it does.
"""
from __future__ import annotations

import asyncio
import logging
import math
import select
from collections import deque
from typing import TYPE_CHECKING, Optional, Protocol, Union, cast

import httptools

from .callers import Caller
from .tcp_table import socket_address
from .http_bodies import Body, BodyBudget, body_buffer
from .http_messages import Handler, Limits, Request, Response, error_response
from .http_messages import head as head_of

if TYPE_CHECKING:
    import mmap

log = logging.getLogger("torchpool.gateway.http")

MAX_PIPELINED = 16                  # parsed requests waiting behind the one being served
MAX_PIPELINED_BYTES = 64 << 20      # ... and their bodies in all
SCRATCH_BYTES = 64 << 10            # the read buffer for headers and small bodies


class _Reject(Exception):
    """A request we answer with an error and then close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Partial:
    """The request being received."""

    __slots__ = ("url", "headers", "size", "length", "buf", "filled", "whole", "method", "keep_alive",
                 "upgrade", "held")

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict = {}
        self.size = 0               # header bytes so far
        self.length: Optional[int] = None
        self.buf: Union[bytearray, mmap.mmap, None] = None   # body_buffer(length), or a bytearray for a chunked body
        self.filled = 0
        self.whole: Optional[bytes] = None   # a body that came in one piece, kept as it came
        self.method = ""
        self.keep_alive = True
        self.upgrade = False
        self.held = 0               # body bytes taken from the budget

    def body(self) -> Body:
        if self.buf is not None:
            return self.buf
        return self.whole if self.whole is not None else b""


class ConnectionHost(Protocol):
    """What a connection uses of its server (http_server.HttpServer, which imports this module)."""

    handler: Handler
    limits: Limits
    budget: BodyBudget
    scratch: memoryview
    loop: asyncio.AbstractEventLoop
    connections: set[HttpConnection]

    def caller_gone(self, caller: Optional[Caller]) -> None: ...

    def no_request(self, conn: HttpConnection) -> None: ...

    def has_request(self, conn: HttpConnection) -> None: ...


class HttpConnection(asyncio.BufferedProtocol):
    """One client connection; `server` gives the handler, the limits, the
    loop and the set of connections (http_server.HttpServer)."""

    def __init__(self, server: ConnectionHost) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.budget: BodyBudget = server.budget
        self.transport: Optional[asyncio.Transport] = None
        self.caller: Optional[Caller] = None
        self.parser: Optional[httptools.HttpRequestParser] = httptools.HttpRequestParser(self)
        self.scratch: memoryview = server.scratch   # shared: each read is parsed before the next
        self.direct: Optional[memoryview] = None    # the rest of a body, read into place
        self.cur: Optional[_Partial] = None
        self.refusal: Optional[_Reject] = None      # raised by a parser callback
        self.queue: deque[Union[Request, _Reject]] = deque()    # to answer in turn
        self.queued_bytes = 0
        self.task: Optional[asyncio.Task[None]] = None
        self.closed = False
        self.reading = True
        self.starved = False                        # paused until the budget has room
        self.stopped = False                        # no more requests will be parsed
        self.shut = False                           # the server closes: nothing more is read
        self.lingering = False
        self.drained: Optional[asyncio.Future[None]] = None
        self.deadline = math.inf
        self.turned_away: Optional[bytes] = None    # past the server's cap: sent this, then closed

    def made_transport(self) -> asyncio.Transport:
        """The connection's transport: connection_made gives it before any
        other event (a parser callback, a request to serve, a deadline)."""
        assert self.transport is not None
        return self.transport

    def _cur(self) -> _Partial:
        """The request being received: the parser's callbacks for a request
        come between on_message_begin, which makes it, and _complete."""
        assert self.cur is not None
        return self.cur

    # --- transport events -----------------------------------------------------

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        # a stream's (uvloop's transports are not asyncio.Transport subclasses)
        transport = self.transport = cast(asyncio.Transport, base)
        if self.turned_away is not None:
            # nothing it sends is read: the answer may be lost to a reset
            # if it sent a request meanwhile, but it is closed either way
            transport.write(self.turned_away)
            transport.close()
            return
        if self.shut:
            transport.close()               # the server closed between its accept and now
            return
        peer = transport.get_extra_info("peername")
        ours = transport.get_extra_info("sockname")
        ip = isinstance(peer, tuple) and len(peer) >= 2
        where = f"{peer[0]}:{peer[1]}" if ip else "?"
        self.caller = Caller(f"HTTP {where}", socket_address(peer[0], peer[1]) if ip else None,
                             ours[1] if isinstance(ours, tuple) and len(ours) >= 2 else 0)
        self._idle()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        # a request being served finishes; its answer is dropped. Whatever
        # else this connection held is given back now (the parser refers to
        # the connection: without this, only the garbage collector would)
        self.closed = True
        self.server.connections.discard(self)
        self.server.has_request(self)           # gone: no longer to be reclaimed
        self._wake_writer()
        self.budget.forget(self._room)
        held = sum(r.held for r in self.queue if isinstance(r, Request))
        if self.cur is not None:
            held += self.cur.held
        self.budget.give(held)
        if self.direct is not None:
            self.direct.release()
        self.cur = self.direct = self.parser = None
        self.queue.clear()
        self.queued_bytes = 0
        self.server.caller_gone(self.caller)

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()

    def resume_writing(self) -> None:
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.direct is None:
            return self.scratch
        # no more than the budget has room for (a page at least: the read
        # that found it full paused reading)
        return self.direct[:max(self.budget.room(), 4096)]

    def buffer_updated(self, nbytes: int) -> None:
        if self.stopped:
            return
        if self.direct is not None:
            self._direct_received(self.direct, nbytes)
            self._check_budget()
            return
        data: Optional[memoryview] = self.scratch[:nbytes]
        while data is not None and not self.closed:
            data = self._feed(data)
        cur = self.cur
        if cur is not None and cur.length is not None and cur.method:
            if cur.buf is None and cur.whole is None and cur.length > SCRATCH_BYTES:
                cur.buf = body_buffer(cur.length)   # a big body not begun: all of it into place
            if cur.buf is not None and cur.filled < cur.length:
                # the rest of this body goes straight into its buffer, past the parser
                self.direct = memoryview(cur.buf)[cur.filled:]
        self._check_budget()

    def _feed(self, data: memoryview) -> Optional[memoryview]:
        """Parse `data`; what is left to parse after an Upgrade request."""
        parser = self.parser
        assert parser is not None           # (None once closed: nothing is read then)
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            # the callback's own exception is not reliably chained to this
            # one (httptools may chain whatever exception was last handled),
            # so a refusal is kept on the connection when it is made
            self._reject(self.refusal or _Reject(400, "malformed HTTP request"))
        except httptools.HttpParserUpgrade as exc:
            # Upgrade is ignored (a server may; curl --http2 asks for h2c):
            # the request is served as plain HTTP/1.1
            self.parser = httptools.HttpRequestParser(self)
            return self._upgrade_body(data[exc.args[0]:])
        except httptools.HttpParserError as exc:
            self._reject(_Reject(400, f"malformed HTTP request: {exc}"))
        return None

    def _upgrade_body(self, rest: memoryview) -> Optional[memoryview]:
        """llhttp ends an Upgrade request at its headers: read its body here;
        what is left to parse after it (None: the body goes on)."""
        cur = self.cur
        if cur is None or not cur.length:
            return rest
        cur.buf = body_buffer(cur.length)
        cur.filled = min(len(rest), cur.length)
        cur.buf[:cur.filled] = rest[:cur.filled]
        self._hold(cur, cur.filled)
        if cur.filled < cur.length:
            return None                     # buffer_updated reads the rest into place
        self._complete()
        return rest[cur.length:]

    def eof_received(self) -> Optional[bool]:
        # a half-closed client still gets the answers to what it sent
        self.stopped = True
        return self.task is not None and not self.lingering

    def _direct_received(self, direct: memoryview, nbytes: int) -> None:
        """`nbytes` of the body read into `direct` (self.direct), past the parser."""
        cur = self._cur()
        self.deadline = self.loop.time() + self.limits.io_timeout
        self._hold(cur, nbytes)
        self.direct = direct = direct[nbytes:]
        if len(direct):
            return
        direct.release()
        self.direct = None
        assert cur.length is not None       # (a body is read into place only when its size is known)
        cur.filled = cur.length
        # the parser still waits for this body: a fresh one reads the next request
        self.parser = httptools.HttpRequestParser(self)
        self._complete()

    # --- parser callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.task is None:
            self.server.no_request(self)        # until its headers are in (the oldest go first)
        self.cur = _Partial()
        self.deadline = self.loop.time() + self.limits.header_timeout

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        self._cur().url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        self._cur().headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def _count(self, n: int) -> None:
        cur = self._cur()
        cur.size += n
        if cur.size > self.limits.max_header:
            raise self._refuse(431, f"request headers exceed {self.limits.max_header} bytes")

    def on_headers_complete(self) -> None:
        self.server.has_request(self)
        cur, parser = self._cur(), self.parser
        assert parser is not None           # (the one calling)
        cur.method = parser.get_method().decode("latin-1")
        cur.keep_alive = parser.should_keep_alive()
        cur.upgrade = parser.should_upgrade()
        coding = cur.headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            # llhttp frames "gzip, chunked" as chunked and leaves the gzip to us:
            # refused (RFC 9112: 501 for a transfer coding the server does not know)
            raise self._refuse(501, f"unsupported Transfer-Encoding '{coding[:40]}': only chunked is "
                               f"supported (send compressed bodies with Content-Encoding)")
        if cur.upgrade and coding is not None:
            raise self._refuse(400, "an Upgrade request with a chunked body is not supported")
        length = cur.headers.get("content-length")
        if length is not None and "transfer-encoding" not in cur.headers:
            cur.length = int(length)        # llhttp checked it is a number
            if cur.length > self.limits.max_body:
                raise self._refuse(413, f"request body of {cur.length} bytes exceeds the limit of "
                                   f"{self.limits.max_body} bytes (--http-max-input-size)")
        if cur.headers.get("expect", "").lower() == "100-continue":
            self.made_transport().write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.deadline = self.loop.time() + self.limits.io_timeout

    def on_body(self, chunk: bytes) -> None:
        cur = self._cur()
        self._hold(cur, len(chunk))
        if cur.length is not None:
            if cur.buf is None:
                if len(chunk) == cur.length:        # all in one read: keep it as it came
                    cur.whole = chunk
                    return
                cur.buf = body_buffer(cur.length)
            cur.buf[cur.filled:cur.filled + len(chunk)] = chunk
            cur.filled += len(chunk)
            return
        # chunked: gathered as it comes, within the limit
        if cur.buf is None:
            cur.buf = bytearray()
        buf = cur.buf
        assert isinstance(buf, bytearray)   # (body_buffer's are for bodies of a known size)
        if len(buf) + len(chunk) > self.limits.max_body:
            raise self._refuse(413, f"request body exceeds the limit of {self.limits.max_body} bytes "
                               f"(--http-max-input-size)")
        buf += chunk

    def on_message_complete(self) -> None:
        cur = self._cur()
        if not (cur.upgrade and cur.length):
            self._complete()

    def _complete(self) -> None:
        cur, self.cur = self._cur(), None
        path = cur.url.decode("latin-1")
        body = cur.body()
        self.queued_bytes += len(body)
        self.queue.append(Request(cur.method, path, cur.headers, body, cur.keep_alive, self.caller,
                                  cur.held))
        if not cur.keep_alive:
            self.stopped = True             # whatever follows is not read
        self._kick()

    # --- the budget of body bytes ------------------------------------------------

    def _hold(self, cur: _Partial, n: int) -> None:
        cur.held += n
        self.budget.take(n)

    def _check_budget(self) -> None:
        """Stop reading while the budget is spent and this connection would
        take more: a body being received, or requests parsed ahead."""
        if self.closed or self.lingering or self.budget.room():
            return
        if self.direct is None and self.cur is None and not self.queue:
            return                          # between requests: the next headers cost nothing
        if not self.starved:
            self.starved = True
            self.budget.wait(self._room)
            self._update_reading()

    def _room(self) -> None:
        """The budget has room again (called by it, once, in turn)."""
        self.starved = False
        self._update_reading()

    # --- serving -------------------------------------------------------------------

    def _refuse(self, status: int, message: str) -> _Reject:
        """A refusal raised from a parser callback; `_feed` answers it."""
        self.refusal = _Reject(status, message)
        return self.refusal

    def _reject(self, why: _Reject) -> None:
        """Answer `why` after the requests before it, then close: the stream
        cannot be trusted past a bad request."""
        self.stopped = True
        self.direct = None
        self.cur = None
        self.queue.append(why)
        self._kick()

    def _kick(self) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self._serve())
        self._update_reading()

    def _update_reading(self) -> None:
        """Read, or not: paused while too many requests wait parsed (they
        resume at half), while the budget is spent for us, and for good once
        the server closes (lingering reads on, to drop what comes)."""
        if self.closed:
            return
        if self.lingering:
            want = True
        elif self.starved or self.shut:
            want = False
        elif self.reading:
            want = len(self.queue) <= MAX_PIPELINED and self.queued_bytes <= MAX_PIPELINED_BYTES
        else:
            want = len(self.queue) <= MAX_PIPELINED // 2 and self.queued_bytes <= MAX_PIPELINED_BYTES // 2
        if want != self.reading:
            self.reading = want
            if want:
                self.made_transport().resume_reading()
            else:
                self.made_transport().pause_reading()

    async def _serve(self) -> None:
        try:
            while self.queue and not self.closed:
                item = self.queue.popleft()
                if isinstance(item, _Reject):
                    self._write(error_response(item.status, str(item)), close=True, linger=True)
                    return
                self.queued_bytes -= len(item.body)
                self._update_reading()
                try:
                    response = await self._answer(item)
                finally:
                    # the body's bytes are ours no more (the handler may have
                    # added what it decompressed)
                    self.budget.give(item.held)
                    item.held = 0
                    item.body = b""
                if self.closed:
                    return
                close = not item.keep_alive or (self.stopped and not self.queue)
                self._write(response, close)
                del response, item          # the views of shared memory go with the transport
                if close:
                    return
                if self.drained is not None:
                    await self._drain(self.drained)
                elif self.queue:
                    # the next request was pipelined: other connections have a
                    # turn first. An answer made without waiting (a refusal, a
                    # health check) would otherwise follow the one before it at
                    # once: a client's whole queue of them in one go while every
                    # other caller waits (e.g. 1 MiB control documents nested too
                    # deeply, each cut and parsed in the loop)
                    await asyncio.sleep(0)
        finally:
            self.task = None
            if not self.lingering and not self.made_transport().is_closing():
                if self.cur is None:
                    self._idle()
                elif not self.cur.method:           # the next request's headers are coming
                    self.server.no_request(self)

    def _idle(self) -> None:
        """Nothing received, nothing to answer: closed after `idle_timeout`,
        sooner when the server is short of connections (HttpServer)."""
        self.deadline = self.loop.time() + self.limits.idle_timeout
        self.server.no_request(self)

    async def _answer(self, request: Request) -> Response:
        try:
            return await self.server.handler(request)
        except asyncio.CancelledError:
            raise
        except Exception:                   # a bug must not take the connection's order with it
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(500, "internal error in the HTTP gateway")

    async def _drain(self, drained: asyncio.Future[None]) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(drained), self.limits.io_timeout)
        except asyncio.TimeoutError:        # a peer that does not read its answers
            self.made_transport().abort()

    def _write(self, response: Response, close: bool, linger: bool = False) -> None:
        length = sum(len(c) if not isinstance(c, memoryview) else c.nbytes for c in response.chunks)
        head = head_of(response.status, response.content_type, length, response.headers, close)
        transport = self.made_transport()
        write = transport.write
        if len(response.chunks) == 1 and length < 16384:
            write(head + bytes(response.chunks[0]))     # one send for a small answer
        else:
            write(head)
            for chunk in response.chunks:
                if len(chunk):
                    write(chunk)
        if linger and transport.can_write_eof():
            self._linger()
        elif close:
            transport.close()

    def _linger(self) -> None:
        """After refusing a request whose body may still be coming: stop
        sending but read on (and drop) for up to `io_timeout`, so that the
        client reads the answer instead of a reset from closing on unread data."""
        self.lingering = True
        self.made_transport().write_eof()
        self._update_reading()
        self.deadline = self.loop.time() + self.limits.io_timeout

    def shutdown(self) -> None:
        """The server closes: answer what was received, read nothing more."""
        self.stopped = self.shut = True
        if self.task is None:
            if self.transport is not None:  # (else connection_made closes it)
                self.transport.close()
        else:
            self._update_reading()

    def abandoned(self) -> bool:
        """Paused in the middle of a body (the budget is spent) and its
        client reset the connection or closed it: paused, it would not see
        that until its deadline, holding what it received. (A client that
        closes with body bytes still unsent gets no FIN through our full
        window: that one is closed at its deadline.)"""
        transport = self.transport
        if not self.starved or (self.cur is None and self.direct is None) or self.closed \
                or transport is None or transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        try:
            poll = select.poll()
            poll.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            return bool(poll.poll(0))
        except (AttributeError, ValueError, OSError):
            return False

    def expired(self, now: float) -> bool:
        """Past its deadline: receiving a request too slowly, or idle too long
        (a connection whose request is being served is never idle)."""
        if self.task is not None and self.cur is None:
            return False
        return now > self.deadline
