"""Telling model files apart, and AOTInductor packages' metadata and size checks,
on archives written here (no AOTInductor compile: the package parts that
matter are made by hand)."""
from __future__ import annotations

import json
import platform
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from torchpool.config.model_config import ModelConfig, TensorSpec
from torchpool.worker.aoti import _shape_rules, check_compatible, package_metadata
from torchpool.worker.binding import Binding
from torchpool.worker.formats import (AOTI_PACKAGE, EXPORTED_PROGRAM, TORCHSCRIPT, detect_format,
                                      load_model, resolve_model_file)
from torchpool.worker.naming import NamingConvention
from torchpool.worker.settings import ExecutionSettings, ModelLoadError

CPU = torch.device("cpu")


def zip_with(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return path


def cfg(name: str = "m", inputs=("x",), dims=(4,), max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig(
        name=name, platform="", backend="pytorch", max_batch_size=max_batch_size,
        inputs=tuple(TensorSpec(n, "TYPE_FP32", tuple(dims)) for n in inputs),
        outputs=(TensorSpec("OUTPUT__0", "TYPE_FP32", tuple(dims)),),
        instance_groups=(), version_policy={"latest": {"num_versions": 1}},
        default_model_filename="model.pt", parameters={})


def test_formats_are_told_from_the_archive_not_the_name(tmp_path: Path) -> None:
    scripted = tmp_path / "scripted.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(torch.nn.Identity()), str(scripted))
    assert detect_format("m", scripted) == TORCHSCRIPT
    program = tmp_path / "program.pt"
    torch.export.save(torch.export.export(torch.nn.ReLU(), (torch.ones(2),)), str(program))
    assert detect_format("m", program) == EXPORTED_PROGRAM
    package = zip_with(tmp_path / "p.pt2", {"p/archive_format": b"pt2",
                                            "p/data/aotinductor/model/x.wrapper.so": b""})
    assert detect_format("m", package) == AOTI_PACKAGE


def test_files_that_are_no_model_say_what_they_are(tmp_path: Path) -> None:
    pickled = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), str(pickled))
    with pytest.raises(ModelLoadError) as info:
        detect_format("m", pickled)
    assert "written by torch.save" in info.value.message and "torch.export.save" in info.value.message
    truncated = tmp_path / "model.pt2"
    truncated.write_bytes(b"PK\x03\x04 not really")
    with pytest.raises(ModelLoadError) as info:
        detect_format("m", truncated)
    assert info.value.message.startswith("failed to load model 'm': 'model.pt2' is not a PyTorch model")
    # a .pt that is no zip goes to torch.jit.load, whose words Triton's users know
    assert detect_format("m", truncated.rename(tmp_path / "model.pt")) == TORCHSCRIPT
    other = zip_with(tmp_path / "other.pt2", {"o/readme.txt": b"hi"})
    with pytest.raises(ModelLoadError) as info:
        detect_format("m", other)
    assert "not a TorchScript module, an ExportedProgram or an AOTInductor package" in info.value.message


def test_model_pt2_is_served_when_the_default_model_pt_is_missing(tmp_path: Path) -> None:
    default = tmp_path / "model.pt"
    assert resolve_model_file(default) == default          # neither exists: the default is reported
    (tmp_path / "model.pt2").write_bytes(b"")
    assert resolve_model_file(default) == tmp_path / "model.pt2"
    default.write_bytes(b"")
    assert resolve_model_file(default) == default
    named = tmp_path / "custom.pt"
    assert resolve_model_file(named) == named               # only the default name falls back
    with pytest.raises(ModelLoadError) as info:
        load_model(cfg(), tmp_path / "2" / "model.pt", CPU, "m", ExecutionSettings())
    assert info.value.code == "UNAVAILABLE" and "unable to find" in info.value.message


METADATA = {"AOTI_DEVICE_KEY": "cpu", "AOTI_PLATFORM": sys.platform, "AOTI_MACHINE": platform.machine(),
            "AOTI_CPU_ISA": "", "AOTI_COMPUTE_CAPABILITY": ""}


def test_package_metadata_is_read_before_loading(tmp_path: Path) -> None:
    package = zip_with(tmp_path / "p.pt2", {
        "p/data/aotinductor/model/abc.wrapper_metadata.json": json.dumps(METADATA).encode()})
    assert package_metadata(package) == METADATA
    check_compatible("m", METADATA, CPU)
    check_compatible("m", METADATA, None)                   # KIND_MODEL: the package's own device


@pytest.mark.parametrize("change, words", [
    ({"AOTI_DEVICE_KEY": "cuda"}, ["compiled for device 'cuda'", "runs on 'cpu'"]),
    ({"AOTI_MACHINE": "sparc64"}, ["compiled for machine 'sparc64'"]),
    ({"AOTI_PLATFORM": "win32"}, ["compiled for platform 'win32'"]),
    ({"AOTI_CPU_ISA": "AMX9000"}, ["AMX9000 instruction set, which this CPU lacks"]),
])
def test_a_package_for_another_machine_is_refused_with_the_reason(change: dict, words: list) -> None:
    with pytest.raises(ModelLoadError) as info:
        check_compatible("m", {**METADATA, **change}, CPU)
    assert info.value.code == "INVALID_ARG"
    for word in words:
        assert word in info.value.message


WRAPPER = """
AOTI_NOINLINE static void check_input_0(AtenTensorHandle* input_handles) {
    ConstantHandle arg2_1 = ConstantHandle(input_handles[0]);
    auto arg2_1_size = arg2_1.sizes();
    if (arg2_1_size[0] < 2) { ss << "input_handles[0]: dim value is too small at 0, "; }
    if (arg2_1_size[0] > 8) { ss << "input_handles[0]: dim value is too large at 0, "; }
    if (4 != arg2_1_size[1]) { ss << "input_handles[0]: unmatched dim value at 1, "; }
}
AOTI_NOINLINE static void check_input_1(AtenTensorHandle* input_handles) {
    ConstantHandle arg3_1 = ConstantHandle(input_handles[1]);
    auto arg3_1_size = arg3_1.sizes();
    if (arg3_1_size[0] < 0) { }
    if (arg3_1_size[1] < 1) { }
    if (arg3_1_size[1] > 16) { }
}
"""


def binding_for(names: list[str]) -> Binding:
    return Binding(model_name="m", is_dict_input=False, input_index={n: i for i, n in enumerate(names)},
                   output_index={"OUTPUT__0": 0}, output_datatype={"OUTPUT__0": "FP32"},
                   input_convention=NamingConvention.NAMED_INDEX,
                   output_convention=NamingConvention.NAMED_INDEX, output_names=("OUTPUT__0",),
                   arity=len(names), required_inputs=frozenset(names), flat_outputs=True)


def test_a_packages_generated_size_checks_become_shape_rules(tmp_path: Path) -> None:
    package = zip_with(tmp_path / "p.pt2", {"p/data/aotinductor/model/abc.wrapper.cpp": WRAPPER.encode()})
    rules = _shape_rules("m", package, binding_for(["INPUT__0", "INPUT__1"]))
    assert rules is not None and rules.exact_rank
    first, second = rules.inputs["INPUT__0"], rules.inputs["INPUT__1"]
    assert (first[0].low, first[0].high, first[1].size) == (2, 8, 4)
    assert (second[1].low, second[1].high) == (1, 16)
    rules.check_config(cfg(inputs=("INPUT__0",), dims=(4,)))      # batch 1..8, [4]: fits
    with pytest.raises(ModelLoadError) as info:
        rules.check_config(cfg(inputs=("INPUT__0",), dims=(5,)))
    assert "dimension 1 is 5 in the configuration" in info.value.message
    assert "the AOTInductor package takes exactly 4" in info.value.message
    with pytest.raises(ModelLoadError) as info:
        rules.check_config(cfg(inputs=("INPUT__0",), dims=(4,), max_batch_size=9))
    assert "max_batch_size is 9" in info.value.message and "at most 8" in info.value.message
    no_source = zip_with(tmp_path / "q.pt2", {"q/data/aotinductor/model/abc.wrapper.so": b""})
    assert _shape_rules("m", no_source, binding_for(["INPUT__0"])) is None


def test_the_package_loader_says_a_damaged_package_cannot_be_loaded(tmp_path: Path) -> None:
    package = zip_with(tmp_path / "model.pt2", {
        "model/archive_format": b"pt2",
        "model/data/aotinductor/model/abc.wrapper_metadata.json": json.dumps(METADATA).encode(),
        "model/data/aotinductor/model/abc.wrapper.so": b"\x7fELF junk"})
    with pytest.raises(ModelLoadError) as info:
        load_model(cfg(), package, CPU, "m", ExecutionSettings())
    assert "cannot be loaded by torch" in info.value.message
