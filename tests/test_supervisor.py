"""mesh._supervisor: the Reaper against a real redis-server. Expiry is forced
(``expire_worker``), never slept."""

from __future__ import annotations

import functools
import logging

import anyio
import anyio.to_thread
import pytest

import mesh._connection
from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh._supervisor import REAP_BATCH, Reaper
from mesh.testing import RedisServer, wait_until

from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops


async def test_a_reaper_keeps_its_watch_between_periodic_checks(own_redis: RedisServer) -> None:
    """Whether a reaper is on watch is drawn at its periodic checks only: a
    reaper on watch passes at every deadline, and redrawing there would
    leave almost nobody on watch (about 3/4.5 of the intended 3)."""
    b = Binding(Keys("watch2"))
    async with open_connection(own_redis.url) as conn:
        for i in range(30):
            await join(b, conn, f"w{i}", ttl_ms=600_000)
        reaper = Reaper(conn, b, ttl=600.0)
        async with anyio.create_task_group() as nursery:
            await nursery.start(reaper.run)
            # the first pass first: a wake during it would be taken by it
            await wait_until(lambda: reaper.statistics().checks == 1, what="the first pass")
            seen = []
            for _ in range(60):
                checks = reaper.statistics().checks
                reaper.wake()

                async def passed(c: int = checks) -> bool:
                    return reaper.statistics().checks > c

                # the draw, if any, follows the count in the reaper's trio
                # task with no checkpoint between: it has happened by now
                await wait_until(passed, within=5, what="a pass")
                seen.append(reaper.on_watch)
            nursery.cancel_scope.cancel()
    assert reaper.statistics().checks >= 61
    assert len(set(seen)) == 1  # redrawn 60 times, it would have changed


async def test_a_reaper_names_its_own_queues_in_its_first_recycle(own_redis: RedisServer) -> None:
    """One recycle.lua call for a dead peer that served the reaper's queues:
    without the hint the first call comes back asking for them."""
    b = Binding(Keys("hint"))

    async def evalsha_calls(conn: mesh._connection.Connection) -> int:
        stats = (await conn.execute("INFO", "commandstats")).decode()
        line = next(x for x in stats.splitlines() if x.startswith("cmdstat_evalsha:"))
        return int(line.split("calls=")[1].split(",")[0])

    async with open_connection(own_redis.url) as conn:
        calls = []
        for hint in (["jobs"], []):
            inc = await join(b, conn, "dead", "jobs")
            await b.enqueue(conn, "jobs", [b"t"])
            await b.claim(conn, "dead", inc, "jobs", 1, 0)
            await expire_worker(conn, b.keys, "dead")
            before = await evalsha_calls(conn)
            reaper = Reaper(conn, b, ttl=1.0, queues=functools.partial(tuple, hint))
            assert await reaper.reap_once() == 1
            calls.append(await evalsha_calls(conn) - before)
            assert await conn.execute("LRANGE", b.keys.queue("jobs"), 0, -1) == [b"t"]
            await conn.execute("DEL", b.keys.queue("jobs"), b.keys.attempts("jobs"))
    # reap_check (finds it), recycle, reap_check (none left); a second
    # recycle call without the hint
    assert calls == [3, 4]


async def test_dead_workers_that_held_many_processes_are_recycled_a_few_at_a_time(
    own_redis: RedisServer,
) -> None:
    """One recycle.lua call holds Redis (every heartbeat of the mesh waits)
    for about 10 us per process it recycles: a reaper that finds several
    dead workers recycles them in calls of about ``recycle_processes``
    processes (a worker counting ``WORKER_COST`` = 2 more), one worker at
    least, not all in one call."""
    b = Binding(Keys("parts"))
    held = {"a": 0, "b": 4, "c": 4, "d": 1, "e": 1, "f": 3}
    async with open_connection(own_redis.url) as conn:
        for w, n in held.items():
            inc = await join(b, conn, w, "jobs")
            if n:
                await b.enqueue(conn, "jobs", [b"%s%d" % (w.encode(), i) for i in range(n)])
                assert len((await b.claim(conn, w, inc, "jobs", n, 0)).processes) == n
            await expire_worker(conn, b.keys, w)
        reaper = Reaper(conn, b, ttl=1.0, queues=lambda: ["jobs"], recycle_processes=11)
        assert await reaper.reap_once() == 6
        queued = await conn.execute("LRANGE", b.keys.queue("jobs"), 0, -1)
    assert len(queued) == 13
    # reap_check's order is the deadlines' (all 0), then the ids; costs
    # a 2, b 6, c 6, d 3, e 3, f 5: a b | c d | e f
    st = reaper.statistics()
    assert (st.recycle_calls, st.processes_recycled) == (3, 13)


async def test_many_dead_workers_that_held_nothing_are_recycled_in_one_call(
    own_redis: RedisServer,
) -> None:
    """Issue 14: a process of 1,000 idle workers that dies. The reaper takes
    them in one lease check and one recycle.lua call (they cost about two
    processes each), where it took 16 per check and call, one after the
    other, and the last task came back after 1.34 TTL."""
    b = Binding(Keys("idle-dead"))
    async with open_connection(own_redis.url) as conn:
        for i in range(100):
            w = f"w{i:03d}"
            inc = await join(b, conn, w, "jobs")
            if i == 57:  # the owner of the one task, somewhere in the middle
                await b.ensure(conn, "jobs", [b"device"])
                assert len((await b.claim(conn, w, inc, "jobs", 1, 0)).processes) == 1
            await expire_worker(conn, b.keys, w)
        reaper = Reaper(conn, b, ttl=1.0, queues=lambda: ["jobs"])
        assert await reaper.reap_once() == 100
        assert await conn.execute("LRANGE", b.keys.queue("jobs"), 0, -1) == [b"device"]
        assert await conn.execute("ZCARD", b.keys.workers) == 0
    st = reaper.statistics()
    # one check that found them, one recycle, one check that found none
    assert (st.checks, st.recycle_calls, st.processes_recycled) == (2, 1, 1)


async def test_the_reapers_times_follow_the_ttl(conn: Connection, b: Binding) -> None:
    r = Reaper(conn, b, ttl=3.0)
    assert (r.interval, r.lease_ms, r.grace, r.batch) == (9.0, 1500, 0.15, REAP_BATCH)
    # the reap lease at least 200 ms, the grace from 25 to 250 ms
    assert (Reaper(conn, b, ttl=0.1).lease_ms, Reaper(conn, b, ttl=0.1).grace) == (200, 0.025)
    assert Reaper(conn, b, ttl=600.0).grace == 0.25


async def test_who_checks_on_an_expiry_or_an_overdue_deadline(conn: Connection, b: Binding) -> None:
    for i in range(3):
        await join(b, conn, f"w{i}")
    r = Reaper(conn, b, ttl=1.0, herd=0)  # herd 0: never drawn by chance
    assert r.on_watch  # on watch until its first periodic pass
    r.heard_expiry()
    assert r._wakeup.is_set()
    assert await r.reap_once() == 0  # nobody dead; it learnt the mesh's size
    r._on_watch = False
    r._wakeup = anyio.Event()
    r.heard_expiry()
    r.deadline_passed(r.grace / 2)
    assert not r._wakeup.is_set()  # not on watch, not drawn, within the grace
    r.deadline_passed(r.grace)
    assert r._wakeup.is_set()  # the backstop: nobody on watch acted in time
    drawn = Reaper(conn, b, ttl=1.0, herd=3)
    await drawn.reap_once()
    drawn._on_watch = False
    drawn.heard_expiry()  # herd 3 of a mesh of 3: always drawn
    assert drawn._wakeup.is_set()


async def test_a_pass_recycles_dead_peers_and_counts_them(
    conn: Connection, b: Binding, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    inc = await join(b, conn, "dead", "jobs")
    await join(b, conn, "alive", "jobs")
    await b.enqueue(conn, "jobs", [b"j1", b"j2"])
    assert len((await b.claim(conn, "dead", inc, "jobs", 2, 0)).processes) == 2
    await expire_worker(conn, keys, "dead")
    r = Reaper(conn, b, ttl=1.0, me=lambda: "me-1")
    with caplog.at_level(logging.INFO, logger="mesh.supervisor"):
        assert await r.reap_once() == 1
    assert sorted(await conn.execute("LRANGE", keys.queue("jobs"), 0, -1)) == [b"j1", b"j2"]
    assert await conn.execute("ZRANGE", keys.workers, 0, -1) == [b"alive"]
    st = r.statistics()
    assert (st.checks, st.recycle_calls, st.workers_recycled, st.processes_recycled) == (2, 1, 1, 2)
    assert any(
        "me-1 took over from 1 dead worker(s) (dead): 2 processes back" in m
        for m in caplog.messages
    )
    assert await r.reap_once() == 0  # nothing left: one check, no recycle
    assert (r.statistics().checks, r.statistics().recycle_calls) == (3, 1)


async def test_a_task_out_of_attempts_is_dead_lettered_and_logged(
    conn: Connection, b: Binding, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    inc = await join(b, conn, "dead", "jobs")
    await b.enqueue(conn, "jobs", [b"poison"])
    assert len((await b.claim(conn, "dead", inc, "jobs", 1, 1)).processes) == 1
    await expire_worker(conn, keys, "dead")
    r = Reaper(conn, b, ttl=1.0, me=lambda: "me-2")
    with caplog.at_level(logging.WARNING, logger="mesh.worker"):
        assert await r.reap_once() == 1
    assert await conn.execute("LLEN", keys.dead("jobs")) == 1
    assert r.statistics().dead_lettered == 1
    [line] = [m for m in caplog.messages if "dead-lettered by me-2" in m]
    assert line.startswith("queue jobs: task 'poison' failed (attempt 1 of 1): its worker dead")


async def test_its_own_lapsed_lease_is_recycled_but_not_counted_as_a_takeover(
    conn: Connection, b: Binding, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    inc = await join(b, conn, "me", "jobs")
    await b.enqueue(conn, "jobs", [b"t"])
    await b.claim(conn, "me", inc, "jobs", 1, 0)
    await expire_worker(conn, keys, "me")
    r = Reaper(conn, b, ttl=1.0, own=lambda: {"me"})
    with caplog.at_level(logging.INFO, logger="mesh.supervisor"):
        assert await r.reap_once() == 1
    assert await conn.execute("LRANGE", keys.queue("jobs"), 0, -1) == [b"t"]
    st = r.statistics()
    assert (st.workers_recycled, st.processes_recycled) == (0, 0)
    assert not any("took over" in m for m in caplog.messages)


async def test_run_checks_when_woken_and_retries_after_a_connection_error(
    own_redis: RedisServer,
) -> None:
    b = Binding(Keys("run"))
    async with open_connection(own_redis.url + "?connect_timeout=0.5") as conn:
        r = Reaper(conn, b, ttl=600.0)  # its own checks only every 30 min
        async with anyio.create_task_group() as nursery:
            await nursery.start(r.run)
            await wait_until(lambda: r.statistics().checks == 1, what="the first pass")
            inc = await join(b, conn, "dead", "jobs")
            await b.enqueue(conn, "jobs", [b"t"])
            await b.claim(conn, "dead", inc, "jobs", 1, 0)
            await expire_worker(conn, b.keys, "dead")
            r.wake()
            await wait_until(lambda: r.statistics().workers_recycled == 1, what="recycled")
            own_redis.stop()
            r.wake()  # fails, and is retried with backoff
            await anyio.to_thread.run_sync(own_redis.start)
            await join(b, conn, "dead2")
            await expire_worker(conn, b.keys, "dead2")
            r.wake()
            await wait_until(
                lambda: r.statistics().workers_recycled == 2, within=10, what="after the outage"
            )
            nursery.cancel_scope.cancel()
