"""One mesh of trio and asyncio worker processes: every persistent task has
exactly one owner, whichever loop it runs on, through kills and graceful
stops of either kind, and every one-shot job is done (at least once: the
job of a killed worker runs again)."""

from __future__ import annotations

import pytest

from mesh._harness.harness import Driver, Harness, payloads
from mesh.testing import wait_until

from .conftest import TTL

pytestmark = pytest.mark.slow


async def test_a_mesh_of_trio_and_asyncio_workers_holds_each_task_once(h: Harness) -> None:
    devices = payloads("dev", 16)
    jobs = [b"!hold=0.2;job%d" % i for i in range(40)]
    trio_workers = await h.start(2, "--loop", "trio")
    asyncio_workers = await h.start(2, "--loop", "asyncio")
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", jobs)
    live: list[Driver] = [*trio_workers, *asyncio_workers]

    async def each_device_owned_once() -> bool:
        """Each device held once, by a live worker."""
        snap = await h.snapshot()
        held = sorted(p.payload for p in snap.queues["devices"].procs.values())
        alive = {await h.worker_id(d) for d in live}
        owners = {p.worker for p in snap.queues["devices"].procs.values()}
        return held == sorted(devices) and owners <= alive

    async with h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}) as mon:
        await wait_until(each_device_owned_once, 10, "every device owned")
        ids = {d.tag: await h.worker_id(d) for d in live}

        async def balanced() -> bool:
            snap = await h.snapshot()
            counts = [
                sum(1 for p in snap.queues["devices"].procs.values() if p.worker == ids[d.tag])
                for d in live
            ]
            return counts == [4, 4, 4, 4]

        # the fair share holds across the loops: 4 devices each
        await wait_until(balanced, 20, "4 devices on each of the 2 trio and 2 asyncio workers")

        # SIGKILL an asyncio worker: trio and asyncio peers take its tasks over
        asyncio_workers[0].kill()
        live.remove(asyncio_workers[0])
        await wait_until(each_device_owned_once, 4 * TTL, "devices back after the kill")

        # a graceful stop of a trio worker: handed back at once, no overlap
        trio_workers[0].term()
        assert await trio_workers[0].wait_exit(5) == 0
        live.remove(trio_workers[0])
        await wait_until(each_device_owned_once, 4 * TTL, "devices back after the stop")

        # a new asyncio worker joins, then the other asyncio worker is killed
        (joined,) = await h.start(1, "--loop", "asyncio")
        live.append(joined)
        asyncio_workers[1].kill()
        live.remove(asyncio_workers[1])
        await wait_until(each_device_owned_once, 4 * TTL, "devices back after the second kill")

        async def jobs_done() -> bool:
            v = await h.judge()
            return all(v.done_count.get(j, 0) >= 1 for j in jobs)

        await wait_until(jobs_done, 10, "every job done")
        # the survivors, a trio and an asyncio worker, hold every device
        assert await each_device_owned_once()
    assert mon.violations == [] and mon.samples > 10
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1
