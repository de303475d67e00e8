"""Containers for tests, started with podman the way a Kubernetes Pod spec
starts them (scripts/test-image builds the image and runs the tests that use
this; docs/deploy.md says what carries over to a real cluster).

`run(...)` turns one container of a manifest into `podman run` flags: the
Pod's and the container's securityContext (user, group, supplementary
groups, read-only root, capabilities, no privilege escalation), `command`
(the ENTRYPOINT) and `args`, `env`, and each volumeMount, from what the test
says each volume is here: a directory of the host (bind mount) or memory
(a tmpfs of the volume's sizeLimit). What podman cannot do here: probes (the
test asks the same URLs itself), resource limits (cgroups v1 hybrid mode),
the kubelet's restarts.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

PODMAN_TIMEOUT = 180


def podman(*args: str, timeout: float = PODMAN_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


@dataclass
class Memory:
    """An emptyDir with medium: Memory, as a tmpfs of `size` bytes."""
    size: int


Volume = Union[Path, Memory]       # a host directory to bind, or memory


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity ("1Gi", "512M", "16Mi") in bytes."""
    number, unit = re.fullmatch(r"(\d+)([KMG]i?)?", quantity).groups()
    return int(number) * {None: 1, "K": 10**3, "M": 10**6, "G": 10**9,
                          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[unit]


def memory_volumes(pod: dict) -> dict[str, Memory]:
    """The Pod's emptyDirs of medium Memory, each as the tmpfs it is."""
    return {v["name"]: Memory(quantity_bytes(v["emptyDir"].get("sizeLimit", "64Mi")))
            for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"}


def flags(container: dict, pod: dict, volumes: dict[str, Volume]) -> list[str]:
    """The `podman run` flags (before the image) and arguments (after it) of
    one container: returns flags + ["IMAGE"] + args, IMAGE a placeholder."""
    out: list[str] = []
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    if "runAsUser" in security:
        out += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"]
    for group in pod.get("securityContext", {}).get("supplementalGroups", []):
        out += ["--group-add", str(group)]
    if security.get("readOnlyRootFilesystem"):
        out.append("--read-only")
    if security.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    caps = security.get("capabilities", {})
    for cap in caps.get("drop", []):
        out += ["--cap-drop", cap]
    for cap in caps.get("add", []):
        out += ["--cap-add", cap]
    for e in container.get("env", []):
        out += ["--env", f"{e['name']}={e['value']}"]
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]]
        path = mount["mountPath"]
        if isinstance(source, Memory):
            out += ["--mount", f"type=tmpfs,destination={path},tmpfs-size={source.size}"]
        else:
            out += ["--volume", f"{source}:{path}" + (":ro" if mount.get("readOnly") else "")]
    if "command" in container:
        out += ["--entrypoint", json.dumps(container["command"])]
    return out + ["IMAGE"] + list(container.get("args", []))


class Container:
    """One container podman runs (detached); removed by `remove()`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def inspect(self) -> dict:
        return json.loads(podman("inspect", self.name).stdout)[0]

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def running(self) -> bool:
        return self.inspect()["State"]["Running"]

    def healthcheck(self) -> subprocess.CompletedProcess:
        """The image's HEALTHCHECK, run once (no systemd here to run it on a timer)."""
        return podman("healthcheck", "run", self.name, check=False)

    def stop(self, grace: int) -> int:
        """SIGTERM, SIGKILL after `grace` s (the Pod's terminationGracePeriodSeconds); the exit code."""
        podman("stop", "--time", str(grace), self.name, timeout=grace + 60)
        return self.inspect()["State"]["ExitCode"]

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)


def run(image: str, name: str, container: dict, pod: dict, volumes: dict[str, Volume], network: str,
        extra_flags: Optional[list[str]] = None, extra_args: Optional[list[str]] = None,
        detach: bool = True, timeout: float = PODMAN_TIMEOUT) -> Union[Container, subprocess.CompletedProcess]:
    """Start `container` of `pod` (their manifest dicts) from `image`, on
    `network` ("none", "host", or "ns:/run/netns/NAME"); `extra_flags` go
    before the image (a volume the manifest does not name), `extra_args`
    after the manifest's args. Detached: a Container; else the finished run."""
    spec = flags(container, pod, volumes)
    at = spec.index("IMAGE")
    argv = ["run", "--name", name, "--network", network, *spec[:at], *(extra_flags or []),
            # no systemd: the healthcheck is run by hand (Container.healthcheck)
            "--health-interval", "disable",
            *(["--detach"] if detach else ["--rm"]), image, *spec[at + 1:], *(extra_args or [])]
    done = podman(*argv, timeout=timeout, check=not detach)
    if not detach:
        return done
    if done.returncode != 0:
        podman("rm", "--force", name, check=False)
        raise AssertionError(f"podman run {name} failed:\n{done.stderr[-3000:]}")
    return Container(name)


def unique(prefix: str) -> str:
    """A container name no other test session uses."""
    return f"{prefix}-{os.getpid()}"
