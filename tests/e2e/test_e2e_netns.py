"""End to end across real networks: three daemons, each on a host of its own
(a network namespace joined to the root namespace by a veth pair), serving
tcp:// with CURVE, and one `Client([...], retries=1)` of all three in the
root namespace under load. One daemon is SIGKILLed; another drops off the
network (its link goes down: what is sent to it is lost and nothing says
so) and later comes back. No request may be lost or answered wrong, and the
time to fail over and to bring the healed daemon back must stay within what
the client's settings promise (docs/client.md, "Several daemons"):

  killed:       the kernel closes its connections; UNAVAILABLE at once
  cut off:      ZeroMQ's heartbeat drops the silent connection after
                HEARTBEAT_IVL_MS + HEARTBEAT_TIMEOUT_MS
  back:         a connect attempt gives up after CONNECT_TIMEOUT_MS, the next
                comes within RECONNECT_MAX_MS, and the health check (every
                health_interval, waiting PROBE_TIMEOUT) sees it ready

Skipped, with the reason, where network namespaces cannot be made (not root).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import zmq.auth

from torchpool.client import Client, MultiClient
from torchpool.client.common import CONNECT_TIMEOUT_MS, HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS, RECONNECT_MAX_MS
from torchpool.client.multi import PROBE_TIMEOUT
from torchpool.examples import ADDSUB_CONFIG, AddSub, serialize, write_model

from ..support import netns
from ..support.daemon import Daemon, wait_for
from ..support.load import Load

PORT = 8555
HEALTH_INTERVAL = 0.2
# scheduling on a noisy 2-core machine, the load's threads, the handshake
SLACK = 3.0

why_not = netns.unavailable()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no network namespaces here: {why_not}")


@pytest.fixture(scope="module")
def addsub_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("netns_repository")
    write_model(root, "addsub", ADDSUB_CONFIG.format(name="addsub", extra=""), serialize(AddSub()))
    return root


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    server = tmp_path / "server"
    clients = tmp_path / "clients"
    server.mkdir()
    clients.mkdir()
    public, secret = zmq.auth.create_certificates(server, "server")
    os.chmod(secret, 0o600)          # the daemon refuses a secret key others can read
    client_public, client_secret = zmq.auth.create_certificates(clients, "client")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "client.key").write_bytes(Path(client_public).read_bytes())
    return {"server_public": Path(public), "server_secret": Path(secret), "authorized": authorized,
            "client_secret": Path(client_secret)}


@pytest.fixture
def three_hosts(addsub_repository: Path, keys: dict[str, Path], tmp_path: Path):
    """A daemon on each of three hosts, CURVE on tcp://ADDRESS:8555."""
    with netns.Hosts(3) as hosts:
        daemons = []
        try:
            for i in range(3):
                workdir = tmp_path / f"host{i}"
                workdir.mkdir()
                d = Daemon(addsub_repository, workdir)
                d.url = f"tcp://{hosts.address(i)}:{PORT}"
                # tcp:// only, and no local side channel: a client on another
                # host could not reach one (here it could, through the file
                # system, and would then bypass the network)
                d.args = [*hosts.run_prefix(i), sys.executable, "-m", "torchpool", "serve",
                          "--model-repository", str(addsub_repository), "--listen", d.url,
                          "--local-socket", "", "--curve-secret-key", str(keys["server_secret"]),
                          "--curve-authorized-keys", str(keys["authorized"])]
                daemons.append(d.start(wait_ready=False))
            for d in daemons:
                wait_for(lambda: "torchpool ready" in d.log() or d.proc.poll() is not None, 60,
                         "the daemon's ready line")
                assert d.proc.poll() is None, d.log()
            yield hosts, daemons
        finally:
            for d in daemons:
                if d.proc is not None and d.proc.poll() is None:
                    assert d.stop() == 0, d.log()


def status(client: MultiClient, url: str) -> dict:
    return next(d for d in client.daemons() if d["url"] == url)


def test_a_killed_and_a_cut_off_daemon_lose_no_request_and_the_healed_one_comes_back(
        three_hosts, keys: dict[str, Path]) -> None:
    hosts, (killed, cut, steady) = three_hosts
    urls = [d.url for d in (killed, cut, steady)]
    partition_bound = (HEARTBEAT_IVL_MS + HEARTBEAT_TIMEOUT_MS) / 1000 + SLACK
    back_bound = (CONNECT_TIMEOUT_MS + RECONNECT_MAX_MS) / 1000 + HEALTH_INTERVAL + PROBE_TIMEOUT + SLACK
    figures = {}
    with Client(urls, timeout=30, retries=1, health_interval=HEALTH_INTERVAL,
                server_key=keys["server_public"], client_key=keys["client_secret"]) as c:
        with Load(c) as load:
            wait_for(lambda: all(status(c, u)["served"] >= 50 for u in urls), 60, "all three to serve")

            t = time.monotonic()
            killed.stop(signal.SIGKILL)
            wait_for(lambda: not status(c, killed.url)["up"], 30, "the killed daemon to be marked down")
            figures["killed: marked down (s)"] = time.monotonic() - t
            figures["killed: slowest call (s)"] = load.slowest_after(t)
            before = status(c, steady.url)["served"]
            wait_for(lambda: status(c, steady.url)["served"] >= before + 100, 30, "the others to serve on")

            t = time.monotonic()
            hosts.cut(1)
            wait_for(lambda: not status(c, cut.url)["up"], partition_bound + 30, "the cut-off daemon to be "
                     "marked down")
            figures["cut off: marked down (s)"] = time.monotonic() - t
            before = status(c, steady.url)["served"]
            wait_for(lambda: status(c, steady.url)["served"] >= before + 100, 30, "the survivor to serve on")
            figures["cut off: slowest call (s)"] = load.slowest_after(t)

            t = time.monotonic()
            hosts.heal(1)
            wait_for(lambda: status(c, cut.url)["up"], back_bound + 30, "the healed daemon to come back")
            figures["healed: back up (s)"] = time.monotonic() - t
            before = status(c, cut.url)["served"]
            wait_for(lambda: status(c, cut.url)["served"] >= before + 50, 30, "requests to reach it again")
            figures["healed: serving again (s)"] = time.monotonic() - t
        answered = sum(load.answered)
    print(f"\n{answered} requests answered; " + "; ".join(f"{k} {v:.2f}" for k, v in figures.items()),
          file=sys.stderr)
    assert load.errors == [] and load.wrong == [], (load.errors[:3], load.wrong[:3])
    assert figures["killed: slowest call (s)"] < SLACK, figures
    assert figures["cut off: marked down (s)"] < partition_bound, figures
    assert figures["cut off: slowest call (s)"] < partition_bound, figures
    assert figures["healed: back up (s)"] < back_bound, figures
