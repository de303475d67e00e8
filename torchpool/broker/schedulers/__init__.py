"""One scheduler per model version, chosen by its config (see base.py)."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Optional

from ...config import ModelConfig
from ...protocol import errors
from ...protocol.errors import TorchpoolError
from ...shm.arena import Arena
from .base import BACKLOG_DELAY_SCHEDULER, DELAY_SCHEDULER, Scheduler, SchedulerHold

log = logging.getLogger("torchpool.broker")


def make_scheduler(config: ModelConfig, model_dir: Path, arena: Arena, transfer: Counter[str],
                   hold: Optional[SchedulerHold] = None) -> Scheduler:
    """The scheduler the config asks for. Raises TorchpoolError when the
    config cannot be scheduled (the version then fails to load). `hold`:
    Triton's test switches (default: from the daemon's environment)."""
    if config.dynamic_batching is not None and config.sequence_batching is not None:
        raise TorchpoolError(errors.INVALID_ARG, "a model has one scheduler: set dynamic_batching or "
                                                 "sequence_batching, not both")
    batching = config.sequence_batching is not None or config.dynamic_batching is not None
    hold = hold or (SchedulerHold.from_environment() if batching else SchedulerHold())
    if batching and hold.queued > 0:
        log.warning("model '%s': %s=%d (%s=%d): its scheduler forms no batch until that many requests "
                    "are queued (a switch for testing)", config.name, DELAY_SCHEDULER, hold.queued,
                    BACKLOG_DELAY_SCHEDULER, hold.backlog)
    if config.sequence_batching is not None:
        from .sequence import SequenceBatcher
        return SequenceBatcher(config, model_dir, arena, transfer, hold)
    if config.dynamic_batching is not None:
        from .dynamic import DynamicBatcher
        return DynamicBatcher(config, arena, transfer, hold)
    from .direct import DirectScheduler
    return DirectScheduler(config, arena, transfer)
