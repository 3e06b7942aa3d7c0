"""Looking at a mesh from outside (mesh._view): the dashboard's overview
agrees with the Client's own reads, and the exporter's counts cost a number
of commands that does not grow with the number of workers."""

from __future__ import annotations

import anyio
import pytest

import mesh
from mesh._view import counts, overview, snapshot
from mesh.testing import wait_until

pytestmark = pytest.mark.both_loops


async def hold(p: mesh.Process) -> None:
    await anyio.sleep_forever()


async def test_overview_agrees_with_the_client(redis_url: str, namespace: str) -> None:
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=5) as w1,
        mesh.open_worker(redis_url, namespace=namespace, ttl=5) as w2,
    ):
        # a capacity and a weight other than 1: the fair shares are by weight
        # against capacity (no rebalancing, so that nothing moves between reads)
        await w1.start_work("devices", hold, capacity=2, rebalance=False)
        await w1.start_work("jobs", hold)
        await w2.start_work("devices", hold, rebalance=False)
        await client.ensure("devices", "d1", weight=3)
        await client.ensure_many("devices", ["d2", "d3"])
        await client.enqueue_many("jobs", ["j1"])

        async def four_running() -> bool:
            return len(await client.processes()) >= 4

        await wait_until(four_running, what="4 processes running")
        cache: dict[str, dict[str, object]] = {}
        ov = await overview(client.reads, cache)
        snap = await snapshot(client.reads, processes=True)
        strip = [
            (w.id, w.alive, w.queues, w.processes, w.host, w.pid, w.started) for w in ov.workers
        ]
        want = [
            (w.id, w.alive, w.queues, w.processes, w.host, w.pid, w.started) for w in snap.workers
        ]
        assert strip == want
        # the same fair shares as Client.workers() (mesh status): T = 5, C = 3
        assert [w.shares for w in ov.workers] == [w.shares for w in snap.workers]
        devices = {w.id: w.shares[0] for w in ov.workers}
        assert (devices[w1.id].share, devices[w2.id].share) == (10 / 3, 5 / 3)
        assert (devices[w1.id].capacity, devices[w2.id].capacity) == (2, 1)
        assert sum(sh.weight for sh in devices.values()) == 5
        assert [q.info for q in ov.queues] == snap.queues
        assert ov.processes == snap.processes
        assert set(cache) == {w1.id, w2.id}  # descriptions read once, then cached
        assert {q.info.name: q.persistent_owned for q in ov.queues} == {"devices": 3, "jobs": 0}


async def test_counts_cost_does_not_grow_with_workers(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.enqueue("jobs", "x")

        async def commands() -> int:
            before = client._conn.statistics().commands_sent
            c = await counts(client.reads)
            assert [q.info.name for q in c.queues] == ["jobs"]
            return client._conn.statistics().commands_sent - before

        alone = await commands()
        async with (
            mesh.open_worker(redis_url, namespace=namespace, ttl=5),
            mesh.open_worker(redis_url, namespace=namespace, ttl=5),
            mesh.open_worker(redis_url, namespace=namespace, ttl=5),
        ):
            assert (await counts(client.reads)).workers_alive == 3
            assert await commands() == alone
