"""The C example client (examples/c) and the documented test vectors
(docs/protocol.md), each against a real daemon.

The client is built here with its Makefile, the machine's C compiler and a
libzmq: the one pkg-config knows, else the shared library pyzmq ships
(site-packages/pyzmq.libs; no zmq.h needed: examples/c/zmq_api.h). Without
make, a C compiler or any libzmq the C tests skip and say why; the vector
tests need none of it.
"""
from __future__ import annotations

import ctypes.util
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from torchpool.protocol import messages
from tests.support.daemon import ROOT, Daemon, RawConnection, free_tcp_port
from tests.unit.test_protocol_vectors import BAD_SHAPE_MESSAGE, doc_vectors

EXAMPLE_DIR = ROOT / "examples" / "c"
BUILD_FLAGS = "-std=c11 -O2 -Wall -Wextra -Wpedantic -Werror"     # the example stays warning-free


def libzmq_make_args() -> Optional[list[str]]:
    """make arguments that link the example with a libzmq, or None when
    this machine has none."""
    pkg_config = shutil.which("pkg-config")
    if pkg_config and subprocess.run([pkg_config, "--exists", "libzmq"]).returncode == 0:
        return []                                   # the Makefile asks pkg-config itself
    import zmq

    bundled = sorted((Path(zmq.__file__).resolve().parent.parent / "pyzmq.libs").glob("libzmq*.so*"))
    if bundled:
        return [f"ZMQ_LIBS={bundled[0]}", "ZMQ_CFLAGS="]
    system = ctypes.util.find_library("zmq")     # the library without its headers
    return [f"ZMQ_LIBS=-l:{system}", "ZMQ_CFLAGS="] if system else None


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    make, cc = shutil.which("make"), shutil.which("cc") or shutil.which("gcc")
    if make is None or cc is None:
        pytest.skip("the C example needs make and a C compiler (apt-get install make gcc)")
    libzmq = libzmq_make_args()
    if libzmq is None:
        pytest.skip("no libzmq on this machine (neither pkg-config's libzmq nor pyzmq's bundled copy)")
    out = tmp_path_factory.mktemp("c_client") / "torchpool_client"
    build = subprocess.run([make, "-C", str(EXAMPLE_DIR), f"OUT={out}", f"CC={cc}",
                            f"CFLAGS={BUILD_FLAGS}", *libzmq],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"building examples/c failed:\n{build.stdout}{build.stderr}"
    return out


@pytest.fixture(scope="module")
def examples_daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    daemon = Daemon(small_repository, tmp_path_factory.mktemp("examples_daemon"), tcp_port=free_tcp_port())
    try:
        yield daemon.start()
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()


def run_client(client: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(client), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_c_client_runs_addsub_and_prints_the_daemons_error(c_client, examples_daemon, scheme):
    url = next(u for u in examples_daemon.urls if u.startswith(scheme))
    vectors = doc_vectors()
    run = run_client(c_client, "--hex", url)
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.stdout.splitlines() == [
        # the C encoder writes the documented request bytes, byte for byte
        "request 1: " + vectors["infer-request"].hex(),
        "OUTPUT0 FP32 [1,16]: " + " ".join(str(v) for v in range(1, 17)),      # 0..15 + 1
        "OUTPUT1 FP32 [1,16]: " + " ".join(str(v) for v in range(-1, 15)),     # 0..15 - 1
        "request 2: " + vectors["error-request"].hex(),
        "error INVALID_ARG: " + BAD_SHAPE_MESSAGE,
    ]
    assert run.stderr == ""


def test_c_client_says_when_nobody_answers(c_client, tmp_path):
    url = f"ipc://{tmp_path / 'nobody.sock'}"
    run = run_client(c_client, "--timeout-ms", "300", url)
    assert run.returncode == 1
    assert run.stdout == ""
    assert f"no answer from torchpool at {url} within 300 ms" in run.stderr


@pytest.mark.parametrize("args", [[], ["--timeout-ms", "soon", "ipc:///x"], ["ipc:///x", "ipc:///y"],
                                  ["--verbose", "ipc:///x"]])
def test_c_client_refuses_bad_arguments_with_its_usage(c_client, args):
    run = run_client(c_client, *args)
    assert run.returncode == 2
    assert run.stderr.startswith("usage: ") and "URL" in run.stderr
    assert run.stdout == ""


def test_documented_vectors_are_what_the_daemon_answers(examples_daemon):
    vectors = doc_vectors()
    with RawConnection(examples_daemon.url) as conn:
        def exchange(request: bytes) -> list[bytes]:
            conn.send(request)
            assert conn.pending(30), "no answer from the daemon within 30 s"
            return conn.sock.recv_multipart()

        assert exchange(vectors["infer-request"]) == [vectors["infer-reply"]]
        assert exchange(vectors["error-request"]) == [vectors["error-reply"]]
        header, *payload = exchange(vectors["statistics-request"])
    stats = messages.unpack(header)
    assert payload == []
    assert (stats["v"], stats["id"], stats["ok"]) == (1, 3, True)
    [entry] = stats["result"]["model_stats"]
    # the shape docs/protocol.md gives under "statistics"
    assert set(entry) == {"name", "version", "last_inference", "inference_count", "execution_count",
                          "inference_stats", "batch_stats", "worker_restarts", "instances"}
    assert (entry["name"], entry["version"]) == ("addsub", "1")
    assert entry["inference_count"] >= 1 and entry["execution_count"] >= 1 and entry["last_inference"] > 0
    assert set(entry["inference_stats"]) == {"success", "fail", "queue", "compute_input", "compute_infer",
                                             "compute_output"}
    assert entry["inference_stats"]["success"]["count"] >= 1
    assert entry["inference_stats"]["success"]["ns"] > 0
    assert all(set(row) == {"batch_size", "compute_input", "compute_infer", "compute_output"}
               for row in entry["batch_stats"])
