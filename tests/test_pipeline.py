"""Adaptive pipelining (issue 34), the default (``prefetch=None``), against a
real redis-server: workers in this process for what a test must watch from
inside (how many processes a runner holds, its handlers at once), real worker
processes for SIGKILL. While handlers are short and the queue has a backlog a
runner claims beyond its concurrency; a long handler holds no work behind it;
the concurrency bound and the fair share hold; a graceful stop hands the
prefetched work back; a cancel by payload reaches a prefetched process; and a
SIGKILL recycles it like running work. The decisions themselves are unit-tested
in test_runner_core.py."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

import anyio
import anyio.lowlevel
import pytest

import mesh
import mesh._runner_core
from mesh._runner import QueueRunner
from mesh.testing import wait_until

from .helpers import Peers, wait_ready

pytestmark = pytest.mark.both_loops

Q = "pipe"


def runner_of(worker: mesh.Worker) -> QueueRunner:
    (runner,) = worker._served.runners()
    return runner


class Watch:
    """One worker's handler: records what ran (with the trio times each run
    began and ended, and whether it returned), the most handlers at once, and
    the most processes its runner held (running and prefetched)."""

    def __init__(
        self, name: str, body: Callable[[mesh.Process], Awaitable[None]] | None = None
    ) -> None:
        self.name = name
        self.body = body
        self.worker: mesh.Worker | None = None
        self.ran: list[bytes] = []
        self.runs: list[tuple[bytes, float, float, bool]] = []
        self.now = self.most_at_once = self.most_held = 0

    async def __call__(self, p: mesh.Process) -> None:
        assert self.worker is not None
        self.ran.append(p.task)
        self.now += 1
        self.most_at_once = max(self.most_at_once, self.now)
        self.most_held = max(self.most_held, len(runner_of(self.worker).running))
        began = anyio.current_time()
        returned = False
        try:
            if self.body is not None:
                await self.body(p)
            returned = True
        finally:
            self.now -= 1
            self.runs.append((p.task, began, anyio.current_time(), returned))

    def done(self) -> Counter[bytes]:
        """How many times each payload's handler returned here."""
        return Counter(t for t, _, _, returned in self.runs if returned)


async def serve(worker: mesh.Worker, watch: Watch, concurrency: int) -> None:
    watch.worker = worker
    await worker.start_work(Q, watch, concurrency=concurrency)


async def test_short_jobs_never_wait_behind_a_long_one(redis_url: str, namespace: str) -> None:
    # Two workers of one slot each; a backlog of short jobs (the runners
    # pipeline), then one 10 s job, then 100 short ones. Whichever worker
    # takes the long job may have claimed short ones after it in the same
    # round trips: it hands them back once the long job counts as long, so
    # every short job runs on the other worker while the long one still runs.
    long_ended = anyio.Event()

    async def body(p: mesh.Process) -> None:
        if p.task == b"long":
            await anyio.sleep(10)
            long_ended.set()

    watches = [Watch("a", body), Watch("b", body)]
    warm = [b"w%d" % i for i in range(200)]
    short = [b"s%d" % i for i in range(100)]
    async with (
        mesh.open_worker(redis_url, namespace=namespace) as a,
        mesh.open_worker(redis_url, namespace=namespace) as b,
    ):
        await serve(a, watches[0], 1)
        await serve(b, watches[1], 1)
        await a.client.enqueue_many(Q, [*warm, b"long", *short])

        def all_short_ran() -> bool:
            done = sum((w.done() for w in watches), Counter[bytes]())
            return all(done[t] == 1 for t in warm + short)

        try:
            await wait_until(
                all_short_ran, within=9, what="every short job, before the long one ends"
            )
        except mesh.testing.WaitTimeout:
            done = sum((w.done() for w in watches), Counter[bytes]())
            missing = [t for t in warm + short if done[t] != 1]
            ps = await a.client.processes(Q)
            info = await a.client.queue_info(Q)
            raise AssertionError(
                f"not run once: {[(t, done[t]) for t in missing][:20]} ({len(missing)}); "
                f"ran: a={len(watches[0].ran)} b={len(watches[1].ran)} "
                f"last a={watches[0].ran[-3:]} b={watches[1].ran[-3:]}; "
                f"held: {[(p.task, p.worker_id == a.id) for p in ps]}; info={info}; "
                f"runners: a={len(runner_of(a).running)} b={len(runner_of(b).running)}"
            ) from None
        assert not long_ended.is_set()
        (long_w,) = [w for w in watches if b"long" in w.ran]
        # nothing ran on the long job's worker once it started
        assert long_w.ran[-1] == b"long"
        # and it holds nothing but the long job, in Redis and here
        assert long_w.worker is not None
        ps = await a.client.processes(Q)
        held = [p.task for p in ps if p.worker_id == long_w.worker.id]
        assert held == [b"long"] and len(runner_of(long_w.worker).running) == 1
        # the runners pipelined: held more than their one slot at times, but
        # never ran two handlers at once
        assert max(w.most_held for w in watches) > 1
        assert [w.most_at_once for w in watches] == [1, 1]
        assert await a.client.cancel(Q, "long") == 1


async def test_pipelining_keeps_the_concurrency_bound_and_the_fair_share(
    redis_url: str, namespace: str
) -> None:
    # Two workers of 10 slots, 6 persistent tasks (whose handlers run until
    # cancelled) and 3,000 short jobs on one queue: each worker runs 3 of the
    # persistent tasks (its fair share) and at most 10 handlers at once,
    # though it holds more than 10 processes while it pipelines.
    async def body(p: mesh.Process) -> None:
        if p.persistent:
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()  # the batch's handlers run at once

    watches = [Watch("a", body), Watch("b", body)]
    jobs = [b"j%d" % i for i in range(3000)]
    async with (
        mesh.open_worker(redis_url, namespace=namespace) as a,
        mesh.open_worker(redis_url, namespace=namespace) as b,
    ):
        await serve(a, watches[0], 10)
        await serve(b, watches[1], 10)
        await a.client.enqueue_many(Q, jobs[:1500])
        await a.client.ensure_many(Q, [b"d%d" % i for i in range(6)])
        await a.client.enqueue_many(Q, jobs[1500:])

        def jobs_done() -> bool:
            done = sum((w.done() for w in watches), Counter[bytes]())
            return len(done) == len(jobs) and set(done.values()) == {1}

        await wait_until(jobs_done, within=60, what="every job run once")

        async def shared() -> bool:
            held = Counter(p.worker_id for p in await a.client.processes(Q) if p.persistent)
            return sorted(held.values()) == [3, 3]

        await wait_until(shared, within=10, what="3 persistent tasks on each worker")
    assert max(w.most_at_once for w in watches) == 10
    assert max(w.most_held for w in watches) > 10


async def test_a_graceful_stop_hands_prefetched_work_back_with_no_overlap(
    redis_url: str, namespace: str
) -> None:
    # Worker a stops while it holds prefetched processes (more than its 5
    # slots): they are handed back unharmed and run on b, each process's
    # runs never overlap, and every job finishes exactly once.
    stopped: list[int] = []

    async def body(p: mesh.Process) -> None:
        await anyio.lowlevel.checkpoint()  # a stop can cancel it here

    wa, wb = Watch("a", body), Watch("b", body)
    jobs = [b"j%d" % i for i in range(3000)]
    async with (
        mesh.open_worker(redis_url, namespace=namespace) as a,
        mesh.open_worker(redis_url, namespace=namespace) as b,
        anyio.create_task_group() as nursery,
    ):

        async def stop_a() -> None:
            stopped.append(await a.stop_work(Q))

        async def body_a(p: mesh.Process) -> None:
            if not stopped and len(wa.ran) > 100 and len(runner_of(a).running) > 5:
                stopped.append(-1)
                nursery.start_soon(stop_a)
            if stopped:
                # from then on a's handlers wait for the stop to cancel them,
                # so it finds them running and more prefetched (under load
                # they had all run before the stop began: 1 run in 72)
                await anyio.sleep(1)
            await body(p)

        wa.body = body_a
        await serve(a, wa, 5)
        await serve(b, wb, 5)
        await a.client.enqueue_many(Q, jobs)

        def jobs_done() -> bool:
            done = wa.done() + wb.done()
            return len(done) == len(jobs) and set(done.values()) == {1}

        await wait_until(jobs_done, within=60, what="every job run once")
        await wait_until(lambda: len(stopped) == 2, what="a's stop returned")

        async def all_reported() -> bool:
            # b reports its last finishes a round trip after they returned
            info = await a.client.queue_info(Q)
            return (info.queued, info.running) == (0, 0)

        await wait_until(all_reported, what="nothing queued or running in Redis")
    assert stopped[1] > 0  # handed back
    # no overlap: each payload's runs (a cancelled one on a, then b's) one
    # after the other
    runs: dict[bytes, list[tuple[float, float]]] = {}
    for task, began, ended, _ in wa.runs + wb.runs:
        runs.setdefault(task, []).append((began, ended))
    for task, spans in runs.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, task


async def test_a_cancel_by_payload_reaches_a_prefetched_process(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One slot; after a backlog of short jobs, "gate" blocks it and "victim"
    # waits prefetched behind it (no handler counts as long here, so it is
    # not handed back meanwhile). Cancelled by payload, it ends at once,
    # without its handler; the jobs after it run.
    monkeypatch.setattr(mesh._runner_core, "LONG_MIN", 3600.0)
    gate = anyio.Event()

    async def body(p: mesh.Process) -> None:
        if p.task == b"gate":
            await gate.wait()

    w = Watch("a", body)
    async with mesh.open_worker(redis_url, namespace=namespace) as a:
        await serve(a, w, 1)
        warm = [b"w%d" % i for i in range(100)]
        await a.client.enqueue_many(Q, [*warm, b"gate", b"victim", b"after"])
        runner = runner_of(a)

        def prefetched() -> list[bytes]:
            return [s.process.task for s in runner.running.values() if s.scope is None]

        await wait_until(
            lambda: w.ran[-1:] == [b"gate"] and b"victim" in prefetched(),
            what="victim prefetched behind the gate",
        )
        assert await a.client.cancel(Q, "victim") == 1
        await wait_until(lambda: b"victim" not in prefetched(), what="the cancel reached it")
        assert a.statistics().processes_cancelled == 1 and w.ran[-1] == b"gate"
        gate.set()
        await wait_until(lambda: w.done()[b"after"] == 1, what="the job after it ran")
    assert b"victim" not in w.ran and w.done()[b"gate"] == 1


@pytest.fixture
def peers(redis_url: str, namespace: str) -> Iterator[Peers]:
    p = Peers(redis_url, namespace)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.mark.slow
@pytest.mark.trio_only("real worker processes: the test's own loop does not matter")
async def test_sigkill_recycles_prefetched_processes_like_running_ones(
    peers: Peers, namespace: str
) -> None:
    # Worker process a (one slot on the queue "timed") pipelines through a
    # backlog, then "gate" blocks its slot with work prefetched behind it
    # (no handler counts as long in a, so it keeps it). a is SIGKILLed: peer
    # b recycles the prefetched processes as it recycles the running one,
    # and each runs there once; none ever started on a.
    gate = "gate:3600"
    async with mesh.open_client(peers.url, namespace=namespace) as client:
        a = peers.start("--timed", "1", "--long-min", "3600")
        await wait_ready(client, peers, 1)
        warm = [f"w{i}:0" for i in range(100)]
        after = [f"p{i}:0" for i in range(4)]
        await client.enqueue_many("timed", [*warm, gate, *after])

        async def a_prefetched() -> bool:
            started = {e.task for e in await peers.events(client) if e.event == "start"}
            held = [p.task.decode() for p in await client.processes("timed")]
            return gate in started and gate in held and len(held) > 1

        await wait_until(a_prefetched, what="a holds work prefetched behind the gate")
        before = {p.task.decode(): p for p in await client.processes("timed")}
        waiting = sorted(set(before) - {gate})
        (a_id,) = {p.worker_id for p in before.values()}
        peers.start("--timed", "2")  # a slot for the gate, one for the rest
        await wait_ready(client, peers, 2)
        a.kill()

        async def b_ran_them() -> bool:
            ev = await peers.events(client)
            ended = Counter(e.task for e in ev if e.event == "end")
            return all(ended[t] == 1 for t in after) and any(
                e.event == "start" and e.task == gate and e.worker != a_id for e in ev
            )

        await wait_until(b_ran_them, within=15, what="b recycled and ran a's processes")
        ev = await peers.events(client)
        now = {p.task.decode(): p for p in await client.processes("timed")}
    # the prefetched ones never started on a, and ran on b (once each)
    assert not [e for e in ev if e.event == "start" and e.task in waiting and e.worker == a_id]
    starts = Counter(e.task for e in ev if e.event == "start" and e.worker != a_id)
    assert all(starts[t] == 1 for t in waiting)
    # the gate moved to b with a higher token; nothing else is held
    assert list(now) == [gate] and now[gate].worker_id != a_id
    assert now[gate].token > before[gate].token
