"""The client API is declared once (torchpool/client/api.py): the asyncio
API is the synchronous one awaited, and each client's methods take the
parameters, with the defaults, that the API declares (and optional ones after them)."""
from __future__ import annotations

import inspect

import pytest

from torchpool.client import AsyncClient, Client, MultiClient
from torchpool.client.api import AsyncSessionCalls, DaemonCalls, SessionCalls


def calls(api: type) -> dict[str, inspect.Signature]:
    """The API's methods by name, and their signatures (self left out)."""
    names = [n for n in dir(api) if not n.startswith("_") and inspect.isfunction(getattr(api, n))]
    return {n: inspect.signature(getattr(api, n)) for n in names}


def test_the_asyncio_api_is_the_synchronous_one_awaited() -> None:
    sync, aio = calls(SessionCalls), calls(AsyncSessionCalls)
    assert sorted(aio) == sorted(sync)
    for name, signature in sync.items():
        assert inspect.iscoroutinefunction(getattr(AsyncSessionCalls, name)), name
        assert aio[name] == signature, name


def test_session_calls_extend_the_daemon_calls() -> None:
    daemon, session = calls(DaemonCalls), calls(SessionCalls)
    assert set(daemon) < set(session)
    assert set(session) - set(daemon) == {"statistics", "register_system_shared_memory",
                                          "unregister_system_shared_memory", "get_system_shared_memory_status",
                                          "register_cuda_shared_memory", "unregister_cuda_shared_memory",
                                          "get_cuda_shared_memory_status"}


@pytest.mark.parametrize("client, api", [(Client, SessionCalls), (MultiClient, DaemonCalls),
                                         (AsyncClient, AsyncSessionCalls)])
def test_each_client_takes_what_its_api_declares(client: type, api: type) -> None:
    assert api in client.__mro__
    for name, signature in calls(api).items():
        method = getattr(client, name)
        assert method is not getattr(api, name), f"{client.__name__}.{name} is not implemented"
        assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(getattr(api, name)), name
        # names, kinds and defaults (annotations are strings here: compared too);
        # a client may take more after them, each with a default (AsyncClient.infer's
        # `sent` and `caller`, for the gateways)
        own = list(inspect.signature(method).parameters.values())
        declared = list(signature.parameters.values())
        assert own[:len(declared)] == declared, f"{client.__name__}.{name}"
        assert all(p.default is not inspect.Parameter.empty for p in own[len(declared):]), name
        assert inspect.signature(method).return_annotation == signature.return_annotation, name
