"""Typed view of one model's configuration (Triton's model_config schema).

The canonical form of a configuration is the JSON dictionary Triton itself
uses (what `model_config()` returns); `ModelConfig` is the typed view the
broker and the workers read. `ModelConfig.from_json` validates the dictionary
and fills in Triton's defaults.

Three layers, each small enough to read on its own:

* `SCHEMA` -- which fields of Triton's `model_config.proto` are messages,
  repeated, maps or scalars of which type. The text-format parser (`pbtxt.py`)
  needs it to know that `dims: [16]` is a list and `input { ... }` written once
  is still a list; `from_json` needs it to turn `"dims": ["16"]` (protobuf's
  JSON spelling of int64) into ints.
* conform (`_conform_message`) -- JSON value types checked and coerced against
  the schema; unknown fields are kept untouched so that a configuration written
  for a newer Triton still loads.
* normalise (`_normalize`) -- Triton's validation rules and defaults, producing
  the `ModelConfig` and its `raw` JSON form.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, NoReturn, Optional


class ConfigError(Exception):
    """A configuration that cannot be used; the message names file and place."""


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
    kind: str                           # KIND_CPU | KIND_GPU | KIND_MODEL | KIND_AUTO
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


def _first_initial_state(value: Any) -> Optional[dict]:
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
    version_policy: dict[str, Any]      # {"latest": {"num_versions": 1}} | {"all": {}} | {"specific": {"versions": [..]}}
    default_model_filename: str         # "model.pt" unless set
    parameters: dict[str, str]          # key -> string_value
    dynamic_batching: Optional[dict[str, Any]] = None
    sequence_batching: Optional[dict[str, Any]] = None
    batch_inputs: tuple[dict[str, Any], ...] = ()
    batch_outputs: tuple[dict[str, Any], ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def input(self, name: str) -> Optional[TensorSpec]:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> Optional[TensorSpec]:
        return next((t for t in self.outputs if t.name == name), None)

    def sequence_states(self) -> list["SequenceState"]:
        """The implicit states of `sequence_batching`, in config order."""
        batching = self.sequence_batching or {}
        return [SequenceState(input_name=str(s["input_name"]), output_name=str(s["output_name"]),
                              data_type=str(s["data_type"]), dims=tuple(int(d) for d in s.get("dims", ())),
                              initial_state=_first_initial_state(s.get("initial_state")))
                for s in batching.get("state", ())]

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "<config>") -> "ModelConfig":
        """Validate a JSON-form configuration and fill in Triton's defaults.

        `d` is what `parse_pbtxt` returns or what `json.load` read from a
        `config.json` (int64 values written as strings are accepted). `name`
        must be set: the repository fills it from the directory name first.
        Raises `ConfigError("<source>: model '<name>': <field path>: <why>")`.
        """
        name = d.get("name") if isinstance(d, dict) else None
        try:
            if not isinstance(d, dict):
                raise _FieldError("", "a model configuration must be a JSON object")
            return _normalize(_conform_message(d, SCHEMA[ROOT_MESSAGE], ""))
        except _FieldError as err:
            raise ConfigError(_error_text(source, name, err)) from None

    def to_json(self) -> dict[str, Any]:
        """The normalised JSON form (a copy of `raw`, so callers may mutate it)."""
        return copy.deepcopy(self.raw)


# --------------------------------------------------------------------------
# Schema: the part of Triton's model_config.proto a parser has to know.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class FieldSpec:
    """The type of one protobuf field.

    `kind` is a scalar kind (int, uint, float, bool, string, enum), "message"
    or "map". Maps are `map<key, value>`: `key` is "string" or "uint",
    `value` is "message" (of type `message`) or a scalar kind.
    """

    kind: str
    repeated: bool = False
    message: Optional[str] = None
    key: str = "string"
    value: str = "message"
    enum: tuple[str, ...] = ()          # enum names by number, where torchpool needs them

    @property
    def scalar(self) -> bool:
        return self.kind not in ("message", "map")


SCALAR_KINDS = ("int", "uint", "float", "bool", "string", "enum")

DATA_TYPE_ENUM = (
    "TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32",
    "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64",
    "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16",
)
INSTANCE_KIND_ENUM = ("KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL")
FORMAT_ENUM = ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW")
TIMEOUT_ACTION_ENUM = ("REJECT", "DELAY")
BATCH_INPUT_KIND_ENUM = (
    "BATCH_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT",
    "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
    "BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN",
)
BATCH_OUTPUT_KIND_ENUM = ("BATCH_SCATTER_WITH_INPUT_SHAPE",)
CONTROL_KIND_ENUM = (
    "CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_READY",
    "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_CORRID",
)

_S, _I, _U, _F, _B = (FieldSpec(k) for k in ("string", "int", "uint", "float", "bool"))
_E = FieldSpec("enum")


def _rep(spec: FieldSpec) -> FieldSpec:
    return replace(spec, repeated=True)


def _msg(name: str, repeated: bool = False) -> FieldSpec:
    return FieldSpec("message", repeated=repeated, message=name)


def _map(message: Optional[str] = None, key: str = "string", value: str = "message") -> FieldSpec:
    return FieldSpec("map", message=message, key=key, value=value)


def _enum(table: tuple[str, ...]) -> FieldSpec:
    return FieldSpec("enum", enum=table)


_DATA_TYPE = _enum(DATA_TYPE_ENUM)
_STR_MAP = _map(value="string")

ROOT_MESSAGE = "ModelConfig"

SCHEMA: dict[str, dict[str, FieldSpec]] = {
    "ModelConfig": {
        "name": _S, "platform": _S, "backend": _S, "runtime": _S,
        "version_policy": _msg("ModelVersionPolicy"),
        "max_batch_size": _I,
        "input": _msg("ModelInput", True),
        "output": _msg("ModelOutput", True),
        "batch_input": _msg("BatchInput", True),
        "batch_output": _msg("BatchOutput", True),
        "optimization": _msg("ModelOptimizationPolicy"),
        "dynamic_batching": _msg("ModelDynamicBatching"),
        "sequence_batching": _msg("ModelSequenceBatching"),
        "ensemble_scheduling": _msg("ModelEnsembling"),
        "instance_group": _msg("ModelInstanceGroup", True),
        "default_model_filename": _S,
        "cc_model_filenames": _STR_MAP,
        "metric_tags": _STR_MAP,
        "parameters": _map("ModelParameter"),
        "model_warmup": _msg("ModelWarmup", True),
        "model_operations": _msg("ModelOperations"),
        "model_transaction_policy": _msg("ModelTransactionPolicy"),
        "model_repository_agents": _msg("ModelRepositoryAgents"),
        "response_cache": _msg("ModelResponseCache"),
        "model_metrics": _msg("ModelMetrics"),
    },
    "ModelVersionPolicy": {
        "latest": _msg("ModelVersionPolicy.Latest"),
        "all": _msg("ModelVersionPolicy.All"),
        "specific": _msg("ModelVersionPolicy.Specific"),
    },
    "ModelVersionPolicy.Latest": {"num_versions": _U},
    "ModelVersionPolicy.All": {},
    "ModelVersionPolicy.Specific": {"versions": _rep(_I)},
    "ModelTensorReshape": {"shape": _rep(_I)},
    "ModelInput": {
        "name": _S, "data_type": _DATA_TYPE, "format": _enum(FORMAT_ENUM),
        "dims": _rep(_I), "reshape": _msg("ModelTensorReshape"),
        "is_shape_tensor": _B, "allow_ragged_batch": _B, "optional": _B,
        "is_non_linear_format_io": _B,
    },
    "ModelOutput": {
        "name": _S, "data_type": _DATA_TYPE, "dims": _rep(_I),
        "reshape": _msg("ModelTensorReshape"), "label_filename": _S,
        "is_shape_tensor": _B, "is_non_linear_format_io": _B,
    },
    "BatchInput": {
        "kind": _enum(BATCH_INPUT_KIND_ENUM), "target_name": _rep(_S),
        "data_type": _DATA_TYPE, "source_input": _rep(_S),
    },
    "BatchOutput": {
        "target_name": _rep(_S), "kind": _enum(BATCH_OUTPUT_KIND_ENUM),
        "source_input": _rep(_S),
    },
    "ModelInstanceGroup": {
        "name": _S, "kind": _enum(INSTANCE_KIND_ENUM), "count": _I,
        "rate_limiter": _msg("ModelRateLimiter"), "gpus": _rep(_I),
        "secondary_devices": _msg("ModelInstanceGroup.SecondaryDevice", True),
        "profile": _rep(_S), "passive": _B, "host_policy": _S,
    },
    "ModelInstanceGroup.SecondaryDevice": {"kind": _E, "device_id": _I},
    "ModelRateLimiter": {
        "resources": _msg("ModelRateLimiter.Resource", True), "priority": _U,
    },
    "ModelRateLimiter.Resource": {"name": _S, "global": _B, "count": _U},
    "ModelParameter": {"string_value": _S},
    "ModelQueuePolicy": {
        "timeout_action": _enum(TIMEOUT_ACTION_ENUM),
        "default_timeout_microseconds": _U, "allow_timeout_override": _B,
        "max_queue_size": _U,
    },
    "ModelDynamicBatching": {
        "preferred_batch_size": _rep(_I), "max_queue_delay_microseconds": _U,
        "preserve_ordering": _B, "priority_levels": _U,
        "default_priority_level": _U,
        "default_queue_policy": _msg("ModelQueuePolicy"),
        "priority_queue_policy": _map("ModelQueuePolicy", key="uint"),
    },
    "ModelSequenceBatching": {
        "direct": _msg("ModelSequenceBatching.StrategyDirect"),
        "oldest": _msg("ModelSequenceBatching.StrategyOldest"),
        "max_sequence_idle_microseconds": _U,
        "control_input": _msg("ModelSequenceBatching.ControlInput", True),
        "state": _msg("ModelSequenceBatching.State", True),
        "iterative_sequence": _B,
    },
    "ModelSequenceBatching.StrategyDirect": {
        "max_queue_delay_microseconds": _U, "minimum_slot_utilization": _F,
    },
    "ModelSequenceBatching.StrategyOldest": {
        "max_candidate_sequences": _U, "preferred_batch_size": _rep(_I),
        "max_queue_delay_microseconds": _U, "preserve_ordering": _B,
    },
    "ModelSequenceBatching.ControlInput": {
        "name": _S, "control": _msg("ModelSequenceBatching.Control", True),
    },
    "ModelSequenceBatching.Control": {
        "kind": _enum(CONTROL_KIND_ENUM), "int32_false_true": _rep(_I),
        "fp32_false_true": _rep(_F), "bool_false_true": _rep(_B),
        "data_type": _DATA_TYPE,
    },
    "ModelSequenceBatching.State": {
        "input_name": _S, "output_name": _S, "data_type": _DATA_TYPE,
        "dims": _rep(_I),
        "initial_state": _msg("ModelSequenceBatching.InitialState", True),
        "use_same_buffer_for_input_output": _B, "use_growable_memory": _B,
    },
    "ModelSequenceBatching.InitialState": {
        "data_type": _DATA_TYPE, "dims": _rep(_I), "zero_data": _B,
        "data_file": _S, "name": _S,
    },
    "ModelOptimizationPolicy": {
        "graph": _msg("ModelOptimizationPolicy.Graph"), "priority": _E,
        "cuda": _msg("ModelOptimizationPolicy.Cuda"),
        "execution_accelerators": _msg("ModelOptimizationPolicy.ExecutionAccelerators"),
        "input_pinned_memory": _msg("ModelOptimizationPolicy.PinnedMemoryBuffer"),
        "output_pinned_memory": _msg("ModelOptimizationPolicy.PinnedMemoryBuffer"),
        "gather_kernel_buffer_threshold": _U, "eager_batching": _B,
    },
    "ModelOptimizationPolicy.Graph": {"level": _I},
    "ModelOptimizationPolicy.Cuda": {
        "graphs": _B, "busy_wait_events": _B,
        "graph_spec": _msg("ModelOptimizationPolicy.Cuda.GraphSpec", True),
        "output_copy_stream": _B,
    },
    "ModelOptimizationPolicy.Cuda.GraphSpec": {
        "batch_size": _I, "input": _map("ModelOptimizationPolicy.Cuda.GraphSpec.Shape"),
        "graph_lower_bound": _msg("ModelOptimizationPolicy.Cuda.GraphSpec.LowerBound"),
    },
    "ModelOptimizationPolicy.Cuda.GraphSpec.Shape": {"dim": _rep(_I)},
    "ModelOptimizationPolicy.Cuda.GraphSpec.LowerBound": {
        "batch_size": _I, "input": _map("ModelOptimizationPolicy.Cuda.GraphSpec.Shape"),
    },
    "ModelOptimizationPolicy.ExecutionAccelerators": {
        "gpu_execution_accelerator": _msg("ModelOptimizationPolicy.Accelerator", True),
        "cpu_execution_accelerator": _msg("ModelOptimizationPolicy.Accelerator", True),
    },
    "ModelOptimizationPolicy.Accelerator": {"name": _S, "parameters": _STR_MAP},
    "ModelOptimizationPolicy.PinnedMemoryBuffer": {"enable": _B},
    "ModelEnsembling": {"step": _msg("ModelEnsembling.Step", True)},
    "ModelEnsembling.Step": {
        "model_name": _S, "model_version": _I, "input_map": _STR_MAP,
        "output_map": _STR_MAP, "model_namespace": _S,
    },
    "ModelWarmup": {
        "name": _S, "batch_size": _U, "inputs": _map("ModelWarmup.Input"),
        "count": _U,
    },
    "ModelWarmup.Input": {
        "data_type": _DATA_TYPE, "dims": _rep(_I), "zero_data": _B,
        "random_data": _B, "input_data_file": _S,
    },
    "ModelOperations": {"op_library_filename": _rep(_S)},
    "ModelTransactionPolicy": {"decoupled": _B},
    "ModelRepositoryAgents": {"agents": _msg("ModelRepositoryAgents.Agent", True)},
    "ModelRepositoryAgents.Agent": {"name": _S, "parameters": _STR_MAP},
    "ModelResponseCache": {"enable": _B},
    "ModelMetrics": {"metric_control": _msg("ModelMetrics.MetricControl", True)},
    "ModelMetrics.MetricControl": {
        "metric_identifier": _msg("ModelMetrics.MetricControl.MetricIdentifier"),
        "histogram_options": _msg("ModelMetrics.MetricControl.HistogramOptions"),
    },
    "ModelMetrics.MetricControl.MetricIdentifier": {"family": _S},
    "ModelMetrics.MetricControl.HistogramOptions": {"buckets": _rep(_F)},
}


def message_fields(spec: Optional[FieldSpec]) -> Mapping[str, FieldSpec]:
    """The fields of a message-typed field; empty (all unknown) when untyped."""
    if spec is None or spec.message is None:
        return {}
    return SCHEMA.get(spec.message, {})


def map_entry_fields(spec: FieldSpec) -> dict[str, FieldSpec]:
    """A map entry as the text format writes it: `{ key: ... value: ... }`."""
    return {"key": FieldSpec(spec.key), "value": FieldSpec(spec.value, message=spec.message)}


def enum_name(spec: FieldSpec, number: int) -> str:
    """Protobuf accepts an enum by number; torchpool stores names."""
    if 0 <= number < len(spec.enum):
        return spec.enum[number]
    raise ValueError(f"enum value {number} is not known here; write the name instead")


def check_integer(kind: str, value: int) -> int:
    if kind == "uint" and value < 0:
        raise ValueError(f"expected a non-negative integer, got {value}")
    return value


def map_key(kind: str, key: Any) -> str:
    """Map keys are strings in the JSON form (JSON objects have no int keys)."""
    if kind == "string":
        if not isinstance(key, str):
            raise ValueError(f"map key must be a string, got {key!r}")
        return key
    try:
        number = int(key) if not isinstance(key, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < 0:
        raise ValueError(f"map key must be a non-negative integer, got {key!r}")
    return str(number)


def json_scalar(spec: FieldSpec, value: Any) -> Any:
    """Coerce one JSON scalar to the field's type (int64 may come as a string)."""
    kind = spec.kind
    if kind in ("int", "uint"):
        return check_integer(kind, _json_int(value))
    if kind == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {value!r}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if kind == "string":
        if isinstance(value, str):
            return value
        raise ValueError(f"expected a string, got {value!r}")
    # enum
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return enum_name(spec, value) if spec.enum else value
    raise ValueError(f"expected an enum name, got {value!r}")


def _json_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip(), 10)
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {value!r}")


# --------------------------------------------------------------------------
# Conform: JSON types checked against the schema.
# --------------------------------------------------------------------------

class _FieldError(Exception):
    """A problem at one field path; `from_json` adds the source and model."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def _fail(path: str, message: str) -> NoReturn:
    raise _FieldError(path, message)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _error_text(source: str, model: Any, err: _FieldError) -> str:
    parts = [source]
    if isinstance(model, str) and model:
        parts.append(f"model '{model}'")
    if err.path:
        parts.append(err.path)
    parts.append(err.message)
    return ": ".join(parts)


def _conform_message(d: Any, fields: Mapping[str, FieldSpec], path: str) -> dict[str, Any]:
    """A copy of `d` with every known field coerced; unknown fields kept as given."""
    if not isinstance(d, dict):
        _fail(path, f"expected an object, got {d!r}")
    out: dict[str, Any] = {}
    for name, value in d.items():
        spec = fields.get(name)
        if value is None:       # JSON null: protobuf reads it as "not set"
            continue
        out[name] = copy.deepcopy(value) if spec is None else _conform_field(value, spec, _join(path, name))
    return out


def _conform_field(value: Any, spec: FieldSpec, path: str) -> Any:
    if spec.kind == "map":
        return _conform_map(value, spec, path)
    if spec.repeated:
        items = value if isinstance(value, list) else [value]
        return [_conform_single(v, spec, f"{path}[{i}]") for i, v in enumerate(items)]
    if isinstance(value, list):
        _fail(path, "is not a repeated field; a list is not allowed here")
    return _conform_single(value, spec, path)


def _conform_single(value: Any, spec: FieldSpec, path: str) -> Any:
    if spec.kind == "message":
        return _conform_message(value, SCHEMA[spec.message], path)
    try:
        return json_scalar(spec, value)
    except ValueError as err:
        _fail(path, str(err))


def _conform_map(value: Any, spec: FieldSpec, path: str) -> dict[str, Any]:
    """JSON form `{"K": V}`; a list of `{key, value}` entries is accepted too."""
    if isinstance(value, dict):
        entries = list(value.items())
    elif isinstance(value, list) and all(isinstance(e, dict) for e in value):
        entries = [(e.get("key", "" if spec.key == "string" else 0), e.get("value")) for e in value]
    else:
        _fail(path, f"expected an object mapping keys to values, got {value!r}")
    value_spec = FieldSpec(spec.value, message=spec.message)
    out: dict[str, Any] = {}
    for key, item in entries:
        try:
            key = map_key(spec.key, key)
        except ValueError as err:
            _fail(path, str(err))
        if item is None:
            item = {} if spec.value == "message" else ("" if spec.value == "string" else 0)
        out[key] = _conform_single(item, value_spec, f"{path}[{key!r}]")
    return out


# --------------------------------------------------------------------------
# Normalise: Triton's validation rules and defaults.
# --------------------------------------------------------------------------

PLATFORM = "pytorch_libtorch"
BACKEND = "pytorch"
DEFAULT_MODEL_FILENAME = "model.pt"
SEQUENCE_IDLE_DEFAULT_MICROSECONDS = 1_000_000
INSTANCE_KINDS = ("KIND_AUTO", "KIND_CPU", "KIND_GPU", "KIND_MODEL")
VERSION_POLICIES = ("latest", "all", "specific")
BATCH_INPUT_DATA_TYPES = ("TYPE_INT32", "TYPE_FP32")
WILDCARD_DIM = -1

# The order of the canonical keys in `raw`; other keys follow as written.
_CANONICAL_ORDER = (
    "name", "platform", "backend", "max_batch_size", "input", "output",
    "batch_input", "batch_output", "instance_group", "version_policy",
    "default_model_filename", "parameters", "dynamic_batching", "sequence_batching",
)


def _normalize(cfg: dict[str, Any]) -> ModelConfig:
    """Validate a conformed dict and build the `ModelConfig` (with `raw`)."""
    name = _normalize_name(cfg)
    _check_platform(cfg)
    max_batch_size = cfg.get("max_batch_size", 0)
    if max_batch_size < 0:
        _fail("max_batch_size", f"'max_batch_size' must be non-negative value for {name}, got {max_batch_size}")
    inputs = _normalize_tensors(cfg, "input", max_batch_size)
    outputs = _normalize_tensors(cfg, "output", max_batch_size)
    cfg.update(
        platform=PLATFORM, backend=BACKEND, max_batch_size=max_batch_size,
        batch_input=_normalize_batch_inputs(cfg, inputs),
        batch_output=_normalize_batch_outputs(cfg, inputs, outputs),
        instance_group=_normalize_instance_groups(cfg, name),
        version_policy=_normalize_version_policy(cfg.get("version_policy")),
        default_model_filename=cfg.get("default_model_filename") or DEFAULT_MODEL_FILENAME,
        parameters={k: {"string_value": v.get("string_value", "")}
                    for k, v in cfg.get("parameters", {}).items()},
    )
    _normalize_dynamic_batching(cfg, max_batch_size)
    _normalize_sequence_batching(cfg, max_batch_size)
    raw = _in_canonical_order(cfg)
    return ModelConfig(
        name=name, platform=PLATFORM, backend=BACKEND, max_batch_size=max_batch_size,
        inputs=inputs, outputs=outputs,
        instance_groups=tuple(InstanceGroup(g["name"], g["kind"], g["count"], tuple(g["gpus"]))
                              for g in raw["instance_group"]),
        version_policy=copy.deepcopy(raw["version_policy"]),
        default_model_filename=raw["default_model_filename"],
        parameters={k: v["string_value"] for k, v in raw["parameters"].items()},
        dynamic_batching=copy.deepcopy(raw.get("dynamic_batching")),
        sequence_batching=copy.deepcopy(raw.get("sequence_batching")),
        batch_inputs=tuple(copy.deepcopy(raw["batch_input"])),
        batch_outputs=tuple(copy.deepcopy(raw["batch_output"])),
        raw=raw,
    )


def _in_canonical_order(cfg: dict[str, Any]) -> dict[str, Any]:
    ordered = {k: cfg[k] for k in _CANONICAL_ORDER if k in cfg}
    ordered.update((k, v) for k, v in cfg.items() if k not in ordered)
    return ordered


def _normalize_name(cfg: dict[str, Any]) -> str:
    name = cfg.get("name", "")
    if not name:
        _fail("name", "model configuration must specify 'name'")
    return name


def _check_platform(cfg: dict[str, Any]) -> None:
    """Only TorchScript models are served; missing both means "pytorch" (Triton
    would guess from the model file, and `model.pt` is PyTorch's)."""
    platform, backend = cfg.get("platform", ""), cfg.get("backend", "")
    only = f"(only {PLATFORM} / backend {BACKEND})"
    if platform and platform != PLATFORM:
        _fail("", f"platform '{platform}' is not served by torchpool {only}")
    if backend and backend != BACKEND:
        _fail("", f"backend '{backend}' is not served by torchpool {only}")


# -- inputs and outputs -------------------------------------------------------

def _normalize_tensors(cfg: dict[str, Any], kind: str, max_batch_size: int) -> tuple[TensorSpec, ...]:
    """Validate `input` or `output` entries, filling Triton's per-tensor defaults."""
    entries = cfg.get(kind, [])
    if not entries:
        _fail("", f"model configuration must contain at least one {kind}, none were specified.")
    seen: set[str] = set()
    specs = []
    for index, entry in enumerate(entries):
        path = f"{kind}[{index}]"
        spec = _tensor_spec(entry, kind, path, max_batch_size)
        if spec.name in seen:
            _fail(f"{path}.name", f"{kind} '{spec.name}' is specified more than once")
        seen.add(spec.name)
        defaults: dict[str, Any] = (
            {"format": "FORMAT_NONE", "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False}
            if kind == "input" else {"label_filename": "", "is_shape_tensor": False})
        entries[index] = _with_defaults(entry, defaults)
        specs.append(spec)
    return tuple(specs)


def _with_defaults(entry: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`entry` with missing fields filled, keeping the fields as written first."""
    return {**entry, **{k: v for k, v in defaults.items() if k not in entry}}


def _tensor_spec(entry: dict[str, Any], kind: str, path: str, max_batch_size: int) -> TensorSpec:
    what = f"model {kind}"
    name = entry.get("name", "")
    if not name:
        _fail(f"{path}.name", f"{what} must specify 'name'")
    what = f"{what} '{name}'"
    data_type = entry.get("data_type", "TYPE_INVALID")
    if data_type == "TYPE_INVALID":
        _fail(f"{path}.data_type", f"{what} must specify 'data_type'")
    if data_type not in CONFIG_TO_WIRE:
        _fail(f"{path}.data_type", f"unknown data type '{data_type}'")
    dims = entry.get("dims", [])
    if not dims:
        _fail(f"{path}.dims", f"{what} must specify 'dims'")
    _check_dims(dims, f"{path}.dims", f"{what} dimension")
    reshape = _checked_reshape(entry, dims, path, what, max_batch_size)
    if kind == "input":
        _check_format(entry, dims, path, what)
    return TensorSpec(
        name=name, data_type=data_type, dims=tuple(dims),
        reshape=None if reshape is None else tuple(reshape),
        allow_ragged_batch=entry.get("allow_ragged_batch", False),
        optional=entry.get("optional", False),
    )


def _check_dims(dims: list[int], path: str, what: str) -> None:
    for dim in dims:
        if dim < 1 and dim != WILDCARD_DIM:
            _fail(path, f"{what} must be integer >= 1, or -1 to indicate a variable-size dimension, got {dim}")


def _checked_reshape(entry: dict[str, Any], dims: list[int], path: str, what: str,
                     max_batch_size: int) -> Optional[list[int]]:
    """Triton's rule: same element count, compared between -1 dimensions."""
    if "reshape" not in entry:
        return None
    shape = entry["reshape"].get("shape", [])
    entry["reshape"] = {"shape": shape}
    path = f"{path}.reshape"
    if not shape and max_batch_size == 0:
        _fail(path, f"{what} cannot have empty reshape for non-batching model")
    _check_dims(shape, f"{path}.shape", f"{what} reshape dimension")
    if not shape and _element_counts(dims) == [1]:
        return shape                    # [1] -> [] makes a scalar per batch item
    if _element_counts(dims) != _element_counts(shape):
        _fail(path, f"{what} has different size for dims {dims} and reshape {shape}")
    return shape


def _element_counts(dims: list[int]) -> list[int]:
    """Element counts of the runs between variable-size (-1) dimensions."""
    counts = [1]
    for dim in dims:
        if dim == WILDCARD_DIM:
            counts.append(1)
        else:
            counts[-1] *= dim
    return counts


def _check_format(entry: dict[str, Any], dims: list[int], path: str, what: str) -> None:
    fmt = entry.get("format", "FORMAT_NONE")
    if fmt not in FORMAT_ENUM:
        _fail(f"{path}.format", f"unknown format '{fmt}'")
    if fmt != "FORMAT_NONE" and len(dims) != 3:
        _fail(f"{path}.format", f"{what} NHWC/NCHW require 3 dims")


# -- batch inputs and outputs -------------------------------------------------

def _normalize_batch_inputs(cfg: dict[str, Any], inputs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
    names = {t.name for t in inputs}
    out = []
    for index, entry in enumerate(cfg.get("batch_input", [])):
        path = f"batch_input[{index}]"
        entry = {"kind": BATCH_INPUT_KIND_ENUM[0], "target_name": [], "source_input": [], **entry}
        kind = entry["kind"]
        if kind not in BATCH_INPUT_KIND_ENUM:
            _fail(f"{path}.kind", f"unknown batch input kind '{kind}'")
        if not entry["target_name"]:
            _fail(f"{path}.target_name", "batch input must specify 'target_name'")
        if entry.get("data_type") not in BATCH_INPUT_DATA_TYPES:
            _fail(f"{path}.data_type", "batch input data type must be TYPE_INT32 or TYPE_FP32")
        _check_sources(entry["source_input"], names, path, f"batch input kind '{kind}'")
        out.append(entry)
    return out


def _normalize_batch_outputs(cfg: dict[str, Any], inputs: tuple[TensorSpec, ...],
                             outputs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
    input_names, output_names = {t.name for t in inputs}, {t.name for t in outputs}
    out = []
    for index, entry in enumerate(cfg.get("batch_output", [])):
        path = f"batch_output[{index}]"
        entry = {"kind": BATCH_OUTPUT_KIND_ENUM[0], "target_name": [], "source_input": [], **entry}
        kind = entry["kind"]
        if kind not in BATCH_OUTPUT_KIND_ENUM:
            _fail(f"{path}.kind", f"unknown batch output kind '{kind}'")
        _check_sources(entry["source_input"], input_names, path, f"batch output kind '{kind}'")
        targets = entry["target_name"]
        for target in targets:
            if target not in output_names:
                _fail(f"{path}.target_name", f"unknown target output name '{target}'")
        if len(set(targets)) != len(targets):
            _fail(f"{path}.target_name", "a target output name can only be specified once")
        out.append(entry)
    return out


def _check_sources(sources: list[str], names: set[str], path: str, what: str) -> None:
    if len(sources) != 1:
        _fail(f"{path}.source_input", f"{what} expects 1 source input, got {len(sources)}")
    if sources[0] not in names:
        _fail(f"{path}.source_input", f"unknown source input name '{sources[0]}'")


# -- instance groups and versions ---------------------------------------------

def _normalize_instance_groups(cfg: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """Triton's naming: the implicit group is named after the model, an unnamed
    explicit group `<model>_<index>`; a count of 0 (proto3 "unset") means 1."""
    groups = cfg.get("instance_group") or [{"name": model}]
    out = []
    for index, group in enumerate(groups):
        path = f"instance_group[{index}]"
        group = {"name": group.get("name") or f"{model}_{index}", "kind": group.get("kind", "KIND_AUTO"),
                 "count": group.get("count", 0), "gpus": group.get("gpus", []),
                 **{k: v for k, v in group.items() if k not in ("name", "kind", "count", "gpus")}}
        label = f"instance group {group['name']} of model {model}"
        if group["kind"] not in INSTANCE_KINDS:
            _fail(f"{path}.kind", f"unknown instance group kind '{group['kind']}' (expected one of {', '.join(INSTANCE_KINDS)})")
        if group["count"] < 0:
            _fail(f"{path}.count", f"{label} must specify 'count' >= 1, got {group['count']}")
        group["count"] = group["count"] or 1
        if any(gpu < 0 for gpu in group["gpus"]):
            _fail(f"{path}.gpus", f"{label} lists a negative GPU id: {group['gpus']}")
        if group["gpus"] and group["kind"] in ("KIND_CPU", "KIND_MODEL"):
            _fail(f"{path}.gpus", f"{label} has kind {group['kind']} but specifies one or more GPUs")
        out.append(group)
    return out


def _normalize_version_policy(policy: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Exactly one of latest / all / specific; none at all means latest 1."""
    if not policy:
        return {"latest": {"num_versions": 1}}
    chosen = [k for k in VERSION_POLICIES if k in policy]
    if len(chosen) != 1:
        found = " and ".join(chosen) if chosen else ", ".join(sorted(policy))
        _fail("version_policy", f"must set exactly one of 'latest', 'all' or 'specific', got {found}")
    choice = chosen[0]
    if choice == "all":
        return {"all": {}}
    if choice == "latest":
        num = policy["latest"].get("num_versions", 0)
        if num < 1:
            _fail("version_policy.latest.num_versions", f"must be >= 1, got {num}")
        return {"latest": {"num_versions": num}}
    versions = policy["specific"].get("versions", [])
    if not versions:
        _fail("version_policy.specific.versions", "must list at least one version")
    if min(versions) < 1:
        _fail("version_policy.specific.versions", f"versions must be >= 1, got {min(versions)}")
    return {"specific": {"versions": sorted(set(versions))}}


# -- schedulers ---------------------------------------------------------------

_QUEUE_POLICY_DEFAULTS = {
    "timeout_action": "REJECT", "default_timeout_microseconds": 0,
    "allow_timeout_override": False, "max_queue_size": 0,
}


def _queue_policy(policy: Optional[dict[str, Any]], path: str) -> dict[str, Any]:
    policy = {**_QUEUE_POLICY_DEFAULTS, **(policy or {})}
    if policy["timeout_action"] not in TIMEOUT_ACTION_ENUM:
        _fail(f"{path}.timeout_action", f"unknown timeout action '{policy['timeout_action']}' (expected REJECT or DELAY)")
    return policy


def _normalize_dynamic_batching(cfg: dict[str, Any], max_batch_size: int) -> None:
    """Triton's defaults and checks; no preferred size means max_batch_size."""
    if "dynamic_batching" not in cfg:
        return
    name = cfg["name"]
    path = "dynamic_batching"
    db = {"preferred_batch_size": [], "max_queue_delay_microseconds": 0, "preserve_ordering": False,
          "priority_levels": 0, "default_priority_level": 0, **cfg["dynamic_batching"]}
    if not db["preferred_batch_size"] and max_batch_size > 0:
        db["preferred_batch_size"] = [max_batch_size]
    for size in db["preferred_batch_size"]:
        if size <= 0:
            _fail(f"{path}.preferred_batch_size", f"dynamic batching preferred size must be positive for {name}")
        if size > max_batch_size:
            _fail(f"{path}.preferred_batch_size", f"dynamic batching preferred size must be <= max batch size for {name}")
    db["default_queue_policy"] = _queue_policy(db.get("default_queue_policy"), f"{path}.default_queue_policy")
    db["priority_queue_policy"] = {
        level: _queue_policy(policy, f"{path}.priority_queue_policy[{level!r}]")
        for level, policy in db.get("priority_queue_policy", {}).items()}
    _check_priorities(db, name, path)
    cfg["dynamic_batching"] = db


def _check_priorities(db: dict[str, Any], name: str, path: str) -> None:
    levels = db["priority_levels"]
    if levels:
        if not 1 <= db["default_priority_level"] <= levels:
            _fail(f"{path}.default_priority_level", f"default priority level must be in range [1, {levels}] for {name}")
        for level in db["priority_queue_policy"]:
            if not 1 <= int(level) <= levels:
                _fail(f"{path}.priority_queue_policy",
                      f"priority queue policy must have priority level in range [1, {levels}] for {name}")
    if db["preserve_ordering"]:
        if levels > 1:
            _fail(f"{path}.preserve_ordering", f"Only one priority level is allowed when 'preserve_ordering' is true for {name}")
        policies = [db["default_queue_policy"], *db["priority_queue_policy"].values()]
        if any(p["default_timeout_microseconds"] and p["timeout_action"] == "DELAY" for p in policies):
            _fail(f"{path}.preserve_ordering",
                  f"Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for {name}")


def _normalize_sequence_batching(cfg: dict[str, Any], max_batch_size: int) -> None:
    """Light checks only (the sequence batcher validates its controls); fills
    Triton's 1 s idle default and the oldest strategy's preferred size."""
    if "sequence_batching" not in cfg:
        return
    path = "sequence_batching"
    sb = {"control_input": [], "state": [], **cfg["sequence_batching"]}
    if "direct" in sb and "oldest" in sb:
        _fail(path, "must set at most one of 'direct' or 'oldest'")
    if not sb.get("max_sequence_idle_microseconds"):
        sb["max_sequence_idle_microseconds"] = SEQUENCE_IDLE_DEFAULT_MICROSECONDS
    if "oldest" in sb and not sb["oldest"].get("preferred_batch_size") and max_batch_size > 0:
        sb["oldest"] = {**sb["oldest"], "preferred_batch_size": [max_batch_size]}
    for index, control in enumerate(sb["control_input"]):
        if not control.get("name"):
            _fail(f"{path}.control_input[{index}].name",
                  f"sequence batching control tensor must have a name for {cfg['name']}")
    cfg["sequence_batching"] = sb
