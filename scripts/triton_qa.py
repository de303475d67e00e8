"""Triton's own client QA (qa/L0_infer, qa/L0_batcher, qa/L0_sequence_batcher,
qa/L0_shared_memory, qa/L0_lifecycle, qa/L0_implicit_state, and of qa/L0_http and
qa/L0_grpc the Python client tests) against torchpool's HTTP and gRPC endpoints.

  Triton server tree (checkout, extracted tree, or bare git repository)
      │ copy qa/common + the suite's qa/L0_* into a temporary directory
      ▼
  qa/common/gen_qa_*.py --libtorch ─► TorchScript models
      │ what the suite's test.sh does for BACKENDS=libtorch, TARGET=cpu:
      │ which models, which config edits
      ▼
  model repositories ─► for each run test.sh makes (a configuration of L0_infer,
                        or one batcher test against one repository):
                torchpool serve --http-port 8000 --grpc-port 8001   (test.sh's exports)
                python <the suite's test>.py -v [Test.test_x]        (the same exports)
                stop the daemon, check nothing of it is left
  summary; exit 1 if a run failed or ran another number of tests than test.sh expects

What each suite leaves out, and why, is in docs/triton-qa.md (in short: other
backends, ensembles, CUDA shared memory, the GPU target, valgrind). On a CPU
host every KIND_GPU instance group of a generated model is made KIND_CPU.
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
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent

# test.sh's EXPECTED_NUM_TESTS is 46 / 33 with ensembles; infer_test.py defines
# its 5 ensemble tests (4 under shared memory) only when ENSEMBLES=1, so with
# ENSEMBLES=0: 24 raw + 6 class + 6 mix + 5 version tests = 41, and 29 under
# shared memory (infer_test.py: "shared memory does not support class output").
CONFIGURATIONS = {
    "no-shm": ({"TEST_SYSTEM_SHARED_MEMORY": "0"}, 41),
    "system-shm": ({"TEST_SYSTEM_SHARED_MEMORY": "1"}, 29),
}

# What every test.sh exports for this run on a CPU-only machine: the backend
# list and the switches the QA reads. TRITON_SERVER_CPU_ONLY only makes the
# QA skip TensorRT models, which BACKENDS=libtorch excludes anyway.
QA_ENVIRONMENT = {
    "BACKENDS": "libtorch", "ENSEMBLES": "0", "TEST_CUDA_SHARED_MEMORY": "0", "TEST_VALGRIND": "0",
    "VALGRIND_TESTS": "0", "TRITON_SERVER_CPU_ONLY": "1", "SERVER_LAUNCH_MODE": "triton",
    "USE_HTTP": "1", "USE_GRPC": "1", "TRITONSERVER_IPADDR": "localhost",
}

# The two variables test.sh exports to delay Triton's schedulers (and that the
# tests check are set, or unset); never inherited from the caller's shell.
DELAY_VARIABLES = ("TRITONSERVER_DELAY_SCHEDULER", "TRITONSERVER_BACKLOG_DELAY_SCHEDULER")

# the system shared-memory regions the QA makes (tritonclient.utils.shared_memory
# keys, as /dev/shm/<name>): input0, output1, ip00, op10_data, and L0_shared_memory's
# input0_data, dummy_data, shmtest ...
QA_SHM_REGION = re.compile(r"^(?:input|output)\d*(?:_data)?$|^(?:ip|op)\d+(?:_data)?$|^dummy_data$|^shmtest$")

UNITTEST_LINE = re.compile(r"^(test_\w+) \([\w.]+\) \.\.\. (ok|FAIL|ERROR|skipped\b.*|expected failure"
                           r"|unexpected success)$", re.M)


class QaError(Exception):
    """A setup step failed; the message says which and what to do."""


# ------------------------------------------------------------------ the suites

@dataclass
class Case:
    """One run of a suite's test file against a daemon started for it."""
    name: str                       # what the summary calls it
    repository: str                 # the folder (under the work directory) the daemon serves
    tests: list[str]                # unittest names given to the test file (none: all of it)
    env: dict[str, str]             # what test.sh exports for this run, daemon and client
    expected: Optional[int]         # tests the run must count (None: not checked)
    serve_args: list[str] = field(default_factory=list)   # test.sh's SERVER_ARGS beyond the repository
    test_file: Optional[str] = None  # under qa/, when not the suite's
    # test.sh's steps before it starts the server for this run (rm -fr models; cp -r ...),
    # given the work directory; for suites whose test edits its repository in place
    setup: Optional[Callable[[Path], None]] = None
    # lines test.sh greps the server's log for after the run (`grep -c "..." $SERVER_LOG`)
    log_expect: tuple[str, ...] = ()


@dataclass
class Suite:
    name: str
    test_file: str                  # under qa/, run from its folder
    test_class: str                 # the unittest class --test names are in
    # files under qa/ that hardcode Triton's ports, with the ports each one names
    port_files: dict[str, tuple[int, ...]]
    build: Callable[[Path, Path], dict[str, list[str]]]   # (qa, work) -> repository -> its models
    cases: Callable[[list[str]], list[Case]]              # the configurations -> the runs
    environment: dict[str, str]     # what test.sh exports for every run of the suite
    default_configs: tuple[str, ...]
    description: str
    # other folders of Triton's tree the suite's repositories are built from
    extra_dirs: tuple[str, ...] = ()

    @property
    def qa_dirs(self) -> tuple[str, ...]:
        return ("qa/common", f"qa/{self.name}", *self.extra_dirs)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/triton-qa",
        description="Run one of Triton's own QA suites (qa/L0_infer, qa/L0_batcher, "
                    "qa/L0_sequence_batcher, qa/L0_shared_memory, qa/L0_http, qa/L0_grpc, qa/L0_lifecycle, "
                    "qa/L0_implicit_state) with the "
                    "libtorch models of its generators against torchpool's KServe v2 HTTP and gRPC "
                    "endpoints.")
    p.add_argument("--triton-server", required=True, type=Path, metavar="DIR",
                   help="Triton server source: a checkout or extracted tree holding qa/, "
                        "or a bare git repository (then --triton-ref is extracted)")
    p.add_argument("--triton-ref", default="HEAD",
                   help="commit or branch to extract when DIR is a bare git repository (default HEAD)")
    p.add_argument("--suite", default="L0_infer", choices=sorted(SUITES),
                   help="which of Triton's QA suites to run (default L0_infer)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="HTTP port (default 8000, Triton's; the QA hardcodes 8000, so another "
                        "port is written into the temporary copy of its files)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001, Triton's)")
    p.add_argument("--config", action="append", choices=sorted(CONFIGURATIONS), dest="configs",
                   help="run only this configuration; repeatable (default: both for L0_infer, "
                        "no-shm for the batcher suites, as their test.sh runs by default)")
    p.add_argument("--test", action="append", dest="tests", metavar="NAME",
                   help="run only this test, e.g. InferTest.test_raw_fff, test_backlog (every run "
                        "test.sh makes of it) or test_backlog.models1 (one run); repeatable "
                        "(L0_infer's test count is then not checked)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for one run of the test file")
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
    args.configs = args.configs or list(SUITES[args.suite].default_configs)
    return args


# ------------------------------------------------------------------ the QA sources

def extract_qa(source: Path, ref: str, dest: Path, dirs: tuple[str, ...] = ("qa/common", "qa/L0_infer")) -> str:
    """Copy Triton's qa/ folders `dirs` into dest/qa; return a description of
    where they came from (with the commit when there is one)."""
    source = source.resolve()
    if (source / "qa").is_dir():
        for sub in dirs:
            if not (source / sub).is_dir():
                raise QaError(f"{source / sub} is missing: --triton-server must hold Triton's qa/ tree")
            shutil.copytree(source / sub, dest / sub)
        # a checkout names its commit; an extracted tree (maybe inside another repository) does not
        commit = _git(["-C", str(source), "rev-parse", "--short", "HEAD"]) if (source / ".git").exists() else ""
        return f"{source}" + (f" at {commit}" if commit else "")
    commit = _git(["--git-dir", str(source), "rev-parse", "--short", f"{ref}^{{commit}}"])
    if not commit:
        raise QaError(f"{source} holds no qa/ directory and is not a git repository with {ref!r}")
    archive = subprocess.run(["git", "--git-dir", str(source), "archive", "--format=tar", ref, *dirs],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        raise QaError(f"git archive {ref} {' '.join(dirs)} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return f"{source} at {commit}"


def _git(args: list[str]) -> str:
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


def point_at_ports(qa: Path, http_port: int, grpc_port: int,
                   files: Optional[dict[str, tuple[int, ...]]] = None) -> None:
    """The QA hardcodes localhost:8000 and :8001; another port is written into
    our temporary copy of the files that name them (the only edit ever made to
    Triton's QA). `files`: path under qa/ -> the ports it names."""
    files = files if files is not None else SUITES["L0_infer"].port_files
    moves = {8000: http_port, 8001: grpc_port}
    for name, ports in files.items():
        path = qa / name
        text = path.read_text()
        for old in ports:
            new = moves[old]
            if old == new:
                continue
            # f"{host}:8000", host + ":8001" or "localhost:8000"
            pattern = re.compile(rf'(?:(?<=[}}"])|(?<=localhost)):{old}"')
            if not pattern.search(text):
                raise QaError(f"{path} no longer hardcodes :{old}; cannot move it to port {new}")
            text = pattern.sub(f':{new}"', text)
        path.write_text(text)


# ------------------------------------------------------------------ building repositories

def generate(qa: Path, work: Path, script: str, flags: list[str], repository: str) -> Path:
    """Run one of qa/common's model generators into work/<repository> (once)."""
    dest = work / repository
    if dest.is_dir():
        return dest
    log = work / f"{repository}.gen.log"
    with open(log, "wb") as out:
        r = subprocess.run([sys.executable, script, *flags, f"--models_dir={dest}"], cwd=qa / "common",
                           stdout=out, stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        raise QaError(f"{script} {' '.join(flags)} failed (exit {r.returncode}):\n{_tail(log, 30)}")
    return dest


def copy_model(source: Path, repository: Path, name: Optional[str] = None) -> Path:
    """cp -r a generated model into a repository; its config.pbtxt, made fit for
    a CPU host (every KIND_GPU instance group becomes KIND_CPU)."""
    if not (source / "config.pbtxt").is_file():
        raise QaError(f"the generator made no model {source.name} (no {source / 'config.pbtxt'})")
    dest = repository / (name or source.name)
    shutil.copytree(source, dest)
    config = dest / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
    return config


def sed(config: Path, pattern: str, replacement: str, every: bool = False) -> None:
    """sed -i "s/pattern/replacement/[g]" config, as test.sh edits configs:
    the first match on each line (every match with `every`)."""
    lines = config.read_text().split("\n")
    regex = re.compile(pattern)
    config.write_text("\n".join(regex.sub(lambda _m: replacement, line, count=0 if every else 1)
                                for line in lines))


def append(config: Path, text: str) -> None:
    """echo "text" >> config."""
    with open(config, "a") as f:
        f.write(text + "\n")


def _names(*repositories: Path) -> dict[str, list[str]]:
    return {r.name: sorted(d.name for d in r.iterdir() if d.is_dir()) for r in repositories}


def build_infer_repository(qa: Path, work: Path) -> dict[str, list[str]]:
    """L0_infer/test.sh's generate_model_repository for BACKENDS=libtorch on the
    cpu target: every libtorch* model of gen_qa_models.py, with a KIND_CPU group."""
    generated = generate(qa, work, "gen_qa_models.py", ["--libtorch"], "qa_model_repository")
    models = work / "models"
    models.mkdir()
    names = sorted(d.name for d in generated.glob("libtorch*") if d.is_dir())
    if not names:
        raise QaError(f"gen_qa_models.py --libtorch made no libtorch* model in {generated}")
    for name in names:
        # test.sh: echo "instance_group [ { kind: ${KIND} }]" >> $MC, KIND_CPU for TARGET=cpu
        append(copy_model(generated / name, models), "instance_group [ { kind: KIND_CPU }]")
    return {"models": names}


def build_repository(qa: Path, work: Path) -> list[str]:
    """L0_infer's repository (work/models); its model names."""
    return build_infer_repository(qa, work)["models"]


BATCHING = "dynamic_batching { preferred_batch_size: [ 2, 6 ], max_queue_delay_microseconds: 10000000 }"


def build_batcher_repositories(qa: Path, work: Path) -> dict[str, list[str]]:
    """L0_batcher/test.sh's models, preferred_batch_only_models and var_models
    for BACKENDS=libtorch."""
    fixed = generate(qa, work, "gen_qa_models.py", ["--libtorch"], "qa_model_repository")
    variable = generate(qa, work, "gen_qa_models.py", ["--libtorch", "--variable"],
                        "qa_variable_model_repository")
    identity = generate(qa, work, "gen_qa_identity_models.py", ["--libtorch"], "qa_identity_model_repository")
    repositories = [work / "models", work / "preferred_batch_only_models", work / "var_models"]
    for repository, source, batching in zip(repositories, (fixed, fixed, variable),
                                            (BATCHING, "dynamic_batching { preferred_batch_size: [ 4, 6 ] }",
                                             BATCHING)):
        config = copy_model(source / "libtorch_float32_float32_float32", repository)
        sed(config, r"^max_batch_size:.*", "max_batch_size: 8")
        sed(config, r"^version_policy:.*", "version_policy: { specific { versions: [1] }}")
        append(config, batching)
    sed(work / "var_models" / "libtorch_float32_float32_float32" / "config.pbtxt", "16", "-1", every=True)
    # the allow-ragged model (test.sh: "Use nobatch model to match the ragged test requirement"),
    # and Triton's identity-backend model custom_zero_1_float32, which torchpool (PyTorch
    # only) serves with the same TorchScript identity model configured the same way
    for name in ("libtorch_zero_1_float32", "custom_zero_1_float32"):
        config = copy_model(identity / "libtorch_nobatch_zero_1_float32", work / "var_models", name)
        sed(config, "libtorch_nobatch_zero_1_float32", name)
        sed(config, r"^max_batch_size:.*", "max_batch_size: 8")
        sed(config, 'name: "INPUT__0"', 'name: "INPUT__0"\nallow_ragged_batch: true')
        append(config, 'batch_output [{target_name: "OUTPUT__0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
                       'source_input: "INPUT__0" }] ' + BATCHING)
    return _names(*repositories)


# L0_batcher/test.sh's lists, and the TRITONSERVER_DELAY_SCHEDULER each test runs with
BATCHER_NO_DELAY_TESTS = (
    "test_static_batch_preferred", "test_static_batch_lt_any_preferred", "test_static_batch_not_preferred",
    "test_static_batch_gt_max_preferred", "test_multi_batch_not_preferred", "test_multi_batch_gt_max_preferred",
    "test_multi_batch_sum_gt_max_preferred", "test_multi_same_output0", "test_multi_same_output1",
    "test_multi_different_outputs", "test_multi_different_output_order")
BATCHER_DELAY_TESTS = {"test_multi_batch_delayed_sum_gt_max_preferred": 2,
                       "test_multi_batch_use_biggest_preferred": 6,
                       "test_multi_batch_use_best_preferred": 3,
                       "test_multi_batch_delayed_use_max_batch": 3}
BATCHER_DIFFERENT_SHAPE_TESTS = (
    "test_multi_batch_not_preferred_different_shape", "test_multi_batch_preferred_different_shape",
    "test_multi_batch_different_shape_allow_ragged", "test_multi_batch_different_shape")
BATCHER_PREFERRED_ONLY_TESTS = {"test_preferred_batch_only_aligned": 4,
                                "test_preferred_batch_only_unaligned": 5,
                                "test_preferred_batch_only_use_biggest_preferred": 7,
                                "test_preferred_batch_only_use_no_preferred_size": 3}


def _delays(delay: int, backlog: Optional[int] = None) -> dict[str, str]:
    env = {"TRITONSERVER_DELAY_SCHEDULER": str(delay)}
    if backlog is not None:
        env["TRITONSERVER_BACKLOG_DELAY_SCHEDULER"] = str(backlog)
    return env


def _one(suite_class: str, test: str, tag: str, repository: str, env: dict[str, str]) -> Case:
    """One test against a fresh daemon (test.sh: "Need to launch the server for
    each test so that the model status is reset"); check_test_results expects 1."""
    return Case(f"{test}.{tag}", repository, [f"{suite_class}.{test}"], env, 1)


def batcher_cases(configs: list[str]) -> list[Case]:
    cases = []
    for config in configs:
        shm = CONFIGURATIONS[config][0]
        suffix = "" if config == "no-shm" else f".{config}"

        def add(test: str, tag: str, repository: str, env: dict[str, str]) -> None:
            cases.append(_one("BatcherTest", test, tag + suffix, repository, {**shm, **env}))

        for model_type, repository in (("FIXED", "models"), ("VARIABLE", "var_models")):
            for test in BATCHER_NO_DELAY_TESTS:
                add(test, model_type, repository, {"BATCHER_TYPE": model_type})
            for test, delay in BATCHER_DELAY_TESTS.items():
                add(test, model_type, repository, {"BATCHER_TYPE": model_type, **_delays(delay)})
        for test in BATCHER_DIFFERENT_SHAPE_TESTS:
            add(test, "VARIABLE", "var_models", {"BATCHER_TYPE": "VARIABLE"})
        add("test_multi_batch_delayed_preferred_different_shape", "VARIABLE", "var_models",
            {"BATCHER_TYPE": "VARIABLE", **_delays(4)})
        for test, delay in BATCHER_PREFERRED_ONLY_TESTS.items():
            add(test, "PREFERRED_BATCH_ONLY", "preferred_batch_only_models",
                {"BATCHER_TYPE": "FIXED", **_delays(delay)})
    return cases


SEQUENCE_QUEUE_DELAY = ("sequence_batching {\ndirect {\nmax_queue_delay_microseconds: 3000000\n"
                        "minimum_slot_utilization: 0\n}")


def build_sequence_repositories(qa: Path, work: Path) -> dict[str, list[str]]:
    """L0_sequence_batcher/test.sh's models0, models1, models2, models4, modelsv
    and queue_delay_models for BACKENDS=libtorch (int32 and bool controls),
    IMPLICIT_STATE=0, ENSEMBLES=0."""
    fixed = generate(qa, work, "gen_qa_sequence_models.py", ["--libtorch"], "qa_sequence_model_repository")
    variable = generate(qa, work, "gen_qa_sequence_models.py", ["--libtorch", "--variable"],
                        "qa_variable_sequence_model_repository")
    # repository -> (where from, which model, max_batch_size (None: as generated), instances)
    layouts = {"models1": (fixed, "libtorch_sequence_{}", 4, 1),
               "models2": (fixed, "libtorch_sequence_{}", 2, 2),
               "models4": (fixed, "libtorch_sequence_{}", 1, 4),
               "queue_delay_models": (fixed, "libtorch_sequence_{}", 4, 1),
               "models0": (fixed, "libtorch_nobatch_sequence_{}", None, 4),
               "modelsv": (variable, "libtorch_sequence_{}", 4, 1)}
    for repository, (source, pattern, max_batch, count) in layouts.items():
        for dtype in ("int32", "bool"):
            name = pattern.format(dtype)
            config = copy_model(source / name, work / repository)
            if max_batch is not None:
                sed(config, r"^max_batch_size:.*", f"max_batch_size: {max_batch}")
            sed(config, "kind: KIND_CPU", f"kind: KIND_CPU\ncount: {count}")
            if repository != "queue_delay_models":
                continue
            sed(config, "sequence_batching {", SEQUENCE_QUEUE_DELAY)
            for variant, utilization in (("half", "0.5"), ("full", "1")):
                copy = work / repository / f"{name}_{variant}"
                shutil.copytree(config.parent, copy)
                sed(copy / "config.pbtxt", name, f"{name}_{variant}")
                sed(copy / "config.pbtxt", "minimum_slot_utilization: 0", f"minimum_slot_utilization: {utilization}")
    return _names(*(work / r for r in layouts))


# L0_sequence_batcher/test.sh's lists; each delay test's (TRITONSERVER_DELAY_SCHEDULER,
# TRITONSERVER_BACKLOG_DELAY_SCHEDULER)
SEQUENCE_NO_DELAY_TESTS = ("test_simple_sequence", "test_length1_sequence", "test_batch_size",
                           "test_no_sequence_start", "test_no_sequence_start2", "test_no_sequence_end",
                           "test_no_correlation_id")
SEQUENCE_DELAY_TESTS = {"test_backlog_fill": (10, 2), "test_backlog_fill_no_end": (10, 3),
                        "test_backlog_same_correlation_id": (12, 2),
                        "test_backlog_same_correlation_id_no_end": (16, 0),
                        "test_backlog_sequence_timeout": (4, 0), "test_half_batch": (8, 0),
                        "test_skip_batch": (12, 0), "test_full_batch": (12, 0), "test_ragged_batch": (12, 0),
                        "test_backlog": (12, 0)}
SEQUENCE_QUEUE_DELAY_TESTS = ("test_queue_delay_no_min_util", "test_queue_delay_half_min_util",
                              "test_queue_delay_full_min_util")
# MODEL_TRIALS: models<trial> -> (NO_BATCHING, MODEL_INSTANCES, BATCHER_TYPE)
SEQUENCE_TRIALS = {"0": ("1", "4", "FIXED"), "1": ("0", "1", "FIXED"), "2": ("0", "2", "FIXED"),
                   "4": ("0", "4", "FIXED"), "v": ("0", "1", "VARIABLE")}


def sequence_cases(configs: list[str]) -> list[Case]:
    cases = []
    for config in configs:
        shm = CONFIGURATIONS[config][0]
        suffix = "" if config == "no-shm" else f".{config}"
        for trial, (no_batching, instances, batcher_type) in SEQUENCE_TRIALS.items():
            repository = f"models{trial}"
            env = {**shm, "NO_BATCHING": no_batching, "MODEL_INSTANCES": instances, "BATCHER_TYPE": batcher_type}
            for test in SEQUENCE_NO_DELAY_TESTS:
                cases.append(_one("SequenceBatcherTest", test, repository + suffix, repository, env))
            for test, (delay, backlog) in SEQUENCE_DELAY_TESTS.items():
                cases.append(_one("SequenceBatcherTest", test, repository + suffix, repository,
                                  {**env, **_delays(delay, backlog)}))
        # test.sh leaves BATCHER_TYPE=VARIABLE (and MODEL_INSTANCES=1) from its last trial
        # here, under which sequence_batcher_test.py tests no libtorch model at all; FIXED
        # makes these three test the libtorch queue_delay_models
        env = {**shm, "NO_BATCHING": "0", "MODEL_INSTANCES": "1", "BATCHER_TYPE": "FIXED", **_delays(2, 0)}
        for test in SEQUENCE_QUEUE_DELAY_TESTS:
            cases.append(_one("SequenceBatcherTest", test, "queue_delay_models" + suffix,
                              "queue_delay_models", env))
    return cases


# ------------------------------------------------------------------ L0_shared_memory

# Triton's `simple` example model (docs/examples/model_repository/simple: INT32 [16]
# INPUT0/INPUT1 -> OUTPUT0 = sum, OUTPUT1 = difference, max_batch_size 8), which
# L0_shared_memory/test.sh serves from its `models` folder; Triton's is ONNX, so the
# same config is served with a TorchScript module computing the same.
SIMPLE_CONFIG = "docs/examples/model_repository/simple/config.pbtxt"
# torchpool's own `simple` (torchpool/examples.py: AddSub), scripted where torch is
SIMPLE_MODULE = ("import sys, torch\nfrom torchpool.examples import AddSub\n"
                 "torch.jit.save(torch.jit.script(AddSub()), sys.argv[1])\n")

# test_python_client_leak reads the client's resident memory with psutil (test.sh:
# "pip3 install psutil"); where psutil is not installed, this stand-in gives the
# same number from /proc (the test file itself is unchanged).
PSUTIL_SHIM = '''"""Stand-in for the part of psutil Triton's shared_memory_test.py uses (torchpool triton-qa)."""
import collections
import os

_Memory = collections.namedtuple("_Memory", "rss vms")


class Process:
    def memory_info(self):
        with open("/proc/self/statm") as f:
            vms, rss = (int(n) * os.sysconf("SC_PAGE_SIZE") for n in f.read().split()[:2])
        return _Memory(rss, vms)
'''

# L0_shared_memory/test.sh's list of tests run with --allow-client-shm=true, each
# once per client type (CLIENT_TYPE=http, grpc)
SHM_ALLOWED_TESTS = (
    "test_invalid_create_shm", "test_valid_create_set_register", "test_unregister_before_register",
    "test_unregister_after_register", "test_reregister_after_register", "test_unregister_after_inference",
    "test_register_after_inference", "test_too_big_shm", "test_mixed_raw_shm", "test_unregisterall",
    "test_infer_offset_out_of_bound", "test_infer_byte_size_out_of_bound", "test_infer_integer_overflow",
    "test_register_out_of_bound", "test_register_reserved_names", "test_register_invalid_shm_key",
    "test_python_client_leak")
SHM_CLIENT_TYPES = ("http", "grpc")


def build_shared_memory_repositories(qa: Path, work: Path) -> dict[str, list[str]]:
    """L0_shared_memory/test.sh's `models` (Triton's `simple`, here TorchScript) and,
    for test_large_shm_register_offset, its second `models` (rm -rf models/*):
    libtorch_int32_int32_int32 from qa_model_repository (BACKENDS=libtorch)."""
    build_simple(work, "models")
    generated = generate(qa, work, "gen_qa_models.py", ["--libtorch"], "qa_model_repository")
    # test.sh copies version 1 only (cp -r .../${model}/1): the generator's versions 2
    # and 3 of this model swap the outputs (OUTPUT__0 = difference), and its "all"
    # version policy would serve version 3 to the test's latest-version requests
    config = copy_model(generated / "libtorch_int32_int32_int32", work / "offset_models")
    for version in config.parent.iterdir():
        if version.is_dir() and version.name != "1":
            shutil.rmtree(version)
    if subprocess.run([sys.executable, "-c", "import psutil"], capture_output=True, check=False).returncode:
        (work / "shims").mkdir(exist_ok=True)
        (work / "shims" / "psutil.py").write_text(PSUTIL_SHIM)
    return _names(work / "models", work / "offset_models")


def shared_memory_cases(configs: list[str]) -> list[Case]:
    """test.sh's runs of its libtorch cases: each test against a fresh daemon, once
    with CLIENT_TYPE=http and once with grpc; the first without --allow-client-shm."""
    allow = ["--allow-client-shm=true"]
    cases = [Case(f"test_client_shm_disabled_by_default.{client}", "models",
                  ["SharedMemoryTest.test_client_shm_disabled_by_default"], {"CLIENT_TYPE": client}, 1)
             for client in SHM_CLIENT_TYPES]
    for test in SHM_ALLOWED_TESTS:
        for client in SHM_CLIENT_TYPES:
            cases.append(Case(f"{test}.{client}", "models", [f"SharedMemoryTest.{test}"],
                              {"CLIENT_TYPE": client}, 1, allow))
    for client in SHM_CLIENT_TYPES:
        cases.append(Case(f"test_large_shm_register_offset.{client}", "offset_models",
                          ["SharedMemoryTest.test_large_shm_register_offset"], {"CLIENT_TYPE": client}, 1, allow))
    return cases


# ------------------------------------------------------------------ L0_http, L0_grpc

# qa/python_models/string_identity (a Python-backend model: TYPE_STRING INPUT0 ->
# OUTPUT0, max_batch_size 0, dims [ -1 ] as L0_grpc/test.sh edits it), served
# with a TorchScript List[str] identity: torchpool serves PyTorch models only.
STRING_IDENTITY_MODULE = '''import sys
from typing import List
import torch


class StringIdentity(torch.nn.Module):
    def forward(self, input0: List[str]) -> List[str]:
        return input0


torch.jit.save(torch.jit.script(StringIdentity()), sys.argv[1])
'''
STRING_IDENTITY_CONFIG = "qa/python_models/string_identity/config.pbtxt"


def build_simple(work: Path, repository: str) -> Path:
    """Triton's `simple` example (docs/examples/model_repository/simple: INT32 [16]
    INPUT0/INPUT1 -> OUTPUT0 = sum, OUTPUT1 = difference, max_batch_size 8) in
    work/<repository>: its config, served with a TorchScript module computing
    the same (Triton's is ONNX)."""
    config = work / SIMPLE_CONFIG
    if not config.is_file():
        raise QaError(f"{SIMPLE_CONFIG} is missing from Triton's tree")
    text = config.read_text()
    if 'platform: "onnxruntime_onnx"' not in text:
        raise QaError(f"{SIMPLE_CONFIG} no longer names the ONNX platform; check what it serves")
    simple = work / repository / "simple"
    (simple / "1").mkdir(parents=True)
    (simple / "config.pbtxt").write_text(text.replace('platform: "onnxruntime_onnx"', 'platform: "pytorch_libtorch"'))
    script(work, ["-c", SIMPLE_MODULE], simple / "1" / "model.pt")
    return simple


def script(work: Path, program: list[str], model: Path) -> None:
    """Run `python <program> <model>` to write a TorchScript model."""
    log = work / f"{model.parent.parent.name}.gen.log"
    with open(log, "wb") as out:
        r = subprocess.run([sys.executable, *program, str(model)], cwd=ROOT, stdout=out,
                           stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        raise QaError(f"scripting {model.parent.parent.name} failed:\n{_tail(log, 30)}")


# Triton's qa_identity_model_repository models that http_test.py uses are ONNX
# identities (gen_qa_identity_models.py --onnx: max_batch_size 8, INPUTn -> OUTPUTn);
# here each is its generator's config (create_onnx_modelconfig, the platform made
# pytorch_libtorch) served with a TorchScript identity: name -> (dtype, dims, count)
HTTP_IDENTITY_MODELS = {
    "onnx_zero_1_float32": ("np.float32", "[-1]", 1),
    "onnx_zero_1_object": ("np_dtype_string", "[-1]", 1),
    "onnx_zero_1_float16": ("np.float16", "[-1, -1]", 1),
    "onnx_zero_3_float32": ("np.float32", "[-1]", 3),
}
# run in qa/common with the models folder as argv[1]: the generator's own configs
HTTP_IDENTITY_CONFIGS = """import sys
import numpy as np
import gen_qa_identity_models as g
import test_util
g.tu = test_util       # the generator imports it in its __main__
np_dtype_string = g.np_dtype_string
""" + "".join(f"g.create_onnx_modelconfig(sys.argv[1], {count}, 8, {dtype}, {dims})\n"
              for dtype, dims, count in HTTP_IDENTITY_MODELS.values())
# argv[1]: how many tensors ("1", "3") or "string"; argv[2]: the model file
IDENTITY_MODULE = '''import sys
from typing import List, Tuple
import torch


class Identity(torch.nn.Module):
    def forward(self, input0: torch.Tensor) -> torch.Tensor:
        return input0


class Identity3(torch.nn.Module):
    def forward(self, input0: torch.Tensor, input1: torch.Tensor,
                input2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return input0, input1, input2


class StringIdentity(torch.nn.Module):
    def forward(self, input0: List[str]) -> List[str]:
        return input0


module = {"1": Identity, "3": Identity3, "string": StringIdentity}[sys.argv[1]]()
torch.jit.save(torch.jit.script(module), sys.argv[2])
'''
# docs/examples/model_repository/simple_identity: a Python-backend STRING identity
SIMPLE_IDENTITY_CONFIG = "docs/examples/model_repository/simple_identity/config.pbtxt"

# http_test.py's HttpTest, but test_loading_large_invalid_model: it builds a 2^31-byte
# payload, base64-encodes it and sends ~2.9 GB as one JSON body (some 13 GB of client
# memory); torchpool answers 413 from Content-Length before reading it (docs/triton-qa.md)
HTTP_TESTS = (
    "test_raw_binary", "test_raw_binary_longer", "test_byte", "test_byte_too_many_elements",
    "test_multi_variable_dimensions", "test_multi_inputs", "test_content_encoding_chunked_manually",
    "test_content_encoding_unsupported_client", "test_descriptive_status_code", "test_buffer_size_overflow",
    "test_negative_dimensions", "test_load_oversized_file_parameter", "test_json_recursion_depth_limit",
    "test_duplicate_output_names", "test_repository_index_deeply_nested_json",
    "test_inference_header_content_length_out_of_range")


def one_string_per_item(config: Path) -> None:
    """A batching model's STRING tensors of dims [ -1 ] or [ 1 ]: a TorchScript
    List[str] has one dimension, the batch, so each becomes dims [ 1 ] with
    reshape { shape: [ ] } (one string per batch item), as torchpool's load
    error advises; requests of shape [n, 1] are served as before."""
    config.write_text(re.sub(r"(data_type: TYPE_STRING\s*dims: \[) -?1 \]",
                             r"\1 1 ]\n    reshape: { shape: [ ] }", config.read_text()))


def build_http_repositories(qa: Path, work: Path) -> dict[str, list[str]]:
    """L0_http/test.sh's MODELDIR for python_http_aio_test.py (the models of Triton's
    CI image, of which the test uses `simple` only) and its python_unit_test_models
    for http_test.py: the identity models of qa_identity_model_repository it copies,
    the copies and edits it makes of them, and simple_identity(_int64)."""
    build_simple(work, "models")
    models = work / "python_unit_test_models"
    models.mkdir()
    log = work / "python_unit_test_models.gen.log"
    with open(log, "wb") as out:
        r = subprocess.run([sys.executable, "-c", HTTP_IDENTITY_CONFIGS, str(models)], cwd=qa / "common",
                           stdout=out, stderr=subprocess.STDOUT, check=False)
    if r.returncode != 0:
        raise QaError(f"gen_qa_identity_models.py's create_onnx_modelconfig failed:\n{_tail(log, 30)}")
    program = work / "identity.py"
    program.write_text(IDENTITY_MODULE)
    for name, (dtype, _dims, count) in HTTP_IDENTITY_MODELS.items():
        config = models / name / "config.pbtxt"
        if not config.is_file():
            raise QaError(f"create_onnx_modelconfig made no {name}")
        sed(config, 'platform: "onnxruntime_onnx"', 'platform: "pytorch_libtorch"')
        (config.parent / "1").mkdir()
        script(work, [str(program), "string" if dtype == "np_dtype_string" else str(count)],
               config.parent / "1" / "model.pt")
    # cp -r onnx_zero_1_object onnx_zero_1_object_1_element; sed its name, and its
    # first -1 (INPUT0's dims) to 1
    config = copy_model(models / "onnx_zero_1_object", models, "onnx_zero_1_object_1_element")
    sed(config, "onnx_zero_1_object", "onnx_zero_1_object_1_element")
    text = config.read_text()
    config.write_text(text.replace("-1", "1", 1))
    one_string_per_item(config)
    # a TorchScript List[str] has one dimension: onnx_zero_1_object ([batch, -1])
    # becomes non-batching; its INPUT0 keeps dims [ -1 ], which is what its test
    # (a raw BYTES request refused) is about
    sed(models / "onnx_zero_1_object" / "config.pbtxt", r"^max_batch_size: 8", "max_batch_size: 0")
    # the error code test's model: a queue of one request
    config = copy_model(models / "onnx_zero_1_float32", models, "onnx_zero_1_float32_queue")
    sed(config, "onnx_zero_1_float32", "onnx_zero_1_float32_queue")
    append(config, "dynamic_batching { \n    max_queue_delay_microseconds: 1000000\n"
                   "    preferred_batch_size: [ 8 ]\n    default_queue_policy {\n"
                   "        max_queue_size: 1\n    }\n}")
    # cp -r ./models/simple_identity (Python backend; here the TorchScript string identity),
    # and simple_identity_int64: TYPE_STRING -> TYPE_INT64
    source = work / SIMPLE_IDENTITY_CONFIG
    if not source.is_file():
        raise QaError(f"{SIMPLE_IDENTITY_CONFIG} is missing from Triton's tree")
    for name, kind, dtype in (("simple_identity", "string", "TYPE_STRING"),
                              ("simple_identity_int64", "1", "TYPE_INT64")):
        model = models / name
        (model / "1").mkdir(parents=True)
        text = source.read_text()
        if 'backend: "python"' not in text:
            raise QaError(f"{SIMPLE_IDENTITY_CONFIG} no longer names the Python backend; check what it serves")
        (model / "config.pbtxt").write_text(text.replace('backend: "python"', 'backend: "pytorch"')
                                            .replace("TYPE_STRING", dtype).replace("simple_identity", name))
        one_string_per_item(model / "config.pbtxt")
        script(work, [str(program), kind], model / "1" / "model.pt")
    return _names(work / "models", models)


def build_grpc_repositories(qa: Path, work: Path) -> dict[str, list[str]]:
    """L0_grpc/test.sh's MODELDIR (for python_grpc_aio_test.py: `simple`) and
    GRPC_TEST_MODELDIR (simple and string_identity, for GrpcTest)."""
    build_simple(work, "models")
    build_simple(work, "grpc_test_models")
    config = work / STRING_IDENTITY_CONFIG
    if not config.is_file():
        raise QaError(f"{STRING_IDENTITY_CONFIG} is missing from Triton's tree")
    model = work / "grpc_test_models" / "string_identity"
    (model / "1").mkdir(parents=True)
    # test.sh: sed -i "s/dims: \[ 1 \]/dims: [ -1 ]/g"; the backend made TorchScript's
    text = config.read_text().replace("dims: [ 1 ]", "dims: [ -1 ]").replace('backend: "python"',
                                                                             'backend: "pytorch"')
    (model / "config.pbtxt").write_text(text)
    program = work / "string_identity.py"
    program.write_text(STRING_IDENTITY_MODULE)
    script(work, [str(program)], model / "1" / "model.pt")
    return _names(work / "models", work / "grpc_test_models")


def http_cases(configs: list[str]) -> list[Case]:
    # test.sh: the server with --allow-client-shm=true, `python python_http_aio_test.py`;
    # then `python http_test.py` against python_unit_test_models, in explicit mode with
    # --load-model=* (EXPECTED_NUM_TESTS=17: every HttpTest but the one left out)
    return [Case("python_http_aio_test", "models", [], {}, 18, ["--allow-client-shm=true"]),
            Case("http_test", "python_unit_test_models", [f"HttpTest.{t}" for t in HTTP_TESTS], {},
                 len(HTTP_TESTS), ["--model-control-mode=explicit", "--load-model=*"], "L0_http/http_test.py")]


def grpc_cases(configs: list[str]) -> list[Case]:
    # test.sh: `python python_unit_test.py GrpcTest` against GRPC_TEST_MODELDIR, then
    # python_grpc_aio_test.py against MODELDIR with --allow-client-shm=true
    return [Case("GrpcTest", "grpc_test_models", ["GrpcTest"], {}, 2),
            Case("python_grpc_aio_test", "models", [], {}, 18, ["--allow-client-shm=true"],
                 "L0_grpc/python_grpc_aio_test.py")]

# ------------------------------------------------------------------ L0_lifecycle

# lifecycle_test.py works on ./models (and ./libtorch_float32_float32_float32, which
# it copies in and out of it) from its own folder: each run's repository is made
# there afresh, as test.sh's `rm -fr models; mkdir models; cp -r ...` before it
LIFECYCLE_MODELS = "qa/L0_lifecycle/models"
FLOAT32 = "libtorch_float32_float32_float32"


def build_lifecycle_sources(qa: Path, work: Path) -> dict[str, list[str]]:
    """$DATADIR/qa_model_repository for BACKENDS=libtorch (gen_qa_models.py
    --libtorch); each run's `models` is made from it by the run's setup. No model
    is required READY at start: some runs start with models that must not load."""
    generate(qa, work, "gen_qa_models.py", ["--libtorch"], "qa_model_repository")
    return {LIFECYCLE_MODELS: []}


def lifecycle_model(work: Path, dest: Path, source: str, name: Optional[str] = None) -> Path:
    """cp -r $DATADIR/qa_model_repository/<source> dest/[name]; another name is a
    stand-in (Triton's onnx_/plan_float32_float32_float32: the same add/sub on
    FP32 [16] with the same versions, which the QA's infer_util addresses by the
    platform the metadata names, so TorchScript's OUTPUT__0 names are used)."""
    config = copy_model(work / "qa_model_repository" / source, dest, name)
    if name and name != source:
        sed(config, f'^name: "{source}"', f'name: "{name}"')
    return config


def fresh_lifecycle_models(work: Path) -> Path:
    """rm -fr models libtorch_float32_float32_float32 config.pbtxt.*; mkdir models"""
    here = work / LIFECYCLE_MODELS
    shutil.rmtree(here, ignore_errors=True)
    shutil.rmtree(here.parent / FLOAT32, ignore_errors=True)
    for stale in here.parent.glob("config.pbtxt.*"):
        stale.unlink()
    here.mkdir()
    return here


def _rename_version(old: str, new: str) -> Callable[[Path], None]:
    def setup(work: Path) -> None:
        # cp -r .../libtorch_float32_float32_float32 models/.; mv .../3 .../<new>
        models = fresh_lifecycle_models(work)
        lifecycle_model(work, models, FLOAT32)
        (models / FLOAT32 / old).rename(models / FLOAT32 / new)
    return setup


def _setup_model_load_unload(work: Path) -> None:
    # test.sh: openvino, onnx, plan models in `models`; the test uses only onnx (a
    # stand-in here), and copies ./libtorch_float32_float32_float32 in and out
    models = fresh_lifecycle_models(work)
    lifecycle_model(work, models, FLOAT32, "onnx_float32_float32_float32")
    lifecycle_model(work, models.parent, FLOAT32)


def _setup_version_load_unload(work: Path) -> None:
    lifecycle_model(work, fresh_lifecycle_models(work), "libtorch_int32_int32_int32")


def _setup_model_modify(work: Path) -> None:
    # test.sh: for i in libtorch plan: the model, config.pbtxt.$i without its
    # version_policy, config.pbtxt.wrong.$i naming wrong_output0_labels.txt (label ->
    # label9); plan_float32_float32_float32 is a stand-in
    models = fresh_lifecycle_models(work)
    for backend in ("libtorch", "plan"):
        name = f"{backend}_float32_float32_float32"
        config = lifecycle_model(work, models, FLOAT32, name)
        text = config.read_text()
        (models.parent / f"config.pbtxt.{backend}").write_text(
            "".join(line for line in text.splitlines(keepends=True) if not line.startswith("version_policy")))
        (models.parent / f"config.pbtxt.wrong.{backend}").write_text(
            "\n".join(re.sub("output0_labels", "wrong_output0_labels", line, count=1) for line in text.split("\n")))
        labels = (config.parent / "output0_labels.txt").read_text()
        (config.parent / "wrong_output0_labels.txt").write_text(
            "\n".join(re.sub("label", "label9", line, count=1) for line in labels.split("\n")))


POLL = ["--repository-poll-secs=1", "--model-control-mode=poll"]
# test.sh's LifeCycleTest runs whose models are libtorch or have a stand-in: test ->
# (setup, SERVER_ARGS beyond --model-repository (test.sh's --exit-timeout-secs=5
# left out: torchpool's shutdown has its own --stop-timeout), log lines grepped)
LIFECYCLE_TESTS: dict[str, tuple[Callable[[Path], None], list[str], tuple[str, ...]]] = {
    "test_parse_ignore_zero_prefixed_version": (
        _rename_version("3", "003"), ["--exit-on-error=false"],
        ("ignore version directory '003' which contains leading zeros in its directory name",)),
    "test_parse_ignore_non_intergral_version": (
        _rename_version("3", "abc"), ["--exit-on-error=false"],
        ("ignore version directory 'abc' which fails to convert to integral number",)),
    "test_dynamic_model_load_unload": (_setup_model_load_unload, POLL, ()),
    "test_dynamic_model_load_unload_disabled": (_setup_model_load_unload, ["--model-control-mode=none"], ()),
    "test_dynamic_version_load_unload": (_setup_version_load_unload, POLL, ()),
    "test_dynamic_version_load_unload_disabled": (_setup_version_load_unload, ["--model-control-mode=none"], ()),
    "test_dynamic_model_modify": (_setup_model_modify, POLL, ()),
}


def lifecycle_cases(configs: list[str]) -> list[Case]:
    """test.sh's runs: `python lifecycle_test.py LifeCycleTest.<test>` against a
    server started for it on the models it prepared; check_test_results expects 1."""
    return [Case(test, LIFECYCLE_MODELS, [f"LifeCycleTest.{test}"], {}, 1, list(args), setup=setup,
                 log_expect=expect)
            for test, (setup, args, expect) in LIFECYCLE_TESTS.items()]


# ------------------------------------------------------------------ L0_implicit_state

IMPLICIT_MODEL = "libtorch_nobatch_sequence_int32"


def build_implicit_state_repositories(qa: Path, work: Path) -> dict[str, list[str]]:
    """L0_implicit_state/test.sh for BACKEND=libtorch: from
    qa_sequence_implicit_model_repository (gen_qa_implicit_models.py --libtorch)
    libtorch_nobatch_sequence_int32 and a copy, ..._output, that also declares the
    state as the output OUTPUT_STATE__1. The other models of its `models` folder
    are of Triton's C++ implicit_state test backend (libtriton_implicit_state.so)."""
    generated = generate(qa, work, "gen_qa_implicit_models.py", ["--libtorch"],
                         "qa_sequence_implicit_model_repository")
    models = work / "implicit_models"
    copy_model(generated / IMPLICIT_MODEL, models)
    output = f"{IMPLICIT_MODEL}_output"
    config = copy_model(generated / IMPLICIT_MODEL, models, output)
    sed(config, r"^name:.*", f'name: "{output}"')
    append(config, 'output [{ name: "OUTPUT_STATE__1" \n data_type: TYPE_INT32 \n dims: [ 1 ] }]')
    return _names(models)


# implicit_state.py's tests that use libtorch models (the other five use the C++
# implicit_state backend's models)
IMPLICIT_STATE_TESTS = ("test_request_output_not_allowed", "test_request_output")


def implicit_state_cases(configs: list[str]) -> list[Case]:
    # test.sh: one server, `python3 implicit_state.py` (EXPECTED_TEST_NUM=7); here
    # its two libtorch tests in one run against one server
    return [Case("implicit_state", "implicit_models", [f"ImplicitStateTest.{t}" for t in IMPLICIT_STATE_TESTS],
                 {}, len(IMPLICIT_STATE_TESTS))]


def infer_cases(configs: list[str]) -> list[Case]:
    return [Case(config, "models", [], CONFIGURATIONS[config][0], CONFIGURATIONS[config][1])
            for config in configs]


SUITES = {
    "L0_infer": Suite(
        "L0_infer", "L0_infer/infer_test.py", "InferTest",
        {"common/infer_util.py": (8000, 8001), "common/shm_util.py": (8000,)},
        build_infer_repository, infer_cases, {"NOBATCH": "1", "BATCH": "1"}, ("no-shm", "system-shm"),
        "ENSEMBLES=0, TARGET=cpu"),
    "L0_batcher": Suite(
        "L0_batcher", "L0_batcher/batcher_test.py", "BatcherTest",
        {"common/infer_util.py": (8000, 8001), "common/shm_util.py": (8000,),
         "L0_batcher/batcher_test.py": (8001,)},
        build_batcher_repositories, batcher_cases, {}, ("no-shm",), "TARGET=cpu"),
    "L0_sequence_batcher": Suite(
        "L0_sequence_batcher", "L0_sequence_batcher/sequence_batcher_test.py", "SequenceBatcherTest",
        {"common/sequence_util.py": (8000, 8001), "L0_sequence_batcher/sequence_batcher_test.py": (8001,)},
        build_sequence_repositories, sequence_cases,
        {"IMPLICIT_STATE": "0", "INITIAL_STATE_FILE": "0", "INITIAL_STATE_ZERO": "0", "USE_SINGLE_BUFFER": "0"},
        ("no-shm",), "ENSEMBLES=0 IMPLICIT_STATE=0, TARGET=cpu"),
    "L0_shared_memory": Suite(
        "L0_shared_memory", "L0_shared_memory/shared_memory_test.py", "SharedMemoryTest",
        {"common/infer_util.py": (8000, 8001), "common/shm_util.py": (8000,),
         "L0_shared_memory/shared_memory_test.py": (8000, 8001)},
        build_shared_memory_repositories, shared_memory_cases, {}, ("no-shm",),
        "system shared memory, TARGET=cpu", extra_dirs=("docs/examples/model_repository/simple",)),
    "L0_http": Suite(
        "L0_http", "L0_http/python_http_aio_test.py", "TestHttpAioClient",
        {"L0_http/python_http_aio_test.py": (8000,), "L0_http/http_test.py": (8000,)},
        build_http_repositories, http_cases, {}, ("no-shm",), "TARGET=cpu",
        extra_dirs=("docs/examples/model_repository/simple", "docs/examples/model_repository/simple_identity")),
    "L0_grpc": Suite(
        "L0_grpc", "L0_grpc/python_unit_test.py", "GrpcTest",
        {"L0_grpc/python_unit_test.py": (8001,), "L0_grpc/python_grpc_aio_test.py": (8001,)},
        build_grpc_repositories, grpc_cases, {}, ("no-shm",), "TARGET=cpu",
        extra_dirs=("docs/examples/model_repository/simple", "qa/python_models/string_identity")),
    "L0_lifecycle": Suite(
        "L0_lifecycle", "L0_lifecycle/lifecycle_test.py", "LifeCycleTest",
        {"common/infer_util.py": (8000, 8001), "common/shm_util.py": (8000,),
         "L0_lifecycle/lifecycle_test.py": (8000, 8001)},
        build_lifecycle_sources, lifecycle_cases, {}, ("no-shm",), "TARGET=cpu"),
    "L0_implicit_state": Suite(
        "L0_implicit_state", "L0_implicit_state/implicit_state.py", "ImplicitStateTest",
        {"L0_implicit_state/implicit_state.py": (8000,)},
        build_implicit_state_repositories, implicit_state_cases,
        {"IMPLICIT_STATE": "1", "INITIAL_STATE_ZERO": "0", "INITIAL_STATE_FILE": "0", "SINGLE_STATE_BUFFER": "0"},
        ("no-shm",), "IMPLICIT_STATE=1, TARGET=cpu"),
}


def select_cases(suite: Suite, configs: list[str], tests: Optional[list[str]]) -> list[Case]:
    """The runs of `suite`, or those of the tests named (L0_infer: the tests are
    passed to one run per configuration; batcher suites: `test_x` picks every
    run of it, `test_x.models1` one)."""
    cases = suite.cases(configs)
    if not tests:
        return cases
    if suite.name == "L0_infer":
        return [Case(c.name, c.repository, list(tests), c.env, None) for c in cases]
    wanted = {t.split(".", 1)[1] if t.startswith(suite.test_class + ".") else t for t in tests}
    def test_of(c: Case) -> str:      # the test a run is of (a whole file's run: its name)
        return c.tests[0].split(".", 1)[-1] if c.tests else c.name

    chosen = [c for c in cases if c.name in wanted or test_of(c) in wanted]
    unknown = sorted(t for t in wanted if not any(c.name == t or test_of(c) == t for c in cases))
    if unknown:
        raise QaError(f"{suite.name} has no run {', '.join(unknown)} (test.sh's runs: "
                      f"{', '.join(sorted({test_of(c) for c in cases}))})")
    return chosen


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


def clean_environment(extra: dict[str, str]) -> dict[str, str]:
    """os.environ without the scheduler delays (a test checks they are unset
    unless test.sh sets them), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in DELAY_VARIABLES}
    env.update(extra)
    return env


def serve_command(models: Path, work: Path, http_port: int, grpc_port: int, env: dict[str, str],
                  extra: Optional[list[str]] = None) -> list[str]:
    """`torchpool serve` as test.sh starts tritonserver: its ZeroMQ socket in the
    work directory (so it meets no other daemon), client shared memory allowed
    where the run uses it (test.sh's --allow-client-shm=true), then the run's
    own arguments (`extra`, test.sh's SERVER_ARGS)."""
    args = [sys.executable, "-m", "torchpool", "serve", "--model-repository", str(models),
            "--listen", f"ipc://{work}/torchpool.sock",
            "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    if env.get("TEST_SYSTEM_SHARED_MEMORY") == "1":
        args.append("--allow-client-shm=true")
    return args + list(extra or [])


class ServedRepository:
    """`torchpool serve` on the QA's ports, in its own session so that nothing it
    starts outlives stop()."""

    def __init__(self, models: Path, work: Path, http_port: int, grpc_port: int, log: Path,
                 env: Optional[dict[str, str]] = None, extra: Optional[list[str]] = None) -> None:
        self.http_port, self.grpc_port, self.log = http_port, grpc_port, log
        env = env or {}
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(serve_command(models, work, http_port, grpc_port, env, extra), cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env=clean_environment(env), start_new_session=True)

    def wait_ready(self, models: list[str], timeout: float) -> None:
        import tritonclient.grpc as grpcclient
        deadline = time.monotonic() + timeout
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")
        try:
            while not self._up(grpc):
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

    def _up(self, grpc: object) -> bool:
        """The broker has settled every model version (READY or not) and both
        gateway ports answer."""
        if "torchpool ready" not in self.log.read_text(errors="replace"):
            return False
        try:
            http_json(self.http_port, "/v2/health/live")
            return bool(grpc.is_server_live())
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
    name: str
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
        # a test's subTests each count a failure, so a run of one test can count three
        return max(0, self.ran - self.failures - self.errors - self.skipped)

    @property
    def ok(self) -> bool:
        return (not self.problems and self.ran > 0 and not self.failures and not self.errors
                and (self.expected is None or self.ran == self.expected))


def run_test_file(suite: Suite, qa: Path, case: Case, timeout: float, logs: Path) -> RunResult:
    """python <test file> -v [tests], as test.sh runs it, with stdout (tritonclient's
    verbose request dumps) and stderr (unittest's report) kept apart."""
    result = RunResult(case.name, case.expected)
    env = clean_environment({**QA_ENVIRONMENT, **suite.environment, **case.env})
    shims = qa.parent / "shims"
    if shims.is_dir():      # stand-ins for client-side modules the test imports (see PSUTIL_SHIM)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shims), env.get("PYTHONPATH")]))
    test = qa / (case.test_file or suite.test_file)
    out, err = logs / f"client.{case.name}.log", logs / f"unittest.{case.name}.log"
    t0 = time.monotonic()
    with open(out, "wb") as o, open(err, "wb") as e, \
            subprocess.Popen([sys.executable, test.name, "-v", *case.tests], cwd=test.parent,
                             env=env, stdout=o, stderr=e, start_new_session=True) as proc:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            result.problems.append(f"{test.name} still running after {timeout:.0f} s; killed")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result.seconds = time.monotonic() - t0
    parse_unittest(err.read_text(errors="replace"), result)
    if proc.returncode != 0 and not (result.failures or result.errors or result.problems):
        result.problems.append(f"{test.name} exited with {proc.returncode}")
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
    return sorted(n for n in os.listdir("/dev/shm") if n not in before and QA_SHM_REGION.match(n))


def run_case(args: argparse.Namespace, suite: Suite, qa: Path, work: Path, models: list[str],
             case: Case) -> RunResult:
    for port in (args.http_port, args.grpc_port):
        if port_in_use(port):
            raise QaError(f"port {port} is in use (another server?); free it or pass "
                          f"--http-port/--grpc-port (the QA's copy is then pointed there)")
    if case.setup:
        case.setup(work)
    shm_before = set(os.listdir("/dev/shm"))
    daemon = ServedRepository(work / case.repository, work, args.http_port, args.grpc_port,
                              work / f"torchpool.{case.name}.log", case.env, case.serve_args)
    result = RunResult(case.name, None)
    try:
        daemon.wait_ready(models, args.ready_timeout)
        result = run_test_file(suite, qa, case, args.timeout, work)
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
        result.problems.extend(missing_log_lines(daemon.log, case.log_expect))
    return result


def missing_log_lines(log: Path, expected: tuple[str, ...]) -> list[str]:
    """test.sh's `grep -c "<line>" $SERVER_LOG` checks: a problem for each line not in the log."""
    text = log.read_text(errors="replace") if expected and log.exists() else ""
    return [f"the daemon's log has no {line!r} (test.sh greps for it)" for line in expected if line not in text]


# ------------------------------------------------------------------ summary

def summary(results: list[RunResult], source: str, suite: str = "L0_infer") -> str:
    about = SUITES[suite].description
    width = max([14, *(len(r.name) + 2 for r in results)])
    lines = [f"Triton qa/{suite} against torchpool ({source}; BACKENDS=libtorch {about})",
             f"{'run':<{width}}{'ran':>5}{'expected':>10}{'passed':>8}{'failed':>8}{'errors':>8}"
             f"{'skipped':>9}{'requests':>10}{'models':>8}{'time':>8}"]
    for r in results:
        ok_requests, failed_requests, models = r.requests
        lines.append(f"{r.name:<{width}}{r.ran:>5}{r.expected if r.expected is not None else '-':>10}"
                     f"{r.passed:>8}{r.failures:>8}{r.errors:>8}{r.skipped:>9}{ok_requests:>10}"
                     f"{models:>8}{r.seconds:>7.0f}s")
    lines.append("requests: inferences the daemon answered successfully in that run "
                 "(failed inferences are tests' expected errors or bugs)")
    for r in results:
        if r.requests[1]:
            lines.append(f"  {r.name}: {r.requests[1]} inference(s) answered with an error")
        for item in r.not_ok + r.problems:
            lines.append(f"  {r.name}: {item}")
        if r.expected is not None and r.ran and r.ran != r.expected:
            lines.append(f"  {r.name}: ran {r.ran} tests, test.sh's count for this setup is {r.expected}")
    if len(results) > 1:
        passed = sum(r.ok for r in results)
        lines.append(f"runs: {len(results)}, passed {passed}, failed {len(results) - passed}; "
                     f"tests: {sum(r.ran for r in results)}, passed {sum(r.passed for r in results)}")
    lines.append("PASSED" if results and all(r.ok for r in results) else "FAILED")
    return "\n".join(lines)


def _tail(path: Path, n: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)      # unwind through every finally: daemon stopped, temp dir removed


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    suite = SUITES[args.suite]
    signal.signal(signal.SIGTERM, _terminate)
    work = Path(tempfile.mkdtemp(prefix="torchpool-triton-qa-"))
    results: list[RunResult] = []
    source = str(args.triton_server)
    try:
        cases = select_cases(suite, args.configs, args.tests)
        source = extract_qa(args.triton_server, args.triton_ref, work, suite.qa_dirs)
        qa = work / "qa"
        point_at_ports(qa, args.http_port, args.grpc_port, suite.port_files)
        repositories = suite.build(qa, work)
        print(f"{sum(len(m) for m in repositories.values())} libtorch models in "
              f"{', '.join(sorted(repositories))}; {len(cases)} run(s) of {suite.test_file}", flush=True)
        for case in cases:
            result = run_case(args, suite, qa, work, repositories[case.repository], case)
            results.append(result)
            print(f"{case.name}: {'ok' if result.ok else 'FAILED'} ({result.seconds:.0f} s)", flush=True)
            if not result.ok and result.report:
                print(f"--- {case.name}: unittest's report (first 200 lines)\n"
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
    print(summary(results, source, args.suite))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
