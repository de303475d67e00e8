"""The worker process: one per model instance.

    broker --[RUN descriptors]--> worker: view inputs in shm (zero copy)
                                         -> the model (TorchScript, torch.export, AOTInductor)
                                         -> outputs: answered where the model made them (its
                                            capture region, capture.py), else written once
                                            into its own arena
    broker <--[DONE descriptors]-- worker

Workers are forked from a template process that already imported torch (see
`torchpool.broker.supervisor`), so starting one costs a fork and a model load.
The worker serves one batch at a time. It allocates output blocks in its own
arena and frees them when the broker says it is done with them: the broker
piggybacks those releases on the next RUN message, so freeing costs no round
trip (the broker may still be sending a block to a client, zero-copy, after
it dispatched other work). An output answered from the capture region is a
tensor the worker holds until that release.
"""
from __future__ import annotations

import ctypes
import faulthandler
import functools
import gc
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence, Union, cast

import torch

from ..logs import setup_logging
from ..protocol import datatypes, errors, internal
from ..protocol.errors import TorchpoolError
from ..shm.arena import Arena, Block, MappedSegments
from ..shm.bulkcopy import copy_into, set_stream_threshold, streams
from ..shm.fdpass import FdReceiver, close_all, send_with_fds
from ..shm.segment import NamedSegment, Segment
from ..shm.reaper import Reaper
from .binding import ExecutionError, ModelLoadError
from .capture import CaptureRegion, OutputCapture, reuse_input
from .classify import Classified, Classifier
from .cuda_ipc import DeviceRegions, device_bytes
from .direct import DirectClients
from .engine import Engine, Value
from .gpu_copies import HostPinning, cuda_pinning, lost_cuda_context, out_of_gpu_memory
from .lending import LendingAreas
from .loader import load_instance
from .parent import tie_to_the_broker
from .settings import grad_context
from .spec import WorkerSpec
from .texts import client_text
from ..protocol.internal import DIRECT_PREFIX, LEND_PREFIX, is_device_ref
from ..protocol.tensors import BLOCK_HEADER_BYTES, BLOCK_MAGIC, read_block_header, worth_descriptor
from ..shm.regions import RegionMaps

if TYPE_CHECKING:
    import mmap

log = logging.getLogger("torchpool.worker")


def worker_main(spec: WorkerSpec, sock: socket.socket, ledger_fd: int = -1) -> None:
    """Entry point in the forked child (a multiprocessing target)."""
    tie_to_the_broker()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the broker's to handle
    # A worker the broker finds hung (execution or load timeout, no exit at
    # stop) gets SIGABRT before SIGKILL: faulthandler then writes every
    # thread's Python stack into the stderr inherited from the daemon, its
    # log, so the operator sees where the model was stuck (it also reports
    # a segfault's stack). The shm guard's SIGBUS handler chains to it.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # the daemon's level and format, into the stderr inherited from it
    setup_logging(spec.log_level, spec.log_format)
    set_stream_threshold(spec.stream_copy_bytes)     # the daemon's --stream-copy-bytes
    if streams(spec.stream_copy_bytes):
        log.debug("model '%s' instance '%s': copies of %d bytes and more store around the CPU caches",
                  spec.model, spec.instance, spec.stream_copy_bytes)
    Worker(spec, sock, ledger_fd).serve()


class Worker:
    def __init__(self, spec: WorkerSpec, sock: socket.socket, ledger_fd: int = -1) -> None:
        self.spec = spec
        self.sock = sock
        self.ledger_fd = ledger_fd    # the daemon's CPU ledger (a CPU worker sizing its threads), or -1
        # the broker hands us each segment's fd; the last unmap frees its pages: off this thread
        self.reaper = Reaper("torchpool-worker-reaper")
        self.inputs_shm = MappedSegments(self._unmap_input)
        # on a GPU (load()): the segments page-locked for it, and the instance's stream
        self.pinning: Optional[HostPinning] = None
        self.receiver = FdReceiver(internal.MAX_MESSAGE)
        self.regions = RegionMaps()
        self.device_regions = DeviceRegions()     # clients' GPU memory (CUDA regions), opened at first use
        self.outputs = Arena(lambda i: f"{spec.segment_prefix}{i}", spec.arena_chunk,
                             spec.arena_limit, prefault=True, announce=self.announce)
        self.engine: Engine           # built by load(): inputs to the device, the model, outputs
        self.classifier: Classifier   # by load(): labels, and outputs asked as top-k classes
        self.busy_poll_ns = spec.busy_poll_us * 1000
        self.weights: Optional[NamedSegment] = None   # the shared weights segment, if any (kept mapped)
        self.label = f"model '{spec.model}' version {spec.version} instance '{spec.instance}'"
        self.capture: Optional[OutputCapture] = None   # outputs answered where the model made them
        self.capture_name: Optional[str] = None
        # the only memory lent to local clients: one area per session (lending.py)
        self.lending = LendingAreas(spec.segment_prefix, self.announce_area,
                                    lambda name: self.send(internal.Forget([name])), self.label,
                                    spec.output_capture_mib << 20)
        self.on_cpu = True            # read on every request: looked up once
        self.context_lost = False     # a sticky CUDA error: the worker ends after its answer
        self._arena_addresses: dict[str, int] = {}
        self.direct = DirectClients(self)

    def send(self, msg: internal.Message) -> None:
        self.sock.send(internal.encode(msg))

    def announce(self, seg: Segment) -> None:
        """A new output segment: the broker gets its fd before any DONE names it."""
        send_with_fds(self.sock, internal.encode(internal.Segments([[seg.name, seg.size]])), [seg.fd])

    def announce_area(self, seg: Segment, lend_id: int) -> None:
        """A new lending area: the broker learns whose it is with its fd."""
        send_with_fds(self.sock, internal.encode(internal.Segments([[seg.name, seg.size, lend_id]])), [seg.fd])

    def serve(self) -> None:
        try:
            self.load()
        except ModelLoadError as exc:
            # the message says what failed in one line; the cause's traceback (a
            # warm-up's, a compile's) is there for an operator who asks (--log-level debug)
            log.error("%s: %s", self.label, exc.message)
            if exc.__cause__ is not None:
                log.debug("%s: the load failed here", self.label, exc_info=exc)
            code = errors.RESOURCE_EXHAUSTED if out_of_gpu_memory(exc) else exc.code
            self.send(internal.LoadFailed(code, exc.message))
            return
        except Exception as exc:  # a load must fail cleanly, whatever happened
            log.error("%s failed to load", self.label, exc_info=exc)
            if out_of_gpu_memory(exc):       # torch's text has the sizes: what it tried, what was free
                self.send(internal.LoadFailed(errors.RESOURCE_EXHAUSTED, f"failed to load model "
                                                                         f"'{self.spec.model}' on {self.spec.device}: "
                                                                         f"{client_text(exc)}"))
                return
            self.send(internal.LoadFailed(errors.INTERNAL, f"failed to load model '{self.spec.model}': "
                                                           f"{client_text(exc)}"))
            return
        self.send(internal.Ready(os.getpid(), str(self.engine.device)))
        gc.freeze()   # torch and the model, ~170,000 objects: a full collection walked them for 50-100 ms
        try:
            # One inference_mode / no_grad scope for the worker's whole life:
            # entering it per request costs microseconds on the hot path.
            with grad_context(self.engine.settings):
                self.loop()
        finally:
            if self.capture is not None:
                self.capture.close()
            self.lending.close()
            self.direct.close()
            if not self.context_lost:
                self.device_regions.close()
            self.engine.close()
            self.outputs.close()
            self.inputs_shm.close()
            self.reaper.stop()

    def load(self) -> None:
        loaded = load_instance(self.spec)   # model, compile, warm-up: worker/loader.py
        self.classifier, self.weights = loaded.classifier, loaded.weights
        # An output arena ready before the first request: its page faults are
        # paid now, not on the first answer.
        self.outputs.free(self.outputs.alloc(1))
        self.capture = OutputCapture.create(f"{self.spec.segment_prefix}capture", self.announce,
                                            self.spec.output_capture_mib << 20)
        self.capture_name = self.capture.name if self.capture is not None else None
        self.engine = Engine(self.spec, loaded, self.capture, self.ledger_fd)
        self.on_cpu = self.engine.on_cpu
        if self.engine.copies is not None:   # on a GPU: the segments it reads, page-locked once
            self.pinning = cuda_pinning(self.label)
        self.direct.start()

    def receive(self) -> tuple[memoryview, list[int]]:
        """The next message; after work, poll a while before sleeping.

        Waking a sleeping process on another CPU costs tens of microseconds
        on a VM, and a worker that slept runs its first request with cold
        caches; a short busy-poll (yielding to anyone runnable) avoids both
        when requests come back to back.
        """
        if self.busy_poll_ns:
            end = time.perf_counter_ns() + self.busy_poll_ns
            while time.perf_counter_ns() < end:
                try:
                    return self.receiver.recv(self.sock, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    os.sched_yield()
        return self.receiver.recv(self.sock)

    def loop(self) -> None:
        while not self.context_lost:
            if self.direct.clients:      # local clients sending requests here (direct.py)
                if not self.direct.turn():
                    return
                continue
            raw, fds = self.receive()
            if not self.handle(raw, fds):
                return

    def handle(self, raw: memoryview, fds: list[int]) -> bool:
        """One message of the broker's; False when the worker stops."""
        if not raw:
            return False  # the broker went away
        try:
            msg = internal.decode(raw)
        except internal.ProtocolViolation as exc:
            close_all(fds)
            log.error("%s: ignoring a message from the broker: %s", self.label, exc)
            return True
        kind = type(msg)
        if fds and kind is not internal.Segments and kind is not internal.Adopt:
            close_all(fds)
            fds = []
        # (`type(msg) is`, as `kind is` before: mypy narrows on it)
        if type(msg) is internal.Run:
            self.release(msg.releases)
            self.run(msg)
        elif type(msg) is internal.Stop:
            return False
        elif type(msg) is internal.Release:
            self.release(msg.blocks)
        elif type(msg) is internal.Forget:
            self.forget(msg.refs)
        elif type(msg) is internal.Segments:
            self.map_segments(msg.segments, fds)
        elif type(msg) is internal.Adopt:
            self.direct.adopt(msg, fds)
        return True

    def map_segments(self, segments: Sequence[Sequence[Union[str, int]]], fds: list[int]) -> None:
        """Input segments the broker handed over (its arena, client arenas)."""
        if len(segments) != len(fds):
            close_all(fds)
            log.error("%s: %d segments came with %d fds; ignored", self.label, len(segments), len(fds))
            return
        # the broker's SEGMENTS are [name, size] each (protocol/internal.py; decoded as they
        # come, the peer is the daemon): the wire's layout, which the type system cannot see
        for (name, _size), fd in zip(cast("Sequence[tuple[str, int]]", segments), fds):
            try:
                self.inputs_shm.add(name, fd)
            except (OSError, ValueError) as exc:
                log.error("%s: cannot map segment %s: %s", self.label, name, exc)

    def forget(self, refs: Sequence[internal.SegmentRef]) -> None:
        """Unmap segments of closed client sessions and unregistered regions;
        close their direct paths."""
        paths = False
        for ref in refs:
            if is_device_ref(ref):            # [DEVICE_REF, handle, device]: a CUDA region
                self.device_regions.drop(cast("list[Union[str, int, bytes]]", ref))
            elif not isinstance(ref, str):    # [key, inode]: a region (a list, off the wire)
                self.regions.drop(cast("list[Union[str, int]]", ref))
            elif ref.startswith(DIRECT_PREFIX):
                self.direct.forget(ref)
                paths = True
            elif ref.startswith(LEND_PREFIX):
                self.lending.forget(int(ref[len(LEND_PREFIX):]))
            else:
                self.inputs_shm.drop(ref.__eq__)
        if paths:     # what ran on them is answered: the broker may stop waiting for them
            self.send(internal.Served([], True))

    def release(self, blocks: Sequence[internal.BlockRef]) -> None:
        """Output blocks the broker no longer reads: arena blocks are freed,
        tensors lent from the capture region dropped (torch frees them)."""
        capture, captured = self.capture, self.capture_name
        # a released block is [segment, offset, size] (protocol/internal.py; decoded as they
        # come, the peer is the daemon): the wire's layout, which the type system cannot see
        for segment, offset, size in cast("Sequence[tuple[str, int, int]]", blocks):
            if capture is not None and segment == captured:
                capture.release(offset)
            elif not self.lending.release(segment, offset):
                self.outputs.free(Block(segment, offset, size))

    def run(self, msg: internal.Run) -> None:
        t0 = time.perf_counter_ns()
        out: list[internal.OutputDescriptor] = []
        reused: list[str] = []
        value: Optional[Value] = None
        try:
            inputs: dict[str, Value] = {}
            reusable: Optional[list[tuple[int, int, internal.SegmentRef, int]]] = None
            regions = False
            for d in msg.inputs:
                value = inputs[d.name] = self.view_input(d)
                if d.segment.__class__ is list:
                    regions = True
                elif d.reuse is True and d.nbytes and self.on_cpu and not isinstance(value, list):
                    reusable = reusable or []
                    reusable.append((value.data_ptr(), d.nbytes, d.segment, d.offset))
            t1 = time.perf_counter_ns()
            requested = msg.outputs
            asked: Optional[dict[str, Union[internal.OutputTarget, internal.Classify]]] = None
            targets: Optional[dict[str, internal.OutputTarget]] = None
            names = [r if isinstance(r, str) else r.name for r in requested] if requested else None
            if requested and not all(r.__class__ is str for r in requested):
                asked = {r.name: r for r in requested if not isinstance(r, str)}
            # one local session's batch: its outputs go into that session's area, the only
            # memory lent to it (lending.py); anyone else's into this worker's own memory
            lend_to = msg.lend_to
            captured = self.lending.capture_region(lend_to) if lend_to else None
            results = self.engine.execute(inputs, names, region=captured)
            t2 = time.perf_counter_ns()
            if asked:   # rare: outputs into regions, outputs asked as classes
                targets = self.classifier.apply(results, asked)
            # (a session's outputs are answered in place only from its area: one made in
            # this worker's own region is copied into the area, which that first copy makes)
            lender = captured if lend_to else self.capture
            for name, value in results.items():
                target = targets.get(name) if targets else None
                if target is None and isinstance(value, torch.Tensor):
                    # answered where it already lies, with no copy: a view of a
                    # reusable input block, or a tensor made in the capture region
                    where = reuse_input(value, reusable) if reusable else None
                    if where is not None:
                        reused.append(name)
                    elif lender is not None:
                        where = lender.lend(value)
                    if where is not None:
                        out.append(internal.OutputDescriptor(name, _wire_name(value.dtype), list(value.shape),
                                                             *where))
                        continue
                out.append(self.write_output(name, value, target, lend_to))
            if regions or asked:
                self.check_regions(msg)
            if captured is not None:
                del results                  # only what the model itself keeps is left in the area
                value = None
                if self.lending.kept_by_the_model(captured):
                    out = self.copy_out_of(captured, out)
            if self.lending.retiring:
                self.lending.sweep()
        except Exception as exc:  # never let one batch take the worker down
            self.take_back(out, reused)
            self.send(self.failed(msg.batch_id, exc))
            return
        t3 = time.perf_counter_ns()
        self.send(internal.Done(msg.batch_id, out, (t1 - t0, t2 - t1, t3 - t2), reused))

    def copy_out_of(self, area: CaptureRegion, out: list[internal.OutputDescriptor]
                    ) -> list[internal.OutputDescriptor]:
        """The batch's outputs in `area`, copied into this worker's arena (they
        go back as bytes: the area is retired, kept_by_the_model) and their
        blocks of the area given back."""
        moved = []
        for d in out:
            if not isinstance(d.segment, str) or d.segment != area.name:
                moved.append(d)
                continue
            block = self.outputs.alloc(d.nbytes)
            copy_into(memoryview(self.outputs.segments[block.segment].buf)[block.offset:block.offset + d.nbytes],
                      memoryview(area.segment.buf)[d.offset:d.offset + d.nbytes])
            self.lending.release(d.segment, d.offset)
            moved.append(d._replace(segment=block.segment, offset=block.offset))
        return moved

    def take_back(self, out: list[internal.OutputDescriptor], reused: list[str]) -> None:
        """A batch failed after some outputs were placed: nobody will read
        them, so their blocks (and lent tensors) come back now."""
        self.release([internal.Block(d.segment, d.offset, d.nbytes) for d in out
                      if isinstance(d.segment, str) and d.name not in reused])

    def check_regions(self, msg: internal.Run) -> None:
        """A client that shrank its region while the model read it (or while
        its output was written) made the guard put zeros in its place
        (shm/guard.py): that batch's answer would be wrong, so it fails. It
        is the client's error, never a crash of this worker."""
        refs = [d.segment for d in msg.inputs if not isinstance(d.segment, str)]
        refs += [r.region for r in msg.outputs if isinstance(r, internal.OutputTarget)]
        for ref in refs:
            if not is_device_ref(ref) and self.regions.broken(cast("list[Union[str, int]]", ref)):
                raise ExecutionError(f"model '{self.spec.model}': a client's registered region "
                                     f"shrank while the model used it; unregister and register "
                                     f"it again", errors.INVALID_ARG)

    def failed(self, batch_id: int, exc: Exception, what: str = "") -> internal.Failed:
        """Log a failed batch (`what`: else named by its id) for the operator
        (with its traceback when the model or torchpool raised) and word it
        for the client: the model and instance, one clean line, no traceback
        and no server paths."""
        where = f"{self.label} {what or f'batch {batch_id}'}"
        if isinstance(exc, TorchpoolError):   # ExecutionError, ModelLoadError, RegionError
            code, text = exc.code, client_text(exc.message)
            if exc.__cause__ is not None:     # forward (or torch) raised: the operator wants the trace
                log.error("%s failed: %s", where, text, exc_info=exc)
            elif code == errors.INVALID_ARG:  # the request's fault, not the server's
                log.debug("%s failed: %s", where, text)
            else:
                log.warning("%s failed: %s", where, text)
        else:                                 # a bug in torchpool or in the model's support code
            code, text = errors.INTERNAL, client_text(f"{type(exc).__name__}: {exc}")
            log.error("%s failed: %s", where, text, exc_info=exc)
        if f"'{self.spec.model}'" not in text:
            text = f"{text} (model '{self.spec.model}' instance '{self.spec.instance}')"
        if not self.on_cpu and out_of_gpu_memory(exc):
            code = errors.RESOURCE_EXHAUSTED    # this batch did not fit; the next may: the worker goes on
        if not self.on_cpu and lost_cuda_context(exc):
            # every later CUDA call of this process would fail: it ends once this
            # answer is sent (loop()), and the broker starts the instance afresh
            self.context_lost = True
            text = f"{text}; the instance's CUDA context is lost: its worker is replaced"
            log.error("%s: the CUDA context is lost: this worker exits and is replaced", self.label)
        return internal.Failed(batch_id, code, text)

    def _buffer(self, ref: internal.SegmentRef, offset: int, nbytes: int, generation: int,
                name: str) -> mmap.mmap:
        """The mapping that holds [offset, offset + nbytes) of input `name`: a
        daemon segment (named) or a client's registered region ([key, inode])."""
        if not isinstance(ref, str):       # [key, inode] (a list, off the wire)
            return self.regions.get(cast("list[Union[str, int]]", ref), offset + nbytes,
                                    self.engine.input_label(name))
        seg = self.inputs_shm.find(ref)
        if seg is None:
            raise ExecutionError(f"{self.engine.input_label(name)}: segment {ref!r} was never handed to this "
                                 f"worker", errors.INTERNAL)
        buf = seg.buf
        if generation:
            # the client may have reused the block since the broker checked it
            magic, gen, size = read_block_header(buf, offset - BLOCK_HEADER_BYTES)
            if magic != BLOCK_MAGIC or gen != generation or size != nbytes:
                raise ExecutionError(f"{self.engine.input_label(name)}: stale descriptor (the block was reused "
                                     f"before the model ran)", errors.INVALID_ARG)
        return buf

    def view_input(self, d: internal.InputDescriptor) -> Value:
        name, datatype, shape, segment, offset, nbytes, generation, _ = d
        if is_device_ref(segment):          # in a client's GPU memory: viewed there
            label = self.engine.input_label(name)
            mapped, device = self.device_regions.mapped(cast("list[Union[str, int, bytes]]", segment),
                                                        offset + nbytes, label)
            return self.engine.device_tensor(name, datatype, shape, device_bytes(mapped, device, offset, nbytes))
        buf = self._buffer(segment, offset, nbytes, generation, name)
        pinned = False
        if self.pinning is not None and segment.__class__ is str:     # a daemon or client arena segment
            address = _address_of(buf)
            pinned = address is not None and self.pinning.pin(segment, address, len(buf))
        return self.engine.tensor(name, datatype, shape, buf, offset, nbytes, pinned)

    def _unmap_input(self, seg: Segment) -> None:
        """An input segment goes: unregistered from the GPU first, then unmapped (off this thread)."""
        if self.pinning is not None:
            self.pinning.unpin(seg.name)
        self.reaper.close(seg)

    def write_output(self, name: str, value: Value, target: Optional[internal.OutputTarget] = None,
                     lend_to: int = 0) -> internal.OutputDescriptor:
        """Write one output once: into the caller's region when it named one,
        else, when it is large enough to be lent, into the area of the session
        the batch's outputs may be lent to (`lend_to`) while it has room, else
        into this worker's arena. Returns its descriptor."""
        if target is not None and is_device_ref(target.region):
            return self._write_to_device(name, value, target)
        if isinstance(value, list):   # List[str], or class strings (classify.py)
            data: Union[bytes, torch.Tensor] = datatypes.encode_bytes(value)
            shape = value.shape if value.__class__ is Classified else [len(value)]
            datatype, nbytes = "BYTES", len(data)
        else:
            if not (value.is_cpu and value.is_contiguous()):
                value = value.cpu().contiguous()
            datatype, shape, nbytes, data = _wire_name(value.dtype), list(value.shape), value.nbytes, value
        if target is not None:
            _, ref, offset, capacity = target
            if nbytes > capacity:
                raise ExecutionError(f"output '{name}' of model '{self.spec.model}' needs {nbytes} "
                                     f"bytes but its region provides {capacity}", errors.INVALID_ARG)
            buf = self.regions.get(cast("list[Union[str, int]]", ref), offset + nbytes,
                                   f"output '{name}' for model '{self.spec.model}'")
            segment: internal.SegmentRef = ref
        else:
            area = self.lending.area(lend_to) if lend_to and worth_descriptor(nbytes) else None
            in_area = area.alloc(nbytes) if area is not None else None
            if area is not None and in_area is not None:
                segment, offset, buf, address = area.name, in_area, area.segment.buf, area.base
            else:
                block = self.outputs.alloc(nbytes)
                segment, offset = block.segment, block.offset
                buf, address = self.outputs.segments[block.segment].buf, 0
            if nbytes and data is value and not streams(nbytes):
                # the arena and the areas are this worker's own memory: one memcpy from
                # the tensor, without numpy views or buffer objects on the way
                ctypes.memmove((address or self._arena_address(segment)) + offset, value.data_ptr(), nbytes)
                return internal.OutputDescriptor(name, datatype, shape, segment, offset, nbytes)
        if nbytes:
            # one copy, streamed when large (torch's multi-threaded copy_ into a
            # shared mapping measured 6x slower here: 8 ms vs 1.3 ms for 16 MiB)
            copy_into(memoryview(buf)[offset:offset + nbytes],
                      data if isinstance(data, bytes) else data.reshape(-1).view(torch.uint8).numpy())
        return internal.OutputDescriptor(name, datatype, shape, segment, offset, nbytes)

    def _write_to_device(self, name: str, value: Value, target: internal.OutputTarget) -> internal.OutputDescriptor:
        """An output into a client's GPU memory (a CUDA region): copied there
        from wherever the model left it, complete before the answer says so."""
        what = f"output '{name}' for model '{self.spec.model}'"
        if isinstance(value, list):
            raise ExecutionError(f"{what}: a BYTES output cannot be written into CUDA shared memory",
                                 errors.INVALID_ARG)
        _, ref, offset, capacity = target
        nbytes = value.nbytes
        if nbytes > capacity:
            raise ExecutionError(f"{what} needs {nbytes} bytes but its region provides {capacity}",
                                 errors.INVALID_ARG)
        if nbytes:
            mapped, device = self.device_regions.mapped(cast("list[Union[str, int, bytes]]", ref),
                                                        offset + nbytes, what)
            destination = device_bytes(mapped, device, offset, nbytes)
            destination.copy_(value.contiguous().reshape(-1).view(torch.uint8))
            torch.cuda.synchronize(destination.device)
        return internal.OutputDescriptor(name, _wire_name(value.dtype), list(value.shape), ref, offset, nbytes)

    def _arena_address(self, segment: str) -> int:
        """Where an output arena segment is mapped (it stays so until the worker exits)."""
        address = self._arena_addresses.get(segment)
        if address is None:
            view = ctypes.c_char.from_buffer(self.outputs.segments[segment].buf)
            address = self._arena_addresses[segment] = ctypes.addressof(view)
            del view          # no export left behind: the arena can still close its mapping
        return address


@functools.cache
def _address_of(buf: mmap.mmap) -> Optional[int]:
    """Where a writable mapping starts (the export is dropped at once: the
    mapping can still be closed); None for a read-only one."""
    try:
        view = ctypes.c_char.from_buffer(buf)
    except TypeError:
        return None
    address = ctypes.addressof(view)
    del view
    return address


_wire_name = functools.cache(datatypes.wire_from_torch)
