"""Fleets (mesh._fleet): many workers of one process sharing a connection,
batched heartbeats, one pub/sub connection and one reaper."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

import mesh
from mesh import Process
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._keys import Keys
from mesh.testing import RedisServer, wait_until

from .helpers import Recorder, running_workers
from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops

TTL = 0.9  # H = 0.3 s, R = 0.6 s


@asynccontextmanager
async def fleet_of(
    url: str, ns: str, n: int, ttl: float = TTL
) -> AsyncIterator[tuple[mesh.Fleet, list[mesh.Worker]]]:
    """A fleet and ``n`` of its workers."""
    async with (
        mesh.open_fleet(url, namespace=ns, ttl=ttl) as fleet,
        running_workers(fleet.open_worker, n) as workers,
    ):
        yield fleet, workers


async def test_batched_renewal_fences_one_worker_and_renews_the_others(
    redis_url: str, namespace: str
) -> None:
    rec = Recorder()
    async with fleet_of(redis_url, namespace, 3) as (fleet, workers):
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            for w in workers:
                await w.start_work("devices", rec.forever, concurrency=1)
            await client.ensure_many("devices", ["d0", "d1", "d2"])
            await wait_until(lambda: _true(len(rec.running()) == 3))
            ids = [w.id for w in workers]

            # Heartbeats due at the same time go in one call: make all three due
            # now (again, if a reply on its way made one of them due later).
            async def batched() -> bool:
                if fleet.renewals.largest >= 3:
                    return True
                for w in workers:
                    fleet.renewals.add(w._lease, w._gen)
                return False

            await wait_until(batched, what="three leases in one call")
            # Now one of the fleet's own workers loses its lease: it alone is
            # fenced (its handler cancelled) and rejoins under a new id.
            await expire_worker(client._conn, client._keys, ids[0])
            await wait_until(lambda: _true(workers[0].id != ids[0] and len(rec.running()) == 3))
            assert [p.worker_id for p in rec.cancelled] == [ids[0]]
            assert [w.id for w in workers[1:]] == ids[1:]
            assert workers[0].statistics().fenced == 1
            assert all(w.statistics().fenced == 0 for w in workers[1:])


async def test_the_shared_subscriber_delivers_each_cancel_to_its_worker(
    redis_url: str, namespace: str
) -> None:
    # H = 20 s: a cancel that missed pub/sub would wait for the durable inbox.
    rec = Recorder()
    async with fleet_of(redis_url, namespace, 2, ttl=60) as (_, (a, b)):
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            await a.start_work("a-jobs", rec.forever)
            await b.start_work("b-jobs", rec.forever)
            await client.enqueue("a-jobs", b"x")
            await client.enqueue("b-jobs", b"x")
            await client.enqueue("b-jobs", b"y")
            await wait_until(lambda: _true(len(rec.running()) == 3))
            assert await client.cancel("b-jobs", b"x") == 1
            await wait_until(lambda: _true(len(rec.cancelled) == 1), within=5)
            (gone,) = rec.cancelled
            assert (gone.queue, gone.task, gone.worker_id) == ("b-jobs", b"x", b.id)
            assert sorted((p.queue, p.task) for p in rec.running()) == [
                ("a-jobs", b"x"),
                ("b-jobs", b"y"),
            ]


async def test_the_fleet_reaper_takes_over_from_a_dead_peer(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with fleet_of(redis_url, namespace, 2) as (fleet, workers):
        async with mesh.open_client(redis_url, namespace=namespace) as client:
            b = Binding(client._keys)
            inc = await join(b, client._conn, "peer", "devices")
            await client.ensure("devices", "d")
            (held,) = (await b.claim(client._conn, "peer", inc, "devices", 1, 0)).processes
            for w in workers:
                await w.start_work("devices", rec.forever)
            await expire_worker(client._conn, client._keys, "peer")
            await wait_until(lambda: _true(len(rec.running()) == 1))
            (p,) = rec.running()
            assert p.task == b"d" and p.token > held.token
            assert p.worker_id in {w.id for w in workers}
            assert fleet.statistics().workers_recycled == 1
            assert sum(w.statistics().fenced for w in workers) == 0


@pytest.mark.slow
async def test_a_fleet_paces_its_joins_and_rejoins_and_every_worker_ends_registered(
    own_redis: RedisServer,
) -> None:
    """300 workers of a fleet open at once: the first JOIN_BURST register at
    once, the others in turns (the join is paced, not refused). Then Redis
    stops answering for longer than R (CLIENT PAUSE): every worker fences
    itself and rejoins under a new id, paced again; each ends registered
    with a live lease, fenced exactly once."""
    n = 300
    ns = "joins"
    async with (
        mesh.open_fleet(own_redis.url, namespace=ns, ttl=3.0, join_window=1.0) as fleet,
        mesh.open_client(own_redis.url, namespace=ns) as client,
        anyio.create_task_group() as nursery,
    ):
        workers: list[mesh.Worker] = []
        done = anyio.Event()

        async def one() -> None:
            async with fleet.open_worker() as w:
                workers.append(w)
                await done.wait()

        for _ in range(n):
            nursery.start_soon(one)
        await wait_until(lambda: _true(len(workers) == n), within=30)
        joins = fleet.renewals.joins
        assert joins.joined == n
        # 200 after the burst, 0.5 ms apart: the last waited up to 0.1 s
        # (less the time the 300 took to arrive)
        assert joins.longest >= 0.05
        conn, k = client._conn, client._keys
        assert await conn.execute("ZCARD", k.workers) == n

        first = {w.id for w in workers}
        await conn.execute("CLIENT", "PAUSE", "2500")  # R = 2 s
        await wait_until(
            lambda: _true(all(w.statistics().generation == 2 for w in workers)), within=30
        )
        assert joins.joined == 2 * n

        async def all_registered() -> bool:
            ids = [w.id for w in workers]
            live = await conn.pipeline([("EXISTS", k.heartbeat(i)) for i in ids])
            members = {m.decode() for m in await conn.execute("ZRANGE", k.workers, 0, -1)}
            return all(live) and members == set(ids)

        await wait_until(all_registered, within=10, what="every worker registered again")
        assert not first & {w.id for w in workers}  # new identities, the old ones retired
        assert [w.statistics().fenced for w in workers] == [1] * n
        done.set()


async def test_a_fleet_refuses_bad_options_before_starting(redis_url: str) -> None:
    with pytest.raises(mesh.ConfigError):
        async with mesh.open_fleet(redis_url, ttl=0.01):
            pass  # pragma: no cover
    with pytest.raises(mesh.ConfigError):
        async with mesh.open_fleet(redis_url, join_window=-1):
            pass  # pragma: no cover
    async with mesh.open_fleet(redis_url, namespace="f") as fleet:
        with pytest.raises(mesh.ConfigError):
            async with fleet.open_worker(worker_id="bad id"):
                pass  # pragma: no cover


async def _true(v: bool) -> bool:
    return v


def _unused(p: Process) -> None:  # pragma: no cover
    pass


async def test_a_worker_that_left_a_fleet_still_has_its_counts_reported(
    redis_url: str, namespace: str
) -> None:
    """The host reports the per-minute counts of all its members in one
    report; a worker that leaves before the next report is still in it."""

    async def handler(p: Process) -> None:
        if p.task.startswith(b"bad"):
            raise ValueError("no")

    async with (
        mesh.open_fleet(redis_url, namespace=namespace, ttl=3.0) as fleet,
        mesh.open_client(redis_url, namespace=namespace) as client,
    ):
        async with fleet.open_worker() as w:
            await w.start_work("jobs", handler, max_attempts=1)
            for t in ("ok1", "ok2", "bad1"):
                await client.enqueue("jobs", t)
            await wait_until(
                lambda: _true(
                    (s := w.statistics()).processes_finished == 2 and s.processes_failed == 1
                )
            )
        assert fleet.workers == []

        async def reported() -> bool:
            (counts,) = await client.minute_counts(["jobs"], minutes=2)
            return (sum(counts.finished), sum(counts.failed)) == (2, 1)

        await wait_until(reported, within=20, what="the counts of the worker that left")


async def test_the_fleet_client_waits_for_min_replicas_and_is_closed_with_the_fleet(
    redis_url: str, namespace: str
) -> None:
    """Issue 32, item 2: ``Fleet.client`` is built with the fleet's
    ``min_replicas`` (on a master with no replica an enqueue fails as a
    fleet worker's does, and nothing says it was acknowledged), and it
    refuses calls once the fleet's block is left."""
    url = f"{redis_url}?connect_timeout=0.5"
    async with mesh.open_fleet(url, namespace=namespace, min_replicas=1) as fleet:
        assert fleet.client.min_replicas == 1
        with pytest.raises(mesh.MeshConnectionError, match="only 0 of 1 replicas"):
            await fleet.client.enqueue("q", b"a")
        async with fleet.open_worker() as w:
            with pytest.raises(mesh.MeshConnectionError, match="only 0 of 1 replicas"):
                await w.client.enqueue("q", b"b")
        client = fleet.client
    with pytest.raises(mesh.ClosedError):
        await client.queues()


async def test_a_client_cannot_be_built_without_deciding_min_replicas(
    conn: Connection, keys: Keys
) -> None:
    with pytest.raises(TypeError, match="min_replicas"):
        mesh.Client(conn, keys)  # type: ignore[call-arg]
    with pytest.raises(mesh.ConfigError, match="min_replicas"):
        mesh.Client(conn, keys, min_replicas=-1)
    client = mesh.Client(conn, keys, min_replicas=2)
    assert client.min_replicas == 2
    with pytest.raises(AttributeError):
        client.min_replicas = 0  # type: ignore[misc]
