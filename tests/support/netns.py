"""Network namespaces for tests: one per simulated host, each joined to the
root namespace by a veth pair, with private addresses that exist only on
those links.

    root namespace                     namespace tp<id>h<i>
    veth tp<id>r<i>  10.X.Y.(4i+1)/30 ◄──► veth eth0  10.X.Y.(4i+2)/30

Only root can make them. The /24 (10.211-10.226.Y.0) is picked per test
session from what the root namespace does not route yet, so two sessions on
one machine never share addresses; nothing is ever sent to an address the
test did not put on one of its own links. `cut(i)` takes the namespace's
end of the link down: the root side still sends, and what it sends is lost
(as to a host whose network died), so nothing tells a peer the connection
is gone; `heal(i)` brings it back.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from typing import Optional

from .daemon import wait_for

IP_TIMEOUT = 30.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=check)


def ensure_iproute2() -> Optional[str]:
    """Install iproute2 with apt when `ip` is missing (root only); the reason
    when it still is not there."""
    if shutil.which("ip"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "`ip` (iproute2) is not installed and this user cannot install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "iproute2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            return f"`ip` is missing and `{' '.join(cmd)}` failed: {done.stderr.strip()[-300:]}"
    return None if shutil.which("ip") else "`ip` is still missing after installing iproute2"


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.211.0.0-10.226.255.0 that no route of the root namespace touches."""
    routed = []
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            word = line.split()[1]
        if word == "default":
            word = "0.0.0.0/0"
        try:
            routed.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    start = os.getpid() % 4096
    for k in range(4096):
        n = (start + k) % 4096
        subnet = ipaddress.ip_network(f"10.{211 + n // 256}.{n % 256}.0/24")
        if not any(subnet.overlaps(r) for r in routed if r.prefixlen > 0):
            return subnet
    raise RuntimeError("no free /24 in 10.211.0.0-10.226.255.0 for the test's namespaces")


class Hosts:
    """`count` network namespaces, each a host at `address(i)`; a context
    manager that removes them (and their links) on exit."""

    def __init__(self, count: int) -> None:
        tag = f"{os.getpid():x}"[-6:]
        self.names = [f"tp{tag}h{i}" for i in range(count)]
        self.links = [f"tp{tag}r{i}" for i in range(count)]        # the root namespace's ends
        self.subnet = _free_subnet()
        base = int(self.subnet.network_address)
        self._root_ends = [str(ipaddress.ip_address(base + 4 * i + 1)) for i in range(count)]
        self._host_ends = [str(ipaddress.ip_address(base + 4 * i + 2)) for i in range(count)]
        self._made: list[str] = []

    def __enter__(self) -> "Hosts":
        try:
            for i, (name, link) in enumerate(zip(self.names, self.links)):
                _ip("netns", "add", name)
                self._made.append(name)
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("addr", "add", f"{self._root_ends[i]}/30", "dev", link)
                _ip("link", "set", link, "up")
                _ip("-n", name, "addr", "add", f"{self._host_ends[i]}/30", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._made:
            # a link left down would keep the namespace alive as long as its
            # sockets try to say goodbye through it
            _ip("-n", name, "link", "set", "eth0", "up", check=False)
            _ip("netns", "del", name, check=False)
        self._made.clear()
        # a namespace's links go when the kernel frees it, a moment after `netns del`
        wait_for(lambda: not any(self._link_exists(link) for link in self.links), 30,
                 "the test's veth links to be removed")

    @staticmethod
    def _link_exists(link: str) -> bool:
        return _ip("link", "show", link, check=False).returncode == 0

    def address(self, i: int) -> str:
        """Host `i`'s address (inside its namespace)."""
        return self._host_ends[i]

    def run_prefix(self, i: int) -> list[str]:
        """Prepend to a command to run it on host `i` (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        """Host `i` drops off the network: its end of the link goes down."""
        _ip("-n", self.names[i], "link", "set", "eth0", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.names[i], "link", "set", "eth0", "up")


def unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    missing = ensure_iproute2()
    if missing:
        return missing
    probe = f"tp{os.getpid():x}probe"[-15:]
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None
