"""Per model-version statistics, in Triton's shape.

The broker updates plain integers on its own thread; the statistics call and
the Prometheus collector read them. Durations are cumulative nanoseconds, as
Triton reports them.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class VersionStats:
    success: Duration = field(default_factory=Duration)      # whole request, accept to answer
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0          # requests' batch items served
    execution_count: int = 0          # model executions (batches)
    last_inference_ms: int = 0
    worker_restarts: int = 0
    batches: dict[int, BatchStats] = field(default_factory=dict)
    batch_sizes: Counter = field(default_factory=Counter)

    def record_execution(self, batch_size: int, requests: int, input_ns: int, infer_ns: int,
                         output_ns: int) -> None:
        """One model execution serving `requests` requests of `batch_size` items in all."""
        self.execution_count += 1
        self.inference_count += batch_size
        self.last_inference_ms = int(time.time() * 1000)
        # Triton counts compute durations per request; each request of the batch shares them
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(infer_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        b = self.batches.setdefault(batch_size, BatchStats())
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        self.batch_sizes[batch_size] += 1

    def to_triton(self, name: str, version: int) -> dict:
        return {
            "name": name,
            "version": str(version),
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": self.compute_input.to_json(),
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
            },
            "batch_stats": [
                {"batch_size": size, "compute_input": b.compute_input.to_json(),
                 "compute_infer": b.compute_infer.to_json(), "compute_output": b.compute_output.to_json()}
                for size, b in sorted(self.batches.items())
            ],
            "worker_restarts": self.worker_restarts,
        }
