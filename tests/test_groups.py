"""Groups of a queue (issue 36), against a real redis-server, on both loops:
jobs of many groups run in weighted round-robin; a group's concurrency is a
cap across the mesh (held while a dead worker's jobs are recycled), 1 keeps
its jobs in order, retries go back to its front; rate limits and pauses
hold per group; ungrouped jobs take turns with the groups; delays, cancels,
dead letters and results work within a group; an empty group leaves no key."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

import anyio
import pytest

import mesh
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._keys import Keys
from mesh._replies import parse_claim_compact
from mesh.testing import wait_until

from .protocol_helpers import expire_worker, join

pytestmark = pytest.mark.both_loops

Q = "g"


async def group_keys_left(conn: Connection, namespace: str) -> list[bytes]:
    """Every key of the namespace's groups still in Redis."""
    found: list[bytes] = []
    for pattern in ("gq:*", "gp:*", "gready:*", "gwait:*", "gdelayed:*", "grate:*", "groups:*"):
        found += await conn.execute("KEYS", f"{{{namespace}}}:{pattern}")
    return sorted(found)


def idle_in_redis(conn: Connection, namespace: str, worker: str) -> Callable[[], Awaitable[bool]]:
    """A poll for :func:`wait_until`: whether ``worker`` is in queue Q's idle
    set (its last claim found nothing, and a wake is what it waits for)."""
    idle = Keys(namespace).idle(Q)

    async def poll() -> bool:
        return bool(await conn.execute("SISMEMBER", idle, worker))

    return poll


class Recorder:
    """A handler that records what ran (payload, group) in order, and the
    most jobs of each group running at once in this process."""

    def __init__(self, hold: float = 0.0) -> None:
        self.hold = hold
        self.ran: list[tuple[bytes, str | None]] = []
        self.now: Counter[str | None] = Counter()
        self.most: Counter[str | None] = Counter()

    async def __call__(self, p: mesh.Process) -> None:
        self.now[p.group] += 1
        self.most[p.group] = max(self.most[p.group], self.now[p.group])
        try:
            if self.hold:
                await anyio.sleep(self.hold)
            else:
                await anyio.lowlevel.checkpoint()
            self.ran.append((p.task, p.group))
        finally:
            self.now[p.group] -= 1


async def test_jobs_of_groups_run_once_each_and_an_empty_group_leaves_no_key(
    redis_url: str, namespace: str, conn: Connection
) -> None:
    rec = Recorder()
    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        for g in ("a", "b", "c"):
            await c.enqueue_many(Q, [f"{g}{i}" for i in range(20)], group=g)
        await c.enqueue_many(Q, [f"u{i}" for i in range(20)])
        look = await c.groups(Q)
        assert {(i.name, i.queued) for i in look.groups} == {("a", 20), ("b", 20), ("c", 20)}
        assert look.queued == 60 and look.total == 3
        await w.start_work(Q, rec, concurrency=4)
        await wait_until(lambda: len(rec.ran) == 80, what="every job", within=60)
        done = Counter(t for t, _ in rec.ran)
        assert set(done.values()) == {1}
        for task, group in rec.ran:
            assert group == (None if task.startswith(b"u") else task[:1].decode())
        await wait_until(lambda: _none_running(c), what="no process left")
        assert await group_keys_left(conn, namespace) == []
        assert (await c.groups(Q)).groups == []


async def _none_running(c: mesh.Client) -> bool:
    return not await c.processes(Q)


async def test_a_claim_takes_turns_among_the_groups_and_the_ungrouped_jobs(
    redis_url: str, namespace: str
) -> None:
    # One group with a long backlog, then nine with two jobs each and two
    # ungrouped jobs: with one slot, each small group's jobs (and the
    # ungrouped ones) run within the first rounds, not after the backlog.
    rec = Recorder()
    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        await c.enqueue_many(Q, [f"big{i}" for i in range(300)], group="big")
        for g in range(9):
            await c.enqueue_many(Q, [f"s{g}-{i}" for i in range(2)], group=f"s{g}")
        await c.enqueue_many(Q, [b"u0", b"u1"])
        await w.start_work(Q, rec, concurrency=1)
        await wait_until(lambda: len(rec.ran) == 320, what="every job", within=60)
        first = rec.ran[:40]
        small = [t for t, g in first if g and g.startswith("s")]
        assert len(small) == 18, first
        assert {t for t, g in first if g is None} == {b"u0", b"u1"}
        # the big group's jobs kept their order
        big = [t for t, g in rec.ran if g == "big"]
        assert big == [f"big{i}".encode() for i in range(300)]


async def test_a_turn_among_backlogged_groups_is_three_jobs(conn: Connection, b: Binding) -> None:
    # A claim among backlogged groups pops a turn of three jobs per group it
    # visits (protocol/include/group.lua QUANTUM), the groups in turn.
    for g in ("a", "b", "c", "d"):
        await b.enqueue_group(conn, Q, g, [f"{g}{i}".encode() for i in range(10)])
    inc = await join(b, conn, "w1", Q)
    got = (await b.claim(conn, "w1", inc, Q, 12, 5)).processes
    assert Counter(p.group for p in got) == {"a": 3, "b": 3, "c": 3, "d": 3}
    assert [p.task for p in got if p.group == "a"] == [b"a0", b"a1", b"a2"]
    got = (await b.claim(conn, "w1", inc, Q, 8, 5)).processes
    assert sorted(Counter(p.group for p in got).values()) == [2, 3, 3]


async def test_a_turn_cut_short_by_a_full_claim_goes_on_at_the_next(
    conn: Connection, b: Binding
) -> None:
    # Claims of two among groups of ten: the group at the front takes two of
    # its turn of three, keeps its place, and takes its third job at the next
    # claim before the next group's turn starts (protocol/README.md, Groups).
    for g in ("a", "b", "c"):
        await b.enqueue_group(conn, Q, g, [f"{g}{i}".encode() for i in range(10)])
    inc = await join(b, conn, "w1", Q)
    order = []
    for _ in range(6):
        got = (await b.claim(conn, "w1", inc, Q, 2, 5)).processes
        order += [p.task.decode() for p in got]
    assert order == ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2", "a3", "a4", "a5"]


async def test_a_group_that_comes_back_joins_the_back_of_the_line(
    conn: Connection, b: Binding
) -> None:
    # "a" empties (its turn finds two jobs) and comes back with one while "b"
    # and "c" wait: it starts after both have had a turn, though its name
    # comes first.
    for g, n in (("a", 2), ("b", 9), ("c", 9)):
        await b.enqueue_group(conn, Q, g, [f"{g}{i}".encode() for i in range(n)])
    inc = await join(b, conn, "w1", Q)
    got = (await b.claim(conn, "w1", inc, Q, 8, 5)).processes
    assert Counter(p.group for p in got) == {"a": 2, "b": 3, "c": 3}
    await b.enqueue_group(conn, Q, "a", [b"a-again"])
    got = (await b.claim(conn, "w1", inc, Q, 7, 5)).processes
    assert [p.group for p in got] == ["b"] * 3 + ["c"] * 3 + ["a"]


async def test_weights_share_the_claims(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        await c.configure_group(Q, "heavy", weight=3)
        await c.enqueue_many(Q, [f"h{i}" for i in range(300)], group="heavy")
        await c.enqueue_many(Q, [f"l{i}" for i in range(300)], group="light")
        await w.start_work(Q, rec, concurrency=1)
        await wait_until(lambda: len(rec.ran) >= 200, what="200 jobs", within=60)
        got = Counter(g for _, g in rec.ran[:200])
        # 3:1, within a few jobs
        assert 140 <= got["heavy"] <= 160, got


async def test_a_groups_concurrency_is_a_cap_across_the_mesh(
    redis_url: str, namespace: str
) -> None:
    recs = [Recorder(hold=0.02) for _ in range(3)]
    running_most = 0
    async with mesh.open_client(redis_url, namespace=namespace) as c:
        await c.configure_group(Q, "acct", concurrency=2)
        await c.enqueue_many(Q, [f"a{i}" for i in range(60)], group="acct")
        await c.enqueue_many(Q, [f"o{i}" for i in range(60)], group="other")
        async with (
            mesh.open_worker(redis_url, namespace=namespace) as w1,
            mesh.open_worker(redis_url, namespace=namespace) as w2,
            mesh.open_worker(redis_url, namespace=namespace) as w3,
        ):
            for w, r in zip((w1, w2, w3), recs, strict=True):
                await w.start_work(Q, r, concurrency=5)

            def done() -> bool:
                return sum(len(r.ran) for r in recs) == 120

            while not done():
                ps = await c.processes(Q)
                running_most = max(running_most, sum(1 for p in ps if p.group == "acct"))
                await anyio.sleep(0.005)
    assert running_most == 2
    assert sum(r.most["acct"] for r in recs) >= 2
    # the other group was not held to the cap
    assert sum(r.most["other"] for r in recs) > 2


async def test_concurrency_one_keeps_a_groups_order_through_a_retry(
    redis_url: str, namespace: str
) -> None:
    ran: list[bytes] = []  # in the order they started
    failed: set[bytes] = set()
    done: list[bytes] = []

    async def handler(p: mesh.Process) -> None:
        ran.append(p.task)
        if p.task == b"k2" and p.task not in failed:
            failed.add(p.task)
            raise RuntimeError("once")
        await anyio.sleep(0.001)
        done.append(p.task)

    async with (
        mesh.open_worker(redis_url, namespace=namespace) as w1,
        mesh.open_worker(redis_url, namespace=namespace) as w2,
    ):
        c = w1.client
        await c.configure(Q, backoff=0.05, group_concurrency=1)
        await c.enqueue_many(Q, [f"k{i}" for i in range(8)], group="key")
        await w1.start_work(Q, handler, concurrency=4)
        await w2.start_work(Q, handler, concurrency=4)
        # every handler returned before the workers stop (a stop cancels
        # the handlers still running, and a peer runs their jobs again)
        await wait_until(lambda: len(done) == 8, what="8 jobs done", within=30)
    assert ran == [b"k0", b"k1", b"k2", b"k2", b"k3", b"k4", b"k5", b"k6", b"k7"], b" ".join(
        ran
    ).decode()


async def test_a_paused_group_waits_while_the_others_run(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        assert await c.pause_group(Q, "held") is True
        assert await c.pause_group(Q, "held") is False
        await c.enqueue_many(Q, [b"h0", b"h1"], group="held")
        await c.enqueue_many(Q, [b"f0", b"f1"], group="free")
        await w.start_work(Q, rec, concurrency=2)
        await wait_until(lambda: len(rec.ran) == 2, what="the free group")
        await anyio.sleep(0.2)
        assert {t for t, _ in rec.ran} == {b"f0", b"f1"}
        (held,) = [g for g in (await c.groups(Q)).groups if g.name == "held"]
        assert held.paused is not None and held.queued == 2 and not held.ready
        assert await c.resume_group(Q, "held") is True
        await wait_until(lambda: len(rec.ran) == 4, what="the resumed group")


async def test_resuming_a_queue_of_grouped_jobs_wakes_its_idle_worker(
    redis_url: str, namespace: str, conn: Connection
) -> None:
    # pause.lua's resume wakes the idle servers for what is ready: the ready
    # groups count (the worker sits in the idle set, so its heartbeat does
    # not make it claim: only a wake does)
    rec = Recorder()
    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        assert await c.pause(Q) is True
        await c.enqueue_many(Q, [b"a0", b"a1"], group="a")
        await w.start_work(Q, rec, concurrency=2)
        await wait_until(idle_in_redis(conn, namespace, w.id), what="the worker idle on the pause")
        assert rec.ran == []
        assert await c.resume(Q) is True
        await wait_until(lambda: len(rec.ran) == 2, what="the jobs after the resume", within=5)


async def test_an_idle_worker_whose_wake_was_lost_finds_a_groups_job(
    redis_url: str, namespace: str, conn: Connection
) -> None:
    # The worker left the idle set (a wake took it out) but the message was
    # lost: its heartbeat says the queue has a ready group, and it claims.
    rec = Recorder()
    async with mesh.open_worker(redis_url, namespace=namespace, ttl=1.5) as w:
        await w.start_work(Q, rec, concurrency=1)
        await wait_until(idle_in_redis(conn, namespace, w.id), what="the worker idle")
        idle = Keys(namespace).idle(Q)
        assert await conn.execute("SREM", idle, w.id) == 1  # the wake that got lost
        await w.client.enqueue(Q, b"j", group="a")  # (wakes nobody: the set is empty)
        await wait_until(lambda: len(rec.ran) == 1, what="the job, by the heartbeat", within=5)


async def test_a_groups_rate_limit_holds(redis_url: str, namespace: str) -> None:
    rec = Recorder()
    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        await c.configure_group(Q, "slow", rate_limit=(5, 0.5))
        await c.enqueue_many(Q, [f"s{i}" for i in range(15)], group="slow")
        await c.enqueue_many(Q, [f"f{i}" for i in range(50)], group="fast")
        await w.start_work(Q, rec, concurrency=10)
        await wait_until(
            lambda: sum(1 for _, g in rec.ran if g == "fast") == 50, what="fast", within=30
        )
        started = anyio.current_time()
        await wait_until(
            lambda: sum(1 for _, g in rec.ran if g == "slow") == 15, what="slow", within=30
        )
        # a burst of 5, then 5 per 0.5 s: 15 take about 1 s
        assert anyio.current_time() - started >= 0.6


async def test_delays_cancels_dead_letters_and_results_work_in_a_group(
    redis_url: str, namespace: str, conn: Connection
) -> None:
    async def handler(p: mesh.Process) -> bytes:
        if p.task == b"bad":
            raise ValueError("no")
        return p.task.upper()

    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        await c.configure(Q, max_attempts=2, backoff=0.01, result_ttl=60)
        await c.enqueue(Q, b"later", group="t", delay=0.3)
        await c.enqueue_many(Q, [b"gone", b"bad", b"ok"], group="t")
        assert await c.cancel(Q, b"gone", group="t") == 1
        await w.start_work(Q, handler, concurrency=2)
        assert await c.result(Q, b"ok", timeout=5) == b"OK"
        assert await c.result(Q, b"later", timeout=5) == b"LATER"
        await wait_until(lambda: _dead(c), what="the bad job's dead letter")
        await wait_until(lambda: _none_running(c), what="no process left")
        assert await group_keys_left(conn, namespace) == []


async def _dead(c: mesh.Client) -> bool:
    return [d.task for d in await c.dead_letters(Q)] == [b"bad"]


async def test_a_dead_workers_group_jobs_go_back_to_the_front_and_its_cap_holds(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # Driven through the scripts: w1 takes the one job its group's cap
    # allows, w2 finds nothing of that group; w1's lease runs out and the
    # recycle puts the job back at the group's front and frees its slot,
    # so the next claim takes it first (a crash counts as an attempt).
    i1 = await join(b, conn, "w1", Q)
    i2 = await join(b, conn, "w2", Q)
    await b.configure_group(conn, Q, "one", "set", ["1", "", "", ""])
    await b.enqueue_group(conn, Q, "one", [b"x0", b"x1", b"x2"])
    (p,) = (await b.claim(conn, "w1", i1, Q, 5, 0)).processes
    assert (p.task, p.group) == (b"x0", "one")
    assert (await b.claim(conn, "w2", i2, Q, 5, 0)).processes == ()
    assert await conn.execute("HGET", keys.groups(Q), "r:one") == b"1"
    await expire_worker(conn, keys, "w1")
    r = await b.recycle(conn, "w1", leave=False)
    assert (r.alive, r.returned) == (False, 1)
    assert await conn.execute("HGET", keys.groups(Q), "r:one") is None
    assert await conn.execute("LRANGE", keys.group_jobs(Q, "one"), 0, -1) == [b"x0", b"x1", b"x2"]
    (q,) = (await b.claim(conn, "w2", i2, Q, 5, 0)).processes
    assert (q.task, q.group, q.attempts) == (b"x0", "one", 1)
    assert q.token > p.token


async def test_bad_group_input_is_refused_with_one_line(redis_url: str, namespace: str) -> None:
    async with mesh.open_client(redis_url, namespace=namespace) as c:
        with pytest.raises(mesh.ConfigError, match="invalid group name"):
            await c.enqueue(Q, b"x", group="no spaces")
        with pytest.raises(mesh.ConfigError, match="priority"):
            await c.enqueue(Q, b"x", group="g", priority=10)
        with pytest.raises(mesh.ConfigError, match="weight must be"):
            await c.configure_group(Q, "g", weight=0)
        with pytest.raises(mesh.ConfigError, match="concurrency must be"):
            await c.configure_group(Q, "g", concurrency=-1)
        assert (await c.groups(Q)).groups == []
        s = await c.configure_group(Q, "g", concurrency=3)
        assert s == mesh.GroupSettings(concurrency=3)
        s = await c.configure_group(Q, "g", weight=2)
        assert s == mesh.GroupSettings(concurrency=3, weight=2)
        await c.configure(Q, group_concurrency=7, group_rate_limit=100)
        (g,) = (await c.groups(Q)).groups
        assert g.settings == mesh.GroupSettings(3, 100, 1.0, 2)
        await c.clear_group(Q, "g")
        assert (await c.groups(Q)).groups == []


async def test_a_groups_jobs_are_listed_by_group(redis_url: str, namespace: str) -> None:
    gate = anyio.Event()

    async def handler(p: mesh.Process) -> None:
        await gate.wait()

    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        await c.configure_group(Q, "t", concurrency=2)
        await c.enqueue_many(Q, [f"t{i}" for i in range(5)], group="t")
        await c.enqueue_many(Q, [b"u0"])
        await w.start_work(Q, handler, concurrency=10)

        async def two_running() -> bool:
            return len((await c.jobs(Q, "running", group="t")).jobs) == 2

        await wait_until(two_running, what="the group's cap of jobs running")
        running = (await c.jobs(Q, "running", group="t")).jobs
        assert [(j.task, j.group) for j in running] == [(b"t0", "t"), (b"t1", "t")]
        page = await c.jobs(Q, "queued", group="t", limit=2)
        assert [j.task for j in page.jobs] == [b"t2", b"t3"] and page.total == 3
        rest = await c.jobs(Q, "queued", group="t", after=page.next)
        assert [j.task for j in rest.jobs] == [b"t4"] and rest.next is None
        with pytest.raises(mesh.ConfigError, match="without a prefix"):
            await c.jobs(Q, "queued", group="t", prefix=b"t")
        gate.set()


async def test_a_retry_of_a_groups_only_job_runs_again(redis_url: str, namespace: str) -> None:
    # The group holds nothing else and has no cap: the failed job goes back
    # into it (no backoff here) and the group must be ready again for it.
    runs: list[int] = []

    async def handler(p: mesh.Process) -> None:
        runs.append(p.attempts)
        if p.attempts == 0:
            raise RuntimeError("first try")

    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        await c.configure(Q, backoff=0, backoff_max=0)
        await c.enqueue(Q, b"solo", group="alone")
        # a claim of two finds one: the group leaves the ready ones at once
        await w.start_work(Q, handler, concurrency=2)
        await wait_until(lambda: runs == [0, 1], what="the retry")


async def test_a_claim_is_not_short_while_a_group_has_jobs_behind_emptied_ones(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # Twelve groups of two jobs each take one turn (two jobs, all they had:
    # they stay in the ready set until a claim finds them empty), then z
    # takes its first turn; the next claim meets the twelve emptied groups
    # first, and must go on past them to z rather than come back with
    # nothing (the worker would then wait for a wake no one sends).
    i1 = await join(b, conn, "w1", Q)
    for i in range(12):
        await b.enqueue_group(conn, Q, f"a{i:02d}", [b"a%d-1" % i, b"a%d-2" % i])
    await b.enqueue_group(conn, Q, "z", [b"z%d" % i for i in range(10)])
    took = []
    for _ in range(13):
        took += [p.task for p in (await b.claim(conn, "w1", i1, Q, 2, 0)).processes]
    assert len(took) == 26 and took[-2:] == [b"z0", b"z1"]
    r = await b.claim(conn, "w1", i1, Q, 2, 0)
    assert [p.task for p in r.processes] == [b"z2", b"z3"]
    assert await conn.execute("ZRANGE", keys.group_ready(Q), 0, -1) == [b"z"]


def test_a_compact_claim_reply_names_each_jobs_group_by_runs() -> None:
    # mixed 2: every process a one-shot task on its first attempt, in runs of
    # one group each ("" for none)
    r = [1000, 5, -1, b"7", 4, 2, b"a", b"b", b"c", b"d", b"t1", 2, b"", 1, b"t2", 1]
    reply = parse_claim_compact(r, Q, "w")
    assert [(p.id, p.task, p.group) for p in reply.processes] == [
        ("7", b"a", "t1"),
        ("8", b"b", "t1"),
        ("9", b"c", None),
        ("10", b"d", "t2"),
    ]
    with pytest.raises(ValueError, match="cover 3 of 4"):
        parse_claim_compact([*r[:-2], b"t2", 0], Q, "w")


async def test_a_groups_jobs_with_a_priority_go_first_through_every_path(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # Driven through the scripts: within a group, the higher priority starts
    # first (FIFO within one, the group's list last), and a job keeps its
    # priority when it is handed back, retried after a backoff, recycled,
    # dead-lettered and requeued; a cancel finds it at any priority. (Three
    # attempts; a repeated crash goes back at once: no backoff.)
    i1 = await join(b, conn, "w1", Q)
    await b.enqueue_group(conn, Q, "one", [b"a0", b"a1"])
    await b.enqueue_group(conn, Q, "one", [b"b5"], priority=5)
    await b.enqueue_group(conn, Q, "one", [b"c9"], priority=9)
    await b.enqueue_group(conn, Q, "one", [b"d5"], priority=5)
    ps = (await b.claim(conn, "w1", i1, Q, 10, 3, backoff_ms=0)).processes
    assert [p.task for p in ps] == [b"c9", b"b5", b"d5", b"a0", b"a1"]
    kinds = [(await conn.execute("HGET", keys.procs(Q), p.id)).split(b"\0")[1] for p in ps]
    assert kinds == [b"g9one", b"g5one", b"g5one", b"g0one", b"g0one"]
    # handed back: each to the front of its priority, the same order again
    await b.give_back(conn, "w1", Q, [p.id for p in ps], failed=False)
    assert await conn.execute("HGET", keys.groups(Q), ":np") == b"3"
    ps = (await b.claim(conn, "w1", i1, Q, 10, 3, backoff_ms=0)).processes
    assert [p.task for p in ps] == [b"c9", b"b5", b"d5", b"a0", b"a1"]
    assert await conn.execute("HGET", keys.groups(Q), ":np") is None
    # c9 fails and waits for its backoff; when due it goes before b5
    by = {p.task: p for p in ps}
    out = await b.give_back(
        conn, "w1", Q, [by[b"c9"].id], failed=True, backoff_ms=1, backoff_cap_ms=1000
    )
    assert out == [(2, 1)]
    await b.give_back(conn, "w1", Q, [by[t].id for t in (b"b5", b"d5")], failed=False)
    await anyio.sleep(0.01)
    ps = (await b.claim(conn, "w1", i1, Q, 2, 3, backoff_ms=0)).processes
    assert [(p.task, p.attempts) for p in ps] == [(b"c9", 1), (b"b5", 0)]
    # w1 dies holding c9, b5, a0, a1: they go back to their priorities
    await expire_worker(conn, keys, "w1")
    await b.recycle(conn, "w1", leave=False)
    i2 = await join(b, conn, "w2", Q)
    ps = (await b.claim(conn, "w2", i2, Q, 10, 3, backoff_ms=0)).processes
    assert [p.task for p in ps] == [b"c9", b"b5", b"d5", b"a0", b"a1"]
    # c9 fails for good (its third attempt, at max_attempts 3): its dead
    # letter keeps its priority and group, and a requeue puts it back there
    by = {p.task: p for p in ps}
    assert by[b"c9"].attempts == 2
    assert await b.give_back(conn, "w2", Q, [by[b"c9"].id], failed=True) == [(3, 0)]
    (rec,) = await conn.execute("LRANGE", keys.dead(Q), 0, -1)
    assert rec.split(b"\0")[4:] == [b"g9one", b"c9"]
    await b.give_back(conn, "w2", Q, [by[t].id for t in (b"a0", b"a1")], failed=False)
    assert await b.dead(conn, Q, "requeue", None) == (1, 0)
    assert await conn.execute("ZRANGE", keys.group_prio(Q, "one"), 0, -1) == [
        b"9" + b"5" + b"0" * 14 + b"c9"
    ]
    # cancelled at any priority, queued or delayed: nothing is left of it
    await b.enqueue_group(conn, Q, "one", [b"late"], in_ms=60_000, priority=7)
    assert (await b.cancel(conn, Q, b"c9", "one"))[0] == 1
    assert (await b.cancel(conn, Q, b"late", "one"))[0] == 1
    assert await conn.execute("EXISTS", keys.group_prio(Q, "one"), keys.group_delayed(Q)) == 0
    assert await conn.execute("LRANGE", keys.group_jobs(Q, "one"), 0, -1) == [b"a0", b"a1"]


async def test_a_groups_delayed_and_dead_jobs_are_listed_and_requeued_into_it(
    redis_url: str, namespace: str
) -> None:
    async def handler(p: mesh.Process) -> None:
        raise ValueError("no")

    async with mesh.open_worker(redis_url, namespace=namespace) as w:
        c = w.client
        await c.configure(Q, max_attempts=1)
        await c.enqueue(Q, b"later", group="t", delay=600, priority=4)
        await c.enqueue(Q, b"elsewhere", group="u", delay=600)
        await c.enqueue(Q, b"bad", group="t", priority=2)
        await c.enqueue(Q, b"plain")
        await w.start_work(Q, handler, concurrency=2)

        async def two_dead() -> bool:
            return len(await c.dead_letters(Q)) == 2

        await wait_until(two_dead, what="two dead letters")
        dead = {(d.task, d.group, d.priority) for d in await c.dead_letters(Q)}
        assert dead == {(b"bad", "t", 2), (b"plain", None, 0)}
        (j,) = (await c.jobs(Q, "dead", group="t")).jobs
        assert (j.task, j.group, j.priority, j.error) == (b"bad", "t", 2, "ValueError: no")
        page = await c.jobs(Q, "delayed", group="t")
        assert [(j.task, j.priority, j.group) for j in page.jobs] == [(b"later", 4, "t")]
        assert page.total == 1 and page.jobs[0].due is not None
        # requeued into its group, at its priority (the group is paused so
        # that it stays there to be looked at)
        await c.pause_group(Q, "t")
        assert await c.requeue_dead(Q, [b"bad"]) == 1
        (q,) = (await c.jobs(Q, "queued", group="t")).jobs
        assert (q.task, q.priority, q.group) == (b"bad", 2, "t")
        (g,) = [g for g in (await c.groups(Q)).groups if g.name == "t"]
        assert (g.queued, g.delayed) == (1, 1)
        assert (await c.jobs(Q, "queued")).total == 0  # not in the ungrouped queue
