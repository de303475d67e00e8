"""The torchpool daemon: one broker process, one worker process per instance.

    clients (DEALER)                        broker (this process, one thread, broker/loop.py)
    ───────────────────┐   ipc:// tcp://   ┌──────────────────────────────────────────────┐
    [header, frames] ──┼──────────────────►│ Frontend: a ROUTER per --listen URL           │
                       │                   │ Intake: route each request                    │
                       │                   │   control ops ─► Registry, ModelControl,      │
                       │                   │                  SessionManager               │
                       │                   │   infer: validate (rules/validation.py) ─► │
                       │                   │   the version's Scheduler (schedulers/:       │
                       │                   │   direct, dynamic, sequence) ─► Instances     │
    [header, frames] ◄─┼───────────────────│ Answers (answers/): split per request, order, │
    ───────────────────┘                   │   lend / send zero-copy from worker memory    │
                                           └──────┬─────────────────────────▲──────────────┘
                                 RUN [descriptors]│ SOCK_SEQPACKET          │ DONE [descriptors]
                                                  ▼                         │
                                     worker (one per model instance, forked from the torch
                                     template by the Supervisor; its lifecycle is Instances'):
                                     views inputs in shm, runs the model (large outputs made
                                     in shm: worker/capture.py), writes the others once.
                                     A local client's plain requests may skip the broker:
                                     direct.py hands it a socket to the worker (worker/direct.py)

Who owns what:
    server.py       startup / main loop / shutdown, dispatch to idle instances
    signals.py      signals recorded by their handlers, acted on by the loop
    intake.py       client requests: control calls routed, inferences validated and queued
    loop.py         the poller, fd handlers and timers everything runs on
    requests.py     InferRequest: an accepted request, its batch layout and staging
    direct.py       direct paths: a local client's plain requests sent to a worker
    schedulers/     one Scheduler per version (base.py is the interface the loop uses)
    deadlines.py    which schedulers have a deadline the loop must wake for
    batch.py        Batch, and the tensors the broker computes for one (batch_input)
    instances.py    worker lifecycle: ready, run, done, crash backoff, execution and load timeouts
    supervisor.py   worker processes: fork from the template, reap, stop
    answers/        one answer per request: split outputs, ordering, lent and sent blocks
    sessions.py     local clients: their arenas, registered regions, lent outputs
    registry.py     model / version records and the Triton control calls that read them
    model_control.py  load / unload / poll, reload beside the serving versions

Every accepted request is answered exactly once: with outputs, or with an
error naming model, tensor and what went wrong (bad input, worker crash,
timeout, shutdown). Signal handlers only record the signal; the loop acts.
"""
from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import zmq

from ..config import scan_repository
from ..logs import set_process_title
from ..config.parameters import ParameterError, model_parameters
from ..protocol import errors, messages
from ..protocol.errors import TorchpoolError
from ..protocol.internal import SegmentRef
from ..shm import Arena, daemon_id, remove_segments_with_prefix, remove_stale_segments, segment_prefix
from ..shm.bulkcopy import set_stream_threshold, streams
from ..shm.reaper import Reaper
from .answers import Answers
from .frontend import Frontend
from .instances import InstanceEvents, Instances
from .direct import DirectPaths
from .intake import Intake
from .lifecycle import Stopping
from .lane import ReplySocket
from .local_channel import LocalChannel, resolve_path
from ..rules.validation import TensorLimits
from .loop import Loop
from .gateways import GatewayProcess
from .metrics import MetricsServer, MetricsSnapshot, configure_metrics, serve_metrics, take_snapshot
from .model_control import EXPLICIT, POLL, ModelControl, fingerprint
from .options import ServerOptions
from .deadlines import SchedulerDeadlines
from .registry import LOADING, READY, ModelVersion, Registry
from .schedulers import make_scheduler
from .sessions import Session, SessionManager
from .signals import SignalInbox
from .supervisor import Supervisor
from .systemd import Notifier, ServiceStatus

log = logging.getLogger("torchpool.broker")

# how long a scrape waits for the loop to read the workers' reports first
METRICS_CATCH_UP_S = 2.0


class ModelLoadFailed(Exception):
    """--exit-on-error: a model failed to load at startup (its one-line reason)."""


class Server:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.daemon = daemon_id(options.listen)
        self.prefix = segment_prefix(self.daemon)
        self.loop = Loop(options.direct_spin_us)
        self.ctx: Optional[zmq.Context[zmq.Socket[bytes]]] = None
        self.frontend: Optional[Frontend] = None
        self.arena: Optional[Arena] = None
        self.registry: Optional[Registry] = None
        self.supervisor: Optional[Supervisor] = None
        self.instances: Optional[Instances] = None
        self.intake: Optional[Intake] = None
        self.sessions: Optional[SessionManager] = None
        self.local_channel: Optional[LocalChannel] = None
        # bytes the broker copied vs. passed by descriptor, for benchmarks and tests
        self.transfer: Counter[str] = Counter()
        self.answers: Optional[Answers] = None
        self.reaper = Reaper()     # closes shared memory off the loop thread (shm/reaper.py)
        self.signals = SignalInbox((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
        self.stopping = Stopping()       # shared by the parts that refuse work once the daemon stops
        self.force_exit = False
        self._started = time.monotonic()
        self.service = ServiceStatus(Notifier(), self.loop.call_later)   # systemd's view
        self.control: Optional[ModelControl] = None
        self.metrics: Optional[MetricsServer] = None
        self.gateway: Optional[GatewayProcess] = None
        self._startup_versions: list[ModelVersion] = []   # what the start's READY=1 waits for
        self.failure: Optional[ModelLoadFailed] = None
        self.deadlines = SchedulerDeadlines()    # _dispatch touches every version it schedules

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT: 0. After a clean shutdown, raises ModelLoadFailed
        (--exit-on-error), AddressInUse, GatewayError or ConfigError when the start failed."""
        set_process_title(f"torchpool broker {self.options.listen[0]}")
        try:
            self.startup()
            gc.freeze()   # what lives as long as the daemon: a full collection 19 ms -> ~1 ms
            self.main_loop()
        finally:
            self.shutdown()
        if self.failure is not None:
            raise self.failure
        return 0

    def startup(self) -> None:
        metrics_config = configure_metrics(self.options.metrics_config)   # checked by the CLI already
        self.loop.watch(self.signals.install(), self._on_signal)
        stale = remove_stale_segments(self.daemon)
        if stale:
            log.warning("removed %d shared-memory segments left by a dead daemon", len(stale))
        o = self.options
        set_stream_threshold(o.stream_copy_bytes)     # before the first copy into the arena
        if streams(o.stream_copy_bytes):
            log.info("copies of %d bytes and more into shared memory store around the CPU caches "
                     "(--stream-copy-bytes)", o.stream_copy_bytes)
        elif o.stream_copy_bytes:
            log.warning("--stream-copy-bytes %d: the _streamcopy extension is not built; every copy "
                        "is an ordinary one", o.stream_copy_bytes)
        self.arena = Arena(lambda i: f"{self.prefix}in{i}", o.shm_chunk, o.shm_limit)
        self.arena.free(self.arena.alloc(1))   # first segment created and pre-faulted now
        # The parts are made in dependency order, each given the parts it calls. Where
        # a part calls one made after it (a session's end gives back the answers'
        # loans, closes its local channel, has the workers forget its regions; the
        # instances tell model control, which starts versions on them), a method of
        # the server stands between them and calls the later part.
        local_path = resolve_path(o.local_socket, o.listen, self.daemon)
        self.sessions = sessions = SessionManager(self.prefix, o, self._end_loans, self._forget_in_workers,
                                                  local_path, close_channel=self._close_channel,
                                                  close_segment=self.reaper.close)
        self.ctx = zmq.Context()
        # a connection that stopped reading loses its sessions; a gone one's queued requests are failed
        self.frontend = frontend = Frontend.from_options(self.ctx, o, on_stalled=sessions.disconnected,
                                                         on_gone=self._connection_gone)
        self.answers = answers = Answers(frontend, self.arena, self.transfer, sessions,
                                         close_segment=self.reaper.close)
        self.loop.call_later(max(0.2, o.client_lease / 4), self._expire_sessions)
        entries = scan_repository(o.model_repository)
        if not entries:
            log.warning("model repository %s holds no models", o.model_repository)
        if o.model_control_mode == EXPLICIT and "*" not in o.load_models:
            entries = [e for e in entries if e.name in o.load_models]
        self.registry = registry = Registry(entries)
        self.supervisor = Supervisor(self.prefix, o.worker_shm_chunk, o.worker_shm_limit, o.log_level,
                                     o.worker_busy_poll_us, o.log_format, registry,
                                     o.output_capture_mib, o.stream_copy_bytes)
        self.instances = instances = Instances(self.loop, self.supervisor, answers, sessions, o, InstanceEvents(
            idle=self._dispatch, settled=self._settled, drained=self._drained, stopping=self.stopping))
        self.control = ModelControl(registry, o.model_repository, o.model_control_mode,
                                    self.start_version, instances.version_gone)
        limits = TensorLimits.of(o)
        direct = DirectPaths(registry, limits, instances.execution_timeout,
                             self.stopping, o.direct_spin_us) if o.direct_paths else None
        self.intake = intake = Intake(frontend, registry, sessions, self.control, answers,
                                      self.transfer, self._dispatch, self.stopping,
                                      remote_model_control=o.remote_model_control, limits=limits,
                                      direct=direct, catch_up=instances.catch_up,
                                      max_header_bytes=o.max_header_bytes)
        for sock in frontend.sockets:
            self.loop.watch(sock, functools.partial(intake.on_readable, sock))
        frontend.watch_connections(self.loop)
        if local_path is not None:
            self.local_channel = LocalChannel(local_path, self.loop, sessions, o.local_allow_users,
                                              o.local_allow_groups, o.max_sessions, o.max_sessions_per_peer,
                                              frontend.connections, o.max_unread_replies,
                                              on_requests=intake.on_lane, on_lane_gone=self._connection_gone,
                                              offers_direct=direct is not None)
        # bound before any model loads: a busy port fails at once
        self.loop.open_door()                 # the metrics server's scrapes catch up first
        self.metrics = serve_metrics(o, self._metrics_snapshot, self.stopping, registry.server_ready,
                                     metrics_config)
        for model in self.registry.models.values():
            model.fingerprint = fingerprint(model.entry.path)
            if model.error:
                log.error("model '%s' is UNAVAILABLE: %s", model.name, model.error)
                if o.exit_on_error:
                    self._stop_starting(f"model '{model.name}' failed to load: {model.error}")
        if o.model_control_mode == POLL and o.repository_poll_secs > 0:
            self.loop.call_later(o.repository_poll_secs, self._poll_repository)
        self._startup_versions = self.registry.all_versions()
        log.info("listening on %s; loading %d model versions from %s", ", ".join(o.listen),
                 len(self._startup_versions), o.model_repository)
        self.service.loading_started(len(self._startup_versions))
        for mv in self._startup_versions:
            if self.failure is None:    # --exit-on-error: the rest do not start
                self.start_version(mv)
        if self.failure is not None:
            return                      # main_loop stops at once; run() raises it
        if o.http_port is not None or o.grpc_port is not None:
            self.gateway = GatewayProcess(o, logging.getLevelName(o.log_level).lower())
            self.gateway.start()        # GatewayError (a busy port...): the daemon does not start
            self.loop.call_later(1.0, self._check_gateway)
        self._announce_if_ready()

    def _end_loans(self, session: Session) -> None:
        assert self.answers is not None        # made before any session can end
        self.answers.end_loans(session)

    def _connection_gone(self, sock: ReplySocket, identity: bytes) -> None:
        """A gone connection's (or lane's) queued requests are failed, not run: once
        the reply that found it gone is sent (answering them there would nest in Answers)."""
        self.loop.call_later(0.0, functools.partial(self._cancel_queued, sock, identity))

    def _forget_in_workers(self, refs: Sequence[SegmentRef]) -> None:
        assert self.supervisor is not None     # made before any session can end
        self.supervisor.forget(refs)

    def _close_channel(self, conn: socket.socket) -> None:
        assert self.local_channel is not None  # a session has a channel only through it
        self.local_channel.close_channel(conn)

    def _drained(self) -> None:
        assert self.control is not None        # # startup() made it before the loop runs
        self.control.progress()

    def main_loop(self) -> None:
        drain_deadline = None
        # With --busy-poll-us, right after activity (a request in flight, or a
        # client likely to send its next one) the loop keeps polling without
        # sleeping, yielding the CPU to anyone who needs it, and sleeps once it
        # has been idle that long: for hosts where waking a process costs more
        # than the spin (off by default: options.py says why).
        busy_poll = self.options.busy_poll_us / 1e6
        last_activity = 0.0
        # Without it, the loop still polls without sleeping while a worker runs
        # one of its batches and answers come sooner than the direct paths'
        # window (Loop.wait)
        assert self.instances is not None      # startup() made it before the loop runs
        busy = self.instances.busy
        while True:
            if self.stopping():
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + self.options.grace_period
                    self.service.stop()
                    if self.gateway is not None:
                        self.gateway.begin_stop()
                    log.info("shutting down: finishing %d accepted requests (grace %.0f s)",
                             self._pending(), self.options.grace_period)
                if self.force_exit or not self._pending() or time.monotonic() >= drain_deadline:
                    return
            if time.perf_counter() - last_activity < busy_poll:
                if not self.loop.poll(0):
                    os.sched_yield()
                    continue    # an empty spin: timers and deadlines wait (at most busy_poll_us)
                last_activity = time.perf_counter()
            elif self.loop.wait(self._poll_timeout(drain_deadline), bool(busy)):
                last_activity = time.perf_counter()
            self.loop.run_timers()
            self._expire_queued()

    def _check_gateway(self) -> None:
        if self.gateway is not None and not self.stopping():
            self.gateway.check()
            self.loop.call_later(1.0, self._check_gateway)

    def shutdown(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        # (no version has a scheduler before the answers and the instances are made)
        if self.registry is not None and self.answers is not None and self.instances is not None:
            for mv in self.registry.all_versions():
                if mv.scheduler is None:
                    continue
                self.answers.flush_held(mv)
                self.instances.fail_queued(mv, TorchpoolError(errors.UNAVAILABLE, "server is shutting down"))
                self.instances.fail_running(mv)
        if self.sessions is not None:
            self.sessions.close_all()
        if self.local_channel is not None:
            self.local_channel.close()
        if self.instances is not None:
            self.instances.stop()
        if self.frontend is not None:
            self._refuse_waiting(self.frontend)
            self.frontend.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=1000)   # closes any socket still open, then terminates
        if self.answers is not None:
            self.answers.close()
        self.reaper.stop()
        if self.arena is not None:
            self.arena.close()
        remove_segments_with_prefix(self.prefix)     # shared weights, the only named segments
        if self.metrics is not None:
            self.metrics.close()
        self.signals.restore()
        self.service.close()
        log.info("torchpool stopped")

    def _refuse_waiting(self, frontend: Frontend) -> None:
        """Requests that arrived while the workers stopped still get an answer."""
        refusal = TorchpoolError(errors.UNAVAILABLE, "server is shutting down")
        for sock in frontend.sockets:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                if len(frames) < 2 or not frames[1]:
                    continue
                try:
                    request_id = messages.decode_header(frames[1]).get("id")
                except messages.HeaderError as exc:
                    request_id = exc.request_id
                frontend.send(sock, frames[0], messages.error_response(request_id, refusal))

    # -------------------------------------------------------------- signals

    def _on_signal(self) -> None:
        for sig in self.signals.drain():
            if sig in (signal.SIGTERM, signal.SIGINT):
                if self.stopping() and sig == signal.SIGINT:
                    log.warning("second SIGINT: stopping now")
                    self.force_exit = True
                self._stop()
            elif sig == signal.SIGHUP:
                self._reload()

    def _reload(self) -> None:
        """SIGHUP (systemctl reload): poll mode rescans the repository; systemd hears
        RELOADING=1 now and READY=1 once what the rescan started has settled."""
        assert self.control is not None        # # startup() made it before the loop runs
        rescan = self.control.mode == POLL
        what = "rescanning the model repository" if rescan else f"nothing to reload ({self.control.mode} mode)"
        log.info("SIGHUP: %s", what)
        self.service.reload_started(what, loads=rescan)
        if rescan:
            self.control.poll()
        self._reload_done_if_settled()

    def _reload_done_if_settled(self) -> None:
        assert self.registry is not None       # # startup() made it before the loop runs
        if self.service.reloading and not self.registry.loading():
            self.service.reload_settled(self._serving_status())

    # ------------------------------------------------------------- timers

    def _poll_timeout(self, drain_deadline: Optional[float]) -> Optional[int]:
        due = None
        for when in (self.loop.next_timer(), drain_deadline, self.deadlines.earliest()):
            if when is not None and (due is None or when < due):
                due = when
        if due is None:
            return None
        return max(0, int((due - time.monotonic()) * 1000) + 1)

    def _expire_queued(self) -> None:
        """Schedulers whose deadline passed: fail what they give up on, then
        dispatch (a batch that waited for more requests may be due)."""
        now = time.monotonic()
        assert self.answers is not None        # # startup() made it before the loop runs
        for mv in self.deadlines.due(now):
            for req, err in mv.scheduler.expire(now):
                self.answers.fail(req, err)
            self._dispatch(mv)

    def _cancel_queued(self, sock: ReplySocket, identity: bytes) -> None:
        assert self.registry is not None and self.answers is not None   # # startup() made it before the loop runs
        for mv in self.registry.all_versions():
            if mv.scheduler is not None:
                for req, err in mv.scheduler.cancel(sock, identity):
                    self.answers.fail(req, err)

    def _expire_sessions(self) -> None:
        assert self.sessions is not None       # # startup() made it before the loop runs
        self.sessions.expire()
        self.loop.call_later(max(0.2, self.options.client_lease / 4), self._expire_sessions)

    def _poll_repository(self) -> None:
        assert self.control is not None        # # startup() made it before the loop runs
        self.control.poll()
        self.loop.call_later(self.options.repository_poll_secs, self._poll_repository)

    def _dispatch(self, mv: ModelVersion) -> None:
        """Idle instances of `mv` take the batches its scheduler has for them;
        the scheduler prepares the next one meanwhile."""
        scheduler = mv.scheduler
        assert self.answers is not None and self.instances is not None   # # startup() made it before the loop runs
        self.deadlines.touch(mv)      # it may have a deadline now
        if not len(scheduler):
            return
        now = time.monotonic()
        try:
            # the instance idle for the shortest time first: its caches (the
            # model's weights) and its thread pool are still warm. In turn, two
            # CPU instances of a ResNet-18 ran 0.87x one (one caller, the same
            # threads: each ran every other request, its caches cold).
            for instance in list(reversed(mv.idle)):
                batch = scheduler.take(instance, now)
                while batch is not None and batch.error is not None:
                    self.answers.fail_batch(batch, batch.error)
                    batch = scheduler.take(instance, now)
                if batch is not None:
                    self.instances.run(mv, instance, batch)
            if len(scheduler):
                self.instances.send_ahead(mv, now)
            if len(scheduler):
                scheduler.prepare(now)
        except Exception as exc:  # a bug must not lose requests or stop the daemon
            log.exception("scheduling %s failed", mv.label)
            self.instances.fail_queued(mv, TorchpoolError(errors.INTERNAL,
                                                          f"{mv.label}: scheduling failed: {exc}"))

    def _pending(self) -> int:
        assert self.instances is not None and self.registry is not None   # # startup() made it before the loop runs
        return sum(len(mv.scheduler) + self.instances.running(mv)
                   for mv in self.registry.all_versions() if mv.scheduler is not None)

    # ------------------------------------------------------- model control

    def start_version(self, mv: ModelVersion) -> None:
        assert self.arena is not None and self.instances is not None   # made before any version starts
        if mv.scheduler is None:
            try:
                model_parameters(mv.config)       # parsed once; a bad value fails the load here
                mv.scheduler = make_scheduler(mv.config, Path(mv.model_file).parent.parent, self.arena,
                                              self.transfer)
            except (TorchpoolError, ParameterError) as exc:
                reason = exc.message if isinstance(exc, TorchpoolError) else str(exc)
                mv.fail(reason)
                log.error("%s is UNAVAILABLE: %s", mv.label, reason)
                self._settled(mv)
                return
        self.instances.start_version(mv)

    def _settled(self, mv: ModelVersion) -> None:
        if self.service.starting and mv in self._startup_versions:
            if mv.state != READY and self.options.exit_on_error:
                self._stop_starting(f"{mv.label} failed to load: {mv.reason}")
            self.service.version_settled(sum(v.state != LOADING for v in self._startup_versions),
                                         len(self._startup_versions), f"{mv.name} v{mv.version} {mv.state}")
        if self.failure is None:
            self._announce_if_ready()
        assert self.control is not None        # made before any version starts
        self.control.version_settled(mv)
        self._reload_done_if_settled()

    def _stop_starting(self, reason: str) -> None:     # --exit-on-error
        if self.failure is None:
            self.failure = ModelLoadFailed(reason)
            self._stop()

    def _stop(self) -> None:
        """Stop taking requests, on direct paths too (their next ones come here, refused)."""
        self.stopping.set()
        if self.intake is not None and self.intake.direct is not None:
            assert self.sessions is not None   # made before the intake
            self.intake.direct.close_all(self.sessions.sessions.values())

    def _metrics_snapshot(self) -> MetricsSnapshot:
        """The state for a scrape (on the metrics server's thread). The loop
        first reads what the workers reported of their direct requests, as
        a statistics call does: a scrape after an answer counts it (else up
        to REPORTS_EVERY_S late). A loop too busy to do so within
        METRICS_CATCH_UP_S leaves the scrape as it is."""
        assert self.arena is not None and self.sessions is not None and self.instances is not None   # made before it
        instances = self.instances
        caught_up = threading.Event()

        def catch_up() -> None:
            try:
                instances.catch_up()
            finally:
                caught_up.set()
        self.loop.call_from_thread(catch_up)
        caught_up.wait(METRICS_CATCH_UP_S)
        # pending: accepted, not started (Triton's nv_inference_pending_request_count)
        shm = {"input_mapped": self.arena.mapped_bytes, "input_used": self.arena.used_bytes,
               "client_arenas": sum(s.arena_bytes for s in list(self.sessions.sessions.values()))}
        return take_snapshot(self.registry, instances.pending, shm)

    def _announce_if_ready(self) -> None:
        assert self.registry is not None       # made before any version starts
        if not self.service.starting or self.registry.loading():
            return
        counts, broken = self.registry.ready_counts()
        log.info("torchpool ready: %s READY%s, in %.2f s; listening on %s", counts, broken,
                 time.monotonic() - self._started, ", ".join(self.options.listen))
        self.service.ready(self._serving_status())

    def _serving_status(self) -> str:
        assert self.registry is not None       # # startup() made it before the loop runs
        return "serving {}{}".format(*self.registry.ready_counts())
