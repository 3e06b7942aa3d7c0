"""``SCRIPT FLUSH`` under load is invisible: every caller falls back from
EVALSHA to EVAL on NOSCRIPT, nothing fails, nothing runs twice."""

from __future__ import annotations

import pytest
import trio

from mesh._harness.harness import Harness
from mesh.testing import wait_until

from .conftest import TTL

pytestmark = pytest.mark.slow


def stat(info: bytes, line: str) -> int:
    for raw in info.decode().splitlines():
        if raw.startswith(line):
            return int(raw.split("calls=" if "calls=" in raw else "count=")[1].split(",")[0])
    return 0


async def test_script_flush_under_load_is_invisible(ho: Harness) -> None:
    h = ho
    await h.start(3, "--concurrency", "20")
    devices = [b"dev%d" % i for i in range(12)]
    await h.client.ensure_many("devices", devices)
    jobs = [b"!hold=0.005;j%d" % i for i in range(600)]
    flushes = 0
    async with h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}, every=0.05) as mon:
        async with trio.open_nursery() as nursery:

            async def flusher() -> None:
                nonlocal flushes
                while True:
                    await h.conn.execute("SCRIPT", "FLUSH")
                    flushes += 1
                    await trio.sleep(0.01)  # not a synchronisation: the flusher's pace

            nursery.start_soon(flusher)
            for i in range(0, len(jobs), 20):
                await h.client.enqueue_many("jobs", jobs[i : i + 20])  # never raises
                assert await h.client.ensure("devices", devices[i % len(devices)]) is False
                await trio.sleep(0.01)  # not a synchronisation: the producer's pace

            async def all_done() -> bool:
                v = await h.judge()
                return all(v.done_count.get(j) for j in jobs)

            await wait_until(all_done, 20 * TTL, "every job done")
            nursery.cancel_scope.cancel()
    assert flushes > 20
    v = await h.judge()
    assert v.duplicates == 0 and v.overlaps == [] and v.rejected == 0
    assert mon.violations == []
    assert await h.warnings() == []  # no worker saw an error
    assert await h.client.dead_letters("jobs") == []
    snap = await h.snapshot()
    assert sorted(p.payload for p in snap.queues["devices"].procs.values()) == sorted(devices)
    # the flushes did hit the callers: NOSCRIPT replies, answered by EVAL
    info = await h.conn.execute("INFO", "all")
    assert stat(info, "errorstat_NOSCRIPT") > 10
    assert stat(info, "cmdstat_eval:") > 10
