"""Triton's batch-forming rules, with one owner: the broker's dynamic
batcher (broker/schedulers/dynamic.py) and a worker batching its direct
requests (worker/direct_batch.py) form their batches by them.

Requests may share a batch when they have the same inputs with the same
shapes beyond the batch dimension (ragged inputs excepted: any shape). A
batch takes requests in order while it stays within the largest preferred
size (or max_batch_size) and is sent when
  - it reached the largest preferred size, or the next request cannot join
    (too big, another shape, or it must run alone), or
  - it reached a preferred size (the largest one reached is sent), or
  - its oldest request has waited max_queue_delay_microseconds;
otherwise it waits until that delay is over or more requests arrive.
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional


class BatchLimits(NamedTuple):
    max_preferred: int          # the largest preferred size (max_batch_size when none)
    preferred: frozenset        # the preferred sizes within max_batch_size
    delay: float                # max_queue_delay_microseconds, in seconds


def batch_limits(cfg: Any) -> BatchLimits:
    """The sizes and the delay of a model's `dynamic_batching`."""
    db = cfg.dynamic_batching or {}
    max_batch = max(1, cfg.max_batch_size)
    preferred = [p for p in db.get("preferred_batch_size", []) if 0 < p <= max_batch]
    return BatchLimits(max(preferred) if preferred else max_batch, frozenset(preferred),
                       db.get("max_queue_delay_microseconds", 0) / 1e6)


def batch_rows(staged: list, batching: bool) -> int:
    """A validated request's rows along dim 0 (1 for a model without batching)."""
    return staged[0][1][0] if batching and staged and staged[0][1] else 1


def batch_key(staged: Iterable[tuple]) -> tuple:
    """The key of the requests a request with these validated inputs
    (`validate_infer`'s staged tuples) may share a batch with."""
    return tuple(sorted((spec.name, "ragged" if spec.allow_ragged_batch else tuple(shape[1:]))
                        for spec, shape, *_ in staged))


def select_batch(ordered: Iterable[Any], max_preferred: int, preferred: frozenset, delay: float,
                 now: float) -> tuple[list, bool, Optional[float]]:
    """The requests of the next batch (in `ordered`, each with `batch_size`,
    `key`, `exclusive` and `enqueued`), whether it should go now, and else
    when it should go at the latest (`enqueued`, `delay` and `now` in one clock's seconds)."""
    reqs: list = []
    items, best, send_now, key, oldest = 0, 0, False, None, None
    for req in ordered:
        n = req.batch_size
        if reqs and (req.exclusive or req.key != key or items + n > max_preferred):
            send_now = True          # the batch cannot grow any more
            break
        if not reqs:
            key = req.key
        reqs.append(req)
        items += n
        if oldest is None or req.enqueued < oldest:
            oldest = req.enqueued
        if req.exclusive or items >= max_preferred:
            send_now = True
            break
        if items in preferred:
            best = len(reqs)
    if not reqs:
        return reqs, False, None
    if send_now:
        return reqs, True, None
    if best:
        return reqs[:best], True, None
    wake = oldest + delay
    return reqs, now >= wake, wake
