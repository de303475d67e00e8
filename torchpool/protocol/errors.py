"""Error codes (Triton's) and the exception that carries one."""
from __future__ import annotations

INVALID_ARG = "INVALID_ARG"
NOT_FOUND = "NOT_FOUND"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
UNSUPPORTED = "UNSUPPORTED"
ALREADY_EXISTS = "ALREADY_EXISTS"
UNKNOWN = "UNKNOWN"
CANCELLED = "CANCELLED"

CODES = frozenset({INVALID_ARG, NOT_FOUND, UNAVAILABLE, INTERNAL, UNSUPPORTED,
                   ALREADY_EXISTS, UNKNOWN, CANCELLED})


class TorchpoolError(Exception):
    """An error with a Triton code; what the server answers and the client raises."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_wire(self) -> dict:
        return {"code": self.code, "message": self.message}


class InferenceError(TorchpoolError):
    """Raised by the client library for every error answer (`.code`, `.message`)."""
