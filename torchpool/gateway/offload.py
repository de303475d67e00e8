"""Decoding too heavy for the event loop, done in a helper process.

The gateway serves every HTTP connection and gRPC call on one event loop.
Parsing a large JSON request (json.loads, then a Python list per tensor) or
the protobuf of a request with large typed `contents` is one long call in C
that holds the GIL: 2.6 s for a 30 MiB JSON body on the development VM,
during which no other caller was answered; a thread would not help (it
would hold the same GIL). So a request whose JSON (HTTP) or non-tensor part
(gRPC) is `OFFLOAD_BYTES` or more is parsed in a helper process, which also
turns its tensor values into their bytes; the loop only copies bytes to and
from it. So is an HTTP control document (repository index / load, a
shared-memory registration) of that size (http_binary.control_document).

    loop ── pickled (function, document bytes) ──► helper process (nice 10)
         ◄── pickled KServeInfer (tensor values as bytes) or (code, message) ──

The helper is started on first use (multiprocessing "spawn": it imports
numpy and the gateway's parsing modules, never torch or grpc), runs at a
lower priority (a caller's heavy request takes CPU the other callers do
not want), is limited to `HELPER_MEMORY` bytes of data (a document of tiny
fields that amplifies in memory is refused, not the host's memory) and is
started again if it dies. It exits with the gateway. A JSON document is
walked in C before json.loads makes anything of it (http_binary.load_json):
one nested deeper than 100 levels, or of more arrays and objects than
`MAX_JSON_CONTAINERS` (the fields that amplify most: 60 MiB of "[]," was
1.5 GiB and 26 s here), is refused at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import resource
import signal
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Optional, TypeVar

from ..protocol import errors
from ..protocol.errors import TorchpoolError

log = logging.getLogger("torchpool.gateway")

# Documents from this size are parsed in the helper: below it, parsing in
# the loop (a few ms at most, for a document of the tiniest fields) costs
# less than the trip to the helper.
OFFLOAD_BYTES = 64 << 10
HELPER_MEMORY = 4 << 30         # RLIMIT_DATA of the helper process
HELPER_NICE = 10
_PR_SET_PDEATHSIG = 1


def _start_helper() -> None:
    """In the helper, before its first task."""
    os.nice(HELPER_NICE)
    resource.setrlimit(resource.RLIMIT_DATA, (HELPER_MEMORY, HELPER_MEMORY))
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # the gateway's Ctrl-C is not ours
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


_T = TypeVar("_T")


def _run(fn: Callable[..., object], args: tuple) -> tuple:
    """In the helper: ("ok", result) or ("error", code, message). Errors
    travel as values: TorchpoolError does not survive pickling."""
    try:
        return ("ok", fn(*args))
    except TorchpoolError as exc:
        return ("error", exc.code, exc.message)
    except MemoryError:
        return ("error", errors.RESOURCE_EXHAUSTED,
                f"the request does not fit the gateway's decoder ({HELPER_MEMORY >> 20} MiB): "
                f"send fewer, larger elements, or the tensors as binary data")


class Offload:
    """The helper process, as the loop sees it: `await run(fn, *args)`."""

    def __init__(self) -> None:
        self._pool: Optional[concurrent.futures.ProcessPoolExecutor] = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_helper)
        return self._pool

    async def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """fn(*args) in the helper; its TorchpoolError raised here."""
        loop = asyncio.get_running_loop()
        try:
            answer = await loop.run_in_executor(self._executor(), _run, fn, args)
        except BrokenProcessPool:
            log.error("the gateway's decoder process died; starting another")
            self._pool = None
            raise TorchpoolError(errors.UNAVAILABLE, "the gateway's decoder process died while "
                                                     "parsing this request") from None
        if answer[0] == "error":
            raise TorchpoolError(answer[1], answer[2])
        return answer[1]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
