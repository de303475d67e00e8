"""torchpool perf's inputs: from a model's metadata (as the daemon answers it),
generated or read from perf_analyzer's JSON or .npy files, and the errors
that name the model, the tensor and what was expected."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from torchpool.client import RawTensor
from torchpool.protocol import datatypes
from torchpool.perf.inputs import InputError, build_requests, model_inputs, parse_shape

# what the daemon answers for the example models addsub and strings
ADDSUB = model_inputs("addsub", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]},
                                            {"name": "INPUT1", "datatype": "FP32", "shape": [-1, 16]}]},
                      {"max_batch_size": 8})
STRINGS = model_inputs("strings", {"inputs": [{"name": "INPUT__0", "datatype": "BYTES", "shape": [-1]}]},
                       {"max_batch_size": 0})
MIXED = model_inputs("mixed", {"inputs": [{"name": "I", "datatype": "INT64", "shape": [-1, 2, -1]},
                                          {"name": "B", "datatype": "BOOL", "shape": [-1, 3]},
                                          {"name": "H", "datatype": "BF16", "shape": [-1, 2]}]},
                     {"max_batch_size": 4})


def test_specs_from_metadata_drop_the_batch_dimension() -> None:
    assert [(s.name, s.datatype, s.dims) for s in ADDSUB.specs] == [("INPUT0", "FP32", (16,)),
                                                                    ("INPUT1", "FP32", (16,))]
    assert STRINGS.specs[0].dims == (-1,) and STRINGS.max_batch_size == 0


def test_parse_shape() -> None:
    assert parse_shape("INPUT__0:4") == ("INPUT__0", [4])
    assert parse_shape("a:b:2,3") == ("a:b", [2, 3])            # the name may hold a colon
    for bad in ("INPUT0", "INPUT0:", ":4", "INPUT0:0", "INPUT0:2,x", "INPUT0:-1"):
        with pytest.raises(InputError, match="--shape expects NAME:d1,d2"):
            parse_shape(bad)


def test_zero_and_random_with_the_batch() -> None:
    (zero,) = build_requests(ADDSUB, 3, "zero", {})
    assert zero["INPUT0"].shape == (3, 16) and zero["INPUT0"].dtype == np.float32
    assert not zero["INPUT0"].any()
    (rand,) = build_requests(ADDSUB, 1, "random", {})
    (again,) = build_requests(ADDSUB, 1, "random", {})
    assert rand["INPUT0"].shape == (1, 16) and 0 <= rand["INPUT0"].min() and rand["INPUT0"].max() < 1
    assert len(np.unique(rand["INPUT0"])) == 16
    np.testing.assert_array_equal(rand["INPUT1"], again["INPUT1"])    # seeded


def test_generated_bytes_bool_int_and_bf16() -> None:
    (s,) = build_requests(STRINGS, 1, "random", {"INPUT__0": [3]}, string_length=5)
    value = s["INPUT__0"]
    assert isinstance(value, RawTensor) and value.datatype == "BYTES" and value.shape == (3,)
    items = datatypes.decode_bytes(value.data, 3)
    assert len(items) == 3 and all(len(x) == 5 and x.isalpha() for x in items)
    (z,) = build_requests(STRINGS, 1, "zero", {"INPUT__0": [2]}, string_length=3)
    assert datatypes.decode_bytes(z["INPUT__0"].data, 2) == [b"000", b"000"]

    (m,) = build_requests(MIXED, 2, "random", {"I": [2, 5]})
    assert m["I"].shape == (2, 2, 5) and m["I"].dtype == np.int64
    assert m["B"].shape == (2, 3) and m["B"].dtype == np.bool_
    assert m["H"].datatype == "BF16" and m["H"].shape == (2, 2) and len(m["H"].data) == 8


def test_json_entries_are_batch_items_taken_in_turn(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [
        {"INPUT0": list(range(16)), "INPUT1": {"content": [1] * 16, "shape": [16]}},
        {"INPUT0": [5] * 16, "INPUT1": [2.5] * 16},
        {"INPUT0": [7] * 16, "INPUT1": [3] * 16}]}))
    requests = build_requests(ADDSUB, 2, str(path), {})
    assert len(requests) == 3                       # one request per entry, used in turn
    first, second, third = requests
    assert first["INPUT0"].shape == (2, 16) and first["INPUT0"].dtype == np.float32
    np.testing.assert_array_equal(first["INPUT0"][0], np.arange(16))
    np.testing.assert_array_equal(first["INPUT1"][1], [2.5] * 16)
    np.testing.assert_array_equal(second["INPUT0"][:, 0], [7, 0])     # entries 2 and 0 (wrapped)
    np.testing.assert_array_equal(third["INPUT0"][:, 0], [5, 7])


def test_json_bytes_with_its_own_shape(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"data": [{"INPUT__0": {"content": ["ab", "c"], "shape": [2]}},
                                         {"INPUT__0": ["xyz"]}]}))
    with pytest.raises(InputError, match="dynamic dims"):
        build_requests(STRINGS, 1, str(path), {})        # the second entry has no shape
    path.write_text(json.dumps({"data": [{"INPUT__0": {"content": ["ab", "c"], "shape": [2]}}]}))
    (r,) = build_requests(STRINGS, 1, str(path), {})
    assert r["INPUT__0"].shape == (2,) and datatypes.decode_bytes(r["INPUT__0"].data, 2) == [b"ab", b"c"]


@pytest.mark.parametrize("document, says", [
    ({"data": [{"INPUT0": [0] * 16}]}, "entry 0: no value for input 'INPUT1' of model 'addsub'"),
    ({"data": [{"INPUT0": [0] * 15, "INPUT1": [0] * 16}]}, "'INPUT0' of model 'addsub' with shape [16] "
                                                            "needs 16 values, got 15"),
    ({"data": [{"INPUT0": ["a"] * 16, "INPUT1": [0] * 16}]}, "is FP32: values of type <U1 do not fit"),
    ({"data": [{"INPUT0": {"shape": [16]}, "INPUT1": [0] * 16}]}, "an object needs \"content\""),
    ({"data": [{"INPUT0": {"content": [0] * 8, "shape": [8]}, "INPUT1": [0] * 16}]},
     "input 'INPUT0' of model 'addsub' has dims [16] (without the batch dimension), got shape [8]"),
    ({"inputs": []}, "expected {\"data\""),
    ([1, 2], "expected {\"data\""),
])
def test_json_errors(tmp_path: Path, document: object, says: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(InputError) as info:
        build_requests(ADDSUB, 1, str(path), {})
    assert says in str(info.value)


def test_json_rounds_nothing(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"data": [{"I": {"content": [[0.5, 1], [2, 3]], "shape": [2, 2]},
                                          "B": [True, False, True], "H": [1.0, 2.0]}]}))
    with pytest.raises(InputError, match="'I' of model 'mixed' is INT64: values of type float64 do not fit"):
        build_requests(MIXED, 1, str(path), {})


def test_npy_directory(tmp_path: Path) -> None:
    np.save(tmp_path / "INPUT0.npy", np.arange(16, dtype=np.float64))          # one item: tiled
    np.save(tmp_path / "INPUT1.npy", np.ones((2, 16), dtype=np.int32))          # the whole batch
    (r,) = build_requests(ADDSUB, 2, str(tmp_path), {})
    assert r["INPUT0"].shape == (2, 16) and r["INPUT0"].dtype == np.float32
    np.testing.assert_array_equal(r["INPUT0"][1], np.arange(16))
    np.testing.assert_array_equal(r["INPUT1"], np.ones((2, 16)))
    with pytest.raises(InputError, match="its batch dimension is 2, but -b is 3"):
        build_requests(ADDSUB, 3, str(tmp_path), {})
    (tmp_path / "INPUT1.npy").unlink()
    with pytest.raises(InputError, match="cannot read input 'INPUT1' of model 'addsub'"):
        build_requests(ADDSUB, 2, str(tmp_path), {})

    strings = tmp_path / "s"
    strings.mkdir()
    np.save(strings / "INPUT__0.npy", np.array(["a", "bc"]))
    (s,) = build_requests(STRINGS, 1, str(strings), {})
    assert datatypes.decode_bytes(s["INPUT__0"].data, 2) == [b"a", b"bc"]

    # an object array is a pickle, which would run code as it loads: refused
    np.save(strings / "INPUT__0.npy", np.array([b"a", None], dtype=object), allow_pickle=True)
    with pytest.raises(InputError, match="cannot read input 'INPUT__0' of model 'strings'.*allow_pickle=False"):
        build_requests(STRINGS, 1, str(strings), {})


def test_batch_and_shape_errors() -> None:
    with pytest.raises(InputError, match="model 'strings' does not batch"):
        build_requests(STRINGS, 2, "zero", {"INPUT__0": [1]})
    with pytest.raises(InputError, match="model 'addsub' takes batches of at most 8, got -b 9"):
        build_requests(ADDSUB, 9, "zero", {})
    with pytest.raises(InputError, match="at least 1"):
        build_requests(ADDSUB, 0, "zero", {})
    with pytest.raises(InputError, match=r"model 'addsub' has no input 'X' \(its inputs: INPUT0, INPUT1\)"):
        build_requests(ADDSUB, 1, "zero", {"X": [1]})
    with pytest.raises(InputError, match=r"give its shape with --shape I:2,N"):
        build_requests(MIXED, 1, "zero", {})
    with pytest.raises(InputError, match=r"input 'I' of model 'mixed' has dims \[2, -1\] .*got shape \[3, 3\]"):
        build_requests(MIXED, 1, "zero", {"I": [3, 3]})
    with pytest.raises(InputError, match="expected zero, random, a JSON file or a directory"):
        build_requests(ADDSUB, 1, "/nonexistent/x", {})
