"""A TCP relay between clients and a server's port that keeps what the
clients send as it passes, nothing changed on the way: the bytes of each
connection, and for ZeroMQ clients (a daemon's tcp:// address) their
messages, read from the ZMTP 3 frames (NULL mechanism: no CURVE).

    with TcpRelay(port, zmtp=True) as relay:
        ... a client connects to 127.0.0.1:{relay.port} ...
        relay.messages()      # every ZeroMQ message the clients sent, each a list of frames
        relay.sent()          # the bytes each connection sent
"""
from __future__ import annotations

import socket
import threading
from typing import Callable

GREETING = 64                 # ZMTP 3: signature, version, mechanism, as-server, filler
MORE, LONG, COMMAND = 0x01, 0x02, 0x04


class ZmtpReader:
    """Frames out of one direction of a ZMTP 3 byte stream; commands (READY,
    PING) are skipped, each whole message goes to `on_message`."""

    def __init__(self, on_message: Callable[[list], None]) -> None:
        self._on_message = on_message
        self._buf = bytearray()
        self._greeted = False
        self._frames: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self._buf += data
        if not self._greeted:
            if len(self._buf) < GREETING:
                return
            del self._buf[:GREETING]
            self._greeted = True
        while len(self._buf) >= 2:
            flags = self._buf[0]
            if flags & LONG:
                if len(self._buf) < 9:
                    return
                size, head = int.from_bytes(self._buf[1:9], "big"), 9
            else:
                size, head = self._buf[1], 2
            if len(self._buf) < head + size:
                return
            body = bytes(self._buf[head:head + size])
            del self._buf[:head + size]
            if flags & COMMAND:
                continue
            self._frames.append(body)
            if not flags & MORE:
                self._on_message(self._frames)
                self._frames = []


class TcpRelay:
    def __init__(self, target_port: int, zmtp: bool = False, host: str = "127.0.0.1") -> None:
        self._target = (host, target_port)
        self._zmtp = zmtp
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._messages: list[list[bytes]] = []
        self._sent: list[bytearray] = []
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="tcp-relay", daemon=True).start()

    def messages(self) -> list[list[bytes]]:
        with self._lock:
            return list(self._messages)

    def sent(self) -> list[bytes]:
        with self._lock:
            return [bytes(b) for b in self._sent]

    def _record(self, frames: list) -> None:
        with self._lock:
            self._messages.append(frames)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return                                  # closed
            try:
                server = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            sent = bytearray()
            with self._lock:
                self._sockets += [client, server]
                self._sent.append(sent)
            reader = ZmtpReader(self._record) if self._zmtp else None

            def read(data: bytes, sent: bytearray = sent, reader: "ZmtpReader | None" = reader) -> None:
                with self._lock:
                    sent += data
                if reader is not None:
                    reader.feed(data)

            threading.Thread(target=self._pipe, args=(client, server, read), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, None), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, read: "Callable[[bytes], None] | None") -> None:
        try:
            while data := src.recv(1 << 16):
                if read is not None:
                    read(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()
            self._sockets = []

    def __enter__(self) -> "TcpRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
