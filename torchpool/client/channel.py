"""One DEALER socket shared by threads: the sync `Client`'s transport.

A ZeroMQ socket must never be used by two threads at once, and a reply may
belong to any of the calls in flight. So one waiting thread at a time owns
the socket (the *reader*): it sends what the other threads queued, reads
every reply and hands each to the thread that waits for its id. When its own
answer is in, or its time is up, it hands the socket to another waiting
thread. A thread alone never waits for anyone: it owns the socket, sends,
and reads its own answer, as the client did before it could be shared.

    thread A (reader)  send A ─ poll(socket, monitor, wake) ─ reply B ─ reply A ─ hand over to C
    thread B           queue B, wake A ─ wait(B's deadline) ──┘ done
    thread C           queue C, wake A ─ wait(C's deadline) ─────────── promoted: reader

Every deadline fires in its own thread: the reader polls no longer than its
own, the others wait on their own events. The reader also reads the
socket's monitor (watch.py): a connection that drops fails every call in
flight at once, instead of each waiting out its time.
"""
from __future__ import annotations

import collections
import functools
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence, Union, cast

import zmq

from ..protocol import errors, messages
from ..protocol.errors import InferenceError
from ..rules.spin import SpinWait
from .types import Frames, NoAnswer, Reply
from .watch import ConnectionWatch, Mark

if TYPE_CHECKING:
    from typing_extensions import Buffer

# Reading the monitor costs a few us, too much for every call: a send right
# after a poll (the hot path) trusts that poll. Anything that happened in so
# short a gap is the daemon going away, which the request then hears about.
_FRESH_S = 0.01
# plain ints: pyzmq turns an enum flag back into an enum on every call (a few us)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)
# zmq_poll itself, not Poller.poll: one Python layer less on every wait
_zmq_poll = zmq.zmq_poll


class _Frame(Protocol):
    """A received frame (zmq.Frame): its bytes, and whether more follow."""

    @property
    def more(self) -> bool: ...

    @property
    def buffer(self) -> memoryview: ...

    def __buffer__(self, flags: int, /) -> memoryview: ...


class _Socket(Protocol):
    """What a SharedSocket does with its ZeroMQ socket (zmq.Socket)."""

    def send(self, data: Buffer, flags: int) -> object: ...

    def send_multipart(self, msg_parts: Sequence[Buffer], flags: int, copy: bool) -> object: ...

    def recv(self, flags: int, copy: bool) -> _Frame: ...


class CallWaiter:
    """One call in flight: its frames until sent, then its answer or error."""

    __slots__ = ("rid", "frames", "deadline", "mark", "reply", "error", "promoted", "event")

    def __init__(self, rid: int, frames: Frames, deadline: float = 0.0) -> None:
        self.rid = rid
        self.frames: Optional[Frames] = frames    # None once sent
        self.deadline = deadline                 # time.monotonic() when the caller gives up
        self.mark: Optional[Mark] = None        # the connection's story when it was sent
        self.reply: Optional[Reply] = None
        self.error: Optional[BaseException] = None
        self.promoted = False                    # told to become the reader
        self.event: Optional[threading.Event] = None   # only for a thread that waits on another


def _closed_error() -> InferenceError:
    return InferenceError(errors.CANCELLED, "client closed")


class SharedSocket:
    """Requests from any thread over one socket; replies routed by id.

    `on_late(header)` gets each answer nobody waits for any more (a call
    that timed out): it must give back what that request held."""

    def __init__(self, sock: Union[zmq.Socket[bytes], int], watch: Optional[ConnectionWatch],
                 on_late: Callable[[object], None]) -> None:
        # a ZeroMQ socket; a LaneSocket's is an fd, only polled here (it overrides
        # the methods that send and receive)
        self._sock = cast(_Socket, sock)
        self._watch = watch
        self._on_late = on_late
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)     # notified when nobody reads
        self._waiting: dict[object, CallWaiter] = {}     # by request id (as an answer says it)
        self._outbox: collections.deque[CallWaiter] = collections.deque()
        self._reader: Optional[CallWaiter] = None
        self._closed = False
        self._polled = 0.0            # when a poll last saw the monitor (as good as a drain)
        self._spin: Optional[SpinWait] = None     # a direct path's (client/direct.py)
        # threads that queued a request wake the reader through this
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_closer = weakref.finalize(self, os.close, self._wake)
        self._poll_items = [(sock, _POLLIN), (self._wake, _POLLIN)]
        if watch is not None:
            self._poll_items.append((watch.fd, _POLLIN))
        self._spin_poll = functools.partial(_zmq_poll, self._poll_items)   # the spin's: built once, not per wait

    # -- a call
    def request(self, frames: Frames, rid: int, timeout: float) -> Reply:
        """Send `frames` and return the reply to `rid`; NoAnswer when none
        comes within `timeout` s (or the connection says none will)."""
        now = time.monotonic()
        deadline = now + timeout
        me = CallWaiter(rid, frames, deadline)
        with self._lock:
            if self._closed:
                raise _closed_error()
            self._waiting[rid] = me
            reader = self._reader is None
            if reader:
                self._reader = me
            else:
                me.event = threading.Event()
                self._outbox.append(me)
                os.eventfd_write(self._wake, 1)
        if reader:
            self._serve(me, deadline, sent_at=now)
        else:
            try:
                self._wait(me, deadline)
            except BaseException:            # interrupted: never leave the socket without a reader
                self._abandon(me)
                raise
        if me.reply is not None:
            return me.reply
        if me.error is not None:
            raise me.error
        raise self._no_answer(timeout)

    def _wait(self, me: CallWaiter, deadline: float) -> None:
        """Wait for another thread to hand us our answer, or the socket."""
        event = me.event
        assert event is not None        # request() gave it one: it is not the reader
        while True:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                event.wait(remaining)
            with self._lock:
                event.clear()
                promoted, me.promoted = me.promoted, False
                done = me.reply is not None or me.error is not None
                if not (promoted or done):
                    if time.monotonic() < deadline:
                        continue
                    if self._waiting.get(me.rid) is me:
                        del self._waiting[me.rid]       # the reader skips it if still queued
                    return
            if promoted and done:                        # close() failed it as it was promoted
                self._hand_over(me)
            elif promoted:
                self._serve(me, deadline)
            return

    def _abandon(self, me: CallWaiter) -> None:
        with self._lock:
            if self._waiting.get(me.rid) is me:
                del self._waiting[me.rid]
            if self._reader is not me:
                return
        self._hand_over(me)

    # -- the reader
    def _serve(self, me: CallWaiter, deadline: float, sent_at: Optional[float] = None) -> None:
        """Own the socket until `me` is answered or its deadline passes,
        sending (`me` first, at `sent_at`, if given) and routing for
        everyone meanwhile; then hand it over."""
        wake, items, spin = self._wake, self._poll_items, self._spin
        polled = items[0][0]            # the socket (or fd) as the poll names it
        try:
            if sent_at is not None:
                self._transmit(me, sent_at)
            while True:
                if self._outbox:
                    self._flush()
                if me.reply is not None or me.error is not None:
                    return
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    self._on_deadline()
                    return
                timeout_ms = max(1, int(remaining * 1000))
                ready = (_zmq_poll(items, timeout_ms) if spin is None
                         else spin.wait(self._spin_poll, timeout_ms))
                # the poll saw the monitor at least from `now` on (the
                # earlier time errs towards draining once more)
                self._polled = now
                for item, _ in ready:
                    # `==`, not `is`: a lane's and a direct path's socket, and the
                    # wake-up, are int fds, and only ints up to 256 are one object
                    # (past fd 256 every answer went unread: issue 26's hang)
                    if item == polled:
                        self._read_one(me)
                    elif item == wake:
                        try:
                            os.eventfd_read(wake)
                        except BlockingIOError:
                            pass
                    else:
                        self._on_monitor()
        except zmq.ZMQError as exc:              # the socket was closed under us
            with self._lock:
                if me.reply is None and me.error is None:
                    me.error = _closed_error() if self._closed else exc
        finally:
            self._hand_over(me)

    def spin(self, window_us: int) -> None:
        """Poll this long for an answer before sleeping, while answers come
        sooner (rules/spin.py; a direct path's daemon says how long)."""
        self._spin = SpinWait(window_us) if window_us else None

    def _no_answer(self, timeout: float) -> NoAnswer:
        watch = self._watch
        assert watch is not None        # a LaneSocket (no watch) overrides this
        return watch.no_answer(timeout)

    def _on_deadline(self) -> None:
        watch = self._watch
        assert watch is not None        # a LaneSocket (no watch) overrides this
        watch.drain()                  # the freshest story for the error

    def _on_monitor(self) -> None:
        watch = self._watch
        assert watch is not None        # a LaneSocket (no watch) overrides this
        if watch.socket.closed:           # close() gave up waiting for this reader
            raise zmq.ZMQError(zmq.ENOTSOCK)
        watch.drain()
        self._fail_lost()

    def _transmit(self, w: CallWaiter, now: Optional[float] = None) -> None:
        """Send one request (the reader's thread only); `now`: the time, if
        the caller just read it."""
        watch = self._watch
        assert watch is not None        # a LaneSocket (no watch) overrides this
        if (time.monotonic() if now is None else now) - self._polled > _FRESH_S:
            watch.drain()     # events from while nobody polled happened before this send
        error = None if watch.connected else watch.before_send()
        if error is None:
            w.mark = watch.mark()
            frames = w.frames
            assert frames is not None       # each call is sent once
            try:
                if len(frames) == 1:       # a tiny request: one frame, no multipart loop
                    self._sock.send(frames[0], _NOBLOCK)
                else:                      # payload frames go without a copy
                    self._sock.send_multipart(frames, flags=_NOBLOCK, copy=False)
            except zmq.Again:
                error = NoAnswer(errors.UNAVAILABLE, f"torchpool at {watch.url} takes no more "
                                                     f"requests: too many wait to be sent (is the "
                                                     f"daemon running?)", sent=False)
        w.frames = None
        if error is not None:
            self._finish(w, error=error)

    def _flush(self) -> None:
        while True:
            with self._lock:
                if not self._outbox:
                    return
                w = self._outbox.popleft()
                if self._waiting.get(w.rid) is not w:
                    continue                      # it gave up before it was sent
            self._transmit(w)

    def _read_one(self, me: CallWaiter) -> None:
        sock = self._sock
        try:
            first = sock.recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return
        payload = []
        frame = first
        while frame.more:              # a message arrives whole: the rest is there
            frame = sock.recv(_NOBLOCK, copy=False)
            payload.append(frame.buffer)
        self._deliver(me, messages.unpack(first), payload)

    def _deliver(self, me: Optional[CallWaiter], header: object, payload: Sequence[Buffer]) -> None:
        """Hand a reply to the call it answers (the reader's thread only;
        `me`: the reader's own call, if it has one in flight)."""
        if not isinstance(header, dict):
            self._on_late(header)               # answers no call
            return
        rid = header.get("id")
        w = self._waiting.get(rid)
        if w is me and w is not None:
            # the reader's own answer needs no lock: no other thread gives it
            # anything (close() at most an error, and the answer wins)
            self._waiting.pop(rid, None)
            w.reply = (header, payload)         # (w is me)
        elif not self._finish(w, reply=(header, payload)):
            self._on_late(header)               # the late answer of a call that timed out

    def _fail_lost(self) -> None:
        """Fail every sent call the connection's events say will get no answer."""
        watch = self._watch
        assert watch is not None        # a LaneSocket (no watch) overrides this
        with self._lock:
            waiting = list(self._waiting.values())
        for w in waiting:
            if w.mark is not None:
                error = watch.failure(w.mark)
                if error is not None:
                    self._finish(w, error=error)

    def _finish(self, w: Optional[CallWaiter], reply: Optional[Reply] = None,
                error: Optional[BaseException] = None) -> bool:
        """Give `w` its reply or error, under the lock (a waiter that timed
        out either sees it or is gone); False if nobody waits for it."""
        if w is None:
            return False
        with self._lock:
            if self._waiting.get(w.rid) is not w:
                return False
            del self._waiting[w.rid]
            w.reply, w.error = reply, error
            if w.event is not None:
                w.event.set()
        return True

    def _hand_over(self, me: CallWaiter) -> None:
        with self._lock:
            if self._waiting.get(me.rid) is me:
                del self._waiting[me.rid]          # our time is up
            self._reader = None
            for w in self._waiting.values():       # someone else waits: they read now
                assert w.event is not None         # only the reader has none, and `me` is gone
                self._reader = w
                w.promoted = True
                w.event.set()
                return
            if self._closed:
                self._idle.notify_all()            # close() waits for this

    # -- the end
    def close(self, wait: float) -> None:
        """Calls in flight fail with CANCELLED; returns once no thread reads
        (or after `wait` s), so the caller may use the socket itself."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in list(self._waiting.values()):    # a reader may pop its own meanwhile
                w.error = _closed_error()
                if w.event is not None:
                    w.event.set()
            self._waiting.clear()
            if self._reader is not None:
                os.eventfd_write(self._wake, 1)
                self._idle.wait_for(lambda: self._reader is None, wait)
            if self._reader is None:        # else a stuck reader may still poll it: the finalizer closes it
                self._wake_closer()
