"""Stopping without two owners (invariant 10), in one process against a real
redis-server: a worker that stops (leaving its block, or stop_work) keeps
renewing its lease while its cancelled handlers clean up, and hands each
process back only once its handler has exited, with no attempt counted.

The peer's start is compared with the old handler's exit on trio's clock of
this one process: both workers run here, so one clock orders them."""

from __future__ import annotations

import logging

import anyio
import pytest

import mesh
from mesh import Process
from mesh._connection import open_connection
from mesh.testing import wait_heartbeats, wait_until

pytestmark = pytest.mark.both_loops

TTL = 0.9  # H = 0.3 s, R = 0.6 s; the cleanups below outlast T


class SlowStop:
    """Handlers whose cancellation takes ``cleanup`` seconds (shielded), and
    that record when each started and when each exited (trio's clock)."""

    def __init__(self, cleanup: float, spread: float = 0.0) -> None:
        self.cleanup = cleanup
        self.spread = spread  # and the n-th handler started n * spread s more
        self.starts: list[tuple[Process, float]] = []
        self.exits: list[tuple[Process, float]] = []

    async def handler(self, p: Process) -> None:
        n = len(self.starts)
        self.starts.append((p, anyio.current_time()))
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(self.cleanup + n * self.spread)
            self.exits.append((p, anyio.current_time()))

    def started(self, task: bytes, worker: str) -> list[float]:
        return [t for p, t in self.starts if p.task == task and p.worker_id == worker]


async def test_leaving_waits_for_a_slow_cleanup_then_hands_back_without_an_attempt(
    redis_url: str, namespace: str
) -> None:
    old, new = SlowStop(2.0), SlowStop(0.0)
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure("devices", "d1")
        await client.enqueue("jobs", "j1")
        async with anyio.create_task_group() as nursery:
            a_left = anyio.Event()
            leave_a = anyio.Event()
            a_id = ""
            a_worker: list[mesh.Worker] = []

            async def run_a() -> None:
                nonlocal a_id
                async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as a:
                    a_id = a.id
                    a_worker.append(a)
                    await a.start_work("devices", old.handler)
                    await a.start_work("jobs", old.handler, max_attempts=1)
                    await leave_a.wait()
                a_left.set()

            nursery.start_soon(run_a)
            await wait_until(lambda: _true(len(old.starts) == 2), what="A runs both tasks")
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as b:
                await b.start_work("devices", new.handler)
                await b.start_work("jobs", new.handler, max_attempts=1)
                leave_a.set()
                # Past T (five renewals span four intervals, 1.1 s or more),
                # A's cleanups still run: A still holds both tasks and renews
                # its lease, so B has started nothing.
                await wait_heartbeats(*a_worker, count=5)
                assert not new.starts
                assert {p.worker_id for p in await client.processes()} == {a_id}
                assert a_id in {w.id for w in await client.workers()}
                await wait_until(lambda: _true(len(new.starts) == 2), what="B takes both")
                await a_left.wait()
                exits = {p.task: t for p, t in old.exits}
                for p, started in new.starts:
                    # B started each task only after A's handler had exited
                    assert started > exits[p.task]
                    assert p.worker_id == b.id
                    assert p.attempts == 0  # no attempt counted by the stop
                    assert started - exits[p.task] < TTL / 2  # at once, not after T
                assert await client.dead_letters("jobs") == []


async def test_stop_work_waits_for_a_slow_cleanup_before_handing_back(
    redis_url: str, namespace: str
) -> None:
    old, new = SlowStop(1.5), SlowStop(0.0)
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure("devices", "d1")
        async with (
            mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as a,
            mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as b,
        ):
            await a.start_work("devices", old.handler)
            await wait_until(lambda: _true(len(old.starts) == 1), what="A runs d1")
            await b.start_work("devices", new.handler)
            assert await a.stop_work("devices") == 1
            (_, exited) = old.exits[0]
            assert anyio.current_time() >= exited
            await wait_until(lambda: _true(len(new.starts) == 1), what="B takes d1")
            (p, started) = new.starts[0]
            assert p.worker_id == b.id and started > exited and p.attempts == 0
            # A is still a live worker, and no longer a server of the queue
            assert a.id in {w.id for w in await client.workers()}
            info = {w.id: w for w in await client.workers()}[a.id]
            assert "devices" not in info.queues


async def test_a_handler_that_outlives_the_grace_is_left_to_the_lease(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Past stop_grace the worker stops renewing: the task is taken over only
    when the lease ran out (T after the last renewal), as after a crash, and
    that counts a failed attempt. Until then no peer starts it."""
    old, new = SlowStop(TTL * 3), SlowStop(0.0)
    caplog.set_level(logging.WARNING, logger="mesh")
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as b,
    ):
        stop_at = 0.0
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL, stop_grace=0.2) as a:
            await a.start_work("jobs", old.handler, max_attempts=3)
            await client.enqueue("jobs", "j1")
            await wait_until(lambda: _true(len(old.starts) == 1), what="A runs j1")
            await b.start_work("jobs", new.handler, max_attempts=3)
            stop_at = anyio.current_time()
        (_, exited) = old.exits[0]
        assert exited - stop_at >= TTL * 3  # leaving waited for the handler
        await wait_until(lambda: _true(len(new.starts) == 1), what="B takes j1")
        (p, started) = new.starts[0]
        # not while the lease could be live (renewed at most H = T/3 before
        # the stop began, or during the grace); counted as a crash
        assert started - stop_at > TTL - TTL / 3
        assert p.attempts == 1
        assert "after the stop grace" in caplog.text


@pytest.mark.parametrize("leave", ["normally", "by cancellation"])
async def test_a_large_stop_hands_back_group_by_group(
    redis_url: str, namespace: str, leave: str
) -> None:
    """A worker that stops with 1,000 handlers cancels them a group at a
    time and hands each group back while the next one exits: a peer starts
    the first tasks before the last of the old handlers has even been
    cancelled (before, all 1,000 exited first, then went back together), and
    still never before a task's own old handler exited. The same when the
    block is cancelled from outside (before, the cancellation reached every
    handler at once)."""
    n = 1000  # (TTL 3 s: 1,000 handler starts on a loaded machine must not fence A)
    # The old handlers' cleanups take 0 to 1 s (1 ms more each), so that the
    # last exits a second after the first: on a loaded machine, B's first
    # start, a wake and a claim after the first group went back, must not
    # have to race 1,000 instant exits.
    old, new = SlowStop(0.0, spread=0.001), SlowStop(0.0)
    exited_at_first_start: list[int] = []

    async def peer(p: Process) -> None:
        if not exited_at_first_start:
            exited_at_first_start.append(len(old.exits))
        await new.handler(p)

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure_many("devices", [f"d{i}" for i in range(n)])
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=3) as b:
            with anyio.CancelScope() as scope:
                async with mesh.open_worker(redis_url, namespace=namespace, ttl=3) as a:
                    await a.start_work("devices", old.handler, concurrency=n)
                    await wait_until(lambda: _true(len(old.starts) == n), what="A runs all")
                    # B takes only what is handed back (no pull for balance)
                    await b.start_work("devices", peer, concurrency=n, rebalance=False)
                    if leave == "by cancellation":
                        scope.cancel()
                        await anyio.sleep_forever()
            await wait_until(lambda: _true(len(new.starts) == n), what="B takes all")
        assert len(old.exits) == n
        assert exited_at_first_start[0] < n, exited_at_first_start
        exits = {p.task: t for p, t in old.exits}
        for p, started in new.starts:
            assert started >= exits[p.task]
            assert p.attempts == 0


async def test_slow_cleanups_in_the_first_group_hold_up_no_other_handler(
    redis_url: str, namespace: str
) -> None:
    """The stop cancels the next group of handlers at the latest a few ms
    after the one before, whatever became of it: handlers behind a group of
    slow cleanups are cancelled at once all the same."""
    n, slow = 250, 150  # the first group (100) and half of the next are slow
    exits: dict[bytes, float] = {}
    starts: list[bytes] = []

    async def handler(p: Process) -> None:
        starts.append(p.task)
        try:
            await anyio.sleep_forever()
        finally:
            if starts.index(p.task) < slow:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(1.0)
            exits[p.task] = anyio.current_time()

    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure_many("devices", [f"d{i}" for i in range(n)])
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as a:
            await a.start_work("devices", handler, concurrency=n)
            await wait_until(lambda: _true(len(starts) == n), what="A runs all")
            stop_at = anyio.current_time()
        fast = [exits[t] - stop_at for t in starts[slow:]]
        late = [exits[t] - stop_at for t in starts[:slow]]
        assert len(fast) == n - slow and max(fast) < 0.3
        assert min(late) >= 1.0
        assert await client.queue_length("devices") == n  # every one handed back


async def test_a_stop_cancels_every_group_in_time_while_redis_does_not_answer(
    redis_url: str, namespace: str
) -> None:
    """The stop's groups are cancelled by time too, not only as the loop
    hands groups back: with Redis asleep (DEBUG SLEEP) when the stop begins,
    so that nothing can be handed back yet, every handler of three groups is
    still cancelled within a few STOP_PACE, not when Redis answers again.
    (Redis sleeps 2 s so that "before it answers" has room under load: a
    full run on 2 cores took 0.41 s to cancel the 300, against 0.3 s allowed
    when Redis slept 0.6 s.)"""
    n = 300
    runs = SlowStop(0.0)
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        open_connection(redis_url) as other,
    ):
        await client.ensure_many("devices", [f"d{i}" for i in range(n)])
        async with anyio.create_task_group() as nursery:
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=3) as a:
                await a.start_work("devices", runs.handler, concurrency=n)
                await wait_until(lambda: _true(len(runs.starts) == n), what="A runs all")
                nursery.start_soon(other.execute, "DEBUG", "SLEEP", "2")
                # Not observable from here (Redis answers nobody while it
                # sleeps): give the DEBUG SLEEP a moment to reach it.
                await anyio.sleep(0.05)
                stop_at = anyio.current_time()
        assert len(runs.exits) == n
        # Redis woke 1.95 s after the stop began: every handler had been
        # cancelled well before it (by time, not by its answer)
        assert max(t for _, t in runs.exits) - stop_at < 1.0
        assert await client.queue_length("devices") == n  # all handed back then


@pytest.mark.parametrize("how", ["worker", "fleet"])
async def test_a_block_cancelled_from_outside_keeps_its_lease_while_a_slow_cleanup_runs(
    redis_url: str, namespace: str, how: str
) -> None:
    """Leaving the block by a cancellation from outside (the trio way to stop
    a service) stops as leaving it normally does: the lease is renewed while
    the cancelled handler cleans up for longer than T, and the task is handed
    back only after the handler exited, with no attempt counted. Before,
    the cancellation stopped the heartbeat with everything else: the lease ran
    out after T, and a peer started the task while the old handler still
    ran (invariant 10), counted as a crash."""
    old, new = SlowStop(2.0), SlowStop(0.0)
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        await client.ensure("devices", "d1")
        async with anyio.create_task_group() as nursery:
            scope = anyio.CancelScope()
            a_left = anyio.Event()
            a_worker: list[mesh.Worker] = []

            async def run_a() -> None:
                with scope:
                    if how == "fleet":
                        async with (
                            mesh.open_fleet(redis_url, namespace=namespace, ttl=TTL) as fleet,
                            fleet.open_worker() as a,
                        ):
                            a_worker.append(a)
                            await a.start_work("devices", old.handler)
                            await anyio.sleep_forever()
                    else:
                        async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as a:
                            a_worker.append(a)
                            await a.start_work("devices", old.handler)
                            await anyio.sleep_forever()
                a_left.set()

            nursery.start_soon(run_a)
            await wait_until(lambda: _true(len(old.starts) == 1), what="A runs the task")
            async with mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as b:
                await b.start_work("devices", new.handler)
                scope.cancel()
                # Past T (five renewals span four intervals, 1.1 s or more):
                # A's cleanup still runs and its lease is renewed, B starts nothing.
                await wait_heartbeats(*a_worker, count=5)
                assert not new.starts
                await wait_until(lambda: _true(len(new.starts) == 1), what="B takes it")
                await a_left.wait()
        (p, started), exited = new.starts[0], old.exits[0][1]
        assert started > exited
        assert started - exited < TTL / 2  # handed back at once, not left to T
        assert p.attempts == 0


async def test_stop_grace_is_checked() -> None:
    for bad in (-1, float("nan"), float("inf"), "1", True):
        with pytest.raises(mesh.ConfigError, match="stop_grace"):
            async with mesh.open_worker("redis://127.0.0.1:1", stop_grace=bad):  # type: ignore[arg-type]
                pass


async def _true(v: bool) -> bool:
    return v


async def test_rejoin_grace_needs_a_worker_id() -> None:
    with pytest.raises(mesh.ConfigError, match="rejoin_grace needs a stable worker_id"):
        async with mesh.open_worker("redis://127.0.0.1:1", rejoin_grace=5):
            pass
    with pytest.raises(mesh.ConfigError, match="rejoin_grace must be"):
        async with mesh.open_worker("redis://127.0.0.1:1", worker_id="a", rejoin_grace=-1):
            pass
