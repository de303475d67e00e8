"""torchpool.protocol.internal: typed broker <-> worker messages on the old wire."""
from __future__ import annotations


import msgpack
import pytest

from torchpool.protocol import internal
from torchpool.protocol.internal import (
    Done, Failed, Forget, InputDescriptor, LoadFailed, OutputDescriptor, OutputTarget,
    ProtocolViolation, Ready, Release, Run, Segments, Stop, decode, encode,
)

IN0 = ["INPUT0", "FP32", [1, 16], "torchpool.abc.in.0", 4096, 64, 0]
IN1 = ["INPUT1", "FP32", [1, 16], ["key", 1234], 8192, 64, 7, True]
OUT0 = ["OUTPUT0", "FP32", [1, 16], "torchpool.abc.w0.0", 0, 64]


def packed(*elements: object) -> bytes:
    """A message as the positional code wrote it before the NamedTuples."""
    return msgpack.packb(list(elements), use_bin_type=True)


def test_run_decodes_the_positional_wire_into_named_fields() -> None:
    target = ["OUTPUT1", ["key", 1234], 64, 256]
    msg = decode(packed(internal.RUN, 5, [IN0, IN1], ["OUTPUT0", target], [["seg", 0, 64]]))
    assert type(msg) is Run and msg.batch_id == 5
    a, b = msg.inputs
    assert type(a) is InputDescriptor and a.name == "INPUT0" and a.shape == [1, 16]
    assert (a.segment, a.offset, a.nbytes, a.generation, a.reuse) == ("torchpool.abc.in.0", 4096, 64, 0, False)
    assert (b.segment, b.generation, b.reuse) == (["key", 1234], 7, True)
    assert msg.outputs == ["OUTPUT0", OutputTarget("OUTPUT1", ["key", 1234], 64, 256)]
    assert type(msg.outputs[1]) is OutputTarget
    segment, offset, size = msg.releases[0]
    assert (segment, offset, size) == ("seg", 0, 64)


@pytest.mark.parametrize("msg, wire", [
    (Run(3, [InputDescriptor(*IN0)], []), [internal.RUN, 3, [IN0 + [False]], [], [], 0]),
    (Run(3, [InputDescriptor(*IN1)], ["OUTPUT0"], [internal.Block("s", 0, 8)], 17),
     [internal.RUN, 3, [IN1], ["OUTPUT0"], [["s", 0, 8]], 17]),
    (Segments([["torchpool.x.w0.l1", 4096, 17]]), [internal.SEGMENTS, [["torchpool.x.w0.l1", 4096, 17]]]),
    (Release([["s", 0, 8]]), [internal.RELEASE, [["s", 0, 8]]]),
    (Forget(["torchpool.x.c1", ["key", 9]]), [internal.FORGET, ["torchpool.x.c1", ["key", 9]]]),
    (Stop(), [internal.STOP]),
    (Ready(4321, "cpu"), [internal.READY, 4321, "cpu"]),
    (LoadFailed("INVALID_ARG", "bad"), [internal.LOAD_FAILED, "INVALID_ARG", "bad"]),
    (Done(3, [OutputDescriptor(*OUT0)], internal.Timings(1, 2, 3), ["OUTPUT0"]),
     [internal.DONE, 3, [OUT0], [1, 2, 3], ["OUTPUT0"]]),
    (Failed(3, "INTERNAL", "boom"), [internal.FAILED, 3, "INTERNAL", "boom"]),
])
def test_encode_writes_the_same_arrays_and_decode_reads_them_back(msg: tuple, wire: list) -> None:
    raw = encode(msg)
    assert msgpack.unpackb(raw, raw=False) == wire
    back = decode(raw)
    assert type(back) is type(msg)
    assert msgpack.unpackb(encode(back), raw=False) == wire
    assert internal.KIND_OF[type(back)] == wire[0]


def test_done_from_the_old_wire() -> None:
    msg = decode(packed(internal.DONE, 9, [OUT0], [10, 20, 30], []))
    assert type(msg) is Done and msg.batch_id == 9 and msg.reused == []
    assert type(msg.outputs[0]) is OutputDescriptor and msg.outputs[0].segment == "torchpool.abc.w0.0"
    input_ns, infer_ns, output_ns = msg.timings
    assert (input_ns, infer_ns, output_ns) == (10, 20, 30)
    # an older worker that sent no reused list
    assert list(decode(packed(internal.DONE, 9, [], [1, 2, 3])).reused) == []


def test_trailing_elements_are_ignored() -> None:
    assert decode(packed(internal.READY, 1, "cpu", "something new")) == Ready(1, "cpu")
    assert decode(packed(internal.FAILED, 1, "INTERNAL", "x", {"more": 1})) == Failed(1, "INTERNAL", "x")


def test_match_statements_work() -> None:
    match decode(encode(Failed(2, "INTERNAL", "boom"))):
        case Failed(batch_id, code, message):
            assert (batch_id, code, message) == (2, "INTERNAL", "boom")
        case _:
            pytest.fail("no match")


@pytest.mark.parametrize("raw", [
    b"",
    b"\xc1",                                        # not msgpack
    msgpack.packb({"kind": 1}),                     # not an array
    msgpack.packb([]),
    msgpack.packb([99, 1]),                         # unknown kind
    msgpack.packb([internal.RUN, 1]),               # too short
    msgpack.packb([internal.RUN, 1, [IN0[:5]], []]),   # a descriptor of 5 elements
    msgpack.packb([internal.RUN, 1, [IN0], [["OUTPUT0", 1, 2]]]),   # a requested output of 3
    msgpack.packb([internal.DONE, 1, [OUT0[:4]], [1, 2, 3], []]),
])
def test_garbage_raises_protocol_violation(raw: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        decode(raw)
