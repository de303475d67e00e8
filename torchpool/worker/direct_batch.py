"""Direct requests in batches, in the worker: the ones waiting, and how a batch
of them runs and is answered.

A model with dynamic batching takes direct requests when its batches are
formed by the batching rules alone (one priority level, no queue policy, no
ragged input: broker/direct.py refuses the others). The worker then batches
the direct requests its clients send, by the broker's own rules
(rules/batching.py): each turn reads one request of each client, and
more in turn while they fill a batch (the threads of a client share its
path); the accepted ones wait here in arrival order, and a batch runs as soon as
the rules send it (at once with no max_queue_delay_microseconds: what
arrived in the same turn runs together).

A model without batching runs each direct request as a batch of one, through
the same `DirectRunner`: the engine (engine.py) gathers each input of a batch
once into one buffer (the requests' payloads were copied out of the receive
buffer when they were read), runs the model, and splits each output back per
request along dim 0 (BYTES by element count) by the broker's own row splitter;
here each request's outputs become its answer, inline.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Generic, Optional, Protocol, TypeVar

import torch

from ..config import ModelConfig
from ..protocol import datatypes, messages, reports, tensors
from ..protocol.errors import TorchpoolError
from ..rules.batching import batch_limits, select_batch
from .engine import Engine, Part, Value

if TYPE_CHECKING:
    from ..protocol.internal import Failed


class DirectClient(Protocol):
    """What a batch needs of the client a request came from."""
    session: str


# the clients' own type (direct.py's _Client): a batcher gives back what it was given
ClientT = TypeVar("ClientT", bound=DirectClient)

# answer(records for SERVED, [(client, frames of its answer), ...])
Answer = Callable[[list, list], None]
# failed(exception, what failed) -> the answer's code and text (Worker.failed)
Failure = Callable[[Exception, str], "Failed"]


class Waiting(Generic[ClientT]):
    """An accepted direct request waiting for its batch (or running alone)."""
    __slots__ = ("client", "request_id", "part", "requested", "batch_size", "key", "enqueued", "t0")
    exclusive = False                    # names only, a batch dimension: it may share a batch

    def __init__(self, client: ClientT, request_id: object, part: Part, requested: list[str],
                 batch_size: int, key: object, t0: int) -> None:
        self.client = client
        self.request_id = request_id
        self.part = part
        self.requested = requested
        self.batch_size = batch_size
        self.key = key                   # which requests it may share a batch with (rules/batching.py)
        self.enqueued = time.monotonic()
        self.t0 = t0                     # when it was read (perf_counter_ns)


class DirectRunner:
    """Runs a batch of direct requests on the engine and answers each of them."""

    def __init__(self, engine: Engine, cfg: ModelConfig, version: str, failed: Failure) -> None:
        self.engine = engine
        self.cfg = cfg
        self.version = version
        self.failed = failed

    def run(self, reqs: list[Waiting[ClientT]], answer: Answer) -> None:
        t_start = time.perf_counter_ns()
        try:
            done = self.engine.run_parts([w.part for w in reqs], self._requested(reqs))
            answers = self._answers(reqs, done.outputs)
        except Exception as exc:         # the model failed (or its outputs cannot be split)
            what = (f"direct request {reqs[0].request_id!r}" if len(reqs) == 1
                    else f"direct batch of {len(reqs)} requests")
            failed = self.failed(exc, what)
            now = time.perf_counter_ns()
            answer([[reports.FAILED, now - w.t0, t_start - w.t0, w.client.session, None] for w in reqs],
                   [(w.client, [messages.pack(messages.error_response(
                       w.request_id, TorchpoolError(failed.code, failed.message)))]) for w in reqs])
            return
        t3 = time.perf_counter_ns()
        execution = [sum(w.batch_size for w in reqs), len(reqs), done.input_ns, done.infer_ns,
                     t3 - t_start - done.input_ns - done.infer_ns]
        records = [[reports.OK, t3 - w.t0, t_start - w.t0, w.client.session, execution if i == 0 else None]
                   for i, w in enumerate(reqs)]
        answer(records, answers)

    def _requested(self, reqs: list[Waiting[ClientT]]) -> list[str]:
        first = reqs[0].requested
        if len(reqs) == 1 or all(w.requested == first for w in reqs):
            return first
        wanted = {name for w in reqs for name in w.requested}
        return [t.name for t in self.cfg.outputs if t.name in wanted]

    def _answers(self, reqs: list[Waiting[ClientT]], outputs: list[dict[str, Value]]) -> list:
        """Each request's answer: its part of each output it asked for."""
        model, version = self.cfg.name, self.version
        out = []
        for w, mine in zip(reqs, outputs):
            entries: list = []
            frames: list = []
            for name in w.requested:
                value = mine.get(name)
                if value is not None:
                    entries.append(inline_output(name, value, frames))
            header = messages.ok_response(w.request_id, model_name=model, model_version=version,
                                          outputs=entries)
            out.append((w.client, [messages.pack(header), *frames]))
        return out


class DirectBatcher(Generic[ClientT]):
    """The waiting direct requests of one worker and the batches they form."""

    def __init__(self, runner: DirectRunner) -> None:
        self.runner = runner
        self.limits = batch_limits(runner.cfg)
        self.max_preferred = self.limits.max_preferred
        self.waiting: list[Waiting[ClientT]] = []
        self.wake_at: Optional[float] = None      # the waiting batch is due then

    def add(self, request: Waiting[ClientT]) -> None:
        self.waiting.append(request)

    def items(self) -> int:
        """The batch size of the requests waiting."""
        return sum(w.batch_size for w in self.waiting)

    def drop(self, client: ClientT) -> None:
        """A client that is gone: its waiting requests have no one to answer."""
        self.waiting = [w for w in self.waiting if w.client is not client]

    def run_due(self, answer: Answer, force: bool = False) -> None:
        """Run every batch the rules send now (`force`: every waiting request)."""
        self.wake_at = None
        while self.waiting:
            reqs, go, wake = select_batch(self.waiting, self.limits, time.monotonic())
            if not (go or force):
                self.wake_at = wake
                return
            del self.waiting[:len(reqs)]          # a batch is always the first requests waiting
            self.runner.run(reqs, answer)


def inline_output(name: str, value: Value, frames: list) -> dict:
    """One output's entry, its bytes inline (or a payload frame when large)."""
    if isinstance(value, list):          # List[str]: BYTES
        entry = tensors.tensor_entry(name, "BYTES", [len(value)])
        tensors.put_data(entry, datatypes.encode_bytes(value), frames)
        return entry
    if not (value.is_cpu and value.is_contiguous()):
        value = value.cpu().contiguous()
    try:
        data = value.numpy()             # one torch call (three for the bytes view below)
    except TypeError:                    # a dtype numpy lacks (bfloat16)
        data = value.reshape(-1).view(torch.uint8).numpy()
    entry = tensors.tensor_entry(name, datatypes.wire_from_torch(value.dtype), list(value.shape))
    tensors.put_data(entry, data, frames)
    return entry


def poll_timeout_ms(wake_at: Optional[float]) -> Optional[int]:
    """poll()'s timeout in ms until `wake_at` (None: no timeout)."""
    if wake_at is None:
        return None
    return max(0, math.ceil((wake_at - time.monotonic()) * 1000))
