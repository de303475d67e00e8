"""Dynamic batching of direct requests, in the worker.

A model with dynamic batching takes direct requests when its batches are
formed by the batching rules alone (one priority level, no queue policy, no
ragged input: broker/direct.py refuses the others). The worker then batches
the direct requests its clients send, by the broker's own rules
(rules/batching.py): each turn reads one request of each client, and
more in turn while they fill a batch (the threads of a client share its
path); the accepted ones wait here in arrival order, and a batch runs as soon as
the rules send it (at once with no max_queue_delay_microseconds: what
arrived in the same turn runs together). Each input of a batch is written
once into one buffer (the requests' payloads were copied out of the
receive buffer when they were read); each output is split back per request
along dim 0 (BYTES by element count), by the broker's own row splitter
(rules/split.py).
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Any, Callable, Optional

from ..config import ModelConfig
from ..protocol import messages, reports
from ..rules.batching import batch_key, batch_limits, batch_rows, select_batch
from ..rules.split import row_spans
from ..protocol.errors import TorchpoolError

# answer(records for SERVED, [(client, frames of its answer), ...])
Answer = Callable[[list, list], None]


class Waiting:
    """An accepted direct request waiting for its batch."""
    __slots__ = ("client", "request_id", "inputs", "requested", "batch_size", "rows", "key",
                 "enqueued", "t0")
    exclusive = False                    # names only, a batch dimension: it may share a batch

    def __init__(self, client: Any, request_id: Any, staged: list, requested: list, batch_size: int,
                 t0: int) -> None:
        self.client = client
        self.request_id = request_id
        # name -> (datatype, model shape, payload): a copy, the receive buffer is reused
        self.inputs = {spec.name: (spec.datatype, model_shape, bytearray(payload))
                       for spec, _shape, model_shape, payload, _location in staged}
        self.requested = requested
        self.batch_size = batch_size
        self.rows = batch_rows(staged, True)
        self.key = batch_key(staged)
        self.enqueued = time.monotonic()
        self.t0 = t0


class DirectBatcher:
    """The waiting direct requests of one worker and the batches they form."""

    def __init__(self, worker: Any, cfg: ModelConfig, output: Callable[[str, Any, list], dict]) -> None:
        self.worker = worker
        self.cfg = cfg
        self.output = output             # (name, value, frames) -> the output's entry
        self.limits = batch_limits(cfg)
        self.max_preferred = self.limits.max_preferred
        self.waiting: list[Waiting] = []
        self.wake_at: Optional[float] = None      # the waiting batch is due then

    def add(self, client: Any, request_id: Any, staged: list, requested: list, batch_size: int,
            t0: int) -> None:
        self.waiting.append(Waiting(client, request_id, staged, requested, batch_size, t0))

    def items(self) -> int:
        """The batch size of the requests waiting."""
        return sum(w.batch_size for w in self.waiting)

    def drop(self, client: Any) -> None:
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
            self._run(reqs, answer)

    # ------------------------------------------------------------ one batch

    def _run(self, reqs: list[Waiting], answer: Answer) -> None:
        worker = self.worker
        t_start = time.perf_counter_ns()
        rows = sum(w.rows for w in reqs)
        items = sum(w.batch_size for w in reqs)
        try:
            inputs = {}
            for name, (datatype, model_shape, _payload) in reqs[0].inputs.items():
                if len(reqs) == 1:       # its own copy already
                    buf, shape = reqs[0].inputs[name][2], model_shape
                else:
                    buf = bytearray(b"".join([w.inputs[name][2] for w in reqs]))
                    shape = [rows, *model_shape[1:]]
                inputs[name] = worker.tensor(name, datatype, shape, buf, 0, len(buf))
            t1 = time.perf_counter_ns()
            results = worker.execute(inputs, self._requested(reqs), capture=False)   # answered inline
            t2 = time.perf_counter_ns()
            answers = self._answers(reqs, results, rows)
        except Exception as exc:         # the model failed (or its outputs cannot be split)
            failed = worker.failed(0, exc, f"direct batch of {len(reqs)} requests")
            now = time.perf_counter_ns()
            answer([[reports.FAILED, now - w.t0, t_start - w.t0, w.client.session, None] for w in reqs],
                   [(w.client, [messages.pack(messages.error_response(
                       w.request_id, TorchpoolError(failed.code, failed.message)))]) for w in reqs])
            return
        t3 = time.perf_counter_ns()
        execution = [items, len(reqs), t1 - t_start, t2 - t1, t3 - t2]
        records = [[reports.OK, t3 - w.t0, t_start - w.t0, w.client.session, execution if i == 0 else None]
                   for i, w in enumerate(reqs)]
        answer(records, answers)

    def _requested(self, reqs: list[Waiting]) -> list:
        first = reqs[0].requested
        if all(w.requested == first for w in reqs):
            return first
        wanted = {name for w in reqs for name in w.requested}
        return [t.name for t in self.cfg.outputs if t.name in wanted]

    def _answers(self, reqs: list[Waiting], results: dict, rows: int) -> list:
        """Each request's answer: its rows of each output it asked for."""
        model = self.cfg.name
        single = len(reqs) == 1
        parts: dict[str, list] = {}
        sizes = [w.rows for w in reqs]
        starts = list(itertools.accumulate(sizes[:-1], initial=0))
        for name, value in results.items():
            if single:
                parts[name] = [value]
                continue
            strings = isinstance(value, list)            # BYTES: split by element count
            count = len(value) if strings else (value.shape[0] if value.dim() else 0)
            spans = row_spans(model, name, count, sizes, starts, rows, strings)
            parts[name] = [value[lo:hi] for lo, hi in spans]
        version = str(self.worker.spec.version)
        out = []
        for i, w in enumerate(reqs):
            entries, frames = [], []
            for name in w.requested:
                if name in parts:
                    entries.append(self.output(name, parts[name][i], frames))
            header = messages.ok_response(w.request_id, model_name=model, model_version=version,
                                          outputs=entries)
            out.append((w.client, [messages.pack(header), *frames]))
        return out


def poll_timeout_ms(wake_at: Optional[float]) -> Optional[int]:
    """poll()'s timeout in ms until `wake_at` (None: no timeout)."""
    if wake_at is None:
        return None
    return max(0, math.ceil((wake_at - time.monotonic()) * 1000))
