"""Triton's batch-forming rules, with one owner: the broker's dynamic
batcher (broker/schedulers/dynamic.py), the sequence batcher's `oldest`
strategy and a worker batching its direct requests (worker/direct_batch.py)
form their batches by them. They are GetDynamicBatch's
(core/src/dynamic_batch_scheduler.cc):

Requests may share a batch when they have the same inputs with the same
shapes beyond the batch dimension (ragged inputs excepted: any shape). The
queue is scanned in order while the batch stays within max_batch_size and
the requests can join (same shapes, none that must run alone). On the way
it remembers the last preferred size it reached, or, where it grows beyond
the largest preferred size before reaching any, what it held just before.
Then
  - while the oldest request has waited less than max_queue_delay_microseconds,
    a remembered batch is sent at once; without one the whole batch is sent
    when it cannot grow (a request could not join) or reached the largest
    preferred size, and otherwise it waits until that delay is over or more
    requests arrive;
  - once the oldest request has waited max_queue_delay_microseconds, the
    whole batch is sent, up to max_batch_size (so requests that piled up
    while the scheduler was held go together);
  - without a max_queue_delay_microseconds nothing waits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, NamedTuple, Optional, Protocol, TypeVar, Union

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .validation import Staged

# what a request's batch key holds per input: its name, and "ragged" or its shape beyond dim 0
BatchKey = tuple[tuple[str, Union[str, tuple[int, ...]]], ...]


class Queued(Protocol):
    """A request waiting to be batched, as `select_batch` reads it."""

    @property
    def batch_size(self) -> int: ...
    @property
    def key(self) -> object: ...
    @property
    def exclusive(self) -> bool: ...
    @property
    def enqueued(self) -> float: ...


Q = TypeVar("Q", bound=Queued)


class BatchLimits(NamedTuple):
    max_batch: int              # max_batch_size (at least 1)
    max_preferred: int          # the largest preferred size (max_batch_size when none)
    preferred: frozenset[int]        # the preferred sizes within max_batch_size
    delay: float                # max_queue_delay_microseconds, in seconds


def limits(max_batch_size: int, preferred_sizes: Iterable[int], delay_us: float) -> BatchLimits:
    """The limits of a batcher with these settings (sizes beyond max_batch_size ignored)."""
    max_batch = max(1, max_batch_size)
    preferred = [int(p) for p in preferred_sizes if 0 < int(p) <= max_batch]
    return BatchLimits(max_batch, max(preferred) if preferred else max_batch, frozenset(preferred),
                       delay_us / 1e6)


def batch_limits(cfg: ModelConfig) -> BatchLimits:
    """The sizes and the delay of a model's `dynamic_batching`."""
    db = cfg.dynamic_batching or {}
    return limits(cfg.max_batch_size, db.get("preferred_batch_size", []),
                  db.get("max_queue_delay_microseconds", 0))


def batch_rows(staged: list[Staged], batching: bool) -> int:
    """A validated request's rows along dim 0 (1 for a model without batching)."""
    return staged[0][1][0] if batching and staged and staged[0][1] else 1


def batch_key(staged: Iterable[Staged]) -> BatchKey:
    """The key of the requests a request with these validated inputs
    (`validate_infer`'s staged tuples) may share a batch with."""
    return tuple(sorted((spec.name, "ragged" if spec.allow_ragged_batch else tuple(shape[1:]))
                        for spec, shape, *_ in staged))


def select_batch(ordered: Iterable[Q], lim: BatchLimits,
                 now: float) -> tuple[list[Q], bool, Optional[float]]:
    """The requests of the next batch (in `ordered`, each with `batch_size`,
    `key`, `exclusive` and `enqueued`), whether it should go now, and else
    when it should go at the latest (`enqueued`, the delay and `now` in one
    clock's seconds)."""
    reqs: list[Q] = []
    key: object
    items, best, full, key, oldest = 0, 0, False, None, 0.0
    for req in ordered:
        n = req.batch_size
        if reqs:
            if items + n > lim.max_preferred and not best:
                best = len(reqs)         # beyond every preferred size: what it holds is the one
            if req.exclusive or req.key != key or items + n > lim.max_batch:
                full = True              # the batch cannot grow any more
                break
        else:
            key, oldest = req.key, req.enqueued
        reqs.append(req)
        items += n
        oldest = min(oldest, req.enqueued)
        if req.exclusive:
            full = True                  # it runs alone
            break
        if items in lim.preferred:
            best = len(reqs)
    if not reqs:
        return reqs, False, None
    due = oldest + lim.delay
    waited = lim.delay > 0 and now >= due
    if best and not waited:
        return reqs[:best], True, None
    if full or items >= lim.max_preferred or waited or lim.delay <= 0:
        return reqs, True, None
    return reqs, False, due
