"""Model control, as Triton's --model-control-mode none | poll | explicit.

A (re)load brings the new versions up beside the serving ones (a
`Generation`); when every new version has settled, the ready ones are
swapped in at once and the old ones retire: they finish what they have
queued and in flight, then their workers stop. So no request is dropped
during a reload. If nothing of the new generation loads, the old versions
keep serving. An unload retires every version and answers once they are
drained. In `poll` mode the repository is rescanned every few seconds (and on
SIGHUP); a model whose files changed is reloaded, a new one loaded, a removed
one unloaded.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Callable, Optional

from ..config import ConfigError, load_model_entry
from ..config.repository import model_names
from ..protocol import errors, internal
from ..protocol.errors import TorchpoolError
from ..protocol.names import check_model_name
from .registry import READY, UNLOADING, Generation, IndexRow, Model, ModelVersion, Registry, new_versions

log = logging.getLogger("torchpool.broker")

NONE, POLL, EXPLICIT = "none", "poll", "explicit"

Waiter = Callable[[Optional[TorchpoolError]], None]


def _is_model_directory(path: Path) -> bool:
    """Does `path` name a directory (False for a name the OS refuses: too long, a NUL)?"""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def fingerprint(model_dir: Path) -> str:
    """What a reload depends on: the config bytes and every version's files."""
    h = hashlib.sha1()
    try:
        for path in sorted(model_dir.rglob("*")):
            if path.is_file():
                st = path.stat()
                h.update(f"{path.relative_to(model_dir)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
                if path.suffix in (".pbtxt", ".json"):
                    h.update(path.read_bytes())
    except OSError:
        return ""
    return h.hexdigest()


class ModelControl:
    def __init__(self, registry: Registry, root: str, mode: str, start_version: Callable[[ModelVersion], None],
                 version_gone: Callable[[ModelVersion], None]) -> None:
        self.registry = registry
        self.root = Path(root)
        self.mode = mode
        self.start_version = start_version      # its workers start (Server.start_version)
        self.version_gone = version_gone        # a retired version's workers are all gone

    # --- requests from clients ------------------------------------------

    def check_explicit(self, op: str) -> None:
        if self.mode != EXPLICIT:
            # Triton's text and code in every mode but explicit (none included):
            # ModelRepositoryManager::LoadUnloadModel
            raise TorchpoolError(errors.UNAVAILABLE,
                                 "explicit model load / unload is not allowed if polling is enabled")

    def load(self, name: object, config: object, waiter: Waiter) -> None:
        name = check_model_name(name)
        entry = load_model_entry(self.root, name, config)
        for warning in entry.warnings:          # what loads anyway, as Triton logs it
            log.warning("%s", warning)
        model = self.registry.models.get(name)
        if entry.error is not None:
            # a model of the repository that fails stays listed, with why; a name
            # that is no model directory leaves nothing behind (Triton's index)
            if (model is None or not model.versions) and _is_model_directory(entry.path):
                self.registry.models[name] = Model(name, entry, fingerprint=fingerprint(entry.path))
            raise TorchpoolError(errors.INVALID_ARG if config is not None else errors.UNAVAILABLE,
                                 f"failed to load '{name}': {entry.error}")
        if model is not None and model.pending is not None:
            model.pending.waiters.append(waiter)      # the same load is already under way
            return
        if model is None:
            model = self.registry.models[name] = Model(name, entry, unloaded=True)
        gen = Generation(entry, fingerprint(entry.path), new_versions(entry), [waiter])
        if not gen.versions:
            raise TorchpoolError(errors.UNAVAILABLE, f"failed to load '{name}': no version to load")
        model.pending = gen
        log.info("loading model '%s' versions %s", name, sorted(gen.versions))
        for mv in gen.versions.values():
            self.start_version(mv)

    def repository_index(self) -> list[IndexRow]:
        """The registry's models and versions, and in explicit mode, as
        Triton lists them, every other model directory of the repository
        (by name only: never loaded)."""
        index = self.registry.repository_index()
        if self.mode == EXPLICIT:
            listed = {row["name"] for row in index}
            try:
                names = model_names(self.root)
            except ConfigError:        # the repository went away: what is loaded is what there is
                names = []
            index += [{"name": name} for name in names if name not in listed]
            index.sort(key=lambda row: row["name"])
        return index

    def unload(self, name: object, waiter: Waiter) -> None:
        model = self.registry.models.get(name) if isinstance(name, str) else None
        if model is None or model.unloaded:
            check_model_name(name)
            raise TorchpoolError(errors.NOT_FOUND, f"unload: model '{name}' is not loaded")
        model.unloaded = True
        model.unload_waiters.append(waiter)
        if model.pending is not None:
            self._abandon(model, model.pending, TorchpoolError(errors.UNAVAILABLE, f"model '{name}' was unloaded"))
        for mv in list(model.versions.values()):
            self.retire(mv)
        model.former |= set(model.versions)
        model.versions = {}
        log.info("unloading model '%s'", name)
        self.progress()

    # --- events from the server ------------------------------------------

    def version_settled(self, mv: ModelVersion) -> None:
        """A version finished loading (READY or failed): maybe swap its generation in."""
        model = self.registry.model_of(mv)
        if model is None or model.pending is None or mv not in model.pending.versions.values():
            return
        gen = model.pending
        if not gen.settled():
            return
        model.pending = None
        ready = [v for v in gen.versions.values() if v.state == READY]
        if not ready:
            reasons = "; ".join(f"version {v.version}: {v.reason}" for v in gen.versions.values())
            log.error("reload of model '%s' failed, the serving versions stay: %s", model.name, reasons)
            for w in gen.waiters:
                w(TorchpoolError(errors.UNAVAILABLE, f"failed to load '{model.name}': {reasons}"))
            return
        old = list(model.versions.values())
        model.former = (model.former | set(model.versions)) - set(gen.versions)
        model.versions = gen.versions
        model.entry, model.fingerprint, model.unloaded = gen.entry, gen.fingerprint, False
        for mv_old in old:
            self.retire(mv_old)
        log.info("model '%s' now serves versions %s", model.name, sorted(v.version for v in ready))
        for w in gen.waiters:
            w(None)
        self.progress()

    def _abandon(self, model: Model, gen: Generation, err: TorchpoolError) -> None:
        """Give up `gen`, the load under way (model.pending)."""
        model.pending = None
        for mv in gen.versions.values():
            self.retire(mv)
        for w in gen.waiters:
            w(err)

    def retire(self, mv: ModelVersion) -> None:
        if mv.state == UNLOADING:
            return
        mv.state = UNLOADING
        mv.reason = "unloaded"
        mv.deferred = []
        self.registry.retiring.append(mv)

    def progress(self) -> None:
        """Stop the workers of retired versions once they have nothing to do."""
        for mv in list(self.registry.retiring):
            if (mv.scheduler is not None and len(mv.scheduler)) or any(w.batch is not None for w in mv.workers):
                continue
            for w in mv.workers:
                if not w.stopping:
                    w.stopping = True
                    try:
                        w.send(internal.Stop())
                    except OSError:
                        pass
            if not mv.workers:
                self.registry.retiring.remove(mv)
                self.version_gone(mv)
        for model in self.registry.models.values():
            if model.unload_waiters and not any(v.name == model.name for v in self.registry.retiring):
                waiters, model.unload_waiters = model.unload_waiters, []
                for waiter in waiters:
                    waiter(None)

    # --- poll mode ------------------------------------------------------------------

    def poll(self) -> None:
        """Reload what changed on disk, load what appeared, unload what went."""
        try:
            names = {p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")}
        except OSError as exc:
            log.error("cannot scan the model repository %s: %s", self.root, exc)
            return
        for name in sorted(names):
            model = self.registry.models.get(name)
            if model is not None and model.pending is not None:
                continue
            # a model removed (so unloaded) and put back loads again, even unchanged
            if model is None or model.unloaded or fingerprint(self.root / name) != model.fingerprint:
                try:
                    self.load(name, None, _log_failure)
                except TorchpoolError as exc:
                    log.error("%s", exc.message)
        for name, model in list(self.registry.models.items()):
            if name not in names and not model.unloaded and model.versions:
                self.unload(name, lambda err: None)


def _log_failure(err: Optional[TorchpoolError]) -> None:
    """A polled load's waiter: nobody asked for it, the log hears how it went."""
    if err is not None:
        log.error("%s", err.message)
