"""BYTES tensors: the length-prefix walks (datatypes.check_bytes, decode_bytes,
bytes_boundaries) in C (_bytescan) and in the pure-Python fallback, with the
same answers and messages; and the broker's limits on BYTES inputs."""
from __future__ import annotations

import mmap
import struct

import pytest

from torchpool.broker.options import ServerOptions
from torchpool.broker.registry import ModelVersion
from torchpool.rules.request import read_infer
from torchpool.rules.validation import DEFAULT_LIMITS, TensorLimits, validate_infer
from torchpool.config import ModelConfig
from torchpool.config.pbtxt import parse_pbtxt
from torchpool.protocol import datatypes, errors
from torchpool.protocol.errors import TorchpoolError

ITEMS = [b"ab", b"", b"xyz", "\u00e9".encode()]
DATA = datatypes.encode_bytes(ITEMS)          # 4 prefixes + 7 bytes


@pytest.fixture(params=["c", "python"])
def walker(request, monkeypatch):
    """Run a test through the compiled walk and through the fallback."""
    if request.param == "python":
        monkeypatch.setattr(datatypes, "_bytescan", None)
    return request.param


def test_the_extension_is_built() -> None:
    # scripts/test installs torchpool with its C extensions; without this one
    # the broker walks BYTES tensors in Python, seconds for millions of elements
    assert datatypes._bytescan is not None


def test_valid_elements(walker: str) -> None:
    assert datatypes.check_bytes(DATA, 4) == 7
    assert datatypes.check_bytes(memoryview(DATA), 4, max_bytes=7) == 7
    assert datatypes.decode_bytes(DATA, 4) == ITEMS
    assert datatypes.decode_bytes(DATA) == ITEMS
    assert datatypes.bytes_boundaries(DATA, [1, 2, 1]) == [0, 6, 17, len(DATA)]
    assert datatypes.bytes_boundaries(DATA, []) == [0]


def test_count_zero(walker: str) -> None:
    assert datatypes.check_bytes(b"", 0) == 0
    assert datatypes.decode_bytes(b"", 0) == [] and datatypes.decode_bytes(b"") == []
    with pytest.raises(ValueError, match=r"^4 bytes follow the last of the 0 elements$"):
        datatypes.check_bytes(b"\0\0\0\0", 0)


@pytest.mark.parametrize("data, count, message", [
    (b"\x02\x00\x00\x00ab\x02\x00", 2,
     "element 1: its 4-byte length prefix is cut off (2 bytes remain at byte 6)"),
    (DATA + b"\x01", 5, "element 4: its 4-byte length prefix is cut off (1 bytes remain at byte 23)"),
    (b"\x05\x00\x00\x00ab", 1, "element 0 claims 5 bytes but only 2 remain"),
    (DATA[:-1], 4, "element 3 claims 2 bytes but only 1 remain"),
    (b"\xff\xff\xff\xff" + b"\0" * 8, 1, "element 0 claims 4294967295 bytes but only 8 remain"),
    (DATA, 5, "5 elements expected but the data ends after 4"),
    (DATA, 3, "6 bytes follow the last of the 3 elements"),          # the 4th: prefix + "é"
    (DATA + b"\0\0\0\0", 4, "4 bytes follow the last of the 4 elements"),
    (b"\0" * 12, 4, "4 elements expected but 12 bytes hold at most 3"),
    (b"\x02\x00", 1, "1 elements expected but 2 bytes hold at most 0"),
])
def test_broken_layouts_are_named(walker: str, data: bytes, count: int, message: str) -> None:
    with pytest.raises(ValueError) as info:
        datatypes.check_bytes(data, count)
    assert str(info.value) == message
    if "hold at most" not in message:          # decode_bytes makes no such shortcut
        with pytest.raises(ValueError) as info:
            datatypes.decode_bytes(data, count)
        assert str(info.value) == message


def test_decode_without_a_count_reads_to_the_end(walker: str) -> None:
    with pytest.raises(ValueError, match=r"^element 4: its 4-byte length prefix is cut off"):
        datatypes.decode_bytes(DATA + b"\0")
    assert datatypes.decode_bytes(DATA + b"\0\0\0\0") == ITEMS + [b""]


def test_max_bytes_counts_the_elements_bytes_not_their_prefixes(walker: str) -> None:
    assert datatypes.check_bytes(DATA, 4, max_bytes=7) == 7
    with pytest.raises(ValueError, match=r"^the 4 elements hold 7 bytes, more than 6$"):
        datatypes.check_bytes(DATA, 4, max_bytes=6)


def test_bytes_boundaries_refuse_a_group_beyond_the_end(walker: str) -> None:
    with pytest.raises(ValueError, match="element 0 claims 2 bytes but only 1 remain"):
        datatypes.bytes_boundaries(DATA[:-1], [3, 1])
    with pytest.raises(ValueError, match="2 elements expected but the data ends after 1"):
        datatypes.bytes_boundaries(DATA, [3, 2])


def test_elements_in_shared_memory(walker: str) -> None:
    # the broker walks client arenas and regions in place
    with mmap.mmap(-1, len(DATA) + 100) as m:
        m[:len(DATA)] = DATA
        view = memoryview(m)[:len(DATA)]
        assert datatypes.check_bytes(view, 4) == 7
        assert datatypes.decode_bytes(view, 4) == ITEMS
        del view


def test_a_large_tensor_of_long_elements(walker: str) -> None:
    items = [bytes([i % 251]) * (i * 37 % 5000) for i in range(3000)]
    data = datatypes.encode_bytes(items)
    assert len(data) > 64 * 1024                # walked without the GIL in C
    assert datatypes.check_bytes(data, 3000) == len(data) - 4 * 3000
    assert datatypes.decode_bytes(data, 3000) == items
    assert datatypes.bytes_boundaries(data, [1000, 2000]) == [
        0, 4000 + sum(map(len, items[:1000])), len(data)]


@pytest.mark.skipif(datatypes._bytescan is None, reason="the _bytescan extension was not built")
def test_four_million_empty_strings_are_checked() -> None:
    count = 1 << 22
    data = struct.pack("<I", 0) * count
    assert datatypes.check_bytes(data, count) == 0


# --- the limits on BYTES inputs (rules/validation.validate_infer) ---------

def strings_model(max_batch_size: int = 0) -> ModelVersion:
    cfg = ModelConfig.from_json({**parse_pbtxt(
        f'name: "m"\nplatform: "pytorch_libtorch"\nmax_batch_size: {max_batch_size}\n'
        'input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]\n'), "name": "m"})
    return ModelVersion("m", 1, cfg, "model.pt")


def infer(shape: list, frames: list, limits: TensorLimits = DEFAULT_LIMITS) -> list:
    header = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": shape, "data": 1}]}
    return validate_infer(read_infer(header), frames, strings_model(), limits=limits).staged


def test_the_default_limits_are_the_server_options_defaults() -> None:
    assert DEFAULT_LIMITS == TensorLimits(10 << 20, 256 << 20)
    assert (DEFAULT_LIMITS.max_bytes_elements, DEFAULT_LIMITS.max_bytes_tensor_bytes) == \
        (ServerOptions.max_bytes_elements, ServerOptions.max_bytes_tensor_bytes)
    options = ServerOptions("repo", [], max_bytes_elements=10, max_bytes_tensor_bytes=100)
    assert TensorLimits.of(options) == TensorLimits(10, 100)


def test_bytes_inputs_within_the_limits_are_accepted() -> None:
    data = datatypes.encode_bytes([b"a", b"bc"])
    staged = infer([2], [data], TensorLimits(2, len(data)))
    assert [(spec.name, shape, bytes(payload)) for spec, shape, _, payload, _ in staged] == \
        [("TEXT", [2], data)]


def test_too_many_elements_are_refused_without_looking_at_the_payload() -> None:
    # the entry names payload frame 1 and the message has none: the count is
    # refused before anyone looks for it
    with pytest.raises(TorchpoolError) as info:
        infer([10_485_761], [])
    assert info.value.code == errors.RESOURCE_EXHAUSTED
    assert info.value.message == ("input 'TEXT' for model 'm' has 10485761 BYTES elements; this server "
                                  "accepts at most 10485760 per tensor (--max-bytes-elements)")
    with pytest.raises(TorchpoolError, match="has 3 BYTES elements; this server accepts at most 2"):
        infer([3], [], TensorLimits(2, 100))


@pytest.mark.skipif(datatypes._bytescan is None, reason="the _bytescan extension was not built")
def test_the_default_takes_triton_s_own_ten_million_elements() -> None:
    """L0_grpc's python_unit_test.py sends 10,485,760 one-byte BYTES elements."""
    count = 10 * 1024 * 1024
    data = struct.pack("<Ic", 1, b"A") * count
    staged = infer([count], [data])
    assert staged[0][1] == [count] and len(staged[0][3]) == 5 * count


def test_too_many_bytes_are_refused_before_the_scan() -> None:
    data = datatypes.encode_bytes([b"x" * 10])             # 14 bytes on the wire
    with pytest.raises(TorchpoolError) as info:
        infer([1], [data], TensorLimits(10, 13))
    assert info.value.code == errors.RESOURCE_EXHAUSTED
    assert info.value.message == ("input 'TEXT' for model 'm' has 14 bytes of BYTES elements; this server "
                                  "accepts at most 13 per tensor (--max-bytes-tensor-bytes)")
    # not scanned: a broken payload over the limit is refused for its size
    with pytest.raises(TorchpoolError) as info:
        infer([1], [b"\xff" * 14], TensorLimits(10, 13))
    assert info.value.code == errors.RESOURCE_EXHAUSTED


def test_a_broken_layout_is_invalid_and_named() -> None:
    with pytest.raises(TorchpoolError) as info:
        infer([2], [datatypes.encode_bytes([b"a"])])
    assert info.value.code == errors.INVALID_ARG
    assert info.value.message == ("input 'TEXT' for model 'm' (BYTES, shape [2]): 2 elements expected but "
                                  "5 bytes hold at most 1; each element is a 4-byte little-endian length "
                                  "and its bytes")
