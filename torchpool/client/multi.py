"""Several daemons behind one client: `Client([url, url, ...])`.

A `MultiClient` holds one `Client` per daemon, each with its own socket and
its own shared-memory session (a session, its arena and its regions only
mean something to the daemon that made them). Each request goes to the
daemon with the fewest requests of this client in flight (round robin
among equals), so a slow daemon gets less.

    infer ──► pick (up, least in flight) ──► Client(url_i) ──► answer
                  ▲                              │ no daemon / connection lost
                  │ ready again                  ▼
            health thread ◄──────────── marked down (skipped)

A daemon that cannot be reached, or whose connection drops, is marked down
and skipped; one that lets a call pass its deadline is checked at once. A
health thread asks every daemon that is down (or in doubt) `server_ready`
every `health_interval` seconds and brings it back when it says yes.

A request that failed because its daemon went away is sent to another only
if the caller allows it: `retries=N` more attempts (default 0: the caller
gets the error, and the next call goes to a daemon that is up). A request
that never left this process (no socket file there) moves to another daemon
whatever `retries` says: it cannot run twice. A call that passed its
deadline is never retried: it may still be running.

Sequences (`sequence_id`) stay on the daemon that saw their start: their
state lives there. Control reads (metadata, config, readiness) are answered
by any daemon that is up; `load` and `unload` go to every daemon. Per-daemon
facts (statistics, registered regions, `empty()` arrays that travel with no
copy) are asked of one daemon's own client: `clients[url]`.

Why a separate class that `Client(list)` returns, rather than a `Client`
subclass: a `Client` owns one socket and one session; this owns clients.
The entry point stays the one users know.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, Optional, Sequence, TypeGuard

import numpy as np

from ..protocol import datatypes, errors
from ..protocol.errors import InferenceError
from .api import DaemonCalls
from .arena import DEFAULT_ARENA_CAP
from .common import DEFAULT_TIMEOUT, ClientKey, ServerKey
from .sync import Client, register_several_daemons
from .types import InferResult, Inputs, JSONDocument, ModelConfig, NoAnswer, RequestedOutput, SequenceId, T, Version

DEFAULT_HEALTH_INTERVAL = 1.0   # seconds between checks of a daemon that is down
PROBE_TIMEOUT = 2.0             # how long a health check waits for `server_ready`


class _Daemon:
    """One daemon of a MultiClient: its client and what we know of it."""

    def __init__(self, url: str, client: Client) -> None:
        self.url = url
        self.client = client
        self.up = True
        self.suspect = False            # a call passed its deadline there: check it
        self.down_since = 0.0
        self.why = ""                   # the error that marked it down
        self.in_flight = 0
        self.served = 0                 # calls it answered (errors included)
        self.failed = 0                 # calls that found it gone

    def describe(self) -> JSONDocument:
        return {"url": self.url, "up": self.up, "in_flight": self.in_flight, "served": self.served,
                "failed": self.failed, "why": self.why}


def _went_away(exc: BaseException) -> TypeGuard[NoAnswer]:
    """The daemon could not be reached or its connection dropped (not: it is slow)."""
    return isinstance(exc, NoAnswer) and exc.code == errors.UNAVAILABLE


class MultiClient(DaemonCalls):
    """A client of several torchpool daemons; see the module doc. Thread-safe.

    `urls`: the daemons' addresses. `retries`: how many other daemons a
    request whose daemon went away may be sent to (default 0). The other
    arguments (`timeout`, `local`, `arena_cap`, `server_key`, `client_key`)
    are each daemon's `Client`'s."""

    def __init__(self, urls: Sequence[str], timeout: float = DEFAULT_TIMEOUT, local: Optional[bool] = None,
                 arena_cap: int = DEFAULT_ARENA_CAP, server_key: Optional[ServerKey] = None,
                 client_key: Optional[ClientKey] = None, *, retries: int = 0,
                 health_interval: float = DEFAULT_HEALTH_INTERVAL) -> None:
        if isinstance(urls, str) or not urls or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"urls: expected a non-empty list of daemon addresses, got {urls!r}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"urls: each daemon once, got {list(urls)!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries: expected a non-negative integer, got {retries!r}")
        self.timeout = timeout
        self.retries = retries
        self._daemons: list[_Daemon] = []
        try:
            for url in urls:
                client = Client(url, timeout, local, arena_cap, server_key, client_key)
                self._daemons.append(_Daemon(url, client))
        except BaseException:
            for d in self._daemons:
                d.client.close(wait=0)
            raise
        self._lock = threading.Lock()
        self._turn = 0                                # round robin among equals
        # (type name, sequence id) -> the daemon that holds it
        self._sequences: dict[tuple[str, SequenceId], _Daemon] = {}
        self._stop = threading.Event()
        self._nudge = threading.Event()               # check now: a daemon is in doubt
        self._health = threading.Thread(target=_health_loop, name="torchpool-health", daemon=True,
                                        args=(self._daemons, self._lock, health_interval, self._stop,
                                              self._nudge))
        self._health.start()
        # a MultiClient nobody closed still stops its thread (which holds only the daemons)
        self._stopper = weakref.finalize(self, _stop_health, self._stop, self._nudge)

    # -- which daemon
    @property
    def clients(self) -> dict[str, Client]:
        """Each daemon's own client, by url (for per-daemon calls)."""
        return {d.url: d.client for d in self._daemons}

    def daemons(self) -> list[JSONDocument]:
        """[{url, up, in_flight, served, failed, why}] for each daemon."""
        with self._lock:
            return [d.describe() for d in self._daemons]

    def _pick(self, tried: Sequence[_Daemon]) -> _Daemon:
        """The daemon for the next attempt: up, not tried yet, fewest in flight.
        When none is up, one that is down (it may be back before the health
        check says so); UNAVAILABLE naming them all when none is left."""
        with self._lock:
            n = len(self._daemons)
            order = [self._daemons[(self._turn + i) % n] for i in range(n)]
            fresh = [d for d in order if d not in tried]
            up = [d for d in fresh if d.up]
            if up:
                best = min(up, key=lambda d: d.in_flight)
            elif fresh:
                best = min(fresh, key=lambda d: d.down_since)
            else:
                raise self._none_left()
            self._turn = (self._daemons.index(best) + 1) % n
            best.in_flight += 1
            return best

    def _none_left(self) -> InferenceError:
        why = "; ".join(f"{d.url}: {d.why or 'failed'}" for d in self._daemons)
        return InferenceError(errors.UNAVAILABLE, f"no torchpool daemon answered ({why})")

    def _settle(self, daemon: _Daemon, exc: Optional[BaseException]) -> None:
        """Account for a finished attempt; mark the daemon down when it went away."""
        with self._lock:
            daemon.in_flight -= 1
            if exc is None or not isinstance(exc, NoAnswer):
                daemon.served += 1
                return
            if exc.code == errors.DEADLINE_EXCEEDED:
                daemon.suspect = True
            elif _went_away(exc):
                daemon.failed += 1
                if daemon.up:
                    daemon.up, daemon.down_since = False, time.monotonic()
                daemon.why = exc.message
        if exc.code == errors.DEADLINE_EXCEEDED:
            self._nudge.set()

    def _run(self, attempt: Callable[[_Daemon], T], pinned: Optional[_Daemon] = None,
             retries: Optional[int] = None) -> T:
        """Run `attempt` on one daemon, moving to others as allowed."""
        left = self.retries if retries is None else retries
        tried: list[_Daemon] = []
        while True:
            if pinned is not None:
                with self._lock:
                    pinned.in_flight += 1
                daemon = pinned
            else:
                daemon = self._pick(tried)
            try:
                result = attempt(daemon)
            except BaseException as exc:
                self._settle(daemon, exc)
                if pinned is not None or not _went_away(exc):
                    raise
                if len(tried) + 1 >= len(self._daemons):
                    if tried:
                        raise self._none_left() from exc
                    raise
                if exc.sent:
                    if left <= 0:
                        raise
                    left -= 1
                tried.append(daemon)
                continue
            self._settle(daemon, None)
            return result

    # -- inference
    def infer(self, model: str, inputs: Inputs, outputs: Optional[Sequence[RequestedOutput]] = None,
              version: Version = None, timeout: Optional[float] = None, copy: bool = False,
              priority: int = 0, sequence_id: SequenceId = 0, sequence_start: bool = False,
              sequence_end: bool = False) -> InferResult:
        """As `Client.infer`, on one of the daemons (see the module doc)."""
        def attempt(daemon: _Daemon) -> InferResult:
            return daemon.client.infer(model, inputs, outputs, version, timeout, copy, priority,
                                       sequence_id, sequence_start, sequence_end)
        if not sequence_id:
            return self._run(attempt)
        return self._run_in_sequence(attempt, sequence_id, sequence_start, sequence_end)

    def _run_in_sequence(self, attempt: Callable[[_Daemon], T], sequence_id: SequenceId, start: bool,
                         end: bool) -> T:
        """A sequence's first request picks its daemon; the others follow it
        there. (A sequence that never ends is remembered until close().)"""
        key = (type(sequence_id).__name__, sequence_id)
        with self._lock:
            pinned = None if start else self._sequences.get(key)
        if pinned is None:
            tried: list[_Daemon] = []

            def first(daemon: _Daemon) -> T:
                tried.append(daemon)
                return attempt(daemon)
            try:
                return self._run(first)
            except BaseException as exc:
                if _went_away(exc):
                    tried.clear()            # it lives nowhere
                raise
            finally:
                if tried and not end:
                    with self._lock:
                        self._sequences[key] = tried[-1]
        if not pinned.up:
            raise InferenceError(errors.UNAVAILABLE, f"sequence {sequence_id!r} lives on torchpool at "
                                                     f"{pinned.url}, which is down ({pinned.why}); "
                                                     f"start it again with sequence_start")
        try:
            return self._run(attempt, pinned)
        finally:
            if end:
                with self._lock:
                    self._sequences.pop(key, None)

    def empty(self, shape: Sequence[int], datatype: str = "FP32") -> np.ndarray:
        """An ordinary array: which daemon (and arena) a request goes to is
        decided when it is sent, so its bytes are copied once then. For no
        copy at all, use one daemon's client: `clients[url].empty(...)`."""
        return np.empty(tuple(int(d) for d in shape), datatypes.numpy_dtype(datatype))

    # -- control calls
    def _read(self, call: Callable[[Client], T]) -> T:
        """A control read: any daemon that is up answers; reads move freely."""
        return self._run(lambda daemon: call(daemon.client), retries=len(self._daemons))

    def server_live(self, timeout: Optional[float] = None) -> bool:
        """True if any daemon is live."""
        return self._any(lambda c: c.server_live(timeout))

    def server_ready(self, timeout: Optional[float] = None) -> bool:
        """True if any daemon is ready."""
        return self._any(lambda c: c.server_ready(timeout))

    def model_ready(self, name: str, version: Version = None) -> bool:
        """True if the model is ready on any daemon."""
        return self._any(lambda c: c.model_ready(name, version))

    def _any(self, ask: Callable[[Client], bool]) -> bool:
        with self._lock:
            order = sorted(self._daemons, key=lambda d: not d.up)
        for d in order:
            try:
                if ask(d.client):
                    return True
            except InferenceError:
                continue
        return False

    def model_metadata(self, name: str, version: Version = None) -> JSONDocument:
        return self._read(lambda c: c.model_metadata(name, version))

    def model_config(self, name: str, version: Version = None) -> JSONDocument:
        return self._read(lambda c: c.model_config(name, version))

    def repository_index(self) -> list[JSONDocument]:
        return self._read(lambda c: c.repository_index())

    def server_metadata(self) -> JSONDocument:
        return self._read(lambda c: c.server_metadata())

    def load(self, name: str, config: ModelConfig = None, timeout: Optional[float] = None) -> None:
        """Load (or reload) the model on every daemon; the first failure is raised after all tried."""
        self._every(lambda c: c.load(name, config, timeout))

    def unload(self, name: str, timeout: Optional[float] = None) -> None:
        """Unload the model on every daemon."""
        self._every(lambda c: c.unload(name, timeout))

    def _every(self, call: Callable[[Client], object]) -> None:
        failure: Optional[InferenceError] = None
        for d in self._daemons:
            try:
                call(d.client)
            except InferenceError as exc:
                failure = failure or InferenceError(exc.code, f"torchpool at {d.url}: {exc.message}")
        if failure is not None:
            raise failure

    # -- lifetime
    def close(self) -> None:
        """Stop the health checks and close every daemon's client."""
        self._stopper()
        for d in self._daemons:
            d.client.close()            # a health check in flight ends with CANCELLED
        if self._health is not threading.current_thread():
            self._health.join()

    def __enter__(self) -> "MultiClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_health(stop: threading.Event, nudge: threading.Event) -> None:
    stop.set()
    nudge.set()


def _health_loop(daemons: list[_Daemon], lock: threading.Lock, interval: float,
                 stop: threading.Event, nudge: threading.Event) -> None:
    """Every `interval` s (or when nudged), ask each daemon that is down or
    in doubt whether it is ready. Holds no reference to the MultiClient."""
    while not stop.is_set():
        nudge.wait(interval)
        nudge.clear()
        for d in daemons:
            if stop.is_set():
                return
            with lock:
                due = not d.up or d.suspect
                d.suspect = False
            if not due:
                continue
            try:
                ready = d.client.server_ready(timeout=PROBE_TIMEOUT)
                why = "not ready"
            except InferenceError as exc:
                ready, why = False, exc.message
            with lock:
                if ready and not d.up:
                    d.up, d.why = True, ""
                elif not ready and d.up:
                    d.up, d.down_since, d.why = False, time.monotonic(), why


register_several_daemons(MultiClient)
