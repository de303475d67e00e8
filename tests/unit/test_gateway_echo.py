"""scripts/gateway_echo.py, the gateways' baselines in the benchmark: each
echo server, in its own process, answers tritonclient's add/sub request
with a + b and a - b."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from gateway_echo import EchoProcess  # noqa: E402

A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 0.5, np.float32)


def _infer_twice(kind: str, port: int) -> list[dict[str, np.ndarray]]:
    """Two requests on one client (over HTTP, one kept-alive connection)."""
    if kind == "http":
        import tritonclient.http as tc
    else:
        import tritonclient.grpc as tc
    client = tc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        inputs = []
        for name, value in (("INPUT0", A), ("INPUT1", B)):
            i = tc.InferInput(name, [1, 16], "FP32")
            if kind == "http":
                i.set_data_from_numpy(value, binary_data=True)
            else:
                i.set_data_from_numpy(value)
            inputs.append(i)
        if kind == "http":
            outputs = [tc.InferRequestedOutput(n, binary_data=True) for n in ("OUTPUT0", "OUTPUT1")]
        else:
            outputs = [tc.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
        results = [client.infer("addsub", inputs, outputs=outputs) for _ in range(2)]
        return [{n: r.as_numpy(n) for n in ("OUTPUT0", "OUTPUT1")} for r in results]
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["grpc", "http"])
def test_echo_answers_add_sub(kind: str) -> None:
    with EchoProcess(kind) as echo:
        for out in _infer_twice(kind, echo.port):
            assert out["OUTPUT0"].dtype == np.float32 and out["OUTPUT0"].shape == (1, 16)
            np.testing.assert_array_equal(out["OUTPUT0"], A + B)
            np.testing.assert_array_equal(out["OUTPUT1"], A - B)
    assert echo.proc.returncode == 0
