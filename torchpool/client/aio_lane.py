"""The request lane and direct paths, from an event loop (the AsyncClient's).

What lane.py's `LaneSocket` and direct.py's `DirectSocket` are to the sync
`Client`, on asyncio: the same datagrams on the same unix sockets, the same
errors, but no thread waits. The socket's reader is the event loop's
(`loop.add_reader`, registered while the socket is open): each answer is
handed to the future of the call it answers, by request id, so any number
of calls may be in flight on one socket at once. A send the socket has no
room for (the far end has not read this client's earlier requests) waits
for writability in the loop, until the call's own deadline; answers are
read meanwhile.

A direct path's calls wait as the sync client's do (rules/spin.py): while
its recent answers came sooner than the daemon's window, a call that waits
keeps the loop from sleeping in its selector (a callback that schedules
itself again: each turn of the loop polls the sockets without a timeout and
runs every other ready task) until its answer comes or the window passes.
The wake-up of a loop asleep in epoll is most of a tiny call's latency on
a VM (rules/spin.py's figures).

- An answer nobody waits for any more (a call that timed out or was
  cancelled) goes to `on_late`, which gives back what its request held.
- The socket closing (the daemon stopped or ended the session; a path's
  worker stopped) fails every call sent on it at once with UNAVAILABLE
  (`NoAnswer.sent` True); a call not sent yet fails with `sent` False, so
  its caller may send it elsewhere (aio.py, flows.py).
"""
from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from typing import Callable, Hashable, Optional, Union

from ..protocol import errors, lane, messages
from ..protocol.errors import InferenceError
from ..rules.ahead import may_send_ahead
from ..rules.spin import SpinWait
from ..shm.fdpass import DONTWAIT
from .direct import DirectLink, path_closed
from .lane import LaneLink, assemble
from .types import Frames, NoAnswer, Reply

_READS_PER_WAKE = 64        # answers read per wake-up before the loop runs others


def _expire(fut: asyncio.Future[Reply]) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class AsyncLane:
    """A local session's request lane, read by the event loop."""

    zmq_fallback = True         # a call it could not send goes over ZeroMQ (aio.py)

    def __init__(self, link: LaneLink, url: str, on_late: Callable[[object], None]) -> None:
        self._link = link
        self._url = url
        self._on_late = on_late
        self.fd = link.sock.fileno()
        self.lost = False                  # closed by the far end: nothing more comes
        self._closed = False               # closed by us
        self._pieces: list[Union[bytes, memoryview]] = []     # of an answer that came in several datagrams
        self._pending: dict[object, asyncio.Future[Reply]] = {}     # by request id (as an answer says it)
        self._writable: list[asyncio.Future[None]] = []      # sends waiting for room
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._spin: Optional[SpinWait] = None     # a direct path's polling policy (spin())
        self._spinning = False                    # a spin callback is scheduled
        try:
            self._attach(asyncio.get_running_loop())   # read from now on: fds come ahead of answers
        except RuntimeError:
            pass                           # no loop running: the first request registers

    # -- the event loop's reader
    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._detach()
        if self.lost or self._closed:
            return
        loop.add_reader(self.fd, self._on_readable)
        self._loop = loop

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self.fd)
            if self._writable:
                loop.remove_writer(self.fd)
        self._wake_writers()

    def _on_readable(self) -> None:
        link = self._link
        for _ in range(_READS_PER_WAKE):
            try:
                data, fds = link.recv()
            except BlockingIOError:
                return
            except OSError:
                data, fds = memoryview(b""), []    # (empty: lost)
            if not data:
                self._lose()
                return
            answer = assemble(self._pieces, data, fds, link)
            if answer is None:
                continue
            frames, payload = answer
            header = messages.unpack(frames[0])
            fut = self._pending.pop(header.get("id"), None) if header.__class__ is dict else None
            if fut is not None and not fut.done():
                fut.set_result((header, payload))
            else:
                self._on_late(header)          # the late answer of a call that timed out

    def _lose(self) -> None:
        """The far end closed: every call sent on it fails now."""
        self.lost = True
        self._detach()
        self._fail_all(lambda: self._lost_error(sent=True))

    def _fail_all(self, error: Callable[[], BaseException]) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error())

    # -- writability
    def _on_writable(self) -> None:
        if self._loop is not None:
            self._loop.remove_writer(self.fd)
        self._wake_writers()

    def _wake_writers(self) -> None:
        waiting, self._writable = self._writable, []
        for w in waiting:
            if not w.done():
                w.set_result(None)

    async def _room(self, loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Reply]) -> None:
        """Wait until the socket may take a datagram, or `answer` is done
        (its deadline passed, the socket was lost or closed)."""
        w = loop.create_future()
        if not self._writable:
            loop.add_writer(self.fd, self._on_writable)
        self._writable.append(w)
        await asyncio.wait((w, answer), return_when=asyncio.FIRST_COMPLETED)

    # -- a call
    async def request(self, frames: Frames, rid: int, timeout: float,
                      sent: Optional[Callable[[], None]] = None, caller: Hashable = None) -> Reply:
        """Send `frames` (one datagram: the caller checked lane.fits) and
        return the answer to `rid`; NoAnswer when none comes within
        `timeout` s, or the socket says none will. `sent()` once it is sent.
        (`caller`: as AsyncPaths'; calls on one socket go in the order sent.)"""
        if self._closed:
            raise InferenceError(errors.CANCELLED, "client closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._attach(loop)
        if self.lost:
            raise self._lost_error(sent=False)
        fut: asyncio.Future[Reply] = loop.create_future()
        self._pending[rid] = fut
        timer = loop.call_later(timeout, _expire, fut)
        try:
            datagram = lane.request(frames)
            sock = self._link.sock
            while True:
                try:
                    sock.sendmsg(datagram, (), DONTWAIT)
                    break
                except BlockingIOError:
                    await self._room(loop, fut)
                    if fut.done():             # not sent: in time, or at all
                        if self._closed:
                            raise InferenceError(errors.CANCELLED, "client closed") from None
                        if self.lost:
                            raise self._lost_error(sent=False) from None
                        raise NoAnswer(errors.DEADLINE_EXCEEDED,
                                       f"torchpool at {self._url} did not take the request in time "
                                       f"(it has not read this client's earlier ones)", sent=False) from None
                except OSError:
                    self._lose()
                    raise self._lost_error(sent=False) from None
            if sent is not None:
                sent()
            spin = self._spin
            if spin is None:
                try:
                    return await fut
                except asyncio.TimeoutError:
                    raise self._no_answer(timeout) from None
            start = time.perf_counter_ns()
            if spin.spinning() and not self._spinning:
                self._spinning = True
                loop.call_soon(self._spin_turn, loop, start + spin.window_ns)
            try:
                return await fut
            except asyncio.TimeoutError:
                raise self._no_answer(timeout) from None
            finally:
                spin.waited(time.perf_counter_ns() - start)
        finally:
            timer.cancel()
            if self._pending.get(rid) is fut:
                del self._pending[rid]

    def _spin_turn(self, loop: asyncio.AbstractEventLoop, end_ns: int) -> None:
        """One turn of the loop without sleeping while a call on this socket
        waits, until `end_ns`; yields the CPU to other runnable processes
        (the worker) as the sync client's spin does."""
        if not self._pending or self._closed or time.perf_counter_ns() >= end_ns:
            self._spinning = False
            return
        os.sched_yield()
        loop.call_soon(self._spin_turn, loop, end_ns)

    # -- errors
    def _lost_error(self, sent: bool) -> NoAnswer:
        return NoAnswer(errors.UNAVAILABLE, f"torchpool at {self._url} closed this client's local "
                                            f"side channel (it stopped, or ended the session)", sent=sent)

    def _no_answer(self, timeout: float) -> NoAnswer:
        return NoAnswer(errors.DEADLINE_EXCEEDED, f"torchpool at {self._url} did not answer within "
                                                  f"{timeout:g} s (it is reachable: the request may "
                                                  f"still run)")

    # -- the end
    def close(self, wait: float = 0) -> None:
        """Calls in flight fail with CANCELLED; the loop stops reading the
        socket (the caller closes it). `wait`: as LaneSocket.close's, unused:
        nothing here reads on another thread."""
        if self._closed:
            return
        self._closed = True
        self._detach()
        self._fail_all(lambda: InferenceError(errors.CANCELLED, "client closed"))


class AsyncDirect(AsyncLane):
    """A direct path (direct.py's DirectSocket), read by the event loop."""

    zmq_fallback = False        # a call it did not take goes over the lane (flows.py)

    def __init__(self, sock: socket.socket, model: str, url: str, on_late: Callable[[object], None]) -> None:
        sock.setblocking(False)
        self.model = model
        self.name = ""                  # the daemon's name of the path (for ended_flow)
        self.version: object = None     # the model version it serves (as the daemon said)
        super().__init__(DirectLink(sock), url, on_late)

    def spin(self, window_us: int) -> None:
        """The daemon's polling window: calls wait without sleeping in the
        loop's selector while answers come sooner (module docstring)."""
        self._spin = SpinWait(window_us) if window_us else None

    def lost_error(self) -> InferenceError:
        return InferenceError(errors.UNAVAILABLE, self._lost_error(True).message)

    def _lost_error(self, sent: bool) -> NoAnswer:
        return path_closed(self.model, self._url, sent)

    def shut(self) -> None:
        self.close()             # calls still on it fail with CANCELLED
        self._link.sock.close()


class Turns:
    """Calls waiting for a place, by caller: each place that frees goes to
    the next caller in turn (round robin), and a caller's own calls keep
    their order. One caller's thousand calls so wait behind each other, not
    in front of another caller's one (a gateway's callers: gateway/backend.py).
    A call cancelled or timed out is dropped when its turn comes."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, collections.deque[asyncio.Future[None]]] = {}
        self._turns: collections.deque[Hashable] = collections.deque()     # callers waiting, next first

    def add(self, caller: Hashable, turn: asyncio.Future[None], first: bool = False) -> None:
        """`turn` waits behind `caller`'s others; `first`: before them, and
        `caller` next (a call woken for a place another call took)."""
        queue = self._queues.get(caller)
        if queue is None:
            queue = self._queues[caller] = collections.deque()
        elif first:
            self._turns.remove(caller)
        else:
            queue.append(turn)
            return
        if first:
            queue.appendleft(turn)
            self._turns.appendleft(caller)
        else:
            queue.append(turn)
            self._turns.append(caller)

    def _next_queue(self) -> Optional[collections.deque[asyncio.Future[None]]]:
        """The next caller's waiting calls (the callers before it, with none
        left that wait, are dropped); None when no call waits."""
        turns = self._turns
        while turns:
            queue = self._queues[turns[0]]
            while queue and queue[0].done():
                queue.popleft()
            if queue:
                return queue
            del self._queues[turns.popleft()]
        return None

    def __bool__(self) -> bool:
        return self._next_queue() is not None

    def waiting(self) -> dict[Hashable, int]:
        """Calls waiting (not cancelled or timed out), by caller."""
        counts = {caller: sum(not turn.done() for turn in queue) for caller, queue in self._queues.items()}
        return {caller: n for caller, n in counts.items() if n}

    def pop(self) -> Optional[asyncio.Future[None]]:
        """The next caller's first waiting call (None when none waits)."""
        queue = self._next_queue()
        if queue is None:
            return None
        caller = self._turns.popleft()      # (None is a caller: an AsyncClient's own calls)
        turn = queue.popleft()
        if queue:
            self._turns.append(caller)
        else:
            del self._queues[caller]
        return turn


class AsyncPaths:
    """Direct paths to each instance of a model, standing as one path.

    An AsyncClient has many calls in flight at once; on one path they would
    all queue at one instance. Holding a path to each (the daemon opens them
    together: broker/direct.py), each call goes to an instance with nothing
    in flight, else ahead to a busy one where the daemon's rule allows that
    (rules/ahead.py: one instance, or executions that average under 2 ms),
    else waits here for the first that frees: in order, as the daemon's
    scheduler places requests on its instances, or by `Turns` where calls
    name their callers.

    A path whose instance stopped leaves the others serving; once none is
    left, or the lost ones are and nothing is in flight, the paths count as
    lost and the client asks for new ones (client/direct.py).
    """

    zmq_fallback = False        # a call it did not take goes over the lane (flows.py)
    _EWMA = 8                   # the mean execution follows about the last 8 calls

    def __init__(self, members: list[AsyncDirect]) -> None:
        self.members = members
        self.model = members[0].model
        self.name = members[0].name
        self.version = members[0].version
        self._in_flight = [0] * len(members)
        self._mean_ns: Optional[float] = None       # of calls that found their instance idle
        self._waiting = Turns()
        self._woken = 0                 # calls woken for a place that have not taken it yet

    @property
    def lost(self) -> bool:
        some_lost, all_lost = False, True
        for member in self.members:
            if member.lost:
                some_lost = True
            else:
                all_lost = False
        return all_lost or (some_lost and not any(self._in_flight))

    def spin(self, window_us: int) -> None:
        """The daemon's polling window: each member applies it to the calls it carries."""
        for member in self.members:
            member.spin(window_us)

    def _place(self) -> int:
        """The member a call goes to now; -1 when it must wait."""
        live, ahead = 0, -1          # (no lists: this runs for every call)
        for i, member in enumerate(self.members):
            if member.lost:
                continue
            if not self._in_flight[i]:
                return i
            live += 1
            if ahead < 0 and self._in_flight[i] == 1:
                ahead = i
        return ahead if ahead >= 0 and may_send_ahead(live, self._mean_ns) else -1

    def waiting(self) -> dict[Hashable, int]:
        """Calls waiting here for a place, by caller."""
        return self._waiting.waiting()

    def _queued(self) -> bool:
        """Are calls waiting for a place?"""
        return self._woken > 0 or bool(self._waiting)

    def _freed(self) -> None:
        """A call ended: the next waiting call (all of them when a path was
        lost: they may have nowhere to go now) looks again."""
        wake_all = any(m.lost for m in self.members)
        while True:
            w = self._waiting.pop()      # (not one cancelled or timed out)
            if w is None:
                return
            w.set_result(None)
            self._woken += 1             # until it runs: its place is kept from new calls
            if not wake_all:
                return

    async def request(self, frames: Frames, rid: int, timeout: float,
                      sent: Optional[Callable[[], None]] = None, caller: Hashable = None) -> Reply:
        """As AsyncLane.request, on the member `_place` chooses. Calls that
        wait for a place take turns by `caller` (Turns)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        woken = False
        while True:
            # calls waiting go first: a new call does not take the place one was woken for
            if woken or not self._queued():
                i = self._place()
                if i >= 0:
                    break
            if self.lost and all(m.lost for m in self.members):
                raise self.members[0]._lost_error(sent=False)
            turn = loop.create_future()
            self._waiting.add(caller, turn, first=woken)     # woken but beaten to it: still first
            woken = True
            try:
                await asyncio.wait_for(turn, max(0.0, deadline - loop.time()))
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._woken -= 1
                    self._freed()           # its turn passes on to the next
                raise
            except asyncio.TimeoutError:
                if turn.done() and not turn.cancelled():     # woken as its time ran out
                    self._woken -= 1
                    self._freed()
                raise InferenceError(errors.DEADLINE_EXCEEDED,
                                     f"no instance of model '{self.model}' was free within "
                                     f"{timeout:g} s (this client's earlier calls were running)") from None
            self._woken -= 1
        member = self.members[i]
        alone = not self._in_flight[i]
        self._in_flight[i] += 1
        start = time.perf_counter_ns()
        try:
            reply = await member.request(frames, rid, max(0.0, deadline - loop.time()), sent)
        except NoAnswer as exc:
            if exc.code == errors.DEADLINE_EXCEEDED and exc.sent:
                exc = member._no_answer(timeout)     # the call's whole time, not what was left of it
            exc.path = member
            raise exc from None
        finally:
            self._in_flight[i] -= 1
            self._freed()
        if alone:
            took = time.perf_counter_ns() - start
            mean = self._mean_ns
            self._mean_ns = took if mean is None else mean + (took - mean) / self._EWMA
        return reply

    def lost_error(self) -> InferenceError:
        return self.members[0].lost_error()

    def shut(self) -> None:
        for member in self.members:
            member.shut()
        self._freed()
