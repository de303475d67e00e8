"""The torchpool daemon: one broker process, one worker process per instance.

    clients (DEALER)                        broker (this process)
    ───────────────────┐   ipc:// tcp://   ┌─────────────────────────────────────┐
    [header, frames] ──┼──────────────────►│ Frontend (ROUTER per --listen URL)   │
                       │                   │   validate against the model config  │
                       │                   │   copy inline tensors once ─► Arena  │
                       │                   │   ModelVersion.queue ─► idle worker  │
    [header, frames] ◄─┼───────────────────│ answer from the worker's shm outputs │
    ───────────────────┘                   └───────┬──────────────────▲───────────┘
                                 RUN [descriptors] │ SOCK_SEQPACKET   │ DONE [descriptors]
                                                   ▼                  │
                                      worker (one per model instance, forked from
                                      the torch template): views inputs in shm,
                                      runs TorchScript, writes outputs to its arena

Models with `dynamic_batching` queue in a `DynamicBatcher` (broker/batcher.py)
instead: it writes the next batch's inputs contiguously while the instances
are busy, a RUN goes out as soon as a DONE comes in (before that batch is
answered), and each request is answered with its own byte ranges of the
batch's outputs.

This module accepts, validates, queues and dispatches, and watches the
workers; `Answers` (broker/answers.py) turns each finished batch into its
requests' answers and tracks the worker memory those answers still read.

Everything happens on one thread around one poller: frontend sockets, worker
sockets, worker process sentinels and a signal wake-up pipe. Signal handlers
only record the signal; the loop acts on it. Every accepted request is
answered exactly once: with outputs, or with an error naming model, tensor and
what went wrong (bad input, worker crash, timeout, shutdown).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import zmq

from ..config import scan_repository
from ..protocol import errors, internal, messages
from ..protocol.errors import TorchpoolError
from ..shm import Arena, daemon_id, remove_segments_with_prefix, remove_stale_segments, segment_prefix
from ..shm.arena import ArenaFull
from .frontend import Frontend
from .options import ServerOptions
from .metrics import MetricsServer
from .model_control import EXPLICIT, POLL, ModelControl, fingerprint
from .answers import Answers
from .batcher import Batch, DynamicBatcher, stage_batch_inputs
from .registry import LOADING, READY, UNAVAILABLE, UNLOADING, ModelVersion, Registry
from .requests import InferRequest, batch_layout, stage_inputs, validate_infer
from .batch import write_tensors
from .sequences import SequenceBatcher, parse_flags
from .sessions import SessionManager
from .systemd import Notifier
from .supervisor import BUSY, DEAD, IDLE, STARTING, Supervisor, WorkerHandle

log = logging.getLogger("torchpool.broker")

MiB = 1 << 20


@dataclass(order=True)
class _Timer:
    when: float
    seq: int
    action: Callable[[], None] = field(compare=False)


class Server:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.daemon = daemon_id(options.listen)
        self.prefix = segment_prefix(self.daemon)
        self.ctx: Optional[zmq.Context] = None
        self.frontend: Optional[Frontend] = None
        self.arena: Optional[Arena] = None
        self.registry: Optional[Registry] = None
        self.supervisor: Optional[Supervisor] = None
        self.sessions: Optional[SessionManager] = None
        # bytes the broker copied vs. passed by descriptor, for benchmarks and tests
        self.transfer: Counter = Counter()
        self.answers: Optional[Answers] = None
        self.poller = zmq.Poller()
        self._fd_handlers: dict[int, Callable[[], None]] = {}
        self._timers: list[_Timer] = []
        self._timer_seq = itertools.count()
        self._batch_ids = itertools.count(1)
        self._burst: Optional[set] = None    # batched versions with requests accepted in this burst
        self._sequence_done: list[InferRequest] = []   # answered requests of sequences, to move on
        self._sequence_sweep = False         # the idle-sequence timer runs (once a model has sequences)
        self._signals: list[int] = []
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._old_handlers: dict[int, Any] = {}
        self.should_exit = False
        self.force_exit = False
        self._started = time.monotonic()
        self.notifier = Notifier()
        self.control: Optional[ModelControl] = None
        self.metrics: Optional[MetricsServer] = None
        self._announced_ready = False

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        try:
            self.startup()
            self.main_loop()
        finally:
            self.shutdown()
        return 0

    def startup(self) -> None:
        self._install_signal_handlers()
        stale = remove_stale_segments(self.daemon)
        if stale:
            log.warning("removed %d shared-memory segments left by a dead daemon", len(stale))
        o = self.options
        self.arena = Arena(lambda i: f"{self.prefix}in{i}", o.shm_chunk, o.shm_limit)
        self.arena.free(self.arena.alloc(1))   # first segment created and pre-faulted now
        self.ctx = zmq.Context()
        self.frontend = Frontend(self.ctx, o.listen)
        for sock in self.frontend.sockets:
            self.poller.register(sock, zmq.POLLIN)
        self.answers = Answers(self.frontend, self.arena, self.transfer)
        self.answers.on_sequence_done = self._sequence_done.append
        self.sessions = SessionManager(f"{self.prefix}", o.client_shm_size, o.client_shm_limit,
                                       o.client_lease, self.answers.give_back, self._forget)
        self.answers.sessions = self.sessions
        self._call_later(max(0.2, o.client_lease / 4), self._expire_sessions)
        entries = scan_repository(o.model_repository)
        if o.model_control_mode == EXPLICIT and "*" not in o.load_models:
            entries = [e for e in entries if e.name in o.load_models]
        self.registry = Registry(entries)
        self.control = ModelControl(self, o.model_repository, o.model_control_mode)
        for model in self.registry.models.values():
            model.fingerprint = fingerprint(model.entry.path)
        if o.model_control_mode == POLL:
            self._call_later(o.repository_poll_secs, self._poll_repository)
        for model in self.registry.models.values():
            if model.error:
                log.error("model '%s' is UNAVAILABLE: %s", model.name, model.error)
        self.supervisor = Supervisor(self.prefix, o.worker_shm_chunk, o.worker_shm_limit, o.log_level,
                                     o.worker_busy_poll_us, o.log_format)
        for mv in self.registry.all_versions():
            self.start_version(mv)
        log.info("listening on %s; loading %d model versions from %s", ", ".join(o.listen),
                 len(self.registry.all_versions()), o.model_repository)
        self.notifier.status(f"loading {len(self.registry.all_versions())} model versions")
        if self.notifier.watchdog_interval:
            self._watchdog()
        if o.metrics_port is not None:
            self.metrics = MetricsServer(o.metrics_host, o.metrics_port, self._metrics_snapshot,
                                         lambda: not self.should_exit,
                                         lambda: not self.should_exit and self.registry.server_ready())
            self.metrics.start()
            log.info("metrics and health on http://%s:%d/metrics", o.metrics_host, self.metrics.port)
        self._announce_if_ready()

    def main_loop(self) -> None:
        drain_deadline = None
        # Waking a sleeping process costs tens of microseconds on a VM; a
        # request's round trip has several such hops. Right after activity
        # (a request in flight, or a client likely to send its next one) the
        # loop keeps polling without sleeping, yielding the CPU to anyone who
        # needs it, and sleeps once it has been idle for busy_poll_us.
        busy_poll = self.options.busy_poll_us / 1e6
        last_activity = 0.0
        while True:
            if self.should_exit:
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + self.options.grace_period
                    self.notifier.stopping()
                    log.info("shutting down: finishing %d accepted requests (grace %.0f s)",
                             self._pending(), self.options.grace_period)
                if self.force_exit or not self._pending() or time.monotonic() >= drain_deadline:
                    return
            spinning = time.perf_counter() - last_activity < busy_poll
            if spinning:
                events = self.poller.poll(0)
                if not events:
                    os.sched_yield()
                    continue    # an empty spin: timers and deadlines wait (at most busy_poll_us)
            else:
                events = self.poller.poll(self._poll_timeout(drain_deadline))
            if events:
                last_activity = time.perf_counter()
            for obj, _event in events:
                if isinstance(obj, zmq.Socket):
                    self._on_frontend(obj)
                else:
                    handler = self._fd_handlers.get(obj)
                    if handler is not None:
                        handler()
            if self._sequence_done:
                self._advance_sequences()
            self._run_timers()
            self._expire_queued()

    def shutdown(self) -> None:
        if self.registry is not None:
            for mv in self.registry.all_versions():
                if isinstance(mv.queue, DynamicBatcher):
                    self.answers.flush_held(mv.queue)
                self._fail_queued(mv, TorchpoolError(errors.UNAVAILABLE, "server is shutting down"))
                for h in mv.workers:
                    if h.batch is not None:
                        batch, h.batch = h.batch, None
                        self.answers.free_batch(batch)
                        self.answers.fail_batch(batch, TorchpoolError(errors.UNAVAILABLE,
                                                               f"server is shutting down; {h.label} "
                                                               f"did not finish in the grace period"))
        if self.sessions is not None:
            self.sessions.close_all()
        if self.supervisor is not None:
            self.supervisor.stop_all(self.options.stop_timeout)
        if self.frontend is not None:
            self._refuse_waiting()
            self.frontend.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=1000)   # closes any socket still open, then terminates
        if self.answers is not None:
            self.answers.close()
        if self.arena is not None:
            self.arena.close(unlink=True)
        remove_segments_with_prefix(self.prefix)
        if self.metrics is not None:
            self.metrics.close()
        self._restore_signal_handlers()
        self.notifier.close()
        log.info("torchpool stopped")

    def _refuse_waiting(self) -> None:
        """Requests that arrived while the workers stopped still get an answer."""
        refusal = TorchpoolError(errors.UNAVAILABLE, "server is shutting down")
        for sock in self.frontend.sockets:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                if len(frames) < 2 or not frames[1]:
                    continue
                try:
                    request_id = messages.decode_header(frames[1]).get("id")
                except TorchpoolError:
                    request_id = None
                self.frontend.send(sock, frames[0], messages.error_response(request_id, refusal))

    # -------------------------------------------------------------- signals

    def _install_signal_handlers(self) -> None:
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._record_signal)
        self._watch_fd(self._wake_r.fileno(), self._on_signal)

    def _record_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)   # only record: the loop acts on it

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        if self._wake_w is not None:
            signal.set_wakeup_fd(-1)
            self._wake_w.close()
            self._wake_r.close()
            self._wake_w = self._wake_r = None

    def _on_signal(self) -> None:
        try:
            while self._wake_r.recv(512):
                pass
        except BlockingIOError:
            pass
        while self._signals:
            sig = self._signals.pop(0)
            if sig in (signal.SIGTERM, signal.SIGINT):
                if self.should_exit and sig == signal.SIGINT:
                    log.warning("second SIGINT: stopping now")
                    self.force_exit = True
                self.should_exit = True
            elif sig == signal.SIGHUP:
                if self.control is not None and self.control.mode == POLL:
                    log.info("SIGHUP: rescanning the model repository")
                    self.control.poll()
                else:
                    log.info("SIGHUP ignored: model control mode '%s' does not rescan the repository",
                             self.options.model_control_mode)

    # --------------------------------------------------------------- fds

    def _watch_fd(self, fd: int, handler: Callable[[], None]) -> None:
        self._fd_handlers[fd] = handler
        self.poller.register(fd, zmq.POLLIN)

    def _unwatch_fd(self, fd: int) -> None:
        if self._fd_handlers.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def _watch_worker(self, h: WorkerHandle) -> None:
        self._watch_fd(h.sock.fileno(), lambda: self._on_worker_message(h))
        self._watch_fd(h.sentinel, lambda: self._on_worker_exit(h))

    # ------------------------------------------------------------- timers

    def _call_later(self, delay: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._timers, _Timer(time.monotonic() + delay, next(self._timer_seq), action))

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0].when <= now:
            heapq.heappop(self._timers).action()

    def _poll_timeout(self, drain_deadline: Optional[float]) -> Optional[int]:
        deadlines = [t.when for t in self._timers[:1]]
        if drain_deadline is not None:
            deadlines.append(drain_deadline)
        for mv in self.registry.all_versions():
            if isinstance(mv.queue, DynamicBatcher):
                due = mv.queue.next_deadline()
                if due is not None:
                    deadlines.append(due)
            elif any(req.deadline for req in mv.queue):
                deadlines.append(time.monotonic() + 0.01)
        if not deadlines:
            return None
        return max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)

    # ----------------------------------------------------------- frontend

    def _on_frontend(self, sock: zmq.Socket) -> None:
        # Drain what is there now, but give the workers' answers a turn too.
        # Batched models see the whole burst before a batch goes out: what
        # is already waiting is batched together.
        self._burst = set()
        try:
            for _ in range(64):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._handle_request(sock, frames)
        finally:
            burst, self._burst = self._burst, None
            for mv in burst:
                self._dispatch(mv)

    def _handle_request(self, sock: zmq.Socket, frames: list) -> None:
        identity = frames[0].bytes
        request_id = None
        if len(frames) == 2 and len(frames[1]) == 0 and self.frontend.notifies_disconnect:
            # ROUTER_NOTIFY: the peer disconnected (closed, crashed, killed)
            self.sessions.disconnected(identity)
            return
        try:
            if len(frames) < 2:
                raise TorchpoolError(errors.INVALID_ARG, "empty request: expected a header frame")
            header = messages.decode_header(frames[1].buffer)
            request_id = header.get("id")
            op = header.get("op")
            session = self._session_of(header, identity)
            if op == messages.OP_INFER:
                self._accept_infer(sock, identity, request_id, header, [f.buffer for f in frames[2:]],
                                   session)
                return
            if not isinstance(op, str) or op not in messages.CONTROL_OPS:
                raise TorchpoolError(errors.UNSUPPORTED, f"unknown operation {op!r}")
            if op in (messages.OP_LOAD, messages.OP_UNLOAD):
                self.control.check_explicit(op)
                waiter = self._deferred_reply(sock, identity, request_id)
                if op == messages.OP_LOAD:
                    self.control.load(header.get("model"), header.get("config"), waiter)
                else:
                    self.control.unload(header.get("model"), waiter)
                return
            if op in messages.SESSION_OPS:
                result = self._session_control(op, header, session, identity)
            else:
                result = self._control(op, header)
        except TorchpoolError as exc:
            self.frontend.send(sock, identity, messages.error_response(request_id, exc))
            return
        except Exception as exc:  # a malformed request must never take the daemon down
            log.exception("request %r could not be handled", request_id)
            self.frontend.send(sock, identity, messages.error_response(
                request_id, TorchpoolError(errors.INVALID_ARG, f"malformed request: {exc!r}")))
            return
        self.frontend.send(sock, identity, messages.ok_response(request_id, result=result))

    def _session_of(self, header: dict, identity: bytes) -> Any:
        """The request's client session (lease renewed), after it hands back
        the output blocks it has finished reading."""
        session = self.sessions.get(header.get("session"), identity)
        if session is not None and header.get("release"):
            self.sessions.release(session, header["release"])
        return session

    def _session_control(self, op: str, header: dict, session: Any, identity: bytes) -> Any:
        sessions = self.sessions
        if op == messages.OP_HELLO:
            return sessions.hello(header, identity)
        if session is None:
            raise TorchpoolError(errors.INVALID_ARG, f"'{op}' needs a session: say hello first")
        if op == messages.OP_GOODBYE:
            sessions.close(session)
            return True
        if op == messages.OP_ARENA_GROW:
            return sessions.grow(session, header)
        if op == messages.OP_REGISTER:
            return sessions.register(session, header)
        if op == messages.OP_UNREGISTER:
            return sessions.unregister(session, header.get("name"))
        return sessions.status(session, header.get("name"))

    def _forget(self, refs: list) -> None:
        """Every live worker unmaps segments of a closed session or region."""
        for h in self.supervisor.workers.values():
            try:
                h.send(internal.FORGET, refs)
            except OSError:
                pass

    # ------------------------------------------------------- model control

    def start_version(self, mv: ModelVersion) -> None:
        if mv.config.dynamic_batching is not None and not isinstance(mv.queue, DynamicBatcher):
            mv.queue = DynamicBatcher(mv.config, self.arena, self.transfer)
        if mv.config.sequence_batching is not None and mv.sequences is None:
            try:
                if mv.config.dynamic_batching is not None:
                    raise TorchpoolError(errors.INVALID_ARG, "a model has one scheduler: set "
                                                             "dynamic_batching or sequence_batching, not both")
                mv.sequences = SequenceBatcher(mv.config, Path(mv.model_file).parent.parent)
            except TorchpoolError as exc:
                self._version_failed(mv, exc.message)
                return
            if not self._sequence_sweep:
                self._sequence_sweep = True
                self._call_later(0.25, self._expire_sequences)
        for handle in self.supervisor.spawn_instances(mv):
            self._watch_worker(handle)

    def version_gone(self, mv: ModelVersion) -> None:
        """A retired version's workers are all gone: drop what it shared."""
        from ..shm.segment import unlink_segment

        unlink_segment(self.supervisor.weights_segment(mv))
        log.info("%s unloaded", mv.label)

    def _poll_repository(self) -> None:
        self.control.poll()
        self._call_later(self.options.repository_poll_secs, self._poll_repository)

    def _deferred_reply(self, sock: zmq.Socket, identity: bytes, request_id: Any) -> Callable:
        """Answer a request later (load / unload finish after the call returns)."""
        def reply(err: Optional[TorchpoolError]) -> None:
            header = messages.error_response(request_id, err) if err else \
                messages.ok_response(request_id, result=True)
            self.frontend.send(sock, identity, header)
        return reply

    def _watchdog(self) -> None:
        """WATCHDOG=1 from the main loop itself: a stuck loop stops the pings."""
        self.notifier.watchdog()
        self._call_later(self.notifier.watchdog_interval, self._watchdog)

    def _metrics_snapshot(self) -> tuple[list, dict]:
        rows = [(mv.name, mv.version, mv.stats, len(mv.queue)) for mv in list(self.registry.all_versions())]
        shm = {"input_mapped": self.arena.mapped_bytes, "input_used": self.arena.used_bytes,
               "client_arenas": sum(s.arena_bytes for s in list(self.sessions.sessions.values()))}
        return rows, shm

    def _expire_sessions(self) -> None:
        self.sessions.expire()
        self._call_later(max(0.2, self.options.client_lease / 4), self._expire_sessions)

    def _control(self, op: str, header: dict) -> Any:
        reg = self.registry
        name, version = header.get("model"), header.get("version")
        if op == messages.OP_SERVER_LIVE:
            return not self.should_exit
        if op == messages.OP_SERVER_READY:
            return not self.should_exit and reg.server_ready()
        if op == messages.OP_MODEL_READY:
            return not self.should_exit and reg.model_ready(name, version)
        if op == messages.OP_MODEL_METADATA:
            return reg.metadata(name, version)
        if op == messages.OP_MODEL_CONFIG:
            return reg.config(name, version)
        if op == messages.OP_REPOSITORY_INDEX:
            return reg.repository_index()
        if op == messages.OP_STATISTICS:
            return reg.statistics(name, version)
        if op == messages.OP_SERVER_METADATA:
            from .. import __version__
            return {"name": "torchpool", "version": __version__,
                    "extensions": ["system_shared_memory", "local_shared_memory"],
                    "transfer": dict(self.transfer)}
        raise TorchpoolError(errors.UNSUPPORTED, f"unknown operation {op!r}")

    def _accept_infer(self, sock: zmq.Socket, identity: bytes, request_id: Any, header: dict,
                      frames: list, session: Any) -> None:
        if self.should_exit:
            raise TorchpoolError(errors.UNAVAILABLE, "server is shutting down")
        mv = self.registry.resolve(header.get("model"), header.get("version"))
        staged, outputs, batch_size, regions, region_outputs = validate_infer(
            header, frames, mv, session, self.sessions)
        timeout_us = header.get("timeout_us") or 0
        if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us < 0:
            timeout_us = 0
        req = InferRequest(sock, identity, request_id, mv, [], outputs, [], None,
                           batch_size=batch_size, session=session, regions=regions,
                           region_outputs=region_outputs, timeout_us=timeout_us,
                           output_shm=bool(header.get("output_shm")) and session is not None and session.local)
        if mv.sequences is not None:
            req.sequence = parse_flags(header, mv.name)
            state = [name for name in mv.sequences.state_outputs if name not in req.outputs]
            req.outputs = req.outputs + state          # the worker returns them; the client never sees them
            req.hidden_outputs = frozenset(state)
        batch_layout(req, staged, mv.config)
        batcher = mv.queue if isinstance(mv.queue, DynamicBatcher) else None
        if batcher is not None:
            # written into its batch's contiguous inputs by the batcher, once
            req.staged = staged
            req.level = batcher.level_of(header.get("priority"))
            batcher.check_room(req)
        else:
            self._stage(req, staged)
            if timeout_us > 0:
                req.deadline = time.monotonic() + timeout_us / 1e6
        # held until the request is answered: regions cannot go, the session cannot expire
        for region in regions:
            region.in_use += 1
        if session is not None:
            session.in_flight += 1
        if batcher is not None:
            batcher.push(req, time.monotonic())
            if self._burst is not None:
                self._burst.add(mv)          # dispatched once the burst is read
                return
        elif mv.sequences is not None:
            if mv.sequences.arrive(req):
                self._begin_in_sequence(mv, req)
            return                           # else it waits for its sequence's running request
        else:
            mv.queue.append(req)
        self._dispatch(mv)

    # ---------------------------------------------------------- sequences

    def _begin_in_sequence(self, mv: ModelVersion, req: Optional[InferRequest]) -> None:
        """Queue `req` with its sequence's control and state tensors; when it
        may not run, fail it and go on with the next request of that sequence."""
        while req is not None:
            try:
                if mv.state == UNAVAILABLE:
                    raise TorchpoolError(errors.UNAVAILABLE, f"{mv.label} is not available: {mv.reason}")
                tensors = mv.sequences.begin(req, time.monotonic())
                try:
                    inputs, blocks = write_tensors(tensors, self.arena)
                except ArenaFull as exc:
                    raise TorchpoolError(errors.UNAVAILABLE, f"model '{mv.name}': {exc}; retry later or "
                                                             f"raise --shm-limit") from None
            except TorchpoolError as exc:
                self.answers.fail(req, exc)
                req = mv.sequences.after_failure(req)
                continue
            req.inputs = req.inputs + inputs
            req.blocks = req.blocks + blocks
            mv.queue.append(req)
            self._dispatch(mv)
            return

    def _advance_sequences(self) -> None:
        """Answered requests of sequences: the next request of each, if one waits."""
        while self._sequence_done:
            done = list(self._sequence_done)
            self._sequence_done.clear()          # in place: Answers holds its append
            now = time.monotonic()
            for req in done:
                mv = req.version
                if mv.sequences is not None:
                    self._begin_in_sequence(mv, mv.sequences.finished(req, now))

    def _expire_sequences(self) -> None:
        now = time.monotonic()
        for mv in self.registry.all_versions():
            if mv.sequences is not None:
                for corrid in mv.sequences.expire(now):
                    log.debug("%s: sequence %s idle for %.1f s: released", mv.label, corrid,
                              mv.sequences.idle_s)
        self._call_later(0.25, self._expire_sequences)

    def _fail_queued(self, mv: ModelVersion, err: TorchpoolError) -> None:
        """Answer every request of `mv` that has not started: queued, or
        waiting for its sequence."""
        waiting = mv.sequences.drain() if mv.sequences is not None else []
        for req in [*mv.queue, *waiting]:
            self.answers.fail(req, err)
        mv.queue.clear()

    def _stage(self, req: InferRequest, staged: list) -> None:
        """A request run on its own: inline inputs copied once into the arena,
        inputs already in shared memory passed by descriptor, and its
        `batch_input` tensors computed."""
        mv = req.version
        self.answers.collect_finished_sends()   # input blocks answers were sent from come back
        req.inputs, req.blocks = stage_inputs(staged, self.arena, mv.name)
        for _spec, _shape, _model_shape, payload, location in staged:
            self.transfer["input_bytes_in_place" if location else "input_bytes_copied"] += len(payload)
        if mv.config.batch_inputs:
            try:
                extra, blocks = stage_batch_inputs(mv.config, [req], self.arena)
            except ArenaFull as exc:
                for block in req.blocks:
                    self.arena.free(block)
                raise TorchpoolError(errors.UNAVAILABLE, f"model '{mv.name}': {exc}; retry later or "
                                                         f"raise --shm-limit") from None
            req.inputs = req.inputs + extra
            req.blocks = req.blocks + blocks

    # ----------------------------------------------------------- dispatch

    def _dispatch(self, mv: ModelVersion) -> None:
        queue = mv.queue
        if isinstance(queue, DynamicBatcher):
            self._dispatch_batches(mv, queue)
            return
        while queue and mv.idle:
            req = queue.popleft()
            if req.deadline is not None and time.monotonic() > req.deadline:
                self.answers.fail(req, TorchpoolError(errors.UNAVAILABLE, "Request timeout expired"))
                continue
            self._run(mv, Batch.single(req))

    def _dispatch_batches(self, mv: ModelVersion, batcher: DynamicBatcher) -> None:
        """Send formed batches to idle instances; form the next one meanwhile."""
        now = time.monotonic()
        while batcher and mv.idle:
            try:
                batch, due = batcher.take(now)
            except Exception as exc:  # a bug must not lose requests or stop the daemon
                log.exception("forming a batch of %s failed", mv.label)
                for req in list(batcher):
                    self.answers.fail(req, TorchpoolError(errors.INTERNAL, f"{mv.label}: forming a batch "
                                                                    f"failed: {exc}"))
                batcher.clear()
                return
            if batch is None:
                if due is not None and (batcher.wake_at is None or due < batcher.wake_at):
                    batcher.wake_at = due
                    self._call_later(max(0.0, due - now), lambda: self._batch_due(mv, batcher))
                break
            if batch.error is not None:
                self.answers.fail_batch(batch, batch.error)
                continue
            self._run(mv, batch)
        if batcher:
            batcher.prepare(now)

    def _batch_due(self, mv: ModelVersion, batcher: DynamicBatcher) -> None:
        if batcher.wake_at is not None and batcher.wake_at <= time.monotonic():
            batcher.wake_at = None
        if mv.queue is batcher:
            self._dispatch(mv)

    def _run(self, mv: ModelVersion, batch: Batch) -> None:
        worker = mv.idle.popleft()
        worker.state = BUSY
        worker.batch = batch
        worker.batch_id = next(self._batch_ids)
        now = time.monotonic()
        for req in batch.requests:
            mv.stats.queue.add(int((now - req.received) * 1e9))
        limit = self._execution_timeout(mv)
        if limit:
            self._call_later(limit, lambda w=worker, b=worker.batch_id: self._kill_if_hung(w, b, limit))
        self.answers.collect_finished_sends()
        releases, worker.releases = worker.releases, []
        try:
            worker.send(internal.RUN, worker.batch_id, batch.inputs, batch.outputs, releases)
        except OSError:
            pass  # the worker is dying; its sentinel will answer this batch

    def _execution_timeout(self, mv: ModelVersion) -> float:
        """Seconds a batch may run: the model's TORCHPOOL_EXECUTION_TIMEOUT_S, else the daemon's."""
        value = mv.config.parameters.get("TORCHPOOL_EXECUTION_TIMEOUT_S")
        try:
            return float(value) if value is not None else self.options.execution_timeout
        except ValueError:
            return self.options.execution_timeout

    def _kill_if_hung(self, worker: WorkerHandle, batch_id: int, limit: float) -> None:
        if worker.state == BUSY and worker.batch_id == batch_id and worker.batch is not None:
            log.error("%s exceeded the execution timeout of %g s; killing it", worker.label, limit)
            worker.timed_out = limit
            worker.process.kill()      # the sentinel answers its requests and respawns it

    def _expire_queued(self) -> None:
        now = time.monotonic()
        for mv in self.registry.all_versions():
            queue = mv.queue
            if isinstance(queue, DynamicBatcher):
                due = queue.next_deadline()
                if due is not None and due <= now:
                    for req in queue.expire(now):
                        self.answers.fail(req, TorchpoolError(errors.UNAVAILABLE, "Request timeout expired"))
                    self._dispatch(mv)
                continue
            if queue and any(r.deadline is not None and now > r.deadline for r in queue):
                keep = []
                for req in queue:
                    if req.deadline is not None and now > req.deadline:
                        self.answers.fail(req, TorchpoolError(errors.UNAVAILABLE, "Request timeout expired"))
                    else:
                        keep.append(req)
                queue.clear()
                queue.extend(keep)

    def _pending(self) -> int:
        return sum(len(mv.queue) + sum(1 for h in mv.workers if h.batch is not None)
                   + (mv.sequences.waiting() if mv.sequences is not None else 0)
                   for mv in self.registry.all_versions())

    # ------------------------------------------------------------ workers

    def _on_worker_message(self, h: WorkerHandle) -> None:
        msg = h.recv()
        if msg is None:          # EOF: the sentinel tells how it died
            self._unwatch_fd(h.sock.fileno())
            return
        kind = msg[0]
        mv = h.mv
        if kind == internal.READY:
            h.state = IDLE
            mv.idle.append(h)
            log.debug("%s ready (pid %s, %s)", h.label, msg[1], msg[2])
            for later in self.supervisor.spawn_deferred(mv):
                self._watch_worker(later)
            if mv.state == LOADING and not mv.deferred and all(w.state != STARTING for w in mv.workers):
                mv.state = READY
                log.info("%s READY (%d instance%s)", mv.label, len(mv.workers),
                         "" if len(mv.workers) == 1 else "s")
                self._announce_if_ready()
                self.control.version_settled(mv)
            self._dispatch(mv)
        elif kind == internal.LOAD_FAILED:
            self._version_failed(mv, msg[2])
        elif kind in (internal.DONE, internal.FAILED):
            batch, h.batch = h.batch, None
            batch_id = h.batch_id
            h.state = IDLE
            mv.idle.append(h)
            if batch is not None:
                self.answers.free_batch(batch)
            # the next batch (already written while this one ran) goes first
            self._dispatch(mv)
            if batch is not None:
                if msg[1] != batch_id:
                    outcome: tuple = ("failed", TorchpoolError(
                        errors.INTERNAL, f"{h.label} answered batch {msg[1]} while running "
                                         f"batch {batch_id}"))
                elif kind == internal.DONE:
                    mv.stats.record_execution(batch.items, len(batch.requests), *msg[3][:3])
                    mv.consecutive_crashes = 0
                    if mv.sequences is not None:      # the state outputs, before the blocks go back
                        for req in batch.requests:
                            mv.sequences.capture(req, msg[2], self.answers.read_output)
                    outcome = ("done", msg[2], h, frozenset(msg[4]) if len(msg) > 4 else frozenset())
                else:
                    outcome = ("failed", TorchpoolError(msg[2], msg[3]))
                self.answers.complete(mv, batch, outcome)
            if self.registry.retiring:
                self.control.progress()

    def _version_failed(self, mv: ModelVersion, reason: str) -> None:
        first = mv.state != UNAVAILABLE
        mv.fail(reason)
        if first:
            log.error("%s is UNAVAILABLE: %s", mv.label, reason)
        self._fail_queued(mv, TorchpoolError(errors.UNAVAILABLE, f"{mv.label} is not available: {reason}"))
        for w in list(mv.workers):
            if w.process.exitcode is None:
                w.process.kill()      # the sentinel fires and reaps it
        self._announce_if_ready()
        self.control.version_settled(mv)

    def _on_worker_exit(self, h: WorkerHandle) -> None:
        self._unwatch_fd(h.sentinel)
        self._unwatch_fd(h.sock.fileno())
        was = h.state
        how = self.supervisor.reap(h)
        self.sessions.worker_gone(h)
        self.answers.worker_gone(h)
        mv = h.mv
        if h.batch is not None:
            batch, h.batch = h.batch, None
            self.answers.free_batch(batch)
            if h.timed_out:
                why = (f"{h.label} exceeded the execution timeout of {h.timed_out:g} s and was killed; "
                       f"it is being restarted")
            else:
                why = f"{h.label} {how} while running this request"
            self.answers.complete(mv, batch, ("failed", TorchpoolError(errors.INTERNAL, why)))
        if mv.state == UNLOADING:
            if not any(w.state != DEAD for w in mv.workers):
                self._fail_queued(mv, TorchpoolError(errors.UNAVAILABLE, f"{mv.label} was unloaded"))
            self.control.progress()
            return
        if self.should_exit or mv.state == UNAVAILABLE:
            return
        if was == STARTING:
            self._version_failed(mv, f"instance '{h.spec.instance}' {how} while loading")
            return
        log.error("%s %s; restarting it", h.label, how)
        mv.stats.worker_restarts += 1
        # A crash loop is crashes with no successful execution in between: a
        # model that serves between crashes (a bad input now and then, an OOM
        # kill) is restarted for ever, with backoff; one that never gets a
        # batch through is given up on.
        mv.consecutive_crashes += 1
        if mv.consecutive_crashes > self.options.max_restarts:
            self._version_failed(mv, f"instance '{h.spec.instance}' crashed {mv.consecutive_crashes} "
                                     f"times without a successful execution in between (last: {how})")
            return
        delay = min(0.1 * 2 ** (mv.consecutive_crashes - 1), 10.0)
        self._call_later(delay, lambda: self._respawn(mv, h.spec.instance, h.spec.device))

    def _respawn(self, mv: ModelVersion, instance: str, device: str) -> None:
        if self.should_exit or mv.state in (UNAVAILABLE, UNLOADING):
            return
        self._watch_worker(self.supervisor.spawn(mv, instance, device))

    def _announce_if_ready(self) -> None:
        if self._announced_ready or self.registry.loading():
            return
        self._announced_ready = True
        versions = self.registry.all_versions()
        ready = sum(1 for mv in versions if mv.state == READY)
        broken = sum(1 for m in self.registry.models.values() if m.error)
        log.info("torchpool ready: %d of %d model versions READY%s, in %.2f s; listening on %s",
                 ready, len(versions), f", {broken} models failed to load" if broken else "",
                 time.monotonic() - self._started, ", ".join(self.options.listen))
        self.notifier.ready(f"serving {ready} of {len(versions)} model versions"
                            + (f"; {broken} models failed to load" if broken else ""))
