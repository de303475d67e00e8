"""Worker supervision: spawn from the torch template, notice deaths, respawn.

Workers are forked by multiprocessing's fork server, which is started once
with `torchpool.worker.process` (and so torch) preloaded: a new worker costs a
fork and a model load instead of a fresh interpreter and `import torch`, and
the torch pages are shared copy-on-write. The fork server never touches CUDA,
so its children may. A worker's death is seen at once through its process
sentinel; the fork server reports the exit status.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import multiprocessing
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from ..config import InstanceGroup
from ..config.devices import cpu_budget, threads_per_worker, visible_gpus
from ..shm.cpu_ledger import CpuLedger, SlotPool
from ..config.parameters import model_parameters
from ..protocol import internal
from ..protocol.internal import BlockRef, SegmentRef
from ..shm.fdpass import DONTWAIT, FdReceiver, send_with_fds
from ..shm.segment import Segment
from ..worker.capture_size import DEFAULT_MIB
from ..worker.entry import run_worker
from ..worker.spec import WorkerSpec
from .registry import ModelVersion, Registry

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from ..protocol.reports import ReportRing
    from .batch import Batch

log = logging.getLogger("torchpool.broker")

STARTING = "STARTING"
IDLE = "IDLE"
BUSY = "BUSY"
DEAD = "DEAD"

# A worker found hung gets SIGABRT, and SIGKILL only if it is still there this
# long after: its faulthandler (worker/process.py) writes its threads' Python
# stacks to the daemon's log and re-raises the signal, within milliseconds
# unless the process cannot run at all.
ABORT_GRACE_S = 2.0

_context: Optional[multiprocessing.context.ForkServerContext] = None


def _fork_context() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torchpool.worker.process", "torchpool.worker.fork_server"])
    return _context


def stop_fork_helpers(timeout: float) -> None:
    """End the fork server and multiprocessing's resource tracker, this
    process's children, and reap them before the daemon exits.

    Each ends by itself once no process holds its pipe's writing end, but
    only some time after the daemon has gone (a fork server was seen alive
    3 s after the daemon's SIGTERM, under load): stop must leave nothing.
    Their pipes are closed first (their own way to stop); one still running
    at `timeout` is killed. multiprocessing has no public way to do this:
    the attributes are those of its ForkServer and ResourceTracker (3.10 to
    3.13), looked up so that a missing one only skips that helper."""
    from multiprocessing import forkserver, resource_tracker, util

    deadline = time.monotonic() + timeout
    server = forkserver._forkserver
    if _end(server, "_forkserver_pid", "_forkserver_alive_fd", deadline):
        address = getattr(server, "_forkserver_address", None)
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        # (multiprocessing's private attribute, which typeshed's stub lacks)
        server._forkserver_address = None  # type: ignore[attr-defined]
    _end(resource_tracker._resource_tracker, "_pid", "_fd", deadline)


def _end(helper: object, pid_attribute: str, fd_attribute: str, deadline: float) -> bool:
    """Close `helper`'s pipe (its way to stop) and reap its process; False
    when it has none running."""
    pid = getattr(helper, pid_attribute, None)
    if pid is None:
        return False
    fd = getattr(helper, fd_attribute, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        setattr(helper, fd_attribute, None)
    _reap(pid, deadline)
    setattr(helper, pid_attribute, None)
    return True


def _reap(pid: int, deadline: float) -> None:
    """Wait for child `pid` until `deadline`, then kill it and wait."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return                          # not ours, or reaped already
        if done:
            return
        if time.monotonic() >= deadline:
            log.warning("process %d (fork server or resource tracker) did not stop; killing it", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.005)


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(eq=False)
class WorkerHandle:
    serial: int
    spec: WorkerSpec
    mv: ModelVersion
    process: BaseProcess
    sock: socket.socket
    state: str = STARTING
    batch: Optional[Batch] = None     # the Batch it is running
    batch_id: int = 0
    ahead: Optional[Batch] = None     # a Batch sent to run right after it (Scheduler.take_ahead)
    ahead_id: int = 0
    releases: list[BlockRef] = field(default_factory=list)   # output blocks to hand back on the next RUN
    timed_out: float = 0.0            # set when killed for exceeding the execution timeout
    load_timed_out: float = 0.0       # set when killed for not loading within the load timeout
    stopping: bool = False            # asked to stop (its version was retired)
    started: float = field(default_factory=time.monotonic)
    known: set[str] = field(default_factory=set)   # segments whose fds it has been handed
    how_it_ended: str = ""            # once reaped: "was killed by signal SIGKILL (9)", ...
    closing_paths: bool = False       # told to close direct paths, not done yet (broker/direct.py)
    reports: Optional[ReportRing] = None   # given a direct path: its report ring (protocol/reports.py)

    @property
    def label(self) -> str:
        return f"model '{self.spec.model}' version {self.spec.version} instance '{self.spec.instance}'"

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def send(self, msg: internal.Message) -> None:
        self.sock.send(internal.encode(msg))

    def running(self) -> bool:
        """Its process has not exited (nor been reaped: a reaped handle's
        process is closed, and its pid may be another process's by now)."""
        return self.state != DEAD and self.process.exitcode is None

    def abort(self) -> bool:
        """SIGABRT, so that it logs where it is stuck (ABORT_GRACE_S); False
        when it has exited already."""
        if not self.running():
            return False
        pid = self.process.pid
        assert pid is not None      # started (spawn) before its handle was made
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        return True

    def kill(self) -> None:
        """SIGKILL, unless it has exited: the end of every escalation."""
        if self.running():
            self.process.kill()

    def hand_over(self, segments: list[Segment]) -> None:
        """Give the worker these segments' fds (before a RUN names them)."""
        for i in range(0, len(segments), 32):
            part = segments[i:i + 32]
            send_with_fds(self.sock, internal.encode(internal.Segments([[s.name, s.size] for s in part])),
                          [s.fd for s in part])
            self.known.update(s.name for s in part)

    def recv(self) -> tuple[Optional[internal.Message], list[int]]:
        """The worker's next message and the fds that came with it (the caller
        owns them); (None, []) at EOF. Raises ProtocolViolation (fds closed),
        BlockingIOError when none waits (the loop saw the socket readable, and
        Instances.catch_up read it since)."""
        try:
            raw, fds = _receiver.recv(self.sock, DONTWAIT)
        except BlockingIOError:
            raise
        except (ConnectionError, OSError):
            return None, []
        if not raw:
            return None, fds
        try:
            return internal.decode(raw), fds
        except internal.ProtocolViolation:
            for fd in fds:
                os.close(fd)
            raise


# The broker's one thread decodes each message before reading the next: one buffer serves all.
_receiver = FdReceiver(internal.MAX_MESSAGE)


def shares_weights(mv: ModelVersion) -> bool:
    """ENABLE_WEIGHT_SHARING (the server checked the parameters before any worker starts)."""
    return model_parameters(mv.config).enable_weight_sharing


def instance_devices(group: InstanceGroup, gpus: list[int]) -> list[str]:
    """Triton's instance_group rules: `count` per listed GPU for KIND_GPU."""
    kind = group.kind
    if kind == "KIND_AUTO":
        kind = "KIND_GPU" if gpus else "KIND_CPU"
    if kind == "KIND_CPU":
        return ["cpu"] * group.count
    if kind == "KIND_MODEL":
        return ["model"] * group.count
    devices = list(group.gpus) if group.gpus else gpus
    if not devices:
        # the worker reports a clear load error for this device
        return [f"cuda:{0}"] * group.count
    return [f"cuda:{g}" for g in devices for _ in range(group.count)]


class Supervisor:
    def __init__(self, segment_prefix: str, arena_chunk: int, arena_limit: int, log_level: int,
                 busy_poll_us: int = 0, log_format: str = "text",
                 registry: Optional[Registry] = None, output_capture_mib: int = DEFAULT_MIB,
                 stream_copy_bytes: int = 0) -> None:
        self.segment_prefix = segment_prefix
        # the CPUs the daemon may use, shared among the CPU instances of every
        # version it serves or loads (the registry's: cpu_instances)
        self.cpu_budget = cpu_budget()
        self.registry = registry
        # which CPU workers run a batch now: they size their threads by it (shm/cpu_ledger.py)
        self.cpu_slots = SlotPool(CpuLedger.create())
        self.threads = 0              # each CPU worker's threads, as last decided
        self.log_format = log_format
        self.busy_poll_us = busy_poll_us
        self.arena_chunk = arena_chunk
        self.arena_limit = arena_limit
        self.log_level = log_level
        self.output_capture_mib = output_capture_mib
        self.stream_copy_bytes = stream_copy_bytes
        self.workers: dict[int, WorkerHandle] = {}       # by sentinel fd
        self._serial = itertools.count()
        self.gpus = visible_gpus()

    def worker_prefix(self, serial: int) -> str:
        return f"{self.segment_prefix}w{serial}."

    def spawn_instances(self, mv: ModelVersion) -> list[WorkerHandle]:
        """Start a version's instances. With weight sharing only the first
        starts now; the others wait in `mv.deferred` until it is ready (it
        fills the shared weights they attach to)."""
        instances = [(f"{group.name}_{i}", device)
                     for group in mv.config.instance_groups
                     for i, device in enumerate(instance_devices(group, self.gpus))]
        self.warn_oversubscribed(mv, sum(device == "cpu" for _, device in instances))
        if shares_weights(mv) and len(instances) > 1:
            mv.deferred = instances[1:]
            instances = instances[:1]
        return [self.spawn(mv, name, device) for name, device in instances]

    def warn_oversubscribed(self, mv: ModelVersion, cpu_instances: int) -> None:
        """A model whose own thread counts ask for more threads than the
        daemon's CPUs: its instances busy together would time-slice them."""
        intra = model_parameters(mv.config).intra_op_threads or 0
        if intra and intra * cpu_instances > self.cpu_budget:
            log.warning("model '%s' version %s: %d CPU instances x INTRA_OP_THREAD_COUNT %d = %d threads "
                        "for %d CPUs; busy together they oversubscribe them (leave the thread counts "
                        "unset and the daemon sizes each instance's threads by what is busy)",
                        mv.name, mv.version, cpu_instances, intra, intra * cpu_instances, self.cpu_budget)

    def spawn_deferred(self, mv: ModelVersion) -> list[WorkerHandle]:
        deferred, mv.deferred = mv.deferred, []
        return [self.spawn(mv, name, device) for name, device in deferred]

    def weights_segment(self, mv: ModelVersion) -> str:
        key = hashlib.sha1(f"{mv.name}\0{mv.version}\0{mv.model_file}".encode()).hexdigest()[:16]
        return f"{self.segment_prefix}sw{key}"

    def spawn(self, mv: ModelVersion, instance: str, device: str) -> WorkerHandle:
        serial = next(self._serial)
        params = model_parameters(mv.config)
        threads, slot = 0, None
        if device == "cpu":
            threads = params.intra_op_threads or self.cpu_threads()
            if not (params.intra_op_threads or params.inter_op_threads):
                slot = self.cpu_slots.take()      # its threads follow the busy workers'
        spec = WorkerSpec(model=mv.name, version=mv.version, instance=instance, config=mv.config,
                          model_path=mv.model_file, device=device,
                          segment_prefix=self.worker_prefix(serial), arena_chunk=self.arena_chunk,
                          arena_limit=self.arena_limit, log_level=self.log_level,
                          busy_poll_us=self.busy_poll_us, log_format=self.log_format,
                          shared_weights=self.weights_segment(mv) if shares_weights(mv) else "",
                          threads=threads, output_capture_mib=self.output_capture_mib,
                          stream_copy_bytes=self.stream_copy_bytes,
                          cpu_slot=-1 if slot is None else slot, cpu_budget=self.cpu_budget)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            ledger = self.cpu_slots.ledger.handle() if slot is not None else None
            proc = _fork_context().Process(target=run_worker, args=(spec, theirs, ledger), daemon=False,
                                           name=f"torchpool-worker-{instance}")
            proc.start()
        except BaseException:
            if slot is not None:
                self.cpu_slots.give_back(slot)
            raise
        finally:
            theirs.close()
        handle = WorkerHandle(serial, spec, mv, proc, ours)
        mv.workers.append(handle)
        self.workers[handle.sentinel] = handle
        log.debug("spawned worker %d (pid %s) for %s on %s", serial, proc.pid, handle.label, device)
        return handle

    def cpu_instances_of(self, versions: Iterable[ModelVersion]) -> int:
        """How many of these versions' instances run on the CPU."""
        return sum(instance_devices(group, self.gpus).count("cpu")
                   for mv in versions for group in mv.config.instance_groups)

    def cpu_instances(self) -> int:
        """CPU instances of what the daemon serves or loads (1 without a
        registry); a reload's new generation replaces its model's current one,
        so each model counts once."""
        if self.registry is None:
            return 1
        count = self.cpu_instances_of
        return sum(max(count(m.versions.values()), count(m.pending.versions.values()) if m.pending else 0)
                   for m in self.registry.models.values())

    def cpu_threads(self) -> int:
        """A new CPU worker's threads (when its model sets none): its share
        of the daemon's CPUs; logged when the share changes."""
        instances = max(1, self.cpu_instances())
        threads = threads_per_worker(self.cpu_budget, instances)
        if threads != self.threads:
            self.threads = threads
            log.info("%d CPUs (affinity and cgroup quota) for %d CPU instances: %d intra-op and inter-op "
                     "thread%s each, unless a model sets INTRA_OP_THREAD_COUNT / INTER_OP_THREAD_COUNT",
                     self.cpu_budget, instances, threads, "" if threads == 1 else "s")
        return threads

    def reap(self, handle: WorkerHandle) -> str:
        """Forget a dead worker; release what it owned. Returns how it died."""
        handle.process.join(timeout=1.0)
        how = handle.how_it_ended = describe_exit(handle.process.exitcode)
        handle.state = DEAD
        ours = self.workers.pop(handle.sentinel, None) is not None
        if handle in handle.mv.workers:
            handle.mv.workers.remove(handle)
        try:
            handle.mv.idle.remove(handle)
        except ValueError:
            pass
        handle.sock.close()
        handle.process.close()
        if ours and handle.spec.cpu_slot >= 0:
            self.cpu_slots.give_back(handle.spec.cpu_slot)
        return how

    def forget(self, refs: Sequence[SegmentRef]) -> None:
        """Every live worker unmaps segments of a closed session or region."""
        names = [r for r in refs if isinstance(r, str)]
        for h in self.workers.values():
            h.known.difference_update(names)
            try:
                if h.releases:      # blocks lent to a session that closed: back before its areas go
                    releases, h.releases = h.releases, []
                    h.send(internal.Release(releases))
                h.send(internal.Forget(refs))
            except OSError:
                pass

    def stop_all(self, timeout: float) -> None:
        """Ask every worker to stop; abort, then kill, those that do not within `timeout`."""
        handles = list(self.workers.values())
        for h in handles:
            try:
                h.send(internal.Stop())
            except OSError:
                pass
        _join_all(handles, time.monotonic() + timeout)
        # stuck: each logs its stacks (SIGABRT), together, then what is left is killed
        late = [h for h in handles if h.running()]
        for h in late:
            log.warning("%s did not stop within %g s; aborting it (its Python stack follows)", h.label, timeout)
            h.abort()        # after the line that says whose stack it is
        _join_all(late, time.monotonic() + ABORT_GRACE_S)
        for h in late:
            if h.running():
                log.warning("%s did not exit %g s after SIGABRT; killing it", h.label, ABORT_GRACE_S)
                h.kill()
                h.process.join(timeout=5.0)
        for h in handles:
            self.reap(h)
        stop_fork_helpers(timeout=5.0)
        self.cpu_slots.ledger.close()


def _join_all(handles: list[WorkerHandle], deadline: float) -> None:
    """Wait until every one of `handles` has exited, or until `deadline`."""
    for h in handles:
        h.process.join(timeout=max(0.0, deadline - time.monotonic()))
