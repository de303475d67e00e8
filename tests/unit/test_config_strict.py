"""Strict configuration: every field and enum value is Triton's, at any depth,
with file:line:column and a "did you mean"; KIND_AUTO resolved for the host;
`model_warmup` parsed and checked against the model."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from torchpool.broker.registry import Registry
from torchpool.config import ConfigError, InstanceGroup, ModelConfig, load_model_entry, parse_pbtxt
from torchpool.config.devices import visible_gpus
from torchpool.config.schema import SCHEMA, FieldSpec
from torchpool.config.warmup import WarmupInput, WarmupSample

IO = """
max_batch_size: 8
input { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }
input { name: "INPUT__1" data_type: TYPE_FP32 dims: [ -1 ] optional: true }
output { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 16 ] }
"""


def parse_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_pbtxt(text, "config.pbtxt")
    return str(info.value)


def config(text: str, gpus: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig.from_json({**parse_pbtxt(IO + text, "config.pbtxt"), "name": "m"}, "config.pbtxt",
                                 gpus=gpus)


def config_error(text: str, gpus: tuple[int, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        config(text, gpus)
    return str(info.value)


# ---------------------------------------------------------------- unknown fields

def test_unknown_top_level_field_is_an_error_with_a_suggestion() -> None:
    assert parse_error('name: "m"\n\nmax_batch_sz: 8\n') == (
        "config.pbtxt:3:1: unknown field 'max_batch_sz' in ModelConfig (did you mean 'max_batch_size'?)")


def test_an_unknown_field_far_from_any_name_has_no_suggestion() -> None:
    assert parse_error("  zzzz: 1") == "config.pbtxt:1:3: unknown field 'zzzz' in ModelConfig"


def test_suggestions_ignore_case() -> None:
    assert parse_error("Max_Batch_Size: 8") == (
        "config.pbtxt:1:1: unknown field 'Max_Batch_Size' in ModelConfig (did you mean 'max_batch_size'?)")


@pytest.mark.parametrize("text, message", [
    ('input { name: "X" dim: [ 4 ] }',
     "1:19: unknown field 'dim' in ModelInput (did you mean 'dims'?)"),
    ('output [ { name: "Y" data_typ: TYPE_FP32 } ]',
     "1:22: unknown field 'data_typ' in ModelOutput (did you mean 'data_type'?)"),
    ("instance_group [ { count: 1 kinds: KIND_CPU } ]",
     "1:29: unknown field 'kinds' in ModelInstanceGroup (did you mean 'kind'?)"),
    ("dynamic_batching {\n  max_queue_delay_microsecond: 100\n}",
     "2:3: unknown field 'max_queue_delay_microsecond' in ModelDynamicBatching "
     "(did you mean 'max_queue_delay_microseconds'?)"),
    ("dynamic_batching { default_queue_policy { max_queue_sz: 2 } }",
     "1:43: unknown field 'max_queue_sz' in ModelQueuePolicy (did you mean 'max_queue_size'?)"),
    ("sequence_batching { state { input_name: \"s\" dim: 1 } }",
     "1:45: unknown field 'dim' in ModelSequenceBatching.State (did you mean 'dims'?)"),
    ("sequence_batching { control_input { name: \"S\" control { knd: CONTROL_SEQUENCE_START } } }",
     "1:57: unknown field 'knd' in ModelSequenceBatching.Control (did you mean 'kind'?)"),
    ('parameters { key: "A" vale { string_value: "1" } }',
     "1:23: unknown field 'vale' in ModelConfig.ParametersEntry (did you mean 'value'?)"),
    ('parameters { key: "A" value { string_valu: "1" } }',
     "1:31: unknown field 'string_valu' in ModelParameter (did you mean 'string_value'?)"),
    ("optimization { cuda { graph: true } }",
     "1:23: unknown field 'graph' in ModelOptimizationPolicy.Cuda (did you mean 'graphs'?)"),
    ('model_warmup { name: "w" batch_sz: 1 }',
     "1:26: unknown field 'batch_sz' in ModelWarmup (did you mean 'batch_size'?)"),
    ('model_warmup { inputs { key: "X" value { zero_date: true } } }',
     "1:42: unknown field 'zero_date' in ModelWarmup.Input (did you mean 'zero_data'?)"),
    ("version_policy { specific { version: [ 1 ] } }",
     "1:29: unknown field 'version' in ModelVersionPolicy.Specific (did you mean 'versions'?)"),
    ("version_policy { newest { } }", "1:18: unknown field 'newest' in ModelVersionPolicy"),
])
def test_unknown_fields_at_every_depth(text: str, message: str) -> None:
    assert parse_error(text) == f"config.pbtxt:{message}"


# ---------------------------------------------------------------- enums and types

@pytest.mark.parametrize("text, message", [
    ("instance_group { kind: KIND_CPUU }",
     "1:24: unknown value 'KIND_CPUU' for field 'kind' in ModelInstanceGroup (did you mean 'KIND_CPU'?)"),
    ('input {\n  name: "X"\n  data_type: TYPE_FLOAT32\n}',
     "3:14: unknown value 'TYPE_FLOAT32' for field 'data_type' in ModelInput (did you mean 'TYPE_FP32'?)"),
    ("input { data_type: fp32 }",
     "1:20: unknown value 'fp32' for field 'data_type' in ModelInput (did you mean 'TYPE_FP32'?)"),
    ("dynamic_batching { default_queue_policy { timeout_action: DROP } }",
     "1:59: unknown value 'DROP' for field 'timeout_action' in ModelQueuePolicy (expected one of REJECT, DELAY)"),
    ("optimization { priority: PRIORITY_HIGH }",
     "1:26: unknown value 'PRIORITY_HIGH' for field 'priority' in ModelOptimizationPolicy "
     "(did you mean 'PRIORITY_MIN'?)"),
    ("instance_group { kind: 7 }",
     "1:24: unknown value 7 for field 'kind' in ModelInstanceGroup "
     "(expected 0 to 3, or a name: KIND_AUTO, KIND_GPU, KIND_CPU, KIND_MODEL)"),
])
def test_unknown_enum_values_have_line_column_and_a_hint(text: str, message: str) -> None:
    assert parse_error(text) == f"config.pbtxt:{message}"


@pytest.mark.parametrize("text, message", [
    ('max_batch_size: "8"', "1:17: field 'max_batch_size': expected an integer, found '\"8\"'"),
    ("instance_group { count: two }", "1:25: field 'count': expected an integer, found 'two'"),
    ("input { optional: yes }", "1:19: field 'optional': expected true or false, found 'yes'"),
    ("model_warmup { batch_size: -1 }", "1:28: field 'batch_size': expected a non-negative integer, got -1"),
])
def test_wrong_types_name_the_field(text: str, message: str) -> None:
    assert parse_error(text) == f"config.pbtxt:{message}"


def test_a_load_error_names_the_file_as_the_repository_gives_it(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(IO + "max_batch_sz: 8\n")
    entry = load_model_entry(tmp_path, "m")
    assert entry.config is None
    assert entry.error == (f"{model_dir / 'config.pbtxt'}:6:1: unknown field 'max_batch_sz' in ModelConfig "
                           "(did you mean 'max_batch_size'?)")


def test_config_json_is_as_strict(tmp_path: Path) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    data = {"input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4], "is_optional": True}],
            "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}
    (model_dir / "config.json").write_text(json.dumps(data))
    assert load_model_entry(tmp_path, "m").error == (
        f"{model_dir / 'config.json'}: model 'm': input[0]: unknown field 'is_optional' in ModelInput "
        "(did you mean 'optional'?)")


def test_a_load_request_config_is_as_strict(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    override = {"input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
                "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
                "instance_group": [{"kind": "KIND_CPUS"}]}
    assert load_model_entry(tmp_path, "m", json.dumps(override)).error == (
        "load('m') config: model 'm': instance_group[0].kind: unknown value 'KIND_CPUS' for field 'kind' "
        "in ModelInstanceGroup (did you mean 'KIND_CPU'?)")
    assert load_model_entry(tmp_path, "m", "{not json").error.startswith("load('m') config: not a JSON object: ")


def test_tritons_fields_that_change_nothing_here_are_accepted() -> None:
    cfg = config("""
        backend: "pytorch"  platform: "pytorch_libtorch"  runtime: ""
        model_repository_agents { agents { name: "checksum" parameters { key: "MD5:1/model.pt" value: "x" } } }
        response_cache { enable: false }
        model_metrics { metric_control { metric_identifier { family: "nv_inference_request_duration_us" }
                                         histogram_options { buckets: [ 100, 500 ] } } }
        metric_tags { key: "team" value: "search" }
        optimization { graph { level: 1 } input_pinned_memory { enable: true } }
        instance_group { kind: KIND_CPU rate_limiter { resources { name: "R" count: 1 } priority: 1 } }
    """)
    assert cfg.raw["response_cache"] == {"enable": False}
    assert cfg.raw["metric_tags"] == {"team": "search"}
    assert cfg.raw["model_repository_agents"]["agents"][0]["name"] == "checksum"


def test_the_schema_is_tritons_model_config_proto() -> None:
    """Every message, field, type, label and enum value name (in number order)
    of the descriptor compiled from Triton's model_config.proto."""
    from google.protobuf.descriptor import FieldDescriptor as F

    from torchpool.gateway.proto import model_config_pb2

    kinds = {F.TYPE_INT32: "int", F.TYPE_INT64: "int", F.TYPE_UINT32: "uint", F.TYPE_UINT64: "uint",
             F.TYPE_FLOAT: "float", F.TYPE_DOUBLE: "float", F.TYPE_BOOL: "bool", F.TYPE_STRING: "string",
             F.TYPE_ENUM: "enum", F.TYPE_MESSAGE: "message"}
    package = "inference."

    def spec_of(f) -> FieldSpec:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            message = value.message_type.full_name[len(package):] if value.message_type else None
            return FieldSpec("map", message=message, key=kinds[key.type], value=kinds[value.type])
        enum = tuple(v.name for v in f.enum_type.values) if f.enum_type else ()
        message = f.message_type.full_name[len(package):] if f.message_type else None
        return FieldSpec(kinds[f.type], repeated=f.is_repeated, message=message, enum=enum)

    expected: dict[str, dict[str, FieldSpec]] = {}

    def walk(message) -> None:
        if message.GetOptions().map_entry:
            return
        expected[message.full_name[len(package):]] = {f.name: spec_of(f) for f in message.fields}
        for nested in message.nested_types:
            walk(nested)

    for message in model_config_pb2.DESCRIPTOR.message_types_by_name.values():
        walk(message)
    # every message the root reaches is in the table, and exactly as Triton declares it
    reached, todo = set(), ["ModelConfig"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(s.message for s in expected[name].values() if s.message)
    assert set(SCHEMA) == reached
    for name in reached:
        assert SCHEMA[name] == expected[name], name


# ---------------------------------------------------------------- KIND_AUTO

def test_kind_auto_is_kind_cpu_without_a_gpu() -> None:
    cfg = config("")
    assert cfg.instance_groups == (InstanceGroup("m", "KIND_CPU", 1, ()),)
    assert cfg.raw["instance_group"] == [{"name": "m", "kind": "KIND_CPU", "count": 1, "gpus": []}]
    assert config("instance_group { count: 2 kind: KIND_AUTO }").instance_groups == (
        InstanceGroup("m_0", "KIND_CPU", 2, ()),)


def test_kind_auto_is_kind_gpu_with_the_visible_gpus() -> None:
    cfg = config("instance_group [ { count: 2 }, { kind: KIND_GPU }, { kind: KIND_GPU gpus: [ 1 ] } ]",
                 gpus=(0, 1))
    assert cfg.instance_groups == (InstanceGroup("m_0", "KIND_GPU", 2, (0, 1)),
                                   InstanceGroup("m_1", "KIND_GPU", 1, (0, 1)),
                                   InstanceGroup("m_2", "KIND_GPU", 1, (1,)))
    assert cfg.raw["instance_group"][0] == {"name": "m_0", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}
    # normalising the answer again changes nothing
    assert ModelConfig.from_json(cfg.raw, "c", gpus=(0, 1)).raw == cfg.raw


def test_kind_auto_with_gpus_on_a_host_without_gpu() -> None:
    assert config_error("instance_group { gpus: [ 0 ] }") == (
        "config.pbtxt: model 'm': instance_group[0].gpus: instance group m_0 of model m has kind "
        "KIND_AUTO (KIND_CPU on this host: no GPU is visible) but specifies one or more GPUs")


def test_by_default_the_hosts_gpus_resolve_kind_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    kind = "KIND_GPU" if visible_gpus() else "KIND_CPU"
    assert config_default_gpus().instance_groups[0].kind == kind
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert visible_gpus() == []
    assert config_default_gpus().instance_groups[0].kind == "KIND_CPU"


def config_default_gpus() -> ModelConfig:
    return ModelConfig.from_json({**parse_pbtxt(IO), "name": "m"}, "config.pbtxt")


# ---------------------------------------------------------------- versions

def test_the_registry_logs_a_missing_specific_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model_dir = tmp_path / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(IO + "version_policy { specific { versions: [ 1, 4 ] } }")
    entry = load_model_entry(tmp_path, "m")
    with caplog.at_level(logging.WARNING, logger="torchpool.broker"):
        registry = Registry([entry])
    assert sorted(registry.models["m"].versions) == [1]
    assert [r.getMessage() for r in caplog.records] == [
        f"version 4 is specified for model 'm', but the version directory is not present in {model_dir}; "
        "serving version 1"]


# ---------------------------------------------------------------- model_warmup

WARMUP = """
model_warmup [
  { name: "zeros" batch_size: 4 count: 3
    inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } } },
  { name: "mixed" batch_size: 1
    inputs [ { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 16 ] random_data: true } },
             { key: "INPUT__1" value { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "in1.bin" } } ] },
  { name: "skipped" batch_size: 0 }
]
"""


def test_model_warmup_is_parsed_into_typed_samples() -> None:
    cfg = config(WARMUP)
    assert cfg.warmup == (
        WarmupSample("zeros", 4, {"INPUT__0": WarmupInput("TYPE_FP32", (16,), "zero")}, count=3),
        WarmupSample("mixed", 1, {"INPUT__0": WarmupInput("TYPE_FP32", (16,), "random"),
                                  "INPUT__1": WarmupInput("TYPE_FP32", (3,), "file", "in1.bin")}, count=1),
    )
    # model_config shows every sample as Triton does, defaults filled (count 0 = once)
    assert cfg.raw["model_warmup"] == [
        {"name": "zeros", "batch_size": 4, "count": 3,
         "inputs": {"INPUT__0": {"data_type": "TYPE_FP32", "dims": [16], "zero_data": True}}},
        {"name": "mixed", "batch_size": 1, "count": 0,
         "inputs": {"INPUT__0": {"data_type": "TYPE_FP32", "dims": [16], "random_data": True},
                    "INPUT__1": {"data_type": "TYPE_FP32", "dims": [3], "input_data_file": "in1.bin"}}},
        {"name": "skipped", "batch_size": 0, "count": 0, "inputs": {}},
    ]
    assert ModelConfig.from_json(cfg.raw, "c", gpus=()).raw == cfg.raw


def test_warmup_may_set_sequence_control_inputs() -> None:
    cfg = config("""
        sequence_batching { control_input { name: "START" control { kind: CONTROL_SEQUENCE_START
                                                                      int32_false_true: [ 0, 1 ] } } }
        model_warmup { name: "w" batch_size: 1
          inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } }
          inputs { key: "START" value { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } }
    """)
    assert set(cfg.warmup[0].inputs) == {"INPUT__0", "START"}


def sample(inputs: str, batch_size: int = 1) -> str:
    return f'model_warmup {{ name: "w" batch_size: {batch_size} {inputs} }}'


X0 = 'inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true } }'


@pytest.mark.parametrize("text, message", [
    (sample(X0.replace("INPUT__0", "INPUT_0")),
     "model_warmup[0].inputs['INPUT_0']: warmup sample 'w' names input 'INPUT_0', which model 'm' does not "
     "have (did you mean 'INPUT__0'?)"),
    (sample(X0.replace("TYPE_FP32", "TYPE_INT32")),
     "model_warmup[0].inputs['INPUT__0'].data_type: warmup sample 'w' input 'INPUT__0' is TYPE_INT32, "
     "but model 'm' expects TYPE_FP32"),
    (sample(X0.replace("[ 16 ]", "[ 4, 4 ]")),
     "model_warmup[0].inputs['INPUT__0'].dims: warmup sample 'w' input 'INPUT__0' has dims [4, 4], which "
     "do not fit the dims [16] of model 'm'"),
    (sample(X0 + ' inputs { key: "INPUT__1" value { data_type: TYPE_FP32 dims: [ -1 ] zero_data: true } }'),
     "model_warmup[0].inputs['INPUT__1'].dims: warmup sample 'w' input 'INPUT__1': warmup setting expects "
     "all variable-size dimensions are specified, got dims [-1]"),
    (sample(X0.replace("zero_data: true", "zero_data: true random_data: true")),
     "model_warmup[0].inputs['INPUT__0']: warmup sample 'w' input 'INPUT__0' sets zero_data and random_data: "
     "give only one of zero_data, random_data or input_data_file"),
    (sample(X0.replace(" zero_data: true", "")),
     "model_warmup[0].inputs['INPUT__0']: warmup sample 'w' input 'INPUT__0' must set one of zero_data, "
     "random_data or input_data_file"),
    (sample(X0.replace("zero_data: true", 'input_data_file: "../../secret"')),
     "model_warmup[0].inputs['INPUT__0'].input_data_file: warmup sample 'w' input 'INPUT__0': input_data_file "
     "'../../secret' must be a relative path inside the model's warmup/ directory"),
    (sample(X0.replace("zero_data: true", 'input_data_file: "/etc/passwd"')),
     "model_warmup[0].inputs['INPUT__0'].input_data_file: warmup sample 'w' input 'INPUT__0': input_data_file "
     "'/etc/passwd' must be a relative path inside the model's warmup/ directory"),
    (sample(X0, batch_size=9),
     "model_warmup[0].batch_size: warmup sample 'w' has batch_size 9, larger than the max_batch_size 8 of "
     "model 'm'"),
    (sample(""), "model_warmup[0].inputs: warmup sample 'w' gives no value for input(s) 'INPUT__0' of model 'm'"),
    ('model_warmup { batch_size: 1 }', "model_warmup[0].name: a warmup sample must specify 'name'"),
])
def test_warmup_errors(text: str, message: str) -> None:
    assert config_error(text) == f"config.pbtxt: model 'm': {message}"


def test_warmup_batch_size_of_a_model_that_does_not_batch(tmp_path: Path) -> None:
    text = IO.replace("max_batch_size: 8", "max_batch_size: 0") + sample(X0, batch_size=2)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_json({**parse_pbtxt(text), "name": "m"}, "c", gpus=())
    assert str(info.value) == ("c: model 'm': model_warmup[0].batch_size: warmup sample 'w' has batch_size 2, "
                               "larger than the max_batch_size 0 of model 'm' (a model that does not batch "
                               "takes 1)")


def write_model(root: Path, extra: str, files: dict[str, bytes]) -> Path:
    model_dir = root / "m"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(IO + extra)
    for name, data in files.items():
        (model_dir / "warmup").mkdir(exist_ok=True)
        (model_dir / "warmup" / name).write_bytes(data)
    return model_dir


FROM_FILE = sample(X0.replace("zero_data: true", 'input_data_file: "x.bin"'))


@pytest.mark.parametrize("files, error", [
    ({"x.bin": bytes(64)}, None),
    ({"x.bin": bytes(100)}, None),
    ({}, "warmup sample 'w' input 'INPUT__0': input_data_file 'x.bin' is not a file in {dir}/warmup"),
    ({"x.bin": bytes(63)}, "warmup sample 'w' input 'INPUT__0': warmup setting expects 64 bytes, but the data "
                           "provided from {dir}/warmup/x.bin only has 63 bytes"),
])
def test_warmup_files_are_checked_in_the_models_warmup_directory(
        tmp_path: Path, files: dict[str, bytes], error: Any) -> None:
    model_dir = write_model(tmp_path, FROM_FILE, files)
    entry = load_model_entry(tmp_path, "m")
    if error is None:
        assert entry.error is None
        assert entry.config.warmup[0].inputs["INPUT__0"] == WarmupInput("TYPE_FP32", (16,), "file", "x.bin")
    else:
        assert entry.error == f"{model_dir / 'config.pbtxt'}: " + error.format(dir=model_dir)
