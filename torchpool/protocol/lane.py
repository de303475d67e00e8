"""The request lane: inference over a local client's side channel.

A client on the daemon's host that attached its session (broker/local_channel.py)
may send its inference requests over that unix socket instead of ZeroMQ.
A request and its answer then cost two datagrams and two wake-ups, where
ZeroMQ hands every message to an I/O thread on each side first (measured on
the development VM, a 200-byte round trip in Python: 130 µs and 110 µs of
CPU over SOCK_SEQPACKET, 245 µs and 280 µs over ZeroMQ DEALER/ROUTER).

A lane message is the frames of a request or reply, `[header, payload...]`:

    u32 header length, header (msgpack), then per payload frame: u32 length, bytes

and travels in datagrams whose first byte says what they hold: `LAST` (the
message ends here) or `MORE` (a piece; the next one continues it). A
request is always one datagram of at most `MAX_DATAGRAM` bytes (the client
sends a larger one over ZeroMQ); an answer may take several. Datagrams that
hand over segments (fds, local_channel.py) are msgpack maps, whose first
byte is never LAST or MORE: a reader tells them apart by that byte.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from typing_extensions import Buffer

LAST = 0x01
MORE = 0x02
MAX_DATAGRAM = 64 * 1024          # one datagram: well under any host's socket buffer
_LAST_BYTE = bytes([LAST])
_MORE_BYTE = bytes([MORE])
_U32 = struct.Struct("<I")


class LaneError(ValueError):
    """A lane message that does not parse."""


def fits(frames: Sequence[Buffer]) -> bool:
    """Do these frames make one datagram (kind byte and length prefixes included)?"""
    size = 1 + 4 * len(frames)
    for frame in frames:
        size += memoryview(frame).nbytes
    return size <= MAX_DATAGRAM


def request(frames: Sequence[Buffer]) -> list[Buffer]:
    """The buffers of a request's one datagram (the caller checked `fits`)."""
    return [_LAST_BYTE, *encode(frames)]


def encode(frames: Sequence[Buffer]) -> list[Buffer]:
    """The buffers of one message (for sendmsg, or to join): length prefixes
    and the frames themselves, not copied."""
    parts: list[Buffer] = []
    for frame in frames:
        parts.append(_U32.pack(memoryview(frame).nbytes))
        parts.append(frame)
    return parts


def datagrams(frames: Sequence[Buffer]) -> list[list[Buffer]]:
    """One message as datagrams, each a list of buffers to send with
    sendmsg: a small message is one datagram (nothing copied), a large one
    is cut into pieces of MAX_DATAGRAM bytes."""
    if fits(frames):
        return [request(frames)]
    body = memoryview(b"".join(encode(frames)))
    step = MAX_DATAGRAM - 1
    out: list[list[Buffer]] = [[_MORE_BYTE, body[i:i + step]] for i in range(0, len(body), step)]
    out[-1][0] = _LAST_BYTE
    return out


def decode(body: Buffer) -> list[memoryview]:
    """The frames of one message (views into `body`)."""
    view = memoryview(body).cast("B")
    frames: list[memoryview] = []
    at, end = 0, len(view)
    while at < end:
        if at + 4 > end:
            raise LaneError("a frame length is cut short")
        (n,) = _U32.unpack_from(view, at)
        at += 4
        if n > end - at:
            raise LaneError(f"a frame of {n} bytes is cut short")
        frames.append(view[at:at + n])
        at += n
    if not frames:
        raise LaneError("a message without a header")
    return frames
