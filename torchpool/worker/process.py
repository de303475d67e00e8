"""The worker process: one per model instance.

    broker --[RUN descriptors]--> worker: view inputs in shm (zero copy)
                                         -> TorchScript forward
                                         -> write outputs once into its own arena
    broker <--[DONE descriptors]-- worker

Workers are forked from a template process that already imported torch (see
`torchpool.broker.supervisor`), so starting one costs a fork and a model load.
The worker serves one batch at a time; its output arena is reset when the next
batch arrives, because the broker has finished reading the previous outputs
by then (it answers the client before dispatching again).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ..config.model_config import ModelConfig
from ..protocol import datatypes, errors, internal
from ..shm.arena import Arena, SegmentCache
from .binding import ExecutionError, ModelLoadError, load_model
from .settings import after_execution, apply_process_settings, grad_context, parse_parameters

log = logging.getLogger("torchpool.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; pickled through the fork server."""

    model: str
    version: int
    instance: str                 # Triton instance name, e.g. "addsub_0_0"
    config: ModelConfig
    model_path: str
    device: str                   # "cpu", "cuda:0", or "model" (KIND_MODEL)
    segment_prefix: str           # names this worker's output segments
    arena_chunk: int
    arena_limit: int
    log_level: int = logging.INFO


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the template (our parent) exits.

    The template exits when the broker does, so a kill -9 of the broker never
    leaves workers behind.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # pragma: no cover - not Linux
        pass


def worker_main(spec: WorkerSpec, sock: socket.socket) -> None:
    """Entry point in the forked child (a multiprocessing target)."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # parent died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the broker's to handle
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s worker[{spec.instance} v{spec.version}] %(message)s")
    Worker(spec, sock).serve()


class Worker:
    def __init__(self, spec: WorkerSpec, sock: socket.socket) -> None:
        self.spec = spec
        self.sock = sock
        self.inputs_shm = SegmentCache()
        self.outputs = Arena(lambda i: f"{spec.segment_prefix}{i}", spec.arena_chunk,
                             spec.arena_limit, prefault=True)
        self.device = None
        self.module: Any = None
        self.binding: Any = None
        self.settings: Any = None

    def send(self, *msg: Any) -> None:
        self.sock.send(msgpack.packb(msg, use_bin_type=True))

    def serve(self) -> None:
        try:
            self.load()
        except ModelLoadError as exc:
            self.send(internal.LOAD_FAILED, exc.code, exc.message)
            return
        except Exception as exc:  # a load must fail cleanly, whatever happened
            self.send(internal.LOAD_FAILED, errors.INTERNAL,
                      f"failed to load model '{self.spec.model}': {exc}")
            return
        self.send(internal.READY, os.getpid(), str(self.device))
        try:
            # One inference_mode / no_grad scope for the worker's whole life:
            # entering it per request costs microseconds on the hot path.
            with grad_context(self.settings):
                self.loop()
        finally:
            self.outputs.close(unlink=True)
            self.inputs_shm.close()

    def load(self) -> None:
        spec = self.spec
        self.settings = parse_parameters(spec.model, spec.config.parameters)
        apply_process_settings(self.settings)
        if spec.device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelLoadError(f"instance '{spec.instance}' of model '{spec.model}' needs "
                                 f"{spec.device} (KIND_GPU) but no GPU is available",
                                 errors.UNAVAILABLE)
        self.device = torch.device("cpu" if spec.device == "model" else spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        map_location = None if spec.device == "model" else self.device
        self.module, self.binding = load_model(spec.config, spec.model_path, map_location,
                                               spec.instance, self.settings)
        # An output arena ready before the first request: its page faults are
        # paid now, not on the first answer.
        self.outputs.free(self.outputs.alloc(1))

    def loop(self) -> None:
        while True:
            try:
                raw = self.sock.recv(internal.MAX_MESSAGE)
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            if not raw:
                return  # the broker went away
            msg = msgpack.unpackb(raw, raw=False)
            if msg[0] == internal.STOP:
                return
            if msg[0] == internal.RUN:
                self.run(msg[1], msg[2], msg[3])

    def run(self, batch_id: int, descriptors: list, requested: list) -> None:
        t0 = time.perf_counter_ns()
        self.outputs.reset()
        try:
            inputs = {d[0]: self.view_input(d) for d in descriptors}
            t1 = time.perf_counter_ns()
            results = self.binding.run(self.module, inputs, requested or None)
            after_execution(self.settings, self.device)
            t2 = time.perf_counter_ns()
            out = [self.write_output(name, value) for name, value in results.items()]
        except (ExecutionError, ModelLoadError) as exc:
            self.send(internal.FAILED, batch_id, exc.code, exc.message)
            return
        except Exception as exc:  # never let one batch take the worker down
            self.send(internal.FAILED, batch_id, errors.INTERNAL,
                      f"model '{self.spec.model}' instance '{self.spec.instance}': {exc}")
            return
        t3 = time.perf_counter_ns()
        self.send(internal.DONE, batch_id, out, [t1 - t0, t2 - t1, t3 - t2])

    def view_input(self, d: list) -> Any:
        name, datatype, shape, segment, offset, nbytes = d
        buf = self.inputs_shm.get(segment).buf
        if datatype == "BYTES":
            items = datatypes.decode_bytes(memoryview(buf)[offset:offset + nbytes])
            try:
                return [item.decode("utf-8") for item in items]
            except UnicodeDecodeError as exc:
                raise ExecutionError(f"input '{name}' for model '{self.spec.model}' holds an "
                                     f"element that is not valid UTF-8 ({exc.reason}); "
                                     f"TorchScript strings must be UTF-8", errors.INVALID_ARG) from None
        dtype = datatypes.torch_dtype(datatype)
        if nbytes == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            count = nbytes // datatypes.element_size(datatype)
            tensor = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)
        if self.device.type != "cpu":
            tensor = tensor.to(self.device)
        return tensor

    def write_output(self, name: str, value: Any) -> list:
        if isinstance(value, list):
            data = datatypes.encode_bytes(value)
            block = self.outputs.alloc(len(data))
            self.outputs.view(block)[:] = data
            return [name, "BYTES", [len(value)], block.segment, block.offset, block.size]
        datatype = datatypes.wire_from_torch(value.dtype)
        nbytes = value.numel() * value.element_size()
        block = self.outputs.alloc(nbytes)
        if nbytes:
            dst = torch.frombuffer(self.outputs.segments[block.segment].buf, dtype=torch.uint8,
                                   count=nbytes, offset=block.offset)
            dst.copy_(value.reshape(-1).view(torch.uint8))
        return [name, datatype, list(value.shape), block.segment, block.offset, nbytes]
