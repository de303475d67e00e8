"""Error codes and the exception that carries one.

The codes are Triton's (KServe's) status names, plus one of torchpool's own:
`SESSION_LOST`, answered to a request that names a shared-memory session the
daemon no longer knows (its lease expired, the daemon restarted). A client
recognises it by the code, never by the message text, and says hello again.
`CANCELLED` is raised by the client library itself (a call on a closed
client); so is `DEADLINE_EXCEEDED` (the daemon is reachable but did not
answer within the caller's time limit; the request may still run). A
client that reaches no daemon at all says `UNAVAILABLE`. `UNKNOWN` stands
in for an error answer that carries no code.
"""
from __future__ import annotations

INVALID_ARG = "INVALID_ARG"
NOT_FOUND = "NOT_FOUND"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
UNSUPPORTED = "UNSUPPORTED"
ALREADY_EXISTS = "ALREADY_EXISTS"
UNKNOWN = "UNKNOWN"
CANCELLED = "CANCELLED"
SESSION_LOST = "SESSION_LOST"
# A client went over one of its limits (sessions, arena bytes, regions,
# requests in flight, unread replies, BYTES size): gRPC's and KServe's name.
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
# The daemon was reachable but did not answer in time (gRPC's and KServe's name).
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"

CODES = frozenset({INVALID_ARG, NOT_FOUND, UNAVAILABLE, INTERNAL, UNSUPPORTED, ALREADY_EXISTS,
                   UNKNOWN, CANCELLED, SESSION_LOST, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED})


class TorchpoolError(Exception):
    """An error with a code; what the server answers and the client raises."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class InferenceError(TorchpoolError):
    """Raised by the client library for every error answer (`.code`, `.message`)."""
