"""Files a model's configuration names: every one stays inside the model's directory.

The daemon opens these with its own rights (root's, under systemd), and a
load request's `config` is written by a client:

    config.pbtxt | config.json                       <model>/
    each version's directory                         <model>/<version>/
    default_model_filename (a file name, no '/')     <model>/<version>/<file>
    output[i].label_filename                         <model>/<file>
    model_warmup input_data_file                     <model>/warmup/<file>
    sequence_batching state initial_state data_file  <model>/initial_state/<file>
    TORCHPOOL_OP_LIBRARIES, TORCHPOOL_PYTHON_MODULES <model>/<file>

Each must resolve, `..` and symlinks followed, inside the model directory as
resolved. So a model directory that is itself a symlink (a repository of
links into a shared store) works, but nothing in it may point out of it:
not `../../etc/passwd`, not `/etc/passwd`, not a symlink to either, not a
version directory linked to elsewhere. A path that leaves is the model's
load error, naming the model, the field and the path as written; the file
is never opened, so nothing of it (content, size) reaches the caller.

Checked when the broker reads the model (the repository scan, a load), and
the model file again in the worker where it is opened. Between the two, only
someone who can write the repository could swap a file: the repository is
the operator's (docs/security.md).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from ..protocol.names import is_path_component
from .errors import ConfigError
from .parameters import ParameterError, model_parameters
from .warmup import WARMUP_DIRECTORY

if TYPE_CHECKING:
    from .model_config import ModelConfig

__all__ = ["resolved_inside", "leaves_message", "check_config_file", "check_named_files", "check_version_paths"]

INITIAL_STATE_DIRECTORY = "initial_state"


def resolved_inside(model_dir: Path | str, relative: Path | str) -> Optional[Path]:
    """`model_dir / relative` with `..` and symlinks resolved, or None when
    that leaves `model_dir` (itself resolved first) or is no path at all."""
    try:
        base = Path(os.path.realpath(model_dir))
        target = Path(os.path.realpath(os.path.join(model_dir, relative)))
    except (ValueError, OSError):       # a NUL byte, a name the OS refuses
        return None
    return target if target.is_relative_to(base) else None


def leaves_message(model: str, field: str, value: object, model_dir: Path | str) -> str:
    """The one wording of a path that leaves its model's directory."""
    return (f"model '{model}': {field} '{value}' leaves the model directory: every file of a "
            f"model must resolve (symlinks followed) inside {model_dir}")


def check_named_files(model_dir: Path, config: ModelConfig, source: str) -> None:
    """Every file `config` (a ModelConfig) names resolves inside `model_dir`;
    ConfigError naming the first that does not."""
    name = config.default_model_filename
    if not is_path_component(name) or name.startswith("/"):
        raise ConfigError(f"{source}: model '{config.name}': default_model_filename '{name}' must be "
                          f"a file name in each version directory (no '/')")
    for field, written, relative in _named_files(config):
        if not isinstance(written, str) or resolved_inside(model_dir, relative) is None:
            raise ConfigError(f"{source}: {leaves_message(config.name, field, written, model_dir)}")


def check_version_paths(model_dir: Path, config: ModelConfig, versions: tuple[int, ...]) -> None:
    """Each selected version's directory and model file resolve inside
    `model_dir` (whether or not the file exists: the worker says that)."""
    for version in versions:
        for field, relative in (("version directory", str(version)),
                                ("default_model_filename", f"{version}/{config.default_model_filename}")):
            if resolved_inside(model_dir, relative) is None:
                raise ConfigError(leaves_message(config.name, field, relative, model_dir))


def check_config_file(model_dir: Path, name: str, config_path: Path) -> None:
    """The config file itself is the model directory's, not a link out of it."""
    if resolved_inside(model_dir, config_path.name) is None:
        raise ConfigError(leaves_message(name, "configuration file", config_path.name, model_dir))


def _named_files(config: ModelConfig) -> Iterator[tuple[str, object, str]]:
    """(field path, the path as written, the path relative to the model
    directory) of every file the configuration names, in config order."""
    raw = config.raw
    for index, output in enumerate(raw.get("output", ())):
        if output.get("label_filename"):
            yield f"output[{index}].label_filename", output["label_filename"], str(output["label_filename"])
    for index, sample in enumerate(raw.get("model_warmup", ())):
        for key, value in sample.get("inputs", {}).items():
            if "input_data_file" in value:
                yield (f"model_warmup[{index}].inputs[{key!r}].input_data_file", value["input_data_file"],
                       f"{WARMUP_DIRECTORY}/{value['input_data_file']}")
    for index, state in enumerate((raw.get("sequence_batching") or {}).get("state", ())):
        initial = state.get("initial_state") or []
        for position, init in enumerate(initial if isinstance(initial, list) else [initial]):
            if isinstance(init, dict) and init.get("data_file"):
                yield (f"sequence_batching.state[{index}].initial_state[{position}].data_file",
                       init["data_file"], f"{INITIAL_STATE_DIRECTORY}/{init['data_file']}")
    try:
        settings = model_parameters(config)
    except ParameterError:
        return                          # the worker reports a parameter it cannot read
    for key, items in (("TORCHPOOL_OP_LIBRARIES", settings.op_libraries),
                       ("TORCHPOOL_PYTHON_MODULES", settings.python_modules)):
        for item in items:
            yield f"parameters[{key!r}]", item, item
