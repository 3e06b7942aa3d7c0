"""``CLIENT KILL TYPE pubsub`` while a cancel or an enqueue is published: the
message is lost, the durable path still delivers (the cancel inbox read by the
heartbeat, the queue state in its reply), within one heartbeat interval."""

from __future__ import annotations

import pytest
import trio

from mesh._harness.harness import Harness, figure
from mesh._harness.sink import Event
from mesh.testing import wait_until

from .conftest import TTL

pytestmark = [pytest.mark.slow, pytest.mark.worker_loops]
H = TTL / 3


async def kill_pubsub(h: Harness) -> int:
    return int(await h.conn.execute("CLIENT", "KILL", "TYPE", "pubsub"))


async def subscribed(h: Harness, n: int) -> bool:
    """At least ``n`` subscriber connections are back (after a kill they
    reconnect within tens of milliseconds)."""
    clients: bytes = await h.conn.execute("CLIENT", "LIST", "TYPE", "pubsub")
    return clients.decode().count("name=mesh-events:") >= n


async def kill_both_subscribers(h: Harness) -> None:
    await wait_until(lambda: subscribed(h, 2), 5, "both subscribers connected")
    assert await kill_pubsub(h) >= 2


async def test_cancel_and_work_published_while_pubsub_is_down_still_land(h: Harness) -> None:
    await h.start(2)
    jobs = [b"!hold=60;job%d" % i for i in range(3)]
    devices = [b"dev%d" % i for i in range(3)]
    await h.client.enqueue_many("jobs", jobs)
    await h.client.ensure_many("devices", devices)

    async def running(n: int) -> bool:
        return len({e.task for e in await h.events() if e.action == "start"}) >= n

    await wait_until(lambda: running(6), 5, "all running")
    latencies: dict[str, list[float]] = {"cancel": [], "enqueue": []}
    for i in range(3):
        for victim in (jobs[i], devices[i]):
            await kill_both_subscribers(h)
            t0 = await h.sink_now()
            assert await h.client.cancel("jobs" if victim in jobs else "devices", victim) == 1

            def cancelled(e: Event, v: bytes = victim) -> bool:
                return e.action == "cancelled" and e.task == v

            e = await h.wait_event(cancelled, 2 * TTL, "cancel")
            latencies["cancel"].append(e.t - t0)
        await kill_both_subscribers(h)
        t0 = await h.sink_now()
        new = b"new%d" % i
        await h.client.enqueue("jobs", new)

        def done(e: Event, n: bytes = new) -> bool:
            return e.action == "done" and e.task == n

        e = await h.wait_event(done, 2 * TTL, "new")
        latencies["enqueue"].append(e.t - t0)
    # the durable path: within one heartbeat interval, plus room for a loaded
    # machine (measured: at most H; docs/reliability.md)
    assert max(latencies["cancel"]) < H + 0.4
    assert max(latencies["enqueue"]) < H + 0.4
    ev = await h.events()
    # a cancelled task never starts again
    for victim in jobs + devices:
        assert sum(e.action == "start" and e.task == victim for e in ev) == 1

    # the handlers' last events come before their finish reports reach Redis
    async def finished() -> bool:
        snap = await h.snapshot()
        return snap.queues["jobs"].procs == {} and snap.queues["devices"].procs == {}

    await wait_until(finished, 2 * TTL, "the finish reports")
    snap = await h.snapshot()
    assert snap.queues["devices"].persistent == {} and snap.queues["devices"].standby == set()
    figure(
        "pubsub_kill",
        h=round(H, 3),
        cancel_max=round(max(latencies["cancel"]), 3),
        enqueue_max=round(max(latencies["enqueue"]), 3),
    )


async def test_pubsub_killed_over_and_over_under_load(h: Harness) -> None:
    await h.start(2)
    killed = 0
    async with trio.open_nursery() as nursery:

        async def killer() -> None:
            nonlocal killed
            while True:
                killed += await kill_pubsub(h)
                await trio.sleep(0.03)  # not a synchronisation: the killer's pace

        nursery.start_soon(killer)
        jobs = [b"!hold=0.2;j%d" % i for i in range(60)]
        long = [b"!hold=60;l%d" % i for i in range(10)]
        await h.client.enqueue_many("jobs", long)
        for i in range(0, 60, 6):
            await h.client.enqueue_many("jobs", jobs[i : i + 6])
            await trio.sleep(0.05)  # not a synchronisation: the producer's pace
        for x in long:
            assert await h.client.cancel("jobs", x) in (0, 1)

        async def settled() -> bool:
            v = await h.judge()
            info = await h.client.queue_info("jobs")
            return all(v.done_count.get(j) for j in jobs) and info.running == info.queued == 0

        await wait_until(settled, 10 * TTL, "every job done, every cancel landed")
        nursery.cancel_scope.cancel()
    assert killed > 10
    v = await h.judge()
    assert v.duplicates == 0 and v.overlaps == []
    assert not [e for e in await h.events() if e.action == "done" and e.task in long]
