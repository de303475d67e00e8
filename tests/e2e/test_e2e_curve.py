"""tcp:// with ZeroMQ CURVE and a ZAP allow-list, against a real daemon.

Keys come from `torchpool keygen`. The daemon's tcp:// socket is a CURVE
server that lets in only the client keys of --curve-authorized-keys; its
ipc:// socket stays plain. A refused client gets no answer at the ZeroMQ
level, so its calls fail after their timeout with a message that says why;
the daemon logs each refusal and keeps serving everyone else. At startup, a
non-loopback tcp:// address without CURVE (unless --insecure-tcp) and any
unusable key file stop the daemon with one line and exit status 2.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq.auth

from torchpool.client import AsyncClient, Client, NoAnswer
from torchpool.examples import ADDSUB_CONFIG, IDENTITY_CONFIG, AddSub, Identity, serialize, write_model
from torchpool.protocol import errors

from ..support.daemon import ROOT, Daemon, free_tcp_port, wait_for

A = np.arange(16, dtype=np.float32).reshape(1, 16)
ADDSUB = {"INPUT0": A, "INPUT1": A}


def torchpool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchpool", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    done = torchpool("keygen", str(directory), "--name", name)
    assert done.returncode == 0, done.stderr
    return directory / f"{name}.key", directory / f"{name}.key_secret"


class Keys:
    def __init__(self, root: Path) -> None:
        self.server_public, self.server_secret = keygen(root / "server", "server")
        self.alice_public, self.alice_secret = keygen(root / "clients", "alice")
        self.mallory_public, self.mallory_secret = keygen(root / "clients", "mallory")
        self.authorized = root / "authorized"
        self.authorized.mkdir()
        shutil.copy(self.alice_public, self.authorized / "alice.key")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("curve_repository")
    write_model(root, "addsub", ADDSUB_CONFIG.format(name="addsub", extra=""), serialize(AddSub()))
    write_model(root, "identity", IDENTITY_CONFIG, serialize(Identity()))
    return root


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def daemon(repository: Path, keys: Keys, tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(repository, tmp_path_factory.mktemp("curve_daemon"),
               "--curve-secret-key", str(keys.server_secret), "--curve-authorized-keys", str(keys.authorized),
               "--model-control-mode", "explicit", "--load-model", "*", "--remote-model-control",
               tcp_port=free_tcp_port()).start()
    yield d
    assert d.stop() == 0, d.log()


def tcp(d: Daemon) -> str:
    return next(u for u in d.urls if u.startswith("tcp://"))


# --- keys -------------------------------------------------------------------------------

def test_keygen_writes_a_pair_it_never_overwrites(keys: Keys) -> None:
    assert stat.S_IMODE(keys.server_secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.server_public.stat().st_mode) == 0o644
    public, secret = zmq.auth.load_certificate(keys.server_secret)
    assert zmq.auth.load_certificate(keys.server_public) == (public, None)   # the public file holds no secret
    assert zmq.curve_public(secret) == public and len(public) == 40
    assert "secret-key" not in keys.server_public.read_text()
    before = keys.server_secret.read_bytes()
    again = torchpool("keygen", str(keys.server_secret.parent), "--name", "server")
    assert again.returncode == 2 and "exists already" in again.stderr, again
    assert keys.server_secret.read_bytes() == before


# --- the authorised client ----------------------------------------------------------------

def test_an_authorised_client_works_over_tcp(daemon: Daemon, keys: Keys) -> None:
    with Client(tcp(daemon), timeout=30, local=False, server_key=keys.server_public,
                client_key=keys.alice_secret) as c:
        out = c.infer("addsub", ADDSUB)
        np.testing.assert_array_equal(out["OUTPUT0"], A + A)
        np.testing.assert_array_equal(out["OUTPUT1"], A - A)
        big = np.arange(1 << 18, dtype=np.float32)            # 1 MiB: payload frames, encrypted
        np.testing.assert_array_equal(c.infer("identity", {"INPUT__0": big})["OUTPUT__0"], big)
        # --remote-model-control: load and unload over tcp too, for an authorised client
        c.unload("identity")
        assert c.model_ready("identity") is False
        c.load("identity")
        assert c.model_ready("identity") is True
    # the same with the keys given as z85 text and a (public, secret) pair, on the asyncio client
    server_public = zmq.auth.load_certificate(keys.server_public)[0].decode()
    pair = zmq.auth.load_certificate(keys.alice_secret)

    async def run() -> None:
        async with AsyncClient(tcp(daemon), timeout=30, server_key=server_public, client_key=pair) as c:
            results = await asyncio.gather(*(c.infer("addsub", ADDSUB) for _ in range(8)))
            for out in results:
                np.testing.assert_array_equal(out["OUTPUT0"], A + A)
    asyncio.run(run())


def test_ipc_is_unaffected(daemon: Daemon, keys: Keys) -> None:
    with Client(daemon.url, timeout=30) as c:
        np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + A)
    # keys do not apply to ipc://: the daemon does not use CURVE there
    with Client(daemon.url, timeout=30, server_key=keys.server_public, client_key=keys.alice_secret) as c:
        np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + A)


# --- refused clients ------------------------------------------------------------------------

def test_refused_clients_fail_clearly_and_the_daemon_keeps_serving(daemon: Daemon, keys: Keys) -> None:
    url, timeout = tcp(daemon), 1.5
    cases = {
        "no key": ({}, "the server uses CURVE and this client has no server_key/client_key"),
        "wrong server key": ({"server_key": keys.mallory_public, "client_key": keys.alice_secret},
                             "check server_key (it must be the server's public key)"),
        "unauthorised key": ({"server_key": keys.server_public, "client_key": keys.mallory_secret},
                             "the server refused this client's CURVE key"),
    }
    outcome: dict = {}

    def attempt(case: str) -> None:
        kwargs, _ = cases[case]
        started = time.monotonic()
        try:
            with Client(url, timeout=timeout, local=False, **kwargs) as c:
                c.infer("addsub", ADDSUB)
            outcome[case] = ("answered", time.monotonic() - started)
        except NoAnswer as exc:
            outcome[case] = (exc, time.monotonic() - started)

    threads = [threading.Thread(target=attempt, args=(case,)) for case in cases]
    for t in threads:
        t.start()
    # meanwhile the authorised client is served
    with Client(url, timeout=30, local=False, server_key=keys.server_public, client_key=keys.alice_secret) as c:
        for _ in range(20):
            np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + A)
        for t in threads:
            t.join(30)
        for case, (_kwargs, why) in cases.items():
            exc, took = outcome[case]
            assert isinstance(exc, NoAnswer), (case, exc)
            assert exc.code == errors.UNAVAILABLE
            assert exc.message.startswith(f"no answer from torchpool at {url} within 1.5 s ("), exc.message
            assert why in exc.message, (case, exc.message)
            assert timeout <= took < timeout + 3, (case, took)
        np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + A)
    assert daemon.proc.poll() is None
    mallory = zmq.auth.load_certificate(keys.mallory_public)[0].decode()
    # (a client with no key at all is told why on its side, above; the daemon's monitor
    # sometimes sees only a connection that broke mid-handshake, logged at debug)
    for line in (f"CURVE: refused a client from 127.0.0.1: its public key {mallory} is not in "
                 f"{keys.authorized}",
                 f"CURVE: a client on {url} failed the handshake: it does not use this daemon's public key"):
        wait_for(lambda: line in daemon.log(), 10, f"the daemon's log line {line!r}")


def test_a_tcp_client_without_curve_is_told_where_to_look(repository: Path) -> None:
    """No daemon at all: the message names the address and the CURVE keys."""
    url = f"tcp://127.0.0.1:{free_tcp_port()}"
    with Client(url, timeout=0.3, local=False) as c:
        with pytest.raises(NoAnswer) as exc:
            c.server_live()
    assert exc.value.message == (f"no answer from torchpool at {url} within 0.3 s (is the server running "
                                 f"and listening there? if the server uses CURVE, check server_key/client_key)")


def test_bad_client_keys_fail_at_construction(keys: Keys) -> None:
    with pytest.raises(ValueError, match="server_key and client_key go together"):
        Client("tcp://127.0.0.1:1", server_key=keys.server_public)
    with pytest.raises(ValueError, match="holds no secret key"):
        Client("tcp://127.0.0.1:1", server_key=keys.server_public, client_key=keys.alice_public)
    with pytest.raises(ValueError, match="server_key: expected the server's public key"):
        Client("tcp://127.0.0.1:1", server_key="not a key", client_key=keys.alice_secret)
    with pytest.raises(ValueError, match="not the one of the secret key"):
        public = zmq.auth.load_certificate(keys.mallory_public)[0]
        secret = zmq.auth.load_certificate(keys.alice_secret)[1]
        Client("tcp://127.0.0.1:1", server_key=keys.server_public, client_key=(public, secret))


# --- startup ----------------------------------------------------------------------------

def refused(repository: Path, *args: str) -> str:
    """`serve` with these options stops at once: status 2 and one line, which is returned."""
    done = torchpool("serve", "--model-repository", str(repository), *args, timeout=30)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, lines)
    assert len(lines) == 1, lines
    return lines[0]


def test_startup_refuses_unusable_options(repository: Path, keys: Keys, tmp_path: Path) -> None:
    port = free_tcp_port()
    line = refused(repository, "--listen", f"tcp://0.0.0.0:{port}")
    assert f"refusing to listen on tcp://0.0.0.0:{port} without authentication" in line
    assert "--insecure-tcp" in line
    curve = ["--listen", f"tcp://127.0.0.1:{port}"]
    missing = tmp_path / "nowhere.key_secret"
    assert f"{missing}: no such key file" in refused(
        repository, *curve, "--curve-secret-key", str(missing), "--curve-authorized-keys", str(keys.authorized))
    assert f"{keys.server_public}: no secret key in this file" in refused(
        repository, *curve, "--curve-secret-key", str(keys.server_public),
        "--curve-authorized-keys", str(keys.authorized))
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    assert f"{garbage}: not a ZeroMQ CURVE certificate" in refused(
        repository, *curve, "--curve-secret-key", str(garbage), "--curve-authorized-keys", str(keys.authorized))
    truncated = tmp_path / "truncated.key_secret"
    truncated.write_text(keys.server_secret.read_text().replace('secret-key = "', 'secret-key = "xx'))
    assert f"{truncated}: its secret key is not a 40-character Z85 CURVE key" in refused(
        repository, *curve, "--curve-secret-key", str(truncated), "--curve-authorized-keys", str(keys.authorized))
    no_dir = tmp_path / "no_such_dir"
    assert f"{no_dir}: no such directory of authorized keys" in refused(
        repository, *curve, "--curve-secret-key", str(keys.server_secret), "--curve-authorized-keys", str(no_dir))
    bad_dir = tmp_path / "bad_authorized"
    bad_dir.mkdir()
    shutil.copy(keys.alice_public, bad_dir / "alice.key")
    (bad_dir / "broken.key").write_text("metadata\ncurve\n")
    assert f"{bad_dir / 'broken.key'}: not a ZeroMQ CURVE certificate" in refused(
        repository, *curve, "--curve-secret-key", str(keys.server_secret), "--curve-authorized-keys", str(bad_dir))
    assert "--curve-secret-key and --curve-authorized-keys go together" in refused(
        repository, *curve, "--curve-secret-key", str(keys.server_secret))
    if os.geteuid() != 0:                       # root reads any file
        unreadable = tmp_path / "unreadable.key_secret"
        shutil.copy(keys.server_secret, unreadable)
        unreadable.chmod(0)
        assert f"{unreadable}: cannot read the key file" in refused(
            repository, *curve, "--curve-secret-key", str(unreadable),
            "--curve-authorized-keys", str(keys.authorized))


def test_a_secret_key_others_can_read_is_refused(repository: Path, keys: Keys, tmp_path: Path) -> None:
    """As ssh refuses a private key others can read: the daemon does not
    start, and says the command that mends the mode; group bits (a
    Kubernetes Secret through fsGroup) start with a warning."""
    curve = ["--listen", f"tcp://127.0.0.1:{free_tcp_port()}", "--curve-authorized-keys", str(keys.authorized)]
    for mode in (0o644, 0o604, 0o601):
        exposed = tmp_path / f"exposed{mode:o}.key_secret"
        shutil.copy(keys.server_secret, exposed)
        exposed.chmod(mode)
        assert refused(repository, *curve, "--curve-secret-key", str(exposed)) == (
            f"torchpool: error: {exposed}: the secret key file is accessible to every user on this host "
            f"(mode {mode:04o}); refusing to use it: run 'chmod 600 {exposed}' and keep the key secret")
    group = tmp_path / "group.key_secret"
    shutil.copy(keys.server_secret, group)
    group.chmod(0o640)
    d = Daemon(repository, tmp_path, *curve, "--curve-secret-key", str(group)).start()
    try:
        assert (f"CURVE: the secret key file {group} can be read by its group (mode 0640)") in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_insecure_tcp_is_allowed_when_asked_for(repository: Path, tmp_path: Path) -> None:
    anywhere, loopback = free_tcp_port(), free_tcp_port()
    d = Daemon(repository, tmp_path, "--listen", f"tcp://0.0.0.0:{anywhere}",
               "--listen", f"tcp://127.0.0.1:{loopback}", "--insecure-tcp").start()
    try:
        log = d.log()
        assert (f"WARNING torchpool.broker: tcp://0.0.0.0:{anywhere} is unauthenticated and unencrypted "
                f"(--insecure-tcp)") in log, log
        assert f"tcp://127.0.0.1:{loopback} is unauthenticated and unencrypted (loopback" in log, log
        for port in (anywhere, loopback):
            with Client(f"tcp://127.0.0.1:{port}", timeout=30, local=False) as c:
                np.testing.assert_array_equal(c.infer("addsub", ADDSUB)["OUTPUT0"], A + A)
    finally:
        assert d.stop() == 0, d.log()
