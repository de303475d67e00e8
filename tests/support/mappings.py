"""Where this process maps an array's memory: /proc/self/maps, for tests
that check an output lies in the daemon's shared memory (and in which)."""
from __future__ import annotations

import numpy as np


def mapped_file(arr: np.ndarray) -> str:
    """The file this process maps at the array's first byte ('' when the
    mapping is anonymous or nothing is mapped there)."""
    address = arr.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""
