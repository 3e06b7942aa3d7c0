"""The network between a worker and Redis fails (a TCP proxy in between):
a cut worker fences itself before its peers may take over and rejoins under
a new id when the cut heals; a reply lost after its script ran is retried
safely (no task in two places, none stuck, none counted twice)."""

from __future__ import annotations

import pytest
import trio

from mesh import MeshConnectionError
from mesh._harness.harness import Harness, figure, payloads
from mesh._scripts import load_scripts
from mesh.testing import wait_until

from .conftest import TTL

pytestmark = pytest.mark.slow

QUEUES = ("devices", "jobs")


@pytest.mark.parametrize("how", ["stall", "cut"])
async def test_a_cut_worker_fences_itself_before_peers_take_over(h: Harness, how: str) -> None:
    proxy = await h.proxy()
    # Neither asks for a share of the other's tasks (--no-rebalance): every
    # task moves only by the cut and by B's leaving. (A rejoined below its
    # share used to pull a device from B before B left, now and then.)
    (a,) = await h.start(1, "--no-rebalance", url=proxy.url)
    devices = payloads("dev", 4)
    jobs = [b"!hold=60;job%d" % i for i in range(4)]
    await h.client.ensure_many("devices", devices)
    await h.client.enqueue_many("jobs", jobs)
    await wait_until(lambda: h.runs(a, devices + jobs), 5, "A runs every task")
    a_id = await h.worker_id(a)
    (b,) = await h.start(1, "--no-rebalance")
    lease_left = await h.conn.execute("PTTL", h.keys.heartbeat(a_id)) / 1000
    async with h.monitor({"devices": set(devices)}, {"jobs": set(jobs)}) as mon:
        cut_at = await h.sink_now()
        getattr(proxy, how)()
        await wait_until(lambda: h.runs(b, devices + jobs), 4 * TTL, "B takes over")
        ev = await h.events()
        fenced_at, taken_at = [], []
        for t in devices + jobs:
            a_cancel = next(
                e for e in ev if e.task == t and e.tag == a.tag and e.action == "cancelled"
            )
            b_start = next(e for e in ev if e.task == t and e.tag == b.tag and e.action == "start")
            assert a_cancel.seq < b_start.seq  # stopped before the peer started
            fenced_at.append(a_cancel.t - cut_at)
            taken_at.append(b_start.t - cut_at)
        # A fenced itself at R after its last confirmed heartbeat was sent
        assert max(fenced_at) < 2 * TTL / 3 + 0.15
        assert min(taken_at) > lease_left - 0.05  # peers waited for the lease
        # Not a synchronisation: the cut lasts 2 TTL in all.
        await trio.sleep(max(0.0, cut_at + 2 * TTL - await h.sink_now()))
        proxy.heal()
        e = await h.wait_event(lambda e: e.action == "id" and e.tag == a.tag, 5 * TTL, "rejoin")
        new_id = e.worker
        assert new_id != a_id
        # Its hand-back gave up after T during the cut (it never loops forever),
        # so the new id may be announced before the cut heals: it registers
        # once Redis answers again.

        async def registered() -> bool:
            return (await h.snapshot()).workers.get(new_id) is True

        await wait_until(registered, 5 * TTL, "the new id registered", every=0.02)

        # It serves again, all the way: its runners wait in the idle sets
        # and its wake channel has a subscriber (registered is not enough:
        # it serves and subscribes right after). Then, when B leaves, A
        # takes everything at once.
        async def serving() -> bool:
            k = h.keys
            idle = [await h.conn.execute("SISMEMBER", k.idle(q), new_id) for q in QUEUES]
            _, subscribers = await h.conn.execute("PUBSUB", "NUMSUB", k.wake_channel(new_id))
            return all(idle) and int(subscribers) > 0

        await wait_until(serving, 5 * TTL, "A to serve both queues and listen for wakes")
        left_at = await h.sink_now()
        b.term()
        try:
            await wait_until(
                lambda: h.runs(a, devices + jobs, since=left_at), TTL, "A takes all back"
            )
        except trio.TooSlowError:
            # what each side did since (so a failure in CI says where the time went)
            seen = [
                (round(e.t - left_at, 3), e.tag, e.action, e.task)
                for e in await h.events()
                if e.t >= left_at and e.action != "act"
            ]
            raise AssertionError(f"A took not all back within T; since B left: {seen}") from None
    assert mon.violations == []
    v = await h.judge()
    assert v.rejected == 0 and v.overlaps == [] and v.max_owners == 1
    figure(
        f"network_{how}",
        ttl=TTL,
        self_fence_max=round(max(fenced_at), 3),
        takeover_min=round(min(taken_at), 3),
        margin=round(min(taken_at) - max(fenced_at), 3),
    )


async def _any(coro: object, want: list[bytes]) -> bool:
    return bool(await coro & set(want))  # type: ignore[misc]


def sha(name: str) -> bytes:
    return load_scripts()[name].sha.encode()


async def test_a_worker_whose_connection_went_half_open_rejoins(h: Harness) -> None:
    """The connection is not reset but silently dead (the peer host vanished, a
    NAT forgot the flow); a new connection would work. The worker must stand
    down before its peers take over (it does) and rejoin under a new id in
    bounded time."""
    proxy = await h.proxy()
    (a,) = await h.start(1, url=proxy.url)
    devices = payloads("dev", 3)
    await h.client.ensure_many("devices", devices)
    await wait_until(lambda: h.runs(a, devices), 5, "A runs the devices")
    (b,) = await h.start(1)
    a_tokens = {e.token for e in await h.events() if e.action == "start" and e.tag == a.tag}
    # a worker gives up on a connection that owes replies and sends nothing
    # for max(2 T, 5 s), then reconnects
    reply_timeout = max(2 * TTL, 5.0)
    async with h.monitor({"devices": set(devices)}) as mon:
        frozen_at = await h.sink_now()
        proxy.freeze()
        await wait_until(lambda: h.runs(b, devices), 4 * TTL, "B takes over")
        ev = await h.events()
        assert {e.token for e in ev if e.action == "cancelled" and e.tag == a.tag} == a_tokens
        e = await h.wait_event(
            lambda e: e.action == "id" and e.tag == a.tag, reply_timeout + 3 * TTL, "A rejoins"
        )
        # The new id is announced when the hand-back gives up (after T); it is
        # registered once the half-open socket is replaced.

        async def registered() -> bool:
            return (await h.snapshot(["devices"])).workers.get(e.worker) is True

        await wait_until(registered, reply_timeout + 3 * TTL, "A registered", every=0.02)
        rejoined = await h.sink_now() - frozen_at
        assert rejoined < reply_timeout + TTL
    assert mon.violations == []
    v = await h.judge()
    assert v.rejected == 0 and v.overlaps == []
    figure("half_open", ttl=TTL, reply_timeout=reply_timeout, rejoined=round(rejoined, 3))


async def test_a_lost_claim_reply_is_handed_back_and_run(h: Harness) -> None:
    proxy = await h.proxy()
    await h.start(1, url=proxy.url)
    lost = proxy.lose_reply_to(sha("claim"))
    await h.client.ensure("devices", b"dev")
    async with h.monitor({"devices": {b"dev"}}, {"jobs": {b"job"}}) as mon:
        with trio.fail_after(5):
            await lost.wait()
        lost = proxy.lose_reply_to(sha("claim"))
        await h.client.enqueue("jobs", b"job")
        with trio.fail_after(5):
            await lost.wait()
        await h.wait_event(lambda e: e.task == b"job" and e.action == "done", 5, "job done")
        await h.wait_event(lambda e: e.task == b"dev" and e.action == "act", 5, "dev runs")
    ev = await h.events()
    # one start of each: the lost claims' processes were handed back, never run
    assert sorted(e.task for e in ev if e.action == "start") == [b"dev", b"job"]
    assert [e.extra for e in ev if e.action == "start" and e.task == b"job"] == ["0"]
    snap = await h.snapshot()
    assert [p.payload for p in snap.queues["devices"].procs.values()] == [b"dev"]
    assert snap.queues["jobs"].procs == {} and snap.places("jobs") == {}
    # the running device's token is not the lost claim's one
    (p,) = snap.queues["devices"].procs.values()
    assert next(e.token for e in ev if e.action == "start" and e.task == b"dev") == int(p.id)
    assert mon.violations == []
    assert proxy.lost_replies == 2
    assert not [e for e in ev if e.action == "id"]  # no fencing needed


async def test_a_lost_claim_reply_is_recovered_even_if_the_recovery_is_cut_too(
    h: Harness,
) -> None:
    """The runner's re-check after a lost claim reply (which processes does
    Redis say we hold?) can itself lose its connection: the orphaned process
    must still be handed back, not held by a live worker that never runs it."""
    proxy = await h.proxy()
    await h.start(1, url=proxy.url)
    lost = proxy.lose_reply_to(sha("claim"))
    await h.client.ensure("devices", b"dev")
    with trio.fail_after(5):
        await lost.wait()
    lost = proxy.lose_reply_to(b"SMEMBERS")  # the re-check's read
    with trio.fail_after(5):
        await lost.wait()
    await h.wait_event(lambda e: e.task == b"dev" and e.action == "act", 3, "dev runs")
    snap = await h.snapshot(["devices"])
    assert [p.payload for p in snap.queues["devices"].procs.values()] == [b"dev"]


async def test_a_lost_finish_reply_is_retried_and_the_task_runs_once(h: Harness) -> None:
    proxy = await h.proxy()
    await h.start(1, url=proxy.url)
    lost = proxy.lose_reply_to(sha("finish"))
    await h.client.enqueue_many("jobs", [b"j1", b"j2", b"j3"])
    with trio.fail_after(5):
        await lost.wait()

    async def drained() -> bool:
        info = await h.client.queue_info("jobs")
        return info.queued == info.running == info.delayed == 0

    await wait_until(drained, 5, "every job finished")
    v = await h.judge()
    assert v.done_count == {b"j1": 1, b"j2": 1, b"j3": 1}
    assert sum(e.action == "start" for e in await h.events()) == 3


async def test_a_lost_give_back_reply_counts_the_failure_once(h: Harness) -> None:
    proxy = await h.proxy()
    await h.start(1, "--max-attempts", "3", "--backoff", "0.05", url=proxy.url)
    lost = proxy.lose_reply_to(sha("give_back"))
    await h.client.enqueue("jobs", b"!fail;p")
    with trio.fail_after(5):
        await lost.wait()

    async def dead() -> list[bytes]:
        return [d.task for d in await h.client.dead_letters("jobs")]

    assert await wait_until(dead, 5, "dead letter") == [b"!fail;p"]
    # three attempts, not fewer: the retried give_back did not count twice
    assert [e.extra for e in await h.events() if e.action == "start"] == ["0", "1", "2"]


async def test_a_lost_heartbeat_reply_does_not_fence(h: Harness) -> None:
    proxy = await h.proxy()
    (d,) = await h.start(1, url=proxy.url)
    await h.client.ensure_many("devices", payloads("dev", 3))
    await h.wait_event(lambda e: e.action == "act", 5, "devices run")
    for _ in range(3):
        lost = proxy.lose_reply_to(sha("heartbeat"))
        with trio.fail_after(5):
            await lost.wait()
        await trio.sleep(TTL / 3)  # not a synchronisation: one loss per heartbeat interval
    # Three more renewals (a lease's worth of rounds): nobody may fence or rejoin.
    await h.wait_renewals([d], count=4)
    ev = await h.events()
    assert not [e for e in ev if e.action in ("id", "cancelled")]
    assert len({e.token for e in ev if e.action == "start"}) == 3


async def test_a_lost_leave_reply_on_sigterm_is_retried_safely(h: Harness) -> None:
    proxy = await h.proxy()
    (a,) = await h.start(1, url=proxy.url)
    (b,) = await h.start(1)
    devices = payloads("dev", 4)
    await h.client.ensure_many("devices", devices)
    await wait_until(lambda: _any(h.started(a), devices), 5, "A runs a device")

    async def all_run() -> bool:
        return {e.task for e in await h.events() if e.action == "start"} >= set(devices)

    await wait_until(all_run, 5, "every device runs")
    lost = proxy.lose_reply_to(sha("recycle"))
    async with h.monitor({"devices": set(devices)}) as mon:
        a.term()
        with trio.fail_after(5):
            await lost.wait()
        assert await a.wait_exit(5) == 0

        async def b_owns_all() -> bool:
            snap = await h.snapshot(["devices"])
            b_id = await h.worker_id(b)
            return (
                sorted(p.payload for p in snap.queues["devices"].procs.values() if p.worker == b_id)
                == devices
            )

        await wait_until(b_owns_all, TTL, "B owns every device at once")
    assert mon.violations == []


async def test_lost_enqueue_and_ensure_replies(h: Harness) -> None:
    """What a client sees: the call raises, the write happened. Retrying an
    enqueue enqueues twice (at-least-once, documented); retrying an ensure is
    a no-op."""
    from mesh import open_client

    proxy = await h.proxy()
    async with open_client(proxy.url, namespace=h.ns) as client:
        lost = proxy.lose_reply_to(sha("enqueue"))
        with pytest.raises(MeshConnectionError, match="in flight"):
            await client.enqueue("jobs", b"x")
        assert lost.is_set()
        assert await h.client.tasks("jobs") == [b"x"]
        lost = proxy.lose_reply_to(sha("ensure"))
        with pytest.raises(MeshConnectionError, match="in flight"):
            await client.ensure("devices", b"d")

        async def retried() -> bool:
            try:
                return await client.ensure("devices", b"d") is False
            except MeshConnectionError:
                return False

        assert await wait_until(retried, 5, "the ensure retried")
        assert await h.client.tasks("devices") == [b"d"]
