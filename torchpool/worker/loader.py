"""Everything a worker does before it reports READY, in order:

    process settings ─► device ─► custom ops ─► model file (formats.py: TorchScript,
    ExportedProgram, AOTInductor) ─► TORCH_COMPILE wrap ─► shared weights ─►
    compile (synthetic batches) ─► model_warmup samples ─► READY

Compiling and warming up run under the model's grad mode, as requests do,
so nothing is compiled or allocated again at the first request. Every failure
is a ModelLoadError naming the model and the step.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config.parameters import ModelParameters
from ..config.paths import leaves_message, resolved_inside
from ..protocol import errors
from ..shm.segment import NamedSegment
from .classify import Classifier
from .compile import compile_now, configure_compile_cache, prepare_compiled
from .formats import AOTI_PACKAGE, LoadedModel, load_model, resolve_model_file
from .settings import (ExecutionSettings, ModelLoadError, apply_process_settings, compile_settings,
                       grad_context, model_settings)
from .spec import WorkerSpec
from .warmup import run_warmup
from .weights import share_weights

log = logging.getLogger("torchpool.worker")


@dataclass
class LoadedInstance:
    """A model instance ready to serve."""

    settings: ExecutionSettings
    device: torch.device
    model: LoadedModel
    classifier: Classifier
    weights: Optional[NamedSegment] = None   # the shared weights segment, if any (kept mapped)


def load_instance(spec: WorkerSpec) -> LoadedInstance:
    settings = model_settings(spec.config)
    apply_process_settings(settings, spec.threads)
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"instance '{spec.instance}' of model '{spec.model}' needs "
                             f"{spec.device} (KIND_GPU) but no GPU is available",
                             errors.UNAVAILABLE)
    device = torch.device("cpu" if spec.device == "model" else spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model_dir = Path(spec.model_path).parent.parent
    load_extensions(spec.model, model_dir, settings)
    classifier = Classifier.load(spec.config, model_dir)
    map_location = None if spec.device == "model" else device
    options = compile_settings(spec.config)
    if options.enabled:
        configure_compile_cache()   # before anything compiles; only a compiling worker makes it
    check_model_file(spec.model, model_dir, Path(spec.model_path))
    # Triton names the model where its "unable to find" message says
    # "model instance"; users' tests look for that text.
    model = load_model(spec.config, spec.model_path, map_location, spec.model, settings)
    if options.enabled:
        model = prepare_compiled(model, spec.config, options)
    instance = LoadedInstance(settings, device, model, classifier)
    with grad_context(settings):    # the weights were loaded under it; requests run under it
        instance.weights = _share_weights(spec, model, device)
        if options.enabled:
            done = compile_now(model, spec.config, device)
            if done.seconds:
                log.info("model '%s' instance '%s': compiled (%s) in %.1f s, %d graphs, %d from the "
                         "compile cache", spec.model, spec.instance, options.mode, done.seconds,
                         done.graphs, done.cached)
        started = time.monotonic()
        ran = run_warmup(spec.config, model_dir, model.module, model.binding, device)
        if ran:
            log.info("model '%s' instance '%s': %d warm-up batch%s in %.2f s", spec.model,
                     spec.instance, ran, "" if ran == 1 else "es", time.monotonic() - started)
    log.debug("model '%s' instance '%s' loaded as %s from %s", spec.model, spec.instance,
              model.format, model.path.name)
    return instance


def _share_weights(spec: WorkerSpec, model: LoadedModel, device: torch.device) -> Optional[NamedSegment]:
    if not spec.shared_weights or device.type != "cpu":
        return None
    if model.weights is None:
        if model.format == AOTI_PACKAGE:
            log.warning("model '%s': ENABLE_WEIGHT_SHARING does not apply to an AOTInductor "
                        "package (its weights are inside its compiled code); each instance keeps "
                        "its own copy", spec.model)
        return None
    return share_weights(model.weights, spec.shared_weights, spec.model)


def check_model_file(model: str, model_dir: Path, model_path: Path) -> None:
    """The file about to be opened (`model.pt2` beside a missing `model.pt`
    too) is the model directory's: checked again here, where it is opened
    (config/paths.py checked the config's names when the broker read it)."""
    relative = resolve_model_file(model_path).relative_to(model_dir)
    if resolved_inside(model_dir, relative) is None:
        raise ModelLoadError(f"failed to load model '{model}': "
                             f"{leaves_message(model, 'default_model_filename', relative, model_dir)}",
                             errors.INVALID_ARG)


def load_extensions(model: str, model_dir: Path, settings: ModelParameters) -> None:
    """Custom operators a model needs, loaded in its own worker process only:
    TORCHPOOL_OP_LIBRARIES (shared libraries, torch.ops.load_library) and
    TORCHPOOL_PYTHON_MODULES (Python files registering ops with torch.library),
    comma-separated paths relative to the model directory. Like the model
    file itself, they run with the daemon's rights: trust the repository."""
    for key, items in (("TORCHPOOL_OP_LIBRARIES", settings.op_libraries),
                       ("TORCHPOOL_PYTHON_MODULES", settings.python_modules)):
        for item in items:
            path = resolved_inside(model_dir, item)
            if path is None or not path.is_file():
                raise ModelLoadError(f"failed to load model '{model}': {key} names '{item}', which is "
                                     f"not a file inside the model directory", errors.INVALID_ARG)
            try:
                if key == "TORCHPOOL_OP_LIBRARIES":
                    torch.ops.load_library(str(path))
                else:
                    name = f"torchpool_ext_{model}_{path.stem}"
                    module_spec = importlib.util.spec_from_file_location(name, path)
                    if module_spec is None or module_spec.loader is None:   # no loader for its suffix
                        raise ImportError("it is not a Python source file")
                    module = importlib.util.module_from_spec(module_spec)
                    sys.modules[name] = module
                    module_spec.loader.exec_module(module)
            except Exception as exc:
                raise ModelLoadError(f"failed to load model '{model}': loading {key} '{item}' "
                                     f"failed: {exc}") from None


__all__ = ["LoadedInstance", "load_extensions", "load_instance"]
