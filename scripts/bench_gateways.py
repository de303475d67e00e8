"""Benchmark section for the KServe v2 HTTP and gRPC endpoints (imported by bench.py).

Every figure comes from the real `tritonclient` (tritonclient.http with
binary tensors in and out, tritonclient.grpc with raw contents), one client
per thread, inputs built once per client (as perf_analyzer does):

  * tiny add/sub (2x[1,16] FP32) p50/p99 at concurrency 1, and the CPU each
    process spent per request meanwhile (/proc/<pid>/task/*/schedstat: the
    client, i.e. this process, the gateway, the broker and the workers);
  * add/sub throughput at concurrency 8 (8 threads, closed loop);
  * a 16 MiB FP32 identity, p50/p99 at concurrency 1.

The baselines of issue 40's goal (each gateway <= 1.5x a minimal server in
its framework returning the same answer with no daemon behind it) are
measured beside them with the same client code: gateway_echo.py's grpcio
aio and httptools-on-asyncio servers, each in its own process, add/sub only.

PyTriton (Triton's C++ HTTP/gRPC frontends + its Python backend, serving the
same add/sub TorchScript in its own process) is measured beside it with the
same client code when $ANCHORS_VENV_ROOT/base/bin/python can import pytriton
(see ../shared/anchors/README.md). The c=1 loops of all targets run in
alternating rounds, so drift on a noisy machine hits them alike; rounds are
blocks of requests (not single ones), because torchpool's broker keeps polling
for a moment after each request and would otherwise steal a core from the
next target's request.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from bench_timing import percentiles, run_window

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
ANCHORS_DIR = Path(os.environ.get("ANCHORS_DIR", str(ROOT.parent / "shared" / "anchors")))
ROUNDS = 4                      # alternating blocks per c=1 measurement

# what each server calls the models
TORCHPOOL_MODELS = {"addsub": "addsub", "identity": "identity"}
PYTRITON_MODELS = {"addsub": "add_sub"}
ECHO_MODELS = {"addsub": "addsub"}


# ------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat_fields(pid: int) -> Optional[list[str]]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(root: int, session: bool = False) -> list[int]:
    """`root` and its live descendants; with `session`, also every process of
    the session `root` leads (PyTriton's stubs may be reparented)."""
    children: dict[int, list[int]] = {}
    in_session = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is None:
                continue
            children.setdefault(int(f[1]), []).append(int(entry))
            if session and int(f[3]) == root:
                in_session.append(int(entry))
    out: list[int] = []
    todo = [root] + in_session
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo.extend(children.get(p, []))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def torchpool_pids(daemon_pid: int) -> dict[str, list[int]]:
    """The daemon's processes by role: the gateway (its child running
    torchpool.gateway, titled `torchpool gateway ...` when setproctitle is
    installed), the broker (the daemon itself) and the workers (every other
    descendant: the fork server and the model instances; only addsub's works
    during an add/sub loop)."""
    groups: dict[str, list[int]] = {"gateway": [], "broker": [daemon_pid], "workers": []}
    for pid in process_tree(daemon_pid):
        if pid == daemon_pid:
            continue
        cmdline = _cmdline(pid)
        gateway = "torchpool.gateway" in cmdline or cmdline.startswith("torchpool gateway")
        groups["gateway" if gateway else "workers"].append(pid)
    return groups


def pytriton_pids(leader: int) -> dict[str, list[int]]:
    """PyTriton's processes by role: tritonserver, the Python backend stub
    (triton_python_backend_stub) and the Python process running infer_func."""
    groups: dict[str, list[int]] = {"tritonserver": [], "stub": [], "python": []}
    for pid in process_tree(leader, session=True):
        comm = _comm(pid)
        role = "tritonserver" if comm.startswith("tritonserver") else "stub" if comm.startswith("triton_python") \
            else "python"
        groups[role].append(pid)
    return groups


def cpu_ns(pids: list[int]) -> int:
    """Nanoseconds on CPU of every thread of `pids` (schedstat's first field)."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total


# --------------------------------------------------------------- clients

class Caller:
    """One tritonclient and its prepared request; `call()` makes one inference."""

    def __init__(self, protocol: str, port: int, model: str, inputs: dict[str, np.ndarray],
                 outputs: list[str]) -> None:
        if protocol == "http":
            import tritonclient.http as tc
            self.client: Any = tc.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=120.0,
                                                        network_timeout=120.0)
        else:
            import tritonclient.grpc as tc
            self.client = tc.InferenceServerClient(f"127.0.0.1:{port}")
        self.protocol, self.model, self.outputs = protocol, model, outputs
        self.inputs = []
        for name, value in inputs.items():
            i = tc.InferInput(name, list(value.shape), "FP32")
            if protocol == "http":
                i.set_data_from_numpy(value, binary_data=True)
            else:
                i.set_data_from_numpy(value)
            self.inputs.append(i)
        if protocol == "http":
            self.requested = [tc.InferRequestedOutput(n, binary_data=True) for n in outputs]
        else:
            self.requested = [tc.InferRequestedOutput(n) for n in outputs]

    def infer(self) -> dict[str, np.ndarray]:
        if self.protocol == "http":
            r = self.client.infer(self.model, self.inputs, outputs=self.requested)
        else:
            r = self.client.infer(self.model, self.inputs, outputs=self.requested, client_timeout=120.0)
        return {n: r.as_numpy(n) for n in self.outputs}

    def call(self) -> None:
        self.infer()

    def close(self) -> None:
        self.client.close()


A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.ones((1, 16), np.float32)


def addsub_caller(protocol: str, port: int, model: str) -> Caller:
    c = Caller(protocol, port, model, {"INPUT0": A, "INPUT1": B}, ["OUTPUT0", "OUTPUT1"])
    out = c.infer()                    # benchmark right answers only
    if not (np.array_equal(out["OUTPUT0"], A + B) and np.array_equal(out["OUTPUT1"], A - B)):
        raise RuntimeError(f"{model} over {protocol} answered wrong values")
    return c


def identity_caller(protocol: str, port: int, model: str, big: np.ndarray) -> Caller:
    c = Caller(protocol, port, model, {"INPUT__0": big}, ["OUTPUT__0"])
    out = c.infer()["OUTPUT__0"]
    if out.shape != big.shape or out[0] != big[0] or out[-1] != big[-1]:
        raise RuntimeError(f"{model} over {protocol} answered a wrong tensor")
    return c


# ----------------------------------------------------------- measurements

def c1_rounds(targets: dict[str, tuple[Callable[[], None], dict[str, list[int]]]], n: int,
              rounds: int = ROUNDS, warmup: int = 20) -> dict[str, dict]:
    """p50/p99 of `n` calls per target at concurrency 1 and the CPU per
    request of each process group (and of this process, the client), in
    `rounds` alternating blocks."""
    samples: dict[str, list[float]] = {t: [] for t in targets}
    cpu: dict[str, dict[str, int]] = {t: {g: 0 for g in [*groups, "client"]} for t, (_c, groups) in targets.items()}
    me = [os.getpid()]
    for call, _groups in targets.values():
        for _ in range(warmup):
            call()
    per_round = [n // rounds + (1 if i < n % rounds else 0) for i in range(rounds)]
    for k in per_round:
        for t, (call, groups) in targets.items():
            time.sleep(0.005)                      # the previous server's polling ends
            for _ in range(3):
                call()
            before = {g: cpu_ns(p) for g, p in groups.items()}
            client0 = cpu_ns(me)
            mine = samples[t]
            for _ in range(k):
                t0 = time.perf_counter()
                call()
                mine.append(time.perf_counter() - t0)
            client1 = cpu_ns(me)
            after = {g: cpu_ns(p) for g, p in groups.items()}
            for g in groups:
                cpu[t][g] += after[g] - before[g]
            cpu[t]["client"] += client1 - client0
    out = {}
    for t in targets:
        p50, p99 = percentiles(samples[t])
        cpu_us = {g: ns / len(samples[t]) / 1000 for g, ns in cpu[t].items()}
        cpu_us["server"] = sum(v for g, v in cpu_us.items() if g != "client")
        out[t] = {"p50": p50, "p99": p99, "requests": len(samples[t]), "cpu_us": cpu_us}
    return out


def closed_loop(make: Callable[[], Caller], threads: int, seconds: float, pids: dict[str, list[int]]) -> dict:
    """Requests per second with `threads` threads, each with its own client,
    and the CPU per request of the server's processes meanwhile."""
    counts = [0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    stop = [0.0]

    def loop(i: int) -> None:
        # made in its own thread: tritonclient.http's gevent hub belongs to one thread
        caller = None
        try:
            caller = make()
        except BaseException as exc:  # noqa: B036 - reported below
            errors.append(exc)
        start.wait()
        n = 0
        try:
            while caller is not None and time.monotonic() < stop[0]:
                caller.call()
                n += 1
        except BaseException as exc:  # noqa: B036 - reported below, the others finish
            errors.append(exc)
        finally:
            if caller is not None:
                caller.close()
        counts[i] = n

    server = [p for g in pids.values() for p in g]
    before: list[int] = []    # the server's CPU when the window opens

    elapsed = run_window(loop, threads, seconds, start, stop, at_start=lambda: before.append(cpu_ns(server)))
    after = cpu_ns(server)
    if errors:
        raise errors[0]
    total = sum(counts)
    return {"rps": total / elapsed, "requests": total,
            "server_cpu_us": (after - before[0]) / total / 1000 if total else 0.0}


def _guard(results: dict, key: str, fn: Callable[[], Any]) -> None:
    """One failed case is reported as its error; the others still run."""
    try:
        results[key] = fn()
    except Exception as exc:  # noqa: BLE001
        results[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]}
        print(f"  {key}: {results[key]['error']}", flush=True)


def bench_gateways(http_port: int, grpc_port: int, n_small: int, n_big: int, seconds: float,
                   pids: dict[str, list[int]], pytriton: Optional["PyTriton"] = None,
                   echoes: Optional[dict[str, Any]] = None) -> dict:
    """torchpool's HTTP and gRPC endpoints (and PyTriton's, and the echo
    servers', when given).

    `pids`: torchpool's processes by role (torchpool_pids()); `echoes`:
    gateway_echo.EchoProcess by protocol ("http", "grpc"). Returns
    {"torchpool_http": {...}, "torchpool_grpc": {...}[, "echo_http": ...,
    "echo_grpc": ..., "pytriton_http": ..., "pytriton_grpc": ...]}, each with
    "addsub_c1" (p50, p99, cpu_us per process group), "addsub_c8" (rps) and,
    for torchpool, "identity16_c1"."""
    ports = {"torchpool_http": ("http", http_port, TORCHPOOL_MODELS, pids),
             "torchpool_grpc": ("grpc", grpc_port, TORCHPOOL_MODELS, pids)}
    for protocol, echo in (echoes or {}).items():
        ports[f"echo_{protocol}"] = (protocol, echo.port, ECHO_MODELS, {"echo": [echo.pid]})
    if pytriton is not None:
        pt_pids = pytriton.pids()
        ports["pytriton_http"] = ("http", pytriton.http_port, PYTRITON_MODELS, pt_pids)
        ports["pytriton_grpc"] = ("grpc", pytriton.grpc_port, PYTRITON_MODELS, pt_pids)
    out: dict[str, dict] = {t: {} for t in ports}
    if pytriton is not None:
        out["pytriton"] = pytriton.settings
    if echoes:
        out["echo"] = {"server": ECHO_SETTINGS}

    # add/sub at c=1, all targets in alternating rounds
    callers: dict[str, Caller] = {}
    for t, (protocol, port, models, _p) in ports.items():
        _guard(out[t], "addsub_c1", lambda: addsub_caller(protocol, port, models["addsub"]))
        if isinstance(out[t]["addsub_c1"], Caller):
            callers[t] = out[t].pop("addsub_c1")
    try:
        measured = c1_rounds({t: (c.call, ports[t][3]) for t, c in callers.items()}, n_small)
        for t, r in measured.items():
            out[t]["addsub_c1"] = r
    except Exception as exc:  # noqa: BLE001
        for t in callers:
            out[t]["addsub_c1"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        print(f"  add/sub c=1: {exc}", flush=True)
    finally:
        for c in callers.values():
            c.close()

    # add/sub throughput at c=8
    for t, (protocol, port, models, group) in ports.items():
        _guard(out[t], "addsub_c8", lambda: closed_loop(
            lambda: addsub_caller(protocol, port, models["addsub"]), 8, seconds, group))

    # 16 MiB identity at c=1 (torchpool's model; PyTriton serves no such model here)
    big = np.ones(4 * MiB, np.float32)
    big[-1] = 2.0
    for t, (protocol, port, models, _g) in ports.items():
        if "identity" not in models:
            continue

        def identity() -> dict:
            c = identity_caller(protocol, port, models["identity"], big)
            try:
                r = c1_rounds({t: (c.call, {})}, n_big, rounds=1, warmup=3)[t]
            finally:
                c.close()
            return {"p50": r["p50"], "p99": r["p99"], "requests": r["requests"]}

        _guard(out[t], "identity16_c1", identity)
    return out


ECHO_SETTINGS = ("scripts/gateway_echo.py, each in its own process on the gateway's event loop: grpcio aio with "
                 "the generated servicer (protobuf parses and writes the whole message) and asyncio.Protocol + "
                 "httptools (json.loads/json.dumps of the header, binary tensors); a+b, a-b with numpy on the "
                 "received bytes; no daemon")


# ---------------------------------------------------------------- PyTriton

def pytriton_python() -> tuple[Optional[str], str]:
    """(the anchors' Python with pytriton, "") or (None, why not)."""
    root = os.environ.get("ANCHORS_VENV_ROOT")
    if not root:
        return None, "ANCHORS_VENV_ROOT is not set (setup_venvs.sh installs into ~/anchors-venv by default)"
    py = Path(root) / "base" / "bin" / "python"
    if not py.exists():
        return None, f"{py} does not exist"
    if not (ANCHORS_DIR / "pytriton_server.py").exists():
        return None, f"{ANCHORS_DIR}/pytriton_server.py does not exist"
    r = subprocess.run([str(py), "-c", "import pytriton"], capture_output=True, timeout=120)
    if r.returncode != 0:
        return None, f"{py} cannot import pytriton"
    return str(py), ""


class PyTriton:
    """PyTriton serving the anchors' add_sub TorchScript (the server and the
    model builder are ../shared/anchors' own scripts, run unchanged)."""

    def __init__(self, python: str, work: Path) -> None:
        self.python = python
        self.model_dir = work / "anchor-models"
        subprocess.run([python, str(ANCHORS_DIR / "models.py"), "--out", str(self.model_dir)],
                       check=True, cwd=ANCHORS_DIR, stdout=subprocess.DEVNULL, timeout=300)
        self.http_port, self.grpc_port, metrics_port = free_port(), free_port(), free_port()
        self.log_path = work / "pytriton.log"
        self._log = open(self.log_path, "wb")
        cmd = [python, str(ANCHORS_DIR / "pytriton_server.py"), "--models", PYTRITON_MODELS["addsub"],
               "--model-dir", str(self.model_dir), "--http-port", str(self.http_port),
               "--grpc-port", str(self.grpc_port), "--metrics-port", str(metrics_port)]
        self.proc = subprocess.Popen(cmd, cwd=ANCHORS_DIR, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.settings = {"server": "PyTriton (anchors' pytriton_server.py): tritonserver -> Python backend stub "
                                   "-> infer_func in PyTriton's process; max_batch_size 8, no queue delay, "
                                   "1 torch thread"}

    def wait_ready(self, timeout: float = 300) -> float:
        import tritonclient.http as tc

        t0 = time.monotonic()
        probe = tc.InferenceServerClient(f"127.0.0.1:{self.http_port}")
        try:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"PyTriton exited ({self.proc.returncode}); see {self.log_path}")
                try:
                    if probe.is_server_ready() and probe.is_model_ready(PYTRITON_MODELS["addsub"]):
                        self.settings["tritonserver"] = probe.get_server_metadata().get("version")
                        return time.monotonic() - t0
                except Exception:  # noqa: BLE001 - not up yet
                    pass
                time.sleep(0.25)
        finally:
            probe.close()
        raise RuntimeError(f"PyTriton not ready in {timeout:.0f} s; see {self.log_path}")

    def pids(self) -> dict[str, list[int]]:
        return pytriton_pids(self.proc.pid)

    def stop(self, timeout: float = 90) -> None:
        """SIGINT to the leader (PyTriton stops tritonserver, its stubs and its
        shared-memory manager); SIGKILL to the session after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self._log.close()


# ------------------------------------------------------------------ report

ROLES = [("client", "client (tritonclient, this process)"),
         ("gateway", "torchpool gateway"), ("broker", "torchpool broker"), ("workers", "torchpool add/sub worker"),
         ("tritonserver", "PyTriton: tritonserver"), ("stub", "PyTriton: Python backend stub"),
         ("python", "PyTriton: Python process (infer_func)"),
         ("echo", "echo server (gateway_echo.py)"),
         ("server", "all server processes")]
COLUMNS = ["torchpool_http", "torchpool_grpc", "echo_http", "echo_grpc", "pytriton_http", "pytriton_grpc"]
NAMES = {"torchpool_http": "torchpool HTTP", "torchpool_grpc": "torchpool gRPC", "echo_http": "echo HTTP",
         "echo_grpc": "echo gRPC", "pytriton_http": "PyTriton HTTP", "pytriton_grpc": "PyTriton gRPC"}


def _get(r: dict, *keys: str) -> Any:
    for k in keys:
        if not isinstance(r, dict) or k not in r:
            return None
        r = r[k]
    return r


def render_gateways(r: dict, us: Callable[[float], str], zmq: Optional[dict] = None) -> list[str]:
    """The endpoint rows beside torchpool's ZeroMQ ones (`zmq`: bench.py's
    torchpool_ipc results, inline frames), with the echo servers' and
    PyTriton's when measured, and torchpool's ratios to them."""
    Field = tuple[str, ...]                 # a path in a case's results

    def cell(t: str, case: str, field: Field, fmt: Callable[[float], str]) -> str:
        if t not in r:
            return ""
        if _get(r, t, case, "error"):
            return "error"
        v = _get(r, t, case, *field)
        return "" if v is None else fmt(v)

    def ratio(other: str, case: str, field: Field, label: str = "") -> str:
        """torchpool's figure over `other`'s (echo, pytriton), per protocol."""
        parts = []
        for proto in ("http", "grpc"):
            a, b = _get(r, f"torchpool_{proto}", case, *field), _get(r, f"{other}_{proto}", case, *field)
            if a and b:
                parts.append(f"{'HTTP' if proto == 'http' else 'gRPC'} {a / b:.2f}x")
        return ", ".join(parts) + (f" ({label})" if parts and label else "")

    def row(label: str, zmq_cell: str, case: str, field: Field, fmt: Callable[[float], str],
            echo_label: str = "", pytriton_label: str = "", ratios: bool = True) -> str:
        cells = " | ".join(cell(t, case, field, fmt) for t in COLUMNS)
        tail = (f" | {ratio('echo', case, field, echo_label)} | {ratio('pytriton', case, field, pytriton_label)} |"
                if ratios else " | | |")
        return f"| {label} | {zmq_cell} | {cells}{tail}"

    rps = (lambda v: f"{v:,.0f}/s")
    cpu = (lambda v: f"{v:,.0f} µs")
    z = zmq or {}
    zc = (lambda *k: _get(z, *k))
    lines = ["", "KServe v2 endpoints (tritonclient, binary tensors over HTTP, raw contents over gRPC) beside "
                 "ZeroMQ (ipc, inline frames):", "",
             "| case | torchpool ZeroMQ ipc | " + " | ".join(NAMES[t] for t in COLUMNS)
             + " | torchpool / echo | torchpool / PyTriton |", "|---" * (len(COLUMNS) + 4) + "|"]
    z1 = zc("addsub", "c1")
    lines.append(row("add/sub 2x[1,16] p50, c=1", us(z1[0]) if z1 else "", "addsub_c1", ("p50",), us,
                     "latency, goal <= 1.5x", "latency, goal <= 0.5x"))
    lines.append(row("add/sub p99, c=1", us(z1[1]) if z1 else "", "addsub_c1", ("p99",), us, "latency", "latency"))
    lines.append(row("add/sub server CPU per request, c=1", "", "addsub_c1", ("cpu_us", "server"), cpu,
                     "CPU", "CPU"))
    z8 = zc("addsub", "c8")
    lines.append(row("add/sub throughput, c=8", rps(z8) if z8 else "", "addsub_c8", ("rps",), rps,
                     "throughput, goal >= 0.67x", "throughput"))
    lines.append(row("add/sub server CPU per request, c=8", "", "addsub_c8", ("server_cpu_us",), cpu, "CPU", "CPU"))
    zi = zc("identity16", "c1")
    for i, field in enumerate(("p50", "p99")):
        lines.append(row(f"identity 16 MiB {field}, c=1", us(zi[i]) if zi else "", "identity16_c1", (field,), us,
                         ratios=False))
    present = [t for t in COLUMNS if t in r]
    lines += ["", "add/sub at c=1: CPU per request, by process (µs, from /proc/*/task/*/schedstat):", "",
              "| process | " + " | ".join(NAMES[t] for t in present) + " |", "|---" * (len(present) + 1) + "|"]
    for role, label in ROLES:
        vals = [_get(r, t, "addsub_c1", "cpu_us", role) for t in present]
        if all(v is None for v in vals):
            continue
        lines.append(f"| {label} | " + " | ".join("" if v is None else f"{v:,.1f}" for v in vals) + " |")
    tot = [_get(r, t, "addsub_c1", "cpu_us") for t in present]
    lines.append("| all, client included | " + " | ".join(
        f"{v['server'] + v['client']:,.1f}" if v else "" for v in tot) + " |")
    errors = [f"{NAMES[t]}, {case}: {v['error']}" for t in present for case, v in r[t].items()
              if isinstance(v, dict) and "error" in v]
    if errors:
        lines += ["", "errors:"] + [f"  {e}" for e in errors]
    if "echo_skipped" in r:
        lines += ["", f"echo servers not measured: {r['echo_skipped']}"]
    elif "echo" in r:
        lines += ["", f"echo servers: {r['echo'].get('server', '')}"]
    if "pytriton_skipped" in r:
        lines += ["", f"PyTriton not measured: {r['pytriton_skipped']}"]
    elif "pytriton" in r:
        lines += ["", f"PyTriton {r['pytriton'].get('tritonserver', '')}: {r['pytriton'].get('server', '')}"]
    return lines
