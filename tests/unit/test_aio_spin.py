"""An AsyncClient's direct path waits as the sync client's does
(client/aio_lane.py, rules/spin.py): while its answers come sooner than the
daemon's window, a waiting call keeps the event loop from sleeping in its
selector, other tasks still run, and it never keeps it awake past the window.
Real sockets, a real event loop; its selector counts the waits that sleep."""
from __future__ import annotations

import asyncio
import selectors
import socket
from typing import Optional

from torchpool.client.aio_lane import AsyncDirect
from torchpool.protocol import lane, messages


class CountingSelector(selectors.DefaultSelector):
    """The loop's selector; counts its waits that may sleep (a timeout other than 0)."""

    sleeps = 0

    def select(self, timeout: Optional[float] = None):  # type: ignore[override]
        if timeout is None or timeout > 0:
            self.sleeps += 1
        return super().select(timeout)


class Worker:
    """The far end of a direct path: answers each request at once, or holds
    them while `hold` is set."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.sock, self.hold, self.held = sock, False, []
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._on_request)

    def _on_request(self) -> None:
        frames = lane.decode(memoryview(self.sock.recv(65536))[1:])
        rid = messages.unpack(frames[0])["id"]
        self.held.append(rid)
        if not self.hold:
            self.answer()

    def answer(self) -> None:
        for rid in self.held:
            self.sock.sendmsg(lane.request([messages.pack({"id": rid, "ok": True})]))
        self.held.clear()


def run(window_us: int, body) -> None:
    selector = CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        path = AsyncDirect(a, "m", "ipc://test", on_late=lambda header: None)
        path.spin(window_us)
        loop.run_until_complete(body(path, Worker(loop, b), selector))
        path.shut()
    finally:
        loop.close()
        b.close()


def call(path: AsyncDirect, rid: int) -> "asyncio.Future":
    return asyncio.ensure_future(path.request([messages.pack({"id": rid})], rid, 30.0))


async def turns_until(condition, limit: int = 100_000) -> None:
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def prime(path: AsyncDirect) -> None:
    """Answers that come at once: the path's waits show to be short."""
    for rid in range(1, 21):
        header, _ = await call(path, rid)
        assert header["id"] == rid


def test_a_waiting_call_keeps_the_loop_polling_and_other_tasks_run() -> None:
    async def body(path, worker, selector) -> None:
        await prime(path)
        worker.hold = True
        pending = call(path, 100)
        await turns_until(lambda: worker.held == [100])
        sleeps = selector.sleeps
        # this task's timer is the loop's next thing due: an idle loop would
        # sleep in its selector until it; a polling one turns meanwhile and
        # still runs it (other tasks are served)
        await asyncio.sleep(0.02)
        assert not pending.done()
        assert selector.sleeps == sleeps, "the loop slept in its selector while a call waited"
        worker.answer()
        header, _ = await pending
        assert header["id"] == 100

    run(10_000_000, body)          # a 10 s window: nothing here outlasts it


def test_without_a_window_the_loop_sleeps_while_a_call_waits() -> None:
    async def body(path, worker, selector) -> None:
        await prime(path)
        worker.hold = True
        sleeps = selector.sleeps
        pending = call(path, 100)
        await asyncio.sleep(0.01)           # a wait the loop may sleep through
        assert selector.sleeps > sleeps
        worker.answer()
        assert (await pending)[0]["id"] == 100

    run(0, body)


def test_the_loop_sleeps_again_once_the_window_has_passed() -> None:
    async def body(path, worker, selector) -> None:
        await prime(path)
        worker.hold = True
        sleeps = selector.sleeps
        pending = call(path, 100)
        # a 1 s timer is the next thing due: once the window is over the loop
        # waits for it in its selector
        await asyncio.sleep(1.0)
        assert selector.sleeps > sleeps and not pending.done()
        worker.answer()
        assert (await pending)[0]["id"] == 100

    run(20_000, body)          # 20 ms
