"""Logging set-up and process titles, shared by the daemon and its workers.

Everything logs to stderr: journald captures it under systemd. Workers are
forked from the daemon's fork server and inherit its stderr, so a worker's
records land in the same stream; `setup_logging` is called again in each
worker with the daemon's level and format (they travel in `WorkerSpec`), so
`--log-format json` gives one JSON object per line for the workers too, and
every record carries the pid of the process that wrote it.

With `--log-format json` a record about a model carries `model`, `version`
and, for one instance, `instance` as fields of its own: every record of a
worker (`set_process_fields`), and the broker's records about a version's or
an instance's life (`extra=log_fields(...)`), so a log shipper can select them
without parsing the message.

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
from typing import Optional

FORMATS = ("text", "json")
FIELDS = ("model", "version", "instance")      # what a JSON record may say it is about

_process_fields: dict[str, str] = {}           # what every record of this process is about


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


# While a model version loads, the broker says "still loading ..." this often,
# so that a long warm-up or compile is not taken for a hang
LOADING_NOTICE_S = _seconds("TORCHPOOL_LOADING_NOTICE_S", 20.0)


def set_process_fields(model: str, version: object, instance: str) -> None:
    """Every JSON record of this process is about this instance (a worker's)."""
    _process_fields.update(log_fields(model, version, instance))


def log_fields(model: str, version: object, instance: Optional[str] = None) -> dict[str, str]:
    """`extra=` of a record about a model version (and one of its instances)."""
    fields = {"model": model, "version": str(version)}
    if instance is not None:
        fields["instance"] = instance
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (`--log-format json`).
    A record logged with an exception carries its traceback in `exception`;
    one about a model, its `model`, `version` (and `instance`)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
                 "pid": record.process, "message": record.getMessage(), **_process_fields}
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value
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


__all__ = ["FIELDS", "FORMATS", "LOADING_NOTICE_S", "JsonFormatter", "log_fields", "set_process_fields",
           "set_process_title", "setup_logging"]
