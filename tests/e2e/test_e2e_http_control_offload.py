"""Large control documents go to the gateway's helper process, not its
event loop (gateway/http_binary.py `control_document_off_loop`).

json.loads of a large control body (a repository index or load request, a
shared-memory registration) held the event loop, and with it every other
HTTP caller, for as long as it took: about 1.5 s for 64 MiB of numbers.
The helper starts on first use, so whether it exists tells where a
document was parsed: not for a small one, yes for a large one. An array
past CONTROL_ITEMS entries in all comes back from it as a wrong value (no
control field takes one): each large request gets the answer a small one
of the same kind gets, and a large legitimate one (a load request whose
config is a long string) loads the model.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..support.daemon import Daemon, descendants, free_tcp_port
from ..support.http_gateway import error_of, gateway_pid, request
from torchpool.gateway.http_binary import CONTROL_ITEMS
from torchpool.gateway.offload import OFFLOAD_BYTES

INDEX_ANSWER = "Invalid value for 'ready': expected a boolean"
KEY_ANSWER = "Unable to parse 'key': expected a string"
ITEMS = 2 * OFFLOAD_BYTES                 # numbers in the large documents' arrays: over both limits


@pytest.fixture(scope="module")
def daemon(small_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_tcp_port()
    d = Daemon(small_repository, tmp_path_factory.mktemp("control_offload"), "--model-control-mode", "explicit",
               "--load-model", "addsub", "--http-port", str(port)).start()
    d.http_port = port
    yield d
    assert d.stop() == 0, d.log()


def numbers(n: int) -> bytes:
    return b"[" + b"1," * (n - 1) + b"1]"


def helper_started(d: Daemon) -> bool:
    """Has the gateway a child process (its helper, and the helper's resource tracker)?"""
    gateway = gateway_pid(d)
    assert gateway
    return bool(descendants(gateway))


def post(d: Daemon, path: str, body: bytes) -> tuple[int, str]:
    status, _, answer = request(d.http_port, "POST", path, body, {"Content-Type": "application/json"}, timeout=120)
    return status, (error_of(answer) if status != 200 else "")


def test_large_control_documents_are_parsed_in_the_helper(daemon: Daemon) -> None:
    assert ITEMS > CONTROL_ITEMS
    small = b'{"ready": ' + numbers(2) + b"}"
    assert post(daemon, "/v2/repository/index", small) == (400, INDEX_ANSWER)
    assert not helper_started(daemon)                 # a small document: parsed in the loop

    large = b'{"ready": ' + numbers(ITEMS) + b"}"
    assert len(large) > OFFLOAD_BYTES
    assert post(daemon, "/v2/repository/index", large) == (400, INDEX_ANSWER)
    assert helper_started(daemon)

    # a registration with a large array where the key goes: the small one's answer
    assert post(daemon, "/v2/systemsharedmemory/region/r/register",
                b'{"key": ' + numbers(2) + b', "byte_size": 8}') == (400, KEY_ANSWER)
    assert post(daemon, "/v2/systemsharedmemory/region/r/register",
                b'{"key": ' + numbers(ITEMS) + b', "byte_size": 8}') == (400, KEY_ANSWER)

    # a large legitimate one: a load whose config override is a long string
    status, _, current = request(daemon.http_port, "GET", "/v2/models/addsub/config")
    assert status == 200
    config = json.loads(current)
    config["parameters"] = {**config.get("parameters", {}), "padding": {"string_value": "x" * (2 * OFFLOAD_BYTES)}}
    body = json.dumps({"parameters": {"config": json.dumps(config)}}).encode()
    assert len(body) > OFFLOAD_BYTES
    status, error = post(daemon, "/v2/repository/models/addsub/load", body)
    assert (status, error) == (200, ""), error
    status, _, answer = request(daemon.http_port, "GET", "/v2/models/addsub/config")
    assert status == 200 and json.loads(answer)["parameters"]["padding"]["string_value"] == "x" * (2 * OFFLOAD_BYTES)
