"""The model registry: what the repository holds and the state of each version."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypedDict

from ..config import ModelConfig, ModelEntry
from ..config.normalize import PLATFORM
from ..protocol import errors
from ..protocol.errors import TorchpoolError
from ..protocol.names import check_model_name
from .stats import VersionStats



class _Named(TypedDict):
    name: str


class IndexRow(_Named, total=False):
    """A row of Triton's repository index: a model directory by name, with
    the version, state and reason of each version the registry holds."""

    version: str
    state: str
    reason: str


# told once a load or an unload settles: None, or why it failed (model_control.Waiter)
Waiter = Callable[[Optional[TorchpoolError]], None]

log = logging.getLogger("torchpool.broker")

LOADING = "LOADING"
READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
UNLOADING = "UNLOADING"       # retired: finishing its requests, then its workers stop


@dataclass(eq=False)
class ModelVersion:
    """One loaded (or loading, or failed) version of a model with its instances."""

    name: str
    version: int
    config: ModelConfig
    model_file: str
    state: str = LOADING
    reason: str = ""
    # What runs it, attached by the server when its workers start. The
    # registry holds records and imports neither: `scheduler` is a
    # schedulers.base.Scheduler, `workers` / `idle` are supervisor.WorkerHandles
    # (Any: naming them here would tie the registry to the modules above it; tests/unit/test_import_graph.py).
    scheduler: Any = None
    workers: list[Any] = field(default_factory=list)
    idle: deque[Any] = field(default_factory=deque)
    deferred: list[tuple[str, str]] = field(default_factory=list)   # (instance, device) not yet started
    stats: VersionStats = field(default_factory=VersionStats)
    consecutive_crashes: int = 0      # worker crashes since the last successful execution

    @property
    def serving(self) -> bool:
        """READY, and at least one instance is alive to run requests now."""
        return self.state == READY and any(w.state in ("IDLE", "BUSY") for w in self.workers)

    @property
    def label(self) -> str:
        return f"model '{self.name}' version {self.version}"

    def fail(self, reason: str) -> None:
        self.state = UNAVAILABLE
        self.reason = reason


@dataclass(eq=False)
class Generation:
    """A (re)load in progress: new versions loading beside the serving ones."""

    entry: ModelEntry
    fingerprint: str
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    waiters: list[Waiter] = field(default_factory=list)     # answered when settled

    def settled(self) -> bool:
        return all(mv.state != LOADING for mv in self.versions.values())


@dataclass(eq=False)
class Model:
    name: str
    entry: ModelEntry
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    pending: Optional[Generation] = None
    unloaded: bool = False
    fingerprint: str = ""
    unload_waiters: list[Waiter] = field(default_factory=list)
    # versions it had that a reload or an unload took away: Triton keeps them
    # (UNAVAILABLE), so a request naming one is "not at ready state", not "not found"
    former: set[int] = field(default_factory=set)

    @property
    def error(self) -> Optional[str]:
        return self.entry.error

    def ready_versions(self) -> list[int]:
        return sorted(v for v, mv in self.versions.items() if mv.state == READY)


def new_versions(entry: ModelEntry) -> dict[int, ModelVersion]:
    if entry.error is not None or entry.config is None:
        return {}
    return {v: ModelVersion(entry.name, v, entry.config, str(entry.model_file(v))) for v in entry.versions}


class Registry:
    def __init__(self, entries: list[ModelEntry]) -> None:
        self.models: dict[str, Model] = {}
        self.retiring: list[ModelVersion] = []
        for entry in entries:
            self.models[entry.name] = Model(entry.name, entry, new_versions(entry))
            for warning in entry.warnings:      # what loads anyway, as Triton logs it
                log.warning("%s", warning)

    def ready_counts(self) -> tuple[str, str]:
        """('3 of 4 model versions', ', 1 models failed to load' or ''); reloads and retirees aside."""
        versions = [mv for m in self.models.values() for mv in m.versions.values()]
        ready = sum(1 for mv in versions if mv.state == READY)
        broken = sum(1 for m in self.models.values() if m.error)
        return f"{ready} of {len(versions)} model versions", f", {broken} models failed to load" if broken else ""

    def all_versions(self) -> list[ModelVersion]:
        """Every version with workers: serving, loading beside them, or retiring."""
        found: list[ModelVersion] = []
        for m in self.models.values():
            found.extend(m.versions.values())
            if m.pending is not None:
                found.extend(m.pending.versions.values())
        return found + self.retiring

    def model_of(self, mv: ModelVersion) -> Optional[Model]:
        return self.models.get(mv.name)

    # --- lookups used by requests ------------------------------------------

    def model(self, name: object) -> Model:
        model = self.models.get(name) if isinstance(name, str) else None
        if model is None:
            check_model_name(name)      # a name no model can have is INVALID_ARG, never echoed
            raise TorchpoolError(errors.NOT_FOUND, f"Request for unknown model: '{name}' is not found")
        return model

    def version_of(self, model: Model, version: object) -> Optional[int]:
        """The version a request names, checked the same way for every op
        (infer, model_ready, model_metadata, model_config, statistics): None
        for "the highest ready one"; INVALID_ARG when it is not a version
        number; NOT_FOUND when the model never had such a version; UNAVAILABLE
        (Triton's "not at ready state") for one it had that was unloaded."""
        wanted = parse_version(model.name, version)
        if wanted is not None and wanted not in model.versions:
            if wanted in model.former:
                raise not_ready(model.name, wanted, "unloaded")
            raise TorchpoolError(errors.NOT_FOUND,
                                 f"Request for unknown model: '{model.name}' version {wanted} is not found")
        return wanted

    def resolve(self, name: object, version: object) -> ModelVersion:
        """The version a request addresses; the highest ready one when unspecified."""
        model = self.model(name)
        wanted = parse_version(name, version)   # malformed: INVALID_ARG before anything else
        if model.error:
            raise TorchpoolError(errors.UNAVAILABLE, f"model '{name}' is not available: {model.error}")
        if model.unloaded and wanted is None:
            # Triton's ModelLifeCycle::GetModel for the latest version of a model it
            # unloaded (explicitly, or removed from a polled repository): NOT_FOUND
            raise TorchpoolError(errors.NOT_FOUND, f"Request for unknown model: '{name}' has no available versions")
        if wanted is None:
            best = None      # the highest ready version (a loop: this runs for every request)
            for v, mv in model.versions.items():
                if mv.state == READY and (best is None or v > best.version):
                    best = mv
            if best is None:
                reasons = "; ".join(f"version {v}: {mv.state.lower()}{' - ' + mv.reason if mv.reason else ''}"
                                    for v, mv in sorted(model.versions.items()))
                raise TorchpoolError(errors.UNAVAILABLE,
                                     f"model '{name}' has no ready version ({reasons})")
            return best
        self.version_of(model, version)         # NOT_FOUND when the model never had such a version
        mv = model.versions[wanted]
        if mv.state != READY:                   # loading, failed or unloading
            raise not_ready(name, wanted, f"{mv.state}: {mv.reason}" if mv.reason else mv.state)
        return mv

    # --- control calls --------------------------------------------------------

    def server_ready(self) -> bool:
        """Strict readiness, as Triton's default: every model's versions are READY."""
        return all(m.error is None and m.versions and
                   all(mv.serving for mv in m.versions.values())
                   for m in self.server_ready_models())

    def loading(self) -> bool:
        return any(mv.state == LOADING for mv in self.all_versions())

    def server_ready_models(self) -> list[Model]:
        return [m for m in self.models.values() if not m.unloaded]

    def model_ready(self, name: object, version: object) -> bool:
        """Ready means a live worker can run it now (not only that it loaded)."""
        parse_version(name, version)     # a malformed version is an error, as for every op
        if not (isinstance(name, str) and name in self.models):
            check_model_name(name)
        try:
            return self.resolve(name, version).serving
        except TorchpoolError:
            return False

    def statistics(self, name: object, version: object) -> dict[str, object]:
        """Triton's statistics: {"model_stats": [...]} for one model or all."""
        if name in (None, ""):
            if parse_version(name, version) is not None:
                raise TorchpoolError(errors.INVALID_ARG, "statistics of a version need the model's name")
            versions = self.all_versions()
        else:
            model = self.model(name)
            wanted = self.version_of(model, version)
            versions = [mv for v, mv in sorted(model.versions.items()) if wanted is None or v == wanted]
        return {"model_stats": [mv.stats.to_triton(mv.name, mv.version, mv.workers) for mv in versions]}

    def repository_index(self) -> list[IndexRow]:
        index: list[IndexRow] = []
        for name in sorted(self.models):
            model = self.models[name]
            if model.error or model.unloaded or not model.versions:
                index.append({"name": name, "version": "", "state": UNAVAILABLE,
                              "reason": model.error or ("unloaded" if model.unloaded else "no versions")})
                continue
            for v, mv in sorted(model.versions.items()):
                index.append({"name": name, "version": str(v), "state": mv.state, "reason": mv.reason})
        return index

    def metadata(self, name: object, version: object) -> dict[str, object]:
        model = self.model(name)
        if model.entry.config is None:
            raise TorchpoolError(errors.UNAVAILABLE, f"model '{name}' is not available: {model.error}")
        wanted = self.version_of(model, version)
        cfg = model.entry.config
        batch = [-1] if cfg.max_batch_size > 0 else []
        versions = [str(wanted)] if wanted is not None else [str(v) for v in model.ready_versions()]
        return {
            "name": name,
            "versions": versions,
            "platform": PLATFORM,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": batch + list(t.dims)}
                       for t in cfg.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": batch + list(t.dims)}
                        for t in cfg.outputs],
        }

    def config(self, name: object, version: object) -> dict[str, object]:
        model = self.model(name)
        if model.entry.config is None:
            raise TorchpoolError(errors.UNAVAILABLE, f"model '{name}' is not available: {model.error}")
        self.version_of(model, version)
        return model.entry.config.raw


def not_ready(name: object, version: int, why: str) -> TorchpoolError:
    """A version the model has (or had) that cannot serve: Triton's UNAVAILABLE
    and its text (model_lifecycle.cc), then torchpool's state and reason."""
    return TorchpoolError(errors.UNAVAILABLE, f"Request for unknown model: '{name}' version {version} "
                                              f"is not at ready state ({why})")


def parse_version(name: object, version: object) -> Optional[int]:
    """A request's `version` field: None (the highest ready version) for nil,
    "", 0 or -1; else a non-negative integer, given as an int or as a string
    of decimal digits. Anything else (a float, a bool, "v1", " 1", "1_0", a
    list) is INVALID_ARG."""
    if version is None or (isinstance(version, (int, str)) and not isinstance(version, bool)
                           and version in ("", 0, -1)):
        return None
    if isinstance(version, int) and not isinstance(version, bool) and version > 0:
        return version
    if isinstance(version, str) and version.isascii() and version.isdigit():
        return int(version)
    raise TorchpoolError(errors.INVALID_ARG,
                         f"invalid version {version!r} for model '{name}': expected a positive integer")
