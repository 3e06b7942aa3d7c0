"""Rebalancing persistent tasks, with workers in one process against a real
redis-server: peers that join get their share with the minimum number of
moves, a moved task goes to a worker below its share and nowhere else, its
old handler has exited before the new one starts, and a queue served with
rebalancing off moves nothing."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest

import mesh
from mesh import Process
from mesh._balance import BalancePolicy, fair_bounds, pull_count
from mesh._binding import Binding
from mesh.cli._status import share_text
from mesh.testing import wait_heartbeats, wait_until

pytestmark = pytest.mark.both_loops

TTL = 0.6  # H = 0.2 s: a few heartbeats per second


class Owners:
    """A persistent handler that records every start and every exit."""

    def __init__(self) -> None:
        self.starts: list[tuple[Process, float]] = []
        self.exits: dict[int, float] = {}
        self.running: dict[bytes, str] = {}

    async def handler(self, p: Process) -> None:
        assert p.task not in self.running, f"{p.task!r} has two live owners"
        self.running[p.task] = p.worker_id
        self.starts.append((p, anyio.current_time()))
        try:
            await anyio.sleep_forever()
        finally:
            del self.running[p.task]
            self.exits[p.token] = anyio.current_time()

    def counts(self, workers: list[mesh.Worker]) -> list[int]:
        c = Counter(self.running.values())
        return [c[w.id] for w in workers]


class Mesh:
    """Workers that can be added and stopped one by one."""

    def __init__(self, url: str, ns: str, nursery: anyio.abc.TaskGroup, owners: Owners) -> None:
        self.url, self.ns, self.nursery, self.owners = url, ns, nursery, owners
        self.workers: list[mesh.Worker] = []
        # by worker, not by id: a worker that fenced itself (a loaded
        # machine, TTL 0.6 s) rejoined under a new id
        self._stops: dict[mesh.Worker, anyio.Event] = {}

    async def add(
        self,
        rebalance: bool = True,
        capacity: int = 1,
        concurrency: int = 10,
        ttl: float = TTL,
    ) -> mesh.Worker:
        async def run(task_status: anyio.abc.TaskStatus[mesh.Worker]) -> None:
            async with mesh.open_worker(self.url, namespace=self.ns, ttl=ttl) as w:
                await w.start_work(
                    "devices",
                    self.owners.handler,
                    rebalance=rebalance,
                    capacity=capacity,
                    concurrency=concurrency,
                )
                stop = self._stops[w] = anyio.Event()
                task_status.started(w)
                await stop.wait()

        w: mesh.Worker = await self.nursery.start(run)
        self.workers.append(w)
        return w

    async def stop(self, w: mesh.Worker) -> None:
        self.workers.remove(w)
        self._stops[w].set()

    def counts(self) -> list[int]:
        return self.owners.counts(self.workers)


@asynccontextmanager
async def open_mesh(url: str, ns: str) -> AsyncIterator[tuple[mesh.Client, Mesh]]:
    owners = Owners()
    async with mesh.open_client(url, namespace=ns) as client, anyio.create_task_group() as nursery:
        m = Mesh(url, ns, nursery, owners)
        yield client, m
        for w in list(m.workers):
            await m.stop(w)


def balanced(counts: list[int], total: int) -> bool:
    return sum(counts) == total and max(counts) - min(counts) <= 1


async def settle(m: Mesh, total: int, within: float = 15.0) -> None:
    async def ok() -> bool:
        return balanced(m.counts(), total)

    await wait_until(ok, within=within, what=f"a balanced mesh (now {m.counts()})")


async def test_peers_that_join_take_exactly_the_surplus(redis_url: str, namespace: str) -> None:
    async with open_mesh(redis_url, namespace) as (client, m):
        for _ in range(3):
            await m.add()
        await client.ensure_many("devices", [f"d{i}" for i in range(30)])
        await settle(m, 30)
        assert m.counts() == [10, 10, 10]
        first = len(m.owners.starts)
        old = set(m.workers)
        for _ in range(3):
            await m.add()
        await settle(m, 30)
        # Nine more rounds of every worker (three leases' worth): nothing else may move.
        await wait_heartbeats(*m.workers, count=10)
        assert m.counts() == [5, 5, 5, 5, 5, 5]
        moved = m.owners.starts[first:]
        assert len(moved) == 15  # the surplus, not more
        new_ids = {w.id for w in m.workers if w not in old}
        by_task: dict[bytes, list[tuple[Process, float]]] = {}
        for p, t in m.owners.starts:
            by_task.setdefault(p.task, []).append((p, t))
        for p, started in moved:
            # each to a peer below its share, once: never on to a third peer
            assert p.worker_id in new_ids and p.attempts == 0
            (prev, _), (again, _) = by_task[p.task]
            assert again == p
            # the old handler had exited before the new one started
            assert m.owners.exits[prev.token] <= started
        stats = [w.statistics() for w in m.workers]
        assert sum(s.processes_moved for s in stats) == 15
        # visible: every worker holds its fair 5, nothing moving
        for info in await client.workers():
            assert info.shares == (mesh.QueueShare("devices", 5, 5, 5, 0, 0, weight=5, share=5.0),)
        assert share_text(info.shares) == "devices 5/5"


async def test_a_stopping_peer_s_tasks_go_at_once_to_a_peer_at_its_share(
    redis_url: str, namespace: str
) -> None:
    """A stopping worker first leaves the queue's servers (drain.lua), so the
    idle peer that stays, already at its fair share of 5, takes all 5 tasks
    handed back at once. Before, its claim was held back by a share that
    still counted the leaving worker, and it took them at its next heartbeat
    (uniform in 0..3 s here: this test failed 4 times in 4 before the change)."""
    ttl = 9.0
    async with open_mesh(redis_url, namespace) as (client, m):
        a = await m.add(ttl=ttl, concurrency=20)
        b = await m.add(ttl=ttl, concurrency=20)
        await client.ensure_many("devices", [f"d{i}" for i in range(10)])
        await settle(m, 10)
        assert m.counts() == [5, 5]
        # the first to claim was held back by its share: it claims again
        # (and finds nothing, so it is idle too) one heartbeat interval later
        idle = client._keys.idle("devices")

        async def both_idle() -> bool:
            return len(await client._conn.execute("SMEMBERS", idle)) == 2

        await wait_until(both_idle, ttl, "both workers idle")
        first = len(m.owners.starts)
        await m.stop(b)
        # within a tenth of the heartbeat interval
        await wait_until(lambda: m.owners.counts([a]) == [10], 0.3, "a took b's tasks", 0.01)
        moved = m.owners.starts[first:]
        assert len(moved) == 5 and {p.worker_id for p, _ in moved} == {a.id}
        assert all(p.attempts == 0 for p, _ in moved)
        for p, _ in m.owners.starts[:first]:
            if p.worker_id == b.id:  # b's handler had exited before a started it
                (again,) = [t for q, t in moved if q.task == p.task]
                assert m.owners.exits[p.token] <= again


async def test_a_held_back_worker_s_retry_leaves_a_fresh_task_to_the_peers_below_share(
    redis_url: str, namespace: str
) -> None:
    """A worker held back by the fair share claims again one heartbeat
    interval (H = 2 s here) later. Then it takes, beyond its share, only the
    tasks that have had no owner for 0.9 H: a task that appeared 1 s before the
    retry stays for the peers below their share (a serving worker that never
    claims, here) until it has waited that long. Before, the retry took
    whatever was queued."""
    async with mesh.open_client(redis_url, namespace=namespace) as client:
        b = Binding(client._keys)
        await b.register(client._conn, "ghost", "g", 60_000, b"{}")
        await b.serve(client._conn, "ghost", "g", "devices")  # counts, never claims
        await client.ensure_many("devices", ["d1", "d2"])  # a fair share of 1 each
        owners = Owners()
        async with mesh.open_worker(redis_url, namespace=namespace, ttl=6) as w:
            await w.start_work("devices", owners.handler)
            await wait_until(lambda: len(owners.starts) == 1, 5, "w takes its share")
            t0 = owners.starts[0][1]  # w was held back then (d2 left for the ghost)
            await client.cancel("devices", "d2")
            await anyio.sleep_until(t0 + 1.0)  # not a synchronisation: d3 comes 1 s in
            await client.ensure("devices", "d3")  # no owner since t0 + 1 s
            # a deliberate window: w's retry came at t0 + 2 s (a timer, not
            # observable from here) and must have left d3 alone
            await anyio.sleep_until(t0 + 2.6)
            assert [p.task for p, _ in owners.starts] == [b"d1"]
            # once d3 has waited 1.8 s, w's next claim takes it
            await wait_until(lambda: len(owners.starts) == 2, 5, "w takes d3 in the end")
            assert owners.starts[1][0].task == b"d3"
            assert owners.starts[1][1] - t0 >= 2.7


async def test_with_rebalancing_off_nothing_moves(redis_url: str, namespace: str) -> None:
    async with open_mesh(redis_url, namespace) as (client, m):
        for _ in range(3):
            await m.add(rebalance=False)
        await client.ensure_many("devices", [f"d{i}" for i in range(30)])
        await settle(m, 30)
        for _ in range(3):
            await m.add(rebalance=False)
        # Twelve more rounds of every worker (four leases' worth): nothing may move.
        await wait_heartbeats(*m.workers, count=13)
        assert m.counts() == [10, 10, 10, 0, 0, 0]
        assert len(m.owners.starts) == 30


async def test_a_rolling_restart_ends_balanced(redis_url: str, namespace: str) -> None:
    async with open_mesh(redis_url, namespace) as (client, m):
        for _ in range(6):
            await m.add()
        await client.ensure_many("devices", [f"d{i}" for i in range(30)])
        await settle(m, 30)
        for w in list(m.workers):
            await m.stop(w)
            await m.add()
            await settle(m, 30)
        assert m.counts() == [5] * 6


async def test_one_heavy_task_and_many_light_ones_spread_by_weight(
    redis_url: str, namespace: str
) -> None:
    """A task of weight 10 and 20 of weight 1 over 3 peers: a fair share of
    10 each, by weight; every peer ends within one task's weight of it
    (here exactly at it: the light tasks fill in around the heavy one)."""
    async with open_mesh(redis_url, namespace) as (client, m):
        for _ in range(3):
            await m.add()
        await client.ensure("devices", "heavy", weight=10)
        await client.ensure_many("devices", [f"d{i}" for i in range(20)])
        weight = {b"heavy": 10}

        def loads() -> list[int]:
            held = [0] * len(m.workers)
            ids = [w.id for w in m.workers]
            for task, wid in m.owners.running.items():
                held[ids.index(wid)] += weight.get(task, 1)
            return held

        async def spread() -> bool:
            return len(m.owners.running) == 21 and all(abs(x - 10) < 10 for x in loads())

        await wait_until(spread, within=15, what=f"a spread by weight (now {loads()})")
        await wait_until(
            lambda: _true(loads() == [10, 10, 10]), within=15, what=f"exact (now {loads()})"
        )
        shares = {i.id: i.shares[0] for i in await client.workers()}
        assert sorted(sh.weight for sh in shares.values()) == [10, 10, 10]
        assert {sh.share for sh in shares.values()} == {10.0}
        heavy = next(w for w in m.workers if m.owners.running[b"heavy"] == w.id)
        assert shares[heavy.id].held == 1  # the heavy one alone
        # the weight changes: ensuring again sets it, and the mesh rebalances
        await client.ensure("devices", "heavy", weight=1)
        weight[b"heavy"] = 1

        async def even() -> bool:
            return sorted(loads()) == [7, 7, 7]

        await wait_until(even, within=15, what=f"7 each after the reweight (now {loads()})")


async def test_capacities_one_to_two_get_one_to_two_of_the_weight(
    redis_url: str, namespace: str
) -> None:
    async with open_mesh(redis_url, namespace) as (client, m):
        await m.add(capacity=1, concurrency=30)
        await client.ensure_many("devices", [f"d{i}" for i in range(30)])
        await wait_until(lambda: _true(m.counts() == [30]), what="the first peer runs all")
        await m.add(capacity=2, concurrency=30)
        await wait_until(lambda: _true(m.counts() == [10, 20]), within=15, what=f"{m.counts()}")
        shares = [i.shares[0] for i in await client.workers()]
        assert sorted((sh.capacity, sh.weight, sh.share) for sh in shares) == [
            (1, 10, 10.0),
            (2, 20, 20.0),
        ]
        assert "x2" in share_text((shares[0],)) + share_text((shares[1],))


async def test_bad_weights_and_capacities_are_refused_in_one_line(
    redis_url: str, namespace: str
) -> None:
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, namespace=namespace, ttl=TTL) as w,
    ):
        for bad in (0, -1, 1.5, True, 1_000_001, "2"):
            with pytest.raises(mesh.ConfigError, match=r"^weight must be a whole number from 1"):
                await client.ensure("devices", "x", weight=bad)  # type: ignore[arg-type]
            with pytest.raises(mesh.ConfigError, match=r"^capacity must be a whole number from"):
                await w.start_work("devices", Owners().handler, capacity=bad)  # type: ignore[arg-type]
        assert await client.persistent_tasks("devices") == {}


def test_the_share_column_of_mesh_status() -> None:
    s = mesh.QueueShare
    assert share_text((s("devices", 3, 5, 5, 2, 0),)) == "devices 3/5 +2"
    assert share_text((s("devices", 10, 4, 5, 0, 5), s("jobs", 2, 0, 0))) == "devices 10/4-5 -5"
    assert share_text(()) == "-"


def test_the_pull_decision() -> None:
    policy = BalancePolicy(absolute_limit=20, relative_limit=0.1)
    assert fair_bounds(30, 6) == (5, 5) and fair_bounds(31, 6) == (5, 6)
    assert fair_bounds(3, 0) == (3, 3)
    assert pull_count(0, 30, 6, False, policy) == 3  # 10% of 30 per request
    assert pull_count(0, 3000, 6, False, policy) == 20  # at most 20
    assert pull_count(4, 30, 6, False, policy) == 1
    assert pull_count(5, 31, 6, False, policy) == 0  # within one: hysteresis
    assert pull_count(0, 30, 6, True, policy) == 0  # tasks ready: claims spread them
    assert pull_count(0, 0, 6, False, policy) == 0
    # by weight against capacity: a share of 30 * 2 / 4 = 15
    assert pull_count(5, 30, 4, False, policy, capacity=2) == 3
    assert pull_count(14, 30, 4, False, policy, capacity=2) == 1
    assert pull_count(14.5, 30, 4, False, policy, capacity=2) == 0  # type: ignore[arg-type]


async def test_a_sticky_restart_gets_its_tasks_back_within_the_grace(
    redis_url: str, namespace: str
) -> None:
    """With worker_id and rejoin_grace, leaving keeps the worker's persistent
    tasks reserved for it: back within the grace, it gets them again (new
    processes, higher tokens), and the peer that stayed gets none of them;
    past the grace they go to the peer."""
    owners = Owners()
    kw = {"namespace": namespace, "ttl": TTL}
    devices = [f"d{i}" for i in range(4)]
    async with (
        mesh.open_client(redis_url, namespace=namespace) as client,
        mesh.open_worker(redis_url, **kw) as peer,  # type: ignore[arg-type]
    ):
        await peer.start_work("devices", owners.handler, rebalance=False)
        await client.ensure_many("devices", devices)
        await wait_until(lambda: _true(len(owners.running) == 4), what="the peer runs all")
        # a sticky worker takes over half by a rebalance, then restarts
        async with mesh.open_worker(
            redis_url,
            worker_id="sticky-1",
            rejoin_grace=5.0,
            **kw,  # type: ignore[arg-type]
        ) as w:
            await w.start_work("devices", owners.handler)
            await wait_until(lambda: _true(owners.counts([w]) == [2]), what="its share")
        before = {p.task: p.token for p, _ in owners.starts if p.worker_id == "sticky-1"}
        assert len(before) == 2
        # Six rounds of the peer (two leases' worth): it may not take them.
        await wait_heartbeats(peer, count=7)
        assert owners.counts([peer]) == [2] and len(owners.running) == 2
        shares = {i.id: i.shares for i in await client.workers()}
        assert shares[peer.id] == (mesh.QueueShare("devices", 2, 4, 4, 0, 0, weight=2, share=4.0),)
        async with mesh.open_worker(
            redis_url,
            worker_id="sticky-1",
            rejoin_grace=0.3,
            **kw,  # type: ignore[arg-type]
        ) as w:
            await w.start_work("devices", owners.handler)
            await wait_until(lambda: _true(owners.counts([w]) == [2]), what="its tasks back")
            again = {p.task: p.token for p, _ in owners.starts if p.worker_id == "sticky-1"}
            assert again.keys() == before.keys()
            assert all(again[t] > before[t] for t in before)  # new processes, new tokens
        # this time it does not come back: after 0.3 s the peer takes them
        await wait_until(lambda: _true(owners.counts([peer]) == [4]), within=5, what="released")


async def _true(v: bool) -> bool:
    return v
