"""Triton's classification extension without a daemon: the worker's top-k
strings (worker/classify.py), the broker's checks of `classification` and
its batch rule (broker/requests.py), the split of a classified answer
(broker/answers/split.py) and the RUN message that carries it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchpool.broker.answers.split import split_outputs
from torchpool.broker.batch import Batch
from torchpool.broker.registry import ModelVersion
from torchpool.broker.requests import InferRequest, batch_layout
from torchpool.rules.validation import _requested_outputs
from torchpool.client import Classification
from torchpool.config import ModelConfig
from torchpool.config.pbtxt import parse_pbtxt
from torchpool.protocol import datatypes, errors, internal, tensors
from torchpool.protocol.errors import TorchpoolError
from torchpool.protocol.internal import OutputDescriptor
from torchpool.worker.classify import Classified, Classifier, read_labels, split_lines, top_k
from torchpool.worker.settings import ExecutionError, ModelLoadError
from torchpool.rules.validation import Staged


def config(max_batch_size: int = 8, label: str = "labels.txt") -> ModelConfig:
    label_line = f' label_filename: "{label}"' if label else ""
    text = (f'name: "m"\nplatform: "pytorch_libtorch"\nmax_batch_size: {max_batch_size}\n'
            'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'output [ { name: "PROBS__0" data_type: TYPE_FP32 dims: [ 4 ]' + label_line + ' },\n'
            '         { name: "FLAT__1" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },\n'
            '         { name: "TEXT__2" data_type: TYPE_STRING dims: [ 1 ] },\n'
            '         { name: "MASK__3" data_type: TYPE_BOOL dims: [ 4 ] },\n'
            '         { name: "HALF__4" data_type: TYPE_FP16 dims: [ 4 ] } ]\n')
    return ModelConfig.from_json({**parse_pbtxt(text), "name": "m"})


# ------------------------------------------------------------ top-k strings

def test_ties_come_out_lowest_index_first_per_batch_item() -> None:
    value = torch.tensor([[0.25, 0.5, 0.5, 0.125],
                          [1.0, 1.0, 1.0, 1.0]], dtype=torch.float32)
    got = top_k(value, 3, batched=True)
    assert got.shape == [2, 3]
    assert list(got) == [b"0.500000:1", b"0.500000:2", b"0.250000:0",
                         b"1.000000:0", b"1.000000:1", b"1.000000:2"]


def test_k_larger_than_the_elements_returns_all_of_them() -> None:
    value = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
    got = top_k(value, 10, batched=True)
    assert got.shape == [2, 2]
    assert list(got) == [b"3:0", b"1:1", b"7:1", b"0:0"]
    # not batched: the whole tensor, flattened
    got = top_k(value, 10, batched=False)
    assert got.shape == [4] and list(got) == [b"7:3", b"3:0", b"1:1", b"0:2"]


def test_labels_missing_for_some_indices_leave_the_label_out() -> None:
    labels = [b"cat", b"", b"dog"]          # index 1: an empty line; 3 and 4: past the end
    value = torch.tensor([0.1, 0.9, 0.3, 0.7, 0.5], dtype=torch.float64)
    got = top_k(value, 5, batched=False, labels=labels)
    assert list(got) == [b"0.900000:1", b"0.700000:3", b"0.500000:4", b"0.300000:2:dog",
                         b"0.100000:0:cat"]


def test_scores_are_printed_as_cpp_to_string_prints_them() -> None:
    floats = top_k(torch.tensor([1e-7, -2.5, 1e20, 0.1], dtype=torch.float32), 4, batched=False)
    # float32 0.1 is 0.100000001490116...: "%f" of its double, as std::to_string(float)
    assert list(floats) == [b"100000002004087734272.000000:2", b"0.100000:3", b"0.000000:0",
                            b"-2.500000:1"]
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                  torch.uint16, torch.uint32, torch.uint64):
        assert list(top_k(torch.tensor([[5, 9, 2]]).to(dtype), 2, batched=True)) == [b"9:1", b"5:0"]
    big = torch.tensor([3, 2**64 - 1], dtype=torch.uint64)
    assert list(top_k(big, 1, batched=False)) == [b"18446744073709551615:1"]
    assert list(top_k(torch.tensor([-3, -1], dtype=torch.int8), 1, batched=False)) == [b"-1:1"]


def test_a_batch_item_is_ranked_over_all_its_elements() -> None:
    value = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)   # items of 6 elements
    got = top_k(value, 2, batched=True, labels=[b"l%d" % i for i in range(6)])
    assert got.shape == [2, 2]
    assert list(got) == [b"5.000000:5:l5", b"4.000000:4:l4", b"11.000000:5:l5", b"10.000000:4:l4"]


def test_zero_rows_give_an_empty_batch() -> None:
    got = top_k(torch.zeros((0, 4)), 3, batched=True)
    assert got.shape == [0, 3] and list(got) == []


def test_the_strings_travel_as_bytes_elements() -> None:
    got = top_k(torch.tensor([[0.5, 0.25]]), 2, batched=True, labels=[b"a", b"b"])
    data = datatypes.encode_bytes(got)
    arr = tensors.decode_array("BYTES", got.shape, data)
    assert arr.shape == (1, 2) and arr.tolist() == [[b"0.500000:0:a", b"0.250000:1:b"]]


# ------------------------------------------------------------ labels

def test_label_lines_as_getline_reads_them() -> None:
    assert split_lines(b"a\nb\n") == [b"a", b"b"]
    assert split_lines(b"a\nb") == [b"a", b"b"]
    assert split_lines(b"a\n\nc\n") == [b"a", b"", b"c"]
    assert split_lines(b"") == []
    assert split_lines(b"\n") == [b""]
    assert split_lines(b"a\r\nb\r\n") == [b"a\r", b"b\r"]       # getline keeps the \r


def test_labels_are_read_from_the_model_directory(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_bytes("zero\none\nzwei \u00e4\n".encode())
    assert read_labels(config(), tmp_path) == {"PROBS__0": [b"zero", b"one", "zwei \u00e4".encode()]}
    assert read_labels(config(label=""), tmp_path) == {}


def test_a_missing_label_file_fails_the_load_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        Classifier.load(config(label="nowhere.txt"), tmp_path)
    message = info.value.message
    assert "nowhere.txt" in message and "'PROBS__0'" in message and "model 'm'" in message
    assert "No such file" in message


def test_the_classifier_replaces_only_the_outputs_asked_classified(tmp_path: Path) -> None:
    (tmp_path / "labels.txt").write_text("a\nb\nc\nd\n")
    classifier = Classifier.load(config(), tmp_path)
    region = internal.OutputTarget("FLAT__1", ["key", 1], 0, 64)
    results = {"PROBS__0": torch.tensor([[0.1, 0.4, 0.3, 0.2]]), "FLAT__1": torch.ones(1, 2, 2)}
    rest = classifier.apply(results, {"PROBS__0": internal.Classify("PROBS__0", 2), "FLAT__1": region})
    assert rest == {"FLAT__1": region}
    assert isinstance(results["PROBS__0"], Classified)
    assert list(results["PROBS__0"]) == [b"0.400000:1:b", b"0.300000:2:c"]
    assert results["FLAT__1"] is not None and isinstance(results["FLAT__1"], torch.Tensor)
    with pytest.raises(ExecutionError) as info:
        classifier.classify("TEXT__2", ["x"], 1)
    assert info.value.code == errors.INVALID_ARG and "unsupported type 'BYTES'" in info.value.message
    with pytest.raises(ExecutionError) as info:
        classifier.classify("MASK__3", torch.ones(1, 4, dtype=torch.bool), 1)
    assert "unsupported type 'BOOL'" in info.value.message


def test_the_run_message_carries_the_classification() -> None:
    raw = internal.encode(internal.Run(7, [], ["A", ["B", 3], ["C", ["key", 5], 0, 16]]))
    msg = internal.decode(raw)
    assert msg.outputs == ["A", internal.Classify("B", 3), internal.OutputTarget("C", ["key", 5], 0, 16)]
    with pytest.raises(internal.ProtocolViolation):
        internal.decode(internal.encode(internal.Run(7, [], [["B", 3, 4]])))


# ------------------------------------------------------------ the broker's checks

def _requested(outputs: list, cfg: ModelConfig | None = None) -> tuple[list, dict]:
    return _requested_outputs(outputs, cfg or config(), "m", None, None, [])


def test_the_broker_asks_the_worker_for_k_classes() -> None:
    assert _requested([{"name": "PROBS__0", "classification": 3}, "FLAT__1"]) == \
        ([["PROBS__0", 3], "FLAT__1"], {})
    # 0 and nil mean no classification, as Triton's class_count 0
    assert _requested([{"name": "PROBS__0", "classification": 0}]) == (["PROBS__0"], {})
    assert _requested([{"name": "PROBS__0", "classification": None}]) == (["PROBS__0"], {})
    assert tensors.classification_request("PROBS__0", 2) == {"name": "PROBS__0", "classification": 2}
    assert Classification("PROBS__0", 2).wire() == {"name": "PROBS__0", "classification": 2}
    with pytest.raises(ValueError):
        Classification("PROBS__0", 0)


@pytest.mark.parametrize("count", [-1, "x", 1.5, True, [2]])
def test_a_bad_k_is_refused_naming_model_and_output(count: object) -> None:
    with pytest.raises(TorchpoolError) as info:
        _requested([{"name": "PROBS__0", "classification": count}])
    assert info.value.code == errors.INVALID_ARG
    assert "output 'PROBS__0' for model 'm'" in info.value.message and "positive integer" in info.value.message
    with pytest.raises(ValueError):
        Classification("PROBS__0", count)      # the client refuses it before sending


@pytest.mark.parametrize("name,datatype", [("TEXT__2", "BYTES"), ("MASK__3", "BOOL"), ("HALF__4", "FP16")])
def test_outputs_that_are_not_numbers_cannot_be_classified(name: str, datatype: str) -> None:
    with pytest.raises(TorchpoolError) as info:
        _requested([{"name": name, "classification": 2}])
    assert info.value.code == errors.INVALID_ARG
    assert info.value.message == (f"output '{name}' for model 'm': class result not available for "
                                  f"output due to unsupported type '{datatype}'")


def test_classification_into_a_region_is_refused() -> None:
    with pytest.raises(TorchpoolError) as info:
        _requested([{"name": "PROBS__0", "classification": 2, "region": ["r", 64, 0]}])
    assert info.value.code == errors.INVALID_ARG and "'region'" in info.value.message


def _request(mv: ModelVersion, outputs: list, rows: int = 1) -> InferRequest:
    req = InferRequest(None, b"c", 1, mv, [], outputs, rows=rows)
    spec = mv.config.input("INPUT__0")
    batch_layout(req, [Staged(spec, [rows, 4], [rows, 4], memoryview(b""), None)], mv.config)
    return req


def test_a_request_with_a_classified_output_runs_alone() -> None:
    mv = ModelVersion("m", 1, config(), "/nowhere/1/model.pt")
    plain, other = _request(mv, ["PROBS__0"]), _request(mv, ["PROBS__0", "FLAT__1"])
    classified = _request(mv, [["PROBS__0", 3]])
    assert not plain.exclusive and not other.exclusive and plain.key == other.key
    assert classified.exclusive and classified.key != plain.key


def test_a_classified_answer_keeps_the_workers_shape() -> None:
    mv = ModelVersion("m", 1, config(), "/nowhere/1/model.pt")
    req = _request(mv, [["FLAT__1", 2], "PROBS__0"], rows=2)
    batch = Batch.single(req)
    descriptors = [OutputDescriptor("FLAT__1", "BYTES", [2, 2], "seg", 0, 40),
                   OutputDescriptor("PROBS__0", "FP32", [2, 4], "seg", 64, 32)]
    (mine,) = split_outputs(mv.config, batch, descriptors, lambda *a: memoryview(b""))
    # FLAT__1 has a reshape, which is not undone on its class strings
    assert mine == [("FLAT__1", "BYTES", [2, 2], "seg", 0, 40), ("PROBS__0", "FP32", [2, 4], "seg", 64, 32)]
    two = Batch([req, _request(mv, ["PROBS__0"])], 2, 3, [], [])
    with pytest.raises(TorchpoolError) as info:
        split_outputs(mv.config, two, [OutputDescriptor("FLAT__1", "BYTES", [6], "seg", 0, 40)],
                      lambda *a: memoryview(datatypes.encode_bytes([b"x"] * 6)))
    assert info.value.code == errors.INTERNAL
