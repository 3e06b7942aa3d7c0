"""Browsing jobs (Client.jobs, Client.job), pausing queues (pause.lua, the
pause flag of claim.lua) and the per-minute counts (stats.lua) against a
real redis-server."""

from __future__ import annotations

from collections.abc import Awaitable

import anyio
import pytest

import mesh
from mesh import ConfigError, Process
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._history import CountsReporter
from mesh._keys import Keys
from mesh._stats import Recorder
from mesh.testing import wait_until

from .protocol_helpers import join

pytestmark = pytest.mark.both_loops

Q = "browse"


async def fill(conn: Connection, b: Binding, client: mesh.Client) -> dict[str, list[bytes]]:
    """Tasks of Q in every state: 2 running, 5 queued (2 with a priority),
    3 delayed, 3 dead; returns the payloads by state, in the state's order."""
    inc = await join(b, conn, "w1", Q)
    for t in ("r1", "r2"):
        await client.enqueue(Q, t)
    running = await b.claim(conn, "w1", inc, Q, 2, 1)
    assert [p.task for p in running.processes] == [b"r1", b"r2"]
    for t in ("d1", "d2", "d3"):
        await client.enqueue(Q, t)
    dying = await b.claim(conn, "w1", inc, Q, 3, 1)  # max attempts 1: a failure is final
    ids = [p.id for p in dying.processes]
    errors = ["ValueError: boom <b>&'\"", "KeyError: 'x'", "worker said no"]
    await b.give_back(conn, "w1", Q, ids, failed=True, errors=errors)
    for t in ("q1", "q2", "q3"):
        await client.enqueue(Q, t)
    await client.enqueue(Q, "hi5", priority=5)
    await client.enqueue(Q, "hi9", priority=9)
    for i, t in enumerate(("l1", "l2", "l3")):
        await client.enqueue(Q, t, delay=100 + i)
    return {
        "running": [b"r1", b"r2"],
        "queued": [b"hi9", b"hi5", b"q1", b"q2", b"q3"],
        "delayed": [b"l1", b"l2", b"l3"],
        "dead": [b"d1", b"d2", b"d3"],
    }


async def all_pages(client: mesh.Client, state: str, limit: int) -> list[mesh.JobPage]:
    pages = [await client.jobs(Q, state, limit=limit)]
    while pages[-1].next is not None:
        pages.append(await client.jobs(Q, state, limit=limit, after=pages[-1].next))
    return pages


async def test_jobs_lists_every_state_in_order_across_pages(
    conn: Connection, b: Binding, redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        want = await fill(conn, b, client)
        for state, payloads in want.items():
            pages = await all_pages(client, state, limit=2)
            assert len(pages) == (len(payloads) + 1) // 2, state
            got = [j for p in pages for j in p.jobs]
            assert [j.task for j in got] == payloads, state
            assert {j.state for j in got} == {state}
            assert all(p.total == len(payloads) for p in pages)
            assert all(len(p.jobs) == 2 for p in pages[:-1])
        running = (await client.jobs(Q, "running")).jobs
        assert [j.worker for j in running] == ["w1", "w1"]
        tokens = [j.token for j in running]
        assert None not in tokens and tokens == sorted(tokens)  # type: ignore[type-var]
        assert all(j.started is not None and j.error is None for j in running)
        dead = (await client.jobs(Q, "dead")).jobs
        assert dead[0].error == "ValueError: boom <b>&'\"" and dead[0].attempts == 1
        assert dead[0].worker == "w1" and dead[0].dead_at is not None
        queued = (await client.jobs(Q, "queued")).jobs
        assert [j.priority for j in queued] == [9, 5, 0, 0, 0]
        assert all(j.due is None and j.worker is None for j in queued)
        delayed = (await client.jobs(Q, "delayed")).jobs
        now = await client.time()
        assert all(d.due is not None and now + 90 < d.due < now + 110 for d in delayed)
        # a prefix finds across the priority set and the list
        hits = await client.jobs(Q, "queued", prefix="q", limit=2)
        assert [j.task for j in hits.jobs] == [b"q1", b"q2"] and hits.next is not None
        rest = await client.jobs(Q, "queued", prefix=b"q", after=hits.next)
        assert [j.task for j in rest.jobs] == [b"q3"] and rest.next is None


async def test_job_finds_a_payload_in_each_state_or_none(
    conn: Connection, b: Binding, redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        want = await fill(conn, b, client)
        for state, payloads in want.items():
            for t in payloads:
                j = await client.job(Q, t)
                assert j is not None and j.state == state and j.task == t, (state, t)
        hi = await client.job(Q, "hi9")
        assert hi is not None and hi.priority == 9
        d2 = await client.job(Q, "d2")
        assert d2 is not None and d2.error == "KeyError: 'x'"
        assert await client.job(Q, "nowhere") is None
        assert await client.job(Q, "q") is None  # a prefix is not a match
        # glob characters in a payload are matched literally
        await client.enqueue(Q, "a*[x]?", priority=3)
        star = await client.job(Q, "a*[x]?")
        assert star is not None and star.state == "queued" and star.priority == 3


async def test_a_persistent_task_in_the_queue_says_since_when_it_waits(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        before = await client.time()
        await client.ensure(Q, "device-1")
        j = await client.job(Q, "device-1")
        assert j is not None and j.state == "queued" and j.persistent
        assert j.enqueued is not None and before - 1 <= j.enqueued <= await client.time() + 1
        assert j.as_dict()["task"] == "device-1"


async def test_bad_arguments_are_refused_with_one_line(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        for kwargs, word in [
            ({"state": "finished"}, "state"),
            ({"state": "queued", "limit": 0}, "limit"),
            ({"state": "queued", "limit": True}, "limit"),
            ({"state": "queued", "limit": 1001}, "limit"),
            ({"state": "queued", "after": "garbage"}, "cursor"),
        ]:
            with pytest.raises(ConfigError, match=word) as ei:
                await client.jobs(Q, **kwargs)  # type: ignore[arg-type]
            assert "\n" not in str(ei.value)
        with pytest.raises(ConfigError, match="queue name"):
            await client.jobs("no spaces", "queued")
        with pytest.raises(ConfigError, match="queue name"):
            await client.pause("{bad}")
        with pytest.raises(ConfigError, match="queue name"):
            await client.job("", "x")


# --- pause -------------------------------------------------------------


async def test_pause_lua_holds_one_shot_tasks_back_and_lets_persistent_ones_through(
    conn: Connection, b: Binding, keys: Keys, redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        inc = await join(b, conn, "w1", Q)
        await client.enqueue(Q, "one")
        await client.enqueue(Q, "hi", priority=4)
        assert await client.pause(Q) is True
        assert await client.pause(Q) is False  # twice: no change
        c = await b.claim(conn, "w1", inc, Q, 5, 0)
        assert c.processes == () and c.remaining == 0
        # nothing moved: the one-shot tasks wait in place
        assert [j.task for j in (await client.jobs(Q, "queued")).jobs] == [b"hi", b"one"]
        # a persistent task behind them is still taken, the rest stays in order
        await client.ensure(Q, "dev")
        await client.enqueue(Q, "two")
        c = await b.claim(conn, "w1", inc, Q, 5, 0)
        assert [(p.task, p.persistent) for p in c.processes] == [(b"dev", True)]
        assert c.remaining == 0
        assert [j.task for j in (await client.jobs(Q, "queued")).jobs] == [b"hi", b"one", b"two"]
        # a due delayed task moves to the queue but does not start
        await client.enqueue(Q, "later", delay=60)
        await conn.execute("ZADD", keys.delayed(Q), "XX", 0, b"later")  # due (forced)
        c = await b.claim(conn, "w1", inc, Q, 5, 0)
        assert c.processes == ()
        queued = [j.task for j in (await client.jobs(Q, "queued")).jobs]
        assert set(queued) == {b"hi", b"one", b"two", b"later"}
        assert (await client.queue_info(Q)).paused is True
        assert Q in await client.paused()
        # resume: the idle worker is woken, and the claim takes one-shot tasks again
        assert await conn.execute("SISMEMBER", keys.idle(Q), "w1") == 1
        assert await client.resume(Q) is True
        assert await conn.execute("SISMEMBER", keys.idle(Q), "w1") == 0  # woken
        assert await client.resume(Q) is False
        c = await b.claim(conn, "w1", inc, Q, 5, 0)
        assert [p.task for p in c.processes] == [b"hi", b"later", b"one", b"two"]
        assert (await client.queue_info(Q)).paused is False


async def test_a_paused_queue_lets_running_jobs_finish_keeps_devices_and_resumes_promptly(
    redis_url: str, namespace: str
) -> None:
    started: list[bytes] = []
    release = anyio.Event()

    async def handler(p: Process) -> None:
        started.append(p.task)
        if p.persistent:
            await anyio.sleep_forever()
        if p.task == b"slow":
            await release.wait()

    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=3.0) as worker,
    ):
        await client.ensure(Q, "device")
        await client.enqueue(Q, "slow")
        await worker.start_work(Q, handler, concurrency=4)
        await wait_until(lambda: b"slow" in started and b"device" in started)
        await client.pause(Q)
        for t in ("a", "b", "c"):
            await client.enqueue(Q, t)
        release.set()
        # the running job finishes while the queue is paused
        await wait_until(lambda: worker.statistics().processes_finished >= 1, what="slow to finish")
        # The worker has free slots and was woken by each enqueue: had any
        # claim taken a one-shot task, it would have started by the time a
        # fresh claim round trip is over. Force one more claim round trip:
        # a cancel of the device hands it over, and the same worker takes it
        # again (persistent tasks are not paused).
        owner = (await client.persistent_tasks(Q))[b"device"]
        assert owner is not None
        await client.cancel(Q, "device")
        await client.ensure(Q, "device")
        await wait_until(lambda: started.count(b"device") == 2, what="the device to be owned again")
        assert not {b"a", b"b", b"c"} & set(started)
        page = await client.jobs(Q, "queued")
        assert [j.task for j in page.jobs] == [b"a", b"b", b"c"]
        await client.resume(Q)
        await wait_until(lambda: {b"a", b"b", b"c"} <= set(started), what="resumed jobs")
        assert (await client.persistent_tasks(Q))[b"device"] is not None


async def test_a_pause_holds_for_every_worker_of_the_namespace(
    redis_url: str, namespace: str
) -> None:
    started: list[bytes] = []

    async def handler(p: Process) -> None:
        started.append(p.task)

    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=3.0) as w1,
        mesh.open_worker(redis_url, namespace=namespace, ttl=3.0) as w2,
    ):
        await client.pause(Q)
        await w1.start_work(Q, handler)
        await w2.start_work(Q, handler)
        k = Keys(namespace)
        conn = w1.client._check()
        await wait_until(lambda: _is(conn.execute("SCARD", k.idle(Q)), 2), what="both idle")
        await client.enqueue(Q, "x")  # wakes both: takes them out of the idle set
        assert await conn.execute("SCARD", k.idle(Q)) == 0
        # both are idle servers again once they claimed and found nothing:
        # the proof that each looked while the queue was paused
        await wait_until(lambda: _is(conn.execute("SCARD", k.idle(Q)), 2), what="both idle")
        assert started == []
        await client.resume(Q)
        await wait_until(lambda: started == [b"x"], what="x to run once")


async def _is(value: Awaitable[object], want: object) -> bool:
    return await value == want


# --- per-minute counts -------------------------------------------------


async def test_counts_are_kept_in_redis_per_minute_and_survive_the_reader(
    conn: Connection, b: Binding, keys: Keys, redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    reporter = CountsReporter(conn, b, lambda: (rec,))
    rec.queue(Q).finished += 7
    rec.queue(Q).failed += 2
    rec.queue("other").finished += 1
    assert await reporter.report()
    assert await reporter.report()  # nothing new: nothing sent
    rec.queue(Q).finished += 3
    assert await reporter.report()
    # a reader (a dashboard) started afterwards sees them: they live in Redis
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        (counts,) = await client.minute_counts([Q], minutes=60)
        assert len(counts.minutes) == 60
        assert sum(counts.finished) == 10 and sum(counts.failed) == 2
        assert counts.finished[-1] + counts.finished[-2] == 10  # this minute (or the last)
    ttl = await conn.execute("PTTL", keys.stats(Q))
    assert 0 < ttl <= 120 * 60_000
    # old minutes are dropped: a field 3 h old goes at the next report
    minute = int((await conn.execute("TIME"))[0]) // 60
    await conn.execute("HSET", keys.stats(Q), f"p{minute - 180}", 5, ":min", minute - 180)
    rec.queue(Q).failed += 1
    assert await reporter.report()
    fields = await conn.execute("HKEYS", keys.stats(Q))
    assert f"p{minute - 180}".encode() not in fields


async def test_a_worker_reports_what_its_handlers_did(redis_url: str, namespace: str) -> None:
    async def handler(p: Process) -> None:
        if p.task.startswith(b"bad"):
            raise ValueError("no")

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=3.0) as worker:
            await worker.start_work(Q, handler, max_attempts=1)
            for t in ("ok1", "ok2", "bad1"):
                await client.enqueue(Q, t)
            await wait_until(
                lambda: (
                    (s := worker.statistics()).processes_finished == 2 and s.processes_failed == 1
                )
            )
        # the worker's last report went out as it left
        (counts,) = await client.minute_counts([Q], minutes=2)
        assert (sum(counts.finished), sum(counts.failed)) == (2, 1)


def big(tag: str, size: int = 3 << 20) -> bytes:
    """A payload of ``size`` bytes that starts with ``tag`` and differs from
    other tags' throughout."""
    return (tag.encode() + b":" + tag.encode() * (size // len(tag)))[:size]


async def test_pages_carry_previews_and_sizes_and_a_ref_fetches_the_whole_payload(
    conn: Connection, b: Binding, redis_url: str, namespace: str
) -> None:
    """A page never carries a whole payload (a 64 MiB one is allowed): each
    job has its first PREVIEW bytes, its size and a ref; the ref finds the
    whole payload, also after jobs ahead of it left, and None once it is gone."""
    from mesh._blob import standin
    from mesh._browse import PREVIEW, fingerprint, payload

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        inc = await join(b, conn, "w1", Q)
        await client.enqueue(Q, big("run"))
        await b.claim(conn, "w1", inc, Q, 1, 1)
        await client.enqueue(Q, big("die"))
        dying = await b.claim(conn, "w1", inc, Q, 1, 1)
        await b.give_back(conn, "w1", Q, [dying.processes[0].id], failed=True, errors=["E"])
        await client.enqueue_many(Q, [big("ahead"), big("q1"), big("q2")])
        await client.enqueue(Q, big("hi"), priority=4)
        await client.ensure(Q, big("dev"))
        await client.enqueue(Q, big("later"), delay=100)
        want = {
            "running": [big("run")],
            "dead": [big("die")],
            "queued": [big("hi"), big("ahead"), big("q1"), big("q2"), big("dev")],
            "delayed": [big("later")],
        }
        for state, payloads in want.items():
            page = await client.jobs(Q, state)
            assert [j.task for j in page.jobs] == [p[:PREVIEW] for p in payloads], state
            assert [j.size for j in page.jobs] == [len(p) for p in payloads], state
            assert not any(j.whole for j in page.jobs)
            for j, p in zip(page.jobs, payloads, strict=True):
                # a payload over 1 MiB is queued as its stand-in (mesh._blob): the
                # ref's fingerprint is of what the queue holds
                fp = fingerprint(standin(p))
                assert j.ref is not None and len(j.ref) < 50 and j.ref.endswith(fp)
                assert await payload(client.reads, Q, j.ref) == p, (state, j.ref)
        queued = (await client.jobs(Q, "queued")).jobs
        assert [j.priority for j in queued] == [4, 0, 0, 0, 0]
        assert [j.persistent for j in queued] == [False, False, False, False, True]
        assert queued[4].enqueued is not None  # a persistent task says since when it waits
        # a prefix longer than the preview still matches
        hits = await client.jobs(Q, "queued", prefix=big("q2")[: PREVIEW + 100])
        assert [j.size for j in hits.jobs] == [3 << 20] and len(hits.jobs[0].task) == PREVIEW
        # the jobs ahead of q2 leave: its ref still finds it; once claimed, None
        ref = queued[3].ref
        assert ref is not None
        await b.claim(conn, "w1", inc, Q, 3, 1)
        assert await payload(client.reads, Q, ref) == big("q2")
        await client.cancel(Q, big("q2"))
        assert await payload(client.reads, Q, ref) is None
        # the record of a payload still comes whole
        dead = await client.job(Q, big("die"))
        assert dead is not None and dead.state == "dead" and dead.task == big("die") and dead.whole
        with pytest.raises(ConfigError, match="invalid job ref"):
            await payload(client.reads, Q, "queued.1")


async def test_delete_queue_deletes_the_attempt_history(
    conn: Connection, b: Binding, keys: Keys, redis_url: str, namespace: str
) -> None:
    """A deleted queue leaves no attempt history behind (it did: tries and
    tried stayed after delete_queue)."""
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        inc = await join(b, conn, "w1", Q)
        await client.enqueue(Q, "flaky")
        c = await b.claim(conn, "w1", inc, Q, 1, 5)
        await b.give_back(conn, "w1", Q, [c.processes[0].id], failed=True, errors=["E"])
        assert await conn.execute("EXISTS", keys.tries(Q), keys.tried(Q)) == 2
        await client.delete_queue(Q)
        assert await conn.execute("EXISTS", keys.tries(Q), keys.tried(Q)) == 0


async def test_failed_attempts_are_kept_bounded_and_a_success_writes_nothing(
    conn: Connection, b: Binding, keys: Keys, redis_url: str, namespace: str
) -> None:
    """give_back.lua keeps each payload's last 5 failed attempts (when,
    worker, error cut to 1000 bytes) in {ns}:tries:<Q>, by SHA-1, for at most
    1000 payloads; a first failure starts anew; finishing and returning
    write nothing there."""
    import hashlib

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        inc = await join(b, conn, "w1", Q)
        await client.configure(Q, max_attempts=7)

        async def fail_once(payload: str, error: str) -> None:
            c = await b.claim(conn, "w1", inc, Q, 1, 7)
            assert [p.task for p in c.processes] == [payload.encode()]
            await b.give_back(conn, "w1", Q, [c.processes[0].id], failed=True, errors=[error])

        # a success and a return write no history
        await client.enqueue(Q, "fine")
        c = await b.claim(conn, "w1", inc, Q, 1, 7)
        await b.give_back(conn, "w1", Q, [c.processes[0].id], failed=False)
        c = await b.claim(conn, "w1", inc, Q, 1, 7)
        assert await b.finish(conn, "w1", inc, Q, [c.processes[0].id]) == [True]
        assert await conn.execute("EXISTS", keys.tries(Q), keys.tried(Q)) == 0
        # seven failures: the last five are kept, the last one dead-lettered
        await client.enqueue(Q, "flaky")
        for i in range(7):
            await fail_once(
                "flaky",
                f"E{i}: failed\nTraceback (most recent call last):\n  line {i}\n{'x' * 2000}",
            )
        j = await client.job(Q, "flaky")
        assert j is not None and j.state == "dead" and j.attempts == 7
        assert [t.error for t in j.tries] == [f"E{i}: failed" for i in range(2, 7)]
        # the error's line and the start of its traceback: 1,000 bytes together
        assert all(t.worker == "w1" and t.traceback is not None for t in j.tries)
        assert all(len(f"{t.error}\n{t.traceback}".encode()) == 1000 for t in j.tries)
        assert (j.tries[0].traceback or "").startswith(
            "Traceback (most recent call last):\n  line 2\n"
        )
        assert [t.when for t in j.tries] == sorted(t.when for t in j.tries)
        assert (await client.jobs(Q, "dead")).jobs[0].tries == ()  # pages do not read them
        # requeued (attempts reset), its next failure starts a new history
        await client.requeue_dead(Q)
        await fail_once("flaky", "again")
        j = await client.job(Q, "flaky")
        assert j is not None and j.state == "queued" and [t.error for t in j.tries] == ["again"]
        # at most 1000 payloads: the oldest leaves with its history
        sha = hashlib.sha1(b"flaky").hexdigest()
        await conn.execute(
            "ZADD", keys.tried(Q), 1, "old", *[x for i in range(998) for x in (2, f"f{i}")]
        )
        await conn.execute("HSET", keys.tries(Q), "old", "[]")
        await client.enqueue(Q, "other")
        await client.cancel(Q, "flaky")
        await fail_once("other", "boom")
        assert await conn.execute("ZCARD", keys.tried(Q)) == 1000
        assert await conn.execute("HEXISTS", keys.tries(Q), "old") == 0
        assert await conn.execute("HEXISTS", keys.tries(Q), sha) == 1


async def test_a_page_is_read_in_bounded_calls_with_the_same_result(
    conn: Connection, b: Binding, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peek.lua stops once the entries it read reach the budget (so a page of
    64 MiB payloads never holds Redis up for long); the page is the same
    when read one entry per call."""
    import mesh._browse as browse

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        want = await fill(conn, b, client)
        whole = {s: await client.jobs(Q, s) for s in want}
        calls = 0
        from mesh._eval import run_script as real

        async def counting(*args: object, **kw: object) -> object:
            nonlocal calls
            calls += 1
            return await real(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(browse, "_PEEK_BUDGET", 1)
        monkeypatch.setattr("mesh._reads.run_script", counting)
        for state in want:
            calls = 0
            assert await client.jobs(Q, state) == whole[state], state
            assert calls >= len(want[state]), (state, calls)
