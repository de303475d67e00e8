"""KServe v2 endpoints from a test: an HTTP status, and one addsub inference
over HTTP and gRPC with Triton's own client."""
from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc
import tritonclient.http

A = np.arange(16, dtype=np.float32).reshape(1, 16)


def http_status(url: str) -> int:
    """The status of a GET (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def infer_addsub_over_http_and_grpc(host: str, http_port: int, grpc_port: int) -> None:
    """addsub answers A + A and A - A over both protocols (tritonclient)."""
    for module, port in ((tritonclient.http, http_port), (tritonclient.grpc, grpc_port)):
        client = module.InferenceServerClient(f"{host}:{port}")
        try:
            inputs = [module.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
            for i in inputs:
                i.set_data_from_numpy(A)
            result = client.infer("addsub", inputs)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + A)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - A)
        finally:
            client.close()
