"""Benchmark section for PyTorch 2 models (imported by bench.py, which runs it
last; alone with `scripts/bench --only pt2` or `python scripts/bench_pt2.py`).

The example MLP (256-1024-1024-10, FP32, the same weights) served in five
forms by one daemon, one KIND_CPU instance each, one intra-op thread each
(INTRA_OP_THREAD_COUNT 1):

  mlp                  TorchScript (torch.jit.script)
  mlp_exported         torch.export program (batch Dim 1..32)
  mlp_aoti             that program compiled by AOTInductor
  mlp_compiled         the TorchScript model with TORCH_COMPILE (converted, compiled at load)
  mlp_exported_compiled  the exported program with TORCH_COMPILE

For each, at batch 1 and 32 (one request of that batch at a time): the
in-worker compute time per batch (the daemon's statistics: compute_infer of
that batch size, over the measured requests only) and the client's round
trip p50 over ipc://. The models are measured in turns, a few requests each,
so that drift on a noisy machine hits all of them alike. Also the seconds
each compiled form spent compiling at load, with an empty compile cache.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torchpool import Client  # noqa: E402

MODELS = ["mlp", "mlp_exported", "mlp_aoti", "mlp_compiled", "mlp_exported_compiled"]
LABELS = {"mlp": "TorchScript", "mlp_exported": "ExportedProgram", "mlp_aoti": "AOTInductor",
          "mlp_compiled": "TorchScript + TORCH_COMPILE",
          "mlp_exported_compiled": "ExportedProgram + TORCH_COMPILE"}
BATCHES = (1, 32)


def build_repository(repo: Path) -> None:
    """The five MLP models (and nothing else) under `repo`."""
    from torchpool.examples import MLP_CONFIG, _mlp, build_pt2_examples, serialize, write_model

    torchscript = serialize(_mlp())
    # one thread per worker: on a small shared machine a worker's two threads
    # stall on each other (TorchScript b=32: 21 ms with two, 2.2 ms with one)
    single = ("instance_group [ { count: 1 kind: KIND_CPU } ]\n"
              'parameters { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }\n')
    write_model(repo, "mlp", MLP_CONFIG + single, torchscript)
    build_pt2_examples(repo, torchscript)
    for name in ("mlp_exported", "mlp_aoti", "mlp_compiled"):
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text() + single)
    exported = repo / "mlp_exported"
    text = (exported / "config.pbtxt").read_text().replace('name: "mlp_exported"',
                                                           'name: "mlp_exported_compiled"')
    text += 'parameters { key: "TORCH_COMPILE" value: { string_value: "true" } }\n'
    write_model(repo, "mlp_exported_compiled", text, (exported / "1" / "model.pt2").read_bytes(),
                filename="model.pt2")


def start_daemon(repo: Path, work: Path) -> tuple[subprocess.Popen, str, Path, float]:
    url = f"ipc://{work}/pt2.sock"
    log = work / "pt2-daemon.log"
    env = {**os.environ, "TORCHPOOL_CACHE_DIR": str(work / "cache")}
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torchpool", "serve", "--model-repository", str(repo),
                                 "--listen", url], stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while "torchpool ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the PyTorch 2 bench daemon did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return proc, url, log, time.monotonic() - started


def compute_ns(client: Client, model: str, batch: int) -> tuple[int, int]:
    """(executions, ns) of compute_infer for batches of `batch` so far."""
    stats = client.statistics(model)["model_stats"][0]
    row = next((b for b in stats["batch_stats"] if b["batch_size"] == batch), None)
    return (0, 0) if row is None else (row["compute_infer"]["count"], row["compute_infer"]["ns"])


def measure(client: Client, batch: int, rounds: int, per_round: int) -> dict:
    x = np.random.default_rng(0).standard_normal((batch, 256)).astype(np.float32)
    reference = client.infer("mlp", {"INPUT__0": x})["OUTPUT__0"]
    calls: dict[str, Callable[[], object]] = {}
    for model in MODELS:
        out = client.infer(model, {"INPUT__0": x})["OUTPUT__0"]
        np.testing.assert_allclose(out, reference, rtol=1e-3, atol=1e-4, err_msg=model)
        calls[model] = lambda model=model: client.infer(model, {"INPUT__0": x})
        for _ in range(20):
            calls[model]()
    before = {m: compute_ns(client, m, batch) for m in MODELS}
    samples: dict[str, list[float]] = {m: [] for m in MODELS}
    for r in range(rounds):
        for model in (MODELS if r % 2 == 0 else MODELS[::-1]):
            for _ in range(per_round):
                t0 = time.perf_counter()
                calls[model]()
                samples[model].append(time.perf_counter() - t0)
    result = {}
    for model in MODELS:
        count, ns = (a - b for a, b in zip(compute_ns(client, model, batch), before[model]))
        result[model] = {"p50": float(np.median(samples[model])), "compute": ns / count / 1e9 if count else 0.0,
                         "requests": len(samples[model])}
    return result


def bench_pt2(quick: bool = False) -> dict:
    rounds = 6 if quick else 20
    with tempfile.TemporaryDirectory(prefix="torchpool-pt2-") as tmp:
        work = Path(tmp)
        print("PyTorch 2: exporting and AOTInductor-compiling the MLP ...", flush=True)
        t0 = time.monotonic()
        build_repository(work / "repo")
        built = time.monotonic() - t0
        print("PyTorch 2: serving (TORCH_COMPILE models compile at load) ...", flush=True)
        proc, url, log, ready = start_daemon(work / "repo", work)
        try:
            with Client(url, timeout=120) as client:
                results = {f"b{b}": measure(client, b, rounds, 10 if b == 1 else 4) for b in BATCHES}
            text = log.read_text(errors="replace")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    compiled = {m: float(found.group(1)) for m in MODELS
                if (found := re.search(rf"model '{m}' instance '\w+': compiled \(\w+\) in ([\d.]+) s", text))}
    return {"results": results, "build_s": built, "ready_s": ready, "compile_s": compiled}


def render_pt2(r: dict, us: Callable[[float], str]) -> list[str]:
    res = r["results"]
    lines = ["", "PyTorch 2 forms of the MLP 256-1024-1024-10 (one instance each, ipc, one request at a time):", "",
             "| form | compute b=1 | p50 b=1 | compute b=32 | p50 b=32 | compute vs TorchScript, b=1 / b=32 |",
             "|---|---|---|---|---|---|"]
    base = {b: res[b]["mlp"]["compute"] for b in ("b1", "b32")}
    for model in MODELS:
        cells = [LABELS[model]]
        for b in ("b1", "b32"):
            cells += [us(res[b][model]["compute"]), us(res[b][model]["p50"])]
        cells.append(" / ".join(f"{base[b] / res[b][model]['compute']:.2f}x" if res[b][model]["compute"] else "-"
                                for b in ("b1", "b32")))
        lines.append("| " + " | ".join(cells) + " |")
    compiled = ", ".join(f"{LABELS[m]} {s:.1f} s" for m, s in r["compile_s"].items())
    lines += ["", f"exporting + AOTInductor compile {r['build_s']:.1f} s; daemon ready in {r['ready_s']:.1f} s "
                  f"(compiling at load, empty cache: {compiled or 'none'})"]
    return lines


if __name__ == "__main__":
    def _us(x: float) -> str:
        return f"{x * 1e6:,.0f} µs" if x < 0.01 else f"{x * 1e3:,.1f} ms"
    print("\n".join(render_pt2(bench_pt2("--quick" in sys.argv), _us)))
