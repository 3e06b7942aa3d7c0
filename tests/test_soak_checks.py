"""The soak's checks of groups (mesh/_harness/checks.py, issue 36), against a
real redis-server: the atomic snapshot finds a group's queued, delayed and
running jobs; a group above its cap, a running count that is not its
processes and a queued count that is not its lists are found; once the
jobs are done, only the settings are left, and a leaked slot is found."""

from __future__ import annotations

from mesh._binding import Binding
from mesh._connection import Connection
from mesh._harness import checks
from mesh._keys import Keys

from .protocol_helpers import join

Q = "jobs"


async def test_the_snapshot_finds_group_jobs_and_their_counts_agree(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.configure_group(conn, Q, "capped", "set", ["2", "", "", ""])
    await b.enqueue_group(conn, Q, "capped", [b"c0", b"c1", b"c2"])
    await b.enqueue_group(conn, Q, "free", [b"f0"])
    running = (await b.claim(conn, "w1", inc, Q, 10, 0)).processes
    assert sorted(p.task for p in running) == [b"c0", b"c1", b"f0"]
    # a delayed job (the member: group, NUL, flag, level, payload), and a
    # queued one with a priority (in the group's priority set)
    await conn.execute("ZADD", keys.group_delayed(Q), 1, b"free\0d0later")
    await b.enqueue_group(conn, Q, "capped", [b"urgent"], priority=5)
    snap = await checks.snapshot(conn, keys, [Q], ["capped", "free"])
    places = snap.places(Q)
    found = [places[p] for p in (b"c0", b"c1", b"c2", b"f0", b"later", b"urgent")]
    assert found == [1, 1, 1, 1, 1, 1]
    assert checks.running_by_group(snap, Q) == {"capped": 2, "free": 1}
    assert checks.group_violations(snap, Q, {"capped": 2}) == []
    # a cap of 1 is exceeded by the 2 running
    (over,) = checks.group_violations(snap, Q, {"capped": 1})
    assert "runs 2 jobs, above its cap 1" in over
    # a group's jobs not named to the snapshot are not seen
    unnamed = await checks.snapshot(conn, keys, [Q])
    assert unnamed.places(Q)[b"c2"] == 0


async def test_a_leaked_slot_and_leftovers_are_found(
    conn: Connection, b: Binding, keys: Keys
) -> None:
    inc = await join(b, conn, "w1", Q)
    await b.configure_group(conn, Q, "capped", "set", ["2", "", "", ""])
    await b.enqueue_group(conn, Q, "capped", [b"c0"])
    (p,) = (await b.claim(conn, "w1", inc, Q, 10, 0)).processes
    await b.finish(conn, "w1", inc, Q, [p.id])
    assert await checks.group_leftovers(conn, keys, Q) == []  # only the settings
    snap = await checks.snapshot(conn, keys, [Q], ["capped"])
    assert checks.group_violations(snap, Q, {"capped": 2}) == []
    # a slot that no process or retry holds: a leak, in the snapshot and at the end
    await conn.execute("HSET", keys.groups(Q), "r:capped", 1)
    snap = await checks.snapshot(conn, keys, [Q], ["capped"])
    (leak,) = checks.group_violations(snap, Q, {"capped": 2})
    assert "counts 1 slots in use, holds 0" in leak
    (left,) = await checks.group_leftovers(conn, keys, Q)
    assert "'r:capped'" in left
    # a group list left behind, and a queued count that is not the lists
    await conn.execute("RPUSH", keys.group_jobs(Q, "capped"), b"stray")
    snap = await checks.snapshot(conn, keys, [Q], ["capped"])
    assert any("0 group jobs counted queued" in v for v in checks.group_violations(snap, Q, {}))
    assert any(
        keys.group_jobs(Q, "capped") in x for x in await checks.group_leftovers(conn, keys, Q)
    )
