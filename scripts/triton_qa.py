"""Triton's own client QA (qa/L0_infer) against torchpool's HTTP and gRPC endpoints.

  Triton server tree (checkout, extracted tree, or bare git repository)
      │ copy qa/common + qa/L0_infer into a temporary directory
      ▼
  gen_qa_models.py --libtorch ─► qa_model_repository/libtorch*   (TorchScript add/sub models)
      │ L0_infer/test.sh's generate_model_repository for BACKENDS=libtorch, TARGET=cpu
      ▼
  models/  ─► for each configuration (no shared memory, system shared memory):
                torchpool serve --http-port 8000 --grpc-port 8001
                python infer_test.py -v      (the environment test.sh sets)
                stop the daemon, check nothing of it is left
  summary; exit 1 if a run failed or ran another number of tests than test.sh expects

Left out, as test.sh leaves them out for BACKENDS=libtorch ENSEMBLES=0:
ensembles (torchpool has none), CUDA shared memory (no GPU; torchpool
refuses it as a Triton without GPUs does), the GPU target, valgrind.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
QA_DIRS = ("qa/common", "qa/L0_infer")

# test.sh's EXPECTED_NUM_TESTS is 46 / 33 with ensembles; infer_test.py defines
# its 5 ensemble tests (4 under shared memory) only when ENSEMBLES=1, so with
# ENSEMBLES=0: 24 raw + 6 class + 6 mix + 5 version tests = 41, and 29 under
# shared memory (infer_test.py: "shared memory does not support class output").
CONFIGURATIONS = {
    "no-shm": ({"TEST_SYSTEM_SHARED_MEMORY": "0"}, 41),
    "system-shm": ({"TEST_SYSTEM_SHARED_MEMORY": "1"}, 29),
}

# What test.sh exports for this run (the backend list and switches it reads),
# for a CPU-only machine: TRITON_SERVER_CPU_ONLY only makes infer_test.py skip
# TensorRT models, which BACKENDS=libtorch excludes anyway.
QA_ENVIRONMENT = {
    "BACKENDS": "libtorch", "ENSEMBLES": "0", "NOBATCH": "1", "BATCH": "1",
    "TEST_CUDA_SHARED_MEMORY": "0", "TEST_VALGRIND": "0", "VALGRIND_TESTS": "0",
    "TRITON_SERVER_CPU_ONLY": "1", "SERVER_LAUNCH_MODE": "triton",
    "USE_HTTP": "1", "USE_GRPC": "1", "TRITONSERVER_IPADDR": "localhost",
}

# tritonclient.utils.shared_memory regions infer_util.py creates (as /dev/shm/<name>)
QA_SHM_REGIONS = ("input0", "input1", "output0", "output1")

UNITTEST_LINE = re.compile(r"^(test_\w+) \([\w.]+\) \.\.\. (ok|FAIL|ERROR|skipped\b.*|expected failure"
                           r"|unexpected success)$", re.M)


class QaError(Exception):
    """A setup step failed; the message says which and what to do."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/triton-qa",
        description="Run Triton's qa/L0_infer (raw, class and mix tests with the libtorch models "
                    "of gen_qa_models.py) against torchpool's KServe v2 HTTP and gRPC endpoints.")
    p.add_argument("--triton-server", required=True, type=Path, metavar="DIR",
                   help="Triton server source: a checkout or extracted tree holding qa/, "
                        "or a bare git repository (then --triton-ref is extracted)")
    p.add_argument("--triton-ref", default="HEAD",
                   help="commit or branch to extract when DIR is a bare git repository (default HEAD)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="HTTP port (default 8000, Triton's; L0_infer hardcodes 8000, so another "
                        "port is written into the temporary copy of infer_util.py/shm_util.py)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001, Triton's)")
    p.add_argument("--config", action="append", choices=sorted(CONFIGURATIONS), dest="configs",
                   help="run only this configuration; repeatable (default: all)")
    p.add_argument("--test", action="append", dest="tests", metavar="NAME",
                   help="run only this test of infer_test.py, e.g. InferTest.test_raw_fff; "
                        "repeatable (the expected test count is then not checked)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for one run of infer_test.py")
    p.add_argument("--ready-timeout", type=float, default=600,
                   help="seconds for the daemon to load every model and answer on both ports")
    p.add_argument("--log-dir", type=Path,
                   help="keep the daemon and client logs here (the temporary directory is removed)")
    args = p.parse_args(argv)
    for flag in ("http_port", "grpc_port"):
        if not 0 < getattr(args, flag) < 65536:
            p.error(f"--{flag.replace('_', '-')} must be a TCP port (1-65535)")
    if args.http_port == args.grpc_port:
        p.error("--http-port and --grpc-port must differ")
    args.configs = args.configs or list(CONFIGURATIONS)
    return args


# ------------------------------------------------------------------ the QA sources

def extract_qa(source: Path, ref: str, dest: Path) -> str:
    """Copy Triton's qa/common and qa/L0_infer into dest/qa; return a description of
    where they came from (with the commit when there is one)."""
    source = source.resolve()
    if (source / "qa").is_dir():
        for sub in QA_DIRS:
            if not (source / sub).is_dir():
                raise QaError(f"{source / sub} is missing: --triton-server must hold Triton's qa/ tree")
            shutil.copytree(source / sub, dest / sub)
        # a checkout names its commit; an extracted tree (maybe inside another repository) does not
        commit = _git(["-C", str(source), "rev-parse", "--short", "HEAD"]) if (source / ".git").exists() else ""
        return f"{source}" + (f" at {commit}" if commit else "")
    commit = _git(["--git-dir", str(source), "rev-parse", "--short", f"{ref}^{{commit}}"])
    if not commit:
        raise QaError(f"{source} holds no qa/ directory and is not a git repository with {ref!r}")
    archive = subprocess.run(["git", "--git-dir", str(source), "archive", "--format=tar", ref, *QA_DIRS],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise QaError(f"git archive {ref} {' '.join(QA_DIRS)} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return f"{source} at {commit}"


def _git(args: list[str]) -> str:
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def point_at_ports(common: Path, http_port: int, grpc_port: int) -> None:
    """infer_util.py and shm_util.py hardcode localhost:8000 and :8001; another
    port is written into our temporary copy (the only edit made to Triton's QA)."""
    for name, old, new in (("infer_util.py", 8000, http_port), ("infer_util.py", 8001, grpc_port),
                           ("shm_util.py", 8000, http_port)):
        if old == new:
            continue
        path = common / name
        text = path.read_text()
        if f'}}:{old}"' not in text:
            raise QaError(f"{path} no longer hardcodes :{old}; cannot move it to port {new}")
        path.write_text(text.replace(f'}}:{old}"', f'}}:{new}"'))


def build_repository(qa: Path, work: Path) -> list[str]:
    """gen_qa_models.py --libtorch, then what test.sh's generate_model_repository
    does for BACKENDS=libtorch on the cpu target; return the model names."""
    generated = work / "qa_model_repository"
    log = work / "gen_qa_models.log"
    with open(log, "wb") as out:
        r = subprocess.run([sys.executable, "gen_qa_models.py", "--libtorch", f"--models_dir={generated}"],
                           cwd=qa / "common", stdout=out, stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        raise QaError(f"gen_qa_models.py --libtorch failed (exit {r.returncode}):\n{_tail(log, 30)}")
    models = work / "models"
    models.mkdir()
    names = sorted(d.name for d in generated.glob("libtorch*") if d.is_dir())
    if not names:
        raise QaError(f"gen_qa_models.py --libtorch made no libtorch* model in {generated}")
    for name in names:
        shutil.copytree(generated / name, models / name)
        # test.sh: echo "instance_group [ { kind: ${KIND} }]" >> $MC, KIND_CPU for TARGET=cpu
        with open(models / name / "config.pbtxt", "a") as config:
            config.write("instance_group [ { kind: KIND_CPU }]\n")
    return names


# ------------------------------------------------------------------ the daemon

def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return s.connect_ex(("127.0.0.1", port)) == 0      # someone answers there


def http_json(port: int, path: str, method: str = "GET") -> object:
    data = b"{}" if method == "POST" else None
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                                       method=method), timeout=10) as r:
        return json.loads(r.read() or b"null")


class ServedRepository:
    """`torchpool serve` on the QA's ports, in its own session so that nothing it
    starts outlives stop()."""

    def __init__(self, models: Path, work: Path, http_port: int, grpc_port: int, log: Path) -> None:
        self.http_port, self.grpc_port, self.log = http_port, grpc_port, log
        args = [sys.executable, "-m", "torchpool", "serve", "--model-repository", str(models),
                "--listen", f"ipc://{work}/torchpool.sock",
                "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, models: list[str], timeout: float) -> None:
        import tritonclient.grpc as grpcclient
        deadline = time.monotonic() + timeout
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        try:
            while not self._ready(grpc):
                if self.proc.poll() is not None:
                    raise QaError(f"torchpool serve exited with {self.proc.returncode}:\n{_tail(self.log, 30)}")
                if time.monotonic() > deadline:
                    raise QaError(f"torchpool not ready on ports {self.http_port}/{self.grpc_port} "
                                  f"after {timeout:.0f} s:\n{_tail(self.log, 30)}")
                time.sleep(0.2)
        finally:
            grpc.close()
        index = http_json(self.http_port, "/v2/repository/index", "POST")
        ready = {m["name"] for m in index if m.get("state") == "READY"}
        missing = [m for m in models if m not in ready]
        if missing:
            raise QaError(f"models not READY: {', '.join(missing)}\n{_tail(self.log, 30)}")

    def _ready(self, grpc: object) -> bool:
        """The broker has loaded the repository and both gateway ports answer."""
        if "torchpool ready" not in self.log.read_text(errors="replace"):
            return False
        try:
            http_json(self.http_port, "/v2/health/ready")
            return bool(grpc.is_server_ready())
        except Exception:       # refused (OSError) or InferenceServerException until the ports are up
            return False

    def request_counts(self) -> tuple[int, int, int]:
        """(successful requests, failed requests, models that answered) from /v2/models/stats."""
        stats = http_json(self.http_port, "/v2/models/stats")["model_stats"]
        success = [s["inference_stats"]["success"]["count"] for s in stats]
        fail = [s["inference_stats"]["fail"]["count"] for s in stats]
        return sum(success), sum(fail), sum(1 for n in success if n)

    def stop(self, timeout: float = 60) -> list[int]:
        """SIGTERM, then SIGKILL to the whole session if it does not stop in time;
        return the pids of its session still alive afterwards (a leak)."""
        session = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(session, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        # its fork server and workers exit just after it: give them a moment
        deadline = time.monotonic() + 10
        while (left := session_members(session)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return left


def session_members(session: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(int(entry))
    return found


# ------------------------------------------------------------------ one run

@dataclass
class RunResult:
    config: str
    expected: Optional[int]
    ran: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    requests: tuple[int, int, int] = (0, 0, 0)
    problems: list[str] = field(default_factory=list)
    not_ok: list[str] = field(default_factory=list)
    report: str = ""

    @property
    def passed(self) -> int:
        return self.ran - self.failures - self.errors - self.skipped

    @property
    def ok(self) -> bool:
        return (not self.problems and self.ran > 0 and not self.failures and not self.errors
                and (self.expected is None or self.ran == self.expected))


def run_infer_test(qa: Path, config: str, tests: Optional[list[str]], timeout: float, logs: Path) -> RunResult:
    """python infer_test.py -v, as test.sh runs it, with stdout (tritonclient's verbose
    request dumps) and stderr (unittest's report) kept apart."""
    env_extra, expected = CONFIGURATIONS[config]
    result = RunResult(config, None if tests else expected)
    env = {**os.environ, **QA_ENVIRONMENT, **env_extra}
    out, err = logs / f"client.{config}.log", logs / f"unittest.{config}.log"
    t0 = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e, \
            subprocess.Popen([sys.executable, "infer_test.py", "-v", *(tests or [])], cwd=qa / "L0_infer",
                             env=env, stdout=o, stderr=e, start_new_session=True) as proc:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            result.problems.append(f"infer_test.py still running after {timeout:.0f} s; killed")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result.seconds = time.monotonic() - t0
    parse_unittest(err.read_text(errors="replace"), result)
    if proc.returncode != 0 and not (result.failures or result.errors or result.problems):
        result.problems.append(f"infer_test.py exited with {proc.returncode}")
    return result


def parse_unittest(text: str, result: RunResult) -> None:
    """Counts from unittest's closing lines ('Ran N tests', 'FAILED (failures=1, ...)');
    the names of tests that were not ok from its -v lines; the failure report."""
    ran = re.search(r"^Ran (\d+) tests? in", text, re.M)
    if not ran:
        result.problems.append("no unittest summary ('Ran N tests'); see the unittest log")
        result.report = text[-4000:]
        return
    result.ran = int(ran.group(1))
    verdict = text[ran.end():]
    for key in ("failures", "errors", "skipped"):
        m = re.search(rf"\b{key}=(\d+)", verdict)
        setattr(result, key, int(m.group(1)) if m else 0)
    result.not_ok = [f"{name}: {status}" for name, status in UNITTEST_LINE.findall(text) if status != "ok"]
    start = text.find("\n" + "=" * 70)
    if start >= 0:
        result.report = text[start:ran.start()]


def leftover_regions(before: set[str]) -> list[str]:
    """The QA's own /dev/shm regions that appeared during the run and are still there."""
    return [n for n in QA_SHM_REGIONS if n not in before and Path("/dev/shm", n).exists()]


def run_configuration(args: argparse.Namespace, qa: Path, work: Path, models: list[str],
                      config: str) -> RunResult:
    for port in (args.http_port, args.grpc_port):
        if port_in_use(port):
            raise QaError(f"port {port} is in use (another server?); free it or pass "
                          f"--http-port/--grpc-port (the QA's copy is then pointed there)")
    shm_before = set(os.listdir("/dev/shm"))
    daemon = ServedRepository(work / "models", work, args.http_port, args.grpc_port,
                              work / f"torchpool.{config}.log")
    result = RunResult(config, None)
    try:
        daemon.wait_ready(models, args.ready_timeout)
        result = run_infer_test(qa, config, args.tests, args.timeout, work)
        result.requests = daemon.request_counts()
    except QaError as e:
        result.problems.append(str(e))
    finally:
        left = daemon.stop()
        if left:
            result.problems.append(f"torchpool processes left after stop (killed): {left}")
        for name in leftover_regions(shm_before):
            os.unlink(Path("/dev/shm", name))
            result.problems.append(f"/dev/shm/{name} left by the run (removed)")
    return result


# ------------------------------------------------------------------ summary

def summary(results: list[RunResult], source: str) -> str:
    lines = [f"Triton qa/L0_infer against torchpool ({source}; "
             "BACKENDS=libtorch ENSEMBLES=0, TARGET=cpu)",
             f"{'configuration':<14}{'ran':>5}{'expected':>10}{'passed':>8}{'failed':>8}{'errors':>8}"
             f"{'skipped':>9}{'requests':>10}{'models':>8}{'time':>8}"]
    for r in results:
        ok_requests, failed_requests, models = r.requests
        lines.append(f"{r.config:<14}{r.ran:>5}{r.expected if r.expected is not None else '-':>10}"
                     f"{r.passed:>8}{r.failures:>8}{r.errors:>8}{r.skipped:>9}{ok_requests:>10}"
                     f"{models:>8}{r.seconds:>7.0f}s")
    lines.append("requests: inferences the daemon answered successfully in that run "
                 "(failed inferences are tests' expected errors or bugs)")
    for r in results:
        if r.requests[1]:
            lines.append(f"  {r.config}: {r.requests[1]} inference(s) answered with an error")
        for item in r.not_ok + r.problems:
            lines.append(f"  {r.config}: {item}")
        if r.expected is not None and r.ran and r.ran != r.expected:
            lines.append(f"  {r.config}: ran {r.ran} tests, test.sh's count for this setup is {r.expected}")
    lines.append("PASSED" if results and all(r.ok for r in results) else "FAILED")
    return "\n".join(lines)


def _tail(path: Path, n: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)      # unwind through every finally: daemon stopped, temp dir removed


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    work = Path(tempfile.mkdtemp(prefix="torchpool-triton-qa-"))
    results: list[RunResult] = []
    source = str(args.triton_server)
    try:
        source = extract_qa(args.triton_server, args.triton_ref, work)
        qa = work / "qa"
        point_at_ports(qa / "common", args.http_port, args.grpc_port)
        models = build_repository(qa, work)
        print(f"{len(models)} libtorch models from gen_qa_models.py; running {', '.join(args.configs)}",
              flush=True)
        for config in args.configs:
            result = run_configuration(args, qa, work, models, config)
            results.append(result)
            if not result.ok and result.report:
                print(f"--- {config}: unittest's report (first 200 lines)\n"
                      + "\n".join(result.report.splitlines()[:200]), flush=True)
    except QaError as e:
        print(f"triton-qa: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy(log, args.log_dir / log.name)
        shutil.rmtree(work, ignore_errors=True)
    print(summary(results, source))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
