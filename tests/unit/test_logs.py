"""JSON log lines say which model, version and instance a record is about (issue 26, item 9)."""
from __future__ import annotations

import json
import logging

import pytest

from torchpool import logs
from torchpool.logs import JsonFormatter, log_fields, set_process_fields


def record(message: str, **extra: str) -> logging.LogRecord:
    logger = logging.getLogger("torchpool.test")
    return logger.makeRecord(logger.name, logging.INFO, __file__, 1, message, (), None, extra=extra or None)


def test_a_record_about_a_version_or_an_instance_carries_its_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_process_fields", {})
    entry = json.loads(JsonFormatter().format(record("READY", **log_fields("addsub", 1))))
    assert (entry["model"], entry["version"], entry["message"]) == ("addsub", "1", "READY")
    assert "instance" not in entry
    entry = json.loads(JsonFormatter().format(record("restarted", **log_fields("addsub", 1, "addsub_0"))))
    assert entry["instance"] == "addsub_0"
    plain = json.loads(JsonFormatter().format(record("torchpool ready")))
    assert not {"model", "version", "instance"} & set(plain)


def test_every_record_of_a_worker_is_about_its_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_process_fields", {})
    set_process_fields("mlp", 2, "mlp_1")
    entry = json.loads(JsonFormatter().format(record("warm-up batch")))
    assert (entry["model"], entry["version"], entry["instance"]) == ("mlp", "2", "mlp_1")
