"""End to end: model warm-up (Triton's model_warmup) and compiled execution
(TORCH_COMPILE) with its on-disk cache.

One repository, served twice with the same cache directory: the first daemon
compiles (cold cache), the second finds the compiled code in the cache. Its
models:

  compiled_ep   an ExportedProgram (x FP32 [4] -> x @ W.T + 1, batch 1..8),
                TORCH_COMPILE, and a model_warmup sample read from a file
  compiled_ts   the same model as TorchScript, TORCH_COMPILE (converted to an
                ExportedProgram, then compiled)
  warm_ts       the TorchScript model with a random_data sample run 3 times
  warm_fails    a TorchScript model that refuses zeros, with a zero_data sample
  plain         the TorchScript model, no warm-up: the client's own first call
                (its session, its shared memory) is paid there, not measured
"""
from __future__ import annotations

import re
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from torchpool.client import Client

from ..support.daemon import Daemon
from ..support.models.pt2_repository import Affine, affine_expected, affine_program, config, save_program, tensor, write

COMPILE = 'parameters { key: "TORCH_COMPILE" value: { string_value: "true" } }\n'
IO = ([tensor("x", [4])], [tensor("OUTPUT__0", [4])])


class RefusesZeros(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 0).all()):
            raise RuntimeError("an all-zero input is not valid for this model")
        return x * 2


def warmup(name: str, source: str, count: int = 1, batch_size: int = 2) -> str:
    return (f'model_warmup [ {{ name: "{name}" batch_size: {batch_size} count: {count} '
            f'inputs {{ key: "x" value: {{ data_type: TYPE_FP32 dims: [ 4 ] {source} }} }} }} ]\n')


def scripted(module: torch.nn.Module) -> bytes:
    import io

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buffer = io.BytesIO()
        torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("warmup_repository")
    program = save_program(affine_program(), tmp_path_factory.mktemp("programs") / "affine.pt2")
    write(root, "compiled_ep", config("compiled_ep", *IO, 8, 'default_model_filename: "model.pt2"\n'
                                      + COMPILE + warmup("from_file", 'input_data_file: "x.bin"', count=2)),
          program)
    (root / "compiled_ep" / "warmup").mkdir()
    (root / "compiled_ep" / "warmup" / "x.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    write(root, "compiled_ts", config("compiled_ts", *IO, 8, COMPILE), scripted(Affine()), "model.pt")
    write(root, "warm_ts", config("warm_ts", *IO, 8, warmup("random", "random_data: true", count=3)),
          scripted(Affine()), "model.pt")
    write(root, "plain", config("plain", *IO, 8), scripted(Affine()), "model.pt")
    write(root, "warm_fails", config("warm_fails", *IO, 8, warmup("zeros", "zero_data: true")),
          scripted(RefusesZeros()), "model.pt")
    return root


def serve(repository: Path, workdir: Path, cache: Path) -> tuple[Daemon, float]:
    """A daemon on `repository` and the seconds until it is ready (every model loaded)."""
    daemon = Daemon(repository, workdir, "--cache-dir", str(cache))
    started = time.monotonic()
    daemon.start(timeout=300)
    return daemon, time.monotonic() - started


def compiled(log: str, model: str) -> tuple[float, int, int]:
    """(seconds, graphs, graphs from the cache) of the model's compile at load."""
    found = re.search(rf"model '{model}' instance '\w+': compiled \(default\) in ([\d.]+) s, "
                      rf"(\d+) graphs, (\d+) from the compile cache", log)
    assert found, f"no compile line for {model}:\n{log}"
    return float(found.group(1)), int(found.group(2)), int(found.group(3))


def latencies(client: Client, model: str, count: int) -> list[float]:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    expected = affine_expected(torch.from_numpy(x)).numpy()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        # with a timeout: through the daemon, never on a direct path, whose
        # opening on a model's first call is no part of its warm-up
        out = client.infer(model, {"x": x}, timeout=120)["OUTPUT__0"]
        times.append(time.perf_counter() - started)
        np.testing.assert_allclose(out, expected, rtol=1e-5)
    return times


def test_warmup_and_compilation_happen_before_ready_and_the_cache_serves_a_restart(
        repository: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.mktemp("compile_cache")
    first, first_ready = serve(repository, tmp_path_factory.mktemp("first"), cache)
    try:
        with Client(first.url, timeout=120) as client:
            latencies(client, "plain", 1)
            index = {r["name"]: r for r in client.repository_index()}
            for model in ("compiled_ep", "compiled_ts", "warm_ts"):
                assert index[model]["state"] == "READY", index[model]
                times = latencies(client, model, 21)
                median = statistics.median(times[1:])
                print(f"{model}: first request {times[0] * 1e3:.2f} ms, median of the next 20 "
                      f"{median * 1e3:.2f} ms")
                # Not 1x: the first request to any model also hands the client's
                # shared memory to that worker (fd passing, first-touch page
                # faults), 1-3 ms here, which no warm-up can do ahead. Without
                # warm-up a compiled model's first request would take seconds; a
                # loaded machine's hiccup may take tens of ms (0.25 s allowed).
                assert times[0] <= max(10 * median, 0.25), (model, times)
            row = index["warm_fails"]
        log = first.log()
    finally:
        assert first.stop() == 0, first.log()
    assert row["state"] == "UNAVAILABLE"
    assert "warm-up sample 'zeros' failed" in row["reason"], row["reason"]
    assert "an all-zero input is not valid for this model" in row["reason"], row["reason"]
    assert "model 'compiled_ep' instance 'compiled_ep_0': 2 warm-up batches" in log
    assert "model 'warm_ts' instance 'warm_ts_0': 3 warm-up batches" in log
    cold = compiled(log, "compiled_ep"), compiled(log, "compiled_ts")
    # (the two models hold the same graph: one may find the other's in the cache already)
    assert all(graphs >= 2 for _, graphs, _ in cold) and sum(c for *_, c in cold) < 4, cold
    assert any((cache / "inductor").rglob("*")), "nothing was cached"

    second, second_ready = serve(repository, tmp_path_factory.mktemp("second"), cache)
    try:
        with Client(second.url, timeout=120) as client:
            latencies(client, "compiled_ep", 2)
            latencies(client, "compiled_ts", 2)
        log = second.log()
    finally:
        assert second.stop() == 0, second.log()
    warm = compiled(log, "compiled_ep"), compiled(log, "compiled_ts")
    print(f"time to READY: first daemon {first_ready:.1f} s (compiling compiled_ep {cold[0][0]:.1f} s, "
          f"compiled_ts {cold[1][0]:.1f} s), restarted with the cache {second_ready:.1f} s "
          f"({warm[0][0]:.1f} s, {warm[1][0]:.1f} s)")
    # every graph comes from the cache: nothing is compiled again
    assert all(cached == graphs >= 2 for _, graphs, cached in warm), warm
