"""Guarded access to shared memory a client owns (its registered regions).

A client can shrink its segment (ftruncate) while the daemon has it mapped;
the daemon's next access beyond the new end raises SIGBUS, which would kill
the process. `protect(buf)` puts a mapping under the guard of the `_sigbus`
extension (see `_sigbus.c`): a SIGBUS inside a protected range replaces the
whole range with anonymous zero pages and sets its `faulted` flag, and the
access that faulted completes (reading zeros, writing into throwaway pages).
The range then no longer shows the client's segment: the caller fails what
used it and treats the mapping as broken until it maps the segment again.
A SIGBUS anywhere else is handled as if the guard did not exist.

Without the compiled extension (no C compiler at install time) there is no
guard: `protect` raises RuntimeError and callers refuse client regions.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from typing_extensions import Buffer

try:
    from . import _sigbus
except ImportError:          # pragma: no cover - built on every supported install
    _sigbus = None  # type: ignore[assignment]

AVAILABLE: bool = _sigbus is not None
CAPACITY: int = _sigbus.CAPACITY if _sigbus is not None else 0   # ranges guarded at once


class GuardedRange:
    """One protected mapping; `release()` it before unmapping."""

    __slots__ = ("_slot", "_serial", "_faulted")

    def __init__(self, slot: int, serial: int) -> None:
        self._slot = slot
        self._serial = serial
        self._faulted: Optional[bool] = None   # known once released

    @property
    def faulted(self) -> bool:
        """A SIGBUS hit the range since protect(): its pages are now zeros."""
        if self._faulted is not None:
            return self._faulted
        return _sigbus.faulted(self._slot, self._serial)

    def release(self) -> None:
        """Stop guarding (idempotent). The mapping must still be there: a range
        released after munmap could be refilled by the next mapping at the
        same address."""
        if self._faulted is None:
            self._faulted = _sigbus.remove(self._slot, self._serial)

    def __repr__(self) -> str:
        state = "released" if self._faulted is not None else "guarded"
        return f"<GuardedRange slot {self._slot} {state}{' faulted' if self.faulted else ''}>"


def protect(buf: Buffer) -> GuardedRange:
    """Guard the pages of `buf` (an mmap.mmap or any buffer that starts on a
    page boundary) against SIGBUS from a shrunk segment. RuntimeError when
    the extension is missing or the table of ranges is full."""
    if _sigbus is None:
        raise RuntimeError("torchpool's SIGBUS guard (torchpool.shm._sigbus) was not compiled: "
                           "reinstall torchpool with a C compiler available")
    return GuardedRange(*_sigbus.add(buf))
