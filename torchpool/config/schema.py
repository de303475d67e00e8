"""Triton's `model_config.proto` as the parsers need it: message by message,
which fields exist and of which type.

Both readers of a configuration follow this table: the text-format parser
(`pbtxt.py`) to know that `dims: [16]` is a list, that `input { ... }`
written once is still a list and that `parameters { key: .. value: .. }` is a
map; the JSON reader (`conform.py`) to turn `"dims": ["16"]` (protobuf's JSON
spelling of int64) into ints. A field or enum value the table does not know
is a load error, as in Triton: a typo such as `max_batch_sz: 8` must not load
a model with batching silently off.

The table is Triton's field set exactly (tests/unit/test_config_strict.py
compares it with the descriptor of the shipped `model_config_pb2`, which is
compiled from Triton's own .proto). It is written out here rather than read
from that descriptor at import time because the broker and every worker read
configurations, and the descriptor lives with the gRPC gateway: importing it
would tie the lower layer to the gateway package.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from .errors import unknown_enum_value


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
    enum: tuple[str, ...] = ()          # enum value names, by number

    @property
    def scalar(self) -> bool:
        return self.kind not in ("message", "map")


DATA_TYPE_ENUM = (
    "TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32",
    "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64",
    "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16",
)
INSTANCE_KIND_ENUM = ("KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL")
SECONDARY_DEVICE_KIND_ENUM = ("KIND_NVDLA",)
FORMAT_ENUM = ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW")
TIMEOUT_ACTION_ENUM = ("REJECT", "DELAY")
PRIORITY_ENUM = ("PRIORITY_DEFAULT", "PRIORITY_MAX", "PRIORITY_MIN")
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
    "ModelInstanceGroup.SecondaryDevice": {"kind": _enum(SECONDARY_DEVICE_KIND_ENUM), "device_id": _I},
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
        "max_candidate_sequences": _I, "preferred_batch_size": _rep(_I),
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
        "graph": _msg("ModelOptimizationPolicy.Graph"), "priority": _enum(PRIORITY_ENUM),
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
        "gpu_execution_accelerator": _msg("ModelOptimizationPolicy.ExecutionAccelerators.Accelerator", True),
        "cpu_execution_accelerator": _msg("ModelOptimizationPolicy.ExecutionAccelerators.Accelerator", True),
    },
    "ModelOptimizationPolicy.ExecutionAccelerators.Accelerator": {"name": _S, "parameters": _STR_MAP},
    "ModelOptimizationPolicy.PinnedMemoryBuffer": {"enable": _B},
    "ModelEnsembling": {"step": _msg("ModelEnsembling.Step", True), "max_inflight_requests": _U},
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

def map_entry_fields(spec: FieldSpec) -> dict[str, FieldSpec]:
    """A map entry as the text format writes it: `{ key: ... value: ... }`."""
    return {"key": FieldSpec(spec.key), "value": FieldSpec(spec.value, message=spec.message)}


def map_entry_name(message: str, field: str) -> str:
    """Protobuf's name for the entry type of a map field: `ModelConfig.ParametersEntry`."""
    return f"{message}.{''.join(part.capitalize() for part in field.split('_'))}Entry"


def enum_from_name(spec: FieldSpec, name: str, field: str, message: str) -> str:
    """A checked enum name (raises ValueError naming the field and the valid names)."""
    if name in spec.enum:
        return name
    offered = [n for n in spec.enum if not n.endswith("_INVALID")]
    raise ValueError(unknown_enum_value(name, field, message, offered))


def enum_from_number(spec: FieldSpec, number: int, field: str, message: str) -> str:
    """Protobuf accepts an enum by number; torchpool stores names."""
    if 0 <= number < len(spec.enum):
        return spec.enum[number]
    raise ValueError(f"unknown value {number} for field '{field}' in {message} "
                     f"(expected 0 to {len(spec.enum) - 1}, or a name: {', '.join(spec.enum)})")


def check_integer(kind: str, value: int) -> int:
    if kind == "uint" and value < 0:
        raise ValueError(f"expected a non-negative integer, got {value}")
    return value


def map_key(kind: str, key: Union[str, int, float]) -> str:
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
