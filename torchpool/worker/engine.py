"""The worker's one execution engine: inputs onto the model's device, the
model, its outputs back per request.

Every batch a worker runs goes through here, whoever formed it:

- a batch the broker dispatched (RUN, process.py): the broker has gathered
  each input of its requests into one block and splits the outputs itself
  (broker/answers), so it is one part here, its inputs views of shared memory;
- a direct request (direct.py): one part, its inputs a copy of what the
  client sent;
- a batch of direct requests the worker formed by the broker's batching rules
  (direct_batch.py): several parts, each input gathered into one buffer, each
  output cut back into each part's rows by the broker's row splitter
  (rules/split.py).

So there is one place where an input becomes the tensor the model takes (on a
GPU: copied onto the device on the instance's stream, asynchronously from
page-locked memory, gpu_copies.py), one place where the model runs (the
output capture on, one synchronisation per batch, the cache cleaned when the
model asks), and one gather and one split for the batches the worker forms.
"""
from __future__ import annotations

import functools
import itertools
import math
import mmap
import time
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from ..protocol import datatypes, errors
from ..rules.split import row_spans
from ..shm.cpu_ledger import CpuLedger
from .binding import ExecutionError
from .capture import CaptureRegion, OutputCapture
from .cpu_share import CpuShare
from .gpu_copies import DeviceCopies
from .loader import LoadedInstance
from .settings import after_execution
from .spec import WorkerSpec

# An input as the model takes it: a tensor, or the strings of a BYTES input
# (TorchScript's List[str]); an output the same, or class strings (classify.py)
Value = Union[torch.Tensor, list]
# memory an input is viewed in: shared memory mapped here, or the worker's own copy
Memory = Union[bytes, bytearray, memoryview, mmap.mmap]


class StagedInput(NamedTuple):
    """One input of a part, as its request sent it: its bytes are the part's own."""
    datatype: str
    shape: list[int]          # the model's shape of it (batch dimension first when batching)
    payload: Union[bytes, bytearray, memoryview]


class Part(NamedTuple):
    """One request's share of a batch the worker forms."""
    inputs: dict[str, StagedInput]
    rows: int                 # its rows along the batch dimension


class PartsRun(NamedTuple):
    """What running a batch of parts gave: each part's outputs, by name, and
    the time its inputs took to gather (and reach the device) and the model to run."""
    outputs: list[dict[str, Value]]
    input_ns: int
    infer_ns: int


class Engine:
    """One model instance's execution: built once the instance is loaded."""

    def __init__(self, spec: WorkerSpec, loaded: LoadedInstance,
                 capture: Optional[OutputCapture], ledger_fd: int = -1) -> None:
        self.model_name = spec.model
        self.settings = loaded.settings
        self.device = loaded.device
        self.module = loaded.model.module
        self.binding = loaded.model.binding
        self.capture = capture             # outputs the model makes, answered where they lie
        self.on_cpu = self.device is None or torch.device(self.device).type == "cpu"
        # on a GPU: the instance's stream, its copies and kernels in order, one sync per batch
        self.copies = (DeviceCopies(self.device)
                       if not self.on_cpu and torch.device(self.device).type == "cuda" else None)
        self.clean_cache = self.settings.enable_cache_cleaning   # read per batch: looked up once
        # a CPU worker whose model sets no thread counts: its threads per batch, by what is busy
        self.cpu_share = (CpuShare(CpuLedger.attach(ledger_fd), spec.cpu_slot, spec.cpu_budget)
                          if ledger_fd >= 0 and self.on_cpu else None)

    def close(self) -> None:
        if self.cpu_share is not None:
            self.cpu_share.close()

    # ------------------------------------------------------------ one input

    def tensor(self, name: str, datatype: str, shape: Sequence[int], buf: Memory, offset: int, nbytes: int,
               pinned: bool = False) -> Value:
        """Input `name` as the model takes it, a view of `buf[offset:offset + nbytes]`
        (on a GPU, a copy there: asynchronous when `buf` is page-locked)."""
        if datatype == "BYTES":
            return self._strings(name, memoryview(buf)[offset:offset + nbytes], math.prod(shape))
        dtype, itemsize, array_type = _tensor_type(datatype)
        if nbytes == 0:
            tensor = torch.empty(shape, dtype=dtype)
        elif array_type is not None:     # (numpy's view of the bytes, then torch's: 2 µs, not 5)
            tensor = torch.from_numpy(np.ndarray(shape, array_type, buf, offset))
        else:
            tensor = torch.frombuffer(buf, dtype=dtype, count=nbytes // itemsize, offset=offset).view(shape)
        if self.copies is not None:
            tensor = self.copies.to_device(tensor, pinned)
        elif not self.on_cpu:
            tensor = tensor.to(self.device)
        return tensor

    def device_tensor(self, name: str, datatype: str, shape: Sequence[int], raw: torch.Tensor) -> Value:
        """Input `name` from a client's GPU memory (`raw`: its bytes, a uint8
        CUDA tensor): viewed in place on the model's device, else copied there."""
        if datatype == "BYTES":
            raise ExecutionError(f"{self.input_label(name)}: a BYTES input cannot be read from CUDA shared "
                                 f"memory", errors.INVALID_ARG)
        dtype, itemsize, _ = _tensor_type(datatype)
        if raw.data_ptr() % itemsize:      # an unaligned offset: a typed view needs aligned storage
            raw = raw.clone()
        tensor = raw.view(dtype).view(shape)
        target = torch.device(self.device or "cpu")
        return tensor if tensor.device == target else tensor.to(target)

    def _strings(self, name: str, data: memoryview, count: int) -> list[str]:
        """A BYTES input as the List[str] TorchScript takes."""
        try:
            # the sender's checks passed, but a client may rewrite its memory since
            items = datatypes.decode_bytes(data, count)
        except ValueError as exc:
            raise ExecutionError(f"{self.input_label(name)}: {exc} (the client changed its memory "
                                 f"after sending)", errors.INVALID_ARG) from None
        try:
            return [item.decode("utf-8") for item in items]
        except UnicodeDecodeError as exc:
            raise ExecutionError(f"{self.input_label(name)} holds an element that is not valid UTF-8 "
                                 f"({exc.reason}); TorchScript strings must be UTF-8", errors.INVALID_ARG) from None

    def input_label(self, name: str) -> str:
        return f"input '{name}' for model '{self.model_name}'"

    # ------------------------------------------------------------ the model

    def execute(self, inputs: dict[str, Value], names: Optional[list[str]], capture: bool = True,
                region: Optional[CaptureRegion] = None) -> dict[str, Value]:
        """The model's outputs; large tensors it makes land in `region`, else
        the capture region (unless `capture` is False: answers that travel inline)."""
        copies, share = self.copies, self.cpu_share
        if copies is not None:          # on a GPU: the model's kernels after its inputs' copies
            with copies.on_stream():
                results = self._run_model(inputs, names, self.capture if capture else None, region)
            copies.finish()             # once per batch: then its outputs are read
        elif share is None:
            results = self._run_model(inputs, names, self.capture if capture else None, region)
        else:                           # its share of the CPUs while it runs
            share.take()
            try:
                results = self._run_model(inputs, names, self.capture if capture else None, region)
            finally:
                share.give()
        if self.clean_cache:
            after_execution(self.settings, self.device)
        return results

    def _run_model(self, inputs: dict[str, Value], names: Optional[list[str]],
                   capture: Optional[OutputCapture], region: Optional[CaptureRegion]) -> dict[str, Value]:
        if capture is None:
            return self.binding.run(self.module, inputs, names)
        capture.on(region)
        try:
            return self.binding.run(self.module, inputs, names)
        finally:
            capture.off()     # never while outputs are copied

    # ------------------------------------------------------------ batches the worker forms

    def run_parts(self, parts: Sequence[Part], names: Optional[list[str]]) -> PartsRun:
        """Gather the parts' inputs, run the model once, and split its outputs
        back into each part's rows (their outputs travel inline: no capture)."""
        t0 = time.perf_counter_ns()
        inputs: dict[str, Value] = {}
        if len(parts) == 1:             # its own copy already: used in place
            for name, (datatype, shape, payload) in parts[0].inputs.items():
                inputs[name] = self.tensor(name, datatype, shape, payload, 0, len(payload))
        else:
            rows = sum(p.rows for p in parts)
            for name, (datatype, shape, _payload) in parts[0].inputs.items():
                buf = bytearray().join([p.inputs[name].payload for p in parts])    # one copy
                inputs[name] = self.tensor(name, datatype, [rows, *shape[1:]], buf, 0, len(buf))
        t1 = time.perf_counter_ns()
        results = self.execute(inputs, names, capture=False)
        t2 = time.perf_counter_ns()
        return PartsRun(self._split(parts, results), t1 - t0, t2 - t1)

    def _split(self, parts: Sequence[Part], results: dict[str, Value]) -> list[dict[str, Value]]:
        """Each part's rows of each output, by the broker's row splitter."""
        if len(parts) == 1:
            return [results]
        sizes = [p.rows for p in parts]
        starts = list(itertools.accumulate(sizes[:-1], initial=0))
        rows = sum(sizes)
        split: list[dict[str, Value]] = [{} for _ in parts]
        for name, value in results.items():
            strings = isinstance(value, list)            # BYTES: split by element count
            count = len(value) if isinstance(value, list) else (value.shape[0] if value.dim() else 0)
            spans = row_spans(self.model_name, name, count, sizes, starts, rows, strings)
            for mine, (lo, hi) in zip(split, spans):
                mine[name] = value[lo:hi]
        return split


@functools.cache
def _tensor_type(datatype: str) -> tuple[torch.dtype, int, Optional[np.dtype]]:
    """(torch dtype, bytes per element, numpy dtype if numpy has it) of a wire
    datatype: read per request, looked up in protocol.datatypes once."""
    array_type: Optional[np.dtype] = datatypes.numpy_dtype(datatype)
    torch_type = datatypes.torch_dtype(datatype)
    if torch.from_numpy(np.zeros(0, array_type)).dtype != torch_type:    # BF16 travels as uint16
        array_type = None
    return torch_type, datatypes.element_size(datatype), array_type
