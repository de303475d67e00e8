"""The gateway's .proto files against the descriptors tritonclient ships.

A gRPC client decodes by field number and type, so one wrong number makes
tritonclient misread a field silently. Every message, field, enum value and
method we define must be Triton's exactly.
"""
from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

pytest.importorskip("tritonclient.grpc")

from tritonclient.grpc import model_config_pb2 as triton_config  # noqa: E402
from tritonclient.grpc import service_pb2 as triton_service  # noqa: E402

from torchpool.gateway import proto  # noqa: E402
from torchpool.gateway.proto import grpc_service_pb2, model_config_pb2  # noqa: E402

PAIRS = [(model_config_pb2, triton_config), (grpc_service_pb2, triton_service)]


def file_proto(module) -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fd)
    return fd


def enums(prefix: str, enum_types) -> dict:
    return {f"{prefix}.{e.name}": {v.name: v.number for v in e.value} for e in enum_types}


def messages(prefix: str, message_types) -> dict:
    """Full name -> {field name: (number, type, label, type name, oneof)}, nested included."""
    found = {}
    for m in message_types:
        name = f"{prefix}.{m.name}"
        found[name] = {f.name: (f.number, f.type, f.label, f.type_name,
                                m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None)
                       for f in m.field}
        found.update(messages(name, m.nested_type))
    return found


def nested_enums(prefix: str, message_types) -> dict:
    found = {}
    for m in message_types:
        name = f"{prefix}.{m.name}"
        found.update(enums(name, m.enum_type))
        found.update(nested_enums(name, m.nested_type))
    return found


def map_entries(prefix: str, message_types) -> set:
    """Names of the map<> entry types (a map written as a repeated message
    would have the same fields but decode differently in JSON)."""
    found = set()
    for m in message_types:
        name = f"{prefix}.{m.name}"
        if m.options.map_entry:
            found.add(name)
        found |= map_entries(name, m.nested_type)
    return found


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=["model_config", "grpc_service"])
def test_messages_and_fields_match_triton(ours, theirs) -> None:
    a, b = file_proto(ours), file_proto(theirs)
    assert (a.name, a.package, a.syntax, list(a.dependency)) == \
        (b.name, b.package, b.syntax, list(b.dependency))
    mine, triton = messages(".inference", a.message_type), messages(".inference", b.message_type)
    assert sorted(mine) == sorted(triton)
    for name in mine:
        assert mine[name] == triton[name], name
    assert map_entries(".inference", a.message_type) == map_entries(".inference", b.message_type)


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=["model_config", "grpc_service"])
def test_enums_match_triton(ours, theirs) -> None:
    a, b = file_proto(ours), file_proto(theirs)
    assert enums(".inference", a.enum_type) == enums(".inference", b.enum_type)
    assert nested_enums(".inference", a.message_type) == nested_enums(".inference", b.message_type)


def test_service_methods_match_triton() -> None:
    def methods(module) -> dict:
        fd = file_proto(module)
        return {(s.name, m.name): (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                for s in fd.service for m in s.method}
    mine = methods(grpc_service_pb2)
    assert mine == methods(triton_service)
    assert ("GRPCInferenceService", "ModelInfer") in mine


def test_bytes_cross_between_the_two() -> None:
    request = triton_service.ModelInferRequest(model_name="m", id="7")
    t = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
    t.parameters["shared_memory_region"].string_param = "r"
    request.parameters["sequence_id"].int64_param = 42
    request.raw_input_contents.append(b"\x00\x00\x80?\x00\x00\x00@")
    ours = grpc_service_pb2.ModelInferRequest.FromString(request.SerializeToString())
    assert ours.inputs[0].parameters["shared_memory_region"].string_param == "r"
    assert ours.parameters["sequence_id"].int64_param == 42
    assert ours.raw_input_contents[0] == request.raw_input_contents[0]
    back = triton_service.ModelInferRequest.FromString(ours.SerializeToString())
    assert back == request


def test_own_pool_leaves_tritonclients_alone() -> None:
    # both sets of modules are imported in this process: ours live in their own pool
    default = descriptor_pool.Default().FindMessageTypeByName("inference.ModelConfig")
    assert default is triton_config.ModelConfig.DESCRIPTOR
    assert proto.POOL.FindMessageTypeByName("inference.ModelConfig") is model_config_pb2.ModelConfig.DESCRIPTOR
    assert model_config_pb2.ModelConfig.DESCRIPTOR is not default


def test_shipped_modules_match_the_proto_files(tmp_path) -> None:
    """The generated modules are what the .proto files say (scripts/gen_proto
    was run after the last edit); any protoc will do for this comparison."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    from pathlib import Path

    source = Path(proto.__file__).parent
    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{source}", f"--descriptor_set_out={out}", "--include_imports",
                        "model_config.proto", "grpc_service.proto"]) == 0
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    for f in compiled.file:          # protoc embeds files without the JSON names it fills in here
        _clear_json_names(f.message_type)
    assert {f.name: f for f in compiled.file} == {"model_config.proto": file_proto(model_config_pb2),
                                                  "grpc_service.proto": file_proto(grpc_service_pb2)}


def _clear_json_names(message_types) -> None:
    for m in message_types:
        for f in m.field:
            f.ClearField("json_name")
        _clear_json_names(m.nested_type)
