"""A request's `version` is checked one way for every op that takes one:
infer (resolve), model_ready, model_metadata, model_config, statistics."""
from __future__ import annotations

from pathlib import Path

import pytest

from torchpool.broker.registry import READY, Registry, parse_version
from torchpool.config import ModelConfig
from torchpool.config.repository import ModelEntry
from torchpool.protocol import errors
from torchpool.protocol.errors import TorchpoolError


def registry() -> Registry:
    config = ModelConfig.from_json({
        "name": "m", "platform": "pytorch_libtorch", "max_batch_size": 4,
        "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": [2]}],
        "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": [2]}]})
    reg = Registry([ModelEntry("m", Path("/nowhere/m"), config, (1, 3))])
    for mv in reg.models["m"].versions.values():
        mv.state = READY
    return reg


def outcome(call) -> object:
    try:
        call()
    except TorchpoolError as exc:
        return exc.code
    return "ok"


OPS = {
    "infer": lambda reg, v: reg.resolve("m", v),
    "model_metadata": lambda reg, v: reg.metadata("m", v),
    "model_config": lambda reg, v: reg.config("m", v),
    "statistics": lambda reg, v: reg.statistics("m", v),
    "model_ready": lambda reg, v: reg.model_ready("m", v),
}


@pytest.mark.parametrize("version, expected", [
    ("", "ok"), (None, "ok"), (-1, "ok"), (0, "ok"), ("1", "ok"), (3, "ok"), ("3", "ok"),
    ("2", errors.NOT_FOUND), (7, errors.NOT_FOUND), ("0", errors.NOT_FOUND),
    ("v1", errors.INVALID_ARG), ("latest", errors.INVALID_ARG), ("-3", errors.INVALID_ARG),
    (-3, errors.INVALID_ARG), (1.0, errors.INVALID_ARG), (True, errors.INVALID_ARG),
    (" 1", errors.INVALID_ARG), ("1_0", errors.INVALID_ARG), ("\u0661", errors.INVALID_ARG),
    ({}, errors.INVALID_ARG), ([1], errors.INVALID_ARG),
])
def test_every_op_checks_the_version_the_same_way(version: object, expected: str) -> None:
    reg = registry()
    got = {op: outcome(lambda: call(reg, version)) for op, call in OPS.items()}
    # model_ready answers False (not an error) for a version that does not exist
    want = {op: expected for op in OPS}
    if expected == errors.NOT_FOUND:
        want["model_ready"] = "ok"
        assert reg.model_ready("m", version) is False
    assert got == want


def test_the_error_texts_match() -> None:
    reg = registry()
    texts = set()
    for op, call in OPS.items():
        if op == "model_ready":
            continue
        with pytest.raises(TorchpoolError) as exc:
            call(reg, 9)
        texts.add(exc.value.message)
    assert texts == {"Request for unknown model: 'm' version 9 is not found"}
    with pytest.raises(TorchpoolError) as exc:
        reg.config("m", "x")
    assert exc.value.message == "invalid version 'x' for model 'm': expected a positive integer"


def test_parse_version() -> None:
    assert parse_version("m", "") is None and parse_version("m", 0) is None
    assert parse_version("m", "12") == 12 and parse_version("m", 12) == 12
    assert [row["version"] for row in registry().statistics("m", "3")["model_stats"]] == ["3"]
    with pytest.raises(TorchpoolError):
        registry().statistics("", "3")           # a version needs its model


@pytest.mark.parametrize("state, reason", [("LOADING", ""), ("UNAVAILABLE", "unable to find 'x'"),
                                           ("UNLOADING", "unloaded")])
def test_a_version_the_model_has_but_cannot_serve_is_not_at_ready_state(state: str, reason: str) -> None:
    """Triton's model_lifecycle.cc: UNAVAILABLE "... is not at ready state" for a
    version that exists in any state but READY; NOT_FOUND only for one that does not."""
    reg = registry()
    mv = reg.models["m"].versions[3]
    mv.state, mv.reason = state, reason
    with pytest.raises(TorchpoolError) as exc:
        reg.resolve("m", 3)
    assert exc.value.code == errors.UNAVAILABLE
    assert exc.value.message == ("Request for unknown model: 'm' version 3 is not at ready state "
                                 f"({state}{': ' + reason if reason else ''})")
    assert reg.resolve("m", None).version == 1 and reg.model_ready("m", 3) is False
