"""Worker lifecycle: every model instance from spawn to exit.

    start_version ─► spawn (supervisor) ─► STARTING ──READY──► IDLE ◄──┐
                           │ load timeout: aborted  │ run(batch)       │ DONE / FAILED
                           ▼                        ▼                  │ (nothing ahead)
                    version UNAVAILABLE           BUSY ────────────────┘
                                                  │  ▲ run(batch): sent ahead, started
                                                  │  └ at DONE / FAILED of the one before
                                                  │ crash, or the execution timeout
                                                  ▼ (killed; a hung one logs its stack first)
                      its batch fails, the one sent ahead is queued again;
                      respawned after a capped backoff, or the version is
                      given up on after a crash loop

The process mechanics (fork from the torch template, reap, stop) are the
supervisor's; this module decides what a worker's messages and deaths mean
for its version, its batch and the loop. It tells the server through
`InstanceEvents`: an instance became idle (dispatch), a version settled
(READY or failed), retiring versions may have drained.
"""
from __future__ import annotations

import functools
import logging
import select
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union, cast

from ..config.parameters import model_parameters
from ..logs import LOADING_NOTICE_S, log_fields
from ..protocol import errors, internal, reports
from ..protocol.errors import TorchpoolError
from ..rules.ahead import may_send_ahead
from ..shm.fdpass import close_all
from ..shm.segment import Segment, unlink_segment
from .answers import Answers, Executed
from .batch import Batch
from .loop import Loop
from .options import ServerOptions
from .registry import LOADING, READY, UNAVAILABLE, UNLOADING, ModelVersion
from .stats import BACKEND, OTHER, REJECTED
from .supervisor import ABORT_GRACE_S, BUSY, DEAD, IDLE, STARTING, Supervisor, WorkerHandle

if TYPE_CHECKING:
    from .sessions import SessionManager

log = logging.getLogger("torchpool.broker")

# While workers have report rings they are read this often: how stale the
# metrics of direct requests may be (statistics calls read them first).
REPORTS_EVERY_S = 0.1


@dataclass
class InstanceEvents:
    """What the server does when instances change."""

    idle: Callable[[ModelVersion], None]          # an instance is free: dispatch
    settled: Callable[[ModelVersion], None]       # a version is READY or UNAVAILABLE
    drained: Callable[[], None]                   # retiring versions may be done
    stopping: Callable[[], bool]                  # the daemon is shutting down


class Instances:
    def __init__(self, loop: Loop, supervisor: Supervisor, answers: Answers, sessions: "SessionManager",
                 options: ServerOptions, events: InstanceEvents) -> None:
        self.loop = loop
        self.supervisor = supervisor
        self.answers = answers
        self.sessions = sessions
        self.options = options
        self.events = events
        self._batch_ids = iter(range(1, 1 << 62))
        self._reading_reports = False      # a timer reads the report rings
        self._restarted: dict[WorkerHandle, float] = {}   # a respawned worker -> when its predecessor died
        # instances running a batch of ours: while any is, the loop expects an
        # answer soon and may poll for it without sleeping (server.main_loop)
        self.busy: set[WorkerHandle] = set()

    # ------------------------------------------------------------- start

    def start_version(self, mv: ModelVersion) -> None:
        log.info("%s loading", mv.label, extra=log_fields(mv.name, mv.version))
        mv.stats.loading_since = since = time.monotonic()
        for handle in self.supervisor.spawn_instances(mv):
            self._watch(handle)
        self.loop.call_later(LOADING_NOTICE_S, lambda: self._still_loading(mv, since))

    def _still_loading(self, mv: ModelVersion, since: float) -> None:
        if mv.state != LOADING or mv.stats.loading_since != since:
            return
        ready = sum(w.state != STARTING for w in mv.workers)
        total = len(mv.workers) + len(mv.deferred)
        log.info("still loading %s (%.0f s; %d of %d instances ready)", mv.label, time.monotonic() - since,
                 ready, total, extra=log_fields(mv.name, mv.version))
        self.loop.call_later(LOADING_NOTICE_S, lambda: self._still_loading(mv, since))

    def _watch(self, h: WorkerHandle) -> None:
        self.loop.watch(h.sock.fileno(), lambda: self._on_message(h))
        self.loop.watch(h.sentinel, lambda: self._on_exit(h))
        limit = self.options.load_timeout
        if limit > 0:
            self.loop.call_later(limit, lambda: self._kill_if_still_loading(h, limit))

    def _kill_if_still_loading(self, h: WorkerHandle, limit: float) -> None:
        if h.state == STARTING and h.process.exitcode is None:
            log.error("%s did not finish loading within %g s; killing it (SIGABRT: its Python stack "
                      "follows)", h.label, limit, extra=_fields(h))
            h.load_timed_out = limit
            self._end_hung(h)          # the sentinel fails its version

    def version_gone(self, mv: ModelVersion) -> None:
        """A retired version's workers are all gone: drop what it shared."""
        unlink_segment(self.supervisor.weights_segment(mv))
        self.answers.flush_held(mv)
        log.info("%s unloaded", mv.label, extra=log_fields(mv.name, mv.version))

    # ------------------------------------------------------------- run

    def run(self, mv: ModelVersion, worker: WorkerHandle, batch: Batch) -> None:
        """Send `batch` to `worker`: one of the version's idle instances, or a
        busy one with nothing ahead, which runs it when it finishes the one
        it runs (the worker reads its messages in order)."""
        if worker.state == BUSY:
            worker.ahead = batch
            worker.ahead_id = batch_id = next(self._batch_ids)
        else:
            mv.idle.remove(worker)
            worker.state = BUSY
            self.busy.add(worker)
            worker.batch = batch
            worker.batch_id = batch_id = next(self._batch_ids)
            self._started(mv, worker)
        self.answers.dispatched(mv, batch)
        self.answers.collect_finished_sends()
        releases, worker.releases = worker.releases, []
        try:
            known = worker.known
            missing = [d.segment for d in batch.inputs if d.segment.__class__ is str and d.segment not in known]
            if missing:
                self._hand_over(worker, missing)
            # (the outputs as the client asked: a region's or a classification's is the list the
            # worker decodes into an OutputTarget or a Classify; msgpack sends either as an array)
            outputs = cast("list[Union[str, internal.OutputTarget, internal.Classify]]", batch.outputs)
            worker.send(internal.Run(batch_id, batch.inputs, outputs, releases, batch.lend_to()))
        except OSError:
            pass  # the worker is dying; its sentinel will answer this batch

    def send_ahead(self, mv: ModelVersion, now: float) -> None:
        """Busy instances get the batch they run next, where the scheduler
        allows it: they start it without waiting for the broker's turn.

        A batch sent ahead waits for its instance even if another one frees
        up first. With one instance it would wait anyway; with several, only
        quick models gain enough to take that risk (the broker's turn is a
        large share of a short execution), and the wait is then short."""
        infer = mv.stats.compute_infer
        if not may_send_ahead(len(mv.workers), infer.ns / infer.count if infer.count else None):
            return
        for worker in mv.workers:
            if worker.state == BUSY and worker.ahead is None and not worker.stopping:
                batch = mv.scheduler.take_ahead(worker, now)
                if batch is None:
                    return
                self.run(mv, worker, batch)

    def _started(self, mv: ModelVersion, worker: WorkerHandle) -> None:
        """`worker.batch` starts now: its requests' queue time ends (a batch
        sent ahead waited at the worker: that is queue time too) and its
        execution timeout begins."""
        now = time.monotonic()
        stats = mv.stats
        windows = stats.windows
        batch = worker.batch
        assert batch is not None      # run() and _on_finished set it before it starts
        for req in batch.requests:
            ns = int((now - req.received) * 1e9)
            stats.queue.add(ns)
            if windows is not None:
                windows.queue.observe(ns // 1000, now)
        limit = self.execution_timeout(mv)
        if limit:
            self.loop.call_later(limit, functools.partial(self._kill_if_hung, worker, worker.batch_id, limit))

    def _hand_over(self, worker: WorkerHandle, names: list[str]) -> None:
        """The daemon's memory has no names: a worker gets each segment's fd
        once, before the first RUN that reads from it."""
        segments = [seg for seg in map(self.segment_of, dict.fromkeys(names)) if seg is not None]
        worker.hand_over(segments)   # one it cannot find fails that batch in the worker, clearly

    def segment_of(self, name: str) -> Optional[Segment]:
        """A daemon segment by name: the broker's input arena, a client's
        arena, or a worker's outputs."""
        return (self.answers.arena.segments.get(name) or self.sessions.segment(name)
                or self.answers.worker_segments.find(name))

    def execution_timeout(self, mv: ModelVersion) -> float:
        """Seconds a batch may run: the model's TORCHPOOL_EXECUTION_TIMEOUT_S, else the daemon's."""
        own = model_parameters(mv.config).execution_timeout
        return own if own is not None else self.options.execution_timeout

    def _kill_if_hung(self, worker: WorkerHandle, batch_id: int, limit: float) -> None:
        if worker.state == BUSY and worker.batch_id == batch_id and worker.batch is not None:
            log.error("%s exceeded the execution timeout of %g s; killing it (SIGABRT: its Python "
                      "stack follows)", worker.label, limit,
                      extra=_fields(worker))
            worker.timed_out = limit
            self._end_hung(worker)     # the sentinel answers its requests and respawns it

    def _end_hung(self, h: WorkerHandle) -> None:
        """SIGABRT first, so that the worker's faulthandler logs where it is
        stuck; SIGKILL after ABORT_GRACE_S if it is still there (a timer:
        the loop does not wait). Its requests are answered when its
        sentinel fires, whichever signal ended it."""
        if h.abort():
            self.loop.call_later(ABORT_GRACE_S, h.kill)

    # ------------------------------------------------------------- messages

    def _on_message(self, h: WorkerHandle) -> None:
        try:
            msg, fds = h.recv()
        except BlockingIOError:
            return               # read since the loop saw it (catch_up)
        except internal.ProtocolViolation as exc:
            log.error("%s sent a message that is not of the worker protocol (%s); killing it", h.label, exc)
            h.process.kill()     # its sentinel fails its batch and restarts it
            return
        # (`type(msg) is`: mypy narrows on it)
        if type(msg) is internal.Segments:
            self.answers.map_worker_segments(h, msg.segments, fds)
            return
        close_all(fds)
        if msg is None:          # EOF: the sentinel tells how it died
            self.loop.unwatch(h.sock.fileno())
            return
        mv = h.mv
        if type(msg) is internal.Ready:
            self._on_ready(h, mv, msg)
        elif type(msg) is internal.LoadFailed:
            self.version_failed(mv, msg.message)
        elif type(msg) is internal.Done or type(msg) is internal.Failed:
            self._on_finished(h, mv, msg)
        elif type(msg) is internal.Served:
            self.read_reports(h)         # the ring first: its reports were written before
            self._on_served(h, mv, msg.records, msg.closed)
        elif type(msg) is internal.Forget:
            self.answers.worker_areas_closed(h, msg.refs)

    def read_reports(self, h: Optional[WorkerHandle] = None) -> None:
        """Count the direct requests in the report rings (protocol/reports.py)
        of `h`, or of every worker."""
        rings = False
        for w in (h,) if h is not None else self.supervisor.workers.values():
            if w.reports is not None:
                rings = True
                records = w.reports.take()
                if records:
                    self._on_served(w, w.mv, records, False)
        if rings and not self._reading_reports:       # and from now on, every REPORTS_EVERY_S
            self._reading_reports = True
            self.loop.call_later(REPORTS_EVERY_S, self._read_reports_again)

    def _read_reports_again(self) -> None:
        self._reading_reports = False
        self.read_reports()

    def catch_up(self) -> None:
        """Read the reports workers have already made: a worker reports each
        direct request before answering it, so statistics read after an
        answer count it, wherever the loop would have read it. Only workers
        given direct paths: the others' messages keep the loop's order."""
        self.read_reports()
        poller, by_fd = select.poll(), {}
        for h in self.supervisor.workers.values():
            fd = h.sock.fileno()
            if h.reports is not None and h.state != DEAD and fd >= 0 and self.loop.watching(fd):
                poller.register(fd, select.POLLIN)
                by_fd[fd] = h
        for _ in range(64):              # bounded: a busy worker keeps sending
            ready = poller.poll(0)
            if not ready:
                return
            for fd, _events in ready:
                self._on_message(by_fd[fd])
                if not self.loop.watching(fd):     # it closed
                    poller.unregister(fd)

    def _on_served(self, h: WorkerHandle, mv: ModelVersion, records: Sequence[reports.Record],
                   closed: bool) -> None:
        """Direct requests the worker answered (worker/direct.py), counted as
        the broker counts its own (their queue: the wait for their batch in
        the worker); each renews its client's session, as a request to the
        broker does."""
        stats, now = mv.stats, time.monotonic()
        if closed:
            h.closing_paths = False          # what ran on them is answered
        self.answers.transfer["requests_direct"] += len(records)
        try:
            for ok, ns, queue_ns, token, execution in records:
                session = self.sessions.sessions.get(token)
                if session is not None:
                    session.last_seen = now      # the broker never saw it: its lease is renewed here
                if execution is not None:
                    stats.record_execution(*execution)
                if ok != reports.OK:
                    stats.record_failure(ns, REJECTED if ok == reports.TIMED_OUT else BACKEND)
                    continue
                stats.success.add(ns)
                stats.queue.add(queue_ns)
                if stats.windows is not None:
                    stats.windows.request.observe(ns // 1000, now)
        except (TypeError, ValueError) as exc:
            log.error("%s reported direct requests the broker cannot read (%r); not counted", h.label, exc)

    def _on_ready(self, h: WorkerHandle, mv: ModelVersion, msg: internal.Ready) -> None:
        h.state = IDLE
        mv.idle.append(h)
        if mv.scheduler is not None:
            mv.scheduler.instance_ready(h)
        log.debug("%s ready (pid %s, %s)", h.label, msg.pid, msg.device)
        died = self._restarted.pop(h, None)
        if died is not None:
            log.info("%s restarted, READY in %.2f s", h.label, time.monotonic() - died, extra=_fields(h))
        for later in self.supervisor.spawn_deferred(mv):
            self._watch(later)
        if mv.state == LOADING and not mv.deferred and all(w.state != STARTING for w in mv.workers):
            mv.state = READY
            stats = mv.stats
            stats.load_seconds = time.monotonic() - stats.loading_since
            count = len(mv.workers)
            log.info("%s READY (%d instance%s) in %.2f s", mv.label, count, "" if count == 1 else "s",
                     stats.load_seconds, extra=log_fields(mv.name, mv.version))
            self.events.settled(mv)
        self.events.idle(mv)

    def _on_finished(self, h: WorkerHandle, mv: ModelVersion, msg: internal.Done | internal.Failed) -> None:
        batch, h.batch = h.batch, None
        batch_id = h.batch_id
        if h.ahead is not None:       # the worker has started it already
            h.batch, h.batch_id, h.ahead = h.ahead, h.ahead_id, None
            self._started(mv, h)
        else:
            h.state = IDLE
            self.busy.discard(h)
            mv.idle.append(h)
        if batch is not None:
            self.answers.free_batch(batch)
            outcome: Executed | TorchpoolError
            if msg.batch_id != batch_id:
                outcome = TorchpoolError(errors.INTERNAL, f"{h.label} answered batch {msg.batch_id} "
                                                          f"while running batch {batch_id}")
            elif isinstance(msg, internal.Done):
                input_ns, infer_ns, output_ns = msg.timings[:3]
                mv.stats.record_execution(batch.items, len(batch.requests), input_ns, infer_ns, output_ns,
                                          padding=batch.padding)
                mv.consecutive_crashes = 0
                # (internal.decode builds a list of them: the type says Sequence for the encoder's sake)
                outcome = Executed(cast("list[internal.OutputDescriptor]", msg.outputs), h,
                                   frozenset(msg.reused))
            else:
                outcome = TorchpoolError(msg.code, msg.message)
            # the scheduler sees the outputs (a sequence's state) before they go back
            mv.scheduler.finished(batch, outcome.outputs if isinstance(outcome, Executed) else None,
                                  self.answers.read_output)
        # the next batch (already written while this one ran) goes first
        self.events.idle(mv)
        if batch is not None:
            self.answers.complete(mv, batch, outcome)
        if mv.state == UNLOADING:
            self.events.drained()

    # ------------------------------------------------------------- failures

    def fail_queued(self, mv: ModelVersion, err: TorchpoolError) -> None:
        """Answer every request of `mv` that has not started."""
        for req in mv.scheduler.drain():
            self.answers.fail(req, err)

    def version_failed(self, mv: ModelVersion, reason: str) -> None:
        first = mv.state != UNAVAILABLE
        mv.fail(reason)
        if first:
            log.error("%s is UNAVAILABLE: %s", mv.label, reason, extra=log_fields(mv.name, mv.version))
        self.fail_queued(mv, TorchpoolError(errors.UNAVAILABLE, f"{mv.label} is not available: {reason}"))
        for w in list(mv.workers):
            if w.process.exitcode is None:
                w.process.kill()      # the sentinel fires and reaps it
        self.events.settled(mv)

    def _on_exit(self, h: WorkerHandle) -> None:
        if h.reports is not None:      # what it reported before it ended counts
            self.read_reports(h)
            h.reports.close()
            h.reports = None
        self.loop.unwatch(h.sentinel)
        self.loop.unwatch(h.sock.fileno())
        was = h.state
        self.busy.discard(h)
        self._restarted.pop(h, None)
        how = self.supervisor.reap(h)
        self.answers.worker_gone(h)
        mv = h.mv
        # a sequence lost with its instance: the model's failure when the instance
        # died (crash, execution timeout), not when we stopped it
        lost = OTHER if mv.state == UNLOADING or self.events.stopping() else BACKEND
        for req, err in mv.scheduler.instance_gone(h):
            self.answers.fail(req, err, lost)
        if h.batch is not None:
            batch, h.batch = h.batch, None
            self.answers.free_batch(batch)
            if h.timed_out:
                why = (f"{h.label} exceeded the execution timeout of {h.timed_out:g} s and was killed; "
                       f"it is being restarted")
            else:
                why = f"{h.label} {how} while running this request"
            err = TorchpoolError(errors.INTERNAL, why)
            mv.scheduler.finished(batch, None, self.answers.read_output)
            self.answers.complete(mv, batch, err)
        if h.ahead is not None:
            ahead, h.ahead = h.ahead, None
            if mv.state == UNAVAILABLE or self.events.stopping():
                self.answers.complete(mv, ahead, TorchpoolError(
                    errors.UNAVAILABLE, f"{h.label} {how} before it could run this request"))
            else:
                # it never started: another instance runs it, or the restarted one
                mv.scheduler.put_back(ahead)
                self.events.idle(mv)
        if mv.state == UNLOADING:
            if not any(w.state != DEAD for w in mv.workers):
                self.fail_queued(mv, TorchpoolError(errors.UNAVAILABLE, f"{mv.label} was unloaded"))
            self.events.drained()
            return
        if self.events.stopping() or mv.state == UNAVAILABLE:
            return
        if was == STARTING:
            if h.load_timed_out:
                self.version_failed(mv, f"instance '{h.spec.instance}' did not finish loading within "
                                        f"{h.load_timed_out:g} s (--load-timeout) and was killed")
            else:
                self.version_failed(mv, f"instance '{h.spec.instance}' {how} while loading")
            return
        log.error("%s %s; restarting it", h.label, how, extra=_fields(h))
        mv.stats.count_restart(h.spec.instance)
        # A crash loop is crashes with no successful execution in between: a
        # model that serves between crashes (a bad input now and then, an OOM
        # kill) is restarted for ever, with backoff; one that never gets a
        # batch through is given up on.
        mv.consecutive_crashes += 1
        if mv.consecutive_crashes > self.options.max_restarts:
            self.version_failed(mv, f"instance '{h.spec.instance}' crashed {mv.consecutive_crashes} "
                                    f"times without a successful execution in between (last: {how})")
            return
        delay = min(0.1 * 2 ** (mv.consecutive_crashes - 1), 10.0)
        died = time.monotonic()
        self.loop.call_later(delay, lambda: self._respawn(mv, h.spec.instance, h.spec.device, died))

    def _respawn(self, mv: ModelVersion, instance: str, device: str, died: float) -> None:
        if self.events.stopping() or mv.state in (UNAVAILABLE, UNLOADING):
            return
        handle = self.supervisor.spawn(mv, instance, device)
        self._restarted[handle] = died
        self._watch(handle)

    # ------------------------------------------------------------- stop

    def stop(self) -> None:
        """Shutdown: fail what is still running, then stop every worker."""
        self.supervisor.stop_all(self.options.stop_timeout)

    def fail_running(self, mv: ModelVersion) -> None:
        """Shutdown: answer the batches `mv`'s workers still have."""
        for h in mv.workers:
            for batch in (h.batch, h.ahead):
                if batch is not None:
                    self.answers.free_batch(batch)
                    self.answers.fail_batch(batch, TorchpoolError(
                        errors.UNAVAILABLE, f"server is shutting down; {h.label} did not finish in "
                                            f"the grace period"))
            h.batch = h.ahead = None

    def pending(self, mv: ModelVersion) -> int:
        """Requests of `mv` waiting to start: queued, or sent ahead to a busy
        instance (Triton's pending request count). The metrics thread calls
        it while the loop runs: each handle's batch is read once."""
        if mv.scheduler is None:
            return 0
        ahead = [h.ahead for h in list(mv.workers)]
        return len(mv.scheduler) + sum(len(batch.requests) for batch in ahead if batch is not None)

    def running(self, mv: ModelVersion) -> int:
        """Batches of `mv` its workers have (running, or sent ahead), and
        direct paths being closed (a direct request may run on them)."""
        return sum((h.batch is not None) + (h.ahead is not None) + h.closing_paths for h in mv.workers)


def _fields(h: WorkerHandle) -> dict[str, str]:
    """A log record's fields for one instance (logs.log_fields)."""
    return log_fields(h.spec.model, h.spec.version, h.spec.instance)
