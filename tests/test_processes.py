"""Workers as real OS processes: SIGKILL, SIGSTOP/SIGCONT and SIGTERM-free
leave. Each test asserts where every task is and who owns it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import anyio
import pytest

import mesh
from mesh.testing import wait_until

from .helpers import PEER_TTL, Peers, wait_ready

TTL = PEER_TTL
pytestmark = [pytest.mark.slow, pytest.mark.both_loops]


@pytest.fixture
def peers(redis_url: str, namespace: str) -> Iterator[Peers]:
    p = Peers(redis_url, namespace)
    try:
        yield p
    finally:
        p.stop_all()


async def test_sigkilled_workers_tasks_move_to_a_live_peer(peers: Peers, namespace: str) -> None:
    async with mesh.open_client(peers.url, namespace=namespace) as client:
        a = peers.start()
        await wait_ready(client, peers, 1)
        await client.ensure_many("devices", ["d1", "d2", "d3"])
        await client.enqueue_many("jobs", ["j1", "j2"])

        async def a_runs_all() -> bool:
            return len(await client.processes()) == 5

        await wait_until(a_runs_all)
        before = {p.task: p for p in await client.processes()}
        (a_id,) = {p.worker_id for p in before.values()}
        peers.start()
        await wait_ready(client, peers, 2)
        a.kill()
        t0 = anyio.current_time()

        async def peer_runs_all() -> bool:
            ps = await client.processes()
            return len(ps) == 5 and all(p.worker_id != a_id for p in ps)

        await wait_until(peer_runs_all, within=TTL * 5, what="takeover")
        took = anyio.current_time() - t0
        after = {p.task: p for p in await client.processes()}
        assert sorted(after) == sorted(before)  # nothing lost, nothing doubled
        assert all(after[t].token > before[t].token for t in after)
        assert all(after[t].persistent == before[t].persistent for t in after)
        assert len({p.worker_id for p in after.values()}) == 1
        assert took < TTL + 1.0, f"takeover took {took:.3f} s with TTL {TTL}"
        assert a_id not in {w.id for w in await client.workers()}
        # the crash counted as one failed attempt of each one-shot task
        assert {after[b"j1"].attempts, after[b"j2"].attempts} == {1}


async def test_a_paused_worker_is_fenced_and_cannot_act_or_finish(
    peers: Peers, namespace: str
) -> None:
    async with mesh.open_client(peers.url, namespace=namespace) as client:
        a = peers.start("--manual", "--hold", str(3 * TTL))
        await wait_ready(client, peers, 1)
        await client.ensure("devices", "dev")
        await client.enqueue("manual", "job")

        async def a_holds_both() -> bool:
            ev = await peers.events(client)
            return any(e.event == "claimed" for e in ev) and any(e.event == "act" for e in ev)

        await wait_until(a_holds_both)
        b = peers.start("--manual", "--hold", "0")
        await wait_ready(client, peers, 2)
        ev = await peers.events(client)
        a_id = next(e.worker for e in ev if e.event == "claimed")
        old_dev = next(e.token for e in ev if e.event == "start" and e.task == "dev")

        os.kill(a.pid, signal.SIGSTOP)
        stopped_at = anyio.current_time()
        lease_left = await client._conn.execute("PTTL", client._keys.heartbeat(a_id)) / 1000
        assert lease_left > 0

        async def b_owns_device() -> bool:
            return any(
                e.event == "start" and e.task == "dev" and e.worker != a_id
                for e in await peers.events(client)
            )

        await wait_until(b_owns_device, within=TTL * 5, what="takeover of the device")
        took = anyio.current_time() - stopped_at
        assert lease_left - 0.02 < took < TTL + 1.0  # not before the lease ran out

        # and B took the one-shot job too, and finished it
        async def b_finished_job() -> bool:
            return any(
                e.event == "finish=True" and e.worker != a_id for e in await peers.events(client)
            )

        await wait_until(b_finished_job, within=5, what="B finishes the job")
        # Not a synchronisation: A stays stopped for 2 TTL in all.
        await anyio.sleep(max(0.0, 2 * TTL - (anyio.current_time() - stopped_at)))
        resumed_at = time.time()  # the driver logs time.time() too
        os.kill(a.pid, signal.SIGCONT)

        async def a_reports() -> bool:
            ev = await peers.events(client)
            return any(e.event.startswith("finish=") and e.worker == a_id for e in ev) and any(
                e.event == "cancelled" and e.worker == a_id for e in ev
            )

        await wait_until(a_reports, within=5 * TTL, what="the stale owner's reports")
        ev = await peers.events(client)
        new_dev = next(
            e.token for e in ev if e.event == "start" and e.task == "dev" and e.worker != a_id
        )
        assert new_dev > old_dev
        # the stale owner's late finish changed nothing
        assert [e.event for e in ev if e.worker == a_id and e.event.startswith("finish=")] == [
            "finish=False"
        ]
        # it acted at most once more (one in-flight action) after resuming
        late_acts = [e for e in ev if e.worker == a_id and e.event == "act" and e.at > resumed_at]
        assert len(late_acts) <= 1

        # it rejoined under a new id; B still owns the device
        async def a_rejoined() -> bool:
            ids = {w.id for w in await client.workers()}
            return a_id not in ids and len(ids) == 2

        await wait_until(a_rejoined, within=5 * TTL, what="A rejoins")
        (p,) = await client.processes("devices")
        assert p.token == new_dev
        assert b.poll() is None and a.poll() is None
