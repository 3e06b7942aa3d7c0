"""Periodic tasks (schedule.lua, fire.lua, mesh/_schedule.py) against a real
redis-server: one copy per tick across the mesh, none missed when a peer is
SIGKILLed, one (not one per missed tick) after an outage."""

from __future__ import annotations

import pytest

import mesh
from mesh import ConfigError
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._errors import CommandError
from mesh._keys import Keys
from mesh._schedule import _fire_due, cron_next, next_tick
from mesh.testing import wait_until

from .helpers import Peers, client_and_workers, redis_ms, wait_ready

pytestmark = pytest.mark.both_loops

Q = "ticks"


async def test_schedule_add_replace_remove(conn: Connection, b: Binding, keys: Keys) -> None:
    t0 = await redis_ms(conn)
    new, first = await b.schedule(conn, Q, b"p\0x", "every 5000", None)
    assert new and t0 + 5000 <= first <= t0 + 5000 + 1000
    new, first2 = await b.schedule(conn, Q, b"p\0x", "every 9000", None)
    assert not new and first2 >= t0 + 9000
    assert await conn.execute("ZRANGE", keys.schedules, 0, -1) == [b"ticks\0p\0x"]
    assert await conn.execute("HGET", keys.schedule_specs, b"ticks\0p\0x") == b"every 9000"
    assert await conn.execute("SISMEMBER", keys.queues, Q) == 1
    for spec, first_ms in [("every 0", None), ("hourly", None), ("cron * * * * *", None)]:
        with pytest.raises(CommandError, match="BAD_ARG"):
            await b.schedule(conn, Q, b"y", spec, first_ms)
    assert await b.unschedule(conn, Q, b"p\0x") is True
    assert await b.unschedule(conn, Q, b"p\0x") is False
    assert await conn.execute("EXISTS", keys.schedules, keys.schedule_specs) == 0


async def test_fire_is_compare_and_set_on_the_tick(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    _, tick = await b.schedule(conn, Q, b"job", "every 60000", None)
    sid = b"ticks\0job"
    # not due yet by the Redis clock: nothing
    assert await b.fire(conn, [(sid, tick, tick + 60000)]) == [0]
    now = await redis_ms(conn)
    await conn.execute("ZADD", keys.schedules, "XX", now - 10, sid)  # due (forced)
    fired = [await b.fire(conn, [(sid, now - 10, now + 59990)]) for _ in range(3)]
    assert fired == [[1], [0], [0]]  # three peers, one copy
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"job"]
    assert int(float(await conn.execute("ZSCORE", keys.schedules, sid))) == now + 59990
    # a tick read before a replace does not fire the new schedule
    await b.schedule(conn, Q, b"job", "every 60000", None)
    assert await b.fire(conn, [(sid, now + 59990, now + 119990)]) == [0]
    with pytest.raises(CommandError, match="BAD_ARG"):
        await b.fire(conn, [(sid, 5, 5)])
    # a payload that became a persistent task is skipped, its tick advanced
    await conn.execute("ZADD", keys.schedules, "XX", now - 5, sid)
    await b.ensure(conn, Q, [b"job2"])
    await b.schedule(conn, Q, b"job2", "every 1000", None)
    await conn.execute("ZADD", keys.schedules, "XX", now - 5, b"ticks\0job2")
    assert await b.fire(conn, [(b"ticks\0job2", now - 5, now + 995)]) == [2]
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"job", b"job2"]  # ensure's copy


def test_next_tick_skips_missed_ticks_and_cron_is_utc() -> None:
    spec = b"every 1000"
    assert next_tick(spec, 10_000, 10_000) == 11_000
    assert next_tick(spec, 10_000, 10_999) == 11_000
    # an outage: ticks 11 000 .. 15 000 passed; the next is the first after now
    assert next_tick(spec, 10_000, 15_500) == 16_000
    assert next_tick(spec, 10_000, 16_000) == 17_000
    midnight = 1_767_225_600_000  # 2026-01-01T00:00:00Z
    assert cron_next("0 * * * *", midnight) == midnight + 3_600_000
    assert cron_next("0 * * * *", midnight - 1) == midnight
    assert next_tick(b"cron */5 * * * *", midnight, midnight + 7 * 60_000) == midnight + 600_000
    with pytest.raises(ConfigError, match="cron"):
        cron_next("61 * * * *", midnight)


async def test_after_an_outage_a_schedule_fires_once(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.schedule(conn, Q, b"job", "every 200", None)
    now = await redis_ms(conn)
    # nobody ran for a second: five ticks missed
    await conn.execute("ZADD", keys.schedules, "XX", now - 1000, b"ticks\0job")
    assert await _fire_due(conn, b, keys) == 0  # fired: look again at once
    wait = await _fire_due(conn, b, keys)
    assert 0 < wait <= 0.2
    assert await conn.execute("LRANGE", keys.queue(Q), 0, -1) == [b"job"]  # once
    assert int(float(await conn.execute("ZSCORE", keys.schedules, b"ticks\0job"))) > now


async def test_client_schedules_list_and_validation(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        t0 = await client.time()
        assert await client.schedule(Q, "a", every=60) is True
        assert await client.schedule(Q, "a", every=30) is False
        assert await client.schedule("other", "b", cron="0 0 * * *") is True
        got = await client.schedules()
        assert [(s.queue, s.task, s.every, s.cron) for s in got] == [
            (Q, b"a", 30.0, None),
            ("other", b"b", None, "0 0 * * *"),
        ]
        assert t0 + 29 < got[0].next_run < t0 + 31
        assert got[1].next_run % 86400 == 0 and got[1].next_run > t0
        assert [s.task for s in await client.schedules("other")] == [b"b"]
        for bad in ({}, {"every": 1, "cron": "* * * * *"}, {"every": 0.01}, {"cron": "nope"}):
            with pytest.raises(ConfigError):
                await client.schedule(Q, "x", **bad)
        assert await client.unschedule(Q, "a") is True
        assert await client.unschedule(Q, "a") is False
        assert [s.task for s in await client.schedules()] == [b"b"]


async def test_three_workers_enqueue_one_copy_per_tick(redis_url: str, namespace: str) -> None:
    # the copies go to a queue nobody serves: its length counts the ticks fired
    async with client_and_workers(redis_url, namespace, 3) as (client, _):
        await client.schedule(Q, "tick", every=0.2)
        (s,) = await client.schedules()
        await check_one_copy_per_tick(client, s.next_run, 0.2, 11)


async def check_one_copy_per_tick(
    client: mesh.Client, first: float, every: float, ticks: int
) -> None:
    """Wait until ``ticks`` ticks were due, unschedule, and check that the
    queue got one copy per tick that was due: none missed (but the last,
    which may have been due while it was unscheduled), none twice."""

    async def due() -> bool:
        return await client.time() > first + (ticks - 1) * every + every / 4

    await wait_until(due, within=ticks * every + 10, what=f"{ticks} ticks")
    before = await client.time()
    await client.unschedule(Q, "tick")
    after = await client.time()
    copies = await client.queue_length(Q)
    due_before = int((before - first) / every) + 1
    due_after = int((after - first) / every) + 1
    assert due_before >= ticks
    assert due_before - 1 <= copies <= due_after, (copies, due_before, due_after)
    assert set(await client.tasks(Q)) == {b"tick"}


@pytest.mark.slow
async def test_a_tick_is_not_missed_when_a_peer_is_sigkilled(
    redis_url: str, namespace: str
) -> None:
    peers = Peers(redis_url, namespace)
    try:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            procs = [peers.start("--hold", "0") for _ in range(3)]
            await wait_ready(client, peers, 3)
            await client.schedule(Q, "tick", every=0.3)
            (s,) = await client.schedules()

            async def three_ticks() -> bool:
                return await client.time() > s.next_run + 0.65

            await wait_until(three_ticks, within=10)
            procs[0].kill()  # SIGKILL one of the three
            await check_one_copy_per_tick(client, s.next_run, 0.3, 12)
            assert procs[1].poll() is None and procs[2].poll() is None
    finally:
        peers.stop_all()


async def test_the_scheduler_reads_the_policies_in_its_own_round_trip(
    conn: Connection, b: Binding, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    import math

    from mesh._policy import PolicyWatch, QueuePolicy, policy_fields

    await b.configure(conn, "q1", "set", "configure", policy_fields(max_attempts=7))
    await conn.execute("HSET", keys.policy, "q2", b"not json")
    applied: list[tuple[str, int]] = []

    def apply(q: str, p: QueuePolicy) -> None:
        applied.append((q, p.max_attempts))

    watch = PolicyWatch(keys.policy, {"q1": None, "q2": None, "q3": None}, apply)
    with caplog.at_level("WARNING", logger="mesh.worker"):
        assert await _fire_due(conn, b, keys, watch) == math.inf  # no schedule
    assert applied == [("q1", 7)]  # q2 unreadable (logged), q3 has none
    assert any("policy of queue q2" in r.getMessage() for r in caplog.records)
    # without a watch (or with no queues), no policy is read
    applied.clear()
    assert await _fire_due(conn, b, keys) == math.inf
    assert await _fire_due(conn, b, keys, PolicyWatch(keys.policy, {}, apply)) == math.inf
    assert applied == []
