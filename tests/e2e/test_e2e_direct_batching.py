"""Dynamic batching of direct requests (worker/direct_batch.py) against a
real daemon: local sync clients of a model with dynamic batching send their
requests to its worker, which batches them by Triton's rules (a preferred
size sends a batch at once, else the queue delay), splits the outputs back
per request, counts each batch once, and serves on when a client of a batch
vanishes. A model whose queue the daemon must order keeps the broker.
"""
from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from torchpool import Client
from torchpool.protocol import errors
from torchpool.protocol.errors import InferenceError

from ..support.daemon import Daemon, cpu_ticks, daemon_segments
from ..support.models.core import config as model_config
from ..support.models.core import serialize, tensor
from ..support.models.execution_errors import RaiseOnNegative
from .test_e2e_direct import RawPath, flood, stats, transfer, worker_pid
from .test_e2e_lane import RawLane

class FirstRow(torch.nn.Module):
    """Loses the batch dimension: one row, whatever the batch."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:1]


WAIT_S = 0.3                 # mlp_delay's max_queue_delay_microseconds

VARIANTS = {
    # a batch goes at 4 items; until then it would wait 30 s
    "mlp_four": "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 30000000 }",
    "mlp_delay": f"dynamic_batching {{ max_queue_delay_microseconds: {int(WAIT_S * 1e6)} }}",
    "mlp_priority": "dynamic_batching { priority_levels: 2 default_priority_level: 1 }",
}


@pytest.fixture(scope="module")
def batching_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("direct_batching_repo")
    for name, batching in VARIANTS.items():
        shutil.copytree(small_repository / "mlp", root / name)
        config = (root / name / "config.pbtxt").read_text()
        assert "dynamic_batching { }" in config
        (root / name / "config.pbtxt").write_text(
            config.replace('name: "mlp"', f'name: "{name}"').replace("dynamic_batching { }", batching))
    pair = "dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 30000000 }\n"
    for name, module in (("first_row_pair", FirstRow()), ("raise_pair", RaiseOnNegative())):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.pt").write_bytes(serialize(module))
        (root / name / "config.pbtxt").write_text(model_config(
            name, inputs=[tensor("INPUT__0", "FP32", [4])], outputs=[tensor("OUTPUT__0", "FP32", [4])],
            max_batch_size=8, extra=pair))
    d = Daemon(root, tmp_path_factory.mktemp("direct_batching"), "--log-level", "debug").start()
    yield d
    assert d.stop() == 0, d.log()
    # a traceback only where raise_pair raised (its failure is logged with the model's trace)
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", d.log())
    assert not [r for r in records if "Traceback" in r and "'raise_pair_0' direct batch" not in r], d.log()
    assert not daemon_segments(d.urls), "the daemon left shared memory behind"


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 256), dtype=np.float32)


def alone(c: Client, x: np.ndarray) -> np.ndarray:
    """The MLP's answer to each row asked alone (a batch of one each)."""
    return np.concatenate([c.infer("mlp_delay", {"INPUT__0": x[i:i + 1]})["OUTPUT__0"] for i in range(len(x))])


def concurrently(url: str, model: str, inputs: list[np.ndarray]) -> list:
    """Each input sent at once by a client of its own; their answers (or errors)."""
    results: list = [None] * len(inputs)

    def call(i: int) -> None:
        with Client(url, timeout=60) as c:
            try:
                results[i] = c.infer(model, {"INPUT__0": inputs[i]})["OUTPUT__0"]
            except InferenceError as exc:
                results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert all(r is not None for r in results), results
    return results


def test_requests_of_several_clients_run_as_one_batch_split_back(batching_daemon: Daemon) -> None:
    url = batching_daemon.url
    x = [rows(1, 1), rows(3, 2)]            # 4 items: mlp_four's preferred size sends the batch
    with Client(url, timeout=60) as c:
        before, counted = transfer(c), stats(c, "mlp_four")
        started = time.monotonic()
        got = concurrently(url, "mlp_four", x)
        assert time.monotonic() - started < 20, "the preferred size did not send the batch"
        for inputs, out in zip(x, got):      # each client its own rows, as if run alone
            assert out.shape == (len(inputs), 10)
            np.testing.assert_allclose(out, alone(c, inputs), rtol=1e-4, atol=1e-5)
        s = stats(c, "mlp_four")
        assert s["execution_count"] == counted["execution_count"] + 1
        assert s["inference_count"] == counted["inference_count"] + 4
        assert {b["batch_size"]: b["compute_infer"]["count"] for b in s["batch_stats"]}[4] == 1
        assert s["inference_stats"]["success"]["count"] == counted["inference_stats"]["success"]["count"] + 2
        # both went to the worker, and each asked for its path on the lane
        after = transfer(c)
        assert after["requests_direct"] - before.get("requests_direct", 0) >= 2


def test_requests_of_threads_sharing_one_client_are_batched(batching_daemon: Daemon) -> None:
    x = [rows(1, 10 + i) for i in range(4)]
    with Client(batching_daemon.url, timeout=60) as c:
        c.infer("mlp_four", {"INPUT__0": rows(4, 9)})      # the path is open (4 items: no wait)
        before, counted = transfer(c), stats(c, "mlp_four")
        results: list = [None] * 4

        def call(i: int) -> None:
            results[i] = c.infer("mlp_four", {"INPUT__0": x[i]})["OUTPUT__0"]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        s = stats(c, "mlp_four")
        assert s["execution_count"] == counted["execution_count"] + 1      # one batch of the four
        assert transfer(c)["requests_direct"] - before["requests_direct"] == 4
        for inputs, out in zip(x, results):
            np.testing.assert_allclose(out, alone(c, inputs), rtol=1e-4, atol=1e-5)


def test_a_lone_request_waits_the_queue_delay_then_runs(batching_daemon: Daemon) -> None:
    with Client(batching_daemon.url, timeout=60) as c:
        x = rows(2, 3)
        c.infer("mlp_delay", {"INPUT__0": x})              # the path is open
        counted = stats(c, "mlp_delay")
        started = time.monotonic()
        out = c.infer("mlp_delay", {"INPUT__0": x})["OUTPUT__0"]
        assert time.monotonic() - started >= WAIT_S * 0.9
        s = stats(c, "mlp_delay")
        np.testing.assert_allclose(out, alone(c, x), rtol=1e-4, atol=1e-5)
        queued = s["inference_stats"]["queue"]
        before = counted["inference_stats"]["queue"]
        assert queued["count"] == before["count"] + 1
        assert queued["ns"] - before["ns"] >= WAIT_S * 0.9e9     # its wait is its queue time


def test_a_model_whose_queue_the_daemon_orders_keeps_the_broker(batching_daemon: Daemon) -> None:
    raw = RawLane(batching_daemon.url)
    try:
        raw.send({"v": 1, "op": "direct", "id": 5, "model": "mlp_priority", "version": "", "session": raw.token})
        answer = raw.answer()
        assert not answer["ok"] and answer["error"]["code"] == errors.UNSUPPORTED, answer
        assert answer["error"]["message"] == ("model 'mlp_priority' version 1 takes no direct requests: the "
                                              "daemon orders its queue (priority levels, queue timeouts or "
                                              "sizes)")
    finally:
        raw.close()
    with Client(batching_daemon.url, timeout=60) as c:       # and its requests are served
        before = transfer(c)
        out = c.infer("mlp_priority", {"INPUT__0": rows(1, 4)}, priority=2)["OUTPUT__0"]
        np.testing.assert_allclose(out, alone(c, rows(1, 4)), rtol=1e-4, atol=1e-5)
        # only alone()'s one request went to a worker
        assert transfer(c).get("requests_direct", 0) - before.get("requests_direct", 0) == 1


def test_a_client_that_vanishes_while_its_request_waits_does_not_stop_the_batch(batching_daemon: Daemon) -> None:
    url = batching_daemon.url
    with Client(url, timeout=60) as c:
        x = rows(1, 5)
        c.infer("mlp_delay", {"INPUT__0": x})              # the path is open
        gone = RawPath(url, "mlp_delay")
        gone.request({"v": 1, "op": "infer", "id": 9, "model": "mlp_delay", "version": "",
                      "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 256],
                                  "data": rows(1, 6).tobytes()}]})
        gone.close()                                       # it waits for its batch, then no one is there
        out = c.infer("mlp_delay", {"INPUT__0": x})["OUTPUT__0"]
        np.testing.assert_allclose(out, alone(c, x), rtol=1e-4, atol=1e-5)
        assert c.server_live()


def test_a_bad_request_in_a_batching_turn_is_refused_alone(batching_daemon: Daemon) -> None:
    path = RawPath(batching_daemon.url, "mlp_delay")
    try:
        path.request({"v": 1, "op": "infer", "id": 3, "model": "mlp_delay", "version": "",
                      "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 255],
                                  "data": bytes(255 * 4)}]})
        answer = path.path_answer()
        assert answer["id"] == 3 and not answer["ok"] and answer["error"]["code"] == errors.INVALID_ARG
        assert "mlp_delay" in answer["error"]["message"] and "INPUT__0" in answer["error"]["message"]
        x = rows(2, 7)
        path.request({"v": 1, "op": "infer", "id": 4, "model": "mlp_delay", "version": "",
                      "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [2, 256],
                                  "data": x.tobytes()}]})
        answer = path.path_answer()
        assert answer["id"] == 4 and answer["ok"], answer
        out = answer["outputs"][0]
        assert out["shape"] == [2, 10]
        with Client(batching_daemon.url, timeout=60) as c:
            np.testing.assert_allclose(np.frombuffer(out["data"], np.float32).reshape(2, 10), alone(c, x),
                                       rtol=1e-4, atol=1e-5)
    finally:
        path.close()


def test_a_batch_whose_output_lost_the_batch_dimension_fails_clearly(batching_daemon: Daemon) -> None:
    ones = np.ones((1, 4), np.float32)
    got = concurrently(batching_daemon.url, "first_row_pair", [ones, ones])
    for err in got:
        assert isinstance(err, InferenceError) and err.code == errors.INTERNAL, got
        assert ("output 'OUTPUT__0' of model 'first_row_pair' has 1 rows for a batch of 2 rows from 2 "
                "requests: a batched output must keep the batch dimension first") in str(err)
    with Client(batching_daemon.url, timeout=60) as c:                  # the worker serves on
        s = c.statistics("first_row_pair")["model_stats"][0]
        assert s["inference_stats"]["fail"]["count"] == 2
        out = c.infer("mlp_delay", {"INPUT__0": rows(1, 8)})["OUTPUT__0"]
        assert out.shape == (1, 10)


def test_a_request_that_makes_the_model_raise_fails_its_batch_only(batching_daemon: Daemon) -> None:
    url = batching_daemon.url
    good, bad = np.ones((1, 4), np.float32), -3 * np.ones((1, 4), np.float32)   # their batch sums < 0
    got = concurrently(url, "raise_pair", [good, bad])
    for err in got:                     # one batch: both fail, as in any batch (Triton's too)
        assert isinstance(err, InferenceError) and err.code == errors.INTERNAL, got
        assert "raise_pair" in str(err) and "boom: input sum is negative" in str(err)
    got = concurrently(url, "raise_pair", [good, 2 * good])           # the next batch runs
    np.testing.assert_array_equal(got[0], good)
    np.testing.assert_array_equal(got[1], 2 * good)


def test_a_client_that_floods_a_batching_path_and_never_reads_harms_no_one(batching_daemon: Daemon) -> None:
    url = batching_daemon.url
    flooder = RawPath(url, "mlp_four")
    try:
        sent = flood(flooder.path, {"v": 1, "op": "infer", "id": 1, "model": "mlp_four", "version": "",
                                    "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 256],
                                                "data": rows(1, 11).tobytes()}]})
        assert sent > 4                             # more than one batch was read from it
        x = rows(4, 12)                             # others are served meanwhile (4 items: no wait)
        with Client(url, timeout=60) as c:
            np.testing.assert_allclose(c.infer("mlp_four", {"INPUT__0": x})["OUTPUT__0"], alone(c, x),
                                       rtol=1e-4, atol=1e-5)
        pid = worker_pid(batching_daemon, "mlp_four")
        ticks = cpu_ticks(pid)
        time.sleep(1.0)                             # a measuring window, not a synchronisation
        assert cpu_ticks(pid) - ticks < 20, "the worker spun on a client that does not read"
    finally:
        flooder.close()
