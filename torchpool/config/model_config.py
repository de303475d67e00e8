"""Typed view of one model's configuration (Triton's model_config schema).

The canonical form of a configuration is the JSON dictionary Triton itself
uses (what `model_config()` returns, `ModelConfig.raw`); `ModelConfig` is the
typed view the broker and the workers read. `ModelConfig.from_json` builds it
in three steps, each its own module:

    conform.py    every field and enum value is one of Triton's, of its type
    normalize.py  Triton's validation rules and defaults -> `raw`
    (here)        the typed view of `raw`

`pbtxt.py` turns a `config.pbtxt` into the JSON form first, and
`repository.py` reads the files and version directories around it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, cast

from .conform import conform_message
from .devices import visible_gpus
from .errors import ConfigError, FieldError
from .normalize import BACKEND, PLATFORM, normalize
from .schema import ROOT_MESSAGE
from .shapes import BatchInput, BatchOutput, DynamicBatching, RawConfig, SequenceBatching, TensorEntry, VersionPolicy
from .warmup import WarmupInput, WarmupSample, warmup_samples

__all__ = ["ConfigError", "ModelConfig", "TensorSpec", "InstanceGroup", "SequenceState",
           "WarmupSample", "WarmupInput", "CONFIG_TO_WIRE"]

# Config data types (TYPE_X) and their wire names (KServe v2).
CONFIG_TO_WIRE = {
    "TYPE_BOOL": "BOOL", "TYPE_UINT8": "UINT8", "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32", "TYPE_UINT64": "UINT64", "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16", "TYPE_BF16": "BF16", "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64", "TYPE_STRING": "BYTES",
}


@dataclass(frozen=True)
class TensorSpec:
    """One `input` or `output` entry."""

    name: str
    data_type: str                      # config form, e.g. "TYPE_FP32"
    dims: tuple[int, ...]               # without the implicit batch dimension
    reshape: Optional[tuple[int, ...]] = None
    allow_ragged_batch: bool = False
    optional: bool = False

    @property
    def datatype(self) -> str:
        """The wire (KServe v2) name: "FP32", "BYTES", ..."""
        return CONFIG_TO_WIRE[self.data_type]


@dataclass(frozen=True)
class InstanceGroup:
    name: str
    kind: str                           # KIND_CPU | KIND_GPU | KIND_MODEL (KIND_AUTO is resolved)
    count: int = 1
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class SequenceState:
    """One `sequence_batching.state` entry: the worker binds its tensors, the
    broker carries the output of one request over as the next one's input."""
    input_name: str
    output_name: str
    data_type: str                      # TYPE_INT32, ...
    dims: tuple[int, ...]
    initial_state: Optional[dict] = None   # zero_data or data_file (the first one given)


def _first_initial_state(value: object) -> Optional[dict]:
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class ModelConfig:
    name: str
    platform: str                       # "pytorch_libtorch"
    backend: str                        # "pytorch"
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    instance_groups: tuple[InstanceGroup, ...]
    # {"latest": {"num_versions": 1}} | {"all": {}} | {"specific": {"versions": [..]}}
    version_policy: VersionPolicy
    default_model_filename: str         # "model.pt" unless set
    parameters: dict[str, str]          # key -> string_value
    dynamic_batching: Optional[DynamicBatching] = None
    sequence_batching: Optional[SequenceBatching] = None
    batch_inputs: tuple[BatchInput, ...] = ()
    batch_outputs: tuple[BatchOutput, ...] = ()
    warmup: tuple[WarmupSample, ...] = ()   # the samples to run (batch_size > 0), in config order
    # a RawConfig (shapes.py), kept a plain dict for the readers that take one (broker/registry.py)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # by name, for the broker's per-request lookups (filled in __post_init__)
    inputs_by_name: dict[str, TensorSpec] = field(init=False, compare=False, repr=False)
    outputs_by_name: dict[str, TensorSpec] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs_by_name", {t.name: t for t in self.inputs})
        object.__setattr__(self, "outputs_by_name", {t.name: t for t in self.outputs})

    def input(self, name: str) -> Optional[TensorSpec]:
        return self.inputs_by_name.get(name)

    def output(self, name: str) -> Optional[TensorSpec]:
        return self.outputs_by_name.get(name)

    def sequence_states(self) -> list["SequenceState"]:
        """The implicit states of `sequence_batching`, in config order."""
        batching = self.sequence_batching or {}
        return [SequenceState(input_name=str(s["input_name"]), output_name=str(s["output_name"]),
                              data_type=str(s["data_type"]), dims=tuple(int(d) for d in s.get("dims", ())),
                              initial_state=_first_initial_state(s.get("initial_state")))
                for s in batching.get("state", ())]

    @classmethod
    def from_json(cls, d: Mapping[str, object], source: str = "<config>",
                  gpus: Optional[Sequence[int]] = None) -> "ModelConfig":
        """Validate a JSON-form configuration and fill in Triton's defaults.

        `d` is what `parse_pbtxt` returns or what `json.load` read from a
        `config.json` (int64 values written as strings are accepted). `name`
        must be set: the repository fills it from the directory name first.
        `gpus` are the GPU ids that KIND_AUTO resolves to (default: the ones
        this host shows, `devices.visible_gpus()`).
        Raises `ConfigError("<source>: model '<name>': <field path>: <why>")`.
        """
        name = d.get("name") if isinstance(d, dict) else None
        try:
            if not isinstance(d, dict):
                raise FieldError("", "a model configuration must be a JSON object")
            conformed = conform_message(d, ROOT_MESSAGE, "")
            raw = normalize(conformed, visible_gpus() if gpus is None else gpus)
        except FieldError as err:
            raise ConfigError(_error_text(source, name, err)) from None
        return _typed_view(raw)

    def to_json(self) -> RawConfig:
        """The normalised JSON form (a copy of `raw`, so callers may mutate it)."""
        return cast(RawConfig, copy.deepcopy(self.raw))


def _error_text(source: str, model: object, err: FieldError) -> str:
    parts = [source]
    if isinstance(model, str) and model:
        parts.append(f"model '{model}'")
    if err.path:
        parts.append(err.path)
    parts.append(err.message)
    return ": ".join(parts)


def _typed_view(raw: RawConfig) -> ModelConfig:
    """The `ModelConfig` of a normalised `raw` (which it keeps)."""
    return ModelConfig(
        name=raw["name"], platform=PLATFORM, backend=BACKEND, max_batch_size=raw["max_batch_size"],
        inputs=tuple(_tensor_spec(t) for t in raw["input"]),
        outputs=tuple(_tensor_spec(t) for t in raw["output"]),
        instance_groups=tuple(InstanceGroup(g["name"], g["kind"], g["count"], tuple(g["gpus"]))
                              for g in raw["instance_group"]),
        version_policy=copy.deepcopy(raw["version_policy"]),
        default_model_filename=raw["default_model_filename"],
        parameters={k: v["string_value"] for k, v in raw["parameters"].items()},
        dynamic_batching=copy.deepcopy(raw.get("dynamic_batching")),
        sequence_batching=copy.deepcopy(raw.get("sequence_batching")),
        batch_inputs=tuple(copy.deepcopy(raw["batch_input"])),
        batch_outputs=tuple(copy.deepcopy(raw["batch_output"])),
        warmup=warmup_samples(raw.get("model_warmup", [])),
        raw=cast("dict[str, Any]", raw),
    )


def _tensor_spec(entry: TensorEntry) -> TensorSpec:
    reshape = entry.get("reshape")
    return TensorSpec(
        name=entry["name"], data_type=entry["data_type"], dims=tuple(entry["dims"]),
        reshape=None if reshape is None else tuple(reshape["shape"]),
        allow_ragged_batch=entry.get("allow_ragged_batch", False),
        optional=entry.get("optional", False),
    )
