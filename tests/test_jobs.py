"""The job-queue features of protocol 4 against a real redis-server: delayed
tasks (delay.lua, the claim's next-due report), dead-letter records, queue
policy, timeouts and results."""

from __future__ import annotations

import datetime

import pytest
import trio

import mesh
from mesh import ConfigError, ConflictError, Process
from mesh._connection import Connection
from mesh._errors import CommandError
from mesh._keys import Keys
from mesh._scripts import Binding
from mesh.testing import wait_until

from .protocol_helpers import join, snapshot
from .test_worker import client_and_workers

Q = "jobs"


@pytest.fixture
def keys(namespace: str) -> Keys:
    return Keys(namespace)


@pytest.fixture
def b(keys: Keys) -> Binding:
    return Binding(keys)


async def redis_ms(conn: Connection) -> int:
    sec, usec = await conn.execute("TIME")
    return int(sec) * 1000 + int(usec) // 1000


# --- delay.lua -----------------------------------------------------------


async def test_delay_puts_tasks_in_the_delayed_set_due_by_redis_time(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    before = await redis_ms(conn)
    r = await b.delay(conn, Q, [b"a", b"b"], in_ms=60_000)
    after = await redis_ms(conn)
    assert r.added == 2
    assert before + 60_000 <= r.due_ms <= after + 60_000
    assert r.due_ms == r.now_ms + 60_000
    got = await conn.execute("ZRANGE", keys.delayed(Q), 0, -1, "WITHSCORES")
    assert got == [b"a", str(r.due_ms).encode(), b"b", str(r.due_ms).encode()]
    assert await conn.execute("SISMEMBER", keys.queues, Q) == 1
    # not claimable before it is due; the claim says when the first is due
    inc = await join(b, conn, "w1", Q)
    c = await b.claim(conn, "w1", inc, Q, 5, 0)
    assert c.processes == ()
    assert 59_000 < c.next_due_ms <= 60_000
    # due (forced, not slept): the claim moves it to the head and takes it
    await conn.execute("ZADD", keys.delayed(Q), "XX", r.now_ms - 1, b"a")
    c = await b.claim(conn, "w1", inc, Q, 5, 0)
    assert [p.task for p in c.processes] == [b"a"]
    assert 59_000 < c.next_due_ms <= 60_000
    snap = await snapshot(conn, keys, Q, ["w1"])
    assert snap["delayed"] == [b"b"] and snap["queue"] == []


async def test_delay_keeps_one_entry_per_payload_at_the_earlier_time(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    first = await b.delay(conn, Q, [b"a"], in_ms=10_000)
    again = await b.delay(conn, Q, [b"a"], in_ms=50_000)
    assert (first.added, again.added) == (1, 0)
    assert int(float(await conn.execute("ZSCORE", keys.delayed(Q), b"a"))) == first.due_ms
    sooner = await b.delay(conn, Q, [b"a", b"c"], in_ms=1_000)
    assert sooner.added == 1  # c is new; a moved earlier
    assert int(float(await conn.execute("ZSCORE", keys.delayed(Q), b"a"))) == sooner.due_ms


async def test_delay_at_an_absolute_time_and_in_the_past(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    now = await redis_ms(conn)
    r = await b.delay(conn, Q, [b"later"], at_ms=now + 3_600_000)
    assert r.due_ms == now + 3_600_000
    await b.delay(conn, Q, [b"past"], at_ms=now - 5_000)
    inc = await join(b, conn, "w1", Q)
    c = await b.claim(conn, "w1", inc, Q, 5, 0)
    assert [p.task for p in c.processes] == [b"past"]


async def test_delay_refuses_persistent_payloads_and_bad_arguments(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    await b.ensure(conn, Q, [b"p"])
    with pytest.raises(ConflictError):
        await b.delay(conn, Q, [b"x", b"p"], in_ms=10)
    assert await conn.execute("EXISTS", keys.delayed(Q)) == 0  # nothing added
    script = b.scripts["delay"]
    ks = [keys.delayed(Q), keys.queues, keys.persistent(Q), keys.standby(Q), keys.idle(Q)]
    cases: list[tuple[str, int | str]] = [("soon", 1), ("in", -1), ("at", "x")]
    for mode, ms in cases:
        with pytest.raises(CommandError) as ei:
            await conn.execute("EVAL", script.source, 5, *ks, Q, "p:", mode, ms, b"x")
        assert ei.value.code == "BAD_ARG"
    assert await conn.execute("EXISTS", keys.delayed(Q)) == 0


async def test_delay_wakes_an_idle_server_only_when_it_is_the_first_due(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.claim(conn, "w1", inc, Q, 1, 0)  # finds nothing: idle
    assert await conn.execute("SMEMBERS", keys.idle(Q)) == [b"w1"]
    await b.delay(conn, Q, [b"a"], in_ms=60_000)
    assert await conn.execute("SMEMBERS", keys.idle(Q)) == []  # woken
    await b.claim(conn, "w1", inc, Q, 1, 0)
    await b.delay(conn, Q, [b"b"], in_ms=90_000)  # not the first due: nobody woken
    assert await conn.execute("SMEMBERS", keys.idle(Q)) == [b"w1"]
    await b.delay(conn, Q, [b"c"], in_ms=1_000)  # the first due now
    assert await conn.execute("SMEMBERS", keys.idle(Q)) == []


async def test_a_claim_wakes_idle_peers_for_due_tasks_it_leaves(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc1 = await join(b, conn, "w1", Q)
    inc2 = await join(b, conn, "w2", Q)
    await b.claim(conn, "w2", inc2, Q, 1, 0)  # w2 idle
    now = await redis_ms(conn)
    await b.delay(conn, Q, [b"a", b"b", b"c"], at_ms=now - 1)
    await b.claim(conn, "w2", inc2, Q, 1, 0)  # takes one, idle no more
    c = await b.claim(conn, "w1", inc1, Q, 1, 0)
    assert len(c.processes) == 1 and c.next_due_ms == 0
    # w1 moved one due task, one is left due: w2 was woken (out of the set)
    assert await conn.execute("SISMEMBER", keys.idle(Q), "w2") == 0


# --- the client ------------------------------------------------------------


async def test_client_delay_and_at_validation(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        naive = datetime.datetime(2030, 1, 1)
        with pytest.raises(ConfigError, match="naive datetime"):
            await client.enqueue(Q, "x", at=naive)
        with pytest.raises(ConfigError, match="not both"):
            await client.enqueue(Q, "x", delay=1, at=1e9)
        with pytest.raises(ConfigError, match="delay"):
            await client.enqueue_many(Q, ["x"], delay=-1)
        with pytest.raises(ConfigError, match="delay"):
            await client.enqueue(Q, "x", delay=float("nan"))
        with pytest.raises(TypeError):
            await client.enqueue(Q, "x", at="tomorrow")  # type: ignore[arg-type]
        assert await client.delayed(Q) == []
        assert await client.queues() == []  # nothing was sent


async def test_client_lists_counts_and_cancels_delayed_tasks(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        now = await client.time()
        at = datetime.datetime.fromtimestamp(now + 7200, datetime.UTC)
        assert await client.enqueue_many(Q, ["b", "c"], at=at) == 2
        await client.enqueue(Q, "a", delay=3600)
        listed = await client.delayed(Q)
        assert [d.task for d in listed] == [b"a", b"b", b"c"]
        assert now + 3599 < listed[0].due < now + 3601
        assert abs(listed[1].due - (now + 7200)) < 0.002
        info = await client.queue_info(Q)
        assert (info.queued, info.delayed) == (0, 3)
        assert await client.cancel(Q, "b") == 1
        assert [d.task for d in await client.delayed(Q)] == [b"a", b"c"]


# --- workers -------------------------------------------------------------


async def test_a_delayed_task_runs_when_due_without_waiting_for_a_heartbeat(
    redis_url: str, namespace: str
) -> None:
    started: list[Process] = []

    async def handler(p: Process) -> None:
        started.append(p)

    # H = 10 s: a start within seconds comes from the wake and the claim's
    # next-due report, not from a heartbeat
    async with client_and_workers(redis_url, namespace, 2, ttl=30) as (client, workers):
        for w in workers:
            await w.start_work(Q, handler)
        t0 = await client.time()
        await client.enqueue(Q, "first", delay=0.4)
        await client.enqueue_many(Q, ["second", "third"], delay=0.8)
        await client.enqueue(Q, "now")

        async def all_ran() -> bool:
            return len(started) == 4

        await wait_until(all_ran, within=5, what="the delayed tasks ran")
        by = {p.task: p for p in started}
        assert by[b"now"].started < t0 + 0.4
        assert t0 + 0.4 <= by[b"first"].started
        assert t0 + 0.8 <= by[b"second"].started and t0 + 0.8 <= by[b"third"].started
        assert len(started) == 4  # each once
        assert await client.delayed(Q) == []


@pytest.mark.slow
async def test_a_task_due_while_a_worker_is_sigkilled_runs_once_on_a_live_peer(
    redis_url: str, namespace: str
) -> None:
    from .test_processes import TTL, Peers, wait_ready

    peers = Peers(redis_url, namespace)
    try:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            a = peers.start("--hold", "0")
            peers.start("--hold", "0")
            await wait_ready(client, peers, 2)
            t0 = await client.time()
            await client.enqueue_many("jobs", ["d1", "d2"], delay=0.5)
            await trio.sleep(0.45)
            a.kill()  # SIGKILL, just before they come due

            async def ran() -> bool:
                return {e.task for e in await peers.events(client) if e.event == "start"} == {
                    "d1",
                    "d2",
                }

            await wait_until(ran, within=TTL * 5, what="the due tasks ran on the live peer")
            starts = [e for e in await peers.events(client) if e.event == "start"]
            assert sorted(e.task for e in starts) == ["d1", "d2"]  # each exactly once
            assert all(e.at >= t0 + 0.5 - 0.05 for e in starts)  # not before due (wall clock)
            assert await client.delayed("jobs") == []
    finally:
        peers.stop_all()
