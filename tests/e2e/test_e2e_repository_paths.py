"""Attack: a configuration naming files outside its model's directory (issue 32, item 3).

The daemon reads what a config names with its own rights (root's under
systemd). Before, an HTTP load whose config said `label_filename:
"../../etc/passwd"` answered that file's lines as class labels, a
`default_model_filename` outside the model directory was loaded, and
symlinks out of the repository were followed. Now every path a model uses
must resolve (symlinks followed) inside the model directory as resolved
(config/paths.py): the load fails naming the model and the field, and
nothing of the file reaches the caller. A model directory that is itself a
symlink (repository entries linked into a shared store) still serves.

Two daemons: one in explicit mode with the HTTP endpoint (load requests
with a config, Triton's client), one on a repository whose files on disk
do the same.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from torchpool import Classification, Client
from torchpool.examples import IDENTITY_CONFIG, Identity, build_example_repository, serialize, write_model

from ..support.daemon import Daemon, free_tcp_port

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

SECRET = "TOP-SECRET-LINE"
LEAVES = "leaves the model directory"
X = np.array([3.0, 1.0, 2.0], np.float32)      # the identity model's top class is index 0
IDENTITY = serialize(Identity())


def _outside(tmp_path: Path) -> Path:
    """Files no model may read: a secret, a model file, a config, a version directory."""
    outside = tmp_path / "outside"
    (outside / "version").mkdir(parents=True)
    (outside / "secret.txt").write_text(f"{SECRET}-1\n{SECRET}-2\n{SECRET}-3\n")
    (outside / "secret.bin").write_bytes(SECRET.encode().ljust(64, b"!"))
    (outside / "model.pt").write_bytes(IDENTITY)
    (outside / "version" / "model.pt").write_bytes(IDENTITY)
    (outside / "config.pbtxt").write_text(IDENTITY_CONFIG.replace('"identity"', '"config_link"'))
    return outside


def _identity(root: Path, name: str, output_extra: str = "") -> Path:
    """An identity model (FP32 [-1]) named `name`, with `output_extra` in its
    output entry; its labels.txt says 'inside-label'."""
    config = IDENTITY_CONFIG.replace('name: "identity"', f'name: "{name}"')
    if output_extra:
        head, tail = config.rsplit("dims: [ -1 ]\n", 1)
        config = head + "dims: [ -1 ]\n" + output_extra + tail
    write_model(root, name, config, IDENTITY)
    (root / name / "labels.txt").write_text("inside-label\n")
    return root / name


def _override(client, label_filename: str = "", **fields: object) -> str:
    config = client.get_model_config("identity")
    config["output"][0]["label_filename"] = label_filename
    config.update(fields)
    return json.dumps(config)


# --- load requests over HTTP -------------------------------------------------------------

def test_http_load_config_cannot_name_files_outside_the_model(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    build_example_repository(root)
    model_dir = root / "identity"
    outside = _outside(tmp_path)
    (model_dir / "labels.txt").write_text("inside-label\n")
    (model_dir / "secret_link.txt").symlink_to(outside / "secret.txt")
    (model_dir / "1" / "linked.pt").symlink_to(outside / "model.pt")
    (model_dir / "warmup").mkdir()
    (model_dir / "warmup" / "link.bin").symlink_to(outside / "secret.bin")
    port = free_tcp_port()
    d = Daemon(root, tmp_path, "--model-control-mode", "explicit", "--load-model", "identity",
               "--http-port", str(port), "--remote-model-control").start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=120)
    pid = d.pid()
    try:
        warmup = [{"name": "w", "batch_size": 1, "inputs": {"INPUT__0": {
            "data_type": "TYPE_FP32", "dims": ["16"], "input_data_file": "link.bin"}}}]
        attacks = {
            "output[0].label_filename": [
                _override(client, os.path.relpath(outside / "secret.txt", model_dir)),   # ../../outside/...
                _override(client, str(outside / "secret.txt")),                           # absolute
                _override(client, "secret_link.txt"),                                     # a symlink out
                _override(client, "1/../../../outside/secret.txt")],
            "default_model_filename": [
                _override(client, default_model_filename="linked.pt"),                    # 1/linked.pt -> out
                _override(client, default_model_filename=os.path.relpath(outside / "model.pt",
                                                                          model_dir / "1"))],
            "input_data_file": [_override(client, model_warmup=warmup)],
        }
        for field, configs in attacks.items():
            for config in configs:
                with pytest.raises(InferenceServerException) as caught:
                    client.load_model("identity", config=config)
                message = caught.value.message()
                assert caught.value.status() == "400", message
                assert "'identity'" in message and field in message, message
                assert LEAVES in message or "must be a file name" in message, message
                assert SECRET not in message and str(tmp_path) not in message, message
                # the serving version is untouched: no label, from anywhere
                result = client.infer("identity", [_tensor(X)],
                                      outputs=[httpclient.InferRequestedOutput("OUTPUT__0", class_count=1)])
                assert result.as_numpy("OUTPUT__0").tolist() == [b"3.000000:0"]

        # a label file inside the model directory is what a config may name
        client.load_model("identity", config=_override(client, "labels.txt"))
        result = client.infer("identity", [_tensor(X)],
                              outputs=[httpclient.InferRequestedOutput("OUTPUT__0", class_count=1)])
        assert result.as_numpy("OUTPUT__0").tolist() == [b"3.000000:0:inside-label"]
        assert d.pid() == pid and d.proc.poll() is None
        assert SECRET not in d.log()
    finally:
        client.close()
        assert d.stop() == 0, d.log()


def _tensor(array: np.ndarray) -> "httpclient.InferInput":
    t = httpclient.InferInput("INPUT__0", list(array.shape), "FP32")
    t.set_data_from_numpy(array)
    return t


# --- repository configs and links on disk ------------------------------------------------

def test_repository_files_that_leave_their_model_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    outside = _outside(tmp_path)
    _identity(root, "good")
    label_out = os.path.relpath(outside / "secret.txt", root / "label_out")
    _identity(root, "label_out", f'    label_filename: "{label_out}"\n')
    label_link = _identity(root, "label_link", '    label_filename: "labels.txt"\n')
    (label_link / "labels.txt").unlink()
    (label_link / "labels.txt").symlink_to(outside / "secret.txt")
    model_link = _identity(root, "model_link")
    (model_link / "1" / "model.pt").unlink()
    (model_link / "1" / "model.pt").symlink_to(outside / "model.pt")
    # no model.pt, and a model.pt2 (taken in its place) that is a link out: the worker refuses it
    pt2_link = _identity(root, "pt2_link")
    (pt2_link / "1" / "model.pt").unlink()
    (pt2_link / "1" / "model.pt2").symlink_to(outside / "model.pt")
    version_link = _identity(root, "version_link")
    shutil.rmtree(version_link / "1")
    (version_link / "1").symlink_to(outside / "version", target_is_directory=True)
    config_link = _identity(root, "config_link")
    (config_link / "config.pbtxt").unlink()
    (config_link / "config.pbtxt").symlink_to(outside / "config.pbtxt")
    # a model directory that is a link into a shared store: allowed, its files are inside it
    linked = _identity(tmp_path / "store", "linked", '    label_filename: "labels.txt"\n')
    (root / "linked").symlink_to(linked, target_is_directory=True)

    d = Daemon(root, tmp_path).start()
    try:
        with Client(d.url, timeout=60) as c:
            index = {row["name"]: row for row in c.repository_index()}
            expected = {"label_out": "output[0].label_filename", "label_link": "output[0].label_filename",
                        "model_link": "default_model_filename", "pt2_link": "default_model_filename",
                        "version_link": "version directory",
                        "config_link": "configuration file"}
            for model, field in expected.items():
                row = index[model]
                assert row["state"] == "UNAVAILABLE", row
                assert f"model '{model}'" in row["reason"] and field in row["reason"], row
                assert LEAVES in row["reason"] and SECRET not in row["reason"], row
            assert index["good"]["state"] == index["linked"]["state"] == "READY", index
            out = c.infer("linked", {"INPUT__0": X}, outputs=[Classification("OUTPUT__0", 1)])
            assert out["OUTPUT__0"].tolist() == [b"3.000000:0:inside-label"]
        assert SECRET not in d.log()
    finally:
        assert d.stop() == 0, d.log()
