"""Exit statuses of the command line, and the one-line error that goes with each.

One owner for the numbers: `torchpool serve --help` prints `EXIT_STATUS_HELP`,
the systemd unit's RestartPreventExitStatus= names the ones a restart cannot
fix, and the tests use these constants.

A failure the user can fix is one line on stderr, `torchpool: error: <what>`,
naming the flag and value at fault, and no traceback. A traceback is kept
for what the user cannot fix: a bug (exit status 1).
"""
from __future__ import annotations

import logging
import os
import select
import sys
from typing import Callable

OK = 0
FAILURE = 1          # serve: an unexpected error (a bug: the traceback says where);
                     # client commands: the server answered with an error, or could not be reached
USAGE = 2            # a bad flag or value (argparse's own status), unusable keys or settings
REPOSITORY = 3       # --model-repository is missing, not a directory, or unreadable
ADDRESS = 4          # an address or port cannot be bound (--listen, --metrics-port, --http-port, --grpc-port)
MODEL_LOAD = 5       # a model failed to load at startup, with --exit-on-error
GATEWAY = 6          # the HTTP/gRPC gateway process could not start for another reason
READER_GONE = 128 + 13   # client commands: stdout's reader went away (`torchpool stats | head`),
                         # the status a shell shows for a program SIGPIPE ended

EXIT_STATUSES: tuple[tuple[int, str], ...] = (
    (OK, "stopped cleanly (SIGTERM, SIGINT)"),
    (FAILURE, "unexpected error (a bug: a traceback follows)"),
    (USAGE, "bad usage: a flag or value is wrong (URL, key files, --metrics-config)"),
    (REPOSITORY, "--model-repository is missing, not a directory, or unreadable"),
    (ADDRESS, "an address or port cannot be bound: --listen, --metrics-port, --http-port, --grpc-port"),
    (MODEL_LOAD, "a model failed to load at startup (--exit-on-error)"),
    (GATEWAY, "the HTTP/gRPC gateway process could not start"),
)

EXIT_STATUS_HELP = "exit statuses:\n" + "\n".join(f"  {code}  {what}" for code, what in EXIT_STATUSES) + \
    "\nan error is one line on stderr: 'torchpool: error: <what>'"


class CliError(Exception):
    """A failure the user can fix: its exit status and its one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def until_the_reader_goes(command: Callable[[], int]) -> int:
    """`command()`'s exit status, or READER_GONE with no traceback when stdout's
    reader went away (`torchpool stats | head`: it has what it wanted). stdout
    is flushed here, not at exit, so that this is seen wherever it happens."""
    try:
        status = command()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise                      # another pipe (a bug): its traceback says where
        devnull = os.open(os.devnull, os.O_WRONLY)   # what is still buffered is dropped at exit
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return READER_GONE


def _stdout_reader_gone() -> bool:
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), 0)       # POLLERR comes whatever is asked for
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):                    # no stdout at all
        return False


def report(message: str, log_format: str = "text") -> None:
    """The one line of a failure. With --log-format json it is a JSON log
    record (the ERROR level, the same text), so a log shipper reads it too."""
    line = f"torchpool: error: {message}"
    if log_format == "json" and logging.getLogger().handlers:
        logging.getLogger("torchpool").error("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)


__all__ = ["ADDRESS", "EXIT_STATUSES", "EXIT_STATUS_HELP", "FAILURE", "GATEWAY", "MODEL_LOAD", "OK",
           "READER_GONE", "REPOSITORY", "USAGE", "CliError", "report", "until_the_reader_goes"]
