"""Compiled execution (TORCH_COMPILE): torch.compile once per worker, at load,
with compilation artefacts cached on disk.

    ExportedProgram  ──.module()─────────────────────────► torch.compile ─► warm-up
    TorchScript      ──TS2EPConverter (sample from config)─┘   (Inductor)    (batch 2 dynamic, then 1)
    AOTInductor      already compiled: TORCH_COMPILE is ignored

torch.compile refuses ScriptModules; torch ships a converter from TorchScript
to an ExportedProgram (`torch._export.converter`), which is what the
migration away from TorchScript uses, so a TorchScript model is converted
with a synthetic input from its config and compiled like an exported one.
A model the converter cannot take (string, dict or Optional arguments,
unsupported TorchScript ops) fails the load with the converter's reason.

The cache: Inductor's FX graph and AOTAutograd caches, under
`<cache dir>/inductor` (TORCHINDUCTOR_CACHE_DIR). The cache dir is
TORCHPOOL_CACHE_DIR (the daemon's --cache-dir), else TORCHINDUCTOR_CACHE_DIR
if the operator set it, else `$XDG_CACHE_HOME/torchpool` or
`~/.cache/torchpool`. Entries are keyed by graph, shapes, torch version and
CPU, so a second instance, a restarted worker or a restarted daemon reuses
them (Dynamo's tracing still runs, about a second for a small model);
deleting the directory is always safe.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from torchpool.config.model_config import ModelConfig
from torchpool.protocol.errors import INVALID_ARG
from torchpool.worker.exported import ProgramRunner
from torchpool.worker.formats import AOTI_PACKAGE, TORCHSCRIPT, LoadedModel
from torchpool.worker.settings import CompileSettings, ModelLoadError
from torchpool.worker.warmup import compile_batches, run_batches

log = logging.getLogger("torchpool.worker")

CACHE_ENV = "TORCHPOOL_CACHE_DIR"


def cache_root() -> Optional[Path]:
    """torchpool's cache directory (see the module text); None: leave torch's default."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen).expanduser()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchpool"


def configure_compile_cache() -> Optional[Path]:
    """Point Inductor's on-disk caches at torchpool's cache directory; returns it.

    Called in the worker before anything compiles (Inductor reads the
    variables when it first needs the directory). A directory that cannot be
    made leaves torch's default (its temporary directory) with a warning.
    """
    root = cache_root()
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    if root is None:
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    inductor = root / "inductor"
    try:
        inductor.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cannot use %s for compile caches (%s); using torch's default", inductor,
                    exc.strerror or exc)
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    return inductor


def prepare_compiled(loaded: LoadedModel, config: ModelConfig, options: CompileSettings) -> LoadedModel:
    """The model wrapped by torch.compile (nothing is compiled yet: that
    happens at the first call, in `compile_now`). `weights` becomes the
    module the compiled code reads its weights from."""
    if loaded.format == AOTI_PACKAGE:
        log.warning("model '%s': TORCH_COMPILE is ignored for an AOTInductor package (it is "
                    "compiled already)", config.name)
        return loaded
    graph_module = loaded.source
    if loaded.format == TORCHSCRIPT:
        graph_module = _from_torchscript(loaded, config)
    mode = None if options.mode == "default" else options.mode
    compiled = torch.compile(graph_module, mode=mode)
    return replace(loaded, module=compiled, weights=graph_module)


def _from_torchscript(loaded: LoadedModel, config: ModelConfig) -> torch.nn.Module:
    """A ScriptModule as an ExportedProgram's module, via torch's converter."""
    binding = loaded.binding
    if binding.is_dict_input or binding.required_inputs != frozenset(binding.input_index):
        raise _cannot(config, "it takes a Dict[str, Tensor] or Optional arguments")
    batches = compile_batches(config, binding)
    if batches is None:
        raise _cannot(config, "it takes strings or batch inputs")
    sample = tuple(binding.arguments(batches[0]))
    try:
        from torch._export.converter import TS2EPConverter

        # loaded afresh, outside inference mode: the converter re-traces with
        # autograd on, which inference-mode weights refuse
        script = torch.jit.load(str(loaded.path), map_location=_device_of(loaded.source))
        program = TS2EPConverter(script, sample).convert()
        return ProgramRunner.of(program)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise _cannot(config, f"converting it to an ExportedProgram failed: "
                              f"{text[0] if text else type(exc).__name__}") from exc


def _device_of(module: Optional[torch.nn.Module]) -> Optional[torch.device]:
    if module is None:
        return None
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return None


def _cannot(config: ModelConfig, why: str) -> ModelLoadError:
    return ModelLoadError(f"failed to load model '{config.name}': TORCH_COMPILE cannot compile this "
                          f"TorchScript model: {why}; export the model with torch.export instead",
                          INVALID_ARG)


@dataclass(frozen=True)
class Compiled:
    """What compiling at load did: its time, and how many Inductor graphs it
    built, how many of them came from the on-disk cache."""

    seconds: float = 0.0
    graphs: int = 0
    cached: int = 0


def compile_now(loaded: LoadedModel, config: ModelConfig, device: Optional[torch.device] = None) -> Compiled:
    """Compile by running the synthetic warm-up batches (on `device`).

    The caller runs this under the model's grad mode: compiled code is
    specialised to it (a tensor made outside inference mode would compile
    again at the first request).
    """
    if loaded.format == AOTI_PACKAGE:
        return Compiled()
    batches = compile_batches(config, loaded.binding)
    if batches is None:
        log.warning("model '%s': TORCH_COMPILE compiles at its first batch (no synthetic input "
                    "can be made for it; model_warmup samples would move that to the load)",
                    config.name)
        return Compiled()
    from torch._dynamo.utils import counters

    before = dict(counters["inductor"])
    started = time.monotonic()
    run_batches(config, loaded.module, loaded.binding, batches, "compiling (TORCH_COMPILE)", device)
    seconds = time.monotonic() - started
    after = counters["inductor"]
    hits = after["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0)
    misses = after["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0)
    return Compiled(seconds, hits + misses, hits)


__all__ = ["CACHE_ENV", "Compiled", "cache_root", "compile_now", "configure_compile_cache",
           "prepare_compiled"]
