"""docs/protocol.md's test vectors are what the code writes and reads.

The hex blocks of the document (a fence opened with "```hex NAME", lines
of "OFFSET  b0 b1 ...") are parsed here and compared with what the real
encoders produce: the client's infer flow and its plain helpers
(torchpool/client/flows.py, common.py), the daemon's answers
(protocol/messages.py, protocol/tensors.py). The error answer's message is
the daemon's own validator's (broker/requests.py) on the example `addsub`
config. The document also states each limit once, names every operation
and every error code: checked against the code too. So the document
cannot drift from the code without a test failing.

tests/e2e/test_e2e_example_clients.py sends the same vectors to a running
daemon.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from torchpool.client.common import decode_infer, encode_control, encode_infer, error_of
from torchpool.client.flows import ClientState
from torchpool.protocol import errors, lane, messages, tensors
from torchpool.protocol.errors import TorchpoolError

PROTOCOL_DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
VECTOR_NAMES = {"infer-request", "infer-reply", "error-request", "error-reply", "statistics-request"}

# the documented vectors' inputs: INPUT0 = 0..15, INPUT1 = sixteen 1.0 (FP32 [1, 16])
INPUT0 = np.arange(16, dtype=np.float32).reshape(1, 16)
INPUT1 = np.ones((1, 16), dtype=np.float32)
BAD_SHAPE_MESSAGE = ("unexpected shape for input 'INPUT0' for model 'addsub'. "
                     "Expected [-1,16], got [1,2]")

_HEX_BLOCK = re.compile(r"^```hex ([\w-]+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def doc_vectors(path: Path = PROTOCOL_DOC) -> dict[str, bytes]:
    """{name: bytes} of every hex block in the document. Each line's offset
    must be the count of bytes before it, so a lost or doubled line fails."""
    vectors: dict[str, bytes] = {}
    for name, body in _HEX_BLOCK.findall(path.read_text(encoding="utf-8")):
        data = bytearray()
        for line in body.splitlines():
            offset, *octets = line.split()
            assert int(offset, 16) == len(data), \
                f"vector '{name}': the line at offset {offset} follows {len(data)} bytes"
            assert octets and all(re.fullmatch(r"[0-9a-f]{2}", o) for o in octets), \
                f"vector '{name}': line {offset} is not bytes in lower-case hex"
            data += bytes.fromhex("".join(octets))
        assert name not in vectors, f"vector '{name}' appears twice"
        vectors[name] = bytes(data)
    return vectors


def doc_section(title: str) -> str:
    """The text of the `## title` section (up to the next `## `)."""
    text = PROTOCOL_DOC.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert match, f"docs/protocol.md has no section '## {title}'"
    return match.group(1)


@pytest.fixture(scope="module")
def vectors() -> dict[str, bytes]:
    return doc_vectors()


@pytest.fixture(scope="module")
def addsub():
    """The example repository's addsub as the daemon holds it (config only: nothing runs)."""
    from torchpool.broker.registry import ModelVersion
    from torchpool.config import ModelConfig
    from torchpool.config.pbtxt import parse_pbtxt
    from torchpool.examples import ADDSUB_CONFIG

    config = ModelConfig.from_json(parse_pbtxt(ADDSUB_CONFIG.format(name="addsub", extra="")))
    return ModelVersion("addsub", 1, config, "/nowhere/addsub/1/model.pt")


def daemon_answer(header: dict, mv) -> bytes:
    """What the daemon's validator makes of a request header: the error
    answer's bytes, or b"" when it accepts the request."""
    from torchpool.rules.request import read_infer
    from torchpool.rules.validation import validate_infer

    try:
        validate_infer(read_infer(header), [], mv)
    except TorchpoolError as exc:
        return messages.pack(messages.error_response(header.get("id"), exc))
    return b""


def output_entries(outputs: dict[str, np.ndarray], frames: list) -> list[dict]:
    """The daemon's output entries, by the rule it answers with (protocol/tensors.py)."""
    entries = []
    for name, value in outputs.items():
        entry = tensors.tensor_entry(name, "FP32", value.shape)
        tensors.put_data(entry, value, frames)
        entries.append(entry)
    return entries


def test_the_document_has_each_vector_once(vectors):
    assert set(vectors) == VECTOR_NAMES
    assert all(vectors.values())


def test_infer_request_is_what_the_client_sends(vectors, addsub):
    expected = vectors["infer-request"]
    # the path Client.infer takes (no session: inline tensors)...
    state = ClientState("ipc:///nowhere", local=False)
    call = next(state.infer_flow("addsub", {"INPUT0": INPUT0, "INPUT1": INPUT1}, None, None, None, False))
    assert call.rid == 1 and call.frames == [expected]
    # ... and the plain helper for callers that build frames themselves
    assert encode_infer(1, "addsub", {"INPUT0": INPUT0, "INPUT1": INPUT1}, None, None, None) == [expected]
    header = messages.decode_header(expected)
    assert header["op"] == "infer" and header["id"] == 1 and header["outputs"] is None
    assert [e["name"] for e in header["inputs"]] == ["INPUT0", "INPUT1"]
    assert header["inputs"][0]["data"] == INPUT0.tobytes() and len(header["inputs"][0]["data"]) == 64
    assert daemon_answer(header, addsub) == b"", "the daemon's validator refuses the documented request"


def test_infer_reply_is_what_the_daemon_sends_and_the_client_reads(vectors):
    expected = vectors["infer-reply"]
    frames: list = []
    outputs = output_entries({"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}, frames)
    assert frames == [], "64-byte outputs travel inline"
    answer = messages.ok_response(1, model_name="addsub", model_version="1", outputs=outputs)
    assert messages.pack(answer) == expected

    header = messages.unpack(expected)
    assert header["ok"] is True and header["model_version"] == "1"
    decoded = decode_infer(header, [])
    np.testing.assert_array_equal(decoded["OUTPUT0"], np.arange(1, 17, dtype=np.float32).reshape(1, 16))
    np.testing.assert_array_equal(decoded["OUTPUT1"], np.arange(-1, 15, dtype=np.float32).reshape(1, 16))
    # the client's infer flow, given this answer, returns the same arrays
    state = ClientState("ipc:///nowhere", local=False)
    flow = state.infer_flow("addsub", {"INPUT0": INPUT0, "INPUT1": INPUT1}, None, None, None, False)
    next(flow)
    with pytest.raises(StopIteration) as done:
        flow.send((header, []))
    result = done.value.value
    assert sorted(result) == ["OUTPUT0", "OUTPUT1"]
    np.testing.assert_array_equal(result["OUTPUT0"], decoded["OUTPUT0"])
    np.testing.assert_array_equal(result["OUTPUT1"], decoded["OUTPUT1"])


def test_error_request_and_the_daemons_refusal(vectors, addsub):
    request = vectors["error-request"]
    assert encode_infer(2, "addsub", {"INPUT0": INPUT0[:, :2], "INPUT1": INPUT1[:, :2]},
                        None, None, None) == [request]
    # the message is the daemon's validator's own, byte for byte
    assert daemon_answer(messages.decode_header(request), addsub) == vectors["error-reply"]
    header = messages.unpack(vectors["error-reply"])
    assert header == {"v": 1, "id": 2, "ok": False,
                      "error": {"code": errors.INVALID_ARG, "message": BAD_SHAPE_MESSAGE}}
    err = error_of(header)
    assert (err.code, err.message) == (errors.INVALID_ARG, BAD_SHAPE_MESSAGE)


def test_statistics_request_is_what_the_client_sends(vectors):
    # Client.statistics("addsub") without a session: model, and "" for any version
    assert encode_control(3, messages.OP_STATISTICS, model="addsub", version="") == [vectors["statistics-request"]]
    assert messages.decode_header(vectors["statistics-request"]) == \
        {"v": 1, "op": "statistics", "id": 3, "model": "addsub", "version": ""}


def test_each_size_limit_is_stated_once_with_the_codes_value():
    text = PROTOCOL_DOC.read_text(encoding="utf-8")
    limits = doc_section("Limits")
    inline = re.search(r"\*\*Inline tensors: ([\d,]+) bytes", limits)
    local = re.search(r"\*\*Local descriptors: above ([\d,]+) bytes", limits)
    assert inline and int(inline.group(1).replace(",", "")) == tensors.INLINE_LIMIT
    assert local and int(local.group(1).replace(",", "")) == tensors.LOCAL_MIN_BYTES
    datagram = re.search(r"\*\*Lane datagrams: ([\d,]+) bytes", limits)
    assert datagram and int(datagram.group(1).replace(",", "")) == lane.MAX_DATAGRAM
    for figure in (f"{tensors.INLINE_LIMIT:,}", f"{tensors.INLINE_LIMIT // 1024} KiB",
                   f"{tensors.LOCAL_MIN_BYTES:,}", f"{tensors.LOCAL_MIN_BYTES // 1024} KiB"):
        assert figure in limits and text.count(figure) == limits.count(figure), \
            f"{figure!r} is stated outside '## Limits' too"


def test_every_operation_and_error_code_is_documented():
    operations = doc_section("Operations")
    for op in sorted(messages.CONTROL_OPS | {messages.OP_INFER}):
        assert f"`{op}`" in operations, f"op '{op}' is missing from the Operations table"
    codes = doc_section("Errors")
    for code in sorted(errors.CODES):
        assert f"| `{code}` |" in codes, f"error code {code} is missing from the Errors table"
