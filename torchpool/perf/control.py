"""A run's own requests beside the load: is the server live, the model's
metadata and configuration, one trial request, the model's statistics at
every window boundary. They go over the protocol the load uses
(senders.py), as perf_analyzer asks them, and come back in the forms of
torchpool's client (Triton's JSON: `Client.model_metadata`, `model_config`,
`statistics`), whichever protocol answered.

Made and used on the main thread only. A server that is not there, a
model it does not know, a failed request: a ServerError with a one-line
message. Statistics that cannot be read are None (the client's figures
stand alone).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar, Union

from ..client import Client
from ..client.common import ClientKey, ServerKey
from ..protocol.errors import InferenceError
from .inputs import wire_requests
from .senders import GRPC, HTTP, ZMQ, Plan, triton_client, triton_inputs, triton_options

# Triton's per-request durations in a model's statistics
STAT_PARTS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
GATEWAY_NAMES = {GRPC: "gRPC", HTTP: "HTTP"}


class ServerError(Exception):
    """The server is not there, does not know the model, or failed a request."""


class ZmqControl:
    """torchpool's `Client` at the daemon's own address."""

    def __init__(self, url: str, wait_s: float, server_key: Optional[ServerKey] = None,
                 client_key: Optional[ClientKey] = None) -> None:
        self.url = url
        self._client = Client(url, timeout=wait_s, server_key=server_key, client_key=client_key)

    def check_live(self, connect_s: float) -> None:
        if not _ask(lambda: self._client.server_live(timeout=connect_s), InferenceError):
            raise ServerError(f"the daemon at {self.url} is not live")

    def metadata(self, model: str, version: Optional[str]) -> dict:
        return _ask(lambda: self._client.model_metadata(model, version), InferenceError)

    def config(self, model: str, version: Optional[str]) -> dict:
        return _ask(lambda: self._client.model_config(model, version), InferenceError)

    def trial(self, plan: Plan) -> None:
        """One request as the load sends it (its per-request timeout included)."""
        request = wire_requests(plan.inputs, plan.sets[:1])[0]
        _ask(lambda: self._client.infer(plan.model, request, version=plan.version, timeout=plan.request_timeout),
             InferenceError, "a trial request failed: ")

    def statistics(self, model: str, version: Optional[str]) -> Optional[dict]:
        try:
            return self._client.statistics(model, version)
        except InferenceError:
            return None

    def close(self) -> None:
        self._client.close()


class TritonControl:
    """tritonclient.grpc or .http at a gateway's HOST:PORT."""

    def __init__(self, protocol: str, url: str, wait_s: float, connect_s: float) -> None:
        from tritonclient.utils import InferenceServerException

        self.protocol, self.url, self._wait_s = protocol, url, wait_s
        # connection refused, no such host: OSError from tritonclient.http's sockets
        self._errors = (InferenceServerException, OSError)
        self._waits = {"client_timeout": wait_s} if protocol == GRPC else {}
        self._client = triton_client(protocol, url, wait_s, connect_s=connect_s)

    def check_live(self, connect_s: float) -> None:
        gateway = GATEWAY_NAMES[self.protocol]
        waits = {"client_timeout": connect_s} if self.protocol == GRPC else {}
        try:
            live = self._client.is_server_live(**waits)
        except self._errors as exc:
            raise ServerError(f"no torchpool {gateway} gateway answered at {self.url}: {_line(exc)} "
                              f"(is `torchpool serve --{self.protocol}-port` running?)") from None
        if not live:
            raise ServerError(f"the server at {self.url} ({gateway}) is not live")

    def metadata(self, model: str, version: Optional[str]) -> dict:
        answer = _ask(lambda: self._client.get_model_metadata(model, version or "", **self._waits), self._errors)
        if self.protocol == HTTP:
            return answer
        return {"inputs": [{"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]}
                           for t in answer.inputs]}

    def config(self, model: str, version: Optional[str]) -> dict:
        answer = _ask(lambda: self._client.get_model_config(model, version or "", **self._waits), self._errors)
        if self.protocol == HTTP:
            return answer
        return {"max_batch_size": answer.config.max_batch_size}

    def trial(self, plan: Plan) -> None:
        """One request as the load sends it (its per-request timeout included)."""
        inputs = triton_inputs(self.protocol, plan)[0]
        options = triton_options(self.protocol, plan, self._wait_s)
        _ask(lambda: self._client.infer(plan.model, inputs, **options), self._errors, "a trial request failed: ")

    def statistics(self, model: str, version: Optional[str]) -> Optional[dict]:
        try:
            answer = self._client.get_inference_statistics(model, version or "", **self._waits)
        except self._errors:
            return None
        return json_statistics(answer) if self.protocol == HTTP else grpc_statistics(answer)

    def close(self) -> None:
        self._client.close()


Control = Union[ZmqControl, TritonControl]


def open_control(protocol: str, url: str, wait_s: float, connect_s: float, server_key: Optional[ServerKey] = None,
                 client_key: Optional[ClientKey] = None) -> Control:
    if protocol == ZMQ:
        return ZmqControl(url, wait_s, server_key, client_key)
    return TritonControl(protocol, url, wait_s, connect_s)


_T = TypeVar("_T")


def _ask(call: Callable[[], _T], errors: Union[type[Exception], tuple[type[Exception], ...]],
         prefix: str = "") -> _T:
    try:
        return call()
    except errors as exc:
        raise ServerError(prefix + _line(exc)) from None


def _line(exc: BaseException) -> str:
    """An error's text on one line (gRPC's may span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def grpc_statistics(answer: Any) -> dict:
    """A ModelStatisticsResponse as Triton's JSON (numbers, every part)."""
    return {"model_stats": [
        {"name": s.name, "version": s.version, "inference_count": s.inference_count,
         "execution_count": s.execution_count,
         "inference_stats": {part: {"count": getattr(s.inference_stats, part).count,
                                    "ns": getattr(s.inference_stats, part).ns} for part in STAT_PARTS}}
        for s in answer.model_stats]}


def json_statistics(answer: dict) -> dict:
    """Triton's JSON statistics with every part present and numbers as ints."""
    out = []
    for s in answer.get("model_stats", []):
        stats = s.get("inference_stats", {})
        out.append({"name": s.get("name"), "version": s.get("version"),
                    "inference_count": int(s.get("inference_count", 0)),
                    "execution_count": int(s.get("execution_count", 0)),
                    "inference_stats": {part: {"count": int(stats.get(part, {}).get("count", 0)),
                                               "ns": int(stats.get(part, {}).get("ns", 0))}
                                        for part in STAT_PARTS}})
    return {"model_stats": out}
