"""Warm-up batches (worker/warmup.py) and the compile parameters (settings.py),
against configs parsed from text as a worker gets them."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from torchpool.config.model_config import ModelConfig
from torchpool.config.pbtxt import parse_pbtxt
from torchpool.protocol import datatypes
from torchpool.worker.settings import ExecutionSettings, ModelLoadError, compile_settings, grad_context
from torchpool.worker.torchscript import bind
from torchpool.worker.warmup import compile_batches, run_warmup, sample_inputs

SETTINGS = ExecutionSettings()


def parsed(text: str) -> ModelConfig:
    return ModelConfig.from_json(parse_pbtxt(text, "config.pbtxt"), "config.pbtxt")


BATCHED = """
name: "m" backend: "pytorch" max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
        { name: "INPUT__1" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
model_warmup [
  { name: "file" batch_size: 3 count: 2
    inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "x.bin" } }
    inputs { key: "INPUT__1" value: { data_type: TYPE_INT32 dims: [ 5 ] random_data: true } } },
  { name: "zeros" batch_size: 1
    inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
    inputs { key: "INPUT__1" value: { data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } } }
]
"""


def test_samples_are_repeated_to_their_batch_size_and_reshaped(tmp_path: Path) -> None:
    config = parsed(BATCHED)
    (tmp_path / "warmup").mkdir()
    # Triton reads the bytes it needs from the file and ignores the rest
    (tmp_path / "warmup" / "x.bin").write_bytes(np.arange(5, dtype=np.float32).tobytes())
    file_sample, zero_sample = config.warmup
    inputs = sample_inputs(config, tmp_path, file_sample)
    assert inputs["INPUT__0"].shape == (3, 2, 2)
    assert inputs["INPUT__0"][2].reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert inputs["INPUT__1"].shape == (3, 5) and inputs["INPUT__1"].dtype == torch.int32
    assert (inputs["INPUT__1"] == inputs["INPUT__1"][0]).all()       # one sample, repeated
    zeros = sample_inputs(config, tmp_path, zero_sample)
    assert zeros["INPUT__0"].shape == (1, 2, 2) and not zeros["INPUT__0"].any()


def test_a_short_file_names_the_input_the_file_and_the_bytes(tmp_path: Path) -> None:
    config = parsed(BATCHED)
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "x.bin").write_bytes(b"\0" * 12)
    with pytest.raises(ModelLoadError) as info:
        sample_inputs(config, tmp_path, config.warmup[0])
    assert "input 'INPUT__0': warm-up file 'x.bin' holds 12 bytes, but FP32 [4] needs 16" in info.value.message


STRINGS = """
name: "s" backend: "pytorch" max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ 3 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ 3 ] } ]
model_warmup [ { name: "words" batch_size: 1
  inputs { key: "INPUT__0" value: { data_type: TYPE_STRING dims: [ 3 ] input_data_file: "w.bin" } } } ]
"""


class Upper(torch.nn.Module):
    def forward(self, words: list[str]) -> list[str]:
        return [w.upper() for w in words]


def scripted(module: torch.nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.script(module)


def test_string_samples_come_from_length_prefixed_files_and_run(tmp_path: Path) -> None:
    config = parsed(STRINGS)
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "w.bin").write_bytes(datatypes.encode_bytes(["a", "bc", "déf"]))
    assert sample_inputs(config, tmp_path, config.warmup[0]) == {"INPUT__0": ["a", "bc", "déf"]}
    module = scripted(Upper())
    with grad_context(SETTINGS):
        assert run_warmup(config, tmp_path, module, bind(module, config)) == 1


class RefusesZeros(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 0).all()):
            raise RuntimeError("zeros are not allowed")
        return x


FAILS = """
name: "f" backend: "pytorch" max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
model_warmup [ { name: "ones" batch_size: 2 count: 3
                 inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 2 ] random_data: true } } },
               { name: "zeros" batch_size: 1
                 inputs { key: "INPUT__0" value: { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true } } } ]
"""


def test_a_failing_sample_fails_the_load_with_the_models_own_words(tmp_path: Path) -> None:
    config = parsed(FAILS)
    module = scripted(RefusesZeros())
    with grad_context(SETTINGS), pytest.raises(ModelLoadError) as info:
        run_warmup(config, tmp_path, module, bind(module, config))
    assert info.value.message == ("failed to load model 'f': warm-up sample 'zeros' failed: PyTorch "
                                  "execute failure: RuntimeError: zeros are not allowed")


SEQUENCE = """
name: "q" backend: "pytorch" max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] } ]
sequence_batching {
  control_input [ { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
                  { name: "CORRID__2" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_INT64 } ] } ]
  state [ { input_name: "STATE__3" output_name: "STATE__1" data_type: TYPE_FP32 dims: [ 2 ] } ]
}
"""


def test_compile_batches_cover_batch_two_dynamic_then_one_with_sequence_fillers() -> None:
    config = parsed(SEQUENCE)

    class Model(torch.nn.Module):
        def forward(self, x, start, corrid, state):
            return x, state
    binding = bind(scripted(Model()), config)
    two, one = compile_batches(config, binding)
    assert two["INPUT__0"].shape == (2, 2) and one["INPUT__0"].shape == (1, 1)
    assert two["INPUT__0"]._dynamo_dynamic_indices == {0, 1}     # batch and the -1 dimension
    assert two["START__1"].dtype == torch.int32 and two["START__1"].shape == (2, 1)
    assert two["CORRID__2"].dtype == torch.int64
    assert two["STATE__3"].shape == (2, 2) and one["STATE__3"].shape == (1, 2)


def test_compile_parameters() -> None:
    def with_parameters(**parameters: str):
        text = "name: \"c\" backend: \"pytorch\" max_batch_size: 1\n" \
               "input [ { name: \"x\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n" \
               "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n"
        text += "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                        for k, v in parameters.items())
        return compile_settings(parsed(text))

    assert with_parameters().enabled is False
    on = with_parameters(TORCH_COMPILE="On", TORCH_COMPILE_MODE="max-autotune")
    assert on.enabled and on.mode == "max-autotune"
    with pytest.raises(ModelLoadError) as info:
        with_parameters(TORCH_COMPILE="yes")
    assert "failed to convert 'yes' to boolean for parameter 'TORCH_COMPILE'" in info.value.message
    with pytest.raises(ModelLoadError) as info:
        with_parameters(TORCH_COMPILE="true", TORCH_COMPILE_MODE="fast")
    assert "TORCH_COMPILE_MODE" in info.value.message and "reduce-overhead" in info.value.message
