#!/usr/bin/env python3
"""torchpool benchmarks. Every figure of one report comes from one run, so
ratios are meaningful even on a noisy 2-core machine.

  1. latency at concurrency 1 (p50/p99) and throughput at concurrency 8 for a
     tiny add/sub model (2x[1,16] FP32) and a 16 MiB FP32 identity model, over
     ipc:// and tcp://, against calling the same TorchScript model in-process
     and against a raw ZeroMQ DEALER/ROUTER echo of the same bytes;
  2. many models (bench_many.py): time until 20 and until 100 single-instance
     models are ready, the memory (PSS) of the daemon with all its processes,
     the PSS per added model, and where an idle worker's memory goes
     (`--only many`; --skip-startup leaves it out);
  3. the local shared-memory path (16 MiB identity against two memcpys and
     against inline frames; allocate-in-place; a tiny model local vs inline);
  4. dynamic batching: throughput and p50/p99 latency at concurrency 1, 8 and
     32 for the example repository's MLP (256-1024-1024-10, one instance),
     once with its `dynamic_batching { }` and once as a copy without it
     (`mlp_nobatch`: one request per execution), with the executions the
     daemon counted (requests per execution = the mean batch size);
  5. sequence batching: 16 concurrent sequences of an accumulator with
     `direct { }` against the same model one sequence at a time
     (bench_sequences.py);
  6. the KServe v2 endpoints (bench_gateways.py), right after the ZeroMQ rows
     of 1. and beside them: the same add/sub (p50/p99 at concurrency 1, the
     CPU per request of the client, the gateway, the broker and the worker;
     throughput at concurrency 8) and 16 MiB identity through the real
     tritonclient over HTTP (binary tensors) and gRPC, and PyTriton (Triton's
     C++ frontends + Python backend, the same add/sub TorchScript) with the
     same client code, when $ANCHORS_VENV_ROOT/base/bin/python has pytriton
     (../shared/anchors; --skip-pytriton leaves it out), and issue 40's
     baselines: a minimal grpcio aio and httptools-on-asyncio server
     answering the same add/sub with no daemon (gateway_echo.py), with
     torchpool's ratio to each (`--only gateways` runs this section alone);
  7. PyTorch 2 (bench_pt2.py): the MLP as TorchScript, ExportedProgram,
     AOTInductor package, TorchScript + TORCH_COMPILE and ExportedProgram +
     TORCH_COMPILE: in-worker compute per batch and round trip p50 at batch 1
     and 32, in one daemon (`--only pt2` runs this section alone, --skip-pt2
     leaves it out);
  8. CPU per tiny request by process and thread (bench_cpu.py): client,
     broker, worker beside the raw echo, with the defaults, with a direct
     path's ends asleep (`--direct-spin-us 0`) and with the broker busy
     polling (`--only cpu` runs this section alone);
  9. TorchServe, PyTriton, the raw echo and the ZeroMQ+shm floor beside
     torchpool on the same models (bench_anchors.py: ../shared/anchors, when
     $ANCHORS_VENV_ROOT has its venvs; `--only anchors`, --skip-anchors);
 10. real models built in code (bench_models.py): a ResNet-18 and a
     BERT-style encoder as TorchScript and .pt2, two instances, with and
     without dynamic batching, at concurrency 1, 4 and 8 against the same
     file in one separate Python process with the same threads; and issue
     27.0's ResNet-18 with the default threads against hand-set ones
     (`--only models`, --skip-models, --real-models).

Not in the full run (an attack, not a way of calling): `--only offender`, a
new gRPC caller's latency alone and beside 4 x 100 gRPC streams whose
answers are never read (bench_offender.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from torchpool import Client  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateways import (PyTriton, bench_gateways, free_port, pytriton_python,  # noqa: E402
                            render_gateways, torchpool_pids)
from gateway_echo import EchoProcess  # noqa: E402
from bench_local import bench_local, render_local  # noqa: E402
from bench_many import bench_many, render_many  # noqa: E402
from bench_offender import bench_offender, render_offender  # noqa: E402
from bench_models import DEFAULT_NAMES, MODELS, bench_models, render_models  # noqa: E402
from bench_anchors import bench_anchors, render_anchors  # noqa: E402
from bench_cpu import bench_cpu, render_cpu  # noqa: E402
from bench_pt2 import bench_pt2, render_pt2  # noqa: E402
from bench_sequences import add_sequence_models, bench_sequences, render_sequences  # noqa: E402
from bench_batching import add_unbatched_mlp, bench_batching, render_batching  # noqa: E402
from bench_timing import throughput, time_calls  # noqa: E402

MiB = 1 << 20


# ------------------------------------------------------------------ helpers

def echo_server(url: str) -> None:
    """A raw ZeroMQ ROUTER echo: the floor for any ZeroMQ server."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(url)
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"quit":
            break
        sock.send_multipart(frames, copy=False)
    sock.close(0)
    ctx.term()


class Daemon:
    def __init__(self, repo: Path, urls: list[str], log: Path, http_port: Optional[int] = None,
                 grpc_port: Optional[int] = None) -> None:
        args = [sys.executable, "-m", "torchpool", "serve", "--model-repository", str(repo)]
        for u in urls:
            args += ["--listen", u]
        if http_port is not None:
            args += ["--http-port", str(http_port)]
        if grpc_port is not None:
            args += ["--grpc-port", str(grpc_port)]
        self.log = log
        self._log = open(log, "wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "torchpool ready" in self.log.read_text(errors="replace"):
                return time.monotonic() - self.t0
            if self.proc.poll() is not None:
                raise SystemExit(f"daemon exited:\n{self.log.read_text()}")
            time.sleep(0.005)
        raise SystemExit("daemon not ready in time")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self._log.close()


# --------------------------------------------------------------- sections

def bench_inprocess(repo: Path, n_small: int, n_big: int, seconds: float) -> dict:
    import torch

    out = {}
    addsub = torch.jit.load(str(repo / "addsub" / "1" / "model.pt"))
    ident = torch.jit.load(str(repo / "identity" / "1" / "model.pt"))
    a = torch.ones(1, 16)
    big = torch.ones(4 * MiB)   # 16 MiB of FP32

    def call_small():
        with torch.inference_mode():
            addsub(a, a)

    def call_big():
        # the identity returns its input; a server must at least copy it out
        with torch.inference_mode():
            ident(big).clone()

    out["addsub"] = {"c1": time_calls(call_small, n_small)}
    out["identity16"] = {"c1": time_calls(call_big, n_big, warmup=3)}
    out["addsub"]["c8"] = throughput(lambda: call_small, 8, seconds)
    out["identity16"]["c8"] = throughput(lambda: call_big, 8, seconds)
    return out


def bench_echo(url: str, n_small: int, n_big: int) -> dict:
    import multiprocessing as mp

    proc = mp.get_context("spawn").Process(target=echo_server, args=(url,))
    proc.start()
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(url)
    small = [b"h" * 64, np.ones(16, np.float32).tobytes(), np.ones(16, np.float32).tobytes()]
    big = np.ones(4 * MiB, np.float32)

    def rt(frames):
        def call():
            sock.send_multipart(frames, copy=len(frames[-1]) < 65536)
            sock.recv_multipart(copy=False)
        return call

    res = {"small": time_calls(rt([b"".join(small)]), n_small),
           "16MiB": time_calls(rt([b"h" * 64, memoryview(big)]), n_big, warmup=3)}
    sock.send_multipart([b"quit"])
    sock.close(0)
    proc.join(10)
    return res


def bench_torchpool(url: str, n_small: int, n_big: int, seconds: float) -> dict:
    """Inline frames (local=False): the path of a client on another host."""
    a = np.ones((1, 16), np.float32)
    big = np.ones(4 * MiB, np.float32)
    out = {}
    with Client(url, local=False) as c:
        out["addsub"] = {"c1": time_calls(lambda: c.infer("addsub", {"INPUT0": a, "INPUT1": a}), n_small)}
        out["identity16"] = {"c1": time_calls(lambda: c.infer("identity", {"INPUT__0": big}), n_big, warmup=3)}

    def client_call(model, inputs):
        def make():
            c = Client(url, local=False)
            return lambda: c.infer(model, inputs)
        return make

    out["addsub"]["c8"] = throughput(client_call("addsub", {"INPUT0": a, "INPUT1": a}), 8, seconds)
    out["identity16"]["c8"] = throughput(client_call("identity", {"INPUT__0": big}), 8, seconds)
    return out


def bench_endpoints(daemon: Daemon, http_port: int, grpc_port: int, work: Path, n_small: int, n_big: int,
                    seconds: float, skip_pytriton: bool) -> dict:
    """The KServe v2 HTTP/gRPC rows (bench_gateways.py), the echo servers
    (gateway_echo.py) and PyTriton, when it is installed, beside them: started
    for this step only, so they cost nothing to the other sections."""
    echoes: dict[str, EchoProcess] = {}
    echo_skipped = ""
    try:
        for protocol in ("http", "grpc"):
            echoes[protocol] = EchoProcess(protocol)
    except Exception as exc:  # noqa: BLE001 - the torchpool rows still run
        echo_skipped = f"they did not start: {exc}"
        for echo in echoes.values():
            echo.stop()
        echoes = {}
    pytriton, skipped = None, ""
    if skip_pytriton:
        skipped = "--skip-pytriton"
    else:
        python, skipped = pytriton_python()
        if python:
            print("PyTriton (for the endpoint rows) ...", flush=True)
            try:
                pytriton = PyTriton(python, work)
                pytriton.wait_ready()
            except Exception as exc:  # noqa: BLE001 - the torchpool rows still run
                skipped = f"it did not start: {exc}"
                if pytriton is not None:
                    pytriton.stop()
                pytriton = None
    print("KServe v2 HTTP/gRPC endpoints (tritonclient)"
          + (", PyTriton beside them" if pytriton else "") + " ...", flush=True)
    try:
        import tritonclient.http as tc

        probe = tc.InferenceServerClient(f"127.0.0.1:{http_port}")
        deadline = time.monotonic() + 30
        while True:             # "torchpool ready" comes once the gateway has bound its ports
            try:
                if probe.is_server_ready():
                    break
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
        probe.close()
        out = bench_gateways(http_port, grpc_port, n_small, n_big, seconds, torchpool_pids(daemon.proc.pid),
                             pytriton, echoes)
    finally:
        if pytriton is not None:
            pytriton.stop()
        for echo in echoes.values():
            echo.stop()
    if skipped:
        out["pytriton_skipped"] = skipped
    if echo_skipped:
        out["echo_skipped"] = echo_skipped
    return out


def gateways_alone(n_small: int, n_big: int, seconds: float, skip_pytriton: bool) -> dict:
    """`--only gateways`: the endpoint rows, in a daemon of the example
    repository started for them."""
    from torchpool.examples import build_example_repository

    with tempfile.TemporaryDirectory(prefix="torchpool-bench-") as tmp:
        work = Path(tmp)
        build_example_repository(work / "repo")
        http_port, grpc_port = free_port(), free_port()
        daemon = Daemon(work / "repo", [f"ipc://{work}/tp.sock"], work / "daemon.log", http_port, grpc_port)
        try:
            daemon.wait_ready()
            return bench_endpoints(daemon, http_port, grpc_port, work, n_small, n_big, seconds, skip_pytriton)
        finally:
            daemon.stop()


# ------------------------------------------------------------------ report

def us(x: float) -> str:
    return f"{x * 1e6:,.0f} µs" if x < 0.01 else f"{x * 1e3:,.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument("--skip-startup", action="store_true", help="leave out the many-models section")
    parser.add_argument("--skip-pytriton", action="store_true",
                        help="measure torchpool's HTTP/gRPC endpoints without PyTriton beside them")
    parser.add_argument("--skip-pt2", action="store_true", help="leave out the PyTorch 2 section")
    parser.add_argument("--skip-anchors", action="store_true",
                        help="leave out TorchServe/PyTriton/floors beside torchpool (bench_anchors.py)")
    parser.add_argument("--skip-models", action="store_true", help="leave out the real-models section")
    parser.add_argument("--real-models", default=",".join(DEFAULT_NAMES),
                        help=f"the real models' section: a comma list of {', '.join(MODELS)} (default %(default)s)")
    parser.add_argument("--only", choices=["gateways", "pt2", "cpu", "anchors", "models", "many", "offender"],
                        help="run this section alone")
    parser.add_argument("--out", default=str(ROOT / "bench-results"))
    args = parser.parse_args()
    n_small, n_big, secs = (300, 8, 2.0) if args.quick else (3000, 40, 5.0)

    from torchpool.examples import build_example_repository

    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
                     "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.only == "gateways":
        results["gateways"] = gateways_alone(n_small, n_big, secs, args.skip_pytriton)
        return report(results, args.out)
    if args.only == "pt2":
        results["pt2"] = bench_pt2(args.quick)
        return report(results, args.out)
    if args.only == "cpu":
        results["cpu"] = bench_cpu(1000 if args.quick else 5000)
        return report(results, args.out)
    if args.only == "anchors":
        results["anchors"] = bench_anchors(Path(args.out), args.quick)
        return report(results, args.out)
    if args.only == "models":
        results["models"] = bench_models(args.quick, args.real_models.split(","))
        return report(results, args.out)
    if args.only == "many":
        results["many"] = bench_many(args.quick)
        return report(results, args.out)
    if args.only == "offender":
        results["offender"] = bench_offender(Daemon, free_port, args.quick)
        return report(results, args.out)
    with tempfile.TemporaryDirectory(prefix="torchpool-bench-") as tmp:
        work = Path(tmp)
        repo = work / "repo"
        build_example_repository(repo)
        add_unbatched_mlp(repo)
        add_sequence_models(repo)
        print("in-process TorchScript ...", flush=True)
        results["inprocess"] = bench_inprocess(repo, n_small, n_big, secs)
        urls = {"ipc": f"ipc://{work}/tp.sock", "tcp": "tcp://127.0.0.1:18555"}
        for name, url in (("ipc", f"ipc://{work}/echo.sock"), ("tcp", "tcp://127.0.0.1:18556")):
            print(f"raw ZeroMQ echo over {name} ...", flush=True)
            results[f"echo_{name}"] = bench_echo(url, n_small, n_big)
        http_port, grpc_port = free_port(), free_port()
        daemon = Daemon(repo, list(urls.values()), work / "daemon.log", http_port, grpc_port)
        try:
            daemon.wait_ready()
            for name, url in urls.items():
                print(f"torchpool over {name} ...", flush=True)
                results[f"torchpool_{name}"] = bench_torchpool(url, n_small, n_big, secs)
            results["gateways"] = bench_endpoints(daemon, http_port, grpc_port, work, n_small, n_big, secs,
                                                  args.skip_pytriton)
            print("local shared-memory path ...", flush=True)
            results["local"] = bench_local(urls["ipc"], n_small, n_big)
            print("dynamic batching: MLP at concurrency 1, 8, 32 ...", flush=True)
            results["batching"] = bench_batching(urls["ipc"], secs)
            print("sequence batching: 16 sequences, direct vs one at a time ...", flush=True)
            results["sequences"] = bench_sequences(urls["ipc"], secs)
        finally:
            daemon.stop()
    if not args.skip_startup:
        results["many"] = bench_many(args.quick)
    if not args.skip_pt2:
        results["pt2"] = bench_pt2(args.quick)
    if not args.skip_models:
        results["models"] = bench_models(args.quick, args.real_models.split(","))
    print("CPU per request by process ...", flush=True)
    results["cpu"] = bench_cpu(1000 if args.quick else 5000)
    if not args.skip_anchors:
        print("TorchServe, PyTriton and the floors beside torchpool (anchors, ~15 min) ...", flush=True)
        results["anchors"] = bench_anchors(Path(args.out), args.quick)
    return report(results, args.out)


def report(results: dict, out_dir: str) -> int:
    """Print the tables and keep the raw figures."""
    print(render(results))
    out = Path(out_dir)
    out.mkdir(exist_ok=True)
    path = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"\nraw figures: {path}")
    return 0


def render(r: dict) -> str:
    lines = [f"machine: {r['machine']}, Python {r['python']}, {r['date']}"]
    if "inprocess" in r:
        lines += render_main(r)
    elif "gateways" in r:
        lines += render_gateways(r["gateways"], us)
    if "many" in r:
        lines += render_many(r["many"])
    if "pt2" in r:
        lines += render_pt2(r["pt2"], us)
    if "models" in r:
        lines += render_models(r["models"], us)
    if "cpu" in r:
        lines += render_cpu(r["cpu"])
    if "anchors" in r:
        lines += render_anchors(r["anchors"])
    if "offender" in r:
        lines += render_offender(r["offender"], us)
    return "\n".join(lines)


def render_main(r: dict) -> list[str]:
    ip = r["inprocess"]
    lines = ["",
             "| case | in-process | raw ZeroMQ echo | torchpool | ratio to echo |",
             "|---|---|---|---|---|"]
    for t in ("ipc", "tcp"):
        tp, echo = r[f"torchpool_{t}"], r[f"echo_{t}"]
        lines.append(f"| add/sub 2x[1,16] p50, c=1, {t} | {us(ip['addsub']['c1'][0])} | {us(echo['small'][0])} "
                     f"| {us(tp['addsub']['c1'][0])} | {tp['addsub']['c1'][0] / echo['small'][0]:.2f}x |")
        lines.append(f"| add/sub p99, c=1, {t} | {us(ip['addsub']['c1'][1])} | {us(echo['small'][1])} "
                     f"| {us(tp['addsub']['c1'][1])} | |")
        lines.append(f"| identity 16 MiB p50, c=1, {t} | {us(ip['identity16']['c1'][0])} | {us(echo['16MiB'][0])} "
                     f"| {us(tp['identity16']['c1'][0])} | {tp['identity16']['c1'][0] / echo['16MiB'][0]:.2f}x |")
        lines.append(f"| identity 16 MiB p99, c=1, {t} | {us(ip['identity16']['c1'][1])} | {us(echo['16MiB'][1])} "
                     f"| {us(tp['identity16']['c1'][1])} | |")
        lines.append(f"| add/sub throughput, c=8, {t} | {ip['addsub']['c8']:,.0f}/s | "
                     f"| {tp['addsub']['c8']:,.0f}/s | |")
        lines.append(f"| identity 16 MiB throughput, c=8, {t} | {ip['identity16']['c8']:,.1f}/s | "
                     f"| {tp['identity16']['c8']:,.1f}/s | |")
    if "gateways" in r:
        lines += render_gateways(r["gateways"], us, r.get("torchpool_ipc"))
    if "local" in r:
        lines += render_local(r["local"], us)
    if "batching" in r:
        lines += render_batching(r["batching"], us)
    if "sequences" in r:
        lines += render_sequences(r["sequences"])
    return lines


if __name__ == "__main__":
    sys.exit(main())
