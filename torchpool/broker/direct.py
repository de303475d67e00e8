"""Direct paths: a local client's small, plain requests, sent to a worker.

A local client with a request lane asks here (`{"op": "direct", "model",
"version"}` on its lane) for a path to a model's instance. When the model
takes direct requests, the broker makes a socket pair, hands one end to an
instance (internal ADOPT, worker/direct.py) and the other to the client (its
fd on the side channel, before the answer naming it), and steps out: the
client's plain requests to that model then cross two process hops, not four.

What stays with the broker, and why a model may take direct requests:
- the requests the worker takes are the ones the broker's DirectScheduler
  would have run alone and at once, or, for a model with dynamic batching,
  the ones its DynamicBatcher would batch by the batching rules alone (one
  priority level, no queue policy, no ragged input): the worker batches
  those itself by the same rules (worker/direct_batch.py). Never a model
  with sequence batching, batch inputs or outputs, an output `reshape` (the
  broker undoes those while answering), or an execution timeout (the
  broker times its own batches: it cannot time a worker's direct requests);
- the worker checks each request by the broker's own rules (validate_infer,
  with this daemon's TensorLimits) and reports each answered one in the
  report ring handed over with its first path (protocol/reports.py), so the
  model's statistics count them;
- one path per session and model version, or one to each of its instances
  (asked with "all", for a caller with many calls in flight); asking again
  replaces them; the session's end closes them all (FORGET), the instance's end closes its
  own (its socket ends go with it) and the client then asks again or uses
  its lane.
"""
from __future__ import annotations

import itertools
import os
import socket
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from ..protocol import errors, internal, messages
from ..protocol.errors import TorchpoolError
from ..protocol.reports import ReportRing
from ..rules.validation import TensorLimits
from ..shm.fdpass import send_with_fds
from .registry import ModelVersion, Registry
from .stats import BACKEND
from .supervisor import BUSY, DEAD, IDLE, WorkerHandle, describe_exit

if TYPE_CHECKING:
    from .sessions import Session


def refusal(mv: ModelVersion, execution_timeout: float) -> Optional[str]:
    """Why `mv` takes no direct requests (None: it does)."""
    cfg = mv.config
    why = "it is not serving" if mv.scheduler is None else mv.scheduler.direct_refusal()
    if why:
        return why
    if cfg.batch_inputs or cfg.batch_outputs:
        return "the daemon computes its batch inputs or outputs"
    if any(spec.reshape is not None for spec in cfg.outputs):
        return "the daemon undoes its output reshape"
    if execution_timeout:
        return "the daemon times its executions (an execution timeout is set)"
    return None


class DirectPaths:
    def __init__(self, registry: Registry, limits: TensorLimits, execution_timeout: Callable[[ModelVersion], float],
                 stopping: Callable[[], bool], spin_us: int = 0) -> None:
        self.registry = registry
        self.spin_us = spin_us          # both ends' spin window (rules/spin.py)
        self.stopping = stopping
        self.limits = limits
        self.execution_timeout = execution_timeout      # (mv) -> seconds, 0 for none
        self._names = (f"{internal.DIRECT_PREFIX}{n}" for n in itertools.count(1))
        self._turn = itertools.count()

    def open(self, session: Session, header: messages.Header) -> messages.Header:
        """Direct paths to the model `header` names, for a session attached
        with a lane: their fds are on its side channel when this returns.

        One path, to the instances in turn, unless `"all": true` asks for one
        to each running instance: a caller with many calls in flight at once
        (an AsyncClient) then sends each to an instance that is free, as the
        daemon's scheduler would. A model with dynamic batching gets none
        such: its worker would batch only the requests on its own paths,
        where the daemon batches everyone's across its instances."""
        mv = self.registry.resolve(header.get("model"), header.get("version"))
        why = refusal(mv, self.execution_timeout(mv))
        every = header.get("all") is True
        if not why and every and mv.config.dynamic_batching is not None:
            why = "the daemon forms its batches from every caller's requests (dynamic batching)"
        if why:
            raise TorchpoolError(errors.UNSUPPORTED, f"{mv.label} takes no direct requests: {why}")
        instances = [h for h in mv.workers if h.state in (IDLE, BUSY) and not h.stopping]
        if not instances:
            raise TorchpoolError(errors.UNAVAILABLE, f"{mv.label} has no running instance")
        if not every:
            instances = [instances[next(self._turn) % len(instances)]]      # clients spread over instances
        self.close(session, mv)
        paths: list[tuple[str, WorkerHandle]] = []
        session.direct[mv] = paths
        for h in instances:
            try:
                paths.append((self._hand_over(session, h), h))
            except TorchpoolError:
                self.close(session, mv)         # the ones handed over already
                raise
        names = [name for name, _ in paths]
        answer: dict[str, object] = {"direct": names[0], "version": mv.version, "spin_us": self.spin_us}
        if every:
            answer["paths"] = names
        return answer

    def _hand_over(self, session: Session, h: WorkerHandle) -> str:
        """A new path between `session` and the instance `h`: the worker's end
        adopted by it, the client's end on the session's side channel. Its name."""
        channel = session.channel
        assert channel is not None, "a session with a lane is attached"     # (Intake checks)
        name = next(self._names)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        ring, ring_fd = (None, -1) if h.reports is not None else ReportRing.create()
        try:
            # its first path: the ring it reports in goes with it
            send_with_fds(h.sock, internal.encode(internal.Adopt(
                name, session.token, self.limits.max_bytes_elements, self.limits.max_bytes_tensor_bytes,
                self.spin_us)),
                [ours.fileno()] if ring is None else [ours.fileno(), ring_fd])
            if ring is not None:
                h.reports, ring = ring, None
            try:
                send_with_fds(channel, messages.pack({"segments": [{"segment": name, "size": 0}]}),
                              [theirs.fileno()], socket.MSG_DONTWAIT)
            except OSError:
                h.send(internal.Forget([name]))
                raise TorchpoolError(errors.UNAVAILABLE, "the client does not read its local side "
                                                         "channel") from None
        finally:
            ours.close()            # the worker and the client hold their own ends now
            theirs.close()
            if ring_fd >= 0:
                os.close(ring_fd)
            if ring is not None:        # not handed over
                ring.close()
        return name

    def why_ended(self, session: Optional[Session], name: object) -> TorchpoolError:
        """The error of a request a client's path `name` had when it closed:
        the instance's death (as the broker words it for its own batches,
        counted once per path as the model's failure), else the path was closed."""
        if self.stopping():           # the broker's words for a request it refuses now
            return TorchpoolError(errors.UNAVAILABLE, "server is shutting down")
        found = next(((n, h) for paths in (session.direct.values() if session is not None else ())
                      for n, h in paths if n == name), None)
        if found is None or session is None:
            return TorchpoolError(errors.INVALID_ARG, f"this session has no direct path {name!r}")
        path, h = found
        if h.stopping:                # its version was unloaded or replaced
            return TorchpoolError(errors.UNAVAILABLE, f"{h.label} was unloaded")
        how = h.how_it_ended
        if h.state != DEAD:
            if h.process.exitcode is None and _at_eof(h.sock):
                h.process.join(0.2)      # its sockets closed as it exited: it is about to be reaped
            if h.process.exitcode is not None:
                how = describe_exit(h.process.exitcode)
        if not how:
            return TorchpoolError(errors.UNAVAILABLE, f"{h.label} closed this client's direct path (the "
                                                      f"session ended)")
        if path not in session.direct_failed:     # once: a client may ask again and again
            session.direct_failed.add(path)
            h.mv.stats.record_failure(0, BACKEND)
        return TorchpoolError(errors.INTERNAL, f"{h.label} {how} with this request on its direct path")

    def close(self, session: Session, mv: ModelVersion) -> None:
        """The session's paths to `mv`, if any, are closed (the workers close their ends)."""
        for name, h in session.direct.pop(mv, ()):
            session.direct_failed.discard(name)
            try:
                h.send(internal.Forget([name]))
            except OSError:
                pass                 # the instance is gone, and its end with it

    def close_all(self, sessions: Iterable[Session]) -> None:
        """Every session's paths are closed (the daemon is stopping): a worker
        counts as running until it says it closed them, having answered the
        direct request it ran."""
        for session in list(sessions):
            for mv in list(session.direct):
                workers = [h for _, h in session.direct[mv]]
                self.close(session, mv)
                for h in workers:
                    h.closing_paths = h.state != DEAD


def _at_eof(sock: socket.socket) -> bool:
    """Has the peer of this socket closed it? (nothing is read)"""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
