"""The size of a worker's output capture region (capture.py), without torch:
the daemon's options (broker/options.py) take their default from here, and
the broker never imports torch.

`--output-capture-mib` sets it; an operator's TORCHPOOL_OUTPUT_CAPTURE_MIB
is still read, as the default, for compatibility with the time when it was
the only way.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

log = logging.getLogger("torchpool.worker")

ENV = "TORCHPOOL_OUTPUT_CAPTURE_MIB"
DEFAULT_MIB = 256


def capture_mib_from_environment(environ: Optional[Mapping[str, str]] = None) -> int:
    """TORCHPOOL_OUTPUT_CAPTURE_MIB, else DEFAULT_MIB (0: capture off); a
    value that is not a whole number of MiB is warned about and ignored."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        return DEFAULT_MIB
    try:
        mib = int(value)
        if mib < 0:
            raise ValueError
    except ValueError:
        log.warning("%s=%r is not a whole number of MiB; using %d", ENV, value, DEFAULT_MIB)
        return DEFAULT_MIB
    return mib
