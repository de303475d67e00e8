"""Inference requests checked against the model config, before anything runs.

The one owner of what a request may be: the broker checks every request it
accepts here (broker/requests.py stages what passes), and a worker checks
each request a local client sends it directly (worker/direct.py) by the same
rules. Every message names the model, the tensor and what was expected
(Triton's wording where Triton has one).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, cast, Optional, Protocol, Sequence, TypeVar, Union

from ..config import ModelConfig, TensorSpec
from ..protocol import datatypes, errors, tensors
from ..protocol.errors import TorchpoolError
from ..protocol.internal import is_device_ref
from .request import InferCall

if TYPE_CHECKING:
    from typing_extensions import Buffer, TypeGuard

    from ..protocol.tensors import Entry

# A requested output as the worker takes it: a name, [name, region ref, offset,
# capacity] or [name, k] (_requested_outputs)
WorkerOutput = Union[str, list[object]]


class Staged(NamedTuple):
    """One input of a request, checked against its model's config."""

    spec: TensorSpec
    shape: list[int]                    # as sent
    model_shape: list[int]              # as the model sees it (reshape, ragged)
    payload: memoryview                 # its bytes
    location: Optional[list[object]]    # where a worker finds them in shared memory; None: inline (_payload)

S = TypeVar("S", contravariant=True)       # a session, passed through to the sessions
R = TypeVar("R", bound="SessionRegion")
R_co = TypeVar("R_co", bound="SessionRegion", covariant=True)


class Limited(Protocol):
    """What TensorLimits.of reads of a daemon's options."""

    @property
    def max_bytes_elements(self) -> int: ...
    @property
    def max_bytes_tensor_bytes(self) -> int: ...


class ModelVersionLike(Protocol):
    """What validate_infer reads of a model version."""

    @property
    def name(self) -> str: ...
    @property
    def config(self) -> ModelConfig: ...


class SessionRegion(Protocol):
    """A registered shared-memory region (broker/regions.py Region)."""

    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    def view(self, offset: int, nbytes: int) -> memoryview: ...
    def worker_ref(self) -> list[object]: ...


class Sessions(Protocol, Generic[S, R_co]):
    """Where shared-memory references resolve (broker/sessions.py SessionManager)."""

    def arena_view(self, session: Optional[S], ref: object, what: str) -> tuple[memoryview, list[object]]: ...
    def region(self, session: Optional[S], ref: object, what: str) -> tuple[R_co, int, int]: ...

MiB = 1 << 20


@dataclass(frozen=True)
class TensorLimits:
    """What one input tensor may hold, beyond what the model config says:
    BYTES tensors cost the broker a walk over every element and the worker a
    Python object per element. A daemon's are its ServerOptions' (--max-bytes-*)."""

    # elements of one BYTES tensor: Triton's own L0_grpc test sends 10,485,760
    # one-byte elements (10 Mi); each costs about 280 bytes at its peak in the
    # worker (a str and a TorchScript string) and as much in the gRPC gateway's
    # converter: about 3 GiB in each at the bound, never more
    max_bytes_elements: int = 10 << 20
    max_bytes_tensor_bytes: int = 256 * MiB      # bytes of one BYTES tensor

    @classmethod
    def of(cls, options: Limited) -> TensorLimits:
        """The limits a daemon's ServerOptions set."""
        return cls(options.max_bytes_elements, options.max_bytes_tensor_bytes)


DEFAULT_LIMITS = TensorLimits()



def _bad(message: str) -> TorchpoolError:
    return TorchpoolError(errors.INVALID_ARG, message)


def _too_much(name: str, model: str, what: str, limit: int, flag: str) -> TorchpoolError:
    return TorchpoolError(errors.RESOURCE_EXHAUSTED, f"input '{name}' for model '{model}' has {what}; "
                                                     f"this server accepts at most {limit} per tensor "
                                                     f"({flag})")


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _check_shape(entry: Entry, model: str) -> list[int]:
    shape = entry.get("shape")
    if shape.__class__ is list:
        for d in shape:
            # int exactly: msgpack gives int, and bool (an int) is no dimension
            if d.__class__ is not int or d < 0:
                break
        else:
            return shape
    raise _bad(f"input '{entry.get('name')}' for model '{model}' has an invalid shape "
               f"{shape!r}: expected a list of non-negative integers")


def _shape_matches(dims: tuple[int, ...], shape: list[int], batching: bool) -> bool:
    """`shape` (with its batch dimension when batching) against the config's dims."""
    start = 1 if batching else 0
    if len(shape) != len(dims) + start:
        return False
    for i, d in enumerate(dims, start):
        if d != -1 and d != shape[i]:
            return False
    return True


def _model_shape(spec: TensorSpec, shape: list[int], batching: bool) -> list[int]:
    """The shape the model sees: the config's `reshape` applied, if any; a
    ragged input (`allow_ragged_batch`) is one flat run of elements."""
    if batching and spec.allow_ragged_batch:
        return [math.prod(shape)]
    if spec.reshape is None:
        return shape
    prefix = shape[:1] if batching else []
    target = list(spec.reshape)
    if -1 in target:
        # Triton's: the config check made the runs between variable (-1)
        # dimensions hold as many elements in `dims` as in `reshape`, so
        # the reshape's -1s take the request's variable sizes, in order
        sizes = iter([n for n, d in zip(shape[len(prefix):], spec.dims) if d == -1])
        target = [next(sizes, 0) if d == -1 else d for d in target]
    return prefix + target


def _payload(e: Entry, frames: Sequence[Buffer], session: Optional[S], sessions: Optional[Sessions[S, R]], name: str,
             model: str, regions: list[R]) -> tuple[memoryview, Optional[list[object]]]:
    """The input's bytes, and where a worker finds them when they are already
    in shared memory ([segment ref, offset, nbytes, generation], and `True`
    when the client lets the answer point into the block; None when inline
    bytes must be staged)."""
    where = tensors.location(e)
    if where != tensors.SHM and where != tensors.REGION:       # inline bytes: the common case
        return memoryview(tensors.tensor_payload(e, frames)).cast("B"), None
    what = f"input '{name}' for model '{model}'"
    if sessions is None:
        raise _bad(f"{what}: shared memory takes a session of the daemon's")
    if where == tensors.SHM:
        view, location = sessions.arena_view(session, e[tensors.SHM], what)
        if e.get(tensors.REUSE) is True:
            location.append(True)        # the answer may point into this block
        return view, location
    region, offset, nbytes = sessions.region(session, e[tensors.REGION], what)
    regions.append(region)
    return region.view(offset, nbytes), [region.worker_ref(), region.offset + offset, nbytes, 0]


@dataclass(frozen=True)
class CheckedInfer(Generic[R]):
    """What validate_infer found an infer request to ask, checked."""

    staged: list[Staged]                 # its inputs, in the order sent
    outputs: list[WorkerOutput]          # the outputs to ask the worker for
    batch_size: int                      # rows along the batch dimension (1 without batching)
    regions: list[R]                     # registered regions it uses (held until it is answered)
    region_outputs: dict[str, tuple[str, int]]   # output name -> (region name, offset) it goes to


def validate_infer(call: InferCall, frames: Sequence[Buffer], mv: ModelVersionLike, session: Optional[S] = None,
                   sessions: Optional[Sessions[S, R]] = None, *, limits: TensorLimits = DEFAULT_LIMITS
                   ) -> CheckedInfer[R]:
    """Check a request's inputs and requested outputs against its model's
    config and `limits`; TorchpoolError (INVALID_ARG, RESOURCE_EXHAUSTED)
    naming the model, the tensor and what was expected."""
    cfg: ModelConfig = mv.config
    model = mv.name
    raw = call.inputs
    if raw.__class__ is not list or not _all_dicts(entries := cast("list[object]", raw)):
        raise _bad(f"request for model '{model}' has no valid 'inputs' list")
    specs = cfg.inputs_by_name
    batching = cfg.max_batch_size > 0
    seen: dict[str, Entry] = {}
    for e in entries:
        name = e.get("name")
        if name.__class__ is not str:
            raise _bad(f"request for model '{model}' has an input without a valid name: {name!r}")
        if name in seen:
            raise _bad(f"input '{name}' given more than once for model '{model}'")
        if name not in specs:
            raise _bad(f"unexpected inference input '{name}' for model '{model}'")
        seen[name] = e
    if len(seen) != len(specs):          # every input given: none can be missing
        required = [t.name for t in cfg.inputs if not t.optional]
        missing = [n for n in required if n not in seen]
        if missing:
            raise _bad(f"expected {len(required)} inputs but got {len(seen)} inputs for model '{model}'. "
                       f"Got input(s) {sorted(seen)}, but missing required input(s) {missing}. "
                       f"Please provide all required input(s).")

    staged: list[Staged] = []
    regions: list[R] = []
    batch_size = None
    for name, e in seen.items():
        spec = specs[name]
        datatype = spec.datatype
        if e.get("datatype") != datatype:
            raise _bad(f"inference input '{name}' data-type is '{e.get('datatype')}', but model '{model}' "
                       f"expects '{datatype}'")
        shape = _check_shape(e, model)
        if batching:
            if not shape:
                raise _bad(f"input '{name}' for model '{model}' has no batch dimension; expected "
                           f"shape {_shape_str([-1, *spec.dims])}")
            if shape[0] > cfg.max_batch_size:
                raise _bad(f"inference request batch-size must be <= {cfg.max_batch_size} for "
                           f"'{model}', got {shape[0]} in input '{name}'")
            if batch_size is None:
                batch_size = shape[0]
            elif shape[0] != batch_size:
                raise _bad(f"input '{name}' for model '{model}' has batch size {shape[0]}, but other "
                           f"inputs have {batch_size}: all inputs must share the batch size")
        if not _shape_matches(spec.dims, shape, batching):
            expected = ([-1] if batching else []) + list(spec.dims)
            raise _bad(f"unexpected shape for input '{name}' for model '{model}'. "
                       f"Expected {_shape_str(expected)}, got {_shape_str(shape)}")
        count = math.prod(shape)
        if datatype == "BYTES" and count > limits.max_bytes_elements:
            # refused before its payload is even looked at
            raise _too_much(name, model, f"{count} BYTES elements", limits.max_bytes_elements,
                            "--max-bytes-elements")
        payload, location = _payload(e, frames, session, sessions, name, model, regions)
        if datatype == "BYTES":
            if location is not None and is_device_ref(location[0]):
                raise _bad(f"input '{name}' for model '{model}': a BYTES tensor cannot be read from CUDA "
                           f"shared memory (its lengths must be read on the host)")
            if len(payload) > limits.max_bytes_tensor_bytes:
                raise _too_much(name, model, f"{len(payload)} bytes of BYTES elements",
                                limits.max_bytes_tensor_bytes, "--max-bytes-tensor-bytes")
            try:
                datatypes.check_bytes(payload, count)
            except ValueError as exc:
                raise _bad(f"input '{name}' for model '{model}' (BYTES, shape {_shape_str(shape)}): "
                           f"{exc}; each element is a 4-byte little-endian length and its bytes") from None
        else:
            want = count * datatypes.element_size(datatype)
            if len(payload) != want:
                raise _bad(f"input byte size mismatch for input '{name}' for model '{model}'. "
                           f"Expected {want}, got {len(payload)}")
        staged.append(Staged(spec, shape, _model_shape(spec, shape, batching), payload, location))

    if cfg.batch_inputs or cfg.batch_outputs:
        present = {spec.name for spec, *_ in staged}
        for entry in (*cfg.batch_inputs, *cfg.batch_outputs):
            source = entry["source_input"][0]
            if source not in present:
                what = "batch input" if entry in cfg.batch_inputs else "batch output"
                raise _bad(f"input '{source}' for model '{model}' is required: {what} "
                           f"'{entry['target_name'][0]}' is computed from it")
    requested, region_outputs = _requested_outputs(call.outputs, cfg, model, session, sessions, regions)
    return CheckedInfer(staged, requested, batch_size or 1, regions, region_outputs)


def _all_dicts(entries: list[object]) -> TypeGuard[list[Entry]]:
    for e in entries:
        if e.__class__ is not dict:
            return False
    return True


# Triton's classification extension ranks numbers only (its classification.cc):
# BOOL, FP16, BF16 and BYTES outputs cannot be classified.
CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
                          "FP32", "FP64"})


def _class_count(out: Entry, spec: TensorSpec, model: str) -> int:
    """The `classification` of a requested output map: the number of classes
    wanted, 0 for none (absent, nil or 0: Triton's class_count 0 means none)."""
    count = out.get(tensors.CLASSIFICATION)
    if count is None:
        return 0
    what = f"output '{spec.name}' for model '{model}'"
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise _bad(f"{what}: 'classification' must be a positive integer (the number of classes "
                   f"to return; 0 or nil for none), got {count!r}")
    if count == 0:
        return 0
    if spec.datatype not in CLASSIFIABLE:
        raise _bad(f"{what}: class result not available for output due to unsupported type "
                   f"'{spec.datatype}'")
    if tensors.REGION in out:
        raise _bad(f"{what}: 'classification' cannot be combined with 'region': the class "
                   f"strings are not the tensor the region holds")
    return count


def _requested_outputs(requested: object, cfg: ModelConfig, model: str, session: Optional[S],
                       sessions: Optional[Sessions[S, R]], regions: list[R]
                       ) -> tuple[list[WorkerOutput], dict[str, tuple[str, int]]]:
    """Output names, maps {name, region} that send an output into a region,
    or maps {name, classification} that ask for its top-k classes. For the
    worker: a name, [name, region ref, offset, capacity] or [name, k]."""
    if requested is None:
        return list(cfg.outputs_by_name), {}
    if not isinstance(requested, list):
        raise _bad(f"'outputs' for model '{model}' must be a list of output names")
    worker_outputs: list[WorkerOutput]
    region_outputs: dict[str, tuple[str, int]]
    seen: set[str]
    worker_outputs, region_outputs, seen = [], {}, set()
    for out in requested:
        name = out.get("name") if isinstance(out, dict) else out
        if not isinstance(name, str):
            raise _bad(f"'outputs' for model '{model}' must be a list of output names")
        if name in seen:            # Triton's InferenceRequest::AddOriginalRequestedOutput
            raise _bad(f"output '{name}' already exists in request for model '{model}'")
        seen.add(name)
        spec = cfg.output(name)
        if spec is None:
            raise _bad(f"unexpected inference output '{name}' for model '{model}'")
        if out is name:              # a plain name
            worker_outputs.append(name)
            continue
        count = _class_count(out, spec, model)
        if count:
            worker_outputs.append([name, count])
        elif tensors.REGION in out:
            if sessions is None:
                raise _bad(f"output '{name}' for model '{model}': a region takes a session of the daemon's")
            region, offset, capacity = sessions.region(session, out[tensors.REGION],
                                                       f"output '{name}' for model '{model}'")
            regions.append(region)
            region_outputs[name] = (region.name, offset)
            worker_outputs.append([name, region.worker_ref(), region.offset + offset, capacity])
        else:
            worker_outputs.append(name)
    return worker_outputs, region_outputs


# --- a request's own timeout ---------------------------------------------------------------

# Triton's answer to a request whose timeout passed before it could start
TIMEOUT = "Request timeout expired"


def start_deadline(call: InferCall) -> Optional[int]:
    """When a request taken on a direct path must have started
    (time.monotonic_ns), or None without a timeout: counted from when its
    client sent it (`sent_ns`, on the host's monotonic clock, which a
    worker shares with its local clients), from now when that is missing
    or in the future. The daemon counts from when it received a request."""
    if not call.timeout_us:
        return None
    now = time.monotonic_ns()
    sent = call.sent_ns
    if sent is None or sent > now:
        sent = now
    return sent + call.timeout_us * 1000
