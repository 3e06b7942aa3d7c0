"""SIGTERM: a worker that stops gracefully hands every process back at once
(milliseconds, not a TTL), with no overlap of owners and no attempt counted."""

from __future__ import annotations

import json

import pytest

from mesh._harness.harness import Harness, figure, payloads
from mesh.testing import wait_until

from .conftest import TTL

pytestmark = [pytest.mark.slow, pytest.mark.worker_loops]


async def test_sigterm_hands_everything_back_at_once_without_overlap(h: Harness) -> None:
    (a,) = await h.start(1)
    devices = payloads("dev", 4)
    jobs = [b"!hold=60;job%d" % i for i in range(4)]
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", jobs)

    await wait_until(lambda: h.runs(a, devices + jobs), 5, "A runs every task")
    a_id = await h.worker_id(a)
    (b,) = await h.start(1)
    async with h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}) as mon:
        term_at = await h.sink_now()
        a.term()

        async def b_runs_all() -> bool:
            started = {e.task for e in await h.events() if e.action == "start" and e.tag == b.tag}
            return started >= set(devices + jobs)

        await wait_until(b_runs_all, TTL, "B takes every task at once")
        assert await a.wait_exit(5) == 0
    ev = await h.events()
    took = []
    for t in devices + jobs:
        a_events = [e for e in ev if e.task == t and e.tag == a.tag]
        b_start = next(e for e in ev if e.task == t and e.tag == b.tag and e.action == "start")
        # A's handler stopped (and acted for the last time) before B started
        assert a_events[-1].action == "cancelled" and a_events[-1].seq < b_start.seq
        if t in jobs:
            assert b_start.extra == "0"  # handed back: no failed attempt counted
        took.append(b_start.t - term_at)
    assert max(took) < TTL / 2
    assert mon.violations == []
    v = await h.judge()
    assert v.rejected == 0 and v.overlaps == [] and v.max_owners == 1
    assert a_id not in {w.id for w in await h.client.workers()}
    stats = json.loads(next(e.extra for e in ev if e.action == "exit" and e.tag == a.tag))
    figure("sigterm", ttl=TTL, handback_max=round(max(took), 3), leave_s=stats["leave_s"])


async def test_sigterm_with_a_slow_cleanup_keeps_one_owner_and_costs_no_attempt(
    h: Harness,
) -> None:
    """The issue's case: handlers that take 2 s (shielded) to clean up, a TTL
    of 1.5 s, one-shot jobs with max_attempts 1. The stopping worker renews
    its lease until each handler has exited, then hands the task back: the
    peer starts it only after the old handler's last event, and the job is
    neither dead-lettered nor counted as failed."""
    ttl = "1.5"
    (a,) = await h.start(1, "--ttl", ttl, "--max-attempts", "1")
    devices = [b"!slowstop=2;dev0"]
    jobs = [b"!hold=60;slowstop=2;job0"]
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", jobs)
    await wait_until(lambda: h.runs(a, devices + jobs), 5, "A runs every task")
    (b,) = await h.start(1, "--ttl", ttl, "--max-attempts", "1")
    async with h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}) as mon:
        term_at = await h.sink_now()
        a.term()
        await wait_until(lambda: h.runs(b, devices + jobs), 10, "B takes every task")
        assert await a.wait_exit(5) == 0
    ev = await h.events()
    gaps = []
    for t in devices + jobs:
        a_last = [e for e in ev if e.task == t and e.tag == a.tag][-1]
        b_start = next(e for e in ev if e.task == t and e.tag == b.tag and e.action == "start")
        # A's handler exited (its cleanup took 2 s, past the TTL) before B started
        assert a_last.action == "cancelled" and a_last.seq < b_start.seq
        assert a_last.t - term_at >= 2.0
        assert b_start.extra == "0"  # no failed attempt counted
        gaps.append(b_start.t - a_last.t)
    assert max(gaps) < 1.0  # handed back when the handler exited, not after T
    assert await h.client.dead_letters("jobs") == []
    assert mon.violations == []
    v = await h.judge()
    assert v.rejected == 0 and v.overlaps == [] and v.max_owners == 1
    figure("slow_stop", ttl=ttl, cleanup_s=2, handoff_gap_max=round(max(gaps), 3))
