"""The one statistics view of a worker: what each counter counts."""

from __future__ import annotations

import anyio
import pytest

import mesh
from mesh._binding import Binding
from mesh._connection import open_connection
from mesh._keys import Keys
from mesh._stats import LATENCY_BOUNDS, _Timing, fence_reason
from mesh.testing import wait_until

from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops

TTL = 0.9


def test_histogram_buckets_are_cumulative_with_inf_last() -> None:
    t = _Timing((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0, 3.0):
        t.observe(v)
    h = t.snapshot()
    # <= 0.1: 0.05 and 0.1 (a bound is inclusive, as in Prometheus)
    assert h.cumulative == (2, 3)
    assert h.count == 5
    assert abs(h.sum - 5.65) < 1e-9


def test_fence_reasons_come_from_the_fenced_error() -> None:
    assert fence_reason("FENCED worker w has no lease (expired or recycled)") == "lease_expired"
    assert fence_reason("FENCED worker w lease superseded") == "lease_superseded"
    assert fence_reason(None) == "heartbeat_timeout"


async def test_per_queue_counters_follow_handler_outcomes(redis_url: str, namespace: str) -> None:
    release = anyio.Event()

    async def handler(p: mesh.Process) -> None:
        if p.task == b"fail":
            raise RuntimeError("boom")
        if p.task == b"hold":
            await release.wait()

    async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w:
        await w.start_work("jobs", handler, max_attempts=1)
        s0 = w.statistics()
        assert s0.queues["jobs"].started == 0
        assert s0.heartbeat_seconds is not None
        await w.client.enqueue_many("jobs", ["ok", "fail", "hold"])
        await wait_until(lambda: w.statistics().processes_finished == 1, what="ok finished")
        await wait_until(lambda: w.statistics().processes_failed == 1, what="fail reported")
        s = w.statistics()
        q = s.queues["jobs"]
        assert (q.started, q.finished, q.failed, q.running) == (3, 1, 1, 1)
        assert s.running == 1 and s.processes_started == 3
        assert q.handler_seconds.count == 2  # "ok" and "fail" ended; "hold" runs
        assert q.claims >= 1 and q.claim_seconds.count == q.claims
        # a cancel of the running task is counted as cancelled
        assert await w.client.cancel("jobs", "hold") == 1
        await wait_until(lambda: w.statistics().processes_cancelled == 1, what="cancelled")
        assert w.statistics().queues["jobs"].handler_seconds.count == 3
        # heartbeats are confirmed and timed
        beats = w.statistics().heartbeats
        await wait_until(lambda: w.statistics().heartbeats > beats, what="a heartbeat")
        hb = w.statistics().heartbeat_seconds
        assert hb is not None and hb.count == w.statistics().heartbeats
        assert hb.bounds == LATENCY_BOUNDS
        assert w.statistics().commands_sent > 0


async def test_fences_are_counted_by_reason(redis_url: str, namespace: str) -> None:
    async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w:

        async def hold(p: mesh.Process) -> None:
            await anyio.sleep_forever()

        await w.start_work("jobs", hold)
        old = w.id
        await expire_worker(w.client._conn, Keys(namespace), old)
        await wait_until(lambda: w.statistics().generation == 2, what="rejoined")
        s = w.statistics()
        assert s.fenced == 1
        assert s.fences["lease_expired"] == 1
        assert s.fences["heartbeat_timeout"] == 0


async def test_takeovers_count_recycled_workers_and_processes(
    redis_url: str, namespace: str
) -> None:
    keys = Keys(namespace)
    b = Binding(keys)
    async with open_connection(redis_url) as conn:
        # a dead peer that held two processes
        await join(b, conn, "dead", "jobs")
        await b.enqueue(conn, "jobs", [b"a", b"b"])
        reply = await b.claim(conn, "dead", "inc-dead", "jobs", 2, 0)
        assert len(reply.processes) == 2
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w:
            await expire_worker(conn, keys, "dead")
            w._reaper.wake()
            await wait_until(lambda: w.statistics().peers_recycled == 1, what="recycled")
            s = w.statistics()
            assert s.processes_recycled == 2
            assert s.reap_checks >= 1
