"""Dynamic batching in scripts/bench: the example MLP with and without
`dynamic_batching { }` at concurrency 1, 8 and 32 (one instance, ipc)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from torchpool import Client

from bench_timing import load_test


def add_unbatched_mlp(repo: Path) -> None:
    """`mlp_nobatch`: the example MLP without dynamic_batching (Triton's default
    scheduler: every request is one execution)."""
    from torchpool.examples import MLP_CONFIG

    target = repo / "mlp_nobatch"
    (target / "1").mkdir(parents=True, exist_ok=True)
    (target / "1" / "model.pt").write_bytes((repo / "mlp" / "1" / "model.pt").read_bytes())
    config = MLP_CONFIG.replace('name: "mlp"', 'name: "mlp_nobatch"')
    config = "\n".join(line for line in config.splitlines()
                       if "dynamic_batching" not in line and "queue delay" not in line)
    (target / "config.pbtxt").write_text(config + "\n")


def bench_batching(url: str, seconds: float, concurrency: tuple = (1, 8, 32)) -> dict:
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    out: dict = {}
    for model in ("mlp_nobatch", "mlp"):
        with Client(url, local=False) as c:
            c.infer(model, {"INPUT__0": x})
        for n in concurrency:
            with Client(url, local=False) as c:
                before = c.statistics(model)["model_stats"][0]
            clients: list = []

            def make():
                # 1 KiB in, 40 bytes out: inline either way, so no client arenas
                c = Client(url, local=False)
                clients.append(c)
                return lambda: c.infer(model, {"INPUT__0": x})

            r = load_test(make, n, seconds)
            for c in clients:
                c.close()
            with Client(url, local=False) as c:
                after = c.statistics(model)["model_stats"][0]
            executions = after["execution_count"] - before["execution_count"]
            items = after["inference_count"] - before["inference_count"]
            r["mean_batch"] = items / executions if executions else 0.0
            out.setdefault(model, {})[f"c{n}"] = r
    return out


def render_batching(b: dict, us: Callable[[float], str]) -> list[str]:
    lines: list[str] = []
    cs = sorted(b["mlp"], key=lambda k: int(k[1:]))
    lines += ["", "dynamic batching, MLP 256-1024-1024-10 ([1,256] FP32 per request, one instance, ipc):", "",
              "| | " + " | ".join(f"c={k[1:]}" for k in cs) + " |", "|---" * (len(cs) + 1) + "|"]
    for model, label in (("mlp_nobatch", "without batching"), ("mlp", "dynamic_batching { }")):
        row = b[model]
        lines.append(f"| {label}: throughput | " + " | ".join(f"{row[k]['rps']:,.0f}/s" for k in cs) + " |")
        lines.append(f"| {label}: p50 / p99 | "
                     + " | ".join(f"{us(row[k]['p50'])} / {us(row[k]['p99'])}" for k in cs) + " |")
        lines.append(f"| {label}: requests per execution | "
                     + " | ".join(f"{row[k]['mean_batch']:.1f}" for k in cs) + " |")
    lines.append("| speed-up with batching | " + " | ".join(
        f"{b['mlp'][k]['rps'] / b['mlp_nobatch'][k]['rps']:.1f}x" for k in cs) + " |")
    return lines
