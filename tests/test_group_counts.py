"""A group's count of slots in use (``r:G`` in ``{ns}:groups:<Q>``, protocol
version 11): only a group with a concurrency cap counts its jobs running; a
group without one counts nothing per job (its claims and finishes read and
write no count), and only its retries waiting for their backoff. A cap
that comes or goes while jobs run recounts them from the process records,
so the cap holds from the moment it is set. Driven through the scripts."""

from __future__ import annotations

import anyio

import mesh
from mesh._binding import Binding
from mesh._connection import Connection
from mesh._group_reads import read_groups, running_jobs
from mesh._harness import checks
from mesh._keys import Keys
from mesh.testing import wait_until

from .protocol_helpers import expire_worker, join

Q = "gc"


async def count(conn: Connection, keys: Keys, g: str) -> int | None:
    raw = await conn.execute("HGET", keys.groups(Q), "r:" + g)
    return None if raw is None else int(raw)


async def no_violation(conn: Connection, keys: Keys, groups: list[str]) -> None:
    snap = await checks.snapshot(conn, keys, [Q], groups)
    assert checks.group_violations(snap, Q, {}) == []


async def test_a_group_without_a_cap_counts_no_job(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue_group(conn, Q, "free", [b"a", b"b", b"c"])
    ps = (await b.claim(conn, "w1", inc, Q, 10, 3)).processes
    assert [p.task for p in ps] == [b"a", b"b", b"c"]
    assert await count(conn, keys, "free") is None  # running, uncounted
    assert await running_jobs(conn, keys, Q) == {"free": 3}
    look = await read_groups(conn, keys, Q, 10)
    assert (look.running, [g.running for g in look.groups]) == (3, [3])
    await no_violation(conn, keys, ["free"])
    assert await b.finish(conn, "w1", inc, Q, [p.id for p in ps]) == [True] * 3
    assert await conn.execute("HKEYS", keys.groups(Q)) == []


async def test_a_cap_set_while_jobs_run_counts_them_and_holds_at_once(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue_group(conn, Q, "t", [b"a", b"b", b"c", b"d", b"e"])
    ps = (await b.claim(conn, "w1", inc, Q, 3, 3)).processes
    assert len(ps) == 3 and await count(conn, keys, "t") is None
    # a cap of 2 while 3 run: they count, and nothing more starts
    await b.configure_group(conn, Q, "t", "set", ["2", "", "", ""])
    assert await count(conn, keys, "t") == 3
    assert (await b.claim(conn, "w1", inc, Q, 5, 3)).processes == ()
    await no_violation(conn, keys, ["t"])
    # two finish: one below the cap, one more starts
    await b.finish(conn, "w1", inc, Q, [ps[0].id, ps[1].id])
    assert await count(conn, keys, "t") == 1
    (p4,) = (await b.claim(conn, "w1", inc, Q, 5, 3)).processes
    assert p4.task == b"d" and await count(conn, keys, "t") == 2
    # the cap goes: the jobs stop counting, and their ends write nothing
    await b.configure_group(conn, Q, "t", "clear", [])
    assert await count(conn, keys, "t") is None
    (p5,) = (await b.claim(conn, "w1", inc, Q, 5, 3)).processes
    assert p5.task == b"e"
    await b.finish(conn, "w1", inc, Q, [ps[2].id, p4.id, p5.id])
    assert await count(conn, keys, "t") is None
    await no_violation(conn, keys, ["t"])


async def test_a_default_cap_that_comes_and_goes_recounts_every_group_without_its_own(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.configure_group(conn, Q, "own", "set", ["", "", "", "2"])  # a weight, no cap
    await b.configure_group(conn, Q, "free", "set", ["0", "", "", ""])  # no cap of its own
    for g in ("x", "own", "free"):
        await b.enqueue_group(conn, Q, g, [g.encode() + b"1", g.encode() + b"2", g.encode() + b"3"])
    assert len((await b.claim(conn, "w1", inc, Q, 9, 3)).processes) == 9
    for g in ("x", "own", "free"):
        await b.enqueue_group(conn, Q, g, [g.encode() + b"4"])
    await b.configure_group(conn, Q, "", "set", ["1", "", "", ""])
    # x and own take the default cap: their jobs count; free keeps none
    assert [await count(conn, keys, g) for g in ("x", "own", "free")] == [3, 3, None]
    (p,) = (await b.claim(conn, "w1", inc, Q, 9, 3)).processes
    assert p.task == b"free4"
    await no_violation(conn, keys, ["x", "own", "free"])
    # the default goes: the counts go, and the groups are ready again
    await b.configure_group(conn, Q, "", "clear", [])
    assert [await count(conn, keys, g) for g in ("x", "own", "free")] == [None] * 3
    rest = (await b.claim(conn, "w1", inc, Q, 9, 3)).processes
    assert sorted(p.task for p in rest) == [b"own4", b"x4"]
    await no_violation(conn, keys, ["x", "own", "free"])


async def test_a_retry_holds_a_slot_in_a_group_with_or_without_a_cap(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.enqueue_group(conn, Q, "free", [b"f"])
    await b.enqueue_group(conn, Q, "capped", [b"c"])
    await b.configure_group(conn, Q, "capped", "set", ["1", "", "", ""])
    ps = {p.task: p for p in (await b.claim(conn, "w1", inc, Q, 5, 3)).processes}
    assert [await count(conn, keys, g) for g in ("free", "capped")] == [None, 1]
    out = await b.give_back(
        conn, "w1", Q, [ps[b"f"].id, ps[b"c"].id], failed=True, backoff_ms=30, backoff_cap_ms=30
    )
    assert out == [(2, 30), (2, 30)]
    # each retry holds its slot while it waits
    assert [await count(conn, keys, g) for g in ("free", "capped")] == [1, 1]
    await no_violation(conn, keys, ["free", "capped"])
    # a cap for free while its retry waits: the retry still counts, once
    await b.configure_group(conn, Q, "free", "set", ["1", "", "", ""])
    assert await count(conn, keys, "free") == 1
    await anyio.sleep(0.05)
    ps2 = (await b.claim(conn, "w1", inc, Q, 5, 3)).processes
    assert sorted(p.task for p in ps2) == [b"c", b"f"]
    assert [await count(conn, keys, g) for g in ("free", "capped")] == [1, 1]
    await b.finish(conn, "w1", inc, Q, [p.id for p in ps2])
    assert [await count(conn, keys, g) for g in ("free", "capped")] == [None, None]
    await no_violation(conn, keys, ["free", "capped"])


async def test_two_retries_of_one_payload_hold_one_slot(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # The same payload twice in a capped group: both fail; their retries
    # are one delayed member, which frees one slot when due, so the other
    # slot must be freed when they merge (else the cap shrinks for good).
    i1 = await join(b, conn, "w1", Q)
    await b.configure_group(conn, Q, "t", "set", ["2", "", "", ""])
    await b.enqueue_group(conn, Q, "t", [b"same", b"same"])
    ps = (await b.claim(conn, "w1", i1, Q, 5, 10)).processes
    assert [p.task for p in ps] == [b"same", b"same"]
    out = await b.give_back(
        conn, "w1", Q, [p.id for p in ps], failed=True, backoff_ms=10, backoff_cap_ms=10
    )
    assert out == [(2, 10), (2, 10)]
    assert await count(conn, keys, "t") == 1
    await no_violation(conn, keys, ["t"])
    # and through a dead worker's recycle
    await anyio.sleep(0.03)
    await b.enqueue_group(conn, Q, "t", [b"same"])
    ps = (await b.claim(conn, "w1", i1, Q, 5, 10, backoff_ms=10, backoff_cap_ms=10)).processes
    assert [p.task for p in ps] == [b"same", b"same"]
    await expire_worker(conn, keys, "w1")
    await b.recycle(conn, "w1", leave=False)
    assert await conn.execute("ZCARD", keys.group_delayed(Q)) == 1  # both wait, as one
    assert await count(conn, keys, "t") == 1
    await no_violation(conn, keys, ["t"])


async def test_a_cap_set_on_a_running_group_holds_across_workers(
    redis_url: str, namespace: str
) -> None:
    # Through the library: two workers run an uncapped group's jobs; once a
    # cap of 1 is set, and the jobs that had started before end, never more
    # than one runs (sampled from Redis while the group drains).
    async def handler(p: mesh.Process) -> None:
        await anyio.sleep(0.02)

    async with mesh.open_client(redis_url, namespace=namespace) as c:
        await c.enqueue_many(Q, [b"%d" % i for i in range(40)], group="t")
        async with (
            mesh.open_worker(redis_url, namespace=namespace) as w1,
            mesh.open_worker(redis_url, namespace=namespace) as w2,
        ):
            for w in (w1, w2):
                await w.start_work(Q, handler, concurrency=4)

            async def running() -> int:
                return sum(1 for p in await c.processes(Q) if p.group == "t")

            async def four() -> bool:
                return await running() >= 4

            async def at_most_one() -> bool:
                return await running() <= 1

            await wait_until(four, what="four of t's jobs running")
            await c.configure_group(Q, "t", concurrency=1)
            await wait_until(at_most_one, what="the jobs started before the cap ended")
            most, seen = 0, 0
            while (look := await c.groups(Q)).queued or look.running:
                most = max(most, await running())
                seen += 1
                await anyio.sleep(0.002)
    assert most == 1 and seen > 10


async def test_a_crashed_jobs_retry_holds_a_slot_in_a_group_without_a_cap(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    # A job of a group without a cap (while another group has settings of
    # its own) crashes twice: the first recycle puts it back at once, the
    # second sends it to its backoff, and the retry then counts in r:G
    # (the recycle's hold) until it is due.
    await b.configure_group(conn, Q, "other", "set", ["2", "", "", ""])
    for i, w in enumerate(("w1", "w2")):
        inc = await join(b, conn, w, Q)
        if i == 0:
            await b.enqueue_group(conn, Q, "free", [b"j"])
        (p,) = (await b.claim(conn, w, inc, Q, 5, 10, backoff_ms=20, backoff_cap_ms=20)).processes
        assert (p.task, p.attempts) == (b"j", i)
        await expire_worker(conn, keys, w)
        r = await b.recycle(conn, w, leave=False)
        assert r.returned == 1
    assert await count(conn, keys, "free") == 1
    assert await conn.execute("ZCARD", keys.group_delayed(Q)) == 1
    await no_violation(conn, keys, ["free", "other"])
    await anyio.sleep(0.05)
    inc = await join(b, conn, "w3", Q)
    (p,) = (await b.claim(conn, "w3", inc, Q, 5, 10)).processes
    assert (p.task, p.attempts) == (b"j", 2)
    assert await count(conn, keys, "free") is None
    await no_violation(conn, keys, ["free", "other"])
