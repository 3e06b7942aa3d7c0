"""The job-queue features of protocols 4 and 5 against a real redis-server: delayed
tasks (delay.lua, the claim's next-due report), dead-letter records, queue
policy, timeouts, results and priorities."""

from __future__ import annotations

import datetime

import anyio
import pytest

import mesh
from mesh import ConfigError, ConflictError, Process
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._errors import CommandError
from mesh._keys import Keys
from mesh._pubsub import PubSub, open_pubsub
from mesh.testing import wait_until

from .helpers import PEER_TTL, Peers, client_and_workers, redis_ms, wait_ready
from .protocol_helpers import join, snapshot

pytestmark = pytest.mark.both_loops

Q = "jobs"


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
        ms = 0.001  # started is in whole ms of the Redis clock, t0 in µs
        assert by[b"now"].started < t0 + 0.4
        assert t0 + 0.4 - ms <= by[b"first"].started
        assert t0 + 0.8 - ms <= by[b"second"].started and t0 + 0.8 - ms <= by[b"third"].started
        assert len(started) == 4  # each once
        assert await client.delayed(Q) == []


@pytest.mark.slow
async def test_a_task_due_while_a_worker_is_sigkilled_runs_once_on_a_live_peer(
    redis_url: str, namespace: str
) -> None:
    peers = Peers(redis_url, namespace)
    try:
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            a = peers.start("--hold", "0")
            peers.start("--hold", "0")
            await wait_ready(client, peers, 2)
            t0 = await client.time()
            await client.enqueue_many("jobs", ["d1", "d2"], delay=0.5)

            async def nearly_due() -> bool:
                return await client.time() >= t0 + 0.45

            await wait_until(nearly_due, what="just before the tasks are due")
            a.kill()  # SIGKILL, just before they come due

            async def ran() -> bool:
                return {e.task for e in await peers.events(client) if e.event == "start"} == {
                    "d1",
                    "d2",
                }

            await wait_until(ran, within=PEER_TTL * 5, what="the due tasks ran on the live peer")
            starts = [e for e in await peers.events(client) if e.event == "start"]
            assert sorted(e.task for e in starts) == ["d1", "d2"]  # each exactly once
            assert all(e.at >= t0 + 0.5 - 0.05 for e in starts)  # not before due (wall clock)
            assert await client.delayed("jobs") == []
    finally:
        peers.stop_all()


# --- dead letters ------------------------------------------------------------


async def test_give_back_and_recycle_keep_dead_letter_records(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"x\0y", b"crash"])
    c = await b.claim(conn, "w1", inc, Q, 2, 1)  # max_attempts 1: the first failure is the last
    x, _crash = c.processes
    t0 = await redis_ms(conn)
    long_error = "ValueError: " + "e\0" * 3000
    r = await b.give_back(conn, "w1", Q, [x.id], failed=True, errors=[long_error])
    assert r == [(3, 0)]
    # the crash of a worker is recorded too
    from .protocol_helpers import expire_worker

    await expire_worker(conn, keys, "w1")
    rr = await b.recycle(conn, "w1", leave=False)
    assert rr.dead_lettered == 1
    from mesh._replies import parse_dead

    recs = [parse_dead(rec, Q) for rec in await conn.execute("LRANGE", keys.dead(Q), 0, -1)]
    assert [d.task for d in recs] == [b"x\0y", b"crash"]
    assert [d.attempts for d in recs] == [1, 1]
    assert [d.worker for d in recs] == ["w1", "w1"]
    assert recs[0].error.startswith("ValueError: e e e") and len(recs[0].error) <= 2000
    assert "\0" not in recs[0].error
    assert recs[1].error == "worker crashed: the lease of worker w1 expired"
    assert all(t0 / 1000 - 0.001 <= d.when <= t0 / 1000 + 5 for d in recs)
    assert await conn.execute("HLEN", keys.attempts(Q)) == 0


async def test_dead_requeue_and_purge_by_payload_or_all(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a", b"b", b"a", b"c"])
    c = await b.claim(conn, "w1", inc, Q, 4, 1)
    await b.give_back(conn, "w1", Q, [p.id for p in c.processes], failed=True)
    await b.claim(conn, "w1", inc, Q, 1, 1)  # finds nothing: idle
    assert await b.dead(conn, Q, "requeue", [b"a"]) == (2, 0)  # both copies
    snap = await snapshot(conn, keys, Q, ["w1"])
    assert snap["queue"] == [b"a", b"a"] and snap["dead"] == [b"b", b"c"]
    assert await conn.execute("SISMEMBER", keys.idle(Q), "w1") == 0  # woken
    assert await b.dead(conn, Q, "requeue", [b"a"]) == (0, 0)  # twice: nothing more
    assert await b.dead(conn, Q, "purge", [b"c", b"zzz"]) == (1, 0)
    # a payload made persistent meanwhile is not requeued as one-shot
    await b.ensure(conn, Q, [b"b"])
    assert await b.dead(conn, Q, "requeue", None) == (0, 1)
    assert await b.dead(conn, Q, "purge", None) == (1, 0)
    snap = await snapshot(conn, keys, Q, ["w1"])
    assert snap["dead"] == [] and snap["queue"] == [b"a", b"a", b"b"]
    with pytest.raises(CommandError, match="BAD_ARG"):
        await b.dead(conn, Q, "bury", None)


async def test_worker_dead_letters_with_the_handlers_error_and_logs_one_line(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[Process] = []

    def look_up(name: str) -> None:
        raise KeyError(name)

    async def handler(p: Process) -> None:
        runs.append(p)
        if p.task.startswith(b"bad"):
            look_up("no such thing " + "x" * 5000)

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work(Q, handler, max_attempts=2, backoff=0.01, backoff_max=0.02)
        t0 = await client.time()
        with caplog.at_level("WARNING", logger="mesh.worker"):
            await client.enqueue_many(Q, ["bad-1", "good"])

            async def dead() -> bool:
                return len(await client.dead_letters(Q)) == 1

            await wait_until(dead, within=5, what="the dead letter")
        (d,) = await client.dead_letters(Q)
        assert d.task == b"bad-1" and d.attempts == 2 and d.worker == w.id
        assert d.error.startswith("KeyError: 'no such thing xxx") and len(d.error) <= 500
        # its traceback, bounded with the error to the record's 2,000 bytes: the
        # handler's frames and the raise, none of the mesh's own above them
        assert d.traceback is not None and "\n" not in d.error
        assert len(f"{d.error}\n{d.traceback}".encode()) <= 2000
        assert "in handler" in d.traceback and "in look_up" in d.traceback
        assert "raise KeyError(name)" in d.traceback
        assert "_pool.py" not in d.traceback and "_runner" not in d.traceback
        job = await client.job(Q, "bad-1")
        assert job is not None and (job.error, job.traceback) == (d.error, d.traceback)
        (first, last) = job.tries
        assert last.traceback is not None  # its first 1,000 bytes with the error
        assert last.traceback.startswith("Traceback (most recent call last):")
        assert first.error.startswith("KeyError: 'no such thing xxx")
        assert t0 <= d.when <= await client.time()
        lines = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
        assert len(lines) == 1 and "bad-1" in lines[0] and Q in lines[0]
        assert "\n" not in lines[0]

        # requeued with attempts reset: it runs again, from attempt 0
        assert await client.requeue_dead(Q) == 1
        assert await client.dead_letters(Q) == []

        async def dead_again() -> bool:
            return len(await client.dead_letters(Q)) == 1

        await wait_until(dead_again, within=5, what="dead-lettered again")
        assert [p.attempts for p in runs if p.task == b"bad-1"] == [0, 1, 0, 1]
        assert await client.purge_dead(Q, ["other"]) == 0
        assert await client.purge_dead(Q, ["bad-1"]) == 1
        assert await client.dead_letters(Q) == []
        assert await client.requeue_dead(Q, []) == 0


async def test_a_peer_that_recycles_a_crashed_worker_logs_each_task_it_dead_letters(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    from .protocol_helpers import expire_worker

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        conn, b, keys = client._conn, Binding(client._keys), client._keys
        inc = await join(b, conn, "crashed", Q)
        await client.enqueue_many(Q, ["doomed", "spared"])
        await b.claim(conn, "crashed", inc, Q, 1, 1)  # its last allowed attempt
        await b.claim(conn, "crashed", inc, Q, 1, 3)
        with caplog.at_level("WARNING", logger="mesh.worker"):
            await expire_worker(conn, keys, "crashed")  # forced, not slept

            def logged() -> list[str]:
                return [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]

            async def recycled() -> bool:
                # the worker logs once the recycle's reply is in: the queue
                # may show it first (seen under CI's load)
                return await client.queue_length(Q) == 1 and bool(logged())

            await wait_until(recycled, within=10, what="the live worker recycled the crashed one")
        lines = logged()
        assert len(lines) == 1, lines
        line = lines[0]
        assert "'doomed'" in line and Q in line and "attempt 1 of 1" in line
        assert "crashed" in line and w.id in line and "\n" not in line
        assert [d.task for d in await client.dead_letters(Q)] == [b"doomed"]
        assert await client.tasks(Q) == [b"spared"]


# --- queue policy and timeouts -------------------------------------------------


async def test_configure_script_set_default_clear(conn: Connection, b: Binding, keys: Keys) -> None:
    import json

    raw = await b.configure(conn, Q, "default", "worker w1", ["max_attempts", 3])
    assert raw is not None
    assert json.loads(raw) == {
        "max_attempts": 3,
        "backoff_ms": 1000,
        "backoff_max_ms": 60000,
        "timeout_ms": 0,
        "result_ttl_ms": 0,
        "rate_limit": 0,
        "rate_period_ms": 1000,
        "enqueue_times": 0,
        "source": "worker w1",
    }
    # "default" leaves a stored policy alone (and returns it)
    assert await b.configure(conn, Q, "default", "worker w2", ["max_attempts", 9]) == raw
    # "set" replaces the fields given, keeps the others
    raw = await b.configure(conn, Q, "set", "configure", ["timeout_ms", 250])
    assert raw is not None
    got = json.loads(raw)
    assert (got["max_attempts"], got["timeout_ms"], got["source"]) == (3, 250, "configure")
    assert await conn.execute("SISMEMBER", keys.queues, Q) == 1
    for bad in (["colour", 1], ["timeout_ms", -1], ["backoff_ms", 70000], ["max_attempts"]):
        with pytest.raises(CommandError, match="BAD_ARG"):
            await b.configure(conn, Q, "set", "configure", bad)
    assert await conn.execute("HGET", keys.policy, Q) == raw  # refused: unchanged
    assert await b.configure(conn, Q, "clear", "", []) is None
    assert await conn.execute("HEXISTS", keys.policy, Q) == 0


async def test_client_configure_and_policy(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.policy(Q) is None
        p = await client.configure(Q, max_attempts=2, backoff=0.5, timeout=3, result_ttl=60)
        assert p == mesh.QueuePolicy(2, 0.5, 60.0, 3.0, 60.0, source="configure")
        assert await client.policy(Q) == p
        p = await client.configure(Q, timeout=0)
        assert (p.max_attempts, p.timeout) == (2, 0.0)
        for bad in (
            {"max_attempts": -1},
            {"backoff": 5, "backoff_max": 1},
            {"backoff": 120},  # above the stored backoff_max: refused by the script
            {"timeout": float("inf")},
            {"result_ttl": -2},
        ):
            with pytest.raises(ConfigError):
                await client.configure(Q, **bad)
        assert await client.policy(Q) == p
        assert await client.clear_policy(Q) is True
        assert await client.clear_policy(Q) is False


async def test_the_queue_policy_wins_over_start_work_options_with_a_warning(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[Process] = []

    async def fail(p: Process) -> None:
        runs.append(p)
        raise RuntimeError("no")

    async with client_and_workers(redis_url, namespace, 2) as (client, (w1, w2)):
        # the first server's options become the policy of a queue that has none
        await w1.start_work(Q, fail, max_attempts=2, backoff=0.01, backoff_max=0.02)
        policy = await client.policy(Q)
        assert policy == mesh.QueuePolicy(2, 0.01, 0.02, 0.0, 0.0, source=f"worker {w1.id}")
        with caplog.at_level("WARNING", logger="mesh.worker"):
            await w2.start_work(Q, fail, max_attempts=7)
        (line,) = [r.getMessage() for r in caplog.records if "overridden" in r.getMessage()]
        assert "max_attempts=7" in line and f"worker {w1.id}" in line
        await client.enqueue(Q, "x")

        async def dead() -> bool:
            return len(await client.dead_letters(Q)) == 1

        await wait_until(dead, within=5)
        assert len(runs) == 2  # both workers applied max_attempts=2, neither 7
        # a policy changed later reaches running workers (within a heartbeat)
        await client.configure(Q, max_attempts=3)

        async def applied() -> bool:
            return all(w._queues[Q].max_attempts == 3 for w in (w1, w2))

        await wait_until(applied, within=3, what="the new policy applied by both workers")
        await client.requeue_dead(Q)

        async def dead_after_three() -> bool:
            return len(runs) == 5 and len(await client.dead_letters(Q)) == 1

        await wait_until(dead_after_three, within=5)
        (d,) = await client.dead_letters(Q)
        assert d.attempts == 3


async def test_a_handler_over_the_timeout_is_cancelled_and_counts_as_failed(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    cancelled: list[Process] = []
    runs: list[Process] = []

    async def slow(p: Process) -> None:
        runs.append(p)
        if p.task == b"quick":
            return
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(p)
            raise

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.configure(Q, timeout=0.2, max_attempts=2, backoff=0.01, backoff_max=0.01)
        await w.start_work(Q, slow)
        with caplog.at_level("WARNING", logger="mesh.worker"):
            await client.enqueue_many(Q, ["slow", "quick"])

            async def dead() -> bool:
                # the worker logs once the script that dead-lettered it has
                # returned: the client can see the dead letter before that
                logged = any("dead-lettered" in r.getMessage() for r in caplog.records)
                return logged and len(await client.dead_letters(Q)) == 1

            await wait_until(dead, within=5)
        # one line for the timeout that dead-lettered it
        lines = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "'slow'" in lines[0] and "TimeoutError" in lines[0] and "attempt 2 of 2" in lines[0]
        (d,) = await client.dead_letters(Q)
        assert d.task == b"slow" and d.attempts == 2
        assert d.error == "TimeoutError: the handler ran longer than 0.2 s"
        assert [p.attempts for p in cancelled] == [0, 1]  # each attempt was cancelled
        assert [p.task for p in runs].count(b"quick") == 1
        st = w.statistics()
        assert (st.processes_finished, st.processes_failed) == (1, 2)


# --- results ---------------------------------------------------------------


async def test_finish_results_keeps_values_for_the_ttl(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    from mesh._replies import ResultsToKeep, parse_result

    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"a\0", b"b", b"c"])
    ps = (await b.claim(conn, "w1", inc, Q, 3, 0)).processes
    keep = ResultsToKeep(
        60_000, {ps[0].id: (b"a\0", b"v\0al"), ps[1].id: (b"b", None), ps[2].id: (b"c", b"")}
    )
    t0 = await redis_ms(conn)
    assert await b.finish(conn, "w1", inc, Q, [p.id for p in ps], keep) == [True] * 3
    got = [
        parse_result(await conn.execute("GET", keys.result(Q, t)), t) for t in (b"a\0", b"b", b"c")
    ]
    assert [g[1] for g in got if g] == [b"v\0al", None, b""]
    assert all(g is not None and t0 / 1000 <= g[0] < t0 / 1000 + 5 for g in got)
    assert 59_000 < await conn.execute("PTTL", keys.result(Q, b"b")) <= 60_000
    # twice: not the caller's process any more, nothing changes
    assert await b.finish(conn, "w1", inc, Q, [ps[0].id], keep) == [False]
    # a record of another payload under the key (a collision) is not taken
    assert parse_result(await conn.execute("GET", keys.result(Q, b"b")), b"x") is None
    snap = await snapshot(conn, keys, Q, ["w1"])
    assert snap["procs"] == {} and snap["held"] == {"w1": set()}


async def test_result_waits_for_the_handlers_value_and_raises_for_dead_letters(
    redis_url: str, namespace: str
) -> None:
    release = anyio.Event()

    async def handler(p: Process) -> object:
        if p.task == b"slow":
            await release.wait()
            return "done: slow"
        if p.task == b"bad":
            raise ValueError("cannot")
        if p.task == b"none":
            return None
        if p.task == b"int":
            return 42
        return p.task.upper()

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.configure(Q, result_ttl=30, max_attempts=1)
        await w.start_work(Q, handler)
        await client.enqueue_many(Q, ["slow", "bad", "none", "abc", "int"])
        async with anyio.create_task_group() as nursery:
            got: list[bytes | None] = []

            async def wait_slow() -> None:
                got.append(await client.result(Q, "slow", timeout=10))

            nursery.start_soon(wait_slow)
            await anyio.sleep(0.2)  # a deliberate window: the call must not return
            assert got == []  # still running: the call waits
            release.set()
        assert got == [b"done: slow"]
        assert await client.result(Q, "abc", timeout=5) == b"ABC"
        assert await client.result(Q, "none", timeout=5) is None
        assert await client.result(Q, "int", timeout=5) is None  # not bytes/str: None
        with pytest.raises(mesh.DeadLetterError) as ei:
            await client.result(Q, "bad", timeout=5)
        assert isinstance(ei.value.dead_letter, mesh.DeadLetter)
        assert ei.value.dead_letter.error == "ValueError: cannot"
        assert isinstance(ei.value, mesh.MeshError)
        with pytest.raises(TimeoutError):
            await client.result(Q, "never enqueued", timeout=0.2)


async def test_done_messages_are_published_only_while_a_result_is_awaited(
    redis_url: str, namespace: str, keys: Keys
) -> None:
    """Finished tasks publish no done message while nobody awaits a result
    of their queue; a waiting client.result() marks the queue (its awaiting
    key), is sent the done message of its task and returns its value; the
    mark then expires on its own."""
    release = anyio.Event()

    async def handler(p: Process) -> bytes:
        if p.task == b"slow":
            await release.wait()
        return b"r:" + p.task

    done = keys.done_channel(Q)

    async def heard(conn: Connection, pubsub: PubSub) -> list[bytes]:
        # everything on the done channel so far: a marker, then up to it
        await conn.execute("PUBLISH", done, "end")
        got: list[bytes] = []
        with anyio.fail_after(5):
            async for msg in pubsub:
                got.append(msg.data)
                if msg.data == b"end":
                    return got
        raise AssertionError("unreachable")

    async with (
        client_and_workers(redis_url, namespace, 1) as (client, (w,)),
        open_pubsub(redis_url) as pubsub,
    ):
        conn = client._conn
        await pubsub.subscribe(done, sharded=True)
        await client.configure(Q, result_ttl=30)
        await w.start_work(Q, handler)
        await client.enqueue_many(Q, ["a", "b", "c"])

        async def finished(n: int) -> bool:
            return w.statistics().processes_finished == n

        await wait_until(lambda: finished(3))
        assert await heard(conn, pubsub) == [b"end"]  # nobody awaited: nothing published
        assert await conn.execute("EXISTS", keys.awaiting(Q)) == 0
        assert await client.result(Q, "a", timeout=5) == b"r:a"  # kept all the same
        await client.enqueue(Q, "slow")
        got: list[bytes | None] = []

        async def wait_slow() -> None:
            got.append(await client.result(Q, "slow", timeout=30))

        async with anyio.create_task_group() as nursery:
            nursery.start_soon(wait_slow)

            async def marked() -> bool:
                return bool(await conn.execute("EXISTS", keys.awaiting(Q)))

            await wait_until(marked)
            release.set()
        assert got == [b"r:slow"]
        assert await heard(conn, pubsub) == [b"slow", b"end"]
        assert 0 < await conn.execute("PTTL", keys.awaiting(Q)) <= 10_000


async def test_results_expire_and_plain_queues_keep_none(
    redis_url: str, namespace: str, keys: Keys
) -> None:
    async def handler(p: Process) -> bytes:
        return b"r:" + p.task

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.configure(Q, result_ttl=0.3)
        await w.start_work(Q, handler)
        await w.start_work("plain", handler)
        await client.enqueue(Q, "x")
        await client.enqueue("plain", "y")
        assert await client.result(Q, "x", timeout=5) == b"r:x"

        async def plain_done() -> bool:
            return w.statistics().processes_finished == 2

        await wait_until(plain_done)
        # nothing kept for a queue without result_ttl
        assert await client._conn.execute("EXISTS", keys.result("plain", b"y")) == 0
        with pytest.raises(TimeoutError):
            await client.result("plain", "y", timeout=0.1)

        async def expired() -> bool:
            return bool(await client._conn.execute("EXISTS", keys.result(Q, b"x")) == 0)

        await wait_until(expired, within=3, what="the result expired")
        with pytest.raises(TimeoutError):
            await client.result(Q, "x", timeout=0.1)


# --- rate limit ----------------------------------------------------------------


async def test_claim_takes_only_the_tokens_of_the_bucket(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"%d" % i for i in range(6)])
    c = await b.claim(conn, "w1", inc, Q, 5, 0, rate=(2, 1000))
    assert [p.task for p in c.processes] == [b"0", b"1"]  # a full bucket: a burst of 2
    assert 400 <= c.next_due_ms <= 500  # the next token is due in 500 ms
    c = await b.claim(conn, "w1", inc, Q, 5, 0, rate=(2, 1000))
    assert c.processes == () and 1 <= c.next_due_ms <= 500
    tokens, _ = await conn.execute("HMGET", keys.rate(Q), "tokens", "at")
    assert float(tokens) < 1
    # a second later (forced, not slept): full again, two more
    now = await redis_ms(conn)
    await conn.execute("HSET", keys.rate(Q), "at", now - 1000)
    c = await b.claim(conn, "w1", inc, Q, 5, 0, rate=(2, 1000))
    assert [p.task for p in c.processes] == [b"2", b"3"]
    assert 0 < await conn.execute("PTTL", keys.rate(Q)) <= 2000
    # an empty queue: no wait reported, no token spent
    await conn.execute("DEL", keys.queue(Q), keys.rate(Q))
    c = await b.claim(conn, "w1", inc, Q, 5, 0, rate=(2, 1000))
    assert c.processes == () and c.next_due_ms == -1
    assert await conn.execute("EXISTS", keys.rate(Q)) == 0
    for bad in [(0, 1000), (2, 0)]:
        with pytest.raises(CommandError, match="BAD_ARG"):
            await b.claim(conn, "w1", inc, Q, 1, 0, rate=bad)


async def test_three_workers_claim_at_the_rate_limit(redis_url: str, namespace: str) -> None:
    runs: list[Process] = []

    async def handler(p: Process) -> None:
        runs.append(p)

    async with client_and_workers(redis_url, namespace, 3) as (client, workers):
        p = await client.configure(Q, rate_limit=(10, 0.5))  # 20 per second, bursts of 10
        assert (p.rate_limit, p.rate_period) == (10, 0.5)
        for w in workers:
            await w.start_work(Q, handler)
        await client.enqueue_many(Q, [str(i) for i in range(70)])

        async def all_ran() -> bool:
            return len(runs) == 70

        await wait_until(all_ran, within=15)
        starts = sorted(p.started for p in runs)
        assert len({p.worker_id for p in runs}) >= 2  # spread over the workers
        # after the first burst of 10, 20 per second across the mesh
        steady = (len(starts) - 11) / (starts[-1] - starts[10])
        assert 18 <= steady <= 22, steady
        # never more than a burst plus the refill in any second
        for i, t in enumerate(starts):
            assert sum(1 for u in starts[i:] if u < t + 1.0) <= 10 + 20 + 1
        assert (await client.configure(Q, rate_limit=0)).rate_limit == 0


# --- priorities ----------------------------------------------------------------


async def test_claim_takes_the_highest_priority_first_fifo_within_one(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        conn, b, keys = client._conn, Binding(client._keys), client._keys
        await client.enqueue(Q, "a")
        await client.enqueue_many(Q, ["b", "c"], priority=5)
        await client.enqueue(Q, "d", priority=9)
        await client.enqueue(Q, "e", priority=0)
        await client.enqueue(Q, "f", priority=5)
        assert await client.tasks(Q) == [b"d", b"b", b"c", b"f", b"a", b"e"]
        assert await client.queue_length(Q) == 6
        assert (await client.queue_info(Q)).queued == 6
        inc = await join(b, conn, "w1", Q)
        beat = (await b.heartbeat(conn, "w1", inc, 60_000, [], [Q])).beats()[0]
        assert beat.state == 0  # work
        c = await b.claim(conn, "w1", inc, Q, 3, 0)
        assert [p.task for p in c.processes] == [b"d", b"b", b"c"]
        assert c.remaining == 3
        # the record keeps the level; the process list reads it
        assert {p.task for p in await client.processes(Q)} == {b"d", b"b", b"c"}
        c = await b.claim(conn, "w1", inc, Q, 5, 0)
        assert [p.task for p in c.processes] == [b"f", b"a", b"e"]
        assert await conn.execute("EXISTS", keys.prio(Q)) == 0
        # only tasks with a priority left: the heartbeat still reports work
        await client.enqueue(Q, "g", priority=1)
        beat = (await b.heartbeat(conn, "w1", inc, 60_000, [], [Q])).beats()[0]
        assert beat.state == 0


async def test_priority_is_validated(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        for bad in (10, -1, 2.5, True, "3"):
            with pytest.raises(ConfigError, match="priority must be a whole number from 0 to 9"):
                await client.enqueue(Q, "x", priority=bad)  # type: ignore[arg-type]
        b = Binding(client._keys)
        with pytest.raises(CommandError, match="BAD_ARG priority"):
            await b.enqueue(client._conn, Q, [b"x"], 10)
        with pytest.raises(CommandError, match="BAD_ARG priority"):
            await b.delay(client._conn, Q, [b"x"], in_ms=5, priority=10)
        assert await client.queue_length(Q) == 0


async def test_returned_failed_and_recycled_tasks_keep_their_priority(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    from .protocol_helpers import expire_worker

    inc = await join(b, conn, "w1", Q)
    await b.enqueue(conn, Q, [b"p1", b"p2"], 5)
    c = await b.claim(conn, "w1", inc, Q, 1, 3, backoff_ms=0, backoff_cap_ms=0)
    (p1,) = c.processes
    await b.enqueue(conn, Q, [b"p3"], 5)
    await b.enqueue(conn, Q, [b"plain"])
    # handed back: the front of its level, not the list
    assert await b.give_back(conn, "w1", Q, [p1.id], failed=False) == [(1, 0)]

    async def order() -> list[bytes]:
        prio = await conn.execute("ZRANGE", keys.prio(Q), 0, -1)
        return [m[16:] for m in prio] + list(await conn.execute("LRANGE", keys.queue(Q), 0, -1))

    assert await order() == [b"p1", b"p2", b"p3", b"plain"]
    # failed without a backoff: the back of its level
    c = await b.claim(conn, "w1", inc, Q, 1, 3, backoff_ms=0, backoff_cap_ms=0)
    assert await b.give_back(conn, "w1", Q, [c.processes[0].id], failed=True) == [(2, 0)]
    assert await order() == [b"p2", b"p3", b"p1", b"plain"]
    # failed with a backoff: delayed, and when due the front of its level
    c = await b.claim(conn, "w1", inc, Q, 1, 3, backoff_ms=60_000, backoff_cap_ms=60_000)
    assert c.processes[0].task == b"p2"
    r = await b.give_back(
        conn, "w1", Q, [c.processes[0].id], failed=True, backoff_ms=60_000, backoff_cap_ms=60_000
    )
    assert r == [(2, 60_000)]
    assert await conn.execute("HGET", keys.delayed_prio(Q), b"p2") == b"5"
    await conn.execute("ZADD", keys.delayed(Q), "XX", 0, b"p2")  # due now (forced)
    c = await b.claim(conn, "w1", inc, Q, 1, 3, backoff_ms=0, backoff_cap_ms=0)
    assert c.processes[0].task == b"p2"  # before p3, p1 and the plain task
    assert await conn.execute("EXISTS", keys.delayed_prio(Q)) == 0
    # a crashed worker's task: its second failure goes to the back of its
    # level (no backoff here); a first crash to the front; dead-lettered at
    # its limit like any other
    await expire_worker(conn, keys, "w1")
    rr = await b.recycle(conn, "w1", leave=False)
    assert (rr.returned, rr.dead_lettered) == (1, 0)
    assert await order() == [b"p3", b"p1", b"p2", b"plain"]
    inc = await join(b, conn, "w2", Q)
    c = await b.claim(conn, "w2", inc, Q, 1, 3)
    assert c.processes[0].task == b"p3" and c.processes[0].attempts == 0
    await expire_worker(conn, keys, "w2")
    rr = await b.recycle(conn, "w2", leave=False)
    assert (rr.returned, rr.dead_lettered) == (1, 0)
    assert await order() == [b"p3", b"p1", b"p2", b"plain"]
    inc = await join(b, conn, "w3", Q)
    c = await b.claim(conn, "w3", inc, Q, 1, 2)
    assert c.processes[0].task == b"p3" and c.processes[0].attempts == 1
    await expire_worker(conn, keys, "w3")
    rr = await b.recycle(conn, "w3", leave=False)
    assert (rr.returned, rr.dead_lettered) == (0, 1)
    assert [d[-2:] for d in await conn.execute("LRANGE", keys.dead(Q), 0, -1)] == [b"p3"]
    # a worker that stops serving hands its tasks back to the front of their level
    inc = await join(b, conn, "w4", Q)
    c = await b.claim(conn, "w4", inc, Q, 2, 3)
    assert [p.task for p in c.processes] == [b"p1", b"p2"]
    assert await b.unserve(conn, "w4", Q) == 2
    assert await order() == [b"p1", b"p2", b"plain"]


async def test_delayed_tasks_with_a_priority_land_in_their_level(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        conn, b, keys = client._conn, Binding(client._keys), client._keys
        await client.enqueue_many(Q, ["plain", "low"], priority=0)
        await client.enqueue(Q, "two", priority=2)
        await client.enqueue(Q, "late", delay=3600, priority=7)
        assert [d.task for d in await client.delayed(Q)] == [b"late"]
        assert (await client.queue_info(Q)).delayed == 1
        await conn.execute("ZADD", keys.delayed(Q), "XX", 0, b"late")  # due now (forced)
        inc = await join(b, conn, "w1", Q)
        c = await b.claim(conn, "w1", inc, Q, 4, 0)
        assert [p.task for p in c.processes] == [b"late", b"two", b"plain", b"low"]


async def test_cancel_delete_and_ensure_see_tasks_with_a_priority(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        keys = client._keys
        await client.enqueue_many(Q, ["x", "y", "x\0z"], priority=3)
        await client.enqueue(Q, "x", priority=8)
        await client.enqueue(Q, "x", delay=3600, priority=4)
        with pytest.raises(ConflictError):
            await client.ensure(Q, "y")
        assert await client.cancel(Q, "x") == 3  # two queued, one delayed
        assert await client.tasks(Q) == [b"y", b"x\0z"]
        assert await client._conn.execute("EXISTS", keys.delayed_prio(Q)) == 0
        await client.enqueue(Q, "w", delay=3600, priority=4)
        assert await client.delete_queue(Q) == 3
        for k in (keys.prio(Q), keys.delayed_prio(Q), keys.delayed(Q)):
            assert await client._conn.execute("EXISTS", k) == 0


async def test_a_worker_runs_the_highest_priority_first(redis_url: str, namespace: str) -> None:
    ran: list[bytes] = []

    async def handler(p: Process) -> None:
        ran.append(p.task)

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.enqueue_many(Q, [f"low-{i}" for i in range(3)])
        await client.enqueue_many(Q, [f"mid-{i}" for i in range(3)], priority=4)
        await client.enqueue(Q, "top", priority=9)
        await w.start_work(Q, handler, concurrency=1)

        async def all_ran() -> bool:
            return len(ran) == 7

        await wait_until(all_ran, within=5, what="the tasks ran")
        assert ran == [b"top", b"mid-0", b"mid-1", b"mid-2", b"low-0", b"low-1", b"low-2"]


async def test_result_says_a_task_finished_with_no_result_kept(
    redis_url: str, namespace: str
) -> None:
    """Issue 32, item 14: a task that finishes while ``result()`` waits, on a
    queue that kept no result when it ran, ends the wait at once with a
    MeshError that says so (it was a TimeoutError after the whole timeout)."""
    release = anyio.Event()

    async def handler(p: Process) -> bytes:
        await release.wait()
        return b"value"

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work(Q, handler)  # no policy: no result is kept
        await client.enqueue(Q, "t")
        errors: list[Exception] = []

        async def wait_result() -> None:
            try:
                await client.result(Q, "t", timeout=60)
            except Exception as exc:
                errors.append(exc)

        with anyio.fail_after(30):  # well within the call's own timeout
            async with anyio.create_task_group() as nursery:
                nursery.start_soon(wait_result)
                # the waiter has marked the queue (it awaits its done message)
                await wait_until(lambda: client._conn.execute("EXISTS", client._keys.awaiting(Q)))
                release.set()
        (exc,) = errors
        assert type(exc) is mesh.MeshError, exc
        assert str(exc) == (
            f"the task finished on queue {Q} with no result kept (the queue's policy kept "
            "no results when it ran); none will come"
        )
