"""When a busy instance may be sent the request it runs next.

A request sent ahead to a busy instance starts the moment that instance
finishes, without waiting for the sender's turn (the broker's loop, or an
event loop's wake-up); but it stays there even if another instance frees up
first. With one instance it would wait anyway. With several, only quick
models gain enough to take that risk (the sender's turn is a large share of
a short execution), and the wait is then short. The broker (instances.py)
and an AsyncClient's paths to every instance (client/aio_lane.py) decide by
this one rule.
"""
from __future__ import annotations

from typing import Optional

# a model of several instances is sent requests ahead only while its mean
# execution (per request) is shorter than this
AHEAD_MAX_MEAN_NS = 2_000_000


def may_send_ahead(instances: int, mean_ns: Optional[float]) -> bool:
    """May a busy instance of a model with `instances` running be sent its
    next request, its executions averaging `mean_ns` (None: none measured yet)?"""
    if instances <= 1:
        return True
    return mean_ns is not None and mean_ns <= AHEAD_MAX_MEAN_NS
