"""The queue runner on a connection of its own, with no heartbeat or pub/sub
around it: a finish report and the next claim go out in one write, and
every guarantee of the runner holds when the two travel together (finish
first, each reply taken on its own, a lost reply re-checked, a nudge kept,
outcomes in hand finished when the runner stops)."""

from __future__ import annotations

import contextvars
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
import trio.testing

import mesh
from mesh import Process
from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._harness.proxy import Proxy
from mesh._keys import Keys
from mesh._pool import START_CHUNK
from mesh._queue_config import QueueConfig
from mesh._runner import QueueRunner
from mesh._runner_core import HERD
from mesh._stats import QueueCounters
from mesh.testing import RedisServer, wait_until

from .protocol_helpers import expire_worker, join, snapshot

pytestmark = pytest.mark.both_loops

Q = "jobs"
OOM = "return redis.error_reply('OOM command not allowed when used memory > maxmemory')"
Hook = Callable[[Sequence[Sequence[Any]], bool], Awaitable[list[Any]]]


class Tap:
    """A connection whose commands and pipelines (the runner's
    finish-and-claim round trips: one ``finish_claim.lua`` call, or with
    results kept a pipeline of ``finish_results.lua`` and ``claim.lua``) a
    test can intercept; everything else passes through."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.config = conn.config
        self.hook: Hook | None = None
        self.sent: list[Sequence[Any]] = []

    async def execute(self, *args: Any) -> Any:
        self.sent.append(args)
        if self.hook is not None:
            return (await self.hook([args], True))[0]
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

    def finish_sha(self, name: str = "finish_claim") -> str:
        return self.b.scripts[name].sha

    @asynccontextmanager
    async def running(
        self,
        conn: Connection | Tap,
        handler: Callable[[Process], Awaitable[None]],
        *,
        concurrency: int = 1,
        result_ttl: float = 0.0,
        prefetch: int | None = 0,  # these tests count round trips: serial unless asked
    ) -> AsyncIterator[QueueRunner]:
        config = QueueConfig(
            Q, handler, concurrency, 0, 0.01, 0.01, result_ttl=result_ttl, prefetch=prefetch
        )
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
        async with anyio.create_task_group() as nursery:
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
        self.release = anyio.Event()
        self.then: Callable[[], None] = lambda: None

    async def __call__(self, p: Process) -> None:
        self.tasks.append(p.task)
        if p.task in self.forever:
            await anyio.sleep_forever()
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
        await anyio.sleep(0.05)  # a deliberate window: nothing more is sent
        stats = conn.statistics()
    assert ran.tasks == [b"t1", b"t2", b"t3"]
    # claim t1; finish t1 + claim t2; finish t2 + claim t3; finish t3 + a
    # claim that finds nothing, each finish and claim one script call
    # (finish_claim.lua): each claim took all it asked for, so the runner
    # was not in the idle set (nobody would have woken it) and looks again
    # when a slot frees. The last one put it there.
    assert (stats.commands_sent, stats.writes) == (4, 4)
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
    # results kept: the finish (finish_results.lua) and the claim are two
    # calls in one write, each taken on its own
    await setup.join(b"t1", b"t2")
    ran = Ran(b"t2")
    async with open_connection(redis_url) as conn:
        tap = Tap(conn)
        refused: list[Sequence[Any]] = []

        async def refuse_the_finish(commands: Sequence[Sequence[Any]], roe: bool) -> list[Any]:
            if not refused and commands[0][1] == setup.finish_sha("finish_results"):
                refused.append(commands[0])
                commands = [("EVAL", OOM, 0), *commands[1:]]
            return await conn.pipeline(commands, raise_on_error=roe)

        tap.hook = refuse_the_finish
        async with setup.running(tap, ran, result_ttl=60.0) as runner:
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
        async with setup.running(tap, ran, result_ttl=60.0) as runner:
            # the claim is retried (after a short backoff) and t2 runs
            await wait_until(lambda: runner._counters.finished == 2)
    assert len(refused) == 1
    assert ran.tasks == [b"t1", b"t2"]
    sha = setup.finish_sha("finish_results")
    finishes = [c for c in tap.sent if c[0] == "EVALSHA" and c[1] == sha]
    assert len(finishes) == 2  # t1's once, t2's once
    assert await setup.drained()


async def test_a_refused_finish_and_claim_is_sent_again_whole(setup: Setup, redis_url: str) -> None:
    # one finish_claim.lua call: refused, neither ran, and both go again
    await setup.join(b"t1", b"t2")
    ran = Ran()
    async with open_connection(redis_url) as conn:
        tap = Tap(conn)
        refused: list[Sequence[Any]] = []

        async def refuse_once(commands: Sequence[Sequence[Any]], roe: bool) -> list[Any]:
            if not refused and commands[0][1] == setup.finish_sha():
                refused.append(commands[0])
                commands = [("EVAL", OOM, 0)]
            return await conn.pipeline(commands, raise_on_error=roe)

        tap.hook = refuse_once
        async with setup.running(tap, ran) as runner:
            await wait_until(lambda: runner._counters.finished == 2)
    assert len(refused) == 1
    assert ran.tasks == [b"t1", b"t2"]  # each once
    sent = [c for c in tap.sent if c[0] == "EVALSHA" and c[1] == setup.finish_sha()]
    assert [c[-1] for c in sent[:2]] == [c[-1] for c in refused] * 2  # t1's finish, again
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
        with anyio.fail_after(5):
            await runner._exited.wait()  # the loop ended on its own
        assert conn.statistics().writes == writes + 1
    assert len(setup.fenced) == 1 and "no lease" in setup.fenced[0]
    assert runner._counters.finished == 0  # the lease was gone: nothing changed
    s = await snapshot(setup.conn, setup.keys, Q, ["w1"])
    assert s["queue"] == [b"t2"] and len(s["procs"]) == 1  # t1's, for a peer's recycle


async def test_a_lost_reply_to_a_finish_and_claim_is_rechecked(
    setup: Setup, redis_server: RedisServer
) -> None:
    await setup.join(b"t1", b"t2", b"t3")
    proxy = Proxy(redis_server.port)
    ran = Ran()
    async with anyio.create_task_group() as nursery:
        await nursery.start(proxy.run)
        lost = proxy.lose_reply_to(setup.finish_sha().encode())
        async with open_connection(proxy.url) as conn, setup.running(conn, ran) as runner:
            with anyio.fail_after(5):
                await lost.wait()
            # t2's claim ran with t1's finish and its reply was lost: the runner
            # re-checks what it holds, hands t2 back, and claims it again
            await wait_until(setup.drained, what="every task finished")
            assert conn.statistics().reconnects == 1
            assert runner.running == {}
        nursery.cancel_scope.cancel()
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
        stuck = anyio.Event()

        async def never_sent(commands: Sequence[Sequence[Any]], roe: bool) -> list[Any]:
            if stuck.is_set() or commands[0][1] != setup.finish_sha():
                # the first claim, and the report on the way out, go through
                return await conn.pipeline(commands, raise_on_error=roe)
            stuck.set()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        tap.hook = never_sent
        async with setup.running(tap, ran) as runner:
            with anyio.fail_after(5):
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
    assert r._core.next_due == float("inf")
    t = anyio.current_time()
    r.retry_due(2_000, 5.0, 300)  # 0.001 x 300 < HERD: acts
    assert t + 5.0 <= r._core.next_due <= anyio.current_time() + 5.0
    r = QueueRunner(None, Binding(Keys("x")), "w1", "i", config, QueueCounters(), print)  # type: ignore[arg-type]
    r.retry_due(3_000, 1.0, HERD)  # few idle servers: every one acts, nothing drawn
    assert r._core.next_due < float("inf")


# --- outcomes in hand when the runner stops (a handler that returned just
# before its worker left, or stopped serving the queue, has its process
# reported finished, not handed back: its task used to run a second time)


async def test_leaving_reports_what_already_finished(redis_url: str, namespace: str) -> None:
    send, receive = anyio.create_memory_object_stream[bytes](10)

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
    send, receive = anyio.create_memory_object_stream[bytes](10)

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
                await anyio.sleep_forever()
            return await real_finish(*args, **kwargs)

        async def finish_and_claim(*args: Any, **kwargs: Any) -> Any:
            # a report that goes out with the next claim (work was announced)
            if "finish" not in hung:
                hung.add("finish")
                await anyio.sleep_forever()
            return await real_finish_and_claim(*args, **kwargs)

        async def give_back(*args: Any, **kwargs: Any) -> Any:
            if "give_back" not in hung:
                hung.add("give_back")
                await anyio.sleep_forever()
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


# --- the handler pool: long-lived handler trio tasks, each handler still in
# a cancel scope only its own process reaches


async def test_the_pool_runs_at_most_concurrency_handlers_at_once(
    redis_url: str, namespace: str
) -> None:
    now = peak = 0
    ran: list[bytes] = []

    async def handler(p: mesh.Process) -> None:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        await anyio.sleep(0.001 * random.random())
        ran.append(p.task)
        now -= 1

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.start_work(Q, handler, concurrency=3)
        await worker.client.enqueue_many(Q, [b"%d" % i for i in range(40)])
        await wait_until(lambda: worker.statistics().processes_finished == 40, within=10)
    assert peak == 3 and sorted(ran) == sorted(b"%d" % i for i in range(40))


class _StartsPerBatch(trio.abc.Instrument):
    """Counts handler starts (``started``) per trio run batch: the stretch
    between two polls for I/O, when no socket is read."""

    def __init__(self) -> None:
        self.started = 0
        self.total = 0
        self.peak = 0

    def before_io_wait(self, timeout: float) -> None:
        self.peak = max(self.peak, self.started)
        self.started = 0


@pytest.mark.trio_only("counts trio's scheduler batches with an instrument")
async def test_a_large_claim_starts_its_handlers_without_holding_the_event_loop(
    redis_url: str, namespace: str
) -> None:
    # Two workers of one process each claim 1,000 persistent tasks at once
    # (a takeover). Started all in one trio run batch, 1,000 handlers kept
    # the loop from reading any socket for the whole batch: seconds on a
    # loaded machine, long enough for heartbeat replies to sit unread past
    # the self-fence deadline. They start START_CHUNK at a time, one large
    # claim of the process at a time, with I/O polled in between.
    counter = _StartsPerBatch()

    async def handler(p: mesh.Process) -> None:
        counter.started += 1
        counter.total += 1
        await anyio.sleep_forever()

    trio.lowlevel.add_instrument(counter)
    try:
        async with (
            mesh.open_worker(redis_url, namespace=namespace) as w1,
            mesh.open_worker(redis_url, namespace=namespace) as w2,
        ):
            for w in (w1, w2):
                await w.start_work(Q, handler, concurrency=1000)
            await w1.client.ensure_many(Q, [b"d%d" % i for i in range(2000)])
            await wait_until(lambda: counter.total == 2000, within=30)
            assert [w1.statistics().running, w2.statistics().running] == [1000, 1000]
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert 0 < counter.peak <= START_CHUNK


async def test_a_cancel_reaches_only_its_handler_and_the_next_runs_unharmed(
    redis_url: str, namespace: str
) -> None:
    # Concurrency 1: one pool trio task runs every handler, one after the
    # other. After a cancel, the next handler must not inherit the
    # cancelled scope, nor a context variable the previous handler set.
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    started = anyio.Event()
    seen: list[tuple[bytes, str]] = []
    cancelled: list[bytes] = []

    async def handler(p: mesh.Process) -> None:
        seen.append((p.task, var.get()))
        var.set(p.task.decode())
        if p.task == b"long":
            started.set()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                cancelled.append(p.task)
                raise
        await anyio.sleep(0.01)  # checkpoints: a reused cancelled scope would cancel these

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.start_work(Q, handler, concurrency=1)
        await worker.client.enqueue_many(Q, ["long", "next", "last"])
        await started.wait()
        assert await worker.client.cancel(Q, "long") == 1
        await wait_until(lambda: worker.statistics().processes_finished == 2, within=10)
        st = worker.statistics()
    assert cancelled == [b"long"] and st.processes_cancelled == 1 and st.processes_failed == 0
    assert seen == [(b"long", "unset"), (b"next", "unset"), (b"last", "unset")]


async def test_a_timeout_fails_only_its_handler_in_a_pool_trio_task(
    redis_url: str, namespace: str
) -> None:
    async def handler(p: mesh.Process) -> None:
        await anyio.sleep(30 if p.task == b"slow" else 0.1)

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.configure(Q, timeout=0.2, max_attempts=1)
        await worker.start_work(Q, handler, concurrency=1)
        await worker.client.enqueue_many(Q, ["slow"])
        await wait_until(lambda: worker.statistics().processes_failed == 1, within=10)
        # the same pool trio task, a new scope with a deadline of its own
        await worker.client.enqueue_many(Q, ["quick"])
        await wait_until(lambda: worker.statistics().processes_finished == 1, within=10)
        (d,) = await worker.client.dead_letters(Q)
    assert d.task == b"slow" and d.error == "TimeoutError: the handler ran longer than 0.2 s"


# --- batch handlers


class Batches:
    """A batch handler that records its calls; payloads in ``fail`` fail (an
    exception in its slot) on their first attempt, ``hold`` waits for
    ``release`` and ``forever`` never returns."""

    def __init__(self, fail: tuple[bytes, ...] = (), forever: bool = False) -> None:
        self.calls: list[list[bytes]] = []
        self.fail = set(fail)
        self.forever = forever
        self.started = anyio.Event()
        self.cancelled = 0

    async def __call__(self, ps: list[mesh.Process]) -> list[Any]:
        self.calls.append([p.task for p in ps])
        self.started.set()
        if self.forever:
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.cancelled += 1
                raise
        return [
            ValueError(f"bad row {p.task!r}") if p.task in self.fail and not p.attempts else p.task
            for p in ps
        ]


async def test_a_batch_handler_gets_up_to_batch_and_fails_only_what_it_marks(
    redis_url: str, namespace: str
) -> None:
    h = Batches(fail=(b"3", b"7"))
    tasks = [b"%d" % i for i in range(10)]
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.configure(Q, backoff=0.01, backoff_max=0.01, result_ttl=60)
        await worker.client.enqueue_many(Q, tasks)
        await worker.start_work(Q, batch_handler=h, batch=4)
        await wait_until(lambda: worker.statistics().processes_finished == 10, within=10)
        st = worker.statistics()
        results = [await worker.client.result(Q, t, timeout=5) for t in tasks]
        info = await worker.client.queue_info(Q)
    assert st.processes_failed == 2 and (info.queued, info.running, info.delayed) == (0, 0, 0)
    assert all(1 <= len(c) <= 4 for c in h.calls)
    runs = sorted(t for c in h.calls for t in c)
    assert runs == sorted([*tasks, b"3", b"7"])  # only the failed ones ran again
    assert results == tasks  # each process's entry is its result


async def test_a_batch_handler_that_raises_or_returns_a_bad_shape_fails_the_batch(
    redis_url: str, namespace: str
) -> None:
    async def bad(ps: list[mesh.Process]) -> list[Any]:
        if ps[0].task == b"raise":
            raise RuntimeError("bulk write refused")
        return [None]  # one entry for two processes

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.configure(Q, max_attempts=1)
        await worker.start_work(Q, batch_handler=bad, batch=2, concurrency=2)
        await worker.client.enqueue_many(Q, ["raise", "x"])
        await wait_until(lambda: worker.statistics().processes_failed == 2, within=10)
        await worker.client.enqueue_many(Q, ["a", "b"])
        await wait_until(lambda: worker.statistics().processes_failed == 4, within=10)
        dead = {d.task: d.error for d in await worker.client.dead_letters(Q)}
    assert dead[b"raise"] == dead[b"x"] == "RuntimeError: bulk write refused"
    assert dead[b"a"].startswith("TypeError: the batch handler of queue jobs returned list of 1")


async def test_a_cancel_of_one_process_of_a_batch_drops_only_it(
    redis_url: str, namespace: str
) -> None:
    release = anyio.Event()
    calls: list[list[bytes]] = []
    cancelled = 0

    async def bulk(ps: list[mesh.Process]) -> None:
        nonlocal cancelled
        calls.append([p.task for p in ps])
        try:
            await release.wait()
        except anyio.get_cancelled_exc_class():
            cancelled += 1
            raise

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        c = worker.client
        await c.enqueue_many(Q, ["a", "b", "c"])
        await worker.start_work(Q, batch_handler=bulk, batch=3)
        await wait_until(lambda: len(calls) == 1, within=10)
        assert await c.cancel(Q, "b") == 1
        await wait_until(lambda: worker.statistics().processes_cancelled == 1, within=10)
        assert cancelled == 0  # the call goes on for a and c
        release.set()
        await wait_until(lambda: worker.statistics().processes_finished == 2, within=10)
        # a cancel of every process of a call cancels the call's scope
        release = anyio.Event()
        await c.enqueue_many(Q, ["d", "e"])
        await wait_until(lambda: len(calls) == 2, within=10)
        assert await c.cancel(Q, "d") == 1 and await c.cancel(Q, "e") == 1
        await wait_until(lambda: cancelled == 1, within=10)
        await wait_until(lambda: worker.statistics().processes_cancelled == 3, within=10)
        info = await c.queue_info(Q)
    assert calls == [[b"a", b"b", b"c"], [b"d", b"e"]]
    assert (info.queued, info.running, info.delayed, info.dead) == (0, 0, 0, 0)


async def test_a_batch_call_over_its_timeout_fails_each_of_its_processes(
    redis_url: str, namespace: str
) -> None:
    h = Batches(forever=True)
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.configure(Q, timeout=0.2, max_attempts=1)
        await worker.client.enqueue_many(Q, ["a", "b"])
        await worker.start_work(Q, batch_handler=h, batch=2)
        await wait_until(lambda: worker.statistics().processes_failed == 2, within=10)
        dead = await worker.client.dead_letters(Q)
    assert h.calls == [[b"a", b"b"]] and h.cancelled == 1
    assert {d.task for d in dead} == {b"a", b"b"}
    assert {d.error for d in dead} == {"TimeoutError: the handler ran longer than 0.2 s"}


async def test_leaving_hands_a_running_batch_back_whole(redis_url: str, namespace: str) -> None:
    h = Batches(forever=True)
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.enqueue_many(Q, ["a", "b", "c"])
        await worker.start_work(Q, batch_handler=h, batch=3)
        await h.started.wait()
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        info = await client.queue_info(Q)
    assert h.cancelled == 1 and (info.queued, info.running) == (3, 0)


async def test_start_work_checks_the_batch_options(redis_url: str, namespace: str) -> None:
    h = Batches()
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        with pytest.raises(mesh.ConfigError, match="not both"):
            await worker.start_work(Q, Ran(), batch_handler=h)
        with pytest.raises(mesh.ConfigError, match="batch must be"):
            await worker.start_work(Q, batch_handler=h, batch=0)
        with pytest.raises(mesh.ConfigError, match="more than concurrency"):
            await worker.start_work(Q, batch_handler=h, batch=5, concurrency=4)
    with pytest.raises(TypeError, match="batch size"):
        mesh.Batched(h, 0)


def test_mesh_worker_loads_a_batch_handler_from_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mesh.cli._worker import load_app

    (tmp_path / "bulkapp.py").write_text(
        "import mesh\n"
        "async def rows(ps):\n    return None\n"
        "async def one(p):\n    return None\n"
        "queues = {'rows': mesh.Batched(rows, 50), 'one': one}\n"
    )
    monkeypatch.chdir(tmp_path)
    app = load_app("bulkapp:queues")
    rows = app["rows"]
    assert isinstance(rows, mesh.Batched) and rows.size == 50 and callable(app["one"])


async def test_one_finish_report_of_many_processes_finishes_each_once(setup: Setup) -> None:
    # finish.lua reads every record with one HMGET and deletes with one HDEL
    # and one SREM: a process named twice is finished once, one not ours is
    # left alone, and a retried report changes nothing.
    await setup.join(b"a", b"b", b"c")
    b, conn = setup.b, setup.conn
    ps = (await b.claim(conn, "w1", setup.inc, Q, 3, 0)).processes
    a, bb, c = (p.id for p in ps)
    assert await b.finish(conn, "w1", setup.inc, Q, [a, bb, a, "999"]) == [True, True, False, False]
    assert await b.finish(conn, "w1", setup.inc, Q, [a, bb]) == [False, False]
    s = await snapshot(conn, setup.keys, Q, ["w1"])
    assert set(s["procs"]) == {c.encode()} and s["held"]["w1"] == {c}
    assert await b.finish(conn, "w1", setup.inc, Q, [c]) == [True]
    assert await setup.drained()


async def test_a_finish_report_of_2500_processes(setup: Setup) -> None:
    # more ids than one unpack() in Lua may take at once: done in chunks
    await setup.join(*[b"%d" % i for i in range(2500)])
    b, conn = setup.b, setup.conn
    ids = []
    for _ in range(3):
        ids += [p.id for p in (await b.claim(conn, "w1", setup.inc, Q, 1000, 0)).processes]
    assert len(ids) == 2500
    assert await b.finish(conn, "w1", setup.inc, Q, ids) == [True] * 2500
    assert await setup.drained()


async def test_finish_reads_payloads_with_any_bytes(setup: Setup) -> None:
    # finish.lua parses only the head of each record, with one pattern
    odd = [b"a\0b", b"\0", b"line\nbreak\0\0", b"\xff\xfe", b"p" * 70_000]
    await setup.join(*odd)
    b, conn = setup.b, setup.conn
    ps = (await b.claim(conn, "w1", setup.inc, Q, 10, 0)).processes
    assert [p.task for p in ps] == odd
    assert await b.finish(conn, "w1", setup.inc, Q, [p.id for p in ps]) == [True] * len(odd)
    assert await setup.drained()


# --- prefetch: processes claimed beyond concurrency, waiting for a slot


@pytest.mark.trio_only("trio.testing.wait_all_tasks_blocked orders the trio tasks")
async def test_prefetch_claims_beyond_concurrency_but_runs_at_most_concurrency(
    redis_url: str, namespace: str
) -> None:
    h = Ran(*(b"%d" % i for i in range(12)))
    now = peak = 0

    async def handler(p: mesh.Process) -> None:
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        try:
            await h(p)
        finally:
            now -= 1

    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.enqueue_many(Q, [b"%d" % i for i in range(12)])
        await worker.start_work(Q, handler, concurrency=2, prefetch=3)

        async def held() -> bool:
            info = await worker.client.queue_info(Q)
            return (info.queued, info.running) == (7, 5)

        await wait_until(held, what="2 running and 3 prefetched, all held in Redis")
        await wait_until(lambda: now == 2, what="both slots busy")
        # The worker has the claim replies (the 3 prefetched ones count as
        # started), and has done all it does with them: no handler more.
        await wait_until(lambda: worker.statistics().processes_started == 5, what="5 in hand")
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)
        assert (now, len(h.tasks)) == (2, 2)  # the prefetched ones wait for a slot
        h.release.set()
        await wait_until(lambda: worker.statistics().processes_finished == 12, within=10)
    assert peak == 2 and sorted(h.tasks) == sorted(b"%d" % i for i in range(12))


async def test_a_cancel_of_a_prefetched_process_ends_it_without_its_handler(
    redis_url: str, namespace: str
) -> None:
    h = Ran(b"busy")
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.enqueue_many(Q, ["busy", "waiting"])
        await worker.start_work(Q, h, concurrency=1, prefetch=1)
        await wait_until(lambda: worker.statistics().processes_started == 2, what="both held")
        assert await worker.client.cancel(Q, "waiting") == 1
        # ended at once, while the only slot is still busy
        await wait_until(lambda: worker.statistics().processes_cancelled == 1)
        info = await worker.client.queue_info(Q)
        assert (info.queued, info.running) == (0, 1) and h.tasks == [b"busy"]
        h.release.set()
        await wait_until(lambda: worker.statistics().processes_finished == 1)
    assert h.tasks == [b"busy"]


async def test_leaving_hands_prefetched_processes_back_unharmed(
    redis_url: str, namespace: str
) -> None:
    h = Ran(forever=(b"a",))
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.enqueue_many(Q, ["a", "b", "c"])
        await worker.start_work(Q, h, concurrency=1, prefetch=2)
        # Held: "a" claimed and its handler running, "b" and "c" prefetched
        # (processes_started counts what was claimed, not what ran).
        await wait_until(
            lambda: worker.statistics().processes_started == 3 and h.tasks == [b"a"],
            what="all held and a running",
        )
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        info = await client.queue_info(Q)
        dead = await client.dead_letters(Q)
    assert h.tasks == [b"a"] and (info.queued, info.running, info.delayed) == (3, 0, 0)
    assert dead == []


async def test_prefetch_hands_back_what_waits_behind_persistent_handlers(
    redis_url: str, namespace: str
) -> None:
    # One slot. "a" runs, the persistent "dev" and then "b" are prefetched.
    # When "a" ends, "dev" takes the slot and never ends: "b" could wait
    # for ever, so it is handed back, and nothing more is claimed here.
    h = Ran(b"a", forever=(b"dev",))
    other = Ran()
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        await worker.client.enqueue(Q, "a")
        await worker.start_work(Q, h, concurrency=1, prefetch=2, balance=False)
        await wait_until(lambda: h.tasks == [b"a"])
        await worker.client.ensure(Q, "dev")
        await wait_until(lambda: worker.statistics().processes_started == 2)
        await worker.client.enqueue(Q, "b")
        await wait_until(lambda: worker.statistics().processes_started == 3)
        h.release.set()
        await wait_until(lambda: h.tasks == [b"a", b"dev"])

        async def b_back() -> bool:
            info = await worker.client.queue_info(Q)
            return (info.queued, info.running) == (1, 1)

        await wait_until(b_back, what="b handed back to the queue")
        async with mesh.open_worker(redis_url, namespace=namespace) as peer:
            await peer.start_work(Q, other, concurrency=1, rebalance=False)
            await wait_until(lambda: other.tasks == [b"b"], what="the peer ran b")
    assert h.tasks == [b"a", b"dev"]


async def test_start_work_checks_the_prefetch_option(redis_url: str, namespace: str) -> None:
    async with mesh.open_worker(redis_url, namespace=namespace) as worker:
        with pytest.raises(mesh.ConfigError, match="prefetch must be"):
            await worker.start_work(Q, Ran(), prefetch=-1)
        with pytest.raises(mesh.ConfigError, match="plain handlers"):
            await worker.start_work(Q, batch_handler=Batches(), prefetch=2)
