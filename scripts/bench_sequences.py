"""Benchmark section for sequence batching (imported by bench.py; run alone
with `python scripts/bench_sequences.py`).

16 sequences at once, each a closed loop of one client thread sending the
requests of its sequence one after the other (START ... END, then a new
sequence), on an accumulator with an implicit INT32 state and one instance:
`seq_direct` has max_batch_size 16 and `direct { }` (the 16 sequences hold
the 16 slots, their requests run together), `seq_alone` is the same model
with max_batch_size 0 (one slot: one sequence at a time, the others wait for
it to end, as in Triton). Both are measured in the same run.
"""
from __future__ import annotations

import io
import itertools
import threading
import time
from pathlib import Path
from typing import Tuple

import numpy as np

from torchpool import Client

from bench_timing import run_window

STEPS = 10          # requests per sequence

CONFIG = """name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: {mbs}
input [ {{ name: "INPUT__0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 5000000
  direct {{ }}
  control_input [ {{ name: "START__1" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }} ]
  state [ {{ input_name: "STATE_IN__2" output_name: "STATE_OUT__1" data_type: TYPE_INT32 dims: [ 1 ] }} ]
}}
"""


def add_sequence_models(repo: Path) -> None:
    import torch
    from torch import Tensor, nn

    class Accumulate(nn.Module):
        def forward(self, x: Tensor, start: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
            total = torch.where(start != 0, x, x + state)
            return total, total

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(Accumulate()), buffer)
    for name, mbs in (("seq_direct", 16), ("seq_alone", 0)):
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "1" / "model.pt").write_bytes(buffer.getvalue())
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, mbs=mbs))


def bench_sequences(url: str, seconds: float, sequences: int = 16) -> dict:
    out: dict = {}
    ids = itertools.count(1)
    for model, shape in (("seq_alone", [1]), ("seq_direct", [1, 1])):
        with Client(url, local=False) as c:
            before = c.statistics(model)["model_stats"][0]
        counts = [0] * sequences
        wrong = []
        stop = [0.0]
        start = threading.Barrier(sequences + 1)

        def loop(i: int) -> None:
            with Client(url, local=False, timeout=120) as c:
                start.wait()
                while time.monotonic() < stop[0]:
                    seq, running = next(ids), 0
                    for step in range(STEPS):
                        x = (i + step) % 7
                        running += x
                        got = c.infer(model, {"INPUT__0": np.full(shape, x, np.int32)}, sequence_id=seq,
                                      sequence_start=step == 0, sequence_end=step == STEPS - 1)
                        if int(got["OUTPUT__0"].reshape(-1)[0]) != running:
                            wrong.append((model, seq, step))
                        counts[i] += 1

        elapsed = run_window(loop, sequences, seconds, start, stop)
        with Client(url, local=False) as c:
            after = c.statistics(model)["model_stats"][0]
        executions = after["execution_count"] - before["execution_count"]
        items = after["inference_count"] - before["inference_count"]
        if wrong:
            raise SystemExit(f"sequence bench: wrong sums {wrong[:5]}")
        out[model] = {"rps": sum(counts) / elapsed, "requests": sum(counts),
                      "mean_batch": items / executions if executions else 0.0}
    out["speedup"] = out["seq_direct"]["rps"] / out["seq_alone"]["rps"]
    return out


def render_sequences(r: dict) -> list[str]:
    a, d = r["seq_alone"], r["seq_direct"]
    return ["", f"sequence batching, 16 concurrent sequences of an INT32 accumulator ({STEPS} requests each, "
                "one instance, ipc):", "",
            "| | throughput | requests per execution |", "|---|---|---|",
            f"| max_batch_size 0 (one sequence at a time) | {a['rps']:,.0f}/s | {a['mean_batch']:.1f} |",
            f"| `direct {{ }}`, max_batch_size 16 | {d['rps']:,.0f}/s | {d['mean_batch']:.1f} |",
            f"| speed-up with sequence batching | {r['speedup']:.1f}x | |"]


if __name__ == "__main__":
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import Daemon

    with tempfile.TemporaryDirectory(prefix="torchpool-bench-seq-") as tmp:
        repo = Path(tmp) / "repo"
        add_sequence_models(repo)
        daemon = Daemon(repo, [f"ipc://{tmp}/tp.sock"], Path(tmp) / "daemon.log")
        try:
            daemon.wait_ready()
            result = bench_sequences(f"ipc://{tmp}/tp.sock", float(sys.argv[1]) if len(sys.argv) > 1 else 5.0)
        finally:
            daemon.stop()
    print("\n".join(render_sequences(result)))
