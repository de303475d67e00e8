"""Real models in scripts/bench (issue 27, items 0 and 3): `scripts/bench --only models`
(or `python scripts/bench_models.py [--quick] [--real-models resnet18,bert]`).

Built in code with seeded random weights (no downloads; torchvision does not
import beside this torch):

  resnet18  ResNet-18 (BasicBlock [2, 2, 2, 2]), 1x3x224x224 FP32 -> 1000 logits
  resnet50  ResNet-50 (Bottleneck [3, 4, 6, 3]), the same shapes (only with --real-models)
  bert      a BERT-base-wide encoder: vocab 30522, hidden 768, 12 heads, FFN
            3072, INT64 input_ids and attention_mask of 128 tokens -> the
            pooled [768]; 2 layers, not BERT-base's 12: on 2 cores one
            request of 12 layers takes about 6x a ResNet-18's time, too few
            requests per window for a p99 (each layer costs the same whatever
            their number, so the ratios hold)

each as TorchScript (torch.jit.script) and as a torch.export program
(torch.export.save, batch Dim 1..8): the `<model>_ts_*` and `<model>_pt2_*`
models. Each served model's answer is checked against the eager module's.

Item 3: each served by one daemon with two KIND_CPU instances and the
daemon's default threads (its CPUs shared among its CPU instances: one
intra-op thread each on 2 cores), max_batch_size 8, once as one request per
execution (`*_b1`) and once with dynamic_batching { preferred_batch_size:
[ 4, 8 ] max_queue_delay_microseconds: 2000 } (`*_dyn`), at concurrency
1, 4 and 8 (closed-loop client threads, a torchpool Client each, the local
shared-memory path); beside the same file run in one separate Python
process with the same thread budget: two copies of the model (the two
instances) with that many intra-op threads, taken by the same number of
caller threads from a queue, one batch-1 forward at a time each. Also that
process running batches of 4 on each copy (what batching itself gains on
this CPU: the ceiling of the dynamic-batching goal).

Item 0: the ResNet-18 case of issue 27 (TorchScript, count 2, the dynamic
batching above) with the defaults against hand-set INTRA_OP_THREAD_COUNT 1
and 2 at count 1 and 2, at concurrency 1 and 8, the defaults and the
in-process baseline measured again in the same turns.

All the models are served at once; every cell is measured in windows taken
in turns, the order reversed every round, so that drift hits all alike:
throughput is the median of a cell's windows, p50/p99 over all its
requests, CPU per inference from /proc/<pid>/stat (utime + stime of every
thread, also the ones that ended) of the client, of the daemon's processes
together and of the in-process baseline. After the timed rounds, the
requests per execution of each dynamic-batching model at c=8 (from the
daemon's statistics, which are not asked during the timed windows) and
each worker's memory (smaps_rollup).
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_timing import closed_loop, percentiles  # noqa: E402

MAX_BATCH = 8
INSTANCES = 2
DYNAMIC_BATCHING = "dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 2000 }\n"


# ------------------------------------------------------------------ models

class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


def _downsample(inplanes: int, outplanes: int, stride: int) -> nn.Module:
    if stride == 1 and inplanes == outplanes:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), nn.BatchNorm2d(outplanes))


class ResNet(nn.Module):
    """torchvision's ResNet layout (v1.5: the stride on the 3x3 conv)."""

    def __init__(self, block: type, layers: list[int], classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, inplanes = [], 64
        for i, count in enumerate(layers):
            planes = 64 << i
            blocks = []
            for j in range(count):
                blocks.append(block(inplanes, planes, 2 if (j == 0 and i > 0) else 1))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class EncoderLayer(nn.Module):
    """A BERT layer: self-attention (scaled_dot_product_attention), then the
    feed-forward block, each with a residual and a post-LayerNorm."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn_in = nn.Linear(hidden, ffn)
        self.ffn_out = nn.Linear(ffn, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.norm1(x + self.out(attended.transpose(1, 2).reshape(b, s, h)))
        return self.norm2(x + self.ffn_out(F.gelu(self.ffn_in(x))))


class Encoder(nn.Module):
    def __init__(self, layers: int, vocab: int = 30522, hidden: int = 768, heads: int = 12, ffn: int = 3072,
                 positions: int = 512) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList([EncoderLayer(hidden, heads, ffn) for _ in range(layers)])
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        seq = input_ids.shape[1]
        x = self.norm(self.words(input_ids) + self.positions(torch.arange(seq, device=input_ids.device)))
        # padding (mask 0) is never attended to: an additive -inf-like bias per key
        bias = ((1.0 - attention_mask.to(x.dtype)) * -10000.0)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        return torch.tanh(self.pooler(x[:, 0]))


SEQ = 128
BERT_LAYERS = 2


@dataclass
class ModelSpec:
    build: Callable[[], nn.Module]
    inputs: list[tuple[str, str, list[int]]]        # (name, Triton type, dims without the batch)
    output: tuple[str, list[int]]
    title: str

    def example(self, batch: int, seed: int = 0) -> list[np.ndarray]:
        """Batch-`batch` inputs, seeded: images of N(0, 1), or token ids with
        the last eighth of each sequence padding."""
        rng = np.random.default_rng(seed)
        out = []
        for name, dtype, dims in self.inputs:
            if dtype == "TYPE_FP32":
                out.append(rng.standard_normal((batch, *dims)).astype(np.float32))
            elif name == "input_ids":
                out.append(rng.integers(0, 30522, (batch, *dims), dtype=np.int64))
            else:
                mask = np.ones((batch, *dims), np.int64)
                mask[:, -dims[-1] // 8:] = 0
                out.append(mask)
        return out


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return make().eval().requires_grad_(False)
    return build


IMAGE = [("INPUT__0", "TYPE_FP32", [3, 224, 224])]
MODELS = {
    "resnet18": ModelSpec(_seeded(lambda: ResNet(BasicBlock, [2, 2, 2, 2])), IMAGE, ("OUTPUT__0", [1000]),
                          "ResNet-18, 1x3x224x224 FP32"),
    "resnet50": ModelSpec(_seeded(lambda: ResNet(Bottleneck, [3, 4, 6, 3])), IMAGE, ("OUTPUT__0", [1000]),
                          "ResNet-50, 1x3x224x224 FP32"),
    "bert": ModelSpec(_seeded(lambda: Encoder(BERT_LAYERS)),
                      [("input_ids", "TYPE_INT64", [SEQ]), ("attention_mask", "TYPE_INT64", [SEQ])],
                      ("OUTPUT__0", [768]), f"BERT-base-wide encoder, {BERT_LAYERS} layers, INT64 ids, seq {SEQ}"),
}


# ------------------------------------------------------------------ repository

FORMS = {"ts": "TorchScript", "pt2": "ExportedProgram"}
# item 0's hand-set variants of resnet18_ts_dyn: (INTRA_OP_THREAD_COUNT, count)
HAND_TUNED = [(1, 2), (2, 2), (1, 1), (2, 1)]
DEFAULTS_MODEL = "resnet18_ts_dyn"


def hand_tuned_name(intra: int, count: int) -> str:
    return f"resnet18_ts_dyn_intra{intra}_count{count}"


def model_config(name: str, spec: ModelSpec, form: str, batching: bool, count: int = INSTANCES,
                 intra: Optional[int] = None) -> str:
    inputs = ", ".join(f'{{ name: "{n}" data_type: {t} dims: [ {", ".join(map(str, d))} ] }}'
                       for n, t, d in spec.inputs)
    out_name, out_dims = spec.output
    text = (f'name: "{name}"\nbackend: "pytorch"\nmax_batch_size: {MAX_BATCH}\n'
            f"input [ {inputs} ]\n"
            f'output [ {{ name: "{out_name}" data_type: TYPE_FP32 dims: [ {", ".join(map(str, out_dims))} ] }} ]\n'
            f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n")
    if form == "pt2":
        text += 'default_model_filename: "model.pt2"\n'
    if batching:
        text += DYNAMIC_BATCHING
    if intra is not None:
        text += f'parameters {{ key: "INTRA_OP_THREAD_COUNT" value: {{ string_value: "{intra}" }} }}\n'
    return text


def export(module: nn.Module, spec: ModelSpec, form: str) -> bytes:
    """The model file's bytes: TorchScript, or a torch.export program with
    a batch Dim of 1..MAX_BATCH (exported at batch 2: export specialises 0
    and 1)."""
    import io
    import warnings

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # TorchScript's deprecation notices
        if form == "ts":
            torch.jit.save(torch.jit.script(module), buffer)
        else:
            batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
            example = tuple(torch.from_numpy(a) for a in spec.example(2))
            program = torch.export.export(module, example, dynamic_shapes=tuple({0: batch} for _ in example))
            torch.export.save(program, buffer)
    return buffer.getvalue()


def build_repository(repo: Path, names: list[str]) -> tuple[dict[str, Path], dict[str, np.ndarray]]:
    """The served models under `repo`: `<model>_<form>_b1` and `_dyn` for
    each model and form, and item 0's hand-tuned ResNet-18s. Returns each
    `<model>_<form>` file (for the in-process baseline) and each model's
    batch-1 output of the eager module (what the served forms must give)."""
    from torchpool.examples import write_model

    files, expected = {}, {}
    for model in names:
        spec = MODELS[model]
        module = spec.build()
        with torch.inference_mode():
            expected[model] = module(*(torch.from_numpy(a) for a in spec.example(1))).numpy()
        for form in FORMS:
            data = export(module, spec, form)
            filename = "model.pt2" if form == "pt2" else "model.pt"
            for batching in (False, True):
                name = f"{model}_{form}_{'dyn' if batching else 'b1'}"
                write_model(repo, name, model_config(name, spec, form, batching), data, filename=filename)
            files[f"{model}_{form}"] = repo / f"{model}_{form}_b1" / "1" / filename
            if model == "resnet18" and form == "ts":
                for intra, count in HAND_TUNED:
                    name = hand_tuned_name(intra, count)
                    write_model(repo, name, model_config(name, spec, form, True, count, intra), data)
    return files, expected


# ------------------------------------------------------------------ in-process baseline

def inprocess_main(conn, files: dict[str, str], copies: int, threads: int) -> None:
    """The baseline process: `copies` of each model file with `threads`
    intra-op (and inter-op) threads; answers ("run", name, model, c,
    seconds, batch) with a window's figures, None ends it."""
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)
    pools: dict[str, queue.Queue] = {}
    for name, path in files.items():
        pools[name] = queue.Queue()
        for _ in range(copies):
            if path.endswith(".pt2"):
                module = torch.export.load(path).module()
            else:
                module = torch.jit.load(path).eval()
            pools[name].put(module)
    conn.send("ready")
    while (message := conn.recv()) is not None:
        _, name, model, c, seconds, batch = message
        inputs = [torch.from_numpy(a) for a in MODELS[model].example(batch)]
        pool = pools[name]

        def make() -> Callable[[], object]:
            def call() -> None:
                module = pool.get()              # an "instance" free, as a worker would be
                try:
                    with torch.inference_mode():
                        module(*inputs)
                finally:
                    pool.put(module)
            return call

        conn.send(window(make, c, seconds, {"process": os.getpid()}, batch))


class InProcess:
    """The in-process baseline in a separate process (its own GIL, CPU
    counted apart from the client's)."""

    def __init__(self, files: dict[str, Path], copies: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=inprocess_main, args=(theirs, {k: str(v) for k, v in files.items()},
                                                                copies, threads))
        self.proc.start()
        if self.conn.recv() != "ready":
            raise SystemExit("the in-process baseline did not start")

    def run(self, name: str, model: str, c: int, seconds: float, batch: int = 1) -> dict:
        self.conn.send(("run", name, model, c, seconds, batch))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(None)
        self.proc.join(60)


# ------------------------------------------------------------------ measuring

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid`, also those that ended."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def window(make_call: Callable[[], Callable[[], object]], c: int, seconds: float,
           processes: dict[str, "int | list[int]"], batch: int = 1) -> dict:
    """One window of `c` closed-loop callers, each call `batch` inferences:
    its latencies, its length and the CPU each named process (or group of
    processes) spent per inference."""
    def cpu() -> dict[str, float]:
        return {k: sum(cpu_seconds(p) for p in (v if isinstance(v, list) else [v])) for k, v in processes.items()}

    before = cpu()
    latencies, elapsed = closed_loop(make_call, c, seconds, warmup=0)
    after = cpu()
    inferences = max(1, len(latencies) * batch)
    return {"latencies": latencies, "elapsed": elapsed, "batch": batch,
            "cpu": {k: (after[k] - before[k]) / inferences for k in processes}}


def merge(windows: list[dict]) -> dict:
    """A cell's figures from its windows: the median window's throughput
    (inferences per second), percentiles over every call, the mean CPU per
    inference."""
    every = [v for w in windows for v in w["latencies"]]
    p50, p99 = percentiles(every) if every else (0.0, 0.0)
    rates = [len(w["latencies"]) * w["batch"] / w["elapsed"] for w in windows]
    out = {"rps": statistics.median(rates), "windows_rps": rates,
           "p50": p50, "p99": p99, "requests": len(every),
           "cpu": {k: statistics.mean(w["cpu"][k] for w in windows) for k in windows[0]["cpu"]}}
    return out


class Served:
    """Closed-loop windows against the daemon: a Client per caller, made
    once (a new client's first request maps its arena: 0.1-0.4 s)."""

    def __init__(self, url: str, daemon_pid: int, callers: int) -> None:
        from tests.support.daemon import descendants
        from torchpool import Client

        self.clients = [Client(url, timeout=300) for _ in range(callers)]
        self.processes: dict[str, "int | list[int]"] = {
            "client": os.getpid(), "broker": daemon_pid, "daemon": [daemon_pid, *descendants(daemon_pid)]}

    def inputs(self, model: str) -> dict[str, np.ndarray]:
        spec = MODELS[model]
        return {name: a for (name, _, _), a in zip(spec.inputs, spec.example(1))}

    def counts(self, name: str) -> tuple[int, int]:
        stats = self.clients[0].statistics(name)["model_stats"][0]
        return stats["execution_count"], stats["inference_count"]

    def run(self, name: str, model: str, c: int, seconds: float) -> dict:
        inputs = self.inputs(model)
        turn = itertools.count()

        def make() -> Callable[[], object]:
            client = self.clients[next(turn)]
            return lambda: client.infer(name, inputs)

        return window(make, c, seconds, self.processes)

    def mean_batch(self, name: str, model: str, c: int, seconds: float) -> float:
        """Requests per execution over a window of `c` callers, from the
        daemon's statistics. Not asked during the timed windows: a
        statistics call has the broker read its workers' smaps_rollup
        (milliseconds each, broker/usage.py; before 1953afd it kept doing so
        every 2 s for a minute: 10-24% of a core with 22 ResNet/BERT workers)."""
        executions, inferences = self.counts(name)
        self.run(name, model, c, seconds)
        after = self.counts(name)
        return (after[1] - inferences) / (after[0] - executions) if after[0] > executions else 0.0

    def close(self) -> None:
        for client in self.clients:
            client.close()


def default_threads(log: Path) -> int:
    """The intra-op threads the daemon gave each CPU worker whose model sets
    none (the last share it logged)."""
    found = re.findall(r"for \d+ CPU instances: (\d+) intra-op", log.read_text(errors="replace"))
    if not found:
        raise SystemExit(f"the daemon logged no CPU share:\n{log.read_text()}")
    return int(found[-1])


def inprocess_row(model: str, form: str) -> str:
    return f"{model}_{form}_inprocess"


ITEM0 = "item0_"        # the prefix of item 0's rows
BATCHED = "_batched"    # the suffix of the in-process rows of batches


@dataclass(frozen=True)
class Cell:
    row: str            # the row of the results it is measured for
    target: str         # a served model, or the in-process baseline's file (`<model>_<form>`)
    inprocess: bool
    model: str          # what it runs: a key of MODELS
    c: int
    batch: int = 1      # inferences per call (the in-process baseline only)


def schedule(names: list[str]) -> list[Cell]:
    """Every cell once: for each model and form at each level its
    in-process baseline and both served configurations; then item 0's
    ResNet-18s at each of its levels, the defaults and the in-process
    baseline again beside the hand-tuned ones (so that they are measured in
    the same minutes)."""
    cells = []
    for model in names:
        for form in FORMS:
            for c in CONCURRENCY:
                cells += [Cell(inprocess_row(model, form), f"{model}_{form}", True, model, c),
                          Cell(f"{model}_{form}_b1", f"{model}_{form}_b1", False, model, c),
                          Cell(f"{model}_{form}_dyn", f"{model}_{form}_dyn", False, model, c)]
            # what batching itself gives: each copy running batches of
            # MAX_BATCH / INSTANCES (the batches c=8 makes of two instances)
            cells.append(Cell(inprocess_row(model, form) + BATCHED, f"{model}_{form}", True, model, INSTANCES,
                              MAX_BATCH // INSTANCES))
    if "resnet18" in names:
        for c in ITEM0_CONCURRENCY:
            cells.append(Cell(ITEM0 + inprocess_row("resnet18", "ts"), "resnet18_ts", True, "resnet18", c))
            cells += [Cell(ITEM0 + name, name, False, "resnet18", c) for name, _ in item0_rows()]
    return cells


CONCURRENCY = (1, 4, 8)
ITEM0_CONCURRENCY = (1, 4, 8)
DEFAULT_NAMES = ["resnet18", "bert"]


def bench_models(quick: bool = False, names: Optional[list[str]] = None) -> dict:
    from bench import Daemon
    from torchpool.config.devices import cpu_budget

    names = names or DEFAULT_NAMES
    seconds, rounds, warm = (0.5, 1, 0.3) if quick else (1.5, 2, 0.5)
    with tempfile.TemporaryDirectory(prefix="torchpool-bench-models-") as tmp:
        work = Path(tmp)
        print(f"real models ({', '.join(names)}): building TorchScript and .pt2 ...", flush=True)
        t0 = time.monotonic()
        files, expected = build_repository(work / "repo", names)
        built = time.monotonic() - t0
        print(f"real models: built in {built:.0f} s; serving them ...", flush=True)
        daemon = Daemon(work / "repo", [f"ipc://{work}/models.sock"], work / "models-daemon.log")
        inprocess = served = None
        try:
            ready = daemon.wait_ready(900)
            print(f"real models: daemon ready in {ready:.0f} s; the in-process baseline and the clients ...",
                  flush=True)
            threads = default_threads(daemon.log)
            inprocess = InProcess(files, INSTANCES, threads)
            served = Served(f"ipc://{work}/models.sock", daemon.proc.pid, max(CONCURRENCY))
            cells = schedule(names)
            warm_up(cells, served, inprocess, expected, warm)
            windows: dict[tuple[str, int], list[dict]] = {}
            for r in range(rounds):
                print(f"real models: round {r + 1} of {rounds}, {len(cells)} windows of {seconds} s ...", flush=True)
                for cell in (cells if r % 2 == 0 else cells[::-1]):
                    got = (inprocess.run(cell.target, cell.model, cell.c, seconds, cell.batch) if cell.inprocess
                           else served.run(cell.target, cell.model, cell.c, seconds))
                    windows.setdefault((cell.row, cell.c), []).append(got)
            print("real models: batch sizes at c=8 (the daemon's statistics), workers' memory ...", flush=True)
            batches = {cell.row: served.mean_batch(cell.target, cell.model, cell.c, seconds) for cell in cells
                       if cell.row.endswith("_dyn") and cell.c == max(CONCURRENCY)}
            memory = worker_memory(daemon.proc.pid)
            sizes = {name: path.stat().st_size for name, path in files.items()}
        finally:
            if served is not None:
                served.close()
            if inprocess is not None:
                inprocess.stop()
            daemon.stop()
    rows: dict[str, dict] = {}
    for (row, c), ws in windows.items():
        rows.setdefault(row, {})[f"c{c}"] = merge(ws)
    for row, mean in batches.items():
        rows[row][f"c{max(CONCURRENCY)}"]["mean_batch"] = mean
    return {"models": names, "rows": rows, "threads": threads, "instances": INSTANCES, "cpu_budget": cpu_budget(),
            "window_s": seconds, "rounds": rounds, "build_s": built, "ready_s": ready, "worker_memory": memory,
            "file_bytes": sizes}


def worker_memory(daemon_pid: int) -> dict[str, dict]:
    """Each served model's workers, after the run: the median PSS, RSS and
    private dirty KiB (smaps_rollup), by the model in the worker's title."""
    from bench_many import kinds, rollup

    found: dict[str, list[dict]] = {}
    for pid, kind in kinds(daemon_pid).items():
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
        if kind == "worker" and title[:2] == ["torchpool", "worker"]:
            found.setdefault(title[2], []).append(rollup(pid))
    return {model: {"workers": len(rs), **{k: statistics.median(r.get(k, 0) for r in rs)
                                           for k in ("Pss", "Rss", "Private_Dirty")}}
            for model, rs in found.items()}


def warm_up(cells: list[Cell], served: Served, inprocess: InProcess, expected: dict[str, np.ndarray],
            seconds: float) -> None:
    """Check each served model's answer against the eager module's, then
    load each target for `seconds` at c=8 (both instances, every batch size
    the batcher forms: TorchScript's profiling executor optimises per
    shape)."""
    targets = {(cell.target, cell.inprocess, cell.batch): cell.model for cell in cells}
    print(f"real models: checking and warming {len(targets)} models ...", flush=True)
    for (target, in_process, batch), model in targets.items():
        if in_process:
            inprocess.run(target, model, max(CONCURRENCY) if batch == 1 else INSTANCES, seconds, batch)
            continue
        got = served.clients[0].infer(target, served.inputs(model))[MODELS[model].output[0]]
        np.testing.assert_allclose(got, expected[model], rtol=1e-3, atol=1e-3, err_msg=target)
        served.run(target, model, max(CONCURRENCY), seconds)


# ------------------------------------------------------------------ report

SHORT = {"resnet18": "ResNet-18", "resnet50": "ResNet-50", "bert": f"BERT-{BERT_LAYERS}L"}


def _rps(cell: dict, base: Optional[dict] = None) -> str:
    text = f"{cell['rps']:,.1f}/s"
    return text + (f" ({cell['rps'] / base['rps']:.2f}x)" if base and base["rps"] else "")


def _cpu(cell: dict, ms: Callable[[float], str]) -> str:
    cpu = cell["cpu"]
    if "process" in cpu:
        return ms(cpu["process"])
    return f"{ms(cpu['daemon'])} (broker {ms(cpu['broker'])}) + {ms(cpu['client'])}"


def render_models(r: dict, us: Callable[[float], str]) -> list[str]:
    rows, cs = r["rows"], [f"c{c}" for c in CONCURRENCY]
    lines = ["", f"real models (bench_models.py), built in code: {r['instances']} KIND_CPU instances of "
                 f"{r['threads']} intra-op thread(s) each (the daemon's default share of {r['cpu_budget']} CPUs); "
                 f"in-process: one process, {r['instances']} copies x {r['threads']} thread(s), batch 1; "
                 f"{r['rounds']} round(s) of {r['window_s']} s windows, alternating; built in {r['build_s']:.0f} s, "
                 f"daemon ready in {r['ready_s']:.0f} s. "
                 "(x): against the in-process row; CPU: the daemon's processes (the broker's part) + the client.",
             "",
             "| model | how | " + " | ".join(f"c={c[1:]}" for c in cs)
             + " | p50 / p99 c=8 (requests) | CPU / inference c=1; c=8 | requests per execution c=8 |",
             "|---|---|" + "---|" * len(cs) + "---|---|---|"]
    for model in r["models"]:
        for form, title in FORMS.items():
            base = rows[inprocess_row(model, form)]
            for label, key in (("in-process", inprocess_row(model, form)),
                               ("served, batch 1", f"{model}_{form}_b1"),
                               ("served, dynamic batching", f"{model}_{form}_dyn")):
                row = rows[key]
                first = f"{SHORT[model]} {title}" if label == "in-process" else ""
                batch = f"{row['c8']['mean_batch']:.1f}" if "mean_batch" in row["c8"] else ""
                lines.append(f"| {first} | {label} | "
                             + " | ".join(_rps(row[c], None if row is base else base[c]) for c in cs)
                             + f" | {us(row['c8']['p50'])} / {us(row['c8']['p99'])} ({row['c8']['requests']})"
                             f" | {_cpu(row['c1'], us)}; {_cpu(row['c8'], us)} | {batch} |")
    lines += render_goals(r)
    memory = r.get("worker_memory", {})
    if memory:
        lines += ["", "a worker after the run (median of each model's two; smaps_rollup): "
                  + "; ".join(f"{SHORT[m]} {FORMS[f]}: file {r['file_bytes'][f'{m}_{f}'] / 2**20:.0f} MiB, PSS "
                              f"{mem['Pss'] / 1024:.0f} MiB, private dirty {mem['Private_Dirty'] / 1024:.0f} MiB"
                              for m in r["models"] for f in FORMS if (mem := memory.get(f"{m}_{f}_dyn"))) + "."]
    if ITEM0 + DEFAULTS_MODEL in rows:
        lines += render_item0(r, us)
    return lines


def goal_figures(r: dict, model: str, form: str) -> dict:
    """The three goals of issue 27 item 3 for one model and form."""
    rows = r["rows"]
    base, b1, dyn = (rows[inprocess_row(model, form)], rows[f"{model}_{form}_b1"], rows[f"{model}_{form}_dyn"])
    batched = rows[inprocess_row(model, form) + BATCHED][f"c{INSTANCES}"]
    return {"batch1": [b1[f"c{c}"]["rps"] / base[f"c{c}"]["rps"] for c in CONCURRENCY],
            "dynamic": dyn["c8"]["rps"] / base["c8"]["rps"],
            "batching_itself": batched["rps"] / base["c8"]["rps"],
            "tail": [row["c8"]["p99"] / row["c8"]["p50"] for row in (b1, dyn)]}


def render_goals(r: dict) -> list[str]:
    columns = [(m, f) for m in r["models"] for f in FORMS]
    figures = [goal_figures(r, m, f) for m, f in columns]

    def mark(ok: bool) -> str:
        return "" if ok else " **missed**"

    lines = ["", "| goal (issue 27.3) | " + " | ".join(f"{SHORT[m]} {FORMS[f]}" for m, f in columns) + " |",
             "|---|" + "---|" * len(columns)]
    lines.append("| served batch 1 >= 0.95x in-process, c=" + "/".join(map(str, CONCURRENCY)) + " | " + " | ".join(
        " / ".join(f"{x:.2f}" for x in f["batch1"]) + mark(min(f["batch1"]) >= 0.95) for f in figures) + " |")
    lines.append("| dynamic batching >= 1.2x in-process batch 1, c=8 | " + " | ".join(
        f"{f['dynamic']:.2f}x" + mark(f["dynamic"] >= 1.2) for f in figures) + " |")
    lines.append(f"| (what batching gives in-process: {INSTANCES} callers of batches of {MAX_BATCH // INSTANCES}, "
                 "against batch 1 at c=8) | " + " | ".join(f"{f['batching_itself']:.2f}x" for f in figures) + " |")
    lines.append("| p99 <= 2x p50 at c=8: batch 1 / dynamic batching | " + " | ".join(
        " / ".join(f"{x:.2f}" for x in f["tail"]) + mark(max(f["tail"]) <= 2.0) for f in figures) + " |")
    return lines


def item0_rows() -> list[tuple[str, str]]:
    return [(DEFAULTS_MODEL, "defaults, count 2 (the daemon's share)")] + [
        (hand_tuned_name(intra, count), f"INTRA_OP_THREAD_COUNT {intra}, count {count}")
        for intra, count in HAND_TUNED]


def render_item0(r: dict, us: Callable[[float], str]) -> list[str]:
    rows = {key[len(ITEM0):]: row for key, row in r["rows"].items() if key.startswith(ITEM0)}
    lines = ["", "issue 27.0: ResNet-18 TorchScript, dynamic_batching { preferred_batch_size: [ 4, 8 ] "
                 "max_queue_delay_microseconds: 2000 }, its own windows in turns:", "",
             "| configuration | c=1 | c=4 | c=8 | p50 / p99 c=8 | CPU / inference c=1; c=8 |",
             "|---|---|---|---|---|---|"]
    for key, label in item0_rows() + [(inprocess_row("resnet18", "ts"),
                                       f"in-process, {r['instances']} copies x {r['threads']} thread(s), batch 1")]:
        row = rows[key]
        lines.append(f"| {label} | {_rps(row['c1'])} | {_rps(row['c4'])} | {_rps(row['c8'])} | "
                     f"{us(row['c8']['p50'])} / "
                     f"{us(row['c8']['p99'])} | {_cpu(row['c1'], us)}; {_cpu(row['c8'], us)} |")
    for c in ITEM0_CONCURRENCY:
        best_key, best_label = max(item0_rows()[1:], key=lambda kv: rows[kv[0]][f"c{c}"]["rps"])
        ratio = rows[DEFAULTS_MODEL][f"c{c}"]["rps"] / rows[best_key][f"c{c}"]["rps"]
        lines.append(f"defaults at c={c}: {ratio:.2f}x the best hand-set ({best_label}); goal >= 0.90x: "
                     + ("met" if ratio >= 0.9 else "**missed**"))
    return lines


def _ms(x: float) -> str:
    return f"{x * 1e6:,.0f} µs" if x < 0.01 else f"{x * 1e3:,.1f} ms"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--real-models", default=",".join(DEFAULT_NAMES),
                        help=f"comma list of {', '.join(MODELS)} (default: %(default)s)")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    result = bench_models(args.quick, args.real_models.split(","))
    print("\n".join(render_models(result, _ms)))
    if args.json:
        Path(args.json).write_text(__import__("json").dumps(result, indent=2))
