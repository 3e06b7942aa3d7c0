"""SIGSTOP/SIGCONT: a paused owner is replaced after its lease runs out, and
when it wakes up its handlers are cancelled before they act again; its late
writes are refused by the sink by token. Short pauses cause no takeover, and
a pause racing the recycle leaves every task in exactly one place."""

from __future__ import annotations

import random

import pytest
import trio

from mesh._harness.harness import Driver, Harness, figure, payloads
from mesh.testing import wait_until

from .conftest import TTL

pytestmark = [pytest.mark.slow, pytest.mark.worker_loops]


async def test_a_paused_owner_is_replaced_and_cannot_act_when_it_wakes(h: Harness) -> None:
    (a,) = await h.start(1, "--manual", "manual")
    devices = payloads("dev", 3)
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue("manual", b"!hold=2.5;m")
    await wait_until(lambda: h.runs(a, devices), 5, "A runs the devices")
    await h.wait_event(lambda e: e.action == "claimed" and e.tag == a.tag, 5, "A claims m")
    (b,) = await h.start(1, "--manual", "manual", "--no-rebalance")
    a_id = await h.worker_id(a)
    ev = await h.events()
    a_tokens = {e.task: e.token for e in ev if e.action == "start" and e.tag == a.tag}
    lease_left = await h.conn.execute("PTTL", h.keys.heartbeat(a_id)) / 1000

    async with h.monitor({"devices": set(devices)}, {"manual": {b"!hold=2.5;m"}}) as mon:
        stopped_at = await h.sink_now()
        a.stop()
        await wait_until(lambda: h.runs(b, devices), 4 * TTL, "B takes the devices")
        ev = await h.events()
        took = (
            max(
                next(e.t for e in ev if e.action == "start" and e.tag == b.tag and e.task == d)
                for d in devices
            )
            - stopped_at
        )
        assert lease_left - 0.05 < took < 2 * TTL
        # Not a synchronisation: A stays stopped for 2 TTL in all.
        await trio.sleep(max(0.0, stopped_at + 2 * TTL - await h.sink_now()))
        resumed_at = await h.sink_now()
        a.cont()

        async def a_stood_down() -> bool:
            ev = await h.events()
            cancelled = {e.token for e in ev if e.action == "cancelled" and e.tag == a.tag}
            finished = [e for e in ev if e.action == "finish" and e.tag == a.tag]
            rejoined = any(e.action == "id" and e.tag == a.tag for e in ev)
            # its warning is flushed to the sink every 50 ms, after the fact
            warned = any(e.action == "log" and "fenced" in e.extra for e in ev if e.tag == a.tag)
            return cancelled >= set(a_tokens.values()) and bool(finished) and rejoined and warned

        await wait_until(a_stood_down, 5 * TTL, "A stands down and rejoins")
    ev = await h.events()
    for task, tok in a_tokens.items():
        cancelled_at = next(e.seq for e in ev if e.action == "cancelled" and e.token == tok)
        late = [e for e in ev if e.fenced and e.token == tok and e.t > resumed_at]
        # no action between waking up and being cancelled, beyond one in flight
        assert len(late) <= 1, (task, late)
        assert all(not e.ok for e in late)
        assert all(e.seq < cancelled_at for e in late)
    # the stale owner's finish of the manual task was refused
    assert [e.extra for e in ev if e.action == "finish" and e.tag == a.tag] == ["False"]
    assert any("fenced" in w for w in await h.warnings(a))
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1
    assert mon.violations == [] and mon.samples > 20
    # B owns the devices (A, back under a new id, may have been handed its
    # share by a rebalance since); the old identity owns nothing
    snap = await h.snapshot(["devices"])
    b_id = await h.worker_id(b)
    new_a = await h.worker_id(a)
    owners = {p.worker for p in snap.queues["devices"].procs.values()}
    assert b_id in owners and owners <= {b_id, new_a}
    assert new_a != a_id and snap.workers.get(new_a) is True and a_id not in snap.workers
    figure("sigstop_2ttl", ttl=TTL, lease_left=round(lease_left, 3), takeover=round(took, 3))


async def test_late_writes_of_a_paused_owner_are_refused_by_token(h: Harness) -> None:
    (a,) = await h.start(1)
    await h.client.ensure("devices", b"!stallwrite;dev")
    await h.wait_event(lambda e: e.action == "start" and e.tag == a.tag, 5, "A starts")
    (b,) = await h.start(1)
    # A freezes itself (a GC pause, a blocking call) at its third action, until
    # B owns the task; then its write, already on its way, reaches the sink.
    late = await h.wait_event(
        lambda e: e.extra == "late" and e.tag == a.tag, 5 * TTL, "A's late write"
    )
    assert not late.ok
    ev = await h.events()
    b_start = next(e for e in ev if e.action == "start" and e.tag == b.tag)
    assert b_start.token > late.token and b_start.seq < late.seq
    await h.wait_event(lambda e: e.action == "id" and e.tag == a.tag, 5 * TTL, "A rejoins")
    v = await h.judge()
    assert v.rejected >= 1 and v.overlaps == [] and v.max_owners == 1
    assert not [
        e
        for e in await h.events()
        if e.token == late.token and e.fenced and e.ok and e.seq > late.seq
    ]


async def pause_and_watch(h: Harness, d: Driver, pause: float) -> None:
    """Pause ``d`` for ``pause`` seconds, at a random phase of its heartbeat
    cycle (the test cannot see that cycle, so it samples it)."""
    await trio.sleep(random.random() * TTL / 3)  # the scenario: a random phase
    d.stop()
    try:
        await trio.sleep(pause)  # the scenario: the pause itself
    finally:
        d.cont()


@pytest.mark.parametrize(
    ("pause", "args"),
    [
        # with the default timing a pause shorter than R - H (= TTL/3) is
        # always absorbed, whatever the phase of the heartbeat cycle
        (0.25 * TTL, ()),
        # a heartbeat every TTL/10 absorbs a pause of half the TTL
        (0.5 * TTL, ("--interval", str(TTL / 10))),
    ],
)
async def test_a_short_pause_changes_nothing(
    h: Harness, pause: float, args: tuple[str, ...]
) -> None:
    a, b = await h.start(2, *args)
    devices = payloads("dev", 4)
    await h.client.ensure_many("devices", devices)

    async def all_running() -> dict[bytes, tuple[str, str]] | None:
        snap = await h.snapshot(["devices"])
        owners = {p.payload: (p.id, p.worker) for p in snap.queues["devices"].procs.values()}
        return owners if len(owners) == len(devices) else None

    before = await wait_until(all_running, 5, "devices running")
    for _ in range(3):
        for d in (a, b):
            await pause_and_watch(h, d, pause)
            await trio.sleep(0.2)  # not a synchronisation: pauses 0.2 s apart
    assert await all_running() == before  # same processes, same owners
    assert not [e for e in await h.events() if e.action in ("id", "cancelled")]
    v = await h.judge()
    assert v.rejected == 0 and v.overlaps == []


async def test_half_ttl_pauses_with_the_default_timing(h: Harness) -> None:
    """A pause of TTL/2 exceeds R - (time since the last heartbeat was sent)
    when it starts late in the heartbeat cycle (about half of the time with
    H = T/3, R = 2T/3): the worker then fences itself on waking and hands its
    processes back. The lease never runs out, so no peer recycles it (no
    attempt is counted) and every task stays in exactly one place."""
    a, b = await h.start(2)
    devices = payloads("dev", 4)
    jobs = [b"!hold=60;job%d" % i for i in range(4)]
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", jobs)
    fenced = 0
    async with h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}) as mon:
        for i in range(8):
            d = (a, b)[i % 2]
            before = await h.worker_id(d)
            await pause_and_watch(h, d, 0.5 * TTL)

            async def settled() -> bool:
                snap = await h.snapshot()
                return all(len(snap.owners("devices", p)) == 1 for p in devices) and all(
                    len(snap.owners("jobs", j)) == 1 for j in jobs
                )

            # not a synchronisation: the pause's effects (a fence) play out first
            await trio.sleep(0.3)
            await wait_until(settled, 3 * TTL, "every task running again")
            fenced += await h.worker_id(d) != before
        snap = await h.snapshot()
    assert mon.violations == []
    # never recycled by a peer: no one-shot attempt was counted
    assert {p.attempts for p in snap.queues["jobs"].procs.values()} == {0}
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1
    figure("pause_half_ttl_default_timing", pauses=8, self_fenced=fenced)


async def test_a_pause_racing_the_recycle_leaves_every_task_in_one_place(h: Harness) -> None:
    # each recycle of a paused worker counts an attempt of its one-shot tasks:
    # no limit here, or five pauses would dead-letter them
    a, b = await h.start(2, "--max-attempts", "0")
    devices = payloads("dev", 6)
    jobs = [b"!hold=60;job%d" % i for i in range(6)]
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", jobs)

    async def settled() -> bool:
        """Every task in one place, nothing held by a worker that is not live
        (tasks may wait out a backoff after a recycle counted a crash)."""
        snap = await h.snapshot()
        live = all(
            snap.workers.get(p.worker) for q in snap.queues.values() for p in q.procs.values()
        )
        return (
            live
            and sorted(snap.places("devices").elements()) == sorted(devices)
            and sorted(snap.places("jobs").elements()) == sorted(jobs)
        )

    async with h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}, every=0.005) as mon:
        for i, pause in enumerate((0.9, 0.97, 1.0, 1.03, 1.1)):
            d = (a, b)[i % 2]
            await pause_and_watch(h, d, pause * TTL)
            await trio.sleep(0.2)  # not a synchronisation: the pause's effects play out
            await wait_until(settled, 4 * TTL, "every task in one place, owners live")
    assert mon.violations == [] and mon.samples > 100
    v = await h.judge()
    assert v.overlaps == [] and v.max_owners == 1
    assert await settled()
