"""Which kind of model file a version holds, told from the archive itself, and
loading it.

Every PyTorch model file is a zip archive under one root directory; what is
inside says what wrote it:

    <root>/code/..., <root>/constants.pkl     torch.jit.save           TorchScript
    <root>/models/<name>.json                 torch.export.save        ExportedProgram
    <root>/data/aotinductor/<name>/...        aoti_compile_and_package AOTInductor package
    <root>/data.pkl only                      torch.save               refused: pickled Python

The file name does not decide (`model.pt` may hold an exported program),
except for a file that is not a zip at all: a `.pt2` gets torchpool's
message, anything else torch.jit.load's, which is Triton's. The file name
is `default_model_filename` as usual; when that is the default `model.pt`
and the version directory has no `model.pt` but a `model.pt2`, the
`model.pt2` is served, so a PyTorch 2 model needs no config line for it.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from torchpool.config.model_config import ModelConfig
from torchpool.protocol.errors import INTERNAL, INVALID_ARG, UNAVAILABLE
from torchpool.worker.aoti import load_aoti
from torchpool.worker.binding import Binding
from torchpool.worker.exported import load_exported
from torchpool.worker.settings import ExecutionSettings, ModelLoadError
from torchpool.worker.torchscript import load_torchscript

TORCHSCRIPT = "TorchScript"
EXPORTED_PROGRAM = "ExportedProgram"
AOTI_PACKAGE = "AOTInductor package"

DEFAULT_FILENAME = "model.pt"
PT2_FILENAME = "model.pt2"


@dataclass
class LoadedModel:
    """A loaded model instance: what runs a batch, and how.

    `module` is what `binding.run` calls. `weights` is the nn.Module whose
    parameters and buffers hold the weights (for ENABLE_WEIGHT_SHARING), None
    when the format keeps them out of reach (AOTInductor). `source` is what a
    compiler starts from (the ExportedProgram's module, the ScriptModule).
    """

    format: str
    path: Path
    module: Callable[..., object]
    binding: Binding
    weights: Optional[torch.nn.Module]
    source: Optional[torch.nn.Module]


def resolve_model_file(model_path: Path | str) -> Path:
    """The file to load: `model_path`, or `model.pt2` beside a missing default `model.pt`."""
    path = Path(model_path)
    if not path.exists() and path.name == DEFAULT_FILENAME:
        alternative = path.with_name(PT2_FILENAME)
        if alternative.is_file():
            return alternative
    return path


def detect_format(model_name: str, path: Path) -> str:
    """TORCHSCRIPT, EXPORTED_PROGRAM or AOTI_PACKAGE, from the archive's entries."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.namelist()
    except zipfile.BadZipFile:
        if path.suffix != ".pt2":
            # torch.jit.load says it in the words Triton's users know
            # ("PytorchStreamReader failed reading zip archive")
            return TORCHSCRIPT
        raise ModelLoadError(f"failed to load model '{model_name}': '{path.name}' is not a PyTorch "
                             f"model archive (not a zip file: truncated, or not written by "
                             f"torch.jit.save, torch.export.save or aoti_compile_and_package)",
                             INTERNAL) from None
    except OSError as exc:
        raise ModelLoadError(f"failed to load model '{model_name}': cannot read '{path.name}': "
                             f"{exc.strerror or exc}", UNAVAILABLE) from None
    inner = {name.partition("/")[2] for name in entries}
    if any(name.startswith("data/aotinductor/") for name in inner):
        return AOTI_PACKAGE
    if any(name.startswith("models/") and name.endswith(".json") for name in inner):
        return EXPORTED_PROGRAM
    if "constants.pkl" in inner or any(name.startswith("code/") for name in inner):
        return TORCHSCRIPT
    if "data.pkl" in inner:
        raise ModelLoadError(f"failed to load model '{model_name}': '{path.name}' was written by "
                             f"torch.save (pickled Python objects), which a server does not run; "
                             f"save the model with torch.export.save (or torch.jit.save)",
                             INVALID_ARG)
    raise ModelLoadError(f"failed to load model '{model_name}': '{path.name}' is a zip archive but "
                         f"not a TorchScript module, an ExportedProgram or an AOTInductor package",
                         INVALID_ARG)


def load_model(
    config: ModelConfig,
    model_path: Path | str,
    device: Optional[torch.device],
    instance_name: str,
    settings: ExecutionSettings,
) -> LoadedModel:
    """Load the version's model file onto `device` (None: KIND_MODEL, the
    model places its tensors) and bind it to `config`."""
    path = resolve_model_file(model_path)
    if not path.is_file():
        raise ModelLoadError(
            f"unable to find '{path}' for model instance '{instance_name}'", UNAVAILABLE)
    kind = detect_format(config.name, path)
    if kind == TORCHSCRIPT:
        module, binding = load_torchscript(config, path, device, settings)
        return LoadedModel(kind, path, module, binding, module, module)
    if kind == EXPORTED_PROGRAM:
        program, binding = load_exported(config, path, device, settings)
        return LoadedModel(kind, path, program, binding, program, program)
    runner, binding = load_aoti(config, path, device)
    return LoadedModel(kind, path, runner, binding, None, None)


__all__ = [
    "AOTI_PACKAGE", "EXPORTED_PROGRAM", "LoadedModel", "TORCHSCRIPT", "detect_format",
    "load_model", "resolve_model_file",
]
