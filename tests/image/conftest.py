"""What the image tests share: the image scripts/test-image built, a network
namespace for the containers (their "Pod IP"), the example models written by
the manifests' own init container, and CURVE keys.

These tests run only from scripts/test-image, which builds the image and
names it in TORCHPOOL_IMAGE; in the ordinary suite they are skipped.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
import zmq.auth

from ..support import netns, podman

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("TORCHPOOL_IMAGE", "")
DAEMON_UID = 10001          # the image's user (Dockerfile's USER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if IMAGE:
        return
    skip = pytest.mark.skip(reason="the image tests run from scripts/test-image, which builds the image")
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


def manifest(path: str, kind: str) -> dict:
    """The one resource of `kind` in ROOT/`path`."""
    (doc,) = [d for d in yaml.safe_load_all((ROOT / path).read_text()) if d and d["kind"] == kind]
    return doc


def owned_dir(path: Path, mode: int = 0o770) -> Path:
    """A directory of the daemon's uid and gid, as fsGroup makes a Pod's volumes."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, DAEMON_UID, DAEMON_UID)
    path.chmod(mode)
    return path


@pytest.fixture(scope="session")
def workdir():
    """A directory other users can enter (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="torchpool-image-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def pod_network():
    """One network namespace the containers join: ports they bind on 0.0.0.0
    are reached at its address, as a Pod's at its IP; nothing else is."""
    why = netns.unavailable()
    if why:
        pytest.fail(f"the image tests need a network namespace: {why}")
    with netns.Hosts(1) as hosts:
        yield hosts


def network_of(hosts: netns.Hosts) -> str:
    return f"ns:/run/netns/{hosts.names[0]}"


@pytest.fixture(scope="session")
def example_models(workdir: Path) -> Path:
    """/models as sidecar.yaml's init container writes it, run in the image."""
    spec = manifest("deploy/k8s/sidecar.yaml", "Deployment")["spec"]["template"]["spec"]
    (init,) = [c for c in spec["initContainers"] if c["name"] == "example-models"]
    models = owned_dir(workdir / "models", 0o755)
    podman.run(IMAGE, podman.unique("tp-example-models"), init, spec,
               {"models": models, **podman.memory_volumes(spec)}, "none", detach=False)
    assert (models / "addsub" / "config.pbtxt").exists()
    return models


@pytest.fixture(scope="session")
def curve_keys(workdir: Path) -> dict[str, Path]:
    """/keys for the container (server's secret readable by its uid, the
    authorized client keys) and the host client's own pair; mallory's key is
    not authorized."""
    keys = owned_dir(workdir / "keys", 0o750)
    authorized = owned_dir(keys / "authorized", 0o750)
    public, secret = zmq.auth.create_certificates(keys, "server")
    os.chown(secret, DAEMON_UID, DAEMON_UID)
    os.chmod(secret, 0o600)
    mine = workdir / "client-keys"
    mine.mkdir()
    client_public, client_secret = zmq.auth.create_certificates(mine, "client")
    _, mallory_secret = zmq.auth.create_certificates(mine, "mallory")
    shutil.copy(client_public, authorized / "client.key")
    return {"dir": keys, "server_public": Path(public), "client_secret": Path(client_secret),
            "mallory_secret": Path(mallory_secret)}
