"""Redis itself fails: restarted with AOF (nothing acknowledged is lost) or
without persistence (everything is lost; the workers notice and rejoin),
stalled by ``DEBUG SLEEP`` longer than the TTL (every worker stands down at
R; no two live owners), evicting keys (refused at start), or out of memory
(heartbeats refused: the workers fence themselves, they do not crash)."""

from __future__ import annotations

import pytest
import trio

from mesh import MeshConnectionError, OutOfMemoryError
from mesh._connection import open_connection
from mesh._harness.harness import Harness, figure, open_harness
from mesh.testing import RedisServer, find_redis_server, run_redis_server, wait_until

from .conftest import TTL

pytestmark = pytest.mark.slow
R = 2 * TTL / 3


async def rejoined_since(h: Harness, t: float, n: int) -> bool:
    tags = {e.tag for e in await h.events() if e.action == "id" and e.t > t}
    return len(tags) >= n


async def owned_by_live_workers(h: Harness, devices: list[bytes]) -> bool:
    snap = await h.snapshot(["devices"])
    owners = [snap.owners("devices", d) for d in devices]
    return all(len(o) == 1 and snap.workers.get(o[0].worker) for o in owners)


@pytest.mark.redis_args("--appendonly", "yes", "--appendfsync", "always")
async def test_restart_with_aof_loses_no_acknowledged_task(ho: Harness) -> None:
    h = ho
    assert h.server is not None
    await h.start(2, "--concurrency", "10")
    devices = [b"dev%d" % i for i in range(6)]
    await h.client.ensure_many("devices", devices)
    jobs = [b"!hold=0.2;j%d" % i for i in range(200)]
    for i in range(0, len(jobs), 20):
        await h.client.enqueue_many("jobs", jobs[i : i + 20])  # each acknowledged
    await trio.sleep(0.5)  # not a synchronisation: work in flight when Redis dies
    before = max(e.token for e in await h.events() if e.fenced)
    h.server.stop()  # SIGKILL: nothing flushed beyond what AOF has
    down_at = await h.sink_now()
    with pytest.raises(MeshConnectionError):
        with trio.fail_after(10):
            await h.client.enqueue("jobs", b"never acknowledged")
    # Not a synchronisation: Redis stays down 1.5 TTL in all.
    await trio.sleep(max(0.0, down_at + 1.5 * TTL - await h.sink_now()))
    h.server.start()
    async with h.monitor({"devices": set(devices)}) as mon:
        await wait_until(lambda: rejoined_since(h, down_at, 2), 10 * TTL, "both rejoin")

        async def all_done() -> bool:
            v = await h.judge()
            info = await h.client.queue_info("jobs")
            done = all(v.done_count.get(j) for j in jobs)
            return done and info.queued == info.running == info.delayed == 0

        await wait_until(all_done, 20 * TTL, "every acknowledged job done")
        await wait_until(lambda: owned_by_live_workers(h, devices), 5 * TTL, "devices owned")
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1
    assert mon.violations == []
    assert await h.client.dead_letters("jobs") == []
    # the token counter survived: every owner after the restart has a higher token
    after = [e.token for e in await h.events() if e.fenced and e.t > down_at + 1.5 * TTL]
    assert after and min(after) > before
    figure("restart_aof", jobs=len(jobs), lost=0, duplicates=v.duplicates, down_s=1.5 * TTL)


@pytest.mark.redis_args("--appendonly", "yes", "--appendfsync", "always")
async def test_a_redis_restart_shorter_than_r_is_absorbed(ho: Harness) -> None:
    """Down for less than R - H: no worker fences, no handler stops, no job
    runs twice (commands wait for the reconnect; finish reports that failed
    meanwhile are sent again)."""
    h = ho
    assert h.server is not None
    await h.start(2, "--concurrency", "10")
    devices = [b"dev%d" % i for i in range(4)]
    await h.client.ensure_many("devices", devices)
    await wait_until(lambda: owned_by_live_workers(h, devices), 5, "devices owned")
    jobs = [b"!hold=0.3;j%d" % i for i in range(60)]
    await h.client.enqueue_many("jobs", jobs)
    await h.wait_event(lambda e: e.action == "start" and e.task in jobs, 5, "jobs running")
    starts = {e.token for e in await h.events() if e.action == "start" and e.task in devices}
    h.server.stop()
    await trio.sleep(0.1)  # not a synchronisation: a short outage
    h.server.start()

    async def all_done() -> bool:
        v = await h.judge()
        return all(v.done_count.get(j) for j in jobs)

    await wait_until(all_done, 10 * TTL, "every job done")
    ev = await h.events()
    assert not [e for e in ev if e.action in ("id", "cancelled")]
    assert {e.token for e in ev if e.action == "start" and e.task in devices} == starts
    v = await h.judge()
    assert v.duplicates == 0 and v.overlaps == []
    # the workers did reconnect to the new server (commands and subscriptions)
    clients = (await h.conn.execute("CLIENT", "LIST")).decode()
    assert clients.count("name=mesh-worker:") == 2 and clients.count("name=mesh-events:") == 2


async def test_restart_without_persistence_workers_notice_and_rejoin(ho: Harness) -> None:
    """Everything in Redis is lost (documented in docs/reliability.md): queued
    and running tasks, persistent tasks, dead letters, the token counter. The
    workers find their leases gone at their next heartbeat, stop every
    handler and rejoin; the application must put its tasks back."""
    h = ho
    assert h.server is not None
    a, b = await h.start(2)
    devices = [b"dev%d" % i for i in range(4)]
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", [b"!hold=60;j%d" % i for i in range(4)])

    async def running() -> bool:
        return len({e.task for e in await h.events() if e.action == "start"}) == 8

    await wait_until(running, 5, "all running")
    old = {e.token for e in await h.events() if e.action == "start"}
    h.server.stop()
    down_at = await h.sink_now()
    await trio.sleep(0.1)  # shorter than R: only the data loss makes them stand down
    h.server.start()
    await wait_until(lambda: rejoined_since(h, down_at, 2), 5 * TTL, "both rejoin")

    async def all_cancelled() -> bool:
        ev = await h.events()
        return {e.token for e in ev if e.action == "cancelled"} >= old

    await wait_until(all_cancelled, 2 * TTL, "every old handler stopped")
    info = await h.client.queue_info("devices"), await h.client.queue_info("jobs")
    assert all(i.queued == i.running == i.persistent == 0 for i in info)  # lost
    assert len([w for w in await h.client.workers() if w.alive]) == 2
    # the application puts its persistent tasks back; they run again
    await h.client.ensure_many("devices", devices)
    await wait_until(lambda: owned_by_live_workers(h, devices), 5 * TTL, "devices owned")
    assert a.alive and b.alive


async def test_tokens_keep_increasing_across_a_restart_that_lost_the_data(ho: Harness) -> None:
    h = ho
    assert h.server is not None
    await h.start(1)
    await h.client.ensure("devices", b"dev")
    first = await h.wait_event(lambda e: e.action == "start", 5, "first owner")
    down_at = await h.sink_now()
    h.server.stop()
    h.server.start()
    await wait_until(lambda: rejoined_since(h, down_at, 1), 5 * TTL, "rejoin")
    await h.client.ensure("devices", b"dev")
    second = await h.wait_event(
        lambda e: e.action == "start" and e.t > down_at, 5 * TTL, "second owner"
    )
    assert second.token > first.token
    assert second.ok  # the sink (a fenced downstream) accepts the new owner


async def test_debug_sleep_longer_than_the_ttl(
    sink_server: RedisServer, namespace: str, nursery: trio.Nursery
) -> None:
    binary = find_redis_server()
    out = (await trio.run_process([binary, "--version"], capture_stdout=True)).stdout.decode()
    major = int(out.split("v=")[1].split(".")[0])
    args = ["--enable-debug-command", "yes"] if major >= 7 else []
    with run_redis_server(args) as server:
        async with open_harness(server.url, sink_server.url, namespace, nursery, TTL) as h:
            await _debug_sleep(h)


async def _debug_sleep(h: Harness) -> None:
    await h.start(2)
    devices = [b"dev%d" % i for i in range(4)]
    jobs = [b"!hold=60;j%d" % i for i in range(4)]
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", jobs)

    async def running() -> bool:
        return len({e.task for e in await h.events() if e.action == "start"}) == 8

    await wait_until(running, 5, "all running")
    old = {e.token for e in await h.events() if e.action == "start"}
    async with (
        open_connection(h.url) as conn,
        h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}) as mon,
    ):
        stall_at = await h.sink_now()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conn.execute, "DEBUG", "SLEEP", 2 * TTL)
            # Not observable from here (Redis answers nobody while it
            # sleeps): give the DEBUG SLEEP a moment to reach it.
            await trio.sleep(0.01)

            async def all_cancelled() -> bool:
                ev = await h.events()
                return {e.token for e in ev if e.action == "cancelled"} >= old

            await wait_until(all_cancelled, 2 * TTL, "every handler stood down")
        ev = await h.events()
        cancelled = [e.t - stall_at for e in ev if e.action == "cancelled" and e.token in old]
        # each worker stood down at R after its last confirmed heartbeat was
        # sent, before the stall began: before any lease could run out
        assert max(cancelled) < R + 0.1
        await wait_until(lambda: rejoined_since(h, stall_at, 2), 5 * TTL, "both rejoin")
        await wait_until(lambda: owned_by_live_workers(h, devices), 5 * TTL, "devices owned")

        async def jobs_running() -> bool:
            snap = await h.snapshot(["jobs"])
            return sorted(p.payload for p in snap.queues["jobs"].procs.values()) == sorted(jobs)

        await wait_until(jobs_running, 5 * TTL, "jobs running again")
    assert mon.violations == []
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1 and v.rejected == 0
    snap = await h.snapshot(["jobs"])
    counted = sum(p.attempts for p in snap.queues["jobs"].procs.values())
    figure(
        "debug_sleep",
        sleep_s=2 * TTL,
        stand_down_max=round(max(cancelled), 3),
        jobs_with_attempt_counted=counted,
        of=len(jobs),
    )


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru", "volatile-ttl"])
async def test_an_evicting_redis_is_refused_at_start(ho: Harness, policy: str) -> None:
    h = ho
    await h.conn.execute("CONFIG", "SET", "maxmemory-policy", policy)
    d = h.spawn()
    assert await d.wait_exit(15) == 2
    (e,) = [e for e in await h.events() if e.action == "startfail"]
    assert e.extra.startswith("ConfigError") and "noeviction" in e.extra and policy in e.extra


async def test_out_of_memory_keeps_the_workers_and_refuses_new_tasks(ho: Harness) -> None:
    h = ho
    a, b = await h.start(2)
    devices = [b"dev%d" % i for i in range(4)]
    await h.client.ensure_many("devices", devices)
    await wait_until(lambda: owned_by_live_workers(h, devices), 5, "devices owned")
    await h.wait_event(lambda e: e.action == "act", 5, "acting")
    old = {e.token for e in await h.events() if e.action == "start"}
    async with h.monitor({"devices": set(devices)}) as mon:
        await h.conn.execute("CONFIG", "SET", "maxmemory", "1")
        oom_at = await h.sink_now()
        with pytest.raises(OutOfMemoryError):
            await h.client.ensure("devices", b"dev-new")
        # Six more renewals at the limit (2T of rounds): nothing may stop.
        await h.wait_renewals([a, b], count=7)
        ev = await h.events()
        assert not [e for e in ev if e.action == "cancelled" and e.token in old]
        assert not [e for e in ev if e.action == "id" and e.t > oom_at]  # no rejoin
        acting = {e.token for e in ev if e.action == "act" and e.t > oom_at + TTL}
        assert acting == old  # the same owners go on acting at the limit
        assert a.alive and b.alive
        await h.conn.execute("CONFIG", "SET", "maxmemory", "0")
        await h.client.ensure("devices", b"dev-new")
        await wait_until(
            lambda: owned_by_live_workers(h, [*devices, b"dev-new"]), 5 * TTL, "all owned"
        )
    assert mon.violations == []
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1
    figure("oom", ttl=TTL, acting_owners=len(acting), cancelled=0)
