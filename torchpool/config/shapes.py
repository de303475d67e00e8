"""The fixed shapes of a normalised configuration that readers index into:
`ModelConfig.raw` (`RawConfig`) and its `dynamic_batching`,
`sequence_batching`, `version_policy`, `batch_inputs` / `batch_outputs`,
tensor and instance-group entries (Triton's model_config messages, in their
JSON form). Messages no reader here indexes are `JSONObject`s. Every key is optional to the checker (`total=False`):
`normalize.py` fills the defaults named in each, so a reader of a
normalised config finds them.
"""
from __future__ import annotations

from typing import TypedDict

from .jsonvalue import JSONObject

__all__ = ["QueuePolicy", "DynamicBatching", "SequenceControl", "ControlInput", "InitialState",
           "SequenceStateEntry", "StrategyDirect", "StrategyOldest", "SequenceBatching",
           "LatestVersions", "SpecificVersions", "VersionPolicy", "BatchInput", "BatchOutput",
           "Reshape", "TensorEntry", "InstanceGroupEntry", "Parameter", "WarmupInputEntry", "WarmupEntry",
           "RawConfig"]


class QueuePolicy(TypedDict, total=False):
    timeout_action: str                     # "REJECT" | "DELAY" (filled)
    default_timeout_microseconds: int       # (filled)
    allow_timeout_override: bool            # (filled)
    max_queue_size: int                     # (filled)


class DynamicBatching(TypedDict, total=False):
    preferred_batch_size: list[int]         # (filled: [max_batch_size] when none and batching)
    max_queue_delay_microseconds: int       # (filled)
    preserve_ordering: bool                 # (filled)
    priority_levels: int                    # (filled)
    default_priority_level: int             # (filled)
    default_queue_policy: QueuePolicy       # (filled)
    priority_queue_policy: dict[str, QueuePolicy]   # by level (filled)


class SequenceControl(TypedDict, total=False):
    kind: str                               # CONTROL_SEQUENCE_START, ...
    int32_false_true: list[int]
    fp32_false_true: list[float]
    bool_false_true: list[bool]
    data_type: str


class ControlInput(TypedDict, total=False):
    name: str
    control: list[SequenceControl]


class InitialState(TypedDict, total=False):
    data_type: str
    dims: list[int]
    zero_data: bool
    data_file: str
    name: str


class SequenceStateEntry(TypedDict, total=False):
    input_name: str
    output_name: str
    data_type: str
    dims: list[int]
    initial_state: list[InitialState]
    use_same_buffer_for_input_output: bool
    use_growable_memory: bool


class StrategyDirect(TypedDict, total=False):
    max_queue_delay_microseconds: int
    minimum_slot_utilization: float


class StrategyOldest(TypedDict, total=False):
    max_candidate_sequences: int
    preferred_batch_size: list[int]         # (filled: [max_batch_size] when none and batching)
    max_queue_delay_microseconds: int
    preserve_ordering: bool


class SequenceBatching(TypedDict, total=False):
    max_sequence_idle_microseconds: int     # (filled)
    control_input: list[ControlInput]       # (filled)
    direct: StrategyDirect
    oldest: StrategyOldest
    state: list[SequenceStateEntry]         # (filled)
    iterative_sequence: bool


class LatestVersions(TypedDict, total=False):
    num_versions: int


class SpecificVersions(TypedDict, total=False):
    versions: list[int]


class VersionPolicy(TypedDict, total=False):
    """Exactly one key: {"latest": {"num_versions": 1}} | {"all": {}} | {"specific": {"versions": [..]}}."""
    latest: LatestVersions
    all: dict[str, object]
    specific: SpecificVersions


class BatchInput(TypedDict, total=False):
    kind: str                               # BATCH_ELEMENT_COUNT, ... (filled)
    target_name: list[str]                  # (filled)
    data_type: str
    source_input: list[str]                 # (filled)


class BatchOutput(TypedDict, total=False):
    target_name: list[str]                  # (filled)
    kind: str                               # BATCH_SCATTER_WITH_INPUT_SHAPE (filled)
    source_input: list[str]                 # (filled)


class Reshape(TypedDict, total=False):
    shape: list[int]


class TensorEntry(TypedDict, total=False):
    """An `input` or an `output` entry."""
    name: str
    data_type: str                          # TYPE_FP32, ...
    format: str                             # inputs (filled)
    dims: list[int]
    reshape: Reshape
    is_shape_tensor: bool                   # (filled)
    allow_ragged_batch: bool                # inputs (filled)
    optional: bool                          # inputs (filled)
    label_filename: str                     # outputs (filled)
    is_non_linear_format_io: bool


class InstanceGroupEntry(TypedDict, total=False):
    name: str                               # (filled)
    kind: str                               # KIND_CPU | KIND_GPU | KIND_MODEL (filled, KIND_AUTO resolved)
    count: int                              # (filled, >= 1)
    gpus: list[int]                         # (filled)
    rate_limiter: JSONObject
    secondary_devices: list[JSONObject]
    profile: list[str]
    passive: bool
    host_policy: str


class Parameter(TypedDict, total=False):
    string_value: str                       # (filled)


class WarmupInputEntry(TypedDict, total=False):
    data_type: str
    dims: list[int]
    zero_data: bool
    random_data: bool
    input_data_file: str


class WarmupEntry(TypedDict, total=False):
    name: str
    batch_size: int
    inputs: dict[str, WarmupInputEntry]
    count: int


class RawConfig(TypedDict, total=False):
    """A normalised configuration (`ModelConfig.raw`, what `model_config()` answers)."""
    name: str
    platform: str
    backend: str
    runtime: str
    version_policy: VersionPolicy
    max_batch_size: int
    input: list[TensorEntry]
    output: list[TensorEntry]
    batch_input: list[BatchInput]
    batch_output: list[BatchOutput]
    optimization: JSONObject
    dynamic_batching: DynamicBatching
    sequence_batching: SequenceBatching
    ensemble_scheduling: JSONObject
    instance_group: list[InstanceGroupEntry]
    default_model_filename: str
    cc_model_filenames: dict[str, str]
    metric_tags: dict[str, str]
    parameters: dict[str, Parameter]
    model_warmup: list[WarmupEntry]
    model_operations: JSONObject
    model_transaction_policy: JSONObject
    model_repository_agents: JSONObject
    response_cache: JSONObject
    model_metrics: JSONObject
