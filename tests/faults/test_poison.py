"""A poison task kills every worker that runs it: a one-shot task counts each
crash as a failed attempt and is dead-lettered at the limit; a persistent
task must back off instead of killing the next worker at once."""

from __future__ import annotations

import pytest

from mesh._harness.harness import Harness
from mesh._harness.sink import Event
from mesh.testing import wait_until

from .conftest import TTL

pytestmark = pytest.mark.slow


async def test_a_poison_one_shot_task_is_dead_lettered_after_the_attempt_limit(
    h: Harness,
) -> None:
    drivers = await h.start(4, "--max-attempts", "3")
    await h.client.enqueue("jobs", b"!kill;poison")

    async def dead() -> list[bytes]:
        return [d.task for d in await h.client.dead_letters("jobs")]

    assert await wait_until(dead, 3 * (TTL + 1), "the poison task dead-lettered") == [
        b"!kill;poison"
    ]
    starts = [e for e in await h.events() if e.action == "start"]
    assert [e.extra for e in starts] == ["0", "1", "2"]  # attempts before each run
    assert [e.token for e in starts] == sorted({e.token for e in starts})
    assert sum(not d.alive for d in drivers) == 3
    # the survivor goes on working
    jobs = [b"after%d" % i for i in range(10)]
    await h.client.enqueue_many("jobs", jobs)

    async def done() -> bool:
        v = await h.judge()
        return all(v.done_count.get(j) == 1 for j in jobs)

    await wait_until(done, 5, "later jobs done")

    # the handlers' last events come before their finish reports reach Redis
    async def settled() -> tuple[int, int, int, int]:
        info = await h.client.queue_info("jobs")
        return info.queued, info.running, info.delayed, info.dead

    async def finished() -> bool:
        return (await settled())[:2] == (0, 0)

    await wait_until(finished, 2 * TTL, "the finish reports")
    assert await settled() == (0, 0, 0, 1)


async def test_a_persistent_task_that_kills_its_worker_backs_off(h: Harness) -> None:
    await h.start(3, "--backoff", "1.0")
    await h.client.ensure("devices", b"!kill;pdev")

    async def three_starts() -> list[float] | None:
        ts = [e.t for e in await h.events() if e.action == "start"]
        return ts if len(ts) >= 3 else None

    t = await wait_until(three_starts, 10 * TTL, "three owners")
    # The first crash is an ordinary failover (a worker may die for other
    # reasons); from the second on, the claimer's backoff (1 s) applies too.
    # Each gap also holds the rest of the dead worker's lease, T minus up to
    # one heartbeat interval, so compare the gaps: the backoff makes the
    # second at least 1 s - H (about 0.67 s) longer.
    first, second = t[1] - t[0], t[2] - t[1]
    assert first < TTL + 0.5
    assert second - first > 0.5, (first, second)


async def test_a_healthy_persistent_task_fails_over_promptly_after_a_second_crash(
    h: Harness,
) -> None:
    """Not a poison task: it runs for 2.5 T on each owner before that owner is
    killed for reasons of its own. Both failovers must stay within the
    failover budget (the rest of the lease plus a few hundred ms)."""
    drivers = {d.tag: d for d in await h.start(3, "--backoff", "2.0")}
    await h.client.ensure("devices", b"dev")
    gaps = []
    for _ in range(2):
        owner = await h.wait_event(
            lambda e: e.action == "start" and e.tag in drivers, 5 * TTL, "an owner"
        )
        d = drivers.pop(owner.tag)

        async def acted_for_a_while(tok: int = owner.token) -> bool:
            acts = [e for e in await h.events() if e.action == "act" and e.token == tok]
            return bool(acts) and acts[-1].t - acts[0].t > 2.5 * TTL

        await wait_until(acted_for_a_while, 5 * TTL, "the owner runs for 2.5 T")
        wid = await h.worker_id(d)
        lease_left = await h.conn.execute("PTTL", h.keys.heartbeat(wid)) / 1000
        killed_at = await h.sink_now()
        d.kill()

        def next_owner(e: Event, t: int = owner.token) -> bool:
            return e.action == "start" and e.token > t

        nxt = await h.wait_event(next_owner, 10 * TTL, "next owner")
        gaps.append(nxt.t - killed_at - lease_left)
    # after the lease ran out: the first crash goes back at once ...
    assert gaps[0] < 0.5, gaps
    # ... and so must the second: this task never killed anyone
    assert gaps[1] < 0.5, gaps
