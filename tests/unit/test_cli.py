"""The CLI takes every default from ServerOptions; logging set-up lives in torchpool.logs."""
from __future__ import annotations

import dataclasses
import json
import logging

from torchpool.broker.options import ServerOptions
from torchpool.cli import build_parser
from torchpool.logs import setup_logging

# ServerOptions fields with no command-line flag (set by code or tests only)
NOT_ON_THE_COMMAND_LINE = {"model_repository", "listen", "worker_shm_limit", "stop_timeout",
                           "max_restarts", "load_models"}


def test_serve_defaults_are_the_server_options_defaults() -> None:
    args = vars(build_parser().parse_args(["serve", "--model-repository", "repo"]))
    checked = 0
    for f in dataclasses.fields(ServerOptions):
        if f.name in NOT_ON_THE_COMMAND_LINE:
            continue
        if f.name in ("local_allow_users", "local_allow_groups", "metrics_config"):
            assert args[f.name] is None and f.default_factory() == []   # repeatable flags
        elif f.name == "log_level":
            assert getattr(logging, args["log_level"].upper()) == f.default
        else:
            assert args[f.name] == f.default, f.name
        checked += 1
    assert checked == len(dataclasses.fields(ServerOptions)) - len(NOT_ON_THE_COMMAND_LINE)


def test_json_logging_carries_the_traceback(capsys) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert setup_logging("warning", "json") == logging.WARNING
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            logging.getLogger("torchpool.worker").error("batch %d failed", 3, exc_info=exc)
        entry = json.loads(capsys.readouterr().err.strip())
        assert entry["message"] == "batch 3 failed" and entry["level"] == "ERROR"
        assert "Traceback" in entry["exception"] and "RuntimeError: boom" in entry["exception"]
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
