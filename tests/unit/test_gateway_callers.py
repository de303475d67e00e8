"""callers.FairShare: each caller's places at the daemon, and turns between
callers; callers.ReadAhead: a caller's streams read ahead, and which of them
a freed place wakes; http_bodies.BodyBudget: bytes held and who waits for
them."""
from __future__ import annotations

import asyncio

import pytest

from torchpool.gateway.callers import Caller, FairShare, ReadAhead, StreamAhead
from torchpool.gateway.http_bodies import BodyBudget, body_buffer


def run(coro):
    return asyncio.run(coro)


def test_a_caller_waits_past_its_share_and_callers_take_turns() -> None:
    async def scenario() -> list[str]:
        share = FairShare(total=2, per_caller=2)
        greedy, other = Caller("greedy"), Caller("other")
        order: list[str] = []

        async def call(caller: Caller, gate: asyncio.Event) -> None:
            await share.enter(caller)
            order.append(caller.name)
            await gate.wait()
            share.leave(caller)

        gate = asyncio.Event()
        tasks = [asyncio.ensure_future(call(greedy, gate)) for _ in range(6)]
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(call(other, gate)))
        await asyncio.sleep(0)
        assert order == ["greedy", "greedy"] and share.waiting() == 5
        gate.set()                      # the two places freed go round: one each
        await asyncio.gather(*tasks)
        return order

    order = run(scenario())
    # the other caller's one request comes before the greedy caller's last three
    assert order == ["greedy", "greedy", "greedy", "other", "greedy", "greedy", "greedy"]


def test_a_caller_never_holds_more_than_its_share() -> None:
    async def scenario() -> int:
        share = FairShare(total=100, per_caller=3)
        caller = Caller("c")
        most = 0
        gate = asyncio.Event()

        async def call() -> None:
            nonlocal most
            await share.enter(caller)
            most = max(most, caller.in_flight)
            await gate.wait()
            share.leave(caller)

        tasks = [asyncio.ensure_future(call()) for _ in range(10)]
        await asyncio.sleep(0)
        assert caller.in_flight == 3 and share.in_flight == 3
        gate.set()
        await asyncio.gather(*tasks)
        assert share.in_flight == 0 and caller.in_flight == 0
        return most

    assert run(scenario()) == 3


def test_a_new_caller_takes_a_free_place_while_another_waits_at_its_share() -> None:
    """A caller with requests waiting past its share, none of which finish
    (a stopped or very slow model): a new caller's request takes one of the
    free places at once. It used to queue behind the waiting caller and
    wait for one of its requests to finish."""
    async def scenario() -> None:
        share = FairShare(total=10, per_caller=2)
        greedy, other = Caller("greedy"), Caller("other")
        never = asyncio.Event()

        async def call(caller: Caller) -> None:
            await share.enter(caller)
            await never.wait()

        stuck = [asyncio.ensure_future(call(greedy)) for _ in range(5)]
        await asyncio.sleep(0)
        assert (greedy.in_flight, share.waiting()) == (2, 3)
        await asyncio.wait_for(share.enter(other), 5)      # no place is freed meanwhile
        assert (other.in_flight, share.in_flight, share.waiting()) == (1, 3, 3)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)

    run(scenario())


def test_a_cancelled_waiter_gives_its_turn_away() -> None:
    async def scenario() -> None:
        share = FairShare(total=1, per_caller=1)
        a, b = Caller("a"), Caller("b")
        await share.enter(a)
        waiting = asyncio.ensure_future(share.enter(b))
        after = asyncio.ensure_future(share.enter(b))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)
        share.leave(a)                  # the place goes to b's next request, not the cancelled one
        await asyncio.wait_for(after, 5)
        assert b.in_flight == 1 and share.in_flight == 1 and share.waiting() == 0

    run(scenario())


async def _settle() -> None:
    """Let every task that can run, run (the loop's turns, not time)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_read_ahead_wakes_one_waiting_stream_per_freed_place_not_all() -> None:
    """Stream a holds the caller's share (3); b, c and d have one request
    each (a stream with none of its own always reads one) and wait to read
    a second. Answers that leave the caller at or over its share wake no
    stream (each answer woke all of them, hundreds per answer for hundreds
    of streams: issue 39, item 1); d's last answer wakes d itself, and the
    place it frees goes to the first waiting, b; c sleeps on."""
    async def scenario() -> None:
        room = ReadAhead(3)
        a, b, c, d = (StreamAhead() for _ in range(4))
        for _ in range(3):
            await room.take(a)
        for s in (b, c, d):
            await room.take(s)
        assert room.held == 6
        second = {name: asyncio.ensure_future(room.take(s)) for name, s in (("b", b), ("c", c), ("d", d))}
        await _settle()
        assert not any(t.done() for t in second.values())
        waiters = [s.waiter for s in (b, c, d)]
        room.give(a, 3)                              # held 3: at the share, no place free
        assert room.held == 3 and not any(w is None or w.done() for w in waiters)
        room.give(d)                                 # d holds none now; held 2: one place
        await _settle()
        assert second["d"].done() and second["b"].done() and not second["c"].done()
        assert (room.held, b.own, c.own, d.own) == (4, 2, 1, 1)
        room.give(b, 2)                              # held 2: one place, to c
        await _settle()
        assert second["c"].done() and room.held == 3

    run(scenario())


def test_the_budget_wakes_waiters_in_turn_and_reservations_wait() -> None:
    async def scenario() -> list[str]:
        budget = BodyBudget(100)
        woken: list[str] = []
        budget.take(100)
        budget.wait(lambda: woken.append("first"))
        budget.wait(lambda: woken.append("second"))
        reserved = asyncio.ensure_future(budget.reserve(60))
        await asyncio.sleep(0)
        assert not reserved.done()
        budget.give(50)                 # room: the waiters in turn; the reservation still waits
        await asyncio.sleep(0)
        assert woken == ["first", "second"] and not reserved.done()
        budget.give(50)
        await asyncio.wait_for(reserved, 5)
        assert budget.held == 60
        return woken

    run(scenario())


@pytest.mark.parametrize("size", [0, 1, 64 << 20])
def test_a_body_buffer_costs_what_is_written(size: int) -> None:
    buf = body_buffer(size)
    assert len(buf) == size
    if size > 1:
        buf[size - 1:size] = b"x"
        assert bytes(buf[:1]) == b"\0" and bytes(buf[size - 1:]) == b"x"
