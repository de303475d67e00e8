"""Triton's classification extension end to end: a daemon on a repository of
its own, the Python client's `Classification`, raw `classification` fields.

  classify_batched   mbs 8, dynamic_batching (200 ms). INPUT__0 FP32 [6] ->
                     PROBS__0 = x (FP32, label_filename labels.txt: cat,
                     dog, an empty line, bird: indices 2, 4 and 5 have no
                     label), COUNT__1 = int(x * 10) (INT32, no labels),
                     TEXT__2 one string per item (STRING), ROWS__3 the
                     rows of the execution (INT64 [1]).
  classify_nobatch   mbs 0. INPUT__0 FP32 [2, 3] -> PROBS__0 = x (FP32,
                     label_filename classes.txt: a..f), MASK__1 = x > 0.5 (BOOL).
  classify_nolabels  label_filename names a file that is not there: the
                     model fails to load.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from torchpool import AsyncClient, Classification, Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon
from ..support.models.core import config, dynamic_batching, serialize, tensor


class Batched(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, List[str], Tensor]:
        rows = torch.full([x.size(0), 1], x.size(0), dtype=torch.int64)
        return x, (x * 10).to(torch.int32), ["item" + str(i) for i in range(x.size(0))], rows


class Plain(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, x > 0.5


class Identity(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x


def _model(root: Path, name: str, text: str, module: nn.Module, files: dict[str, str]) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(text)
    (root / name / "1" / "model.pt").write_bytes(serialize(module))
    for filename, content in files.items():
        (root / name / filename).write_text(content)


def build_repository(root: Path) -> None:
    _model(root, "classify_batched", config(
        "classify_batched", max_batch_size=8,
        inputs=[tensor("INPUT__0", "FP32", [6])],
        outputs=[tensor("PROBS__0", "FP32", [6], extra='label_filename: "labels.txt"'),
                 tensor("COUNT__1", "INT32", [6]),
                 tensor("TEXT__2", "STRING", [1], reshape=[]),
                 tensor("ROWS__3", "INT64", [1])],
        extra=dynamic_batching(200_000)), Batched(), {"labels.txt": "cat\ndog\n\nbird\n"})
    _model(root, "classify_nobatch", config(
        "classify_nobatch", max_batch_size=0,
        inputs=[tensor("INPUT__0", "FP32", [2, 3])],
        outputs=[tensor("PROBS__0", "FP32", [2, 3], extra='label_filename: "classes.txt"'),
                 tensor("MASK__1", "BOOL", [2, 3])]), Plain(), {"classes.txt": "a\nb\nc\nd\ne\nf"})
    _model(root, "classify_nolabels", config(
        "classify_nolabels", max_batch_size=0,
        inputs=[tensor("INPUT__0", "FP32", [3])],
        outputs=[tensor("OUTPUT__0", "FP32", [3], extra='label_filename: "missing.txt"')]), Identity(), {})


@pytest.fixture(scope="module")
def cdaemon(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("classification_repository")
    build_repository(root)
    d = Daemon(root, tmp_path_factory.mktemp("classification_daemon")).start()
    yield d
    assert d.stop() == 0, d.log()


X = np.array([[0.5, 0.25, 0.75, 0.125, 0.0625, 0.375],
              [0.2, 0.9, 0.4, 0.9, 0.1, 0.3]], np.float32)


@pytest.mark.parametrize("local", [True, False])
def test_top3_of_a_batching_model_per_item(cdaemon: Daemon, local: bool) -> None:
    with Client(cdaemon.url, timeout=30, local=local) as c:
        out = c.infer("classify_batched", {"INPUT__0": X},
                      outputs=[Classification("PROBS__0", 3), Classification("COUNT__1", 2)], copy=True)
    assert sorted(out) == ["COUNT__1", "PROBS__0"]
    probs = out["PROBS__0"]
    assert probs.dtype == object and probs.shape == (2, 3)
    # labels: 0 cat, 1 dog, 2 (empty line: none), 3 bird; 4 and 5 are past the file's end
    assert probs.tolist() == [[b"0.750000:2", b"0.500000:0:cat", b"0.375000:5"],
                              [b"0.900000:1:dog", b"0.900000:3:bird", b"0.400000:2"]]
    # integer scores without decimals; ties in index order
    assert out["COUNT__1"].tolist() == [[b"7:2", b"5:0"], [b"9:1", b"9:3"]]


def test_top3_of_a_model_without_batching_over_the_whole_tensor(cdaemon: Daemon) -> None:
    x = np.array([[0.1, 0.6, 0.3], [0.8, 0.2, 0.7]], np.float32)
    with Client(cdaemon.url, timeout=30) as c:
        out = c.infer("classify_nobatch", {"INPUT__0": x}, outputs=[Classification("PROBS__0", 3), "MASK__1"])
        assert out["PROBS__0"].shape == (3,)
        assert out["PROBS__0"].tolist() == [b"0.800000:3:d", b"0.700000:5:f", b"0.600000:1:b"]
        np.testing.assert_array_equal(out["MASK__1"], x > 0.5)
        # more classes than elements: all of them
        every = c.infer("classify_nobatch", {"INPUT__0": x}, outputs=[Classification("PROBS__0", 100)])
        assert every["PROBS__0"].shape == (6,)
        assert every["PROBS__0"][-1] == b"0.100000:0:a"


def test_k_beyond_the_elements_of_an_item(cdaemon: Daemon) -> None:
    with Client(cdaemon.url, timeout=30) as c:
        out = c.infer("classify_batched", {"INPUT__0": X[:1]}, outputs=[Classification("PROBS__0", 7)])
    assert out["PROBS__0"].shape == (1, 6)
    assert out["PROBS__0"][0, -1] == b"0.062500:4"


def test_zero_classes_is_the_tensor_itself(cdaemon: Daemon) -> None:
    with Client(cdaemon.url, timeout=30) as c:
        out = c.infer("classify_batched", {"INPUT__0": X}, outputs=[{"name": "PROBS__0", "classification": 0}])
    np.testing.assert_array_equal(out["PROBS__0"], X)


@pytest.mark.parametrize("count", [-1, "x", 2.5, True])
def test_a_bad_k_is_invalid_arg_naming_model_and_output(cdaemon: Daemon, count: object) -> None:
    with Client(cdaemon.url, timeout=30) as c:
        with pytest.raises(InferenceError) as info:
            c.infer("classify_batched", {"INPUT__0": X}, outputs=[{"name": "PROBS__0", "classification": count}])
    assert info.value.code == errors.INVALID_ARG
    assert "output 'PROBS__0' for model 'classify_batched'" in info.value.message
    assert "'classification' must be a positive integer" in info.value.message


@pytest.mark.parametrize("model,output,datatype", [("classify_batched", "TEXT__2", "BYTES"),
                                                   ("classify_nobatch", "MASK__1", "BOOL")])
def test_an_output_that_is_not_numbers_cannot_be_classified(cdaemon: Daemon, model: str, output: str,
                                                            datatype: str) -> None:
    x = X if model == "classify_batched" else X[:, :3]
    with Client(cdaemon.url, timeout=30) as c:
        with pytest.raises(InferenceError) as info:
            c.infer(model, {"INPUT__0": x}, outputs=[Classification(output, 2)])
    assert info.value.code == errors.INVALID_ARG
    assert info.value.message == (f"output '{output}' for model '{model}': class result not available "
                                  f"for output due to unsupported type '{datatype}'")


def test_classification_into_a_region_is_refused(cdaemon: Daemon) -> None:
    with Client(cdaemon.url, timeout=30) as c:
        with pytest.raises(InferenceError) as info:
            c.infer("classify_batched", {"INPUT__0": X},
                    outputs=[{"name": "PROBS__0", "classification": 2, "region": ["r", 64, 0]}])
    assert info.value.code == errors.INVALID_ARG
    assert "output 'PROBS__0' for model 'classify_batched'" in info.value.message
    assert "'region'" in info.value.message


def test_dynamic_batching_with_mixed_requests(cdaemon: Daemon) -> None:
    """Requests with and without classification, in flight together: each
    gets what it asked for. The plain ones share a batch; a classified one
    runs in a batch of its own."""
    rows = [X[:1], X, X[1:], X[1:] * 2]
    asks = [None, ["COUNT__1", "ROWS__3"], [Classification("PROBS__0", 2), "ROWS__3"],
            [Classification("PROBS__0", 1), "TEXT__2", "ROWS__3"]]

    async def run() -> list:
        async with AsyncClient(cdaemon.url, timeout=60) as c:
            return await asyncio.gather(*(c.infer("classify_batched", {"INPUT__0": x}, outputs=o, copy=True)
                                          for x, o in zip(rows, asks)))

    before = _stats(cdaemon)
    plain, counts, classified, mixed = asyncio.run(run())
    np.testing.assert_array_equal(plain["PROBS__0"], X[:1])
    np.testing.assert_array_equal(plain["COUNT__1"], (X[:1] * 10).astype(np.int32))
    assert plain["TEXT__2"].tolist() == [[b"item0"]]
    assert classified["PROBS__0"].tolist() == [[b"0.900000:1:dog", b"0.900000:3:bird"]]
    assert sorted(counts) == ["COUNT__1", "ROWS__3"]
    np.testing.assert_array_equal(counts["COUNT__1"], (X * 10).astype(np.int32))
    assert mixed["PROBS__0"].tolist() == [[b"1.800000:1:dog"]]
    assert mixed["TEXT__2"].tolist() == [[b"item0"]]
    after = _stats(cdaemon)
    assert after["inference_count"] - before["inference_count"] == 5
    # sent in this order within the queue delay: the two plain requests ran
    # together, each classified one alone
    assert plain["ROWS__3"].tolist() == [[3]] and counts["ROWS__3"].tolist() == [[3], [3]]
    assert classified["ROWS__3"].tolist() == [[1]] and mixed["ROWS__3"].tolist() == [[1]]
    assert after["execution_count"] - before["execution_count"] == 3


def _stats(d: Daemon) -> dict:
    with Client(d.url, timeout=30, local=False) as c:
        return c.statistics("classify_batched")["model_stats"][0]


def test_a_missing_label_file_fails_the_load_naming_it(cdaemon: Daemon) -> None:
    with Client(cdaemon.url, timeout=30) as c:
        assert not c.model_ready("classify_nolabels")
        row = next(r for r in c.repository_index() if r["name"] == "classify_nolabels")
    assert row["state"] == "UNAVAILABLE"
    assert "classify_nolabels/missing.txt" in row["reason"] and "'OUTPUT__0'" in row["reason"]
    assert str(cdaemon.log_path.parent.parent) not in row["reason"]       # no server path
