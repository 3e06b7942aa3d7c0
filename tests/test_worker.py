"""Workers in one process against a real redis-server: handlers, persistent
tasks, handover, fencing, cancel, lossless events, and bad input."""

from __future__ import annotations

import functools
import logging
import secrets
from typing import Any

import anyio
import pytest
import trio
import trio.testing

import mesh
import mesh._connection
from mesh import ClosedError, ConfigError, MeshConnectionError, Process
from mesh.testing import RedisServer, wait_until

from .helpers import Recorder, client_and_workers
from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops

TTL = 0.9  # H = 0.3 s, R = 0.6 s


async def test_each_task_runs_once_across_workers(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 3) as (client, workers):
        for w in workers:
            await w.start_work("jobs", rec.quick, concurrency=4)
        tasks = [b"%d" % i for i in range(500)]
        assert await client.enqueue_many("jobs", tasks) == 500

        async def all_done() -> bool:
            # a finish report's reply reaches its worker a moment after Redis
            # ran it (and the processes left): count once every reply is in
            finished = sum(w.statistics().processes_finished for w in workers)
            return len(rec.done) >= 500 and finished >= 500 and not await client.processes("jobs")

        await wait_until(all_done, what="500 tasks")
        assert sorted(p.task for p in rec.done) == sorted(tasks)
        assert len({p.token for p in rec.done}) == 500
        assert await client.queue_length("jobs") == 0
        assert {p.worker_id for p in rec.done} <= {w.id for w in workers}
        assert sum(w.statistics().processes_finished for w in workers) == 500


async def test_payloads_round_trip_byte_for_byte(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    payloads: list[bytes | str] = [
        b"",
        b"\x00",
        b"\x00\xff\r\n$3\r\n",
        bytes(range(256)) * 40,
        "žluťoučký kůň",
    ]
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await client.enqueue_many("bin", payloads)
        assert await client.tasks("bin") == [
            p if isinstance(p, bytes) else p.encode() for p in payloads
        ]
        await w.start_work("bin", rec.quick)
        await wait_until(lambda: _true(len(rec.done) == len(payloads)))
    expected = [p if isinstance(p, bytes) else p.encode() for p in payloads]
    assert sorted(p.task for p in rec.done) == sorted(expected)


def stall_heartbeats(w: mesh.Worker) -> list[float]:
    """From now on every heartbeat of ``w`` hangs (a stalled connection); the
    list gets the time each stalled heartbeat was sent."""
    sent: list[float] = []

    async def stalled(*args: object, **kw: object) -> object:
        sent.append(anyio.current_time())
        await anyio.sleep_forever()
        raise AssertionError

    w._binding.heartbeat = stalled  # type: ignore[method-assign,assignment]
    return sent


async def _true(v: bool) -> bool:
    return v


async def test_persistent_tasks_have_one_owner_and_move_at_once_on_leave(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    devices = [f"dev-{i}" for i in range(4)]
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        async with client_and_workers(redis_url, namespace, 1) as (_, (w2,)):
            await w2.start_work("devices", rec.forever, concurrency=10)
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w1:
                # w1 first: take everything while w2 is at capacity 10 too; who
                # owns what does not matter, only that each has one owner
                await w1.start_work("devices", rec.forever, concurrency=10)
                assert await client.ensure_many("devices", devices) == [True] * 4
                assert await client.ensure("devices", "dev-0") is False

                async def four_running() -> bool:
                    return len(await client.processes("devices")) == 4

                await wait_until(four_running)
                procs = await client.processes("devices")
                assert sorted(p.task for p in procs) == sorted(d.encode() for d in devices)
                assert all(p.persistent for p in procs)
                owned_by_w1 = {p.task: p.token for p in procs if p.worker_id == w1.id}
                await w1.stop_work("devices")  # hand over w1's share
                t0 = anyio.current_time()

                async def w2_owns_all() -> bool:
                    ps = await client.processes("devices")
                    return len(ps) == 4 and all(p.worker_id == w2.id for p in ps)

                await wait_until(w2_owns_all, within=2)
                handover = anyio.current_time() - t0
            tokens = {p.task: p.token for p in await client.processes("devices")}
            for task, token in owned_by_w1.items():
                assert tokens[task] > token  # fencing tokens only go up
            assert handover < TTL  # well before any lease could have run out
            # exactly one live handler per device at the end
            live = rec.running()
            assert sorted(p.task for p in live) == sorted(d.encode() for d in devices)


async def test_leaving_the_worker_block_hands_back_and_publishes(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (peer,)):
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w1:
            await w1.start_work("devices", rec.forever)
            await client.ensure("devices", "d")
            await wait_until(lambda: _true(len(rec.started) == 1))
        # w1 left: its handler was cancelled first, then the task handed back
        assert [p.task for p in rec.cancelled] == [b"d"]
        assert await client.tasks("devices") == [b"d"]
        assert [w.id for w in await client.workers()] == [peer.id]
        await peer.start_work("devices", rec.forever)

        async def peer_owns() -> bool:
            return [p.worker_id for p in await client.processes("devices")] == [peer.id]

        await wait_until(peer_owns)


async def test_lost_lease_fences_the_worker_and_it_rejoins(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("devices", rec.forever)
        await client.ensure("devices", "d")
        await wait_until(lambda: _true(len(rec.started) == 1))
        old_id = w.id
        first = rec.started[0]
        # the lease runs out behind the worker's back (forced)
        await expire_worker(client._conn, client._keys, old_id)

        async def rejoined_and_running() -> bool:
            ps = await client.processes("devices")
            return w.id != old_id and len(ps) == 1 and ps[0].worker_id == w.id

        await wait_until(rejoined_and_running, within=5)
        assert rec.cancelled == [first]  # the stale owner's handler was stopped
        (p,) = await client.processes("devices")
        assert p.token > first.token
        assert old_id not in [x.id for x in await client.workers()]
        assert w.statistics().fenced == 1
        # the old identity's late finish changes nothing
        assert await w.finish(first) is False


async def test_self_fence_cancels_handlers_before_the_lease_can_run_out(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("devices", rec.forever)
        await client.ensure("devices", "d")
        await wait_until(lambda: _true(len(rec.started) == 1))
        # Heartbeats stop getting through (a stalled connection, simulated by
        # a heartbeat call that never returns).
        real = w._binding.heartbeat
        cut_at = stall_heartbeats(w)
        await wait_until(lambda: _true(bool(rec.cancelled)), within=3)
        cancelled_at = anyio.current_time()
        # Cancelled at R after the last confirmed heartbeat was sent: that is
        # at most R after the first stalled heartbeat was sent, and before T.
        assert cancelled_at - cut_at[0] < w.timing.fence_after + 0.1
        assert cancelled_at - cut_at[0] < w.timing.ttl
        w._binding.heartbeat = real  # type: ignore[method-assign]

        async def running_again() -> bool:
            return len(await client.processes("devices")) == 1 and len(rec.started) == 2

        await wait_until(running_again, within=5)
        assert rec.started[1].token > rec.started[0].token


async def test_cancel_by_payload_stops_processes_on_every_worker(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 3) as (client, workers):
        for w in workers:
            await w.start_work("jobs", rec.forever, concurrency=2)
        await client.enqueue_many("jobs", [b"x"] * 5 + [b"y"])

        async def six_running() -> bool:
            return len(await client.processes("jobs")) == 6

        await wait_until(six_running)
        assert len({p.worker_id for p in await client.processes("jobs")}) == 3
        await client.enqueue("jobs", b"x")  # one more, queued
        assert await client.cancel("jobs", b"x") == 6
        await wait_until(lambda: _true(len(rec.cancelled) == 5), within=1)
        assert {p.task for p in rec.cancelled} == {b"x"}
        assert [p.task for p in await client.processes("jobs")] == [b"y"]
        assert await client.tasks("jobs") == []


async def test_a_cancel_whose_message_is_lost_lands_within_a_heartbeat(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("jobs", rec.forever)
        await client.enqueue("jobs", b"x")
        await wait_until(lambda: _true(len(rec.started) == 1))
        # drop every pub/sub message from now on: only the durable inbox remains
        w._host._dispatch = lambda *a, **k: None  # type: ignore[method-assign]
        t0 = anyio.current_time()
        assert await client.cancel("jobs", b"x") == 1
        await wait_until(lambda: _true(len(rec.cancelled) == 1), within=3)
        assert anyio.current_time() - t0 < w.timing.interval + 0.2


async def test_queued_work_is_taken_without_pub_sub(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("jobs", rec.quick)
        w._host._dispatch = lambda *a, **k: None  # type: ignore[method-assign]
        key = client._keys.idle("jobs")

        async def idle() -> bool:  # the runner found nothing and waits
            return bool(await client._conn.execute("SISMEMBER", key, w.id))

        await wait_until(idle, what="the runner to go idle")
        t0 = anyio.current_time()
        await client.enqueue("jobs", b"x")
        await wait_until(lambda: _true(len(rec.done) == 1), within=3)
        assert anyio.current_time() - t0 < w.timing.interval + 0.2


async def test_killed_pub_sub_connection_loses_neither_cancel_nor_work(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("jobs", rec.forever)
        await client.enqueue("jobs", b"a")
        await wait_until(lambda: _true(len(rec.started) == 1))
        await client._conn.execute("CLIENT", "KILL", "TYPE", "pubsub")
        assert await client.cancel("jobs", b"a") == 1
        await client.enqueue("jobs", b"b")
        await wait_until(lambda: _true(len(rec.cancelled) == 1 and len(rec.started) == 2), within=3)
        assert rec.started[1].task == b"b"


async def test_failing_handler_retries_then_dead_letters(redis_url: str, namespace: str) -> None:
    attempts: list[int] = []

    async def poison(p: Process) -> None:
        attempts.append(p.attempts)
        raise RuntimeError("boom")

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("jobs", poison, max_attempts=3, backoff=0.01, backoff_max=0.02)
        await client.enqueue("jobs", b"bad")

        async def dead() -> bool:
            return [d.task for d in await client.dead_letters("jobs")] == [b"bad"]

        await wait_until(dead, within=5)
        assert attempts == [0, 1, 2]
        info = await client.queue_info("jobs")
        assert (info.queued, info.delayed, info.running, info.dead) == (0, 0, 0, 1)


async def test_manual_dequeue_finish_and_give_back(redis_url: str, namespace: str) -> None:
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("manual")
        assert await w.dequeue("manual") is None
        await client.enqueue_many("manual", [b"a", b"b"])
        a = await w.dequeue("manual")
        assert a is not None and a.task == b"a" and a.worker_id == w.id
        assert await w.give_back(a) is True
        assert await client.tasks("manual") == [b"a", b"b"]  # back at the front
        a2 = await w.dequeue("manual")
        assert a2 is not None and a2.task == b"a" and a2.token > a.token
        assert await w.finish(a) is False  # the given-back claim is gone
        assert await w.finish(a2) is True
        assert await w.finish(a2) is False
        with pytest.raises(ConfigError, match="not served"):
            await w.dequeue("other")


async def test_stop_work_hands_back_that_queue_only(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("a", rec.forever)
        await w.start_work("b", rec.forever)
        await client.enqueue("a", b"1")
        await client.enqueue("b", b"2")
        await wait_until(lambda: _true(len(rec.started) == 2))
        assert await w.stop_work("a") == 1
        assert await client.tasks("a") == [b"1"]
        assert [p.task for p in await client.processes("b")] == [b"2"]
        with pytest.raises(ConfigError, match="not served"):
            await w.stop_work("a")
        with pytest.raises(ConfigError, match="served already"):
            await w.start_work("b", rec.forever)


async def test_bad_timing_is_refused_before_connecting() -> None:
    url = "redis://127.0.0.1:1"  # nothing listens: a connect would fail differently
    for kw in (
        {"ttl": 0.02},
        {"ttl": 3.0, "heartbeat_interval": 2.0},
        {"ttl": 3.0, "fence_after": 3.0},
        {"ttl": 3.0, "heartbeat_interval": 1.0, "fence_after": 1.0},
        {"ttl": -1.0},
    ):
        with pytest.raises(ConfigError, match="heartbeat interval < fence_after < ttl"):
            async with mesh.open_worker(url, **kw):  # type: ignore[arg-type]
                pass  # pragma: no cover


async def test_unreachable_redis_fails_fast_and_clearly() -> None:
    t0 = anyio.current_time()
    with pytest.raises(MeshConnectionError) as e:
        async with mesh.open_client("redis://user:s3cret@127.0.0.1:1"):
            pass  # pragma: no cover
    assert anyio.current_time() - t0 < 2
    assert "127.0.0.1:1" in str(e.value) and "s3cret" not in str(e.value)
    with pytest.raises(MeshConnectionError):
        async with mesh.open_worker("redis://127.0.0.1:1"):
            pass  # pragma: no cover


@pytest.mark.parametrize("name", ["a b", "a{b", "a}b", "", "x" * 201, "tab\t", "glob*", "ü"])
async def test_bad_queue_names_are_refused_clearly(
    redis_url: str, namespace: str, name: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with pytest.raises(ConfigError, match="invalid queue name"):
            await client.enqueue(name, b"x")
        assert await client.queues() == []


async def test_queue_names_with_colons_and_slashes_work(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        for q in ("a:b", "a", "tenant/1:jobs@eu"):
            await w.start_work(q, rec.quick)
            await client.enqueue(q, q)
        await wait_until(lambda: _true(len(rec.done) == 3))
        assert sorted((p.queue, p.task) for p in rec.done) == [
            ("a", b"a"),
            ("a:b", b"a:b"),
            ("tenant/1:jobs@eu", b"tenant/1:jobs@eu"),
        ]


@pytest.mark.parametrize("ns", ["a:b", "{x}", "a b", "", "n" * 65])
async def test_bad_namespaces_are_refused_before_connecting(ns: str) -> None:
    with pytest.raises(ConfigError, match="invalid namespace"):
        async with mesh.open_client("redis://127.0.0.1:1", namespace=ns):
            pass  # pragma: no cover


async def test_bad_payloads_are_refused_and_nothing_is_sent(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace, max_payload=10) as client:
        with pytest.raises(TypeError, match="bytes or str, not int"):
            await client.enqueue("q", 5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not a single payload"):
            await client.enqueue_many("q", b"abc")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="11 bytes; the limit"):
            await client.enqueue_many("q", [b"ok", b"x" * 11])
        assert await client.queue_length("q") == 0


async def test_duplicate_worker_id_is_refused(redis_url: str, namespace: str) -> None:
    wid = "dup-" + secrets.token_hex(3)
    async with mesh.open_worker(redis_url, namespace=namespace, worker_id=wid, ttl=TTL):
        with pytest.raises(ConfigError, match="in use"):
            async with mesh.open_worker(redis_url, namespace=namespace, worker_id=wid):
                pass  # pragma: no cover
    with pytest.raises(ConfigError, match="invalid worker id"):
        async with mesh.open_worker(redis_url, namespace=namespace, worker_id="a:b"):
            pass  # pragma: no cover


async def test_using_a_closed_client_or_worker_raises_closed_error(
    redis_url: str, namespace: str
) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        pass
    with pytest.raises(ClosedError):
        await client.enqueue("q", b"x")
    async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w:
        pass
    with pytest.raises(ClosedError):
        await w.start_work("q")
    with pytest.raises(ClosedError):
        await w.client.queues()


async def test_an_evicting_redis_is_refused(own_redis: RedisServer) -> None:
    async with mesh.open_client(own_redis.url) as client:
        await client._conn.execute("CONFIG", "SET", "maxmemory-policy", "volatile-lru")
    with pytest.raises(ConfigError, match="noeviction"):
        async with mesh.open_worker(own_redis.url):
            pass  # pragma: no cover


async def test_reconcile_makes_the_persistent_set_exact(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("conns", rec.forever)
        r = await client.reconcile("conns", ["a", "b", "c"])
        assert sorted(r.added) == [b"a", b"b", b"c"] and r.cancelled == ()
        await wait_until(lambda: _true(len(rec.started) == 3))
        r = await client.reconcile("conns", ["b", "c", "d"])
        assert r.added == (b"d",) and r.cancelled == (b"a",)
        await wait_until(lambda: _true(len(rec.cancelled) == 1 and len(rec.started) == 4))
        assert rec.cancelled[0].task == b"a"
        assert sorted(await client.persistent_tasks("conns")) == [b"b", b"c", b"d"]
        r = await client.reconcile("conns", ["b", "c", "d"])
        assert r == mesh.ReconcileResult((), ())


async def test_delete_queue_cancels_running_and_empties_it(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("q", rec.forever, concurrency=1)
        await client.enqueue_many("q", [b"1", b"2", b"3"])
        await wait_until(lambda: _true(len(rec.started) == 1))
        assert await client.delete_queue("q") == 3
        await wait_until(lambda: _true(len(rec.cancelled) == 1))
        assert await client.queue_info("q") == mesh.QueueInfo("q", 0, 0, 0, 0, 0)
        assert "q" not in await client.queues()


async def test_an_out_of_memory_redis_keeps_the_worker_and_refuses_new_tasks(
    own_redis: RedisServer,
) -> None:
    """At the memory limit (issue 23) the lease renewals go on: a full Redis
    does not fence live workers (heartbeat.lua's first write is one Redis
    lets through), while new tasks are refused before anything is written.
    Every path at the limit, on 7.x and 6.2, is in tests/test_memory.py."""
    rec = Recorder()
    async with client_and_workers(own_redis.url, "oom", 1) as (client, (w,)):
        await w.start_work("devices", rec.forever)
        await client.ensure("devices", "d")
        await wait_until(lambda: _true(len(rec.started) == 1))
        first_id = w.id
        beats = w.statistics().heartbeats
        # every write that could grow memory is refused from now on
        await client._conn.execute("CONFIG", "SET", "maxmemory", "1")
        with pytest.raises(mesh.OutOfMemoryError, match="maxmemory"):
            await client.ensure("devices", "e")
        # renewed several times at the limit, neither fenced nor cancelled
        await wait_until(
            lambda: _true(w.statistics().heartbeats >= beats + 3),
            within=10,  # a deadline for the state, not a speed claim
        )
        assert w.id == first_id and w.statistics().fenced == 0 and rec.cancelled == []
        await client._conn.execute("CONFIG", "SET", "maxmemory", "0")
        assert await client.ensure("devices", "e") is True
        await wait_until(lambda: _true(len(rec.started) == 2))


async def test_persistent_tasks_spread_over_the_peers(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 3) as (client, workers):
        for w in workers:
            await w.start_work("devices", rec.forever, concurrency=10)
        await client.ensure_many("devices", [f"d{i}" for i in range(6)])

        async def six_running() -> bool:
            return len(await client.processes("devices")) == 6

        await wait_until(six_running)
        owners = [p.worker_id for p in await client.processes("devices")]
        assert sorted(owners.count(w.id) for w in workers) == [2, 2, 2]


async def test_a_fair_share_never_leaves_a_task_waiting_for_a_full_peer(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 2) as (client, (small, big)):
        await small.start_work("devices", rec.forever, concurrency=1)
        await big.start_work("devices", rec.forever, concurrency=10)
        await client.ensure_many("devices", ["a", "b", "c", "d"])  # fair share: 2 each

        async def all_running() -> bool:
            return len(await client.processes("devices")) == 4

        await wait_until(all_running, within=big.timing.interval * 3 + 1)
        owners = [p.worker_id for p in await client.processes("devices")]
        assert owners.count(small.id) == 1 and owners.count(big.id) == 3


async def test_processes_that_end_during_a_report_round_trip_are_reported(
    own_redis: RedisServer,
) -> None:
    # The server stalls now and then (a busy script), so the runner's finish and
    # give-back calls are in flight while other handlers end. Every process
    # must still be reported: none may stay "running" behind a live worker.
    finished: list[bytes] = []
    failed_once: set[bytes] = set()

    async def staggered(p: Process) -> None:
        await anyio.sleep(int(p.task) % 7 / 1000)  # work of its own length, not a wait
        if int(p.task) % 5 == 0 and p.task not in failed_once:
            failed_once.add(p.task)
            raise RuntimeError("fail once")
        finished.append(p.task)

    async with client_and_workers(own_redis.url, "rt", 1) as (client, (w,)):
        await w.start_work("jobs", staggered, concurrency=8, backoff=0)
        await client.enqueue_many("jobs", [str(i) for i in range(200)])
        async with mesh._connection.open_connection(own_redis.url) as staller:
            for _ in range(30):
                await staller.execute("EVAL", "for i = 1, 300000 do end", 0)
                await anyio.sleep(0.002)  # not a wait: the stalls come now and then

        async def all_reported() -> bool:
            info = await client.queue_info("jobs")
            return len(finished) == 200 and (info.queued, info.running, info.delayed) == (0, 0, 0)

        await wait_until(all_reported, within=10, what="every process reported")
        assert sorted(finished) == sorted(str(i).encode() for i in range(200))


async def test_queue_infos_and_the_redis_clock(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        assert await client.queue_infos() == []
        await client.enqueue_many("b", ["1", "2"])
        await client.ensure("a", "p")
        infos = await client.queue_infos()
        assert infos == [mesh.QueueInfo("a", 1, 0, 0, 1, 0), mesh.QueueInfo("b", 2, 0, 0, 0, 0)]
        assert await client.queue_infos(["b"]) == infos[1:]
        t = await client.time()
        sec, _ = await client._conn.execute("TIME")
        assert abs(t - int(sec)) < 2


async def test_a_process_that_redis_lost_is_stopped_within_a_heartbeat(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("devices", rec.forever)
        await client.ensure("devices", "d")
        await wait_until(lambda: _true(len(rec.started) == 1))
        (p,) = await client.processes("devices")
        # As after a failover that dropped the claim: Redis forgets the
        # process and has the task queued again (and it gets a new owner).
        k = client._keys
        await client._conn.pipeline(
            [
                ("HDEL", k.procs("devices"), p.id),
                ("SREM", k.held(w.id, "devices"), p.id),
                ("HDEL", k.persistent("devices"), "d"),
                ("SADD", k.standby("devices"), "d"),
                ("LPUSH", k.queue("devices"), "d"),
                ("PUBLISH", k.wake_channel(w.id), "devices"),
            ]
        )
        t0 = anyio.current_time()
        await wait_until(lambda: _true(len(rec.cancelled) == 1), within=3)
        assert anyio.current_time() - t0 < w.timing.interval + 0.3
        assert rec.cancelled[0].token == p.token
        await wait_until(lambda: _true(len(rec.started) == 2))
        assert [x.task for x in rec.running()] == [b"d"]  # one live owner again
        assert rec.running()[0].token > p.token


async def test_dequeue_is_for_queues_without_a_handler(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (_, (w,)):
        await w.start_work("auto", rec.quick)
        with pytest.raises(ConfigError, match="served by a handler"):
            await w.dequeue("auto")


async def test_check_lease_fails_once_the_fence_deadline_has_passed(
    redis_url: str, namespace: str
) -> None:
    verdicts: list[str] = []

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):

        async def device(p: Process) -> None:
            w.check_lease(p)  # fine while the lease is held
            verdicts.append("ok")
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                try:
                    w.check_lease(p)  # what a write on the way out would ask
                    verdicts.append("still ok")
                except mesh.FencedError as exc:
                    verdicts.append(f"fenced: {exc}")
                raise

        await w.start_work("devices", device)
        await client.ensure("devices", "d")
        await wait_until(lambda: _true(verdicts == ["ok"]))
        (p,) = await client.processes("devices")
        stall_heartbeats(w)
        await wait_until(lambda: _true(len(verdicts) >= 2), within=3)  # it may rejoin at once
        assert verdicts[1].startswith("fenced: ") and "no heartbeat confirmed" in verdicts[1]
        with pytest.raises(mesh.FencedError):
            w.check_lease(p)


async def test_work_announced_while_a_claim_is_in_flight_is_taken_at_once(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("jobs", rec.quick)

        async def idle() -> bool:  # the runner waits for a nudge
            return w.id.encode() in await client._conn.execute("SMEMBERS", w._keys.idle("jobs"))

        await wait_until(idle, what="the runner idle")
        real = w._binding.run
        calls = 0

        async def run(conn: Any, call: Any) -> Any:
            # The first claim runs in Redis and finds nothing; before its reply
            # reaches the runner, a task is enqueued and announced.
            nonlocal calls
            reply = await real(conn, call)
            if call.script.name == "claim":
                calls += 1
                if calls == 1:
                    await client.enqueue("jobs", b"late")
                    # the wake reaches the runner while the claim reply waits
                    core = w._gen.runners["jobs"]._core
                    await wait_until(lambda: core.maybe_work, 2, "the wake dispatched")
            return reply

        w._binding.run = run  # type: ignore[method-assign]
        t0 = anyio.current_time()
        w._gen.runners["jobs"].nudge()
        await wait_until(lambda: _true(len(rec.done) == 1), within=3)
        # taken on the nudge, not at the next heartbeat H later
        assert anyio.current_time() - t0 < w.timing.interval / 2


async def test_many_deaths_at_once_cost_a_few_batched_recycles_in_the_whole_mesh(
    own_redis: RedisServer,
) -> None:
    from mesh._binding import Binding
    from mesh._keys import Keys

    async with client_and_workers(own_redis.url, "herd", 20) as (client, peers):
        b, k = Binding(Keys("herd")), client._keys
        dead = [f"dead-{i}" for i in range(50)]
        for d in dead:
            inc = "i-" + d
            await b.register(client._conn, d, inc, 60_000, b"{}")
            await b.serve(client._conn, d, inc, "jobs")
        await client.enqueue_many("jobs", dead)
        for d in dead:
            await b.claim(client._conn, d, "i-" + d, "jobs", 1, 0)
        # all 50 die at the same moment
        await client._conn.pipeline(
            [("DEL", *(k.heartbeat(d) for d in dead))] + [("ZADD", k.workers, 0, d) for d in dead]
        )

        async def all_recycled() -> bool:
            return len(await client.workers()) == 20

        await wait_until(all_recycled, within=10, what="50 dead workers recycled")
        assert sorted(await client.tasks("jobs")) == sorted(d.encode() for d in dead)
        stats = [p._reaper.statistics() for p in peers]
        assert sum(s.workers_recycled for s in stats) == 50
        # each dead worker went to one peer; holding one process each,
        # all fit one call (issue 14; it was 16 per call), and a
        # same-moment race may add a call or two
        calls = sum(s.recycle_calls for s in stats)
        print(f"recycle calls {calls}, checks {sum(s.checks for s in stats)}")
        assert 1 <= calls <= 3


async def test_a_death_wakes_a_few_reapers_not_every_peer(own_redis: RedisServer) -> None:
    """Every peer hears a lease key expire; only the few on watch act (and
    the heartbeat backstop, if none was): one death costs a few reap checks
    in the whole mesh, not one per peer, and failover stays prompt."""
    from mesh._binding import Binding
    from mesh._keys import Keys

    n = 30
    async with client_and_workers(own_redis.url, "watch", n, ttl=10.0) as (client, peers):
        b, conn = Binding(Keys("watch")), client._conn
        on_watch, prompt = [], 0
        for trial in range(4):
            victim = f"victim-{trial}"
            q = f"jobs{trial}"
            await client.enqueue(q, "orphan")
            t0 = anyio.current_time()
            inc = await join(b, conn, victim, q, ttl_ms=300)  # never renewed
            (p,) = (await b.claim(conn, victim, inc, q, 1, 0)).processes
            assert p.task == b"orphan"
            on_watch.append(sum(r._reaper.on_watch for r in peers))
            before = sum(r._reaper.statistics().checks for r in peers)

            async def recycled(v: str = victim) -> bool:
                return v not in [w.id for w in await client.workers()]

            await wait_until(recycled, within=5, what="the victim recycled")
            assert await client.tasks(q) == [b"orphan"]
            took = anyio.current_time() - t0 - 0.3  # after the lease ran out
            await anyio.sleep(0.3)  # a deliberate window: late reapers show in the count below
            checks = sum(r._reaper.statistics().checks for r in peers) - before
            print(f"trial {trial}: {took:.3f} s after the lease, {checks} checks by {n} peers")
            # one expiry event: about 3 of the 30 act on it; if none (e^-3,
            # 5%), the first heartbeat after the grace: within H + grace
            assert took < 10 / 3 + 0.25 + 0.3
            prompt += took < 0.25
            # on watch: about 3; the periodic checks of 30 peers every 10-12 s
            # add about 3 per second; every peer waking would be 30 or more
            assert checks <= 15
        assert prompt >= 2
        assert sum(on_watch) < 4 * n / 2


@pytest.mark.parametrize(("ttl", "ping"), [(0.9, 1.0), (3.0, 3.0), (600.0, 30.0)])
async def test_the_event_link_is_probed_every_ttl_within_bounds(
    redis_url: str, namespace: str, ttl: float, ping: float
) -> None:
    """Every T (not every second: 1,000 idle workers would cost Redis 1,000
    PINGs a second), but at least every second and at most every 30 s."""
    async with mesh.open_worker(redis_url, namespace=namespace, ttl=ttl) as w:
        assert w._pubsub._ping_interval == ping


async def test_peers_started_together_do_not_renew_in_lockstep(own_redis: RedisServer) -> None:
    """The first renewal comes 0.5-1 H after the start, at random: the
    heartbeats of a fleet started at once spread over half an interval (they
    are the reapers' backstop, and a burst of them would wake every reaper)."""
    async with client_and_workers(own_redis.url, "lockstep", 20, ttl=3.0) as (client, workers):
        # everyone renewed once after its start (the first heartbeat goes out at once)
        await wait_until(lambda: all(w.statistics().heartbeats >= 2 for w in workers))
        r = await client._conn.execute("ZRANGE", client._keys.workers, 0, -1, "WITHSCORES")
    deadlines = [float(r[i + 1]) for i in range(0, len(r), 2)]
    assert len(deadlines) == 20
    assert max(deadlines) - min(deadlines) > 200  # ms; started together: a few ms


async def test_new_work_wakes_only_idle_servers_and_a_freed_slot_looks_by_itself(
    redis_url: str, namespace: str
) -> None:
    """An enqueue wakes one idle server per task and a spare, not every idle
    one; a server whose process was cancelled is not in the idle set (its
    claim was full) and must look for work by itself. With a 30 s lease the
    heartbeat (first after 5 s or more) cannot be what brings the work."""
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 4, ttl=30.0) as (client, workers):
        for w in workers:
            await w.start_work("devices", rec.forever, concurrency=1)
        key = client._keys.idle("devices")

        async def idle_count(n: int) -> bool:
            return len(await client._conn.execute("SMEMBERS", key)) == n

        def sent() -> list[int]:
            return [w._conn.statistics().commands_sent for w in workers]

        await wait_until(lambda: idle_count(4))
        before = sent()
        await client.ensure("devices", "a")
        await wait_until(lambda: _true(len(rec.started) == 1), within=2)
        # the spare found nothing and is idle again; the owner is full
        await wait_until(lambda: idle_count(3), within=2)
        await anyio.sleep(0.1)  # a deliberate window: no other claim may follow
        claims = [b - a for a, b in zip(before, sent(), strict=True)]
        assert sorted(claims) == [0, 0, 1, 1]  # two woken, one claim each
        (owner,) = [w for w in workers if w.id == rec.started[0].worker_id]
        assert owner.id.encode() not in await client._conn.execute("SMEMBERS", key)
        # cancelled in the mesh: the freed slot looks for work at once (one
        # claim, nothing to take), and the owner is idle again
        before = sent()
        await client.cancel("devices", "a")
        await wait_until(lambda: _true(len(rec.cancelled) == 1), within=2)
        await wait_until(lambda: idle_count(4), within=2)
        await anyio.sleep(0.1)  # a deliberate window: no other claim may follow
        claims = [b - a for a, b in zip(before, sent(), strict=True)]
        assert claims == [1 if w is owner else 0 for w in workers]


async def test_a_server_whose_wake_was_lost_is_back_in_the_idle_set_within_a_heartbeat(
    redis_url: str, namespace: str
) -> None:
    """A wake takes the server out of the idle set; if the message is lost,
    nothing else would put it back while the queue stays empty: the
    heartbeat reports that it is not there, and it claims."""
    async with client_and_workers(redis_url, namespace, 1, ttl=1.5) as (client, (w,)):
        await w.start_work("jobs", Recorder().quick)
        key = client._keys.idle("jobs")

        async def member() -> bool:
            return bool(await client._conn.execute("SISMEMBER", key, w.id))

        await wait_until(member)
        await client._conn.execute("SREM", key, w.id)  # popped by a wake that got lost
        t0 = anyio.current_time()
        await wait_until(member, within=3 * w.timing.interval)
        assert anyio.current_time() - t0 <= w.timing.interval + 0.3


async def test_a_plain_def_handler_is_refused_before_any_task_runs(
    redis_url: str, namespace: str
) -> None:
    ran: list[bytes] = []

    def plain(p: Process) -> None:
        ran.append(p.task)

    async def handler(p: Process, tag: str) -> None:
        ran.append(tag.encode() + p.task)

    class Callable_:
        async def __call__(self, p: Process) -> None:
            ran.append(b"obj:" + p.task)

    class SyncCallable:
        def __call__(self, p: Process) -> None:
            ran.append(p.task)

    async with client_and_workers(redis_url, namespace, 1) as (client, [w]):
        await client.enqueue_many("plain", [b"a"])
        for bad in (plain, lambda p: handler(p, "x"), SyncCallable(), functools.partial(plain)):
            with pytest.raises(TypeError, match="is not async"):
                await w.start_work("plain", bad)  # type: ignore[arg-type]
        assert "plain" not in (await client.workers())[0].queues
        # async callables of every shape are accepted and run
        await w.start_work("partial", functools.partial(handler, tag="p:"))
        await w.start_work("object", Callable_())
        await client.enqueue("partial", b"1")
        await client.enqueue("object", b"2")

        async def both_ran() -> bool:
            return sorted(ran) == [b"obj:2", b"p:1"]

        await wait_until(both_ran, what="the partial and the object to run")
        assert await client.queue_length("plain") == 1  # the plain def never ran


# --- logs: one line per event at INFO, tracebacks only at DEBUG ----------------


def log_lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    """The messages of trio-mesh's records at ``level`` or above, each
    checked to be one line without a traceback."""
    out = []
    for r in caplog.records:
        if r.name.startswith("mesh") and r.levelno >= level:
            msg = r.getMessage()
            assert "\n" not in msg and r.exc_info is None, (msg, r.exc_info)
            out.append(msg)
    return out


async def test_a_failed_attempt_is_one_line_with_what_happens_next(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mesh")

    async def broken(p: Process) -> None:
        raise ValueError("boom\non two lines")

    async with client_and_workers(redis_url, namespace, 1) as (client, (w,)):
        await w.start_work("jobs", broken, max_attempts=2, backoff=0.05, backoff_max=1)
        await client.enqueue("jobs", b"job-1")

        # counted once the give-back's reply came: then it is dead-lettered
        await wait_until(lambda: _true(w.statistics().processes_failed == 2), what="2 failures")
        assert (await client.queue_info("jobs")).dead == 1
    failed = [m for m in log_lines(caplog) if "failed" in m]
    assert failed == [
        "queue jobs: task 'job-1' failed (attempt 1 of 2): ValueError: boom on two lines; "
        "retrying in 0.05 s",
        "queue jobs: task 'job-1' failed (attempt 2 of 2): ValueError: boom on two lines; "
        "dead-lettered",
    ]
    # the tracebacks are there, at DEBUG only
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 2 and {r.levelno for r in tracebacks} == {logging.DEBUG}


async def test_a_lost_lease_logs_the_fence_the_takeover_and_the_rejoin_once_each(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mesh")
    rec = Recorder()
    async with client_and_workers(redis_url, namespace, 2) as (client, (w1, w2)):
        await w1.start_work("devices", rec.forever)
        await client.ensure("devices", "d")
        await wait_until(lambda: _true(len(rec.started) == 1))
        old_id = w1.id if rec.started[0].worker_id == w1.id else w2.id
        holder = w1 if old_id == w1.id else w2
        await expire_worker(client._conn, client._keys, old_id)

        async def rejoined() -> bool:
            return holder.id != old_id and old_id not in [x.id for x in await client.workers()]

        await wait_until(rejoined, what="the holder to rejoin")
        await wait_until(lambda: _true(len(rec.started) == 2), what="the device to run again")
        new_id = holder.id
        peer_id = w2.id if holder is w1 else w1.id
        # a worker does not count its own lapsed lease as a takeover
        assert holder.statistics().peers_recycled == 0
    lines = log_lines(caplog)
    fences = [m for m in lines if "fenced" in m]
    assert len(fences) == 1 and fences[0].startswith(f"worker {old_id} fenced (")
    assert "lease" in fences[0] or "superseded" in fences[0] or "gone" in fences[0], fences
    assert [m for m in lines if "rejoined" in m] == [
        f"worker {old_id} rejoined the mesh as {new_id}"
    ]
    # whoever recycled the old identity: a peer says so, the worker itself does not
    takeovers = [m for m in lines if "took over" in m]
    assert len(takeovers) <= 1, takeovers
    for m in takeovers:
        assert m.startswith(f"worker {peer_id} took over from 1 dead worker(s) ({old_id}): ")


async def test_redis_unreachable_is_said_once_per_outage(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mesh")
    rec = Recorder()
    async with client_and_workers(own_redis.url, "outage", 1) as (_, (w,)):
        await w.start_work("jobs", rec.quick)
        first_id = w.id
        own_redis.stop()
        # the worker retries all the while, and fences itself at R
        await wait_until(lambda: _true(w.statistics().fenced == 1), what="the fence")
        own_redis.start()
        await wait_until(lambda: _true(w.id != first_id and w._lease.ready.is_set()), what="rejoin")
    lines = log_lines(caplog)
    # (a heartbeat stuck on the dead connection until the fence deadline logs
    # no retry at all: the fence line says it)
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert {r.levelno for r in retries if r.name == "mesh.worker"} <= {
        logging.DEBUG,
        logging.WARNING,
    }
    fences = [m for m in lines if "fenced" in m]
    assert fences == [
        f"worker {first_id} fenced (no heartbeat confirmed within 0.6 s; Redis unreachable); "
        "its processes were stopped; rejoining"
    ]
    rejoined = f"worker {first_id} rejoined the mesh as {w.id}"
    assert [m for m in lines if "rejoined" in m] == [rejoined]
    # whatever else it said, it said once: no line per retry
    assert len(lines) == len(set(lines)) <= 5, lines


async def test_a_worker_does_not_report_recycling_itself(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="mesh")
    rec = Recorder()
    # a long lease: its heartbeat does not notice for seconds, so its own
    # reaper is the first to find its lapsed lease (as after a long pause)
    async with client_and_workers(redis_url, namespace, 1, ttl=30) as (client, (w,)):
        await w.start_work("devices", rec.forever)
        await client.ensure("devices", "d")
        await wait_until(lambda: _true(len(rec.started) == 1))
        await expire_worker(client._conn, client._keys, w.id)
        await w._reaper.reap_once()
        assert await client.processes() == []  # recycled all the same
        assert w.statistics().peers_recycled == 0
    assert not [m for m in log_lines(caplog) if "took over" in m or "recycled" in m]
    own = [r.getMessage() for r in caplog.records if "own lapsed lease" in r.getMessage()]
    assert len(own) == 1


# --- a cancel that reaches a worker before the reply of the claim that
# created the process (its pub/sub message and the heartbeat that carries it
# from the durable inbox both arrive while the claim reply is on its way) must
# still stop the process: it used to be acknowledged and forgotten, and the
# handler then ran a task that Redis no longer knew, forever for a persistent
# task


@pytest.mark.trio_only("trio.testing.wait_all_tasks_blocked orders the trio tasks")
async def test_a_cancel_that_overtakes_the_claim_reply_is_not_lost(
    redis_url: str, namespace: str
) -> None:
    started: list[bytes] = []

    async def hold(p: mesh.Process) -> None:
        started.append(p.task)
        await anyio.sleep_forever()

    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=0.6) as worker,
    ):
        real_run = worker._binding.run
        cancels: list[int] = []
        returned = anyio.Event()

        async def run(conn: Any, call: Any) -> Any:
            reply = await real_run(conn, call)
            if call.script.name == "claim" and reply.processes and not cancels:
                cancels.append(await client.cancel("devices", "dev-1"))
                # The runner's trio task resumes late: heartbeats deliver and
                # acknowledge the cancel meanwhile (the inbox is empty again).
                inbox = client._keys.inbox(worker.id)

                async def acknowledged() -> bool:
                    return int(await client._conn.execute("SCARD", inbox)) == 0

                await wait_until(acknowledged, what="the cancel delivered and acknowledged")
                returned.set()
            return reply

        worker._binding.run = run  # type: ignore[method-assign]
        await worker.start_work("devices", hold)
        await client.ensure("devices", "dev-1")
        with anyio.fail_after(5):
            await returned.wait()
        assert cancels == [1]
        # the runner took the reply and went back to waiting, without starting it
        await trio.testing.wait_all_tasks_blocked()
        assert started == []
        assert worker.statistics().running == 0
        assert worker.statistics().processes_cancelled == 1
        assert await client.processes("devices") == []
        assert await client.persistent_tasks("devices") == {}


async def test_a_worker_cancelled_from_outside_hands_back_at_once(
    redis_url: str, namespace: str
) -> None:
    ttl = 3.0

    async def handler(p: mesh.Process) -> None:
        await anyio.sleep_forever()

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        with anyio.CancelScope() as outer:
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=ttl) as w:
                await w.start_work("devices", handler)
                await client.ensure("devices", "d1")

                async def running() -> bool:
                    return len(await client.processes("devices")) == 1

                await wait_until(running)
                t0 = anyio.current_time()
                outer.cancel()
                await anyio.sleep_forever()
        took = anyio.current_time() - t0
        info = await client.queue_info("devices")
        assert (info.queued, info.running) == (1, 0)
        assert await client.workers() == []
        assert took < ttl / 3, f"leaving took {took:.3f} s"


async def test_wakes_and_cancels_travel_sharded_where_the_server_has_it(
    own_redis: RedisServer, namespace: str
) -> None:
    """Redis 7.0+: the scripts SPUBLISH an idle worker's wake and a cancel, and
    the worker hears them on SSUBSCRIBE (PUBSUB SHARDNUMSUB); no PUBLISH is
    sent. Redis 6.2 (tests/test_compat.py runs this file there): both go by
    PUBLISH. Either way they arrive: with a heartbeat every 10 s, the task
    starts and is cancelled within seconds only through the nudges."""
    url = own_redis.url
    started: list[bytes] = []
    cancelled: list[bytes] = []

    async def handler(p: Process) -> None:
        started.append(p.task)
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(p.task)
            raise

    async with mesh._connection.open_connection(url) as admin:
        info: bytes = await admin.execute("INFO", "server")
        sharded = int(info.split(b"redis_version:")[1].split(b".")[0]) >= 7
        async with (
            mesh.open_client(url, namespace=namespace) as c,
            mesh.open_worker(url, namespace=namespace, ttl=30) as w,
        ):
            await w.start_work("q", handler)
            idle = f"{{{namespace}}}:idle:q"

            async def is_idle() -> bool:
                return bool(await admin.execute("SISMEMBER", idle, w.id))

            await wait_until(is_idle, 5, "the worker's first claim to find nothing")
            wake = f"{{{namespace}}}:wake:{w.id}"
            shard_subs = await admin.execute("PUBSUB", "SHARDNUMSUB", wake) if sharded else None
            await admin.execute("CONFIG", "RESETSTAT")
            await c.enqueue("q", b"job")
            await wait_until(lambda: started, 5, "the woken worker to claim")
            assert await c.cancel("q", b"job") == 1
            await wait_until(lambda: cancelled, 5, "the cancel to reach the handler")
            stats: bytes = await admin.execute("INFO", "commandstats")
    calls = {
        name: int(stats.split(f"cmdstat_{name}:calls=".encode())[1].split(b",")[0])
        for name in ("publish", "spublish")
        if f"cmdstat_{name}:".encode() in stats
    }
    if sharded:
        assert shard_subs == [wake.encode(), 1]
        assert calls.get("spublish", 0) >= 2 and "publish" not in calls, calls
    else:
        assert calls.get("publish", 0) >= 2 and "spublish" not in calls, calls
