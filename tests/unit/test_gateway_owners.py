"""backend.Backend's region owners (owners.py): how long each kind keeps its
regions, and the renewal of the daemon session that holds them. The daemon
is a stand-in here (tests/e2e/test_e2e_gateway_callers.py has the real one)."""
from __future__ import annotations

import asyncio
from typing import Optional

import pytest

from torchpool.gateway import backend as backend_module
from torchpool.gateway.backend import Backend, ShmPolicy
from torchpool.gateway.callers import Caller


class FakeClient:
    """An AsyncClient with a session of its own at a daemon that keeps its
    regions; counts the calls that renew it."""

    def __init__(self, url: str, timeout: float = 0.0, local: Optional[bool] = None) -> None:
        self.regions: set[str] = set()
        self.closed = False
        self.renewals = 0
        self.lease_s: Optional[float] = None

    async def register_system_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self.lease_s = 0.3                  # its hello said
        self.regions.add(name)

    async def unregister_system_shared_memory(self, name: Optional[str] = None) -> None:
        if name is None:
            self.regions.clear()
        else:
            self.regions.discard(name)

    async def get_system_shared_memory_status(self, name: Optional[str] = None) -> list[dict]:
        return [{"name": n} for n in sorted(self.regions)]

    async def server_live(self) -> bool:
        self.renewals += 1
        return True

    async def aclose(self) -> None:
        self.closed = True


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Backend:
    """Callers on port 1000+uid are loopback peers of that uid; others remote."""
    monkeypatch.setattr(backend_module, "AsyncClient", FakeClient)
    monkeypatch.setattr(backend_module, "loopback_peer_uid",
                        lambda address, port: port - 1000 if port >= 1000 else None)
    return Backend("ipc:///nowhere", shm=ShmPolicy(allowed=True))


def caller(name: str, uid: Optional[int]) -> Caller:
    return Caller(name, ("127.0.0.1", 40000), 1000 + uid if uid is not None else 80)


def test_a_users_regions_stay_after_its_last_caller_until_unregistered(backend: Backend) -> None:
    async def main() -> None:
        a = caller("a", 7)
        await backend.register_shm(a, "r", "tpt-r", 0, 64)
        client = a.owner.client
        await backend.forget(a)
        assert not client.closed and backend._owners[("uid", 7)].names == {"r"}
        await asyncio.sleep(0.5)            # a third of its 0.3 s lease, at least 0.2 s
        assert client.renewals >= 1         # the daemon ends no session renewed
        other = caller("other", 8)
        assert await backend.shm_status(other) == []        # the shared session's: none (FakeClient)
        await backend.unregister_shm(other, "r")
        b = caller("b", 7)
        assert await backend.shm_status(b) == [{"name": "r"}]
        await backend.unregister_shm(b, "r")
        assert client.closed and a.owner is None and b.owner.client is None
        renewals = client.renewals
        await asyncio.sleep(0.5)
        assert client.renewals == renewals  # no renewal once it holds none
        await backend.forget(b)
        await backend.forget(other)
        assert backend._owners == {}        # owners holding nothing are not kept
        await backend.close()

    asyncio.run(main())


def test_a_remote_callers_regions_go_with_it(backend: Backend) -> None:
    async def main() -> None:
        a = caller("a", None)
        await backend.register_shm(a, "r", "tpt-r", 0, 64)
        client = a.owner.client
        await backend.forget(a)
        assert client.closed and backend._owners == {}
        await backend.close()

    asyncio.run(main())


def test_the_gateway_stopping_closes_the_sessions_it_kept(backend: Backend) -> None:
    async def main() -> None:
        a = caller("a", 7)
        await backend.register_shm(a, "r", "tpt-r", 0, 64)
        client, owner = a.owner.client, a.owner
        await backend.forget(a)
        await backend.close()
        assert client.closed and owner.renewal is None

    asyncio.run(main())
