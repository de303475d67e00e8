"""The model repository: Triton's directory layout, read without loading models.

    <repo>/<model>/config.pbtxt        (or config.json; config.pbtxt wins when
    <repo>/<model>/<version>/model.pt   both exist, as in Triton)

A version directory is named by a positive integer without leading zeros;
other subdirectories (and names starting with 0) are ignored with a warning
naming each, as Triton does (its warmup, initial_state and configs folders
without one).
`version_policy` selects among them: `latest { num_versions: N }` the N
highest, `all {}` every one, `specific { versions: [...] }` the listed ones
that exist: as in Triton, a listed version without its directory is a
warning (`ModelEntry.warnings`, logged by whoever loads the model) and the
others are served; only when none of them exists is the model unavailable.

Every problem is local to its model: `scan_repository` returns an entry with
`error` set for a broken model and goes on with the others. Every file the
config names (and the config file, each version directory and its model
file) must resolve inside the model directory (paths.py), whoever wrote the
config. Whether the model file itself exists is not checked here: the worker
reports that, in Triton's words, when it loads the version.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

from ..protocol.names import model_name_error, model_name_problem
from .errors import ConfigError
from .jsonvalue import JSONObject
from .unacted import unacted_warning
from .model_config import ModelConfig
from .paths import check_config_file, check_named_files, check_version_paths
from .pbtxt import parse_pbtxt
from .warmup import check_warmup_files

__all__ = ["ModelEntry", "scan_repository", "load_model_entry", "read_config_file"]

CONFIG_FILES = ("config.pbtxt", "config.json")     # in order of preference

# A configuration given with a load request: JSON text, or the parsed object.
Override = Union[str, bytes, Mapping[str, object]]


@dataclass
class ModelEntry:
    """One model directory as the repository sees it."""

    name: str
    path: Path                      # the model directory
    config: Optional[ModelConfig]   # None when the config failed
    versions: tuple[int, ...]       # versions selected by version_policy, ascending
    error: Optional[str] = None     # why the whole model is UNAVAILABLE (bad config, no version directory, ...)
    warnings: tuple[str, ...] = ()  # what deserves a log line at load (a missing specific version,
                                    # an ignored version directory)

    def model_file(self, version: int) -> Path:
        """`<path>/<version>/<default_model_filename>` (it may not exist)."""
        filename = self.config.default_model_filename if self.config else "model.pt"
        return self.path / str(version) / filename


def scan_repository(root: Path | str) -> list[ModelEntry]:
    """Every model directory under `root`, sorted by name.

    Hidden entries (".name") and plain files are skipped. Raises `ConfigError`
    only when `root` itself is not a directory.
    """
    return [load_model_entry(root, name) for name in model_names(root)]


def model_names(root: Path | str) -> list[str]:
    """The names of the model directories under `root`, sorted (hidden
    entries and plain files skipped). Raises `ConfigError` when `root` is
    not a directory or cannot be listed."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"model repository path '{root}' is not a directory")
    try:
        return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError as err:
        raise ConfigError(f"model repository path '{root}' cannot be listed: {err.strerror or err}") from None


def load_model_entry(root: Path | str, name: str, override: Optional[object] = None) -> ModelEntry:
    """Read one model's config and version directories; never raises for a
    problem with the model (the entry's `error` says what is wrong).

    `override` is a configuration given with a load request (a JSON text or
    object, Triton's `config` parameter): it replaces the model's config file.
    """
    path = Path(root) / name
    problem = model_name_problem(name)
    if problem:
        return ModelEntry(name, path, None, (), model_name_error(problem))
    if not path.is_dir():
        return ModelEntry(name, path, None, (), f"model '{name}' not found: no directory {path}")
    try:
        config = _load_config(path, name) if override is None else _override_config(path, name, override)
    except ConfigError as err:
        return ModelEntry(name, path, None, (), str(err))
    ignored: tuple[str, ...] = ()
    try:
        available, ignored = version_directories(path)
        versions, warnings = select_versions(path, config, available)
        check_version_paths(path, config, versions)
    except ConfigError as err:
        return ModelEntry(name, path, config, (), str(err), warnings=ignored)
    unacted = unacted_warning(name, config.raw)
    return ModelEntry(name, path, config, versions,
                      warnings=ignored + warnings + ((unacted,) if unacted else ()))


# --------------------------------------------------------------------------
# Config files
# --------------------------------------------------------------------------

def read_config_file(path: Path) -> JSONObject:
    """The JSON form of a `config.pbtxt` or `config.json` file (not validated)."""
    try:
        text = path.read_text(encoding="utf-8-sig")     # tolerate an editor's BOM
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    if path.suffix == ".pbtxt":
        return parse_pbtxt(text, str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}:{err.colno}: {err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a model configuration must be a JSON object")
    return data


def _load_config(model_dir: Path, name: str) -> ModelConfig:
    """Parse, check the name against the directory, validate."""
    config_path = next((model_dir / f for f in CONFIG_FILES if (model_dir / f).is_file()), None)
    if config_path is None:
        raise ConfigError(f"model '{name}': no config.pbtxt or config.json in {model_dir}")
    check_config_file(model_dir, name, config_path)
    data = read_config_file(config_path)
    declared = data.get("name")
    if declared in (None, ""):
        data["name"] = name
    elif declared != name:
        raise ConfigError(f"{config_path}: unexpected directory name '{name}' for model "
                          f"'{declared}', directory name must equal model name")
    config = ModelConfig.from_json(data, str(config_path))
    check_named_files(model_dir, config, str(config_path))
    check_warmup_files(model_dir, config.warmup, str(config_path))
    return config


def _override_config(model_dir: Path, name: str, override: object) -> ModelConfig:
    """The configuration a load request carries (an Override; a client's
    value, so anything), validated as a config.json is."""
    source = f"load('{name}') config"
    if not isinstance(override, (str, bytes, Mapping)):    # (dict() made a config of a list of pairs)
        raise ConfigError(f"{source}: not a JSON object: {type(override).__name__}")
    try:
        data = json.loads(override) if isinstance(override, (str, bytes)) else dict(override)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{source}: not a JSON object: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a model configuration must be a JSON object")
    data.setdefault("name", name)
    config = ModelConfig.from_json(data, source)
    check_named_files(model_dir, config, source)
    check_warmup_files(model_dir, config.warmup, source)
    return config


# --------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------

# subdirectories of a model that are no versions and no reason to warn (Triton's
# warmup data, initial state and per-model config folders)
NOT_VERSIONS = frozenset({"warmup", "initial_state", "configs"})


def version_directories(model_dir: Path) -> tuple[list[int], tuple[str, ...]]:
    """Numeric subdirectories, ascending; "0", "01" and non-numbers are ignored
    (Triton's rule), so `str(version)` is always the directory name. With the
    warnings naming each ignored directory, in Triton's words
    (model_lifecycle.cc VersionsToLoad)."""
    try:
        children = sorted(model_dir.iterdir())
    except OSError as err:
        raise ConfigError(f"cannot list {model_dir}: {err.strerror or err}") from None
    versions, ignored = [], []
    for child in children:
        name = child.name
        if name in NOT_VERSIONS or not child.is_dir():
            continue
        if name.isascii() and name.isdigit():
            if len(name) > 1 and name.startswith("0"):
                why = "which contains leading zeros in its directory name"
            elif name == "0":
                why = "which is not a positive integer"
            else:
                versions.append(int(name))
                continue
        else:
            why = "which fails to convert to integral number"
        ignored.append(f"ignore version directory {name!r} {why} (model directory {model_dir})")
    return sorted(versions), tuple(ignored)


def select_versions(model_dir: Path, config: ModelConfig, available: Optional[list[int]] = None
                    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The versions the policy selects, ascending, and the warnings about
    listed versions that have no directory; `ConfigError` when none can be served.
    `available`: version_directories(model_dir)'s versions when already read."""
    name = config.name
    if available is None:
        available, _ = version_directories(model_dir)
    if not available:
        raise ConfigError(f"model '{name}' has no version directories in {model_dir} (at least one "
                          f"version must be available under the version policy of model '{name}')")
    policy = config.version_policy
    if "latest" in policy:
        return tuple(available[-policy["latest"]["num_versions"]:]), ()
    if "all" in policy:
        return tuple(available), ()
    wanted = policy["specific"]["versions"]
    present = tuple(v for v in wanted if v in available)
    missing = [v for v in wanted if v not in available]
    if not present:
        listed = ", ".join(str(v) for v in missing)
        raise ConfigError(f"at least one version must be available under the version policy of model "
                          f"'{name}': version {listed} {'is' if len(missing) == 1 else 'are'} specified, "
                          f"but no such version directory is present in {model_dir}")
    warnings = tuple(f"version {v} is specified for model '{name}', but the version directory is not "
                     f"present in {model_dir}; serving {_versions(present)}"
                     for v in missing)
    return present, warnings


def _versions(versions: tuple[int, ...]) -> str:
    return ("version " if len(versions) == 1 else "versions ") + ", ".join(map(str, versions))
