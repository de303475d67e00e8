"""The gateway process's event loop (process._run)."""
from __future__ import annotations

import asyncio
import sys

import pytest

from torchpool.gateway import process


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_the_gateway_runs_on_uvloop() -> None:
    pytest.importorskip("uvloop")
    assert process._run(_loop_module()).startswith("uvloop")


def test_the_gateway_runs_on_uvloop_under_python_3_10(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.10 (setup.cfg's python_requires) has no asyncio.Runner: the
    gateway used it whenever uvloop was installed, and stopped at its start
    with an AttributeError."""
    pytest.importorskip("uvloop")
    monkeypatch.delattr(asyncio, "Runner", raising=False)
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    try:
        assert process._run(_loop_module()).startswith("uvloop")
    finally:
        asyncio.set_event_loop_policy(None)
