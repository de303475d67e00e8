"""The way a run's requests are sent: torchpool's own client over ZeroMQ
(`-i zmq`, the default), or Triton's client library, `tritonclient`, to the
daemon's gRPC or HTTP gateway (`-i grpc`, `-i http`), as perf_analyzer sends
them there.

    -i     a sender (one per load thread)          an async sender (--async)
    zmq    torchpool.client.Client                 torchpool.client.AsyncClient
    grpc   tritonclient.grpc, raw tensor contents  tritonclient.grpc.aio
    http   tritonclient.http, binary tensors       tritonclient.http.aio

A sender sends request k with the k-th of the run's input sets in turn
(`Plan`), made once for it in its client's form (no encoding per request);
every output comes back (Triton's clients: all outputs, binary over HTTP).

Timeouts (docs/perf.md):

  `wait_s` (--timeout) is how long a client waits for an answer before the
  run fails. It is the client's own setting, never a request's timeout:
  torchpool's `Client(timeout=)`, tritonclient.http's `network_timeout`, and
  for tritonclient.grpc, which has no such setting, `client_timeout` on each
  call (a gRPC deadline: the gateway does not make it a request timeout).

  `request_timeout` (--request-timeout; None, the default, sends none) goes
  with each request as its own timeout, which the server applies: a request
  that could not start within it is answered "Request timeout expired". Over
  ZeroMQ it is `infer(timeout=)`, which also bounds that call's wait; over
  the gateways Triton's `timeout` request parameter, in microseconds.

A sender is made, used and closed in one thread (tritonclient.http's
connections belong to the thread that made them: load.py keeps each sender
in a thread of its own), an async sender on the event loop that awaits it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional, Sequence

import numpy as np

from ..client import AsyncClient, Client
from ..client.common import ClientKey, ServerKey
from .inputs import ModelInputs, wire_requests
from .load import AnySenderFactory

ZMQ, GRPC, HTTP = "zmq", "grpc", "http"
PROTOCOLS = (ZMQ, GRPC, HTTP)
TRITON_MODULES = {GRPC: "tritonclient.grpc", HTTP: "tritonclient.http"}
TRITON_EXTRAS = {GRPC: "tritonclient[grpc]", HTTP: "tritonclient[http]"}


@dataclass(frozen=True)
class Plan:
    """What every request of a run asks: the model, its input sets taken in
    turn (numpy arrays, inputs.build_arrays), and the timeout sent with each
    request (None: none)."""
    model: str
    version: Optional[str]
    inputs: ModelInputs
    sets: Sequence[dict]
    request_timeout: Optional[float] = None


class TritonMissing(Exception):
    """tritonclient (or what its protocol needs) cannot be imported."""


def triton_module(protocol: str, use_async: bool = False) -> ModuleType:
    """tritonclient.grpc or .http (their .aio with `use_async`), imported
    now: a TritonMissing that says what to install when it cannot be."""
    name = TRITON_MODULES[protocol] + (".aio" if use_async else "")
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise TritonMissing(f"-i {protocol}{' --async' if use_async else ''} sends with Triton's client "
                            f"library, {name}, which cannot be imported ({exc}): "
                            f"pip install '{TRITON_EXTRAS[protocol]}'") from None


# --- torchpool's client -----------------------------------------------------------------------

class ZmqSender:
    """torchpool's `Client`."""

    def __init__(self, client: Client, plan: Plan, requests: Sequence[dict]) -> None:
        self._client, self._requests, self._n = client, requests, len(requests)
        self._model, self._version, self._timeout = plan.model, plan.version, plan.request_timeout

    def infer(self, k: int) -> None:
        # timeout=None is a plain call: the client's own wait, nothing sent
        self._client.infer(self._model, self._requests[k % self._n], version=self._version, timeout=self._timeout)

    def close(self) -> None:
        self._client.close()


class AsyncZmqSender:
    """torchpool's `AsyncClient`."""

    def __init__(self, client: AsyncClient, plan: Plan, requests: Sequence[dict]) -> None:
        self._client, self._requests, self._n = client, requests, len(requests)
        self._model, self._version, self._timeout = plan.model, plan.version, plan.request_timeout

    async def infer(self, k: int) -> None:
        await self._client.infer(self._model, self._requests[k % self._n], version=self._version,
                                 timeout=self._timeout)

    async def aclose(self) -> None:
        await self._client.aclose()


# --- Triton's client --------------------------------------------------------------------------

def triton_array(datatype: str, array: np.ndarray) -> np.ndarray:
    """An input array as tritonclient's `set_data_from_numpy` takes it: BF16
    bits as the dtype this tritonclient maps BF16 to (ml_dtypes.bfloat16
    since r26.06; before, float32 whose top half it sends)."""
    if datatype != "BF16":
        return array
    from tritonclient.utils import triton_to_np_dtype

    dtype = np.dtype(triton_to_np_dtype("BF16"))
    if dtype.itemsize == 2:
        return np.ascontiguousarray(array, np.uint16).view(dtype)
    return (np.asarray(array, np.uint32) << 16).view(np.float32)


def triton_inputs(protocol: str, plan: Plan) -> list[list]:
    """One list of `InferInput`s per input set, made once, as perf_analyzer
    prepares its requests: binary tensors over HTTP, raw contents over gRPC."""
    tc = triton_module(protocol)
    made = []
    for arrays in plan.sets:
        one = []
        for name, array in arrays.items():
            datatype = plan.inputs.spec(name).datatype
            tensor = tc.InferInput(name, list(array.shape), datatype)
            if protocol == HTTP:
                tensor.set_data_from_numpy(triton_array(datatype, array), binary_data=True)
            else:
                tensor.set_data_from_numpy(triton_array(datatype, array))
            one.append(tensor)
        made.append(one)
    return made


def triton_options(protocol: str, plan: Plan, wait_s: float) -> dict:
    """The keyword arguments of each `infer` call."""
    options: dict[str, object] = {"model_version": plan.version or ""}     # "": the latest
    if plan.request_timeout is not None:
        options["timeout"] = max(1, round(plan.request_timeout * 1e6))  # Triton's, in microseconds
    if protocol == GRPC:
        options["client_timeout"] = wait_s
    return options


def triton_client(protocol: str, url: str, wait_s: float, use_async: bool = False,
                  connect_s: Optional[float] = None) -> Any:
    """A tritonclient InferenceServerClient for `url` (HOST:PORT) whose
    waits are the client's own (`wait_s`; `connect_s` to connect over HTTP)."""
    tc = triton_module(protocol, use_async)
    if protocol == GRPC:
        return tc.InferenceServerClient(url)
    if use_async:
        return tc.InferenceServerClient(url, conn_timeout=wait_s)
    return tc.InferenceServerClient(url, connection_timeout=connect_s or wait_s, network_timeout=wait_s)


class TritonSender:
    """tritonclient.grpc or .http, one client (HTTP: one connection)."""

    def __init__(self, protocol: str, url: str, wait_s: float, plan: Plan) -> None:
        self._inputs = triton_inputs(protocol, plan)
        self._n, self._model = len(self._inputs), plan.model
        self._options = triton_options(protocol, plan, wait_s)
        self._client = triton_client(protocol, url, wait_s)

    def infer(self, k: int) -> None:
        self._client.infer(self._model, self._inputs[k % self._n], **self._options)

    def close(self) -> None:
        self._client.close()


class AsyncTritonSender:
    """tritonclient.grpc.aio or .http.aio (made on the loop that awaits it)."""

    def __init__(self, protocol: str, url: str, wait_s: float, plan: Plan) -> None:
        self._inputs = triton_inputs(protocol, plan)
        self._n, self._model = len(self._inputs), plan.model
        self._options = triton_options(protocol, plan, wait_s)
        self._client = triton_client(protocol, url, wait_s, use_async=True)

    async def infer(self, k: int) -> None:
        await self._client.infer(self._model, self._inputs[k % self._n], **self._options)

    async def aclose(self) -> None:
        await self._client.close()


# --- what load.py is given ----------------------------------------------------------------------

def sender_factory(protocol: str, url: str, wait_s: float, plan: Plan, use_async: bool = False,
                   shared_client: bool = False, server_key: Optional[ServerKey] = None,
                   client_key: Optional[ClientKey] = None) -> AnySenderFactory:
    """What makes the load's senders: each call a new one (a new client),
    except that with `shared_client` (ZeroMQ only) every sender sends on
    one `Client` (it is thread-safe: one session and one arena in all)."""
    if protocol != ZMQ:
        triton_module(protocol, use_async)          # missing: said now, not in a load thread
        if use_async:
            return lambda: AsyncTritonSender(protocol, url, wait_s, plan)
        return lambda: TritonSender(protocol, url, wait_s, plan)
    requests = wire_requests(plan.inputs, plan.sets)       # encoded once, shared: read only
    if use_async:
        return lambda: AsyncZmqSender(AsyncClient(url, timeout=wait_s, server_key=server_key, client_key=client_key),
                                      plan, requests)
    shared: list[Client] = []

    def make() -> ZmqSender:
        if not shared_client:
            return ZmqSender(Client(url, timeout=wait_s, server_key=server_key, client_key=client_key), plan, requests)
        if not shared:
            shared.append(Client(url, timeout=wait_s, server_key=server_key, client_key=client_key))
        return ZmqSender(shared[0], plan, requests)  # closed once per sender: close() is idempotent

    return make
