"""The harness checks itself: the sink fences by token and its judge finds
overlaps; the proxy stalls, cuts and loses exactly the reply it was told to."""

from __future__ import annotations

import itertools

import pytest
import trio

from mesh import MeshConnectionError
from mesh._connection import open_connection
from mesh._harness import sink
from mesh._harness.proxy import Proxy
from mesh.testing import RedisServer, wait_until


async def test_the_sink_refuses_a_lower_token_and_records_it(sink_server: RedisServer) -> None:
    async with open_connection(sink_server.url) as conn:

        async def act(tok: int, action: str = "act") -> int:
            return int(await conn.execute(*sink.report_command("h1", b"t", tok, "w", action)))

        assert await act(5, "start") == 1
        assert await act(5) == 1
        assert await act(7, "start") == 1
        assert await act(5) == 0  # stale
        assert await act(6) == 0  # stale too: lower than the highest seen
        assert await act(7) == 1
        assert int(await conn.execute(*sink.report_command("h1", b"t", 1, "w", "cancelled"))) == 1
        ev = await sink.EventLog(conn, "h1").update()
        assert [(e.token, e.ok) for e in ev if e.fenced] == [
            (5, True), (5, True), (7, True), (5, False), (6, False), (7, True),
        ]  # fmt: skip
        assert all(a.t <= b.t for a, b in itertools.pairwise(ev))
        v = sink.judge(ev)
        # 5 made one late attempt (allowed: one in flight), 6 made one too
        assert v.rejected == 2 and v.overlaps == [] and v.late_attempts == 2
        assert v.max_owners == 1


def _ev(seq: int, tok: int, ok: bool = True, action: str = "act") -> sink.Event:
    return sink.Event(seq, seq / 10, action, ok, True, b"t", tok, "w", "", "")


def test_the_judge_finds_two_owners_acting_at_once() -> None:
    ev = [_ev(0, 1, action="start"), _ev(1, 1), _ev(2, 2, action="start"), _ev(3, 1, False),
          _ev(4, 1, False), _ev(5, 2)]  # fmt: skip
    v = sink.judge(ev)
    assert v.overlaps == [(b"t", 1, 2, 2)]
    assert v.max_attempting_owners == 2
    # a one-shot task done twice is a duplicate, not an overlap
    ev = [_ev(0, 1, action="start"), _ev(1, 1, action="done"), _ev(2, 2, action="start"),
          _ev(3, 2, action="done")]  # fmt: skip
    v = sink.judge(ev)
    assert v.duplicates == 1 and v.overlaps == [] and v.max_owners == 1


async def test_the_proxy_stalls_cuts_and_heals(
    sink_server: RedisServer, nursery: trio.Nursery
) -> None:
    p = Proxy(sink_server.port)
    await nursery.start(p.run)
    async with open_connection(p.url) as conn:
        assert await conn.execute("PING") == b"PONG"
        p.stall()
        with trio.move_on_after(0.3) as cs:
            await conn.execute("SET", "proxy-k", "1")
        assert cs.cancelled_caught  # nothing came back
        p.heal()
        assert await conn.execute("GET", "proxy-k") == b"1"  # the stalled write went through
        p.cut()
        with pytest.raises(MeshConnectionError):
            await conn.execute("PING")
        p.heal()

        async def answers() -> bool:
            try:
                return bool(await conn.execute("PING") == b"PONG")
            except MeshConnectionError:
                return False

        await wait_until(answers, 5, "PING through the healed proxy")


async def test_the_proxy_loses_exactly_the_marked_reply_after_it_ran(
    sink_server: RedisServer, nursery: trio.Nursery
) -> None:
    p = Proxy(sink_server.port)
    await nursery.start(p.run)
    async with open_connection(p.url) as conn:
        await conn.execute("DEL", "proxy-n")
        lost = p.lose_reply_to(b"proxy-n")
        with pytest.raises(MeshConnectionError, match="in flight"):
            await conn.execute("INCR", "proxy-n")
        assert lost.is_set() and p.lost_replies == 1

        async def read() -> bytes | None:
            try:
                return await conn.execute("GET", "proxy-n")  # type: ignore[no-any-return]
            except MeshConnectionError:
                return None

        assert await wait_until(read, 5, "a read after the lost reply") == b"1"  # it ran once
