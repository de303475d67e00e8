"""`model_warmup`: Triton's warmup samples, checked against the model's inputs.

    model_warmup {
      name: "zeros"  batch_size: 4  count: 2
      inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [16] zero_data: true } }
    }

A sample is `batch_size` requests of one batch item each, run together
`count` times (0 means once) when an instance has loaded, before it takes
traffic. Every input takes its data from exactly one source: zeros, random
bytes, or a file under the model's `warmup/` directory (Triton's
`<model>/warmup/<input_data_file>`). A sample with `batch_size: 0` is skipped,
as Triton skips it, so only the others are checked against the model and
appear in `ModelConfig.warmup`.

Checked here, so a worker can run a sample without second-guessing it: the
input names are the model's inputs (or sequence-batching control inputs,
which Triton lets a sample set), every input that is not optional has a
value, data types are the model's, dims are concrete and fit the model's
dims, `batch_size` fits `max_batch_size`, the file path stays inside
`warmup/`. `check_warmup_files` (called where the model directory is known)
checks that each file exists and holds enough bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Optional

from ..protocol.datatypes import config_to_wire, element_size
from .errors import ConfigError, did_you_mean, fail

if TYPE_CHECKING:
    from .shapes import RawConfig, WarmupEntry, WarmupInputEntry

__all__ = ["WarmupInput", "WarmupSample", "normalize_warmup", "warmup_samples", "check_warmup_files"]

WARMUP_DIRECTORY = "warmup"
SOURCES = {"zero_data": "zero", "random_data": "random", "input_data_file": "file"}


@dataclass(frozen=True)
class WarmupInput:
    """The value of one input in a warmup sample."""

    data_type: str                  # Triton's name, e.g. "TYPE_FP32"
    dims: tuple[int, ...]           # one batch item's shape (no batch dimension), all concrete
    source: str                     # "zero" | "random" | "file"
    file: Optional[str] = None      # for "file": relative to the model's warmup/ directory


@dataclass(frozen=True)
class WarmupSample:
    """One `model_warmup` entry that runs (batch_size > 0)."""

    name: str
    batch_size: int                 # requests of one batch item each, executed together
    inputs: dict[str, WarmupInput]
    count: int = 1                  # executions of the sample (the config's 0 means 1)


def normalize_warmup(cfg: RawConfig) -> list[WarmupEntry]:
    """The `model_warmup` entries with Triton's defaults filled, each checked
    against the normalised inputs of `cfg` (raises FieldError)."""
    return [_normalize_sample(sample, cfg, f"model_warmup[{index}]")
            for index, sample in enumerate(cfg["model_warmup"])]


def warmup_samples(raw: list[WarmupEntry]) -> tuple[WarmupSample, ...]:
    """The typed samples that run, from the normalised `model_warmup`."""
    return tuple(
        WarmupSample(
            name=s["name"], batch_size=s["batch_size"], count=s["count"] or 1,
            inputs={name: _typed_input(value) for name, value in s["inputs"].items()})
        for s in raw if s["batch_size"] > 0)


def check_warmup_files(model_dir: Path, samples: tuple[WarmupSample, ...], source: str) -> None:
    """Each `input_data_file` exists under `<model_dir>/warmup/` and holds at
    least one batch item's bytes (any size for TYPE_STRING), as Triton checks
    when it reads it; raises ConfigError naming the file."""
    for sample in samples:
        for name, value in sample.inputs.items():
            if value.source != "file" or value.file is None:     # ("file" always names one)
                continue
            path = model_dir / WARMUP_DIRECTORY / value.file
            where = f"{source}: warmup sample '{sample.name}' input '{name}'"
            if not path.is_file():
                raise ConfigError(f"{where}: input_data_file '{value.file}' is not a file in {path.parent}")
            needed = _byte_size(value)
            size = path.stat().st_size
            if size < needed:
                raise ConfigError(f"{where}: warmup setting expects {needed} bytes, but the data provided "
                                  f"from {path} only has {size} bytes")


def _normalize_sample(sample: WarmupEntry, cfg: RawConfig, path: str) -> WarmupEntry:
    name = sample.get("name", "")
    if not name:
        fail(f"{path}.name", "a warmup sample must specify 'name'")
    out: WarmupEntry = {"name": name, "batch_size": sample.get("batch_size", 0),
                        "inputs": {k: v.copy() for k, v in sample.get("inputs", {}).items()},
                        "count": sample.get("count", 0)}
    for key, value in out["inputs"].items():
        _check_source(value, f"{path}.inputs[{key!r}]", f"warmup sample '{name}' input '{key}'")
    if out["batch_size"] > 0:          # a batch-0 sample is skipped: nothing else to check
        _check_batch_size(out["batch_size"], cfg, f"{path}.batch_size", name)
        _check_inputs(out["inputs"], cfg, f"{path}.inputs", name)
    return out


def _check_source(value: WarmupInputEntry, path: str, what: str) -> None:
    """Exactly one data source (a protobuf oneof), and a file stays in warmup/."""
    given = [key for key in SOURCES if key in value]
    if not given:
        fail(path, f"{what} must set one of zero_data, random_data or input_data_file")
    if len(given) > 1:
        fail(path, f"{what} sets {' and '.join(given)}: give only one of zero_data, random_data "
                   "or input_data_file")
    if given[0] == "input_data_file":
        file = PurePosixPath(value["input_data_file"])
        if not file.parts or file.is_absolute() or ".." in file.parts:
            fail(f"{path}.input_data_file", f"{what}: input_data_file '{file}' must be a relative path "
                                            f"inside the model's {WARMUP_DIRECTORY}/ directory")
    value.setdefault("data_type", "TYPE_INVALID")
    value.setdefault("dims", [])


def _check_batch_size(batch_size: int, cfg: RawConfig, path: str, name: str) -> None:
    """The sample's items run as one batch: it must fit what the model takes."""
    max_batch_size = cfg["max_batch_size"]
    if batch_size > max(1, max_batch_size):
        fail(path, f"warmup sample '{name}' has batch_size {batch_size}, larger than the max_batch_size "
                   f"{max_batch_size} of model '{cfg['name']}'"
                   + (" (a model that does not batch takes 1)" if max_batch_size == 0 else ""))


def _check_inputs(inputs: dict[str, WarmupInputEntry], cfg: RawConfig, path: str, name: str) -> None:
    model = cfg["name"]
    config_inputs = {t["name"]: t for t in cfg["input"]}
    controls = {c["name"] for c in cfg.get("sequence_batching", {}).get("control_input", ())}
    for key, value in inputs.items():
        what = f"warmup sample '{name}' input '{key}'"
        here = f"{path}[{key!r}]"
        if key not in config_inputs and key not in controls:
            fail(here, f"warmup sample '{name}' names input '{key}', which model '{model}' does not "
                       f"have{did_you_mean(key, [*config_inputs, *controls])}")
        if value["data_type"] == "TYPE_INVALID":
            fail(f"{here}.data_type", f"{what} must specify 'data_type'")
        _check_dims(value["dims"], f"{here}.dims", what)
        spec = config_inputs.get(key)
        if spec is None:
            continue                    # a control input: the sequence batcher's data type and shape
        if value["data_type"] != spec["data_type"]:
            fail(f"{here}.data_type", f"{what} is {value['data_type']}, but model '{model}' "
                                      f"expects {spec['data_type']}")
        if not _fits(value["dims"], spec["dims"]):
            fail(f"{here}.dims", f"{what} has dims {value['dims']}, which do not fit the dims "
                                 f"{spec['dims']} of model '{model}'")
    missing = [n for n, t in config_inputs.items() if n not in inputs and not t["optional"]]
    if missing:
        fail(path, f"warmup sample '{name}' gives no value for input(s) "
                   f"{', '.join(repr(m) for m in missing)} of model '{model}'")


def _check_dims(dims: list[int], path: str, what: str) -> None:
    for dim in dims:
        if dim == -1:
            fail(path, f"{what}: warmup setting expects all variable-size dimensions are specified, "
                       f"got dims {dims}")
        if dim < 0:
            fail(path, f"{what}: dimension must be >= 0, got {dim}")


def _fits(dims: list[int], model_dims: list[int]) -> bool:
    """Same rank; every fixed model dimension equal (-1 takes any size)."""
    return len(dims) == len(model_dims) and all(m in (-1, d) for d, m in zip(dims, model_dims))


def _typed_input(value: WarmupInputEntry) -> WarmupInput:
    key = next(k for k in SOURCES if k in value)
    return WarmupInput(data_type=value["data_type"], dims=tuple(value["dims"]), source=SOURCES[key],
                       file=value.get("input_data_file"))


def _byte_size(value: WarmupInput) -> int:
    """One batch item's bytes; 0 for TYPE_STRING (its file is taken as it is)."""
    count = 1
    for dim in value.dims:
        count *= dim
    return count * element_size(config_to_wire(value.data_type))
