"""The stress test's offender (test_e2e_stress_hostile.py), in a module of its own.

What the test measures is the harm that goes through the daemon: the
offender's own CPU on a small machine is not the server's doing, so it runs
niced and without torch (below).

It runs in a spawned process, which imports the module its target lives in:
here that is this module and the client library, not torch (the test module's
repository helpers import it). A process holding torch spent about 1.5 s per
measured phase in full garbage collections over torch's objects: CPU taken
from the honest clients on a 2-core machine that no client-only offender
would spend, and not the daemon's doing.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct

import posix_ipc
import zmq

from torchpool.client import Client, SharedMemoryRef
from torchpool.protocol import messages
from torchpool.protocol.errors import InferenceError

ELEMENTS = 64                    # the tensor every client of the stress test sends


def offend(url: str, stop_file: str, counts: dict) -> None:
    """The offender: cycles through its attacks until `stop_file` exists.

    At nice 19: its own loop never waits, and on a 2-core machine it would
    take a core's share from the honest clients' process whatever the server
    did. Niced, it gets the CPU nobody else wants, while the work it makes
    the daemon do runs at the daemon's priority and stays in the measure."""
    os.nice(19)
    ctx = zmq.Context()
    key = f"tp-test-stress-{os.getpid()}-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory("/" + key, posix_ipc.O_CREX, mode=0o600, size=1 << 20)
    rounds = 0
    try:
        while not os.path.exists(stop_file):
            rounds += 1
            # 1. hello flood on one connection, past the per-connection session limit
            s = ctx.socket(zmq.DEALER)
            s.connect(url)
            for i in range(12):
                s.send(messages.pack({"v": 1, "op": "hello", "id": i, "local": True}))
            for _ in range(12):
                if s.poll(10000):
                    s.recv()
            s.close(0)
            # 2. requests it never reads (and more than it may have in flight), then gone
            s = ctx.socket(zmq.DEALER)
            s.connect(url)
            x = struct.pack(f"<{ELEMENTS}f", *range(ELEMENTS))
            for i in range(300):
                s.send(messages.pack({"v": 1, "op": "infer", "id": i, "model": "plus_one", "version": "",
                                      "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [ELEMENTS],
                                                  "data": x}], "outputs": None}))
            s.close(0)
            # 3. garbage and a BYTES tensor over the element limit
            s = ctx.socket(zmq.DEALER)
            s.connect(url)
            s.send(b"\xc1garbage")
            s.send(messages.pack({"v": 1, "op": "infer", "id": 1, "model": "plus_one", "version": "",
                                  "inputs": [{"name": "INPUT__0", "datatype": "BYTES", "shape": [5_000_000],
                                              "data": b"\0\0\0\0" * 1000}], "outputs": None}))
            for _ in range(2):
                if s.poll(10000):
                    s.recv()
            s.close(0)
            # 4. a region shrunk under its requests
            os.ftruncate(shm.fd, 1 << 20)
            mm = mmap.mmap(shm.fd, 1 << 20)
            mm.close()
            with Client(url, timeout=30) as c:
                c.register_system_shared_memory("r", key, 1 << 16)
                ref = SharedMemoryRef("r", 4 * ELEMENTS, 0, "FP32", (ELEMENTS,))
                c.infer("plus_one", {"INPUT__0": ref})
                os.ftruncate(shm.fd, 0)
                try:
                    c.infer("plus_one", {"INPUT__0": ref})
                except InferenceError:
                    counts["refused"] = counts.get("refused", 0) + 1
    finally:
        counts["rounds"] = rounds
        shm.close_fd()
        posix_ipc.unlink_shared_memory("/" + key)
        ctx.term()
