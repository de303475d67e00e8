"""The gateway stress test's offender (test_e2e_gateway_stress.py), in a
module of its own: it runs in a spawned process that imports this module,
the standard library, numpy and grpc, never torch (see offender.py for why).

It sends, over and over, what took the gateway's event loop longest
(issue 32, item 6): a 30 MiB JSON body of numbers whose answer is JSON too,
4M empty strings as JSON BYTES data, and 4M empty strings as gRPC
bytes_contents, reading every answer.
"""
from __future__ import annotations

import http.client
import json
import os

ELEMENTS = 16                           # the honest clients' tensor
BIG_JSON_FLOATS = 3_000_000             # about 30 MiB of JSON
EMPTY_STRINGS = 4_000_000


def payloads() -> tuple[bytes, bytes, bytes]:
    """The offender's three requests (made by the test, at its priority)."""
    from torchpool.gateway.proto import grpc_service_pb2 as pb

    numbers = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [BIG_JSON_FLOATS],
                           "data": [1.25] * BIG_JSON_FLOATS}]}
    strings = {"inputs": [{"name": "INPUT__0", "datatype": "BYTES", "shape": [EMPTY_STRINGS],
                           "data": [""] * EMPTY_STRINGS}]}
    message = pb.ModelInferRequest(model_name="identity")
    t = message.inputs.add(name="INPUT__0", datatype="BYTES", shape=[EMPTY_STRINGS])
    t.contents.bytes_contents.extend([b""] * EMPTY_STRINGS)
    return json.dumps(numbers).encode(), json.dumps(strings).encode(), message.SerializeToString()


def _wait_while_paused(pause_file: str, counts: dict) -> None:
    """While `pause_file` exists, send nothing (counts["idle"] says so)."""
    import time

    while os.path.exists(pause_file):
        counts["idle"] = True
        time.sleep(0.02)
    counts["idle"] = False


def offend_gateway(http_port: int, grpc_port: int, requests: tuple, stop_file: str, counts: dict) -> None:
    """Sends `requests` (payloads()) until `stop_file` exists, pausing while
    `stop_file`.pause does; at nice 19 (its own CPU is not the gateway's doing)."""
    import grpc

    os.nice(19)
    numbers, strings, message = requests
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=None, response_deserializer=None)
    rounds = 0
    try:
        while not os.path.exists(stop_file):
            for body in (numbers, strings):
                _wait_while_paused(stop_file + ".pause", counts)
                conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
                conn.request("POST", "/v2/models/identity/infer", body=body)
                answer = conn.getresponse()
                answer.read()
                counts[f"http {answer.status}"] = counts.get(f"http {answer.status}", 0) + 1
                conn.close()
            _wait_while_paused(stop_file + ".pause", counts)
            try:
                infer(message, timeout=120)
                counts["grpc ok"] = counts.get("grpc ok", 0) + 1
            except grpc.RpcError as exc:
                counts[str(exc.code())] = counts.get(str(exc.code()), 0) + 1
            rounds += 1
            counts["rounds"] = rounds
    finally:
        counts["rounds"] = rounds
        channel.close()
