"""One scheduler per model version, chosen by its config (see base.py)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from ...config import ModelConfig
from ...protocol import errors
from ...protocol.errors import TorchpoolError
from ...shm.arena import Arena
from .base import Scheduler


def make_scheduler(config: ModelConfig, model_dir: Path, arena: Arena, transfer: Counter) -> Scheduler:
    """The scheduler the config asks for. Raises TorchpoolError when the
    config cannot be scheduled (the version then fails to load)."""
    if config.dynamic_batching is not None and config.sequence_batching is not None:
        raise TorchpoolError(errors.INVALID_ARG, "a model has one scheduler: set dynamic_batching or "
                                                 "sequence_batching, not both")
    if config.sequence_batching is not None:
        from .sequence import SequenceBatcher
        return SequenceBatcher(config, model_dir, arena, transfer)
    if config.dynamic_batching is not None:
        from .dynamic import DynamicBatcher
        return DynamicBatcher(config, arena, transfer)
    from .direct import DirectScheduler
    return DirectScheduler(config, arena, transfer)
