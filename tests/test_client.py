"""The client (mesh/_client.py) on its own: what its calls report, and what
they refuse. Most client calls are also exercised with workers in
test_worker.py and test_jobs.py; here is what needs no worker (a process is
claimed with the protocol binding where one is needed)."""

from __future__ import annotations

import anyio
import pytest

import mesh
from mesh import ClosedError, ConfigError, MeshConnectionError
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._keys import Keys

from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops

Q = "jobs"

# reconcile reports what it changed, not what it tried to change


async def test_concurrent_reconciles_report_each_cancel_once(
    redis_url: str, namespace: str
) -> None:
    # Two replicas of a service reconcile the same desired set at the same
    # moment: both read the persistent set before either cancels, so both try
    # to cancel "gone". Only the one whose cancel found it may report it.
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure_many("conns", ["keep", "gone"])
        results: list[mesh.ReconcileResult] = []

        async def reconcile() -> None:
            results.append(await client.reconcile("conns", ["keep"]))

        async with anyio.create_task_group() as nursery:
            nursery.start_soon(reconcile)
            nursery.start_soon(reconcile)
        assert sorted(r.cancelled for r in results) == [(), (b"gone",)]
        assert all(r.added == () for r in results)
        assert await client.persistent_tasks("conns") == {b"keep": None}


# --- opening and closing --------------------------------------------------------


async def test_bad_options_are_refused_before_connecting() -> None:
    nowhere = "redis://127.0.0.1:1"
    with pytest.raises(ConfigError, match="invalid namespace"):
        async with mesh.open_client(nowhere, namespace="a b"):
            pass
    with pytest.raises(ConfigError, match="min_replicas must be an integer >= 0"):
        async with mesh.open_client(nowhere, min_replicas=-1):
            pass
    with pytest.raises(MeshConnectionError, match=r"could not connect to redis://127\.0\.0\.1:1"):
        async with mesh.open_client(nowhere + "?connect_timeout=2"):
            pass


async def test_a_closed_client_refuses_every_call(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert client.namespace == namespace
        assert client.min_replicas == 0
    for call in (
        client.enqueue(Q, "x"),
        client.ensure(Q, "x"),
        client.cancel(Q, "x"),
        client.processes(),
        client.workers(),
        client.schedules(),
        client.delayed(Q),
        client.tasks(Q),
    ):
        with pytest.raises(ClosedError, match="this client is closed"):
            await call


# --- one-shot tasks ---------------------------------------------------------------


async def test_enqueue_many_checks_everything_before_sending(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace, max_payload=8) as client:
        assert await client.enqueue_many(Q, []) == 0
        with pytest.raises(TypeError, match="not a single payload"):
            await client.enqueue_many(Q, "abc")
        with pytest.raises(TypeError, match="bytes or str, not int"):
            await client.enqueue_many(Q, ["a", 3])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"the limit \(max_payload\) is 8"):
            await client.enqueue_many(Q, ["a", "123456789"])
        with pytest.raises(ConfigError, match="priority must be a whole number from 0 to 9"):
            await client.enqueue_many(Q, ["a"], priority=10)
        with pytest.raises(ConfigError, match="invalid queue name"):
            await client.enqueue_many("a b", ["a"])
        assert await client.queues() == []  # nothing was sent
        assert await client.queue_infos() == []


async def test_priorities_are_claimed_highest_first_fifo_within_one(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue_many(Q, ["p0a", "p0b"])
        await client.enqueue_many(Q, ["p5a", "p5b"], priority=5)
        await client.enqueue(Q, "p9", priority=9)
        assert await client.tasks(Q) == [b"p9", b"p5a", b"p5b", b"p0a", b"p0b"]
        assert await client.queue_length(Q) == 5
        assert (await client.queue_info(Q)).queued == 5


async def test_an_enqueue_with_a_persistent_task_among_them_adds_none(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.ensure(Q, "dev") is True
        with pytest.raises(mesh.ConflictError):
            await client.enqueue_many(Q, ["a", "dev", "b"])
        assert await client.tasks(Q) == [b"dev"]  # the persistent one, queued
        with pytest.raises(mesh.ConflictError):
            await client.enqueue(Q, "dev", delay=5)
        await client.enqueue(Q, "job")
        with pytest.raises(mesh.ConflictError):
            await client.ensure(Q, "job")  # a queued one-shot task


async def test_delayed_tasks_are_listed_first_due_first_and_delayed_once(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        now = await client.time()
        assert await client.enqueue_many(Q, ["late"], delay=60) == 1
        assert await client.enqueue_many(Q, ["soon", "late"], delay=30, priority=3) == 1
        d = await client.delayed(Q)
        assert [t.task for t in d] == [b"late", b"soon"]  # late moved to the earlier time
        assert all(now + 29 < t.due < now + 31 for t in d)
        assert [t.priority for t in d] == [3, 3]
        assert [t.task for t in await client.delayed(Q, limit=1)] == [b"late"]
        assert await client.delayed(Q, limit=0) == []
        for bad in (-1, True, 1.5):
            with pytest.raises(ConfigError, match="limit must be a whole number >= 0"):
                await client.delayed(Q, limit=bad)  # type: ignore[arg-type]
        info = await client.queue_info(Q)
        assert (info.queued, info.delayed) == (0, 2)
        assert await client.cancel(Q, "late") == 1
        assert [t.task for t in await client.delayed(Q)] == [b"soon"]


# --- persistent tasks -------------------------------------------------------------


async def test_ensure_reports_new_ones_and_checks_the_weight(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.ensure_many(Q, ["a", "b"]) == [True, True]
        assert await client.ensure_many(Q, ["b", "c"], weight=2) == [False, True]
        assert await client.ensure_many(Q, []) == []
        assert await client.persistent_tasks(Q) == {b"a": None, b"b": None, b"c": None}
        for bad in (0, 1_000_001, True):
            with pytest.raises(ConfigError, match="weight must be a whole number from 1"):
                await client.ensure(Q, "d", weight=bad)
        assert (await client.queue_info(Q)).persistent == 3


async def test_reconcile_takes_weights_from_a_mapping_and_collapses_duplicates(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure_many(Q, ["old", "keep"])
        r = await client.reconcile(Q, {"keep": 1, "new": 3})
        assert r == mesh.ReconcileResult(added=(b"new",), cancelled=(b"old",))
        assert set(await client.persistent_tasks(Q)) == {b"keep", b"new"}
        r = await client.reconcile(Q, ["keep", "keep", "new"])
        assert r == mesh.ReconcileResult((), ())
        with pytest.raises(ConfigError, match="weight must be"):
            await client.reconcile(Q, {"keep": 0})
        assert set(await client.persistent_tasks(Q)) == {b"keep", b"new"}  # unchanged


async def test_cancel_and_delete_queue_count_what_they_removed(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue_many(Q, ["a", "a", "b"])
        assert await client.cancel(Q, "a") == 2
        assert await client.cancel(Q, "nothing") == 0
        await client.ensure(Q, "dev")
        await client.enqueue(Q, "later", delay=60)
        assert await client.delete_queue(Q) == 3  # b, dev, later
        info = await client.queue_info(Q)
        assert (info.queued, info.delayed, info.persistent) == (0, 0, 0)


# --- dead letters -------------------------------------------------------------------


async def test_dead_letters_are_listed_requeued_and_purged_by_payload(
    redis_url: str, namespace: str, conn: Connection, b: Binding, keys: Keys
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue_many(Q, ["x", "y", "z"])
        inc = await join(b, conn, "w", Q)
        assert len((await b.claim(conn, "w", inc, Q, 3, 1)).processes) == 3
        await expire_worker(conn, keys, "w")
        await b.recycle(conn, "w", leave=False)  # one attempt allowed: all dead
        dead = await client.dead_letters(Q)
        assert sorted(d.task for d in dead) == [b"x", b"y", b"z"]
        assert all(d.attempts == 1 and d.worker == "w" for d in dead)
        assert all(d.error.startswith("worker crashed") for d in dead)
        with pytest.raises(mesh.DeadLetterError) as exc:
            await client.result(Q, "x", timeout=0)  # the latest outcome: its dead letter
        letter = exc.value.dead_letter
        assert isinstance(letter, mesh.DeadLetter) and letter.task == b"x"
        assert await client.requeue_dead(Q, []) == 0
        assert await client.requeue_dead(Q, ["y"]) == 1
        assert await client.tasks(Q) == [b"y"]
        assert await client.purge_dead(Q, ["nothing"]) == 0
        assert await client.purge_dead(Q) == 2
        assert await client.dead_letters(Q) == []
        with pytest.raises(TimeoutError):
            await client.result(Q, "x", timeout=0)  # purged: no outcome kept


# --- schedules, results, the clock, workers ------------------------------------------------


async def test_schedules_are_unique_per_queue_and_task(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.schedule(Q, "tick", every=60) is True
        assert await client.schedule(Q, "tick", every=30) is False  # replaced
        assert await client.schedule("other", "tick", every=120) is True
        [s] = await client.schedules(Q)
        assert (s.queue, s.task, s.every) == (Q, b"tick", 30.0)
        assert [x.queue for x in await client.schedules()] == [Q, "other"]  # next due first
        with pytest.raises(ConfigError, match="exactly one"):
            await client.schedule(Q, "t", every=1, cron="* * * * *")
        with pytest.raises(ConfigError, match="every must be a number of seconds from"):
            await client.schedule(Q, "t", every=0.01)
        assert await client.unschedule(Q, "tick") is True
        assert await client.unschedule(Q, "tick") is False
        assert [x.queue for x in await client.schedules()] == ["other"]


async def test_result_checks_its_timeout_and_times_out(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        for bad in (-1, float("inf"), "1"):
            with pytest.raises(ConfigError, match="timeout must be a"):
                await client.result(Q, "x", timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(
            TimeoutError, match=f"no outcome of the task on queue {Q} within 0.05 s"
        ):
            await client.result(Q, "x", timeout=0.05)


async def test_workers_and_processes_as_redis_sees_them(
    redis_url: str, namespace: str, conn: Connection, b: Binding, keys: Keys
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.workers() == [] and await client.processes() == []
        t0 = await client.time()
        inc = await join(b, conn, "w", Q, ttl_ms=30_000)
        await client.ensure(Q, "dev")
        (p,) = (await b.claim(conn, "w", inc, Q, 1, 0)).processes
        [w] = await client.workers()
        assert (w.id, w.alive, w.queues, w.processes) == ("w", True, (Q,), 1)
        assert 29 < w.lease_left <= 30 and w.started >= t0 - 1
        assert await client.processes() == await client.processes(Q) == [p]
        assert p.persistent and p.worker_id == "w"
        await expire_worker(conn, keys, "w")
        [w] = await client.workers()
        assert not w.alive and w.lease_left < 0  # dead, not yet recycled
