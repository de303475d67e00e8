"""End to end: PyTorch 2 models — torch.export programs and AOTInductor packages.

The models are exported (and one compiled by AOTInductor) at set-up, once per
session (tests/support/models/pt2_repository.py), and served by a real daemon: dynamic
batching, tuple and dict outputs, a dict input, static shapes, a sequence with
implicit state, weight sharing, dimension ranges checked with Triton-style
errors, configs that contradict the program and broken packages refused at
load with their reason, a killed worker replaced, statistics.
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from torchpool.client import Client
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon, descendants, wait_for, worker_pids
from ..support.models.pt2_repository import affine_expected, build_once

LOAD_ERRORS = {
    "pt2_bad_batch": ["input 'a'", "max_batch_size is 16", "at most 8"],
    "pt2_bad_dims": ["input 'a'", "dimension 1 is 5", "takes exactly 4"],
    "pt2_truncated": ["'model.pt2' is not a PyTorch model archive"],
    "pt2_aoti_cuda": ["compiled for device 'cuda'", "runs on 'cpu'"],
    "pt2_aoti_damaged": ["AOTInductor package 'model.pt2' cannot be loaded", "damaged"],
}


@pytest.fixture(scope="module")
def pt2_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_once(tmp_path_factory.getbasetemp() / "pt2_repository")


@pytest.fixture(scope="module")
def pt2_daemon(pt2_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("pt2_daemon")
    (workdir / "tmp").mkdir()     # the daemon's TMPDIR: what it leaves there is seen
    d = Daemon(pt2_repository, workdir, "--log-level", "debug",
               env={"TORCHPOOL_CACHE_DIR": str(workdir / "cache"), "TMPDIR": str(workdir / "tmp")})
    try:
        d.start(timeout=180)
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def client(pt2_daemon: Daemon):
    with Client(pt2_daemon.url, timeout=60) as c:
        yield c


def rows(n: int, width: int = 4, start: float = 0.0) -> np.ndarray:
    return (np.arange(n * width, dtype=np.float32).reshape(n, width) + start) / 4


def error_of(client: Client, model: str, inputs: dict, **kwargs) -> InferenceError:
    with pytest.raises(InferenceError) as info:
        client.infer(model, inputs, **kwargs)
    return info.value


def test_exported_program_binds_by_argument_name_and_returns_a_tuple(client: Client) -> None:
    a, b = rows(3), rows(3, start=5)
    out = client.infer("pt2_addsub", {"b": b, "a": a})
    np.testing.assert_allclose(out["OUTPUT__0"], a + b)
    np.testing.assert_allclose(out["OUTPUT__1"], a - b)
    assert out["OUTPUT__0"].shape == (3, 4)


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(client: Client) -> None:
    before = client.statistics("pt2_addsub")["model_stats"][0]

    def one(i: int) -> None:
        a, b = rows(1 + i % 3, start=i), rows(1 + i % 3, start=100 + i)
        out = client.infer("pt2_addsub", {"a": a, "b": b})
        np.testing.assert_allclose(out["OUTPUT__0"], a + b)
        np.testing.assert_allclose(out["OUTPUT__1"], a - b)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(64)))
    after = client.statistics("pt2_addsub")["model_stats"][0]
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == sum(1 + i % 3 for i in range(64))
    assert executions < 64, f"{executions} executions for 64 concurrent requests: nothing was batched"


def test_static_program_found_as_model_pt2_without_a_config_line(client: Client, pt2_repository: Path) -> None:
    assert not (pt2_repository / "pt2_static" / "1" / "model.pt").exists()
    x = rows(3)
    np.testing.assert_allclose(client.infer("pt2_static", {"INPUT__0": x})["OUTPUT__0"], 3 * x)
    err = error_of(client, "pt2_static", {"INPUT__0": rows(2)})
    assert err.code == "INVALID_ARG" and "Expected [3,4], got [2,4]" in err.message


def test_dict_outputs_bind_by_key_and_a_subset_can_be_asked(client: Client) -> None:
    x = np.array([[1, 5, 2], [-3, -1, -2]], np.float32)
    out = client.infer("pt2_stats", {"x": x})
    np.testing.assert_allclose(out["sum"], [[8], [-6]])
    np.testing.assert_allclose(out["max"], [[5], [-1]])
    only = client.infer("pt2_stats", {"x": x}, outputs=["max"])
    assert list(only) == ["max"]


def test_a_dict_argument_takes_the_inputs_by_key(client: Client) -> None:
    x, y = rows(2), rows(2, start=9)
    np.testing.assert_allclose(client.infer("pt2_dict_input", {"y": y, "x": x})["OUTPUT__0"], 2 * x + y)


def test_a_dimension_beyond_the_programs_range_is_the_requests_error(client: Client) -> None:
    np.testing.assert_allclose(client.infer("pt2_stats", {"x": np.ones((1, 16), np.float32)})["sum"], [[16]])
    err = error_of(client, "pt2_stats", {"x": np.ones((1, 17), np.float32)})
    assert err.code == "INVALID_ARG"
    assert err.message == ("unexpected shape for input 'x' for model 'pt2_stats': dimension 1 is 17, "
                           "but the exported program accepts at most 16 (got shape [1,17])")
    # the batch's failure is that request's alone: the model goes on serving
    np.testing.assert_allclose(client.infer("pt2_stats", {"x": np.ones((2, 3), np.float32)})["sum"],
                               [[3], [3]])


def test_configs_that_contradict_the_program_and_broken_files_fail_to_load(client: Client) -> None:
    index = {row["name"]: row for row in client.repository_index()}
    for name, words in LOAD_ERRORS.items():
        row = index[name]
        assert row["state"] == "UNAVAILABLE", row
        for word in words:
            assert word in row["reason"], (name, row["reason"])
        assert not client.model_ready(name)
    for name in ("pt2_addsub", "pt2_static", "pt2_stats", "pt2_dict_input", "pt2_sequence",
                 "pt2_shared", "pt2_aoti"):
        assert index[name]["state"] == "READY", index[name]


def test_an_aotinductor_package_serves_batches(client: Client) -> None:
    for n in (1, 8):
        a, b = rows(n), rows(n, start=3)
        out = client.infer("pt2_aoti", {"INPUT__0": a, "INPUT__1": b})
        np.testing.assert_allclose(out["OUTPUT__0"], a + b)
        np.testing.assert_allclose(out["OUTPUT__1"], a - b)
    err = error_of(client, "pt2_aoti", {"INPUT__0": rows(9), "INPUT__1": rows(9)})
    assert err.code == "INVALID_ARG" and "batch-size must be <= 8" in err.message
    stats = client.statistics("pt2_aoti")["model_stats"][0]
    assert stats["inference_count"] >= 9 and stats["inference_stats"]["compute_infer"]["count"] >= 2


def test_a_loaded_aotinductor_package_leaves_no_extracted_copy(pt2_daemon: Daemon, client: Client) -> None:
    # torch's loader extracts each package under TMPDIR and never removes it
    # (6.6 MB per load); the worker removes it once the library is loaded
    assert client.model_ready("pt2_aoti")
    tmp = pt2_daemon.socket_path.parent / "tmp"
    assert sorted(p.name for p in tmp.iterdir() if "aoti" in p.name) == []


def test_a_sequence_keeps_its_state_in_an_exported_program(client: Client) -> None:
    def send(seq: int, value: int, start: bool = False) -> int:
        out = client.infer("pt2_sequence", {"INPUT__0": np.array([[value]], np.int32)},
                           sequence_id=seq, sequence_start=start)
        return int(out["OUTPUT__0"].reshape(-1)[0])

    assert send(11, 1, start=True) == 1
    assert send(22, 10, start=True) == 10
    assert send(11, 2) == 3
    assert send(22, 20) == 30
    assert send(11, 3) == 6


def test_weight_sharing_maps_one_copy_of_the_programs_weights(client: Client, pt2_daemon: Daemon) -> None:
    x = rows(4)
    for _ in range(4):          # both instances serve
        np.testing.assert_allclose(client.infer("pt2_shared", {"x": x})["OUTPUT__0"],
                                   affine_expected(torch.from_numpy(x)).numpy(), rtol=1e-6)
    segments = [p.name for p in Path("/dev/shm").iterdir() if ".sw" in p.name
                and f".{pt2_daemon.pid()}." in p.name]
    assert len(segments) == 1, segments
    workers = worker_pids(pt2_daemon.log(), "pt2_shared")
    assert len(workers) == 2

    def mapped_by() -> list[int]:
        found = []
        for pid in workers:
            try:
                if segments[0] in Path(f"/proc/{pid}/maps").read_text():
                    found.append(pid)
            except OSError:
                pass
        return found
    assert wait_for(lambda: len(mapped_by()) == 2, 30, "both workers mapping the shared weights")


def test_a_killed_worker_is_replaced_and_only_its_model_notices(client: Client, pt2_daemon: Daemon) -> None:
    [worker] = worker_pids(pt2_daemon.log(), "pt2_aoti")[-1:]
    assert worker in descendants(pt2_daemon.pid())
    os.kill(worker, signal.SIGKILL)
    np.testing.assert_allclose(client.infer("pt2_static", {"INPUT__0": rows(3)})["OUTPUT__0"], 3 * rows(3))

    def serves_again() -> bool:
        try:
            out = client.infer("pt2_aoti", {"INPUT__0": rows(2), "INPUT__1": rows(2)})
        except InferenceError:
            return False
        return bool(np.allclose(out["OUTPUT__0"], 2 * rows(2)))
    wait_for(serves_again, 60, "the AOTInductor model to serve again after its worker was killed",
             interval=0.2)
    assert len(worker_pids(pt2_daemon.log(), "pt2_aoti")) >= 2
