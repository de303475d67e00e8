"""The part of an error text a client should see (and a load failure reports)."""
from __future__ import annotations

_TORCHSCRIPT_PREAMBLE = "The following operation failed in the TorchScript interpreter."


def client_text(message: object) -> str:
    """The part of an error text a client should see: one line, no traceback.

    TorchScript errors embed the interpreter's preamble, two tracebacks with
    the model's source and the server's file paths, and end with the Python
    exception line (`builtins.RuntimeError: boom`). Keep what comes before
    the preamble (e.g. "PyTorch execute failure: ") and that exception line;
    of any other text keep its first line (torch's own errors list
    registration sites with server paths on the lines after it). The whole
    text goes to the daemon's log with the traceback. (Paths left in that
    line are cut down where every error answer is made: messages.hide_paths.)
    `message` may be an exception: its text is used.
    """
    message = str(message)
    lines = message.splitlines()
    if len(lines) <= 1:
        return message
    head = lines[0]
    if not any(line.startswith("Traceback") for line in lines):
        return head
    prefix = head.partition(_TORCHSCRIPT_PREAMBLE)[0] if _TORCHSCRIPT_PREAMBLE in head else ""
    in_traceback = False
    found = ""
    for line in lines:
        if line.startswith("Traceback"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            found = line            # the first unindented line after a traceback
            in_traceback = False
    if not found:
        return head if _TORCHSCRIPT_PREAMBLE not in head else prefix.rstrip() or head
    return prefix + found.removeprefix("builtins.")


__all__ = ["client_text"]
