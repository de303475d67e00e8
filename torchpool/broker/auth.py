"""Who may connect over tcp://: ZeroMQ CURVE with a ZAP allow-list.

    tcp:// ROUTER (CURVE server, ZAP domain "torchpool")
      │  handshake: the client proves it holds the secret half of its public key
      ▼
    ZAP handler (this module's thread, on inproc://zeromq.zap.01)
      allows a public key listed in --curve-authorized-keys (DIR/*.key),
      refuses any other (logged with the peer's address and key)
    handshakes that fail before ZAP is asked (a client with no key, or with
      the wrong server key) are logged too: `handshake_failed`, told by the
      frontend's monitor of the socket (libzmq allows one monitor a socket,
      and connections.py counts connections with it)

ipc:// sockets stay plain: the socket file's mode guards them. A tcp://
address without CURVE is allowed on loopback only, unless --insecure-tcp.

Keys are ZeroMQ certificate files as `zmq.auth.create_certificates` writes
them (`torchpool keygen DIR --name NAME`: NAME.key public, NAME.key_secret
secret, mode 0600). They are read once, at start.

libzmq lets a CURVE handshake through when no ZAP handler answers at all, so
the handler never stops while a CURVE socket is open: it is started before
the sockets bind and stopped after they close, and an error inside it refuses
the client (ZAP status 500) rather than ending the thread.
"""
from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Hashable, Literal, Optional, Sequence, Union, overload
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger("torchpool.broker")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"torchpool"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_LOG_EVERY = 60.0          # seconds: one line per refused peer (or failure kind) in this time
_inproc_ids = itertools.count()     # inproc names are never reused within the process
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class SecurityError(Exception):
    """The daemon's access options cannot be used as given: a one-line reason
    naming the file or address (the CLI exits with status 2)."""


# --- key files ---------------------------------------------------------------------------

def _z85_key(text: Optional[bytes], path: Path, what: str) -> bytes:
    if not text:
        raise SecurityError(f"{path}: no {what} in this file (expected a ZeroMQ certificate "
                            f"written by 'torchpool keygen')")
    try:
        if len(text) != 40 or len(z85.decode(text)) != 32:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise SecurityError(f"{path}: its {what} is not a 40-character Z85 CURVE key") from None
    return text


@overload
def read_certificate(path: Union[str, Path], secret: Literal[True]) -> tuple[bytes, bytes]: ...
@overload
def read_certificate(path: Union[str, Path], secret: Literal[False]) -> tuple[bytes, None]: ...
def read_certificate(path: Union[str, Path], secret: bool) -> tuple[bytes, Optional[bytes]]:
    """(public, secret) z85 keys of a certificate file; SecurityError naming
    the file when it is missing, unreadable or not a CURVE certificate
    (`secret`: the file must hold the secret key too)."""
    path = Path(path)
    if not path.is_file():
        raise SecurityError(f"{path}: no such key file")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise SecurityError(f"{path}: cannot read the key file: {exc.strerror or exc}") from None
    except ValueError:
        raise SecurityError(f"{path}: not a ZeroMQ CURVE certificate (no public-key line; "
                            f"write one with 'torchpool keygen')") from None
    public = _z85_key(public, path, "public key")
    if not secret:
        return public, None
    secret_key = _z85_key(secret_key, path, "secret key")
    if zmq.curve_public(secret_key) != public:
        raise SecurityError(f"{path}: its public key is not the one of its secret key")
    return public, secret_key


def read_authorized_keys(directory: Union[str, Path]) -> dict[bytes, str]:
    """The client public keys a directory allows: {z85 key: file name}, from
    every DIR/*.key file (SecurityError naming the first bad one)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SecurityError(f"{directory}: no such directory of authorized keys")
    try:
        files = sorted(p for p in directory.iterdir() if p.name.endswith(PUBLIC_SUFFIX))
    except OSError as exc:
        raise SecurityError(f"{directory}: cannot list the authorized keys: {exc.strerror or exc}") from None
    return {read_certificate(p, secret=False)[0]: p.name for p in files}


def keygen(directory: Union[str, Path], name: str) -> tuple[Path, Path]:
    """Write a new key pair: DIR/NAME.key (public, 0644) and DIR/NAME.key_secret
    (secret, 0600, created so: never readable by others, even for a moment).
    Existing files are never overwritten."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise SecurityError(f"invalid key name {name!r}: a plain file name is expected")
    public_file, secret_file = directory / (name + PUBLIC_SUFFIX), directory / (name + SECRET_SUFFIX)
    for path in (public_file, secret_file):
        if path.exists():
            raise SecurityError(f"{path} exists already: not overwriting it (choose another --name)")
    directory.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)        # pyzmq writes the files with open(); the umask makes them 0600
    try:
        written = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(written[0], 0o644)  # the public half is meant to be copied around
    os.chmod(written[1], 0o600)
    return Path(written[0]), Path(written[1])


# --- addresses ---------------------------------------------------------------------------

def is_tcp(url: str) -> bool:
    return url.startswith("tcp://")


def is_loopback(url: str) -> bool:
    """True when a tcp:// bind address can only be reached from this host:
    a loopback IP, `localhost`, the `lo` interface, or a name that resolves
    to loopback addresses only. `*` and anything unresolvable are not."""
    host = urlsplit(url).hostname or ""
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host or host == "*":
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False           # an interface name (eth0) or an unknown host
    # (an IP family's address is a str: only AF_UNIX's could be other, never resolved here)
    return bool(infos) and all(isinstance(a, str) and ipaddress.ip_address(a.split("%")[0]).is_loopback
                               for a in (i[4][0] for i in infos))


def check_listen(urls: Sequence[str], curve: bool, insecure_tcp: bool) -> None:
    """Refuse a non-loopback tcp:// address without CURVE unless --insecure-tcp."""
    if curve or insecure_tcp:
        return
    for url in urls:
        if is_tcp(url) and not is_loopback(url):
            raise SecurityError(f"refusing to listen on {url} without authentication: give "
                                f"--curve-secret-key and --curve-authorized-keys (torchpool keygen), "
                                f"or --insecure-tcp to accept any client that can reach it")


def check_options(urls: Sequence[str], curve_secret_key: Optional[str],
                  curve_authorized_keys: Optional[str], insecure_tcp: bool) -> Optional["CurveAuth"]:
    """Validate the access options before anything starts; a CurveAuth (keys
    loaded, nothing started) when CURVE is on, else None. SecurityError with
    a one-line reason otherwise."""
    if bool(curve_secret_key) != bool(curve_authorized_keys):
        raise SecurityError("--curve-secret-key and --curve-authorized-keys go together: the daemon's "
                            "secret key, and the directory of the client keys it allows")
    check_listen(urls, bool(curve_secret_key), insecure_tcp)
    if not curve_secret_key or not curve_authorized_keys:    # (both or neither: checked above)
        return None
    public, secret = read_certificate(curve_secret_key, secret=True)
    refuse_if_others_can_read(Path(curve_secret_key))
    allowed = read_authorized_keys(curve_authorized_keys)
    return CurveAuth(public, secret, allowed, Path(curve_secret_key), Path(curve_authorized_keys))


# --- the ZAP handler ---------------------------------------------------------------------

class _Throttle:
    """At most one log line per key per `every` seconds; counts the rest."""

    def __init__(self, every: float = _LOG_EVERY, keep: int = 1024) -> None:
        self.every, self.keep = every, keep
        self._last: dict[Hashable, tuple[float, int]] = {}

    def __call__(self, key: Hashable) -> Optional[int]:
        """None: stay quiet; else the number of events not logged since the last line."""
        now = time.monotonic()
        last, quiet = self._last.get(key, (-self.every - 1.0, 0))
        if now - last < self.every:
            self._last[key] = (last, quiet + 1)
            return None
        if len(self._last) >= self.keep and key not in self._last:
            self._last.pop(next(iter(self._last)))
        self._last[key] = (now, 0)
        return quiet


class CurveAuth:
    """This daemon's CURVE key pair and its allow-list, the ZAP handler thread
    that enforces it, and what it logs of the handshakes that fail."""

    def __init__(self, public: bytes, secret: bytes, allowed: dict[bytes, str], key_file: Path,
                 directory: Path) -> None:
        self.public, self.secret = public, secret
        self.allowed = allowed
        self.key_file, self.directory = key_file, directory
        self._zap: Optional[zmq.Socket[bytes]] = None
        self._wake: Optional[zmq.Socket[bytes]] = None       # ours: tells the thread to stop
        self._wake_peer: Optional[zmq.Socket[bytes]] = None  # the thread's end
        self._thread: Optional[threading.Thread] = None
        self._refused = _Throttle()
        self._failed = _Throttle()

    def secure(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], url: str) -> None:
        """Make `sock` (not bound yet) a CURVE server under our ZAP domain.
        Call for every socket before start(); its monitor's HANDSHAKE_EVENTS
        go to `handshake_failed`."""
        if self._thread is not None:
            raise RuntimeError("CurveAuth.secure() after start()")
        sock.curve_server = True
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.zap_domain = ZAP_DOMAIN

    def start(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Bind the ZAP handler (before any CURVE socket binds) and run it."""
        self._zap = zap = ctx.socket(zmq.REP)
        zap.linger = 0
        zap.bind(ZAP_ENDPOINT)
        pipe = f"inproc://torchpool.auth.{next(_inproc_ids)}"
        self._wake = ctx.socket(zmq.PAIR)
        self._wake.linger = 0
        self._wake.bind(pipe)
        self._wake_peer = wake_peer = ctx.socket(zmq.PAIR)
        wake_peer.linger = 0
        wake_peer.connect(pipe)
        self._thread = threading.Thread(target=self._run, args=(zap, wake_peer), name="torchpool-zap",
                                        daemon=True)
        self._thread.start()
        log.info("CURVE on tcp://: server key %s, %d client keys allowed from %s",
                 self.key_file, len(self.allowed), self.directory)
        if not self.allowed:
            log.warning("CURVE: %s holds no client key (*.key): every tcp:// client will be refused",
                        self.directory)
        _warn_if_group_can_read(self.key_file)

    def stop(self) -> None:
        """Stop the handler (after the CURVE sockets are closed) and close
        every socket of ours. The thread never closes the ZAP socket itself:
        if it ended by accident, the socket stays bound and unanswered, and
        handshakes wait instead of passing."""
        if self._thread is not None:
            assert self._wake is not None    # start() made it before the thread
            try:
                self._wake.send(b"stop")
            except zmq.ZMQError:
                pass
            self._thread.join(10)
            self._thread = None
        for sock in (self._zap, self._wake, self._wake_peer):
            if sock is not None:
                sock.close(0)
        self._zap = self._wake = self._wake_peer = None

    # -- the thread

    def _run(self, zap: zmq.Socket[bytes], wake_peer: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(wake_peer, zmq.POLLIN)
        poller.register(zap, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
                if wake_peer in ready:
                    return
                if zap in ready:
                    self._answer_zap(zap)
            except zmq.ContextTerminated:
                return
            except Exception:
                log.exception("CURVE: the ZAP handler failed; tcp:// handshakes wait until restart")
                return

    def _answer_zap(self, zap: zmq.Socket[bytes]) -> None:
        request = zap.recv_multipart()
        try:
            status, text, user = self._decide(request)
        except Exception:   # never end the thread: libzmq would let clients in without ZAP
            log.exception("CURVE: the ZAP request could not be handled; refusing the client")
            status, text, user = b"500", b"Internal error", b""
        request_id = request[1] if len(request) > 1 else b""
        zap.send_multipart([b"1.0", request_id, status, text, user, b""])

    def _decide(self, request: list[bytes]) -> tuple[bytes, bytes, bytes]:
        if len(request) < 6 or request[0] != b"1.0":
            return b"400", b"Malformed ZAP request", b""
        _version, _rid, domain, address, _identity, mechanism, *credentials = request
        peer = address.decode("utf-8", "replace")
        if domain != ZAP_DOMAIN or mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return b"400", b"CURVE required", b""
        key = z85.encode(credentials[0])
        name = self.allowed.get(key)
        if name is not None:
            log.debug("CURVE: allowed client key %s (%s) from %s", key.decode(), name, peer)
            return b"200", b"OK", name.encode()
        quiet = self._refused((peer, key))
        if quiet is not None:
            log.warning("CURVE: refused a client from %s: its public key %s is not in %s%s",
                        peer, key.decode(), self.directory,
                        f" ({quiet} more refusals not logged)" if quiet else "")
        return b"400", b"Client key not authorized", b""

    def handshake_failed(self, url: str, kind: int, value: int) -> None:
        """A monitor event of HANDSHAKE_EVENTS on the socket of `url`: logged (throttled)."""
        level = logging.WARNING
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:   # the connection broke (value: errno)
            level = logging.DEBUG
            why = f"the connection failed during the handshake ({os.strerror(value)})"
        elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            why = "it uses no CURVE key (give the client server_key and client_key)"
        elif value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            why = "it does not use this daemon's public key as its server_key"
        else:
            why = f"ZMTP protocol error {value:#x}"
        quiet = self._failed((url, why))
        if quiet is not None:
            log.log(level, "CURVE: a client on %s failed the handshake: %s%s", url, why,
                    f" ({quiet} more not logged)" if quiet else "")


def refuse_if_others_can_read(path: Path) -> None:
    """A secret key file anyone on the host may read is no secret: refused,
    as ssh refuses such a private key, with the command that mends it.
    (Group bits are only warned about: a Kubernetes Secret volume reaches a
    non-root daemon through its fsGroup, mode 0440.)"""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise SecurityError(f"{path}: cannot read the key file: {exc.strerror or exc}") from None
    if mode & stat.S_IRWXO:
        raise SecurityError(f"{path}: the secret key file is accessible to every user on this host "
                            f"(mode {stat.S_IMODE(mode):04o}); refusing to use it: run 'chmod 600 {path}' "
                            f"and keep the key secret")


def _warn_if_group_can_read(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & stat.S_IRWXG:
        log.warning("CURVE: the secret key file %s can be read by its group (mode %04o); "
                    "chmod 600 it unless that group is meant to hold it", path, stat.S_IMODE(mode))
