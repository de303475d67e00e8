"""HTTP request bodies: where their bytes go, and how many the gateway holds.

A body of known size is received into one buffer of that size, but the
buffer is anonymous memory the kernel maps page by page as bytes land in it
(`body_buffer`): declaring a 64 MiB body and sending nothing costs nothing.

`BodyBudget` counts the body bytes every connection holds (received,
queued, being served, decompressed) against one limit. A connection that
would go over it stops reading until others give bytes back; it is
resumed in the order it began to wait. Its deadlines run meanwhile: a
client that sends a body too slowly is closed as before, and what it held
is given back. A connection that goes away gives back everything it held
at once; a paused one is checked every second for a reset or a close (one
that closes with its body still unsent sends no FIN past our full window:
it goes at its deadline).
"""
from __future__ import annotations

import asyncio
import mmap
from collections import deque
from typing import Callable, Union

# A request body as received: bytes (one read), a bytearray (chunked, or empty), an
# anonymous mmap (`body_buffer`), or a view of one (decompressed).
Body = Union[bytes, bytearray, memoryview, mmap.mmap]


def body_buffer(size: int) -> Union[bytearray, mmap.mmap]:
    """A writable buffer of `size` bytes whose memory is taken only where
    it is written (size 0: an empty bytearray)."""
    if size <= 0:
        return bytearray()
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class BodyBudget:
    """Request body bytes held by the HTTP gateway, all connections together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiting: deque[Callable[[], None]] = deque()

    def room(self) -> int:
        return max(0, self.limit - self.held)

    def take(self, n: int) -> None:
        self.held += n

    def give(self, n: int) -> None:
        if n <= 0:
            return
        self.held -= n
        # each waiter is called once; one still short of room waits again
        for _ in range(len(self._waiting)):
            if not self.room():
                break
            self._waiting.popleft()()

    def wait(self, resume: Callable[[], None]) -> None:
        """Call `resume` once there is room again (once, in turn)."""
        if resume not in self._waiting:
            self._waiting.append(resume)

    def forget(self, resume: Callable[[], None]) -> None:
        try:
            self._waiting.remove(resume)
        except ValueError:
            pass

    async def reserve(self, n: int) -> None:
        """Take `n` bytes, waiting in turn until they fit (`give` them back).
        A reservation larger than the whole budget waits for an empty one."""
        while self.held and self.held + n > self.limit:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake() -> None:
                if not fut.done():
                    fut.set_result(None)

            self.wait(wake)
            try:
                await fut
            finally:
                self.forget(wake)
        self.take(n)
