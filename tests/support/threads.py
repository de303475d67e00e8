"""Run one piece of work in several threads at once, for the client's thread tests."""
from __future__ import annotations

import threading
from typing import Any, Callable


def in_threads(count: int, work: Callable[[int], Any], join_timeout: float = 300) -> list[Any]:
    """work(0..count-1) in threads started together; each one's result or exception."""
    results: list[Any] = [None] * count
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except BaseException as exc:     # the test inspects it
            results[i] = exc
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting"
    return results
