"""mesh._lease: the lease timing, generations, and a Lease on its own (no
Worker around it) against a real redis-server: it registers, renews, hands
back when closed, and after a fence rejoins under a new identity. Fences are
forced (the lease key is deleted or taken over), never waited for."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import attrs
import pytest

from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._errors import ConfigError
from mesh._keys import Keys
from mesh._lease import Generation, Lease, LeaseTiming
from mesh._pubsub import open_pubsub
from mesh._renewals import OwnHeartbeat
from mesh._replies import HeartbeatReply
from mesh._stats import Recorder
from mesh._supervisor import Reaper
from mesh.testing import wait_until

pytestmark = pytest.mark.both_loops

TIMING = LeaseTiming.make(0.9, None, None)  # H 0.3 s, R 0.6 s, T 0.9 s


# --- timing and generations (pure) ----------------------------------------------


def test_lease_timing_defaults_to_thirds_of_the_ttl_in_whole_ms() -> None:
    assert LeaseTiming.make(3, None, None) == LeaseTiming(3, 1.0, 2.0)
    assert LeaseTiming.make(1, None, None) == LeaseTiming(1, 0.333, 0.667)
    assert LeaseTiming.make(10, 1, 9) == LeaseTiming(10, 1, 9)


@pytest.mark.parametrize(
    ("ttl", "interval", "fence_after"),
    [(3, 2.0, 1.0), (3, 1.0, 3.0), (3, 0.001, 1.0), (3, 1.5, 1.5), (0.02, None, None)],
)
def test_lease_timing_refuses_what_breaks_h_below_r_below_t(
    ttl: float, interval: float | None, fence_after: float | None
) -> None:
    with pytest.raises(ConfigError) as exc:
        LeaseTiming.make(ttl, interval, fence_after)
    msg = str(exc.value)
    assert msg.startswith("lease timing must satisfy 0.01 s <= heartbeat interval < fence_after")
    assert msg.endswith("(ttl is too small)") == (ttl < 0.04)


async def test_a_generation_keeps_its_first_fence_reason() -> None:
    gen = Generation("w1", 1)
    assert len(gen.incarnation) == 16 and gen.incarnation != Generation("w1", 1).incarnation
    gen.fence("superseded")
    gen.fence("later")
    assert gen.fence_reason == "superseded" and gen.scope.cancel_called


# --- a Lease against Redis ----------------------------------------------------------


@attrs.define
class Host:
    """What a worker gives its lease, recording what the lease does."""

    conn: Connection
    binding: Binding
    lease: Lease
    recorder: Recorder
    generations: list[Generation] = attrs.Factory(list)
    cancelled: list[str] = attrs.Factory(list)


@asynccontextmanager
async def a_lease(
    url: str, namespace: str, worker_id: str = "w1", queues: tuple[str, ...] = ("jobs",)
) -> AsyncIterator[Host]:
    binding = Binding(Keys(namespace))
    recorder = Recorder()
    async with open_connection(url) as conn, open_pubsub(url) as pubsub:
        generations: list[Generation] = []
        cancelled: list[str] = []

        async def start_runners(gen: Generation) -> None:
            generations.append(gen)

        lease = Lease(
            conn,
            pubsub,
            binding,
            TIMING,
            worker_id,
            Reaper(conn, binding, ttl=TIMING.ttl),
            queues=lambda: queues,
            start_runners=start_runners,
            cancel_process=cancelled.append,
            recorder=recorder,
            driver=OwnHeartbeat(conn, binding),
        )
        host = Host(conn, binding, lease, recorder, generations, cancelled)
        async with anyio.create_task_group() as nursery:
            await nursery.start(lease.run)
            try:
                yield host
            finally:
                lease.close()
                await lease.stopped.wait()


async def test_a_lease_registers_renews_and_hands_back_when_closed(
    redis_url: str, namespace: str, conn: Connection
) -> None:
    keys = Keys(namespace)
    async with a_lease(redis_url, namespace) as h:
        gen = await h.lease.current()
        assert gen.id == "w1" and h.generations == [gen]
        assert await conn.execute("EXISTS", keys.heartbeat("w1")) == 1
        assert await conn.execute("SMEMBERS", keys.servers("jobs")) == [b"w1"]
        await wait_until(lambda: h.recorder.heartbeats >= 2, what="two renewals")
        assert 0 < await conn.execute("PTTL", keys.heartbeat("w1")) <= 900
        await h.binding.enqueue(conn, "jobs", [b"t"])
        (p,) = (await h.binding.claim(conn, "w1", gen.incarnation, "jobs", 1, 0)).processes
    # closed: gone from Redis, its process handed back (no attempt counted)
    assert h.lease.stopped.is_set() and h.lease.closing
    assert await conn.execute("EXISTS", keys.heartbeat("w1")) == 0
    assert await conn.execute("ZRANGE", keys.workers, 0, -1) == []
    assert await conn.execute("LRANGE", keys.queue("jobs"), 0, -1) == [b"t"]
    assert h.recorder.handed_back == 1 and p.task == b"t"


async def test_a_fenced_lease_rejoins_under_a_new_identity(
    redis_url: str, namespace: str, conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    keys = Keys(namespace)
    with caplog.at_level(logging.INFO, logger="mesh.worker"):
        async with a_lease(redis_url, namespace) as h:
            first = await h.lease.current()
            # the lease key gone: the next heartbeat finds it so and fences
            await conn.execute("DEL", keys.heartbeat("w1"))
            await wait_until(lambda: len(h.generations) == 2, what="a second generation")
            second = await h.lease.current()
            assert first.scope.cancel_called and first.fence_reason is not None
            assert second.id.startswith("w1.") and second.number == 2
            assert h.lease.ids == {"w1", second.id}
            assert await conn.execute("SMEMBERS", keys.servers("jobs")) == [second.id.encode()]
            assert sum(h.recorder.fences_snapshot().values()) == 1
    assert any(m.startswith("worker w1 fenced (") for m in caplog.messages)
    assert any(f"worker w1 rejoined the mesh as {second.id}" in m for m in caplog.messages)


async def test_the_first_registration_error_propagates(
    redis_url: str, namespace: str, conn: Connection
) -> None:
    b = Binding(Keys(namespace))
    await b.register(conn, "w1", "someone-else", 60_000, b"{}")  # a live w1
    async with open_pubsub(redis_url) as pubsub:
        lease = Lease(
            conn,
            pubsub,
            b,
            TIMING,
            "w1",
            Reaper(conn, b, ttl=TIMING.ttl),
            queues=lambda: (),
            start_runners=_no_runners,
            cancel_process=lambda pid: None,
            recorder=Recorder(),
            driver=OwnHeartbeat(conn, b),
        )
        async with anyio.create_task_group() as nursery:
            with pytest.raises(ConfigError, match="worker id w1 is in use"):
                await nursery.start(lease.run)
    assert lease.stopped.is_set()


async def _no_runners(gen: Generation) -> None:
    pass


async def test_renewed_acts_on_the_inbox_and_tells_the_reaper(
    redis_url: str, namespace: str
) -> None:
    async with a_lease(redis_url, namespace, queues=()) as h:
        gen = await h.lease.current()
        reaper = h.lease._reaper
        reaper._on_watch = False
        reaper._wakeup = anyio.Event()
        gen.early_cancels = {"old": anyio.current_time() - 10, "new": anyio.current_time()}
        sent = anyio.current_time()
        reply = HeartbeatReply(0, -1000, ("p1", "p2"), (), (), (), ())  # a deadline 1 s ago
        nxt = h.lease.renewed(gen, sent, [], reply)
        assert h.cancelled[-2:] == ["p1", "p2"] and gen.acks == ["p1", "p2"]
        assert set(gen.early_cancels) == {"new"}  # older than the TTL: pruned
        assert reaper._wakeup.is_set()  # overdue beyond the grace: the backstop
        assert sent < nxt <= sent + TIMING.interval
        assert gen.scope.deadline == sent + TIMING.fence_after


async def test_a_failed_renewal_is_said_once_per_outage(
    redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    from mesh._errors import MeshConnectionError

    async with a_lease(redis_url, namespace, queues=()) as h:
        gen = await h.lease.current()
        with caplog.at_level(logging.DEBUG, logger="mesh.worker"):
            caplog.clear()
            now = anyio.current_time()
            for _ in range(3):
                retry = h.lease.renewal_failed(gen, now, MeshConnectionError("down"))
                assert now < retry <= anyio.current_time() + min(TIMING.interval / 4, 0.25)
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "Redis unreachable: down" in warnings[0].getMessage()
            assert gen.trouble_since == now
            reply = HeartbeatReply(0, 10_000, (), (), (), (), ())
            h.lease.renewed(gen, now + 1, [], reply)
            assert gen.trouble_since is None
            assert any("heartbeat confirmed again, 1.0 s after" in m for m in caplog.messages)
