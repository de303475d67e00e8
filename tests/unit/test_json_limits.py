"""The gateway's limits on the shape of a JSON document (issue 39, item 3):
nesting deeper than Triton's 100 levels, and more arrays and objects than
MAX_JSON_CONTAINERS, refused by a walk that makes nothing of the document,
before json.loads makes a Python object of each. The walk in C
(_bytescan.json_scan) and the regular-expression fallback give the same
answers."""
from __future__ import annotations

import json
import math
import random
import time
import tracemalloc

import pytest

from torchpool.gateway import http_binary
from torchpool.gateway.http_binary import (CONTROL_ITEMS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, control_document,
                                          json_scan, load_json)
from torchpool.protocol.errors import TorchpoolError

MiB = 1 << 20
NO_LIMIT = 1 << 62


@pytest.fixture(params=["c", "python"])
def walker(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(http_binary, "_json_scan_c", None)
        monkeypatch.setattr(http_binary, "_json_prune_c", None)
    return request.param


def test_the_c_walk_is_built() -> None:
    # scripts/test builds the extension: without it the walk is a regular
    # expression, seconds for documents of millions of brackets (and the cut
    # of a control document's deep values 0.1-0.2 s per MiB, in the gateway's loop)
    assert http_binary._json_scan_c is not None
    assert http_binary._json_prune_c is not None


@pytest.mark.parametrize("doc, counts", [
    (b"", (0, 0, 0)),
    (b"1.5", (0, 0, 3)),
    (b"[]", (1, 1, 2)),
    (b'{"a": [1, [2, {}]], "b": []}', (5, 4, 28)),
    (b'["[[[{{", "]]]"]', (1, 1, 16)),                     # brackets in strings are text
    (b'["a\\"[[", "\\\\", [[]]]', (3, 3, 21)),             # an escaped quote; an escaped backslash
    (b'["\\\\\\"[", []]', (2, 2, 13)),                     # \\ then \" inside one string
    (b'["unterminated [[[', (1, 1, 18)),                   # walked to its end; json.loads says why
    (b"]]][", (1, 1, 4)),                                  # broken: never below 0
])
def test_counts(walker: str, doc: bytes, counts: tuple) -> None:
    assert json_scan(doc, NO_LIMIT, NO_LIMIT) == counts
    assert json_scan(memoryview(bytearray(doc)), NO_LIMIT, NO_LIMIT) == counts


def test_the_walk_stops_at_the_first_bracket_over_a_limit(walker: str) -> None:
    assert json_scan(b"[[[[1]]]]", 3, NO_LIMIT) == (4, 4, 3)
    assert json_scan(b"[[],[],[],[]]", NO_LIMIT, 3) == (4, 2, 7)
    assert json_scan(b"[[],[],[]]", NO_LIMIT, 4) == (4, 2, 10)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"0" + b"]" * depth


def test_nesting_to_100_is_taken_and_deeper_refused(walker: str) -> None:
    assert MAX_JSON_DEPTH == 100
    assert load_json(nested(100)) == json.loads(nested(100))
    # Triton's words (http_server.cc, HTTP_MAX_JSON_NESTING_DEPTH), then where
    with pytest.raises(TorchpoolError, match=r"JSON nesting depth exceeds maximum allowed limit \(100\): "
                                             r"the request JSON nests deeper at byte 100$"):
        load_json(nested(101))
    with pytest.raises(TorchpoolError, match=r"nests deeper at byte 100$"):
        load_json(nested(100_000))                      # was a RecursionError, caught


def test_control_documents_read_a_value_nested_too_deeply_as_a_wrong_value(walker: str) -> None:
    """Triton parses a repository or load request whole and then refuses the
    field's type; here the value is cut out before json.loads, whole."""
    doc = b'{"ready": ' + nested(250_000) + b', "s": "[[[", "n": ' + nested(2) + b"}"
    parsed = load_json(doc, deep_values=True)
    assert isinstance(parsed, dict) and parsed["s"] == "[[[" and parsed["n"] == [[0]]
    value = parsed["ready"]
    for _ in range(99):                                 # 99 levels under the object's: kept
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert isinstance(value, float) and math.isnan(value)   # the 101st level and under: one NaN
    assert load_json(nested(5), deep_values=True) == json.loads(nested(5))
    with pytest.raises(TorchpoolError, match=r"nests deeper at byte 109$"):
        load_json(b'{"ready": ' + nested(250_000) + b"}")   # not a control request: refused


PRUNED = [
    # (document, max_depth): what is cut, the same in C and in Python
    (b"", 0), (b"[]", 0), (b"[]", 1), (b"[[1]]", 1), (b"[[1],[2,[3]],4]", 1), (b"[[1],[2,[3]],4]", 2),
    (b'{"a": {"b": [1]}, "c": "x"}', 1), (b'{"a": {"b": [1]}, "c": "x"}', 2),
    (b'["[[[", [["]]]", {}]], "{"]', 1),                         # brackets in strings are text
    (b'[["a\\"[[", [[]]], "\\\\", [[]]]', 1),                  # escaped quotes and backslashes
    (b"[[[1]]", 1),                                             # a deep value still open at the end
    (b'[[["unterminated [[[', 1),                               # ... and in a string that never ends
    (b"]]][[[]]]][[", 1), (b"}{}{", 0),                         # broken: the depth never below 0
    (b"[" * 300 + b"0" + b"]" * 300, 100),
]


@pytest.mark.parametrize("doc, max_depth", PRUNED)
def test_the_cut_of_deep_values_is_the_same_in_c_and_in_python(doc: bytes, max_depth: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    c = http_binary._json_prune_c
    assert c is not None
    monkeypatch.setattr(http_binary, "MAX_JSON_DEPTH", max_depth)
    expected = http_binary._prune_deep_re(doc)
    assert c(doc, max_depth, http_binary.DEEP_VALUE) == expected
    assert c(memoryview(bytearray(doc)), max_depth, http_binary.DEEP_VALUE) == expected
    assert http_binary._prune_deep(doc) == expected


def test_the_cut_of_deep_values_is_the_same_in_c_and_in_python_for_random_documents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = http_binary._json_prune_c
    assert c is not None
    rng = random.Random(39)
    tokens = [b"[", b"]", b"{", b"}", b'"', b"\\", b"1", b","]
    for _ in range(2000):
        doc = b"".join(rng.choices(tokens, weights=[6, 5, 3, 3, 2, 1, 2, 2], k=rng.randrange(0, 80)))
        depth = rng.randrange(0, 6)
        monkeypatch.setattr(http_binary, "MAX_JSON_DEPTH", depth)
        assert c(doc, depth, b"NaN") == http_binary._prune_deep_re(doc), (doc, depth)
    # large enough to be walked without the GIL, and a replacement longer than what it replaces
    doc = b"[" + b"[[[]],[],{}]," * 20000 + b"0]"
    monkeypatch.setattr(http_binary, "MAX_JSON_DEPTH", 2)
    assert c(doc, 2, b'"a deep value"') == http_binary._prune_deep_re(doc).replace(b"NaN", b'"a deep value"')


def test_a_large_control_document_nested_too_deeply_is_refused(walker: str) -> None:
    # the cut is a Python walk in the gateway's loop: only for documents up to 1 MiB
    assert http_binary.DEEP_VALUES_BYTES == 1 << 20
    doc = b'{"pad": "' + b"x" * (1 << 20) + b'", "ready": ' + nested(101) + b"}"
    with pytest.raises(TorchpoolError, match=r"JSON nesting depth exceeds maximum allowed limit \(100\)"):
        load_json(doc, deep_values=True)


def test_too_many_arrays_and_objects_deep_in_a_control_document_are_refused(
        walker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_binary, "MAX_JSON_CONTAINERS", 200)
    with pytest.raises(TorchpoolError, match="more than 200 arrays and objects"):
        load_json(b'{"ready": ' + nested(300) + b"}", deep_values=True)


def test_too_many_arrays_and_objects_are_refused(walker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_binary, "MAX_JSON_CONTAINERS", 10)
    doc = b'{"a": [' + b"{}," * 7 + b"[]]}"
    assert load_json(doc)["a"][-1] == []                 # 10: taken
    with pytest.raises(TorchpoolError, match=r"\] the request JSON has more than 10 arrays and objects \(the "
                                             r"limit: each takes about 80 bytes as a Python object\): "
                                             r"send tensor data as flat arrays, or as binary data$"):
        load_json(doc.replace(b"{},", b"{},{},", 1))


def attack(size: int) -> bytes:
    """`size` bytes of a request whose data is empty lists (the review's body)."""
    head = b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":['
    return head + b"[]," * ((size - len(head) - 6) // 3) + b"[]]}]}"


def test_sixty_mib_of_empty_lists_is_refused_and_makes_nothing() -> None:
    """json.loads took 16 s and 1.4 GiB for it (gateway helper: 1.6 GiB, 44 s);
    refused before any object is made. (How long it takes is scripts/bench's
    to say: a timed assertion fails on a loaded machine.)"""
    doc = attack(60 * MiB)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(TorchpoolError, match=f"more than {MAX_JSON_CONTAINERS} arrays and objects"):
            http_binary.infer_call(doc, None, len(doc), "m", convert=True)
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"60 MiB of '[],': refused in {took * 1e3:.1f} ms, {peak >> 10} KiB allocated at the peak")
    assert peak < MiB


def test_a_large_document_of_numbers_passes_the_walk() -> None:
    """A large honest document (60 MiB of floats: one array, no nesting)
    passes (walked in 6 ms on the development VM, beside json.loads' 5.6 s)."""
    doc = b"[" + b"1.5," * (15 * MiB) + b"1]"
    started = time.perf_counter()
    assert json_scan(doc, MAX_JSON_DEPTH, MAX_JSON_CONTAINERS) == (1, 1, len(doc))
    took = time.perf_counter() - started
    print(f"walk of {len(doc) >> 20} MiB of floats: {took * 1e3:.0f} ms")


# --- shapes: Triton's parse and its size checks before "data" (http_test.py) ---------

def infer_doc(shape: list, datatype: str = "FP32", data: object = (1.0,)) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": shape,
                                   "data": list(data)}]}).encode()


@pytest.mark.parametrize("dim", [-5, 1.5, "2", None, 1 << 64, 1 << 200])
def test_a_dimension_that_is_no_uint64_is_triton_s_internal_error(dim: object) -> None:
    with pytest.raises(TorchpoolError) as info:
        http_binary.parse_infer(infer_doc([2, dim]), {}, "m")
    assert (info.value.code, info.value.message) == (
        "INTERNAL", "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer")


def test_a_dimension_past_int64_is_an_invalid_dimension() -> None:
    with pytest.raises(TorchpoolError) as info:
        http_binary.parse_infer(infer_doc([1, 1 << 63]), {}, "m")
    assert (info.value.code, info.value.message) == (
        "INVALID_ARG", "invalid shape for input 'INPUT0': shape [1,-9223372036854775808] contains one or "
                       "more invalid dimensions")


@pytest.mark.parametrize("shape, datatype, message", [
    ([16, (1 << 60) + 2], "FP32", "invalid shape for input 'INPUT0': shape [16,1152921504606846978] causes "
                                  "total element count to exceed maximum size of 9223372036854775807"),
    ([4, (1 << 60) + 2], "FP32", "byte size overflow for input 'INPUT0': element count (4611686018427387912) "
                                 "* data type size (4) exceeds maximum allowed size (9223372036854775807)"),
])
def test_element_count_and_byte_size_overflow_are_triton_s_texts(shape: list, datatype: str,
                                                                  message: str) -> None:
    with pytest.raises(TorchpoolError) as info:
        http_binary.parse_infer(infer_doc(shape, datatype), {}, "m")
    assert (info.value.code, info.value.message) == ("INVALID_ARG", message)


def test_a_zero_dimension_or_a_byte_sized_type_stops_no_request() -> None:
    # no overflow where Triton finds none: a 0 dimension ends the count; a 1-byte
    # type (and BYTES) has no byte-size product; the data check comes after
    for shape, datatype in (([0, 1 << 62, 1 << 62], "FP32"), ([4, (1 << 60) + 2], "UINT8"),
                            ([4, (1 << 60) + 2], "BYTES")):
        call = http_binary.parse_infer(infer_doc(shape, datatype), {}, "m")
        assert call.inputs[0].shape == shape


def _entries(value: object) -> int:
    """Array and object entries in a parsed document, nested ones included."""
    if isinstance(value, list):
        return len(value) + sum(_entries(v) for v in value)
    if isinstance(value, dict):
        return len(value) + sum(_entries(v) for v in value.values())
    return 0


def test_a_control_document_comes_back_with_a_bounded_number_of_entries() -> None:
    """What the helper hands back for the event loop to unpickle is bounded in
    total, not only per array: 4,096 keys each holding 4,096 numbers (32 MiB,
    every container at the limit) came back whole, 16 million objects."""
    per = CONTROL_ITEMS
    body = b'{"parameters": {' + b",".join(b'"k%d": [%s1]' % (i, b"1," * (per - 1)) for i in range(per)) + b"}}"
    assert len(body) < 64 << 20
    doc = control_document(body, deep_values=True)
    assert isinstance(doc, dict)
    assert _entries(doc) <= CONTROL_ITEMS
    # a small control document comes back whole
    small = {"parameters": {"config": "{}", "file:1/model.pt": "AAAA"}, "ready": True}
    assert control_document(json.dumps(small).encode(), deep_values=True) == small
