"""A load of addsub requests through one client, every answer checked."""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from torchpool.protocol.errors import InferenceError

LOADERS = 4


class Load:
    """`threads` threads calling addsub through one client, each with its own
    inputs, until stopped. Every answer is compared with what it must be;
    errors and wrong answers are kept, and each call's start and duration."""

    def __init__(self, client: Any, threads: int = LOADERS) -> None:
        self.client = client
        self.stop = threading.Event()
        self.answered = [0] * threads
        self.errors: list[tuple[int, BaseException]] = []
        self.wrong: list[str] = []
        self.calls: list[tuple[float, float]] = []        # (monotonic start, seconds) of each answer
        self.threads = [threading.Thread(target=self._run, args=(t,)) for t in range(threads)]

    def _run(self, t: int) -> None:
        i = 0
        b = np.arange(16, dtype=np.float32).reshape(1, 16)
        while not self.stop.is_set():
            a = np.full((1, 16), t * 1_000_000 + i, np.float32)
            i += 1
            start = time.monotonic()
            try:
                out = self.client.infer("addsub", {"INPUT0": a, "INPUT1": b})
            except InferenceError as exc:
                self.errors.append((t, exc))
                continue
            self.calls.append((start, time.monotonic() - start))
            if not (np.array_equal(out["OUTPUT0"], a + b) and np.array_equal(out["OUTPUT1"], a - b)):
                self.wrong.append(f"thread {t} call {i}: {out['OUTPUT0'][0, :2]} {out['OUTPUT1'][0, :2]}")
            self.answered[t] += 1

    def slowest_after(self, moment: float) -> float:
        """The longest answered call among those still waiting at `moment` or started later."""
        return max((d for s, d in list(self.calls) if s + d >= moment), default=0.0)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not any(t.is_alive() for t in self.threads)
