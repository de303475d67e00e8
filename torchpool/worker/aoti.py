"""AOTInductor packages: `model.pt2` made by `torch._inductor.aoti_compile_and_package`.

The package holds compiled code (a shared library per model) and no Python
graph; it is loaded with `torch._inductor.aoti_load_package` and run through
its loader's `boxed_run`, which takes and returns flat tensor lists (the
Python wrapper would parse the call spec from JSON on every call).

What a package knows about itself: its call structure (`get_call_spec`:
keyword and dict-key names, no positional names, so positional inputs bind
by `<name>__<index>` or config order), the machine it was compiled for
(`*_metadata.json`: device, platform, machine, CPU vector ISA) and, in the
generated wrapper source it carries, the size checks of every input
(`check_input_<i>`: fixed sizes and the bounds of dynamic ones). The
metadata is read from the archive before anything is loaded, so a package
for a GPU, another architecture or a wider CPU ISA fails with a reason
instead of a crash; the size checks become `ShapeRules`, held against the
config at load and applied to its open dimensions per batch, as for an
ExportedProgram. The package's own run-time checks (AOTI_RUNTIME_CHECK_INPUTS)
stay off: Inductor may compile a batch dimension declared `min=1` with a
lower bound of 2, and that check would refuse every batch of one (the code
itself runs them). If the operator turns them on, their failures are still
reworded to name the config's tensor.

Weights live inside the package's code: ENABLE_WEIGHT_SHARING cannot share
them between instances (each instance holds its own copy).
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol

import torch
from torch.utils import _pytree as pytree

from torchpool.config.model_config import ModelConfig
from torchpool.protocol.errors import INTERNAL, INVALID_ARG
from torchpool.worker.binding import Binding
from torchpool.worker.settings import ExecutionError, ModelLoadError
from torchpool.worker.shapes import Dim, ShapeRules
from torchpool.worker.signature import bind_program, read_signature

WHAT = "the AOTInductor package"
_HANDLE_ERROR = re.compile(r"input_handles\[(\d+)\]: ([^\n]*)")
_HANDLE = re.compile(r"ConstantHandle (\w+) = ConstantHandle\(input_handles\[(\d+)\]\);")


class BoxedLoader(Protocol):
    """The package's loader (torch._C._aoti.AOTIModelPackageLoader), as the runner calls it."""

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...


class AotiRunner:
    """Calls the package with the flat list of input tensors; returns the flat outputs."""

    def __init__(self, loader: BoxedLoader) -> None:
        self.loader = loader

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self.loader.boxed_run(list(inputs))


def package_metadata(model_path: Path) -> dict[str, str]:
    """The compile-time metadata of the package's (first) model, read from the zip."""
    with zipfile.ZipFile(model_path) as archive:
        found = sorted(n for n in archive.namelist()
                       if "/data/aotinductor/" in n and n.endswith("_metadata.json"))
        if not found:
            return {}
        return json.loads(archive.read(found[0]).decode("utf-8"))


def check_compatible(model_name: str, metadata: dict[str, str], device: Optional[torch.device]) -> None:
    """Refuse a package compiled for another device kind, OS, machine or a CPU
    vector ISA this machine lacks (its code would fault with SIGILL)."""
    package_device = metadata.get("AOTI_DEVICE_KEY", "")
    if device is not None and package_device and package_device != device.type:
        raise ModelLoadError(f"failed to load model '{model_name}': {WHAT} was compiled for "
                             f"device '{package_device}', but this instance runs on '{device}'; "
                             f"compile it for {device.type} or change the instance_group kind",
                             INVALID_ARG)
    wanted = {"AOTI_PLATFORM": sys.platform, "AOTI_MACHINE": platform.machine()}
    for key, here in wanted.items():
        theirs = metadata.get(key, "")
        if theirs and theirs != here:
            raise ModelLoadError(f"failed to load model '{model_name}': {WHAT} was compiled for "
                                 f"{key.removeprefix('AOTI_').lower()} '{theirs}', this machine is "
                                 f"'{here}'", INVALID_ARG)
    isa = metadata.get("AOTI_CPU_ISA", "").lower()
    if isa and package_device == "cpu":
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        supported = [str(v).lower() for v in valid_vec_isa_list()]
        if isa not in supported:
            raise ModelLoadError(f"failed to load model '{model_name}': {WHAT} was compiled for "
                                 f"the {isa.upper()} instruction set, which this CPU lacks (it has "
                                 f"{', '.join(s.upper() for s in supported) or 'none'}); compile it "
                                 f"on (or for) this machine", INVALID_ARG)


def load_aoti(config: ModelConfig, model_path: Path, device: Optional[torch.device]) -> tuple[AotiRunner, Binding]:
    """Load an AOTInductor package and bind it to `config`."""
    try:
        metadata = package_metadata(model_path)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ModelLoadError(f"failed to load model '{config.name}': cannot read {WHAT} "
                             f"'{model_path.name}': {exc}", INVALID_ARG) from None
    check_compatible(config.name, metadata, device)
    index = device.index if device is not None and device.index is not None else -1
    on_cpu = device is None or device.type == "cpu"
    try:
        with _extraction_removed_after_load() if on_cpu else contextlib.nullcontext():
            compiled = torch._inductor.aoti_load_package(str(model_path), run_single_threaded=True,
                                                         device_index=index)
        in_json, out_json = compiled.loader.get_call_spec()
    except Exception as exc:
        raise ModelLoadError(f"failed to load model '{config.name}': {WHAT} '{model_path.name}' "
                             f"cannot be loaded by torch {torch.__version__} (was it compiled by "
                             f"another torch version, or is it damaged?): {_first_line(exc)}",
                             INTERNAL) from exc
    signature = read_signature(config.name, pytree.treespec_loads(in_json),
                               pytree.treespec_loads(out_json), None, WHAT)
    binding = bind_program(config, signature)
    shapes = _shape_rules(config.name, model_path, binding)
    if shapes is not None:
        shapes.check_config(config)
    binding = replace(binding, shapes=shapes, explain=_explainer(config.name, binding))
    return AotiRunner(compiled.loader), binding


@contextlib.contextmanager
def _extraction_removed_after_load() -> Iterator[None]:
    """torch's package loader extracts the package into a directory under
    TMPDIR and never removes it (a day of tests left 72 such directories of
    6.6 MB in /tmp here, one per load). Here it extracts into a directory of
    ours, removed once the CPU library is loaded: dlopen has mapped it, and
    Linux keeps a removed file's pages while they are mapped. (A CUDA package
    may load kernel files later, at its first call: it keeps torch's way.)"""
    own = tempfile.mkdtemp(prefix="torchpool-aoti-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = own
    try:
        yield
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(own, ignore_errors=True)


def _shape_rules(model_name: str, model_path: Path, binding: Binding) -> Optional[ShapeRules]:
    """The size checks Inductor generated for each input, as ShapeRules by config name."""
    try:
        with zipfile.ZipFile(model_path) as archive:
            source = next((archive.read(n).decode("utf-8", "replace") for n in archive.namelist()
                           if n.endswith(".wrapper.cpp")), None)
    except (zipfile.BadZipFile, OSError):
        return None
    if source is None:
        return None
    names = {position: name for name, position in binding.input_index.items()}
    inputs: dict[str, tuple[Dim, ...]] = {}
    exact = "dim value is too small" in source      # every dynamic dimension has a check
    for var, index in _HANDLE.findall(source):
        name = names.get(int(index))
        if name is None:
            continue
        dims: dict[int, dict[str, int]] = {}
        for size, axis in re.findall(rf"if \((\d+) != {var}_size\[(\d+)\]\)", source):
            dims.setdefault(int(axis), {})["size"] = int(size)
        for axis, low in re.findall(rf"if \({var}_size\[(\d+)\] < (\d+)\)", source):
            dims.setdefault(int(axis), {})["low"] = int(low)
        for axis, high in re.findall(rf"if \({var}_size\[(\d+)\] > (\d+)\)", source):
            dims.setdefault(int(axis), {})["high"] = int(high)
        rank = max(dims) + 1 if dims else 0
        inputs[name] = tuple(_dim(dims.get(axis), f"{var}_{axis}") for axis in range(rank))
    if not inputs:
        return None
    return ShapeRules(model_name, inputs, WHAT, exact_rank=exact)


def _dim(found: Optional[dict[str, int]], symbol: str) -> Dim:
    if not found:
        return Dim()
    if "size" in found:
        return Dim(size=found["size"])
    # each dimension its own symbol: the package does not say which are tied
    return Dim(symbol=symbol, low=found.get("low", 0), high=found.get("high"))


def _explainer(model_name: str, binding: Binding) -> Callable[[str], Optional[ExecutionError]]:
    """A package's input-check failure in the config's words (the request's fault)."""
    names = {position: name for name, position in binding.input_index.items()}

    def explain(text: str) -> Optional[ExecutionError]:
        match = _HANDLE_ERROR.search(text)
        if match is None:
            return None
        name = names.get(int(match.group(1)), f"#{match.group(1)}")
        return ExecutionError(f"unexpected shape for input '{name}' for model '{model_name}': "
                              f"{match.group(2).strip()} ({WHAT} checked it)", INVALID_ARG)
    return explain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["AotiRunner", "check_compatible", "load_aoti", "package_metadata"]
