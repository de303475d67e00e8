"""Logging set-up and process titles, shared by the daemon and its workers.

Everything logs to stderr: journald captures it under systemd. Workers are
forked from the daemon's fork server and inherit its stderr, so a worker's
records land in the same stream; `setup_logging` is called again in each
worker with the daemon's level and format (they travel in `WorkerSpec`), so
`--log-format json` gives one JSON object per line for the workers too, and
every record carries the pid of the process that wrote it.

`set_process_title` is how each process names itself in `ps` and top
(`torchpool broker ipc://...`, `torchpool worker addsub v1 #0`): the same
names the log lines use, so an operator can match a pid in one to the other.

This module imports nothing of torchpool: the CLI, the broker and the workers
all use it without pulling each other in.
"""
from __future__ import annotations

import json
import logging
import os
import sys

FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (`--log-format json`).
    A record logged with an exception carries its traceback in `exception`."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
                 "pid": record.process, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str | int, fmt: str = "text") -> int:
    """Send the root logger to stderr at `level` ("info" or logging.INFO)
    in `fmt` ("text" or "json"); returns the numeric level. The text format
    has no timestamp when journald adds its own (JOURNAL_STREAM set)."""
    numeric = level if isinstance(level, int) else getattr(logging, level.upper())
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (expected one of {', '.join(FORMATS)})")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
        handler.setFormatter(logging.Formatter(stamp + "%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    return numeric


def set_process_title(title: str) -> bool:
    """Show `title` as this process's command line (ps, top, /proc/PID/cmdline)
    when `setproctitle` is installed (optional: without it nothing changes);
    True if it was set. SPT_NOENV keeps /proc/PID/environ intact (the title
    then fits in the original command line's length): tools that read a
    process's environment, our tests' leak checks among them, still can."""
    os.environ.setdefault("SPT_NOENV", "1")
    try:
        from setproctitle import setproctitle
    except ImportError:
        return False
    setproctitle(title)
    return True


__all__ = ["FORMATS", "JsonFormatter", "set_process_title", "setup_logging"]
