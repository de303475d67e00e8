"""HTTP/1.1 messages as the gateway sees them: a parsed `Request`, the
`Response` a handler returns and how its head is written, and the `Limits`
on what a client may send (http_protocol.py enforces them)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from .callers import Caller
from .defaults import MAX_INPUT_BYTES
from .http_bodies import Body

# A body is held whole in memory, at most this (--http-max-input-size); a
# compressed body is held to the same limit once decompressed.
MAX_BODY_BYTES = MAX_INPUT_BYTES
# Body bytes held by every connection together, by default: this many of
# the largest bodies (the budget of http_bodies.py).
BODIES_HELD = 4
MAX_HEADER_BYTES = 64 << 10         # request line + headers (llhttp has no limit of its own)

_REASONS = {200: "OK", 100: "Continue", 400: "Bad Request", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 413: "Payload Too Large",
            429: "Too Many Requests", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
            504: "Gateway Timeout"}


@dataclass(frozen=True)
class Limits:
    max_body: int = MAX_BODY_BYTES
    max_bodies_held: int = 0        # bytes, all connections together; 0: BODIES_HELD * max_body
    max_header: int = MAX_HEADER_BYTES
    header_timeout: float = 30.0    # first byte of a request -> end of its headers
    io_timeout: float = 60.0        # longest pause while a body arrives or a response leaves
    idle_timeout: float = 300.0     # a keep-alive connection with nothing to do
    # connections at once (0: no cap; the gateway process sets one below its
    # fd limit). Past half of it, one idle or still sending a request's
    # headers for `pressure_timeout` is closed (http_server.HttpServer).
    max_connections: int = 0
    pressure_timeout: float = 5.0

    @property
    def bodies_held(self) -> int:
        # never less than one whole body: a body larger than the budget could not be received
        return max(self.max_bodies_held or BODIES_HELD * self.max_body, self.max_body)


@dataclass
class Request:
    method: str
    path: str                       # as sent, query string included
    headers: dict                   # lower-case name -> value (latin-1 text)
    body: Body                      # bytes, bytearray, an anonymous mmap or b""
    keep_alive: bool = True
    caller: Optional[Caller] = None
    held: int = 0                   # body bytes counted in the budget (given back once answered)


@dataclass
class Response:
    status: int
    chunks: list                    # bytes-like, written in order after the headers
    content_type: Optional[str] = "application/json"
    headers: tuple = ()             # extra (name, value) pairs


Handler = Callable[[Request], Awaitable[Response]]


def error_response(status: int, message: str, headers: tuple = ()) -> Response:
    return Response(status, [json.dumps({"error": message}).encode()], headers=headers)


def head(status: int, content_type: Optional[str], length: int, headers: tuple, close: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    lines.extend(f"{k}: {v}" for k, v in headers)
    lines.append(f"Content-Length: {length}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
