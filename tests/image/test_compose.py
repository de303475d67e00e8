"""deploy/compose/compose.yaml brought up with podman-compose (scripts/test-image
installs it from PyPI and names it in PODMAN_COMPOSE): the models step, the
daemon and the example app sharing the socket directory, none with a network.
The app's answers must come, over the local shared-memory path; the daemon's
HEALTHCHECK passes; `down` removes every container and volume."""
from __future__ import annotations

import json
import os
import subprocess

from ..support import podman
from ..support.daemon import wait_for
from .conftest import IMAGE, ROOT

COMPOSE_FILE = ROOT / "deploy" / "compose" / "compose.yaml"
ANSWER = "addsub OUTPUT0[0, :4] = [0.0, 2.0, 4.0, 6.0] local: True"


def compose(project: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    tool = os.environ.get("PODMAN_COMPOSE")
    assert tool, "PODMAN_COMPOSE names podman-compose (scripts/test-image installs it)"
    done = subprocess.run([tool, "-p", project, "-f", str(COMPOSE_FILE), *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "TORCHPOOL_IMAGE": IMAGE})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def containers_of(project: str) -> dict[str, str]:
    """service -> container name, for the project's containers."""
    rows = json.loads(podman.podman("ps", "--all", "--format", "json", "--filter",
                                    f"label=io.podman.compose.project={project}").stdout or "[]")
    return {r["Labels"]["com.docker.compose.service"]: r["Names"][0] for r in rows}


def test_the_compose_sidecar_answers_over_the_local_path() -> None:
    project = podman.unique("tpcompose")
    try:
        compose(project, "up", "-d")
        names = containers_of(project)
        assert set(names) == {"models", "torchpool", "app"}, names
        app, daemon = podman.Container(names["app"]), podman.Container(names["torchpool"])
        wait_for(lambda: ANSWER in app.logs() or not app.running(), 180, "the app's first answer")
        assert ANSWER in app.logs(), app.logs()[-2000:] + daemon.logs()[-2000:]
        check = daemon.healthcheck()
        assert check.returncode == 0, check.stdout + check.stderr
        # nobody has a network: the socket directory is all they share
        for name in names.values():
            assert podman.Container(name).inspect()["HostConfig"]["NetworkMode"] == "none"
        assert podman.Container(names["models"]).inspect()["State"]["ExitCode"] == 0
    finally:
        compose(project, "down", "--volumes")
    assert containers_of(project) == {}
    volumes = podman.podman("volume", "ls", "--format", "{{.Name}}").stdout.split()
    assert not [v for v in volumes if v.startswith(project)], volumes
