"""broker/model_control.py's load (config/repository.py reads its config): a
load request's config is a JSON object or its text; anything else is refused
as not one (a list of pairs made a config, dict() took it). The model stays
listed with why, as for any config that fails."""
from __future__ import annotations

from pathlib import Path

import pytest

from torchpool.broker.model_control import EXPLICIT, ModelControl
from torchpool.broker.registry import Registry
from torchpool.protocol import errors
from torchpool.protocol.errors import TorchpoolError


@pytest.mark.parametrize("config", [5, True, [["name", "m"]], [1, 2]])
def test_a_config_that_is_no_json_object_is_refused(tmp_path: Path, config: object) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    control = ModelControl(Registry([]), str(tmp_path), EXPLICIT, lambda mv: None, lambda mv: None)
    with pytest.raises(TorchpoolError) as refused:
        control.load("m", config, lambda err: None)
    assert refused.value.code == errors.INVALID_ARG
    assert refused.value.message.startswith("failed to load 'm': load('m') config: not a JSON object")
    assert control.registry.models["m"].entry.error.startswith("load('m') config: not a JSON object")
