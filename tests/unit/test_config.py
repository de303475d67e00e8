"""torchpool.config: the pbtxt parser, ModelConfig.from_json, the repository."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from torchpool.config import (
    ConfigError, InstanceGroup, ModelConfig, ModelEntry, TensorSpec,
    load_model_entry, parse_pbtxt, scan_repository,
)

# The config from Triton's quickstart, as users copy it.
SIMPLE_PBTXT = """\
name: "simple"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  },
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  },
  {
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
"""

SIMPLE_JSON_FORM = {
    "name": "simple",
    "platform": "pytorch_libtorch",
    "max_batch_size": 8,
    "input": [
        {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
        {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]},
    ],
    "output": [
        {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]},
        {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [16]},
    ],
}

IO = """
input { name: "X" data_type: TYPE_FP32 dims: 4 }
output { name: "Y" data_type: TYPE_FP32 dims: 4 }
"""


def config(text: str = "", name: str = "m", gpus: tuple[int, ...] = ()) -> ModelConfig:
    """A validated config from pbtxt, with one input and one output unless
    given, on a host showing `gpus` (none: the result does not depend on the
    machine the test runs on)."""
    if not re.search(r"^\s*input\b", text, re.MULTILINE):
        text += IO
    data = parse_pbtxt(text, "config.pbtxt")
    data.setdefault("name", name)
    return ModelConfig.from_json(data, "/r/m/config.pbtxt", gpus=gpus)


def minimal(**fields: Any) -> dict[str, Any]:
    """A JSON-form config dict that validates, with `fields` replacing its own."""
    base: dict[str, Any] = {
        "name": "m",
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
    }
    base.update(fields)
    return base


# ---------------------------------------------------------------------------
# parse_pbtxt: syntax
# ---------------------------------------------------------------------------

def test_classic_triton_config_parses_to_json_form() -> None:
    assert parse_pbtxt(SIMPLE_PBTXT) == SIMPLE_JSON_FORM


def test_repetition_and_list_syntax_are_the_same() -> None:
    repeated = parse_pbtxt("""
        input { name: "A" data_type: TYPE_INT32 dims: 1 dims: 2 }
        input { name: "B" data_type: TYPE_INT32 dims: [3] }
    """)
    listed = parse_pbtxt("""
        input: [ { name: "A", data_type: TYPE_INT32, dims: [1, 2] },
                 { name: "B", data_type: TYPE_INT32, dims: 3 } ]
    """)
    assert repeated == listed
    assert repeated["input"][0]["dims"] == [1, 2]


def test_repeated_fields_written_once_are_lists() -> None:
    data = parse_pbtxt("""
        input { name: "A" dims: 16 }
        instance_group { kind: KIND_GPU gpus: 0 profile: "p" }
        dynamic_batching { preferred_batch_size: 4 }
        version_policy { specific { versions: 3 } }
    """)
    assert data["input"] == [{"name": "A", "dims": [16]}]
    assert data["instance_group"] == [{"kind": "KIND_GPU", "gpus": [0], "profile": ["p"]}]
    assert data["dynamic_batching"] == {"preferred_batch_size": [4]}
    assert data["version_policy"] == {"specific": {"versions": [3]}}


def test_list_and_repetition_of_one_field_accumulate() -> None:
    assert parse_pbtxt("input { dims: [1, 2] dims: 3 dims: [] }") == {"input": [{"dims": [1, 2, 3]}]}


def test_nested_messages_with_colon_braces_and_angle_brackets() -> None:
    data = parse_pbtxt("""
        sequence_batching: {
          oldest < max_candidate_sequences: 4 preferred_batch_size: [2, 4] >
          control_input [
            { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
            { name: "READY" control { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } }
          ]
          state { input_name: "s_in" output_name: "s_out" data_type: TYPE_FP32 dims: [-1]
                  initial_state { data_type: TYPE_FP32 dims: 1 zero_data: true name: "zero" } }
        }
    """)
    sb = data["sequence_batching"]
    assert sb["oldest"] == {"max_candidate_sequences": 4, "preferred_batch_size": [2, 4]}
    assert sb["control_input"][0]["control"] == [
        {"kind": "CONTROL_SEQUENCE_START", "int32_false_true": [0, 1]}]
    assert sb["control_input"][1]["control"] == [
        {"kind": "CONTROL_SEQUENCE_READY", "fp32_false_true": [0.0, 1.0]}]
    assert isinstance(sb["control_input"][1]["control"][0]["fp32_false_true"][1], float)
    assert sb["state"][0]["initial_state"] == [
        {"data_type": "TYPE_FP32", "dims": [1], "zero_data": True, "name": "zero"}]


def test_comments_and_separators() -> None:
    data = parse_pbtxt("""
        # a comment line
        name: "m";   # trailing comment with "quotes" and { braces
        max_batch_size: 4,
        input { name: "X#not-a-comment", dims: [1]; };
    """)
    assert data == {"name": "m", "max_batch_size": 4,
                    "input": [{"name": "X#not-a-comment", "dims": [1]}]}


def test_strings_escapes_quotes_and_concatenation() -> None:
    data = parse_pbtxt(r"""
        name: 'single "quoted"'
        default_model_filename: "a\tb\nc\\d\"e\'f\?"
        backend: "\x41\101\u00e9\U0001F600"
        platform: "con" 'cat'
          "enated"
        runtime: "héllo"
    """)
    assert data["name"] == 'single "quoted"'
    assert data["default_model_filename"] == "a\tb\nc\\d\"e'f?"
    assert data["backend"] == "AAé\U0001F600"
    assert data["platform"] == "concatenated"
    assert data["runtime"] == "héllo"


def test_octal_and_hex_escapes_make_utf8_bytes() -> None:
    assert parse_pbtxt(r'name: "\303\251\xc3\xa9"') == {"name": "éé"}


def test_numbers() -> None:
    data = parse_pbtxt("""
        max_batch_size: 0x10
        input { dims: [ -1, 0X2, 3 ] }
        sequence_batching {
          direct { minimum_slot_utilization: 1.5e-1 }
          control_input { control { fp32_false_true: [ -2.5f, .5 ] } }
          control_input { control { fp32_false_true: [ -inf, nan ] } }
        }
        model_metrics { metric_control { histogram_options { buckets: [ 2., 5 ] } } }
        optimization { graph { level: - 7 } }
    """)
    assert data["max_batch_size"] == 16
    assert data["input"][0]["dims"] == [-1, 2, 3]
    sb = data["sequence_batching"]
    assert sb["direct"]["minimum_slot_utilization"] == pytest.approx(0.15)
    assert sb["control_input"][0]["control"][0]["fp32_false_true"] == [-2.5, 0.5]
    neg_inf, nan = sb["control_input"][1]["control"][0]["fp32_false_true"]
    assert neg_inf == -math.inf and math.isnan(nan)
    buckets = data["model_metrics"]["metric_control"][0]["histogram_options"]["buckets"]
    assert buckets == [2.0, 5.0] and all(isinstance(b, float) for b in buckets)
    assert data["optimization"]["graph"]["level"] == -7


def test_booleans_in_every_text_spelling() -> None:
    data = parse_pbtxt("""
        input { is_shape_tensor: true allow_ragged_batch: True optional: t }
        input { is_shape_tensor: false allow_ragged_batch: False optional: f }
        input { is_shape_tensor: 1 allow_ragged_batch: 0 }
    """)
    assert [i.get("is_shape_tensor") for i in data["input"]] == [True, False, True]
    assert [i.get("allow_ragged_batch") for i in data["input"]] == [True, False, False]
    assert [i.get("optional") for i in data["input"]] == [True, False, None]


def test_enums_by_name_and_by_number() -> None:
    data = parse_pbtxt("""
        input { data_type: 11 format: FORMAT_NCHW }
        instance_group { kind: 2 }
    """)
    assert data["input"][0] == {"data_type": "TYPE_FP32", "format": "FORMAT_NCHW"}
    assert data["instance_group"][0]["kind"] == "KIND_CPU"


def test_parameters_map_both_spellings() -> None:
    data = parse_pbtxt("""
        parameters { key: "INFERENCE_MODE" value { string_value: "false" } }
        parameters: { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }
        parameters: [ { key: "A" value { string_value: "1" } },
                      { key: "B" value { string_value: "2" } } ]
        parameters { key: "A" value { string_value: "last wins" } }
    """)
    assert data["parameters"] == {
        "INFERENCE_MODE": {"string_value": "false"},
        "DISABLE_OPTIMIZED_EXECUTION": {"string_value": "true"},
        "A": {"string_value": "last wins"},
        "B": {"string_value": "2"},
    }


def test_integer_keyed_map_uses_string_keys_like_json() -> None:
    data = parse_pbtxt("""
        dynamic_batching {
          priority_queue_policy { key: 1 value { timeout_action: DELAY max_queue_size: 3 } }
          priority_queue_policy [ { key: 2 value { } } ]
        }
    """)
    assert data["dynamic_batching"]["priority_queue_policy"] == {
        "1": {"timeout_action": "DELAY", "max_queue_size": 3}, "2": {}}


def test_string_maps_and_deep_schema() -> None:
    data = parse_pbtxt("""
        optimization { execution_accelerators { gpu_execution_accelerator {
            name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } } }
        model_warmup { name: "w" batch_size: 1
                       inputs { key: "X" value { data_type: TYPE_FP32 dims: 4 zero_data: true } } }
    """)
    accel = data["optimization"]["execution_accelerators"]["gpu_execution_accelerator"]
    assert accel == [{"name": "tensorrt", "parameters": {"precision_mode": "FP16"}}]
    assert data["model_warmup"] == [{"name": "w", "batch_size": 1, "inputs": {
        "X": {"data_type": "TYPE_FP32", "dims": [4], "zero_data": True}}}]


def test_model_transaction_policy_is_not_repeated() -> None:
    assert parse_pbtxt("model_transaction_policy { decoupled: true }") == {
        "model_transaction_policy": {"decoupled": True}}


def test_empty_text_is_an_empty_message() -> None:
    assert parse_pbtxt("  # nothing\n") == {}


# ---------------------------------------------------------------------------
# parse_pbtxt: errors with file:line:column
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("max_batch_size 8", "f.pbtxt:1:16: expected ':' after field 'max_batch_size', found '8'"),
    ('name: "abc\n', "f.pbtxt:1:7: unterminated string"),
    ('input {\n  name: "X"\n', "f.pbtxt:3:1: unexpected end of input: '{' opened at line 1, column 7 is not closed"),
    ("input <\n name: \"X\" }", "f.pbtxt:2:12: expected a field name or '>', found '}'"),
    ("input { dims: [1 2] }", "f.pbtxt:1:18: expected ',' or ']' in the list of 'dims', found '2'"),
    ("input { dims: [1, ] }", "f.pbtxt:1:19: expected a value, found ']'"),
    ("max_batch_size: 1\n  max_batch_size: 2", "f.pbtxt:2:3: field 'max_batch_size' is specified more than once"),
    ("name: simple", "f.pbtxt:1:7: field 'name': expected a quoted string, found 'simple'"),
    ("max_batch_size: 1.5", "f.pbtxt:1:17: field 'max_batch_size': expected an integer, found '1.5'"),
    ("input { data_type: \"TYPE_FP32\" }",
     "f.pbtxt:1:20: field 'data_type': expected an enum name, found '\"TYPE_FP32\"'"),
    ('name: "a\\qb"', "f.pbtxt:1:9: invalid escape sequence '\\q'"),
    ("max_batch_size: 12ab", "f.pbtxt:1:17: invalid number '12ab'"),
    ("name: @", "f.pbtxt:1:7: unexpected character '@'"),
    ("}", "f.pbtxt:1:1: expected a field name, found '}'"),
    ('name: [ "a" ]', "f.pbtxt:1:1: field 'name' is not repeated; a list is not allowed"),
    ("input: 3", "f.pbtxt:1:8: field 'input' expects a message ('{ ... }'), found '3'"),
    ("input { dims { } }", "f.pbtxt:1:14: field 'dims' expects an integer, not a message"),
    ("dynamic_batching { preserve_ordering: 2 }",
     "f.pbtxt:1:39: field 'preserve_ordering': expected true or false, found '2'"),
    ("dynamic_batching {\n\tmax_queue_delay_microseconds: -1 }",
     "f.pbtxt:2:32: field 'max_queue_delay_microseconds': expected a non-negative integer, got -1"),
    ("parameters: \"x\"", "f.pbtxt:1:13: field 'parameters' expects a map entry ('{ ... }'), found '\"x\"'"),
    ("# comment\n\n   max_batch_size: -x", "f.pbtxt:3:21: expected a number after '-', found 'x'"),
    ('name: "\\xzz"', "f.pbtxt:1:8: '\\x' must be followed by hex digits"),
    ('name: "\\377"', "f.pbtxt:1:7: string is not valid UTF-8"),
])
def test_syntax_errors_name_line_and_column(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pbtxt(text, "f.pbtxt")
    assert str(info.value) == message


def test_default_filename_in_errors() -> None:
    with pytest.raises(ConfigError, match=r"^<string>:1:1: "):
        parse_pbtxt("{")


# ---------------------------------------------------------------------------
# ModelConfig.from_json: typed view, defaults, normalised raw
# ---------------------------------------------------------------------------

def test_classic_config_typed_view_and_defaults() -> None:
    cfg = ModelConfig.from_json(parse_pbtxt(SIMPLE_PBTXT), "config.pbtxt", gpus=())
    assert cfg.name == "simple"
    assert (cfg.platform, cfg.backend, cfg.max_batch_size) == ("pytorch_libtorch", "pytorch", 8)
    assert cfg.inputs == (TensorSpec("INPUT0", "TYPE_FP32", (16,)), TensorSpec("INPUT1", "TYPE_FP32", (16,)))
    assert [o.name for o in cfg.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert cfg.input("INPUT1").datatype == "FP32"
    assert cfg.output("nope") is None
    # Triton names the implicit instance group after the model.
    assert cfg.instance_groups == (InstanceGroup("simple", "KIND_CPU", 1, ()),)
    assert cfg.version_policy == {"latest": {"num_versions": 1}}
    assert cfg.default_model_filename == "model.pt"
    assert cfg.parameters == {}
    assert cfg.dynamic_batching is None and cfg.sequence_batching is None
    assert cfg.batch_inputs == () and cfg.batch_outputs == ()


def test_raw_is_the_normalised_json_form() -> None:
    cfg = ModelConfig.from_json(minimal(), "c", gpus=())
    assert cfg.raw == {
        "name": "m", "platform": "pytorch_libtorch", "backend": "pytorch", "max_batch_size": 0,
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4], "format": "FORMAT_NONE",
                   "is_shape_tensor": False, "allow_ragged_batch": False, "optional": False}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4], "label_filename": "",
                    "is_shape_tensor": False}],
        "batch_input": [], "batch_output": [],
        "instance_group": [{"name": "m", "kind": "KIND_CPU", "count": 1, "gpus": []}],
        "version_policy": {"latest": {"num_versions": 1}},
        "default_model_filename": "model.pt", "parameters": {},
    }
    assert json.loads(json.dumps(cfg.raw)) == cfg.raw
    # Normalising twice changes nothing: raw is a valid input again.
    assert ModelConfig.from_json(cfg.raw, "c", gpus=()).raw == cfg.raw


def test_to_json_returns_a_copy_of_raw() -> None:
    cfg = ModelConfig.from_json(minimal(), "c")
    out = cfg.to_json()
    assert out == cfg.raw
    out["input"][0]["name"] = "changed"
    assert cfg.raw["input"][0]["name"] == "X"


def test_config_json_with_int64_as_strings() -> None:
    data = json.loads("""{
        "name": "m", "backend": "pytorch", "max_batch_size": "4",
        "input": [{"name": "X", "data_type": "TYPE_INT64", "dims": ["16", "-1"],
                   "reshape": {"shape": ["4", "4", "-1"]}}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}],
        "version_policy": {"specific": {"versions": ["2", 1]}},
        "dynamic_batching": {"max_queue_delay_microseconds": "100",
                             "priority_queue_policy": {"1": {"max_queue_size": "5"}},
                             "priority_levels": "1", "default_priority_level": "1"},
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
        "parameters": {"INFERENCE_MODE": {"string_value": "false"}}
    }""")
    cfg = ModelConfig.from_json(data, "config.json")
    assert cfg.max_batch_size == 4
    assert cfg.inputs[0].dims == (16, -1) and cfg.inputs[0].reshape == (4, 4, -1)
    assert cfg.version_policy == {"specific": {"versions": [1, 2]}}
    db = cfg.dynamic_batching
    assert db["max_queue_delay_microseconds"] == 100
    assert db["priority_queue_policy"]["1"]["max_queue_size"] == 5
    assert cfg.parameters == {"INFERENCE_MODE": "false"}
    assert cfg.instance_groups == (InstanceGroup("m_0", "KIND_CPU", 2, ()),)


def test_json_null_means_unset() -> None:
    cfg = ModelConfig.from_json(minimal(max_batch_size=None, version_policy=None), "c")
    assert cfg.max_batch_size == 0 and cfg.version_policy == {"latest": {"num_versions": 1}}


def test_platform_backend_combinations() -> None:
    for fields in ({}, {"platform": "pytorch_libtorch"}, {"backend": "pytorch"},
                   {"platform": "pytorch_libtorch", "backend": "pytorch"}):
        cfg = ModelConfig.from_json(minimal(**fields), "c")
        assert (cfg.platform, cfg.backend) == ("pytorch_libtorch", "pytorch")


def test_parameters_are_string_values() -> None:
    cfg = config("""
        parameters { key: "INFERENCE_MODE" value { string_value: "false" } }
        parameters { key: "EMPTY" value { } }
    """)
    assert cfg.parameters == {"INFERENCE_MODE": "false", "EMPTY": ""}
    assert cfg.raw["parameters"]["EMPTY"] == {"string_value": ""}


def test_version_policies() -> None:
    assert config("version_policy: { latest: { num_versions: 2 } }").version_policy == {"latest": {"num_versions": 2}}
    assert config("version_policy: { all { } }").version_policy == {"all": {}}
    assert config("version_policy { specific { versions: [3, 1, 3] } }").version_policy == {
        "specific": {"versions": [1, 3]}}


def test_instance_groups_follow_triton_defaults() -> None:
    cfg = config("""
        instance_group [
          { count: 2 kind: KIND_CPU },
          { name: "gpu_group" kind: KIND_GPU gpus: [ 0, 1 ] },
          { kind: KIND_MODEL count: 0 },
          { }
        ]
    """)
    assert cfg.instance_groups == (
        InstanceGroup("m_0", "KIND_CPU", 2, ()),
        InstanceGroup("gpu_group", "KIND_GPU", 1, (0, 1)),
        InstanceGroup("m_2", "KIND_MODEL", 1, ()),
        InstanceGroup("m_3", "KIND_CPU", 1, ()),
    )


def test_reshape_rules() -> None:
    ok = [("dims: [16] reshape { shape: [4, 4] }", (4, 4)),
          ("dims: [-1, 4] reshape { shape: [-1, 2, 2] }", (-1, 2, 2)),
          ("dims: [2, 4, -1, 6] reshape { shape: [8, -1, 1, 6] }", (8, -1, 1, 6)),
          ("dims: [1] reshape { }", ())]
    for text, shape in ok:
        cfg = config(f'max_batch_size: 2\ninput {{ name: "X" data_type: TYPE_FP32 {text} }}\n'
                     'output { name: "Y" data_type: TYPE_FP32 dims: 1 }')
        assert cfg.inputs[0].reshape == shape


def test_dynamic_batching_defaults_follow_triton() -> None:
    cfg = config("max_batch_size: 8 dynamic_batching { }")
    assert cfg.dynamic_batching == {
        "preferred_batch_size": [8], "max_queue_delay_microseconds": 0, "preserve_ordering": False,
        "priority_levels": 0, "default_priority_level": 0,
        "default_queue_policy": {"timeout_action": "REJECT", "default_timeout_microseconds": 0,
                                 "allow_timeout_override": False, "max_queue_size": 0},
        "priority_queue_policy": {},
    }
    cfg = config("""max_batch_size: 8 dynamic_batching {
        preferred_batch_size: [2, 4] max_queue_delay_microseconds: 500
        priority_levels: 2 default_priority_level: 2
        default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 10 max_queue_size: 7 }
        priority_queue_policy { key: 1 value { allow_timeout_override: true } } }""")
    db = cfg.dynamic_batching
    assert db["preferred_batch_size"] == [2, 4] and db["max_queue_delay_microseconds"] == 500
    assert db["default_queue_policy"]["max_queue_size"] == 7
    assert db["priority_queue_policy"]["1"]["allow_timeout_override"] is True
    assert db["priority_queue_policy"]["1"]["timeout_action"] == "REJECT"


def test_sequence_batching_defaults() -> None:
    cfg = config("""max_batch_size: 4 sequence_batching {
        oldest { max_candidate_sequences: 2 }
        control_input { name: "START" control { kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] } } }""")
    sb = cfg.sequence_batching
    assert sb["max_sequence_idle_microseconds"] == 1_000_000
    assert sb["oldest"] == {"max_candidate_sequences": 2, "preferred_batch_size": [4]}
    assert sb["state"] == [] and sb["control_input"][0]["name"] == "START"


def test_batch_inputs_and_outputs_are_kept() -> None:
    cfg = config("""
        max_batch_size: 4
        input { name: "X" data_type: TYPE_FP32 dims: [-1] allow_ragged_batch: true }
        output { name: "Y" data_type: TYPE_FP32 dims: [-1] }
        batch_input { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "IDX" data_type: TYPE_INT32 source_input: "X" }
        batch_output { kind: BATCH_SCATTER_WITH_INPUT_SHAPE target_name: ["Y"] source_input: ["X"] }
    """)
    assert cfg.inputs[0].allow_ragged_batch is True
    assert cfg.batch_inputs == ({"kind": "BATCH_ACCUMULATED_ELEMENT_COUNT", "target_name": ["IDX"],
                                 "source_input": ["X"], "data_type": "TYPE_INT32"},)
    assert cfg.batch_outputs == ({"kind": "BATCH_SCATTER_WITH_INPUT_SHAPE", "target_name": ["Y"],
                                  "source_input": ["X"]},)


def test_every_known_data_type_is_accepted() -> None:
    for data_type in ("TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT64", "TYPE_INT8",
                      "TYPE_INT64", "TYPE_FP16", "TYPE_BF16", "TYPE_FP64", "TYPE_STRING"):
        inputs = [{"name": "X", "data_type": data_type, "dims": [1]}]
        assert ModelConfig.from_json(minimal(input=inputs), "c").inputs[0].data_type == data_type


# ---------------------------------------------------------------------------
# ModelConfig.from_json: every validation error
# ---------------------------------------------------------------------------

P = "/r/m/config.pbtxt: model 'm': "

INPUT_X = {"name": "X", "data_type": "TYPE_FP32", "dims": [4]}


def _input(**fields: Any) -> list[dict[str, Any]]:
    return [INPUT_X, {**INPUT_X, "name": "X1", **fields}]


@pytest.mark.parametrize("fields, message", [
    ({"name": ""}, "/r/m/config.pbtxt: name: model configuration must specify 'name'"),
    ({"platform": "onnxruntime_onnx"},
     P + "platform 'onnxruntime_onnx' is not served by torchpool (only pytorch_libtorch / backend pytorch)"),
    ({"backend": "onnxruntime"},
     P + "backend 'onnxruntime' is not served by torchpool (only pytorch_libtorch / backend pytorch)"),
    ({"max_batch_size": -1}, P + "max_batch_size: 'max_batch_size' must be non-negative value for m, got -1"),
    ({"max_batch_size": "eight"}, P + "max_batch_size: expected an integer, got 'eight'"),
    ({"input": []}, P + "model configuration must contain at least one input, none were specified."),
    ({"output": []}, P + "model configuration must contain at least one output, none were specified."),
    ({"input": _input(data_type="TYPE_FOO")},
     P + "input[1].data_type: unknown value 'TYPE_FOO' for field 'data_type' in ModelInput "
         "(did you mean 'TYPE_BOOL'?)"),
    ({"input": _input(data_type=None)}, P + "input[1].data_type: model input 'X1' must specify 'data_type'"),
    ({"input": _input(name="")}, P + "input[1].name: model input must specify 'name'"),
    ({"input": _input(name="X")}, P + "input[1].name: input 'X' is specified more than once"),
    ({"input": _input(dims=[])}, P + "input[1].dims: model input 'X1' must specify 'dims'"),
    ({"input": _input(dims=[4, 0])}, P + "input[1].dims: model input 'X1' dimension must be integer >= 1, "
                                         "or -1 to indicate a variable-size dimension, got 0"),
    ({"input": _input(dims=[-2])}, P + "input[1].dims: model input 'X1' dimension must be integer >= 1, "
                                       "or -1 to indicate a variable-size dimension, got -2"),
    ({"input": _input(dims=["x"])}, P + "input[1].dims[0]: expected an integer, got 'x'"),
    ({"input": _input(dims=[16], reshape={"shape": [5]})},
     P + "input[1].reshape: model input 'X1' has different size for dims [16] and reshape [5]"),
    ({"input": _input(dims=[-1, 4], reshape={"shape": [4, -1]})},
     P + "input[1].reshape: model input 'X1' has different size for dims [-1, 4] and reshape [4, -1]"),
    ({"input": _input(dims=[1], reshape={})},
     P + "input[1].reshape: model input 'X1' cannot have empty reshape for non-batching model"),
    ({"input": _input(format="FORMAT_NCHW")}, P + "input[1].format: model input 'X1' NHWC/NCHW require 3 dims"),
    ({"input": _input(allow_ragged_batch="yes")}, P + "input[1].allow_ragged_batch: expected true or false, got 'yes'"),
    ({"input": {"name": "X"}}, P + "input[0].data_type: model input 'X' must specify 'data_type'"),
    ({"input": "X"}, P + "input[0]: expected an object, got 'X'"),
    ({"output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2], "reshape": {"shape": [3]}}]},
     P + "output[0].reshape: model output 'Y' has different size for dims [2] and reshape [3]"),
    ({"instance_group": [{"kind": "KIND_TPU"}]},
     P + "instance_group[0].kind: unknown value 'KIND_TPU' for field 'kind' in ModelInstanceGroup "
         "(did you mean 'KIND_GPU'?)"),
    ({"instance_group": [{"count": -1}]},
     P + "instance_group[0].count: instance group m_0 of model m must specify 'count' >= 1, got -1"),
    ({"instance_group": [{"kind": "KIND_GPU", "gpus": [0, -1]}]},
     P + "instance_group[0].gpus: instance group m_0 of model m lists a negative GPU id: [0, -1]"),
    ({"instance_group": [{"kind": "KIND_CPU", "gpus": [0]}]},
     P + "instance_group[0].gpus: instance group m_0 of model m has kind KIND_CPU but specifies one or more GPUs"),
    ({"version_policy": {"latest": {"num_versions": 0}}},
     P + "version_policy.latest.num_versions: must be >= 1, got 0"),
    ({"version_policy": {"latest": {}, "all": {}}},
     P + "version_policy: must set exactly one of 'latest', 'all' or 'specific', got latest and all"),
    ({"version_policy": {"newest": {}}},
     P + "version_policy: unknown field 'newest' in ModelVersionPolicy"),
    ({"version_policy": {"specific": {"versions": []}}},
     P + "version_policy.specific.versions: must list at least one version"),
    ({"version_policy": {"specific": {"versions": [0, 1]}}},
     P + "version_policy.specific.versions: versions must be >= 1, got 0"),
    ({"parameters": {"A": "not a message"}}, P + "parameters['A']: expected an object, got 'not a message'"),
    ({"parameters": {"A": {"string_value": 3}}}, P + "parameters['A'].string_value: expected a string, got 3"),
    ({"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [8]}},
     P + "dynamic_batching.preferred_batch_size: dynamic batching preferred size must be <= max batch size for m"),
    ({"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [0]}},
     P + "dynamic_batching.preferred_batch_size: dynamic batching preferred size must be positive for m"),
    ({"max_batch_size": 4, "dynamic_batching": {"priority_levels": 2}},
     P + "dynamic_batching.default_priority_level: default priority level must be in range [1, 2] for m"),
    ({"max_batch_size": 4, "dynamic_batching": {"priority_levels": 2, "default_priority_level": 1,
                                                "priority_queue_policy": {"3": {}}}},
     P + "dynamic_batching.priority_queue_policy: priority queue policy must have priority level "
         "in range [1, 2] for m"),
    ({"max_batch_size": 4, "dynamic_batching": {"priority_queue_policy": {"-1": {}}}},
     P + "dynamic_batching.priority_queue_policy: map key must be a non-negative integer, got '-1'"),
    ({"max_batch_size": 4, "dynamic_batching": {"preserve_ordering": True, "priority_levels": 2,
                                                "default_priority_level": 1}},
     P + "dynamic_batching.preserve_ordering: Only one priority level is allowed when 'preserve_ordering' "
         "is true for m"),
    ({"max_batch_size": 4, "dynamic_batching": {"preserve_ordering": True, "default_queue_policy": {
        "timeout_action": "DELAY", "default_timeout_microseconds": 5}}},
     P + "dynamic_batching.preserve_ordering: Queue policy can not have DELAY as timeout action "
         "when 'preserve_ordering' is true for m"),
    ({"max_batch_size": 4, "dynamic_batching": {"default_queue_policy": {"timeout_action": "DROP"}}},
     P + "dynamic_batching.default_queue_policy.timeout_action: unknown value 'DROP' for field "
         "'timeout_action' in ModelQueuePolicy (expected one of REJECT, DELAY)"),
    ({"sequence_batching": {"direct": {}, "oldest": {}}},
     P + "sequence_batching: must set at most one of 'direct' or 'oldest'"),
    ({"sequence_batching": {"control_input": [{"control": [{"kind": "CONTROL_SEQUENCE_START"}]}]}},
     P + "sequence_batching.control_input[0].name: sequence batching control tensor must have a name for m"),
    ({"batch_input": [{"kind": "BATCH_MAGIC", "target_name": ["T"], "data_type": "TYPE_INT32", "source_input": ["X"]}]},
     P + "batch_input[0].kind: unknown value 'BATCH_MAGIC' for field 'kind' in BatchInput (expected one of "
         "BATCH_ELEMENT_COUNT, BATCH_ACCUMULATED_ELEMENT_COUNT, BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO, "
         "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE, BATCH_ITEM_SHAPE, BATCH_ITEM_SHAPE_FLATTEN)"),
    ({"batch_input": [{"target_name": ["T"], "data_type": "TYPE_INT64", "source_input": ["X"]}]},
     P + "batch_input[0].data_type: batch input data type must be TYPE_INT32 or TYPE_FP32"),
    ({"batch_input": [{"target_name": ["T"], "data_type": "TYPE_INT32", "source_input": ["Z"]}]},
     P + "batch_input[0].source_input: unknown source input name 'Z'"),
    ({"batch_input": [{"target_name": ["T"], "data_type": "TYPE_INT32", "source_input": []}]},
     P + "batch_input[0].source_input: batch input kind 'BATCH_ELEMENT_COUNT' expects 1 source input, got 0"),
    ({"batch_input": [{"data_type": "TYPE_INT32", "source_input": ["X"]}]},
     P + "batch_input[0].target_name: batch input must specify 'target_name'"),
    ({"batch_output": [{"target_name": ["Z"], "source_input": ["X"]}]},
     P + "batch_output[0].target_name: unknown target output name 'Z'"),
    ({"batch_output": [{"target_name": ["Y", "Y"], "source_input": ["X"]}]},
     P + "batch_output[0].target_name: a target output name can only be specified once"),
    ({"dynamic_batching": [{}]}, P + "dynamic_batching: is not a repeated field; a list is not allowed here"),
])
def test_validation_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_json(minimal(**fields), "/r/m/config.pbtxt", gpus=())
    assert str(info.value) == message


def test_from_json_rejects_a_non_object() -> None:
    with pytest.raises(ConfigError, match=r"^c: a model configuration must be a JSON object$"):
        ModelConfig.from_json(["not", "a", "dict"], "c")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Repository
# ---------------------------------------------------------------------------

def write_model(root: Path, name: str, config_text: str | None, versions: tuple[str, ...] = ("1",),
                filename: str = "config.pbtxt") -> Path:
    model_dir = root / name
    model_dir.mkdir(parents=True)
    if config_text is not None:
        (model_dir / filename).write_text(config_text)
    for version in versions:
        (model_dir / version).mkdir()
    return model_dir


def io_pbtxt(extra: str = "") -> str:
    return IO + extra


def test_scan_with_one_broken_model_among_good_ones(tmp_path: Path) -> None:
    write_model(tmp_path, "good_pbtxt", io_pbtxt('max_batch_size: 8 default_model_filename: "net.pt"'), ("1", "2"))
    write_model(tmp_path, "good_json", json.dumps(minimal(name="good_json", max_batch_size="2")),
                ("3",), filename="config.json")
    write_model(tmp_path, "broken_syntax", io_pbtxt("max_batch_size 8"))
    write_model(tmp_path, "broken_type", io_pbtxt('input { name: "Z" data_type: TYPE_FOO dims: 1 }'))
    write_model(tmp_path, "wrong_name", io_pbtxt('name: "other"'))
    write_model(tmp_path, "no_config", None)
    write_model(tmp_path, "no_versions", io_pbtxt(), ())
    write_model(tmp_path, ".hidden", io_pbtxt())
    (tmp_path / "README.md").write_text("not a model")

    entries = {e.name: e for e in scan_repository(tmp_path)}
    assert list(entries) == sorted(["good_pbtxt", "good_json", "broken_syntax", "broken_type",
                                    "wrong_name", "no_config", "no_versions"])

    good = entries["good_pbtxt"]
    assert good.error is None and good.versions == (2,)
    assert good.path == tmp_path / "good_pbtxt"
    assert good.config.max_batch_size == 8
    assert good.model_file(2) == tmp_path / "good_pbtxt" / "2" / "net.pt"
    assert entries["good_json"].error is None and entries["good_json"].versions == (3,)
    assert entries["good_json"].config.max_batch_size == 2

    config_file = tmp_path / "broken_syntax" / "config.pbtxt"
    assert entries["broken_syntax"].config is None
    assert entries["broken_syntax"].error == (
        f"{config_file}:4:16: expected ':' after field 'max_batch_size', found '8'")
    assert entries["broken_type"].error == (
        f"{tmp_path / 'broken_type' / 'config.pbtxt'}:4:30: unknown value 'TYPE_FOO' for field "
        "'data_type' in ModelInput (did you mean 'TYPE_BOOL'?)")
    assert entries["wrong_name"].error == (
        f"{tmp_path / 'wrong_name' / 'config.pbtxt'}: unexpected directory name 'wrong_name' "
        "for model 'other', directory name must equal model name")
    assert entries["no_config"].error == (
        f"model 'no_config': no config.pbtxt or config.json in {tmp_path / 'no_config'}")
    no_versions = entries["no_versions"]
    assert no_versions.config is not None and no_versions.versions == ()
    assert no_versions.error.startswith(
        f"model 'no_versions' has no version directories in {tmp_path / 'no_versions'}")
    assert "at least one version must be available under the version policy" in no_versions.error


def test_pbtxt_wins_over_json(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "m", io_pbtxt("max_batch_size: 3"))
    (model_dir / "config.json").write_text(json.dumps(minimal(max_batch_size=5)))
    assert load_model_entry(tmp_path, "m").config.max_batch_size == 3


def test_name_in_config_matching_the_directory_is_fine(tmp_path: Path) -> None:
    write_model(tmp_path, "m", io_pbtxt('name: "m"'))
    assert load_model_entry(tmp_path, "m").error is None


def test_json_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    write_model(tmp_path, "m", '{\n  "name": "m",\n  "input": [}\n', filename="config.json")
    error = load_model_entry(tmp_path, "m").error
    assert error.startswith(f"{tmp_path / 'm' / 'config.json'}:3:13: ")


@pytest.mark.parametrize("policy, selected", [
    ("", (10,)),
    ("version_policy { latest { num_versions: 2 } }", (3, 10)),
    ("version_policy { latest { num_versions: 9 } }", (1, 3, 10)),
    ("version_policy { all { } }", (1, 3, 10)),
    ("version_policy { specific { versions: [10, 1] } }", (1, 10)),
])
def test_version_policy_selects_directories(tmp_path: Path, policy: str, selected: tuple[int, ...]) -> None:
    # "0", "007", "v2" and a plain file named "5" are not version directories.
    model_dir = write_model(tmp_path, "m", io_pbtxt(policy), ("1", "3", "10", "0", "007", "v2"))
    (model_dir / "5").write_text("")
    entry = load_model_entry(tmp_path, "m")
    assert entry.error is None
    assert entry.versions == selected


def test_specific_version_without_directory_is_a_warning(tmp_path: Path) -> None:
    """Triton logs it and serves the versions that exist."""
    write_model(tmp_path, "m", io_pbtxt("version_policy { specific { versions: [1, 2, 4] } }"), ("1", "4"))
    entry = load_model_entry(tmp_path, "m")
    assert entry.error is None and entry.versions == (1, 4)
    assert entry.warnings == (f"version 2 is specified for model 'm', but the version directory is not "
                              f"present in {tmp_path / 'm'}; serving versions 1, 4",)


def test_ignored_version_directories_are_warnings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Triton logs each subdirectory it ignores as a version, in these words
    (model_lifecycle.cc); its warmup, initial_state and configs folders are
    not versions and no warning."""
    import logging

    from torchpool.broker.registry import Registry

    model_dir = write_model(tmp_path, "m", io_pbtxt(),
                            ("1", "003", "abc", "0", "warmup", "initial_state", "configs"))
    (model_dir / "notes").write_text("")                      # a file: not looked at
    entry = load_model_entry(tmp_path, "m")
    assert entry.error is None and entry.versions == (1,)
    where = f"(model directory {model_dir})"
    expected = (f"ignore version directory '0' which is not a positive integer {where}",
                f"ignore version directory '003' which contains leading zeros in its directory name {where}",
                f"ignore version directory 'abc' which fails to convert to integral number {where}")
    assert entry.warnings == expected
    with caplog.at_level(logging.WARNING):
        Registry([entry])                                     # the daemon's load logs them
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == list(expected)
    # no version left: the model fails, and the log still says what was ignored
    write_model(tmp_path, "none", io_pbtxt(), ("abc",))
    entry = load_model_entry(tmp_path, "none")
    assert entry.error.startswith("model 'none' has no version directories")
    assert entry.warnings == (f"ignore version directory 'abc' which fails to convert to integral number "
                              f"(model directory {tmp_path / 'none'})",)


def test_fields_torchpool_does_not_act_on_are_one_warning_per_model(tmp_path: Path) -> None:
    """They load, as in Triton, and the log says what is not there."""
    extra = ("response_cache { enable: true }\n"
             "optimization { priority: PRIORITY_DEFAULT input_pinned_memory { enable: true } }\n"
             "model_transaction_policy { decoupled: false }\n"
             "instance_group [ { kind: KIND_CPU rate_limiter { resources [ { name: \"R\" count: 1 } ] } } ]")
    write_model(tmp_path, "m", io_pbtxt(extra), ("1",))
    entry = load_model_entry(tmp_path, "m")
    assert entry.error is None and entry.versions == (1,)
    assert entry.warnings == ("model 'm': torchpool accepts and ignores these configuration fields: "
                              "response_cache (Triton's response cache); optimization (Triton's optimization "
                              "policy (graph level, priority, CUDA graphs, pinned memory, accelerators, eager "
                              "batching)); instance_group[0].rate_limiter (Triton's rate limiter)",)
    write_model(tmp_path, "plain", io_pbtxt("optimization { priority: PRIORITY_DEFAULT }"), ("1",))
    assert load_model_entry(tmp_path, "plain").warnings == ()    # defaults only: nothing to say


def test_specific_versions_none_present_is_an_error(tmp_path: Path) -> None:
    write_model(tmp_path, "m", io_pbtxt("version_policy { specific { versions: [2, 3] } }"), ("1",))
    entry = load_model_entry(tmp_path, "m")
    assert entry.versions == () and entry.config is not None
    assert entry.error == ("at least one version must be available under the version policy of model 'm': "
                           f"version 2, 3 are specified, but no such version directory is present in "
                           f"{tmp_path / 'm'}")


def test_model_file_is_not_required(tmp_path: Path) -> None:
    write_model(tmp_path, "m", io_pbtxt())
    entry = load_model_entry(tmp_path, "m")
    assert entry.error is None and not entry.model_file(1).exists()
    assert entry.model_file(1) == tmp_path / "m" / "1" / "model.pt"


def test_load_model_entry_for_missing_or_unsafe_names(tmp_path: Path) -> None:
    missing = load_model_entry(tmp_path, "nope")
    assert missing == ModelEntry("nope", tmp_path / "nope", None, (),
                                 f"model 'nope' not found: no directory {tmp_path / 'nope'}")
    for name, problem in (("../escape", "holds a '/' after the leading one"), ("..", "is '..'"),
                          ("", "is empty"), ("a/b", "holds a '/' after the leading one"),
                          (".hidden", "begins with '.'"), ("a\0b", "holds a NUL byte"),
                          ("/abs", "begins with '/'"), ("a\\b", "holds a backslash")):
        assert load_model_entry(tmp_path, name).error == (
            f"invalid model name: it {problem}; a model name is a single directory name of 1 to 255 "
            f"bytes with no NUL, '/' or backslash, not beginning with '.'")


def test_scan_of_a_missing_repository_raises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a directory"):
        scan_repository(tmp_path / "absent")


def test_scan_of_an_empty_repository(tmp_path: Path) -> None:
    assert scan_repository(str(tmp_path)) == []
