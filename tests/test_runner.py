"""The queue runner on a connection of its own, with no heartbeat or pub/sub
around it: a finish report and the next claim go out in one write, and
every guarantee of the runner holds when the two travel together (finish
first, each reply taken on its own, a lost reply re-checked, a nudge kept,
outcomes in hand finished when the runner stops)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

import mesh
from mesh import Process
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh._runner import HERD, QueueConfig, QueueRunner
from mesh._scripts import Binding
from mesh._stats import QueueCounters
from mesh.testing import RedisServer, wait_until

from .faults.proxy import Proxy
from .protocol_helpers import expire_worker, join, snapshot

Q = "jobs"
OOM = "return redis.error_reply('OOM command not allowed when used memory > maxmemory')"
Hook = Callable[[Sequence[Sequence[Any]], bool], Awaitable[list[Any]]]


class Tap:
    """A connection whose pipelines (the runner's finish-and-claim round
    trips) a test can intercept; everything else passes through."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.config = conn.config
        self.hook: Hook | None = None
        self.sent: list[Sequence[Any]] = []

    async def execute(self, *args: Any) -> Any:
        self.sent.append(args)
        return await self.conn.execute(*args)

    async def pipeline(
        self, commands: Sequence[Sequence[Any]], *, raise_on_error: bool = True
    ) -> list[Any]:
        self.sent.extend(commands)
        if self.hook is not None:
            return await self.hook(commands, raise_on_error)
        return await self.conn.pipeline(commands, raise_on_error=raise_on_error)


class Setup:
    def __init__(self, namespace: str, conn: Connection) -> None:
        self.keys = Keys(namespace)
        self.b = Binding(self.keys)
        self.conn = conn  # the test's own, never the runner's
        self.inc = ""
        self.fenced: list[str] = []

    async def join(self, *tasks: bytes) -> None:
        self.inc = await join(self.b, self.conn, "w1", Q)
        # cached, so that no NOSCRIPT detour changes what the runner sends
        for script in self.b.scripts.values():
            await self.conn.execute("SCRIPT", "LOAD", script.source)
        if tasks:
            await self.b.enqueue(self.conn, Q, list(tasks))

    def finish_sha(self) -> str:
        return self.b.scripts["finish"].sha

    @asynccontextmanager
    async def running(
        self,
        conn: Connection | Tap,
        handler: Callable[[Process], Awaitable[None]],
        *,
        concurrency: int = 1,
    ) -> AsyncIterator[QueueRunner]:
        config = QueueConfig(Q, handler, concurrency, 0, 0.01, 0.01)
        runner = QueueRunner(
            conn,  # type: ignore[arg-type]
            self.b,
            "w1",
            self.inc,
            config,
            QueueCounters(),
            self.fenced.append,
            balance_wait=30.0,  # far beyond any test: a held-back task stays held back
            ttl=60.0,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            try:
                yield runner
            finally:
                await runner.stop()

    async def drained(self) -> bool:
        s = await snapshot(self.conn, self.keys, Q, ["w1"])
        return bool(s["queue"] == [] and s["procs"] == {} and s["held"]["w1"] == set())


@pytest.fixture
async def setup(redis_url: str, namespace: str) -> AsyncIterator[Setup]:
    async with open_connection(redis_url) as conn:
        yield Setup(namespace, conn)


class Ran:
    """A handler that records what it ran; tasks named in ``hold`` wait for
    ``release`` (then call ``then``), those in ``forever`` never return."""

    def __init__(self, *hold: bytes, forever: tuple[bytes, ...] = ()) -> None:
        self.tasks: list[bytes] = []
        self.hold = set(hold)
        self.forever = set(forever)
        self.release = trio.Event()
        self.then: Callable[[], None] = lambda: None

    async def __call__(self, p: Process) -> None:
        self.tasks.append(p.task)
        if p.task in self.forever:
            await trio.sleep_forever()
        if p.task in self.hold:
            await self.release.wait()
            self.then()


async def test_a_finish_and_the_next_claim_share_one_write(setup: Setup, redis_url: str) -> None:
    await setup.join(b"t1", b"t2", b"t3")
    ran = Ran()
    async with open_connection(redis_url) as conn, setup.running(conn, ran) as runner:
        await wait_until(lambda: runner._counters.finished == 3)

        async def idle() -> bool:
            return bool(await setup.conn.execute("SMEMBERS", setup.keys.idle(Q)) == [b"w1"])

        await wait_until(idle, what="the last claim put the runner in the idle set")
        await trio.sleep(0.05)  # nothing more is sent
        stats = conn.statistics()
    assert ran.tasks == [b"t1", b"t2", b"t3"]
    # claim t1; finish t1 + claim t2; finish t2 + claim t3; finish t3 + a
    # claim that finds nothing: each claim took all it asked for, so the
    # runner was not in the idle set (nobody would have woken it) and looks
    # again when a slot frees. The last one put it there.
    assert (stats.commands_sent, stats.writes) == (7, 4)
    assert await setup.drained()


async def test_a_slot_freed_by_the_finish_is_claimed_in_the_same_write(
    setup: Setup, redis_url: str
) -> None:
    await setup.join()
    await join(setup.b, setup.conn, "w2", Q)  # an idle peer: a fair share of 1 each
    await setup.b.ensure(setup.conn, Q, [b"d1", b"d2"])
    ran = Ran(b"d1", forever=(b"d2",))
    async with open_connection(redis_url) as conn, setup.running(conn, ran, concurrency=2) as r:
        await wait_until(lambda: ran.tasks == [b"d1"])
        # d2 is left to the peer (no one else wakes this runner for 30 s)
        assert (await snapshot(setup.conn, setup.keys, Q, []))["queue"] == [b"d2"]
        writes = conn.statistics().writes
        ran.then = r.nudge  # work is announced as d1's handler returns
        ran.release.set()
        # The finish ran first, in the same write: w1 held nothing more
        # when the claim counted its share.
        await wait_until(lambda: ran.tasks == [b"d1", b"d2"], what="d2 claimed")
        assert conn.statistics().writes == writes + 1
        assert r._counters.finished == 1


async def test_a_claim_that_went_through_starts_even_if_its_finish_was_refused(
    setup: Setup, redis_url: str
) -> None:
    await setup.join(b"t1", b"t2")
    ran = Ran(b"t2")
    async with open_connection(redis_url) as conn:
        tap = Tap(conn)
        refused: list[Sequence[Any]] = []

        async def refuse_the_finish(commands: Sequence[Sequence[Any]], roe: bool) -> list[Any]:
            if not refused and commands[0][1] == setup.finish_sha():
                refused.append(commands[0])
                commands = [("EVAL", OOM, 0), *commands[1:]]
            return await conn.pipeline(commands, raise_on_error=roe)

        tap.hook = refuse_the_finish
        async with setup.running(tap, ran) as runner:
            await wait_until(lambda: ran.tasks == [b"t1", b"t2"], what="t2 started")
            assert len(refused) == 1
            # t1 is reported again, alone (t2 holds the only slot), and finished
            await wait_until(lambda: runner._counters.finished == 1, what="t1 finished")
            s = await snapshot(setup.conn, setup.keys, Q, ["w1"])
            assert list(s["procs"]) == [pid.encode() for pid in runner.running]  # t2's
            ran.release.set()
            await wait_until(lambda: runner._counters.finished == 2)
    assert ran.tasks == [b"t1", b"t2"]
    assert await setup.drained()


async def test_a_finish_that_went_through_is_not_sent_again_if_its_claim_was_refused(
    setup: Setup, redis_url: str
) -> None:
    await setup.join(b"t1", b"t2")
    ran = Ran()
    async with open_connection(redis_url) as conn:
        tap = Tap(conn)
        refused: list[Sequence[Any]] = []

        async def refuse_the_claim(commands: Sequence[Sequence[Any]], roe: bool) -> list[Any]:
            if not refused and len(commands) == 2:
                refused.append(commands[1])
                commands = [commands[0], ("EVAL", OOM, 0)]
            return await conn.pipeline(commands, raise_on_error=roe)

        tap.hook = refuse_the_claim
        async with setup.running(tap, ran) as runner:
            # the claim is retried (after a short backoff) and t2 runs
            await wait_until(lambda: runner._counters.finished == 2)
    assert len(refused) == 1
    assert ran.tasks == [b"t1", b"t2"]
    finishes = [c for c in tap.sent if c[0] == "EVALSHA" and c[1] == setup.finish_sha()]
    assert len(finishes) == 2  # t1's once, t2's once
    assert await setup.drained()


async def test_a_fenced_claim_beside_a_finish_fences_the_runner(
    setup: Setup, redis_url: str
) -> None:
    await setup.join(b"t1", b"t2")
    ran = Ran(b"t1")
    async with open_connection(redis_url) as conn, setup.running(conn, ran) as runner:
        await wait_until(lambda: ran.tasks == [b"t1"])
        await expire_worker(setup.conn, setup.keys, "w1")
        writes = conn.statistics().writes
        ran.release.set()  # finish t1 + claim t2 (more was queued), one write
        with trio.fail_after(5):
            await runner._exited.wait()  # the loop ended on its own
        assert conn.statistics().writes == writes + 1
    assert len(setup.fenced) == 1 and "no lease" in setup.fenced[0]
    assert runner._counters.finished == 0  # the lease was gone: nothing changed
    s = await snapshot(setup.conn, setup.keys, Q, ["w1"])
    assert s["queue"] == [b"t2"] and len(s["procs"]) == 1  # t1's, for a peer's recycle


async def test_a_lost_reply_to_a_finish_and_claim_is_rechecked(
    setup: Setup, redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    await setup.join(b"t1", b"t2", b"t3")
    proxy = Proxy(redis_server.port)
    await nursery.start(proxy.run)
    ran = Ran()
    lost = proxy.lose_reply_to(setup.finish_sha().encode())
    async with open_connection(proxy.url) as conn, setup.running(conn, ran) as runner:
        with trio.fail_after(5):
            await lost.wait()
        # t2's claim ran with t1's finish and its reply was lost: the runner
        # re-checks what it holds, hands t2 back, and claims it again
        await wait_until(setup.drained, what="every task finished")
        assert conn.statistics().reconnects == 1
        assert runner.running == {}
    assert proxy.lost_replies == 1
    assert ran.tasks == [b"t1", b"t2", b"t3"]  # each once: the lost claim never ran


async def test_a_nudge_during_a_finish_and_claim_is_kept(setup: Setup, redis_url: str) -> None:
    await setup.join(b"t1", b"t2")
    ran = Ran()
    async with open_connection(redis_url) as conn:
        tap = Tap(conn)
        box: list[QueueRunner] = []

        async def announce_after_redis_ran_it(
            commands: Sequence[Sequence[Any]], roe: bool
        ) -> list[Any]:
            replies = await conn.pipeline(commands, raise_on_error=roe)
            if tap.hook is not None:
                tap.hook = None
                # the claim took t2 and left the queue empty; t3 is
                # announced before its reply arrives
                await setup.b.enqueue(setup.conn, Q, [b"t3"])
                box[0].nudge()
            return replies

        tap.hook = announce_after_redis_ran_it
        async with setup.running(tap, ran) as runner:
            box.append(runner)
            # nothing else would wake this runner: no heartbeat, no pub/sub
            await wait_until(lambda: ran.tasks == [b"t1", b"t2", b"t3"], what="t3 taken")
            await wait_until(lambda: runner._counters.finished == 3)
    assert await setup.drained()


async def test_an_unsent_finish_is_sent_when_the_runner_stops(setup: Setup, redis_url: str) -> None:
    await setup.join(b"t1", b"t2")
    ran = Ran()
    async with open_connection(redis_url) as conn:
        tap = Tap(conn)
        stuck = trio.Event()

        async def never_sent(commands: Sequence[Sequence[Any]], roe: bool) -> list[Any]:
            stuck.set()
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        tap.hook = never_sent
        async with setup.running(tap, ran) as runner:
            with trio.fail_after(5):
                await stuck.wait()  # finish t1 + claim t2, held before the write
            await runner.stop()
    # t1's outcome was in hand: finished on the way out, not left to be
    # handed back (and run again); t2 was never claimed
    assert runner._counters.finished == 1
    s = await snapshot(setup.conn, setup.keys, Q, ["w1"])
    assert s["procs"] == {} and s["queue"] == [b"t2"]


async def test_about_herd_idle_servers_act_on_a_retry_due_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every idle server hears a delayed task's due time in its heartbeat;
    each acts with probability HERD / idle servers, drawn once per due time
    (the same due time comes in every heartbeat until then)."""
    config = QueueConfig(Q, None, 1, 0, 0.01, 0.01)
    r = QueueRunner(None, Binding(Keys("x")), "w1", "i", config, QueueCounters(), print)  # type: ignore[arg-type]
    draws = iter([0.5, 0.001])
    monkeypatch.setattr(random, "random", lambda: next(draws))
    r.retry_due(1_000, 5.0, 300)  # 0.5 x 300 >= HERD: leaves it to others
    r.retry_due(1_000, 4.0, 300)  # the same due time: no new draw
    assert r._next_due == float("inf")
    t = trio.current_time()
    r.retry_due(2_000, 5.0, 300)  # 0.001 x 300 < HERD: acts
    assert t + 5.0 <= r._next_due <= trio.current_time() + 5.0
    r = QueueRunner(None, Binding(Keys("x")), "w1", "i", config, QueueCounters(), print)  # type: ignore[arg-type]
    r.retry_due(3_000, 1.0, HERD)  # few idle servers: every one acts, nothing drawn
    assert r._next_due < float("inf")


# --- outcomes in hand when the runner stops (a handler that returned just
# before its worker left, or stopped serving the queue, has its process
# reported finished, not handed back: its task used to run a second time)


async def test_leaving_reports_what_already_finished(redis_url: str, namespace: str) -> None:
    send, receive = trio.open_memory_channel[bytes](10)

    async def report(p: mesh.Process) -> None:
        await send.send(p.task)  # the caller leaves as soon as it sees this

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.start_work("reports", report, concurrency=4)
        await worker.client.enqueue_many("reports", ["daily", "weekly"])
        got = {await receive.receive(), await receive.receive()}
    assert got == {b"daily", b"weekly"}
    assert worker.statistics().processes_finished == 2
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        info = await client.queue_info("reports")
    assert (info.queued, info.running, info.delayed) == (0, 0, 0)


async def test_stop_work_reports_what_already_finished(redis_url: str, namespace: str) -> None:
    send, receive = trio.open_memory_channel[bytes](10)

    async def report(p: mesh.Process) -> None:
        await send.send(p.task)

    async def fail(p: mesh.Process) -> None:
        await send.send(p.task)
        raise RuntimeError("this attempt fails")

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        # The runner's own reports hang until stop_work cancels them, so the
        # outcomes are still unreported when the runners stop.
        binding = worker._binding
        real_finish, real_give_back = binding.finish, binding.give_back
        real_finish_and_claim = binding.finish_and_claim
        hung: set[str] = set()

        async def finish(*args: Any, **kwargs: Any) -> Any:
            if "finish" not in hung:
                hung.add("finish")
                await trio.sleep_forever()
            return await real_finish(*args, **kwargs)

        async def finish_and_claim(*args: Any, **kwargs: Any) -> Any:
            # a report that goes out with the next claim (work was announced)
            if "finish" not in hung:
                hung.add("finish")
                await trio.sleep_forever()
            return await real_finish_and_claim(*args, **kwargs)

        async def give_back(*args: Any, **kwargs: Any) -> Any:
            if "give_back" not in hung:
                hung.add("give_back")
                await trio.sleep_forever()
            return await real_give_back(*args, **kwargs)

        binding.finish = finish  # type: ignore[method-assign]
        binding.finish_and_claim = finish_and_claim  # type: ignore[method-assign]
        binding.give_back = give_back  # type: ignore[method-assign]

        await worker.start_work("reports", report)
        await worker.start_work("flaky", fail, backoff=30.0, backoff_max=30.0)
        await worker.client.enqueue("reports", "daily")
        await worker.client.enqueue("flaky", "once")
        assert {await receive.receive(), await receive.receive()} == {b"daily", b"once"}
        await wait_until(lambda: hung == {"finish", "give_back"}, what="both reports hung")
        assert await worker.stop_work("reports") == 0
        assert await worker.stop_work("flaky") == 0
        reports = await worker.client.queue_info("reports")
        flaky = await worker.client.queue_info("flaky")
    assert (reports.queued, reports.running) == (0, 0)
    # the failed attempt counts: the task waits for its backoff
    assert (flaky.queued, flaky.running, flaky.delayed) == (0, 0, 1)
