"""What systemd hears from the daemon, read from a NOTIFY_SOCKET the test binds.

In order: loading progress (STATUS=loading i/n ...), EXTEND_TIMEOUT_USEC
again and again while a model is still loading (so TimeoutStartSec never
cuts a slow load short), READY=1 once every version settled, RELOADING=1
with MONOTONIC_USEC on SIGHUP and READY=1 when the reload's loads settled
(Type=notify-reload), STOPPING=1 on SIGTERM. Also the unit file itself.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from torchpool.broker.systemd import EXTEND_BY
from torchpool.cli import errors

from torchpool.client import Client

from ..support.daemon import ROOT, Daemon, free_tcp_port, wait_for

# imported by the worker before the model (TORCHPOOL_PYTHON_MODULES): a load
# that lasts until the test creates the file GATE names (outside the model's
# directory: a file added there would make poll mode reload the model)
GATE = """\
import pathlib, time
while not pathlib.Path({path!r}).exists():
    time.sleep(0.02)
"""


class NotifySocket:
    """A unix datagram socket standing in for systemd's; keeps every message."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[str] = []

    def until(self, predicate, timeout: float = 60.0) -> list[str]:
        """Receive until `predicate(messages)` holds; fail after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not predicate(self.messages):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; systemd heard: {self.messages}")
            self.sock.settimeout(left)
            self.messages.append(self.sock.recv(4096).decode())
        return self.messages

    def close(self) -> None:
        self.sock.close()


def first(messages: list[str], line: str) -> int:
    """Index of the first message holding `line` (a whole line)."""
    return next(i for i, m in enumerate(messages) if line in m.split("\n"))


def count(messages: list[str], prefix: str) -> int:
    return sum(1 for m in messages for line in m.split("\n") if line.startswith(prefix))


def copy_model(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    config = dst / "config.pbtxt"
    config.write_text(re.sub(r'name: "[^"]*"', f'name: "{dst.name}"', config.read_text(), count=1))


@pytest.fixture
def notify(tmp_path: Path):
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


def test_progress_extensions_ready_reload_and_stopping(small_repository: Path, tmp_path: Path,
                                                       notify: NotifySocket) -> None:
    repo = tmp_path / "repo"
    copy_model(small_repository / "addsub", repo / "addsub")
    copy_model(small_repository / "identity", repo / "gated")
    config = repo / "gated" / "config.pbtxt"
    config.write_text(config.read_text() + '\nparameters { key: "TORCHPOOL_PYTHON_MODULES" '
                                           'value { string_value: "gate.py" } }\n')
    gate = tmp_path / "open"
    (repo / "gated" / "gate.py").write_text(GATE.format(path=str(gate)))
    d = Daemon(repo, tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "0",
               env={"NOTIFY_SOCKET": notify.path})
    d.start(wait_ready=False)
    try:
        # `gated` is still loading: progress for addsub, and a second extension EXTEND_EVERY s later
        got = notify.until(lambda m: count(m, "EXTEND_TIMEOUT_USEC=") >= 2 and
                           any("STATUS=loading 1/2 model versions: addsub v1 READY" in x for x in m))
        assert count(got, "READY=1") == 0
        assert got[:2] == ["STATUS=loading 0/2 model versions", f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY * 1e6)}"]
        gate.touch()
        got = notify.until(lambda m: count(m, "READY=1") == 1)
        loaded = first(got, "STATUS=loading 2/2 model versions: gated v1 READY")
        ready = first(got, "READY=1")
        assert 1 < loaded < ready
        assert "STATUS=serving 2 of 2 model versions" in got[ready].split("\n")

        # systemctl reload: a new model in the repository, SIGHUP
        copy_model(small_repository / "addsub", repo / "addsub2")
        before = time.monotonic_ns() // 1000
        d.proc.send_signal(signal.SIGHUP)
        got = notify.until(lambda m: count(m, "READY=1") == 2)
        reloading = first(got, "RELOADING=1")
        lines = dict(line.split("=", 1) for line in got[reloading].split("\n"))
        assert before <= int(lines["MONOTONIC_USEC"]) <= time.monotonic_ns() // 1000
        assert lines["STATUS"] == "rescanning the model repository"
        again = len(got) - 1
        assert ready < reloading < again and "READY=1" in got[again].split("\n")
        assert "STATUS=serving 3 of 3 model versions" in got[again].split("\n")
        assert count(got[reloading:], "EXTEND_TIMEOUT_USEC=") >= 1      # the reload loads a model

        d.proc.send_signal(signal.SIGTERM)
        got = notify.until(lambda m: count(m, "STOPPING=1") == 1)
        assert first(got, "STOPPING=1") > again
        assert d.stop() == 0, d.log()
    finally:
        gate.touch()
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)


def test_reload_with_nothing_to_reload_answers_at_once(small_repository: Path, tmp_path: Path,
                                                       notify: NotifySocket) -> None:
    repo = tmp_path / "repo"
    copy_model(small_repository / "addsub", repo / "addsub")
    d = Daemon(repo, tmp_path, env={"NOTIFY_SOCKET": notify.path})
    d.start(wait_ready=False)
    try:
        notify.until(lambda m: count(m, "READY=1") == 1)
        d.proc.send_signal(signal.SIGHUP)
        got = notify.until(lambda m: count(m, "READY=1") == 2)
        reloading = first(got, "RELOADING=1")
        assert "STATUS=nothing to reload (none mode)" in got[reloading].split("\n")
        assert "READY=1" in got[reloading + 1].split("\n")
        assert count(got[reloading:], "EXTEND_TIMEOUT_USEC=") == 0
        assert d.stop() == 0, d.log()
        notify.until(lambda m: count(m, "STOPPING=1") == 1)
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)


def unit_settings() -> dict[str, list[str]]:
    """scripts/torchpool.service as key -> values (continued lines joined)."""
    text = (ROOT / "scripts" / "torchpool.service").read_text().replace("\\\n", " ")
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(" ".join(value.split()))
    return settings


def test_the_unit_file() -> None:
    unit = unit_settings()
    assert unit["Type"] == ["notify-reload"] and unit["NotifyAccess"] == ["main"]
    assert unit["EnvironmentFile"] == ["-/etc/default/torchpool"]
    assert unit["ExecStart"][0].startswith("/opt/torchpool/bin/torchpool serve ")
    assert unit["ExecStart"][0].endswith(" $TORCHPOOL_ARGS")
    assert "ExecReload" not in unit                  # notify-reload sends SIGHUP itself
    assert int(unit["TimeoutStartSec"][0]) > EXTEND_BY
    assert sorted(map(int, unit["RestartPreventExitStatus"][0].split())) == \
        [errors.USAGE, errors.REPOSITORY, errors.MODEL_LOAD]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="hiding the checkout takes a mount namespace of our own (root)")
def test_the_service_install_is_self_contained(small_repository: Path, tmp_path: Path) -> None:
    """The install recipe (docs/deploy.md, "Run it under systemd"): the
    service's own venv and a non-editable install. The unit's ExecStart
    (its paths put under tmp_path) then runs with the checkout's code and
    its .venv's programs hidden, as ProtectHome= hides a checkout under
    /home: before, the recipe copied the checkout with its editable .venv,
    whose torchpool was the original tree's. (The dependencies are the
    suite's, by a .pth into its site-packages, instead of being installed
    again: torch alone is 750 MB.)"""
    prefix, dist = tmp_path / "opt-torchpool", tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(dist), str(ROOT)], check=True, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "venv", str(prefix)], check=True, timeout=600)
    (wheel,) = dist.glob("torchpool-*.whl")
    subprocess.run([str(prefix / "bin" / "pip"), "install", "-q", "--no-deps", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    dependencies = sysconfig.get_paths()["purelib"]
    own = subprocess.run([str(prefix / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    Path(own, "suite-dependencies.pth").write_text(dependencies + "\n")
    assert (prefix / "bin" / "torchpool").read_text().splitlines()[0].startswith(f"#!{prefix / 'bin' / 'python'}")

    socket_path, metrics = tmp_path / "torchpool.sock", free_tcp_port()
    (command,) = unit_settings()["ExecStart"]
    argv = [a.replace("/opt/torchpool", str(prefix)).replace("/srv/models", str(small_repository))
            .replace("ipc:///run/torchpool/torchpool.sock", f"ipc://{socket_path}")
            for a in command.split() if a != "$TORCHPOOL_ARGS"]
    argv[argv.index("--metrics-port") + 1] = str(metrics)
    hidden = [ROOT / "torchpool", Path(sys.executable).parent.resolve()]     # the code, the suite venv's programs
    script = " && ".join(f"mount -t tmpfs none {p}" for p in hidden) + ' && exec "$@"'
    log = open(tmp_path / "service.log", "wb")
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script, "sh", *argv], cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: b"torchpool ready" in (tmp_path / "service.log").read_bytes() or proc.poll() is not None,
                 120, "the installed daemon to be ready")
        assert proc.poll() is None, (tmp_path / "service.log").read_text()
        with Client(f"ipc://{socket_path}", timeout=30) as c:
            a = np.arange(16, dtype=np.float32).reshape(1, 16)
            np.testing.assert_array_equal(c.infer("addsub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"], a + a)
        # what it runs is the install's, and nothing of the checkout
        maps = Path(f"/proc/{proc.pid}/maps").read_text() + Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert str(prefix) in maps and str(ROOT / "torchpool") not in maps
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        log.close()
    assert code == 0, (tmp_path / "service.log").read_text()
