"""The infer request's one reader and writer (rules/request.py)."""
from __future__ import annotations

import msgpack
import pytest

from torchpool.protocol import messages
from torchpool.rules.request import InferCall, infer_header, read_infer

INPUTS = [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": b"\0" * 8}]


def test_what_the_client_writes_the_daemon_reads_back_the_same() -> None:
    call = InferCall(7, "addsub", "1", INPUTS, ["OUTPUT0"], 250_000, 123_456, 2,
                     {"id": 9, "start": True}, True)
    wire = messages.decode_header(messages.pack(infer_header(call)))
    assert wire["op"] == messages.OP_INFER and wire["v"] == messages.PROTOCOL_VERSION
    assert read_infer(wire) == call


def test_fields_at_their_defaults_are_left_off_the_wire() -> None:
    call = InferCall(1, "m", "", INPUTS, None, 0, None, 0, None, False)
    header = infer_header(call)
    assert set(header) == {"v", "op", "id", "model", "version", "inputs", "outputs", "timeout_us"}
    back = read_infer(msgpack.unpackb(msgpack.packb(header)))
    assert back._replace(priority=0) == call and back.priority is None   # absent: the default level


@pytest.mark.parametrize("timeout", [-1, True, 1.5, "100", None, [1]])
def test_a_timeout_that_is_not_a_non_negative_integer_is_none(timeout: object) -> None:
    assert read_infer({"timeout_us": timeout}).timeout_us == 0


@pytest.mark.parametrize("sent", [True, 1.0, "5", None])
def test_a_send_time_that_is_not_an_integer_is_unknown(sent: object) -> None:
    assert read_infer({"timeout_us": 10, "sent_ns": sent}).sent_ns is None


def test_a_header_missing_everything_still_reads() -> None:
    call = read_infer({})
    assert call == InferCall(None, None, None, None, None, 0, None, None, None, False)
