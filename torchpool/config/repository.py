"""The model repository: Triton's directory layout, read without loading models.

    <repo>/<model>/config.pbtxt        (or config.json; config.pbtxt wins when
    <repo>/<model>/<version>/model.pt   both exist, as in Triton)

A version directory is named by a positive integer without leading zeros;
other subdirectories (and names starting with 0) are ignored, as Triton does.
`version_policy` selects among them: `latest { num_versions: N }` the N
highest, `all {}` every one, `specific { versions: [...] }` the listed ones
(each must exist).

Every problem is local to its model: `scan_repository` returns an entry with
`error` set for a broken model and goes on with the others. Whether the model
file itself exists is not checked here: the worker reports that, in Triton's
words, when it loads the version.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .model_config import ConfigError, ModelConfig
from .pbtxt import parse_pbtxt

__all__ = ["ModelEntry", "scan_repository", "load_model_entry", "read_config_file"]

CONFIG_FILES = ("config.pbtxt", "config.json")     # in order of preference


@dataclass
class ModelEntry:
    """One model directory as the repository sees it."""

    name: str
    path: Path                      # the model directory
    config: Optional[ModelConfig]   # None when the config failed
    versions: tuple[int, ...]       # versions selected by version_policy, ascending
    error: Optional[str] = None     # why the whole model is UNAVAILABLE (bad config, no version directory, ...)

    def model_file(self, version: int) -> Path:
        """`<path>/<version>/<default_model_filename>` (it may not exist)."""
        filename = self.config.default_model_filename if self.config else "model.pt"
        return self.path / str(version) / filename


def scan_repository(root: Path | str) -> list[ModelEntry]:
    """Every model directory under `root`, sorted by name.

    Hidden entries (".name") and plain files are skipped. Raises `ConfigError`
    only when `root` itself is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"model repository path '{root}' is not a directory")
    try:
        names = sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError as err:
        raise ConfigError(f"model repository path '{root}' cannot be listed: {err.strerror or err}") from None
    return [load_model_entry(root, name) for name in names]


def load_model_entry(root: Path | str, name: str) -> ModelEntry:
    """Read one model's config and version directories; never raises for a
    problem with the model (the entry's `error` says what is wrong)."""
    path = Path(root) / name
    if not _is_plain_name(name):
        return ModelEntry(name, path, None, (), f"invalid model name '{name}'")
    if not path.is_dir():
        return ModelEntry(name, path, None, (), f"model '{name}' not found: no directory {path}")
    try:
        config = _load_config(path, name)
    except ConfigError as err:
        return ModelEntry(name, path, None, (), str(err))
    try:
        versions = select_versions(path, config)
    except ConfigError as err:
        return ModelEntry(name, path, config, (), str(err))
    return ModelEntry(name, path, config, versions)


def _is_plain_name(name: str) -> bool:
    """A single path component: a client-supplied name must not leave the repository."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name and not name.startswith(".")


# --------------------------------------------------------------------------
# Config files
# --------------------------------------------------------------------------

def read_config_file(path: Path) -> dict[str, Any]:
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
    data = read_config_file(config_path)
    declared = data.get("name")
    if declared in (None, ""):
        data["name"] = name
    elif declared != name:
        raise ConfigError(f"{config_path}: unexpected directory name '{name}' for model "
                          f"'{declared}', directory name must equal model name")
    return ModelConfig.from_json(data, str(config_path))


# --------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------

def version_directories(model_dir: Path) -> list[int]:
    """Numeric subdirectories, ascending; "0", "01" and non-numbers are ignored
    (Triton's rule), so `str(version)` is always the directory name."""
    try:
        children = list(model_dir.iterdir())
    except OSError as err:
        raise ConfigError(f"cannot list {model_dir}: {err.strerror or err}") from None
    return sorted(int(child.name) for child in children
                  if child.name.isascii() and child.name.isdigit()
                  and not child.name.startswith("0") and child.is_dir())


def select_versions(model_dir: Path, config: ModelConfig) -> tuple[int, ...]:
    """The versions the policy selects, ascending; `ConfigError` when none can be served."""
    name = config.name
    available = version_directories(model_dir)
    if not available:
        raise ConfigError(f"model '{name}' has no version directories in {model_dir} (at least one "
                          f"version must be available under the version policy of model '{name}')")
    policy = config.version_policy
    if "latest" in policy:
        return tuple(available[-policy["latest"]["num_versions"]:])
    if "all" in policy:
        return tuple(available)
    wanted = policy["specific"]["versions"]
    missing = [v for v in wanted if v not in available]
    if missing:
        raise ConfigError(f"model '{name}': version {missing[0]} is specified for model '{name}', "
                          f"but the version directory is not present in {model_dir}")
    return tuple(wanted)
