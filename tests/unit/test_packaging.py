"""`pip install torchpool` (no extras) is the client library: numpy, pyzmq,
msgpack and posix_ipc, and no torch.

The install test builds the package from this checkout into a fresh venv
the way a user's service would get it (pip, build isolation, the configured
index), checks what came with it, then talks to a real daemon (run from the
suite's own venv, which has the server extras) with that venv's python.
"""
from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..support.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]

# import names of what a client install holds besides torchpool itself
CLIENT_DISTRIBUTIONS = {"numpy", "pyzmq", "msgpack", "posix_ipc"}
SERVER_DISTRIBUTIONS = {"torch", "httptools", "grpcio", "protobuf", "uvloop", "setproctitle"}


def requirement_name(line: str) -> str:
    """'tritonclient[http,grpc]>=2.40' -> 'tritonclient' (PEP 503 normalised)."""
    name = line.split(";")[0]
    for stop in "[<>=!~ ":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-")


def requirements(value: str) -> dict[str, str]:
    """A setup.cfg requirement list as {normalised name: the whole line}."""
    lines = [line.strip() for line in value.splitlines()]
    return {requirement_name(line): line for line in lines if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    return cfg


def test_the_plain_install_is_the_client(setup_cfg: configparser.ConfigParser) -> None:
    plain = requirements(setup_cfg["options"]["install_requires"])
    assert set(plain) == {requirement_name(n) for n in CLIENT_DISTRIBUTIONS}, plain


def test_the_server_extra_holds_torch_and_the_gateways(setup_cfg: configparser.ConfigParser) -> None:
    extras = setup_cfg["options.extras_require"]
    server = requirements(extras["server"])
    assert set(server) == {requirement_name(n) for n in SERVER_DISTRIBUTIONS}, server
    # a range wide enough for any torch 2 build the user already has
    assert server["torch"].replace(" ", "") == "torch>=2.1,<3"
    test = requirements(extras["test"])
    assert "torchpool[server]" in test.values(), "the suite runs the daemon: [test] needs [server]"
    assert {"pytest", "tritonclient", "prometheus-client", "kubernetes-validate", "pyyaml"} <= set(test)
    assert set(requirements(extras["plot"])) == {"matplotlib"}
    # nothing pinned exactly: the package lives beside other packages' pins
    every = [line for value in extras.values() for line in requirements(value).values()]
    assert not [line for line in every + list(server.values()) if "==" in line]


def test_type_hints_are_shipped(setup_cfg: configparser.ConfigParser) -> None:
    assert (ROOT / "torchpool" / "py.typed").is_file()
    assert "py.typed" in setup_cfg["options.package_data"]["torchpool"]


def test_the_setup_script_pins_torch_from_constraints() -> None:
    """scripts/_setup_env.sh installs constraints.txt's torch first and checks
    every extra's module: a venv without uvloop reinstalls instead of failing CI."""
    script = (ROOT / "scripts" / "_setup_env.sh").read_text()
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch==")]
    assert len(pins) == 1, "constraints.txt must pin exactly one torch"
    assert "-e \"$ROOT[server,test,plot]\"" in script
    assert script.index("$torch_pin") < script.index("[server,test,plot]")
    for module in ("torch", "uvloop", "setproctitle", "httptools", "grpc", "kubernetes_validate", "matplotlib",
                   "mypy", "ruff"):
        assert module in script.split("check=", 1)[1].split("if [", 1)[0], module


def copy_source(destination: Path) -> None:
    """What the source distribution holds, without this checkout's build outputs
    (compiled extensions, caches), so the install builds everything itself."""
    for name in ("setup.cfg", "setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, destination / name)
    shutil.copytree(ROOT / "torchpool", destination / "torchpool",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))


def clean_environment() -> dict[str, str]:
    """The suite's environment without what would let the fresh venv see the
    suite's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with `pip install <checkout>` and no extras; its python."""
    root = tmp_path_factory.mktemp("client-install")
    source = root / "src"
    source.mkdir()
    copy_source(source)
    venv = root / "venv"
    # no pip in the venv: the suite's pip installs into it (--python), which
    # saves the seconds ensurepip takes
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--disable-pip-version-check", "--no-warn-script-location", str(source)],
        capture_output=True, text=True, timeout=600, env=clean_environment())
    assert install.returncode == 0, f"pip install of the client failed:\n{install.stdout}\n{install.stderr}"
    return python


def run_in(python: Path, script: str, cwd: Path) -> str:
    """Run `script` with the fresh venv's python, outside the checkout (so
    the checkout's torchpool is not on its path); return its stdout."""
    done = subprocess.run([str(python), "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=clean_environment())
    assert done.returncode == 0, f"the client venv's script failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_client_install_has_no_torch(client_python: Path, tmp_path: Path) -> None:
    found = json.loads(run_in(client_python, """
        import importlib.metadata, importlib.util, json, pathlib, sys
        import torchpool, torchpool.client
        names = sorted(d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions())
        print(json.dumps({
            "distributions": names,
            "torch": importlib.util.find_spec("torch") is not None,
            "imported": sorted(m for m in sys.modules if m.split(".")[0] in
                               ("torch", "grpc", "httptools", "google", "uvloop", "setproctitle")),
            "package": str(pathlib.Path(torchpool.__file__).parent),
            "py_typed": (pathlib.Path(torchpool.__file__).parent / "py.typed").is_file(),
            "extensions": [importlib.util.find_spec(m) is not None for m in
                           ("torchpool.shm._streamcopy", "torchpool.protocol._bytescan")],
        }))
        """, tmp_path))
    assert found["torch"] is False
    assert set(found["distributions"]) == {"torchpool"} | {requirement_name(n) for n in CLIENT_DISTRIBUTIONS}
    assert found["imported"] == []
    assert found["package"].startswith(str(client_python.parent.parent)), found["package"]
    assert found["py_typed"] is True
    # built from source without torch (a C compiler is on every machine that runs this suite)
    assert found["extensions"] == [True, True]


def test_the_client_install_answers_a_real_daemon(client_python: Path, small_repository: Path,
                                                  tmp_path: Path) -> None:
    daemon = Daemon(small_repository, tmp_path).start()
    try:
        answer = json.loads(run_in(client_python, f"""
            import json, sys
            import numpy as np
            from torchpool.client import Client
            a = np.arange(16, dtype=np.float32).reshape(1, 16)
            b = np.full((1, 16), 0.5, np.float32)
            with Client({daemon.url!r}, timeout=60) as client:
                with client.infer("addsub", {{"INPUT0": a, "INPUT1": b}}) as out:
                    sums, differences = out["OUTPUT0"].tolist(), out["OUTPUT1"].tolist()
                with client.infer("strings", {{"INPUT__0": ["torch", "pool"]}}) as out:
                    words = [bytes(w).decode() for w in out["OUTPUT__0"]]
            print(json.dumps({{"sum": sums, "difference": differences, "words": words,
                              "torch": "torch" in sys.modules}}))
            """, tmp_path))
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert answer["sum"] == [[i + 0.5 for i in range(16)]]
    assert answer["difference"] == [[i - 0.5 for i in range(16)]]
    assert answer["words"] == ["TORCH", "POOL"]
    assert answer["torch"] is False


def test_a_client_install_refuses_to_serve_in_one_line(client_python: Path, small_repository: Path,
                                                       tmp_path: Path) -> None:
    """`torchpool serve` without the server extra says what to install, before anything starts."""
    done = subprocess.run([str(client_python), "-m", "torchpool", "serve", "--model-repository",
                           str(small_repository), "--listen", f"ipc://{tmp_path}/t.sock"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=clean_environment())
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "torchpool: error: torch not installed: the daemon needs pip install 'torchpool[server]'"]
