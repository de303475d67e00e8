"""The project's image, built from the Dockerfile by scripts/test-image, run
for real with podman as the manifests start it.

- The sidecar's daemon (deploy/k8s/sidecar.yaml: its args, uid and gid,
  securityContext, the socket directory as a shared volume, /dev/shm as
  memory), with the CURVE tcp listener docs/deploy.md adds, in a network
  namespace of its own (its "Pod IP"). From the host: its HEALTHCHECK, health
  and metrics over HTTP, an inference over tcp with CURVE (and a refused key),
  and clients on the host that see the socket directory where the app
  container would (/run/torchpool, in a mount namespace of their own): as
  the Pod's uid, and as another uid in the daemon's group (the DaemonSet's
  node-local clients). Their answers took the local shared-memory path:
  sealed memfds over the side channel, across the container boundary and
  podman's default seccomp profile.
- KServe's layout (deploy/kserve/cluster-serving-runtime.yaml): the runtime's
  container with the repository read-only at /mnt/models, answering KServe
  v2 over HTTP on 8080 and gRPC on 9000.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from torchpool.client import Client, NoAnswer
from torchpool.protocol import errors

from ..support import podman
from ..support.daemon import wait_for
from ..support.kserve_v2 import http_status, infer_addsub_over_http_and_grpc
from .conftest import DAEMON_UID, IMAGE, ROOT, manifest, network_of, owned_dir

SOCKET_DIR = "/run/torchpool"
READY_TIMEOUT = 180       # six models load in the container (minutes on a busy machine)
A = np.arange(16, dtype=np.float32).reshape(1, 16)
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x0010     # 0x10: F_SEAL_FUTURE_WRITE


def pod_spec(path: str) -> dict:
    return manifest(path, "Deployment")["spec"]["template"]["spec"]


def test_the_image_is_what_the_dockerfile_says() -> None:
    (info,) = json.loads(podman.podman("image", "inspect", IMAGE).stdout)
    config = info["Config"]
    assert config["User"] == f"{DAEMON_UID}:{DAEMON_UID}"
    assert config["Entrypoint"] == ["torchpool", "serve"]
    assert "--model-repository" in config["Cmd"]
    # HEALTHCHECK survives only in the docker format (podman build --format docker)
    assert info["Healthcheck"]["Test"][:2] == ["CMD", "python"]
    assert {"8000/tcp", "8001/tcp", "8002/tcp", "8555/tcp"} <= set(config["ExposedPorts"])
    print(f"\nimage {IMAGE}: {info['Size'] / 1e9:.2f} GB", file=sys.stderr)
    # torch is the CPU build the constraints pin, and the C extensions were built
    check = ("import torch, torchpool.shm._sigbus, torchpool.shm._streamcopy, torchpool.protocol._bytescan, "
             "torchpool.worker._outcapture; print(torch.__version__)")
    done = podman.podman("run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE, "-c", check)
    pin = next(line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
               if line.startswith("torch=="))
    assert done.stdout.strip() == f"{pin}+cpu"


# --- the sidecar's daemon ---------------------------------------------------------------

HOST_CLIENT = textwrap.dedent('''
    import fcntl, json, os, re, sys
    import numpy as np
    from torchpool import Client
    LENT = re.compile(r"memfd:(torchpool\\.\\S+\\.w\\d+\\.l\\d+)")    # a worker's lending area
    x = np.arange(1 << 20, dtype=np.float32)                 # 4 MiB: through the arena, lent back
    with Client(sys.argv[1], timeout=60) as c:
        before = c.server_metadata()["transfer"]
        out = c.infer("clone", {"INPUT__0": x})
        y = out["OUTPUT__0"]
        seals = {}
        for fd in os.listdir("/proc/self/fd"):
            m = LENT.search(os.readlink(f"/proc/self/fd/{fd}")) if os.path.exists(f"/proc/self/fd/{fd}") else None
            if m:
                seals[m.group(1)] = fcntl.fcntl(int(fd), fcntl.F_GET_SEALS)
        print(json.dumps({
            "uid": os.getuid(), "groups": os.getgroups(), "local": c.is_local,
            "right": bool((y == x).all()), "writeable": bool(y.flags.writeable),
            "stats": c.transfer_stats(), "before": before, "after": c.server_metadata()["transfer"],
            "lent_maps": sorted(set(LENT.findall(open("/proc/self/maps").read()))), "lent_seals": seals}))
''')


def on_the_host(socket_dir: Path, argv: list[str], uid: int, gid: int, groups: list[int]) -> list[str]:
    """`argv` as uid:gid (+groups) on the host, in a mount namespace of its own
    where `socket_dir` is at /run/torchpool, as the app container sees it:
    the daemon names its side channel by the path it sees. (Every step execs
    the next: the process is `argv`'s.)"""
    setpriv = ["setpriv", "--reuid", str(uid), "--regid", str(gid)]
    setpriv += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    script = (f"mount -t tmpfs -o mode=0755 tmpfs /run && mkdir {SOCKET_DIR} && "
              f"mount --bind {socket_dir} {SOCKET_DIR} && exec \"$@\"")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *setpriv, *argv]


def run_on_the_host(socket_dir: Path, argv: list[str], uid: int, gid: int, groups: list[int]) -> str:
    done = subprocess.run(on_the_host(socket_dir, argv, uid, gid, groups), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def proc_status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line)


@pytest.fixture
def sidecar(pod_network, example_models: Path, curve_keys: dict, workdir: Path):
    """sidecar.yaml's torchpool container, plus a CURVE tcp listener (docs/deploy.md)."""
    spec = pod_spec("deploy/k8s/sidecar.yaml")
    (daemon,) = [c for c in spec["initContainers"] if c["name"] == "torchpool"]
    socket_dir = owned_dir(workdir / "sidecar-run")
    volumes = {**podman.memory_volumes(spec), "models": example_models, "torchpool-socket": socket_dir}
    container = podman.run(
        IMAGE, podman.unique("tp-sidecar"), daemon, spec, volumes, network_of(pod_network),
        extra_flags=["--volume", f"{curve_keys['dir']}:/keys:ro"],
        extra_args=["--listen=tcp://0.0.0.0:8555", "--curve-secret-key=/keys/server.key_secret",
                    "--curve-authorized-keys=/keys/authorized"])
    try:
        yield container, socket_dir, spec
    finally:
        logs = container.logs()
        container.remove()
        print(logs[-2000:], file=sys.stderr)


def test_the_sidecar_container_serves_http_curve_tcp_and_local_clients_on_the_host(
        sidecar, pod_network, curve_keys: dict) -> None:
    container, socket_dir, spec = sidecar
    ip = pod_network.address(0)
    wait_for(lambda: http_status(f"http://{ip}:8000/v2/health/ready") == 200 or not container.running(),
             READY_TIMEOUT, "the container's models to load")
    assert container.running(), container.logs()
    # health: the image's own HEALTHCHECK, and the probes' URLs from outside
    check = container.healthcheck()
    assert check.returncode == 0, check.stdout + check.stderr
    assert http_status(f"http://{ip}:8000/v2/health/live") == 200
    metrics = urllib.request.urlopen(f"http://{ip}:8002/metrics", timeout=10).read().decode()
    assert 'nv_inference_request_success{model="addsub",version="1"}' in metrics

    # what the daemon runs as, inside podman's default seccomp profile
    status = proc_status(container.inspect()["State"]["Pid"])      # its PID 1: torchpool serve
    assert status["Uid"].split()[0] == str(DAEMON_UID) and status["Seccomp"].strip() == "2"
    assert status["NoNewPrivs"].strip() == "1" and int(status["CapEff"], 16) == 0

    # tcp with CURVE from the host: bytes over the network, and a key not in the list refused
    url = f"tcp://{ip}:8555"
    with Client(url, timeout=30, server_key=curve_keys["server_public"],
                client_key=curve_keys["client_secret"]) as c:
        out = c.infer("addsub", {"INPUT0": A, "INPUT1": A}, copy=True)
        np.testing.assert_array_equal(out["OUTPUT0"], A + A)
        assert not c.is_local and c.transfer_stats()["bytes_inline"] == 2 * A.nbytes
    with Client(url, timeout=3, server_key=curve_keys["server_public"],
                client_key=curve_keys["mallory_secret"]) as c:
        with pytest.raises(NoAnswer) as refused:
            c.infer("addsub", {"INPUT0": A, "INPUT1": A})
        assert refused.value.code == errors.UNAVAILABLE

    # clients on the host through the shared socket directory: the Pod's uid
    # (the app container), and another uid in the daemon's group
    pod_uid = spec["securityContext"]["runAsUser"]
    for uid, gid, groups in ((pod_uid, pod_uid, []), (20001, 20001, [DAEMON_UID])):
        seen = json.loads(run_on_the_host(socket_dir, [sys.executable, "-c", HOST_CLIENT,
                                                       f"ipc://{SOCKET_DIR}/torchpool.sock"], uid, gid, groups))
        nbytes = 4 << 20
        assert seen["uid"] == uid and seen["local"] and seen["right"], seen
        # the input was copied into the arena the daemon handed over, not sent as bytes...
        assert seen["stats"] == {"bytes_copied": nbytes, "bytes_zero_copy": 0, "bytes_inline": 0}, seen
        assert seen["after"]["input_bytes_in_place"] - seen["before"].get("input_bytes_in_place", 0) == nbytes
        # ...and the output came back lent: the worker's memory mapped read-only in the client
        assert seen["after"]["output_bytes_lent"] - seen["before"].get("output_bytes_lent", 0) == nbytes
        assert seen["lent_maps"] and not seen["writeable"], seen
        # the memory lent is sealed: no size change, and no writes by anyone since it was mapped
        assert set(seen["lent_seals"]) == set(seen["lent_maps"]), seen
        assert all(v & SEALED == SEALED for v in seen["lent_seals"].values()), seen

    # the app container's own command (sidecar.yaml), run the same way, answers
    (app,) = spec["containers"]
    first = run_app_until_its_first_line(socket_dir, app, pod_uid)
    assert first.strip() == "addsub OUTPUT0[0, :4] = [0.0, 2.0, 4.0, 6.0]", first

    # SIGTERM drains and exits 0 within the Pod's grace period; the socket files go
    assert container.stop(spec["terminationGracePeriodSeconds"]) == 0, container.logs()
    assert not list(socket_dir.iterdir())


def run_app_until_its_first_line(socket_dir: Path, app: dict, uid: int) -> str:
    """The app's command loops forever: its first line, then SIGTERM, on which it exits 0."""
    assert app["command"][0] == "python"
    env = {**os.environ, **{e["name"]: e["value"] for e in app["env"]}}
    proc = subprocess.Popen(on_the_host(socket_dir, [sys.executable, *app["command"][1:]], uid, uid, []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    watchdog = threading.Timer(60, proc.kill)       # its Client has a 10 s timeout; this ends anything else
    watchdog.start()
    try:
        first = proc.stdout.readline()
        proc.terminate()
        assert proc.wait(30) == 0, proc.stderr.read()[-2000:]
        return first
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# --- KServe's layout --------------------------------------------------------------------

def test_the_default_container_refuses_an_unauthenticated_zeromq_tcp_client(pod_network, example_models: Path) -> None:
    """The image run as docs/deploy.md's `docker run` runs it, with its own
    command: KServe v2 over HTTP and gRPC from the network, and no ZeroMQ on
    tcp (its default once listened on tcp://0.0.0.0:8555 with --insecure-tcp:
    model control open to anyone who could reach it). A ZeroMQ tcp client
    gets no answer; the port refuses the connection."""
    (info,) = json.loads(podman.podman("image", "inspect", IMAGE).stdout)
    command = info["Config"]["Cmd"]
    assert "--insecure-tcp" not in command and not any(a.startswith("tcp://") for a in command), command
    container = podman.run(IMAGE, podman.unique("tp-default"), {}, {}, {}, network_of(pod_network),
                           extra_flags=["--shm-size", "1g", "--volume", f"{example_models}:/models:ro"])
    ip = pod_network.address(0)
    try:
        wait_for(lambda: http_status(f"http://{ip}:8000/v2/health/ready") == 200 or not container.running(),
                 READY_TIMEOUT, "the default container's models to load")
        assert container.running(), container.logs()
        infer_addsub_over_http_and_grpc(ip, 8000, 8001)
        with Client(f"tcp://{ip}:8555", timeout=3, local=False) as c:
            with pytest.raises(NoAnswer) as refused:
                c.infer("addsub", {"INPUT0": A, "INPUT1": A})
            assert refused.value.code == errors.UNAVAILABLE
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((ip, 8555), timeout=10).close()
        assert container.stop(45) == 0, container.logs()
    finally:
        container.remove()


def test_the_kserve_runtime_serves_mnt_models_over_http_and_grpc(pod_network, example_models: Path) -> None:
    runtime = manifest("deploy/kserve/cluster-serving-runtime.yaml", "ClusterServingRuntime")["spec"]
    (spec,) = runtime["containers"]
    pod = {"volumes": runtime["volumes"]}
    # what KServe adds: the storage initializer's volume, read-only at /mnt/models
    container = podman.run(IMAGE, podman.unique("tp-kserve"), spec, pod, podman.memory_volumes(pod),
                           network_of(pod_network), extra_flags=["--volume", f"{example_models}:/mnt/models:ro"])
    ip = pod_network.address(0)
    try:
        wait_for(lambda: http_status(f"http://{ip}:8080/v2/health/ready") == 200 or not container.running(),
                 READY_TIMEOUT, "the runtime's models to load")
        assert container.running(), container.logs()
        assert http_status(f"http://{ip}:8080/v2/models/addsub/ready") == 200
        infer_addsub_over_http_and_grpc(ip, 8080, 9000)
        port = runtime["annotations"]["prometheus.kserve.io/port"]
        metrics = urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10).read().decode()
        assert re.search(r'nv_inference_request_success\{model="addsub",version="1"\} 2\b', metrics), metrics
        assert container.stop(45) == 0, container.logs()
    finally:
        container.remove()
