"""`torchpool serve` refuses what it cannot serve with one line and its own exit status.

Each case runs the real command (`python -m torchpool serve ...`) and checks
the exact line on stderr, the exit status (torchpool/cli/errors.py), that
there is no traceback, and that nothing started: a port or a path is
refused before any model loads. Then --exit-on-error, and the warning for
an empty repository.
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from torchpool.cli import errors

from ..support.daemon import ROOT, Daemon, daemon_segments, descendants, alive, wait_for


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchpool", "serve", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def refused(status: int, *args: str) -> str:
    """`serve` with these arguments stops at once with `status` and one line
    on stderr (and nothing on stdout); that line, without its prefix."""
    done = serve(*args)
    assert done.returncode == status, (done.returncode, done.stderr)
    assert done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchpool: error: "), lines
    return lines[0][len("torchpool: error: "):]


@pytest.fixture
def busy_port():
    """A port something else listens on for the test's duration."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_the_model_repository_must_be_a_readable_directory(tmp_path: Path) -> None:
    listen = ["--listen", f"ipc://{tmp_path}/t.sock"]
    missing = tmp_path / "nowhere"
    assert refused(errors.REPOSITORY, "--model-repository", str(missing), *listen) == \
        f"--model-repository {missing}: no such directory"
    a_file = tmp_path / "models.txt"
    a_file.write_text("not a directory")
    assert refused(errors.REPOSITORY, "--model-repository", str(a_file), *listen) == \
        f"--model-repository {a_file}: not a directory"
    assert not (tmp_path / "t.sock").exists()


@pytest.mark.parametrize("url", ["s3://bucket/models", "gs://bucket/models", "as://account/container/m"])
def test_a_cloud_repository_is_refused_with_what_to_do(url: str, tmp_path: Path) -> None:
    line = refused(errors.REPOSITORY, "--model-repository", url, "--listen", f"ipc://{tmp_path}/t.sock")
    scheme = url.split("://")[0]
    assert line.startswith(f"--model-repository {url}: cloud and remote repositories ({scheme}://) "
                           f"are not supported; copy the repository to a local directory"), line


def test_a_listen_address_without_its_scheme_shows_the_url_meant(tmp_path: Path) -> None:
    path = f"{tmp_path}/x.sock"
    assert refused(errors.USAGE, "--model-repository", str(tmp_path), "--listen", path) == \
        f"--listen {path}: expected a URL such as ipc://{path} or tcp://127.0.0.1:8555"
    assert refused(errors.USAGE, "--model-repository", str(tmp_path), "--listen", "tcp://127.0.0.1") == \
        "--listen tcp://127.0.0.1: expected tcp://HOST:PORT with a port number, e.g. tcp://127.0.0.1:8555"
    assert refused(errors.USAGE, "--model-repository", str(tmp_path), "--listen", "http://127.0.0.1:80") == \
        "--listen http://127.0.0.1:80: only ipc:// and tcp:// addresses are served, e.g. " \
        "ipc:///tmp/torchpool.sock or tcp://127.0.0.1:8555"


@pytest.mark.parametrize("flag, what", [("--metrics-port", "metrics"), ("--http-port", "HTTP"),
                                        ("--grpc-port", "gRPC")])
def test_a_busy_port_is_named_before_any_model_loads(small_repository: Path, tmp_path: Path, busy_port: int,
                                                     flag: str, what: str) -> None:
    line = refused(errors.ADDRESS, "--model-repository", str(small_repository),
                   "--listen", f"ipc://{tmp_path}/t.sock", flag, str(busy_port))
    assert line == f"{flag} {busy_port}: cannot serve {what} on 127.0.0.1:{busy_port}: address already in use"
    assert not (tmp_path / "t.sock").exists()


def test_a_busy_tcp_listen_address(small_repository: Path, busy_port: int) -> None:
    url = f"tcp://127.0.0.1:{busy_port}"
    assert refused(errors.ADDRESS, "--model-repository", str(small_repository), "--listen", url) == \
        f"--listen {url}: address already in use"


def test_one_port_for_two_endpoints_is_bad_usage(small_repository: Path, tmp_path: Path) -> None:
    assert refused(errors.USAGE, "--model-repository", str(small_repository), "--listen",
                   f"ipc://{tmp_path}/t.sock", "--metrics-port", "8123", "--http-port", "8123") == \
        "--http-port 8123: already given to --metrics-port"


def test_an_ipc_socket_a_live_daemon_serves(small_repository: Path, tmp_path: Path) -> None:
    """Its path is in use by a running process: exit status 4, the daemon untouched."""
    path = tmp_path / "t.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        line = refused(errors.ADDRESS, "--model-repository", str(small_repository), "--listen", f"ipc://{path}")
        assert line == f"--listen ipc://{path}: {path} is in use by a running process " \
                       f"(is another torchpool serving it?)"
        assert path.exists()


def test_a_local_socket_a_live_daemon_serves(small_repository: Path, tmp_path: Path) -> None:
    path = tmp_path / "side.local"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as live:
        live.bind(str(path))
        live.listen()
        line = refused(errors.ADDRESS, "--model-repository", str(small_repository),
                       "--listen", f"ipc://{tmp_path}/t.sock", "--local-socket", str(path))
        assert line == f"--local-socket {path}: {path} is in use by a running process " \
                       f"(is another torchpool serving it?)"


# --- --exit-on-error ----------------------------------------------------------------------

@pytest.fixture
def broken_repository(small_repository: Path, tmp_path: Path) -> Path:
    """addsub, and `broken`: the same config, a model.pt that is not TorchScript."""
    root = tmp_path / "repo"
    shutil.copytree(small_repository / "addsub", root / "addsub")
    shutil.copytree(small_repository / "addsub", root / "broken")
    config = root / "broken" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "addsub"', 'name: "broken"'))
    (root / "broken" / "1" / "model.pt").write_bytes(b"this is not a TorchScript archive")
    return root


def test_exit_on_error_stops_the_start_with_the_models_reason(broken_repository: Path, tmp_path: Path) -> None:
    d = Daemon(broken_repository, tmp_path, "--exit-on-error")
    d.start(wait_ready=False)
    try:
        status = d.proc.wait(120)
    finally:
        d.stop(signal.SIGKILL)      # only if it is still running; closes its log
    log = d.log()
    assert status == errors.MODEL_LOAD, log
    last = log.strip().splitlines()[-1]
    assert last.startswith("torchpool: error: model 'broken' version 1 failed to load: "), log
    assert last.endswith(" (--exit-on-error)"), last
    assert "Traceback" not in log
    assert "torchpool ready" not in log
    assert not d.socket_path.exists()
    assert not daemon_segments(d.urls)


def test_exit_on_error_stops_at_a_broken_config_before_any_worker(broken_repository: Path,
                                                                  tmp_path: Path) -> None:
    (broken_repository / "broken" / "config.pbtxt").write_text('name: "broken"\nmax_batch_size: oops\n')
    done = serve("--model-repository", str(broken_repository), "--listen", f"ipc://{tmp_path}/t.sock",
                 "--exit-on-error=true", timeout=120)
    assert done.returncode == errors.MODEL_LOAD, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torchpool: error: model 'broken' failed to load: "), done.stderr
    assert "Traceback" not in done.stderr
    assert "spawned worker" not in done.stderr and "addsub' version 1 READY" not in done.stderr


def test_without_exit_on_error_the_others_serve(broken_repository: Path, tmp_path: Path) -> None:
    """Triton's default is to exit; torchpool's is to serve what loads (the issue's decision)."""
    d = Daemon(broken_repository, tmp_path, "--exit-on-error=false").start()
    try:
        from torchpool.client import Client

        with Client(d.url, timeout=30) as c:
            index = {m["name"]: m["state"] for m in c.repository_index()}
        assert index == {"addsub": "READY", "broken": "UNAVAILABLE"}
        pids = [d.pid()] + descendants(d.pid())
        assert d.stop() == 0, d.log()
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)
    wait_for(lambda: not any(alive(p) for p in pids), 30, "the daemon's processes to exit")


# --- an empty repository -------------------------------------------------------------------

def test_an_empty_repository_is_a_warning_and_the_daemon_serves(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    d = Daemon(root, tmp_path).start()
    try:
        log = d.log()
        assert f"WARNING torchpool.broker: model repository {root} holds no models" in log, log
        from torchpool.client import Client

        with Client(d.url, timeout=30) as c:
            assert c.repository_index() == []
            assert c.server_live() is True
        assert d.stop() == 0, d.log()
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)
