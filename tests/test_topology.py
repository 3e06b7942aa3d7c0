"""Topologies against real Sentinel and Cluster setups started here (tests/topology.py):
discovery, the ROLE check, re-routing of "not executed here" replies, and workers
that follow the master through a failover."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import trio

import mesh
from mesh import MeshConnectionError, Process
from mesh._connection import open_connection
from mesh._topology import Topology, crc16, keyslot, parse_shards, parse_slots
from mesh._url import parse_url
from mesh.testing import RedisServer, free_port
from mesh.testing import wait_until as mesh_wait

from .topology import ClusterSetup, client, cluster_setup, sentinel_setup, wait_for

NS = "topo" + secrets.token_hex(3)
ROUTE = f"{{{NS}}}:"
SLOT = keyslot(ROUTE)


class Runs:
    """A fenced sink: what each persistent task's owners did, by token."""

    def __init__(self) -> None:
        self.started: list[tuple[bytes, int, float]] = []
        self.cancelled: list[tuple[bytes, int]] = []

    async def handler(self, p: Process) -> None:
        self.started.append((p.task, p.token, trio.current_time()))
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled.append((p.task, p.token))
            raise

    def tokens(self, task: bytes) -> list[int]:
        return [token for t, token, _ in self.started if t == task]

    def running(self, task: bytes) -> int:
        """How many handlers of ``task`` are running now."""
        started = sum(1 for t, _, _ in self.started if t == task)
        return started - sum(1 for t, _ in self.cancelled if t == task)

    def ran_since(self, task: bytes, since: float) -> bool:
        return any(t == task and at > since for t, _, at in self.started)

    def check_no_overlap(self) -> None:
        """A task's tokens strictly increase with every new owner."""
        for task in {t for t, _, _ in self.started}:
            tokens = self.tokens(task)
            assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), (task, tokens)


async def wait_until(pred: object, within: float, what: str) -> None:
    with trio.move_on_after(within):
        while not pred():  # type: ignore[operator]  # noqa: ASYNC110 - poll with a deadline
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out after {within}s waiting for {what}")


# ---------------------------------------------------------------- pure parts


def test_keyslot_known_values() -> None:
    # Values from the Redis Cluster specification / CLUSTER KEYSLOT.
    assert keyslot("foo") == 12182
    assert keyslot("{user1000}.following") == keyslot("{user1000}.followers")
    assert keyslot("foo{}{bar}") == crc16(b"foo{}{bar}") % 16384  # empty tag: whole key
    assert keyslot("foo{{bar}}zap") == keyslot("{bar")
    assert keyslot(b"123456789") == 0x31C3 % 16384  # the CRC16/XMODEM check value


# ---------------------------------------------------------------- Cluster (shared)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterSetup]:
    with cluster_setup(replica_of_slot=SLOT) as setup:
        yield setup


def test_keyslot_matches_the_server(cluster: ClusterSetup) -> None:
    c = client(cluster.masters[0].port)
    for key in ("foo", ROUTE, "{a}b", "a{b", "{}x", "x" * 300, "ключ"):
        assert keyslot(key) == c.execute_command("CLUSTER", "KEYSLOT", key), key
    assert mesh.namespace_slot(NS) == c.execute_command("CLUSTER", "KEYSLOT", ROUTE + "queue:q")


async def test_shards_and_slots_give_the_same_map(cluster: ClusterSetup) -> None:
    async with open_connection(cluster.url()) as conn:
        shards = parse_shards(await conn.execute("CLUSTER", "SHARDS"), tls=False)
        slots = parse_slots(await conn.execute("CLUSTER", "SLOTS"))
    assert sorted(shards) == sorted(slots)
    assert sum(last - first + 1 for first, last, _, _ in slots) == 16384


async def test_any_node_of_a_cluster_reaches_the_slot_master(cluster: ClusterSetup) -> None:
    owner = cluster.owner_port(SLOT)
    others = [m for m in cluster.masters if m.port != owner]
    urls = [
        cluster.url(cluster.replicas[0]),  # a replica
        cluster.url(others[0]),  # another master
        cluster.url(scheme="redis+cluster"),  # the seed list
    ]
    for url in urls:
        async with open_connection(url, route_key=ROUTE) as conn:
            assert conn.node == ("127.0.0.1", owner), url
            assert await conn.execute("SET", ROUTE + "k", url) == b"OK"
            assert conn.topology.cluster
    # 6.2 has no CLUSTER SHARDS: the CLUSTER SLOTS path lands on the same node.
    topology = Topology(parse_url(urls[1]), ROUTE)
    topology._use_slots = True
    async with open_connection(urls[1], topology=topology) as conn:
        assert conn.node == ("127.0.0.1", owner)
        assert await conn.execute("GET", ROUTE + "k") == urls[-1].encode()


async def test_cluster_db_must_be_0(cluster: ClusterSetup) -> None:
    with pytest.raises(MeshConnectionError, match="db must be 0, not 2"):
        async with open_connection(cluster.url(cluster.masters[0]) + "/2", route_key=ROUTE):
            pass  # pragma: no cover


async def test_moved_is_rerouted_not_raised(cluster: ClusterSetup) -> None:
    # A connection pinned to the wrong master (as if the slot had moved since):
    # MOVED replies are re-routed and retried, in order, and no error escapes.
    owner = cluster.owner_port(SLOT)
    wrong = next(m for m in cluster.masters if m.port != owner)
    topology = Topology(parse_url(cluster.url(wrong)), route_key="{elsewhere}")
    topology.slot = next(
        e[0]
        for e in client(wrong.port).execute_command("CLUSTER", "SLOTS")
        if e[2][1] == wrong.port
    )
    async with open_connection(cluster.url(wrong), topology=topology) as conn:
        assert conn.node == ("127.0.0.1", wrong.port)
        topology.slot = SLOT  # the next discovery looks for our namespace's master
        replies = await conn.pipeline(
            [("DEL", ROUTE + "l"), ("RPUSH", ROUTE + "l", "a"), ("RPUSH", ROUTE + "l", "b")]
        )
        assert replies == [0, 1, 2]
        assert await conn.execute("LRANGE", ROUTE + "l", 0, -1) == [b"a", b"b"]
        assert conn.node == ("127.0.0.1", owner)
        assert conn.statistics().reroutes >= 1
    # A plain error reply stays the caller's.
    async with open_connection(cluster.url(), route_key=ROUTE) as conn:
        with pytest.raises(mesh.CommandError, match="WRONGTYPE"):
            await conn.execute("INCR", ROUTE + "l")


async def test_client_and_worker_on_other_nodes(cluster: ClusterSetup) -> None:
    owner = cluster.owner_port(SLOT)
    other = next(m for m in cluster.masters if m.port != owner)
    runs = Runs()
    async with mesh.open_client(cluster.url(cluster.replicas[0]), namespace=NS) as c:
        assert await c.ensure("p", "device-1")
        async with mesh.open_worker(cluster.url(other), namespace=NS, ttl=3) as w:
            await w.start_work("p", runs.handler)
            await wait_until(lambda: runs.tokens(b"device-1"), 10, "the persistent task to run")
    assert client(owner).exists(ROUTE + "persistent:p")


async def test_rebalancing_by_weight_on_a_cluster(cluster: ClusterSetup) -> None:
    """Rebalancing works on Cluster as on one server: a peer that joins
    through another master takes its fair share by weight against capacity
    (every script of the namespace runs on its slot's master), moved only
    once its old handler exited."""
    owner = cluster.owner_port(SLOT)
    other = next(m for m in cluster.masters if m.port != owner)
    runs = Runs()
    kw = {"namespace": NS, "ttl": 1.5}
    async with (
        mesh.open_client(cluster.url(cluster.replicas[0]), namespace=NS) as c,
        mesh.open_worker(cluster.url(), **kw) as first,  # type: ignore[arg-type]
    ):
        await first.start_work("balanced", runs.handler)
        await c.ensure("balanced", "heavy", weight=4)
        await c.ensure_many("balanced", [f"light-{i}" for i in range(8)])

        async def weights() -> dict[str, tuple[int, float]]:
            return {
                w.id: (w.shares[0].weight, w.shares[0].share) for w in await c.workers() if w.shares
            }

        await wait_until(
            lambda: len(runs.started) - len(runs.cancelled) == 9, 10, "all nine to run"
        )
        async with mesh.open_worker(cluster.url(other), **kw) as second:  # type: ignore[arg-type]
            await second.start_work("balanced", runs.handler, capacity=2)

            async def even() -> bool:
                return await weights() == {first.id: (4, 4.0), second.id: (8, 8.0)}

            await mesh_wait(even, within=15, what="weights 4 and 8 of 12 at capacities 1, 2")
            assert runs.cancelled  # tasks moved, each once its handler exited
    assert client(owner).exists(ROUTE + "share:balanced")


def test_cli_status_on_a_replica(cluster: ClusterSetup) -> None:
    env = {**os.environ, "MESH_REDIS_URL": cluster.url(cluster.replicas[0])}
    out = subprocess.run(
        [sys.executable, "-m", "mesh.cli", "status", "--namespace", NS],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "MOVED" not in out.stdout + out.stderr


# ---------------------------------------------------------------- Cluster failovers


async def test_cluster_failovers() -> None:
    """CLUSTER FAILOVER (shorter than the TTL) cancels no handler; SIGKILL of the
    slot's master: the workers follow the promoted replica and every persistent
    task runs again under a larger token."""
    ns = "cf" + secrets.token_hex(3)
    route = f"{{{ns}}}:"
    tasks = [f"device-{i}".encode() for i in range(4)]
    with cluster_setup(replica_of_slot=keyslot(route), node_timeout_ms=500) as setup:
        owner = setup.owner_port(keyslot(route))
        old_master = next(m for m in setup.masters if m.port == owner)
        replica = setup.replicas[0]
        url = setup.url(scheme="redis+cluster")
        runs = Runs()
        async with mesh.open_client(url, namespace=ns) as c:
            for t in tasks:
                await c.ensure("p", t)
            async with trio.open_nursery() as nursery:
                workers: list[mesh.Worker] = []

                async def one() -> None:
                    async with mesh.open_worker(url, namespace=ns, ttl=3) as w:
                        await w.start_work("p", runs.handler)
                        workers.append(w)  # serving: a failover may begin
                        await trio.sleep_forever()

                for _ in range(2):
                    nursery.start_soon(one)
                await wait_until(
                    lambda: len(workers) == 2 and all(runs.tokens(t) for t in tasks),
                    10,
                    "both workers serving and first runs",
                )

                # The fair share moves two tasks to the second worker (a hand-over
                # cancels their first handlers): let it settle first.
                await wait_until(
                    lambda: all(w.statistics().running == 2 for w in workers),
                    15,
                    "the fair share (2 tasks each)",
                )
                cancelled, started = len(runs.cancelled), len(runs.started)

                # 1. A coordinated failover, shorter than R (2 s of the default 3 s TTL).
                await trio.to_thread.run_sync(
                    lambda: client(replica.port).execute_command("CLUSTER", "FAILOVER")
                )
                try:
                    await trio.to_thread.run_sync(
                        lambda: wait_for(
                            "the replica to take over",
                            lambda: setup.owner_port(keyslot(route)) == replica.port,
                        )
                    )
                except AssertionError:
                    print((replica.dir / "redis.log").read_text()[-3000:])
                    print((old_master.dir / "redis.log").read_text()[-3000:])
                    raise
                beats = [w.statistics().heartbeats for w in workers]
                await wait_until(
                    lambda: all(
                        w.statistics().heartbeats > b + 1
                        for w, b in zip(workers, beats, strict=True)
                    ),
                    10,
                    "heartbeats on the new master",
                )
                assert len(runs.cancelled) == cancelled  # no handler stopped
                assert len(runs.started) == started  # none started again
                assert all(w.statistics().fenced == 0 for w in workers)

                # 2. SIGKILL of the slot's master (now the former replica): the old
                # master is promoted back; the workers ride it out or fence and
                # rejoin, and every persistent task ends up running exactly once.
                replica.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                await trio.to_thread.run_sync(
                    lambda: wait_for(
                        "the old master to be promoted again",
                        lambda: setup.owner_port(keyslot(route), via=old_master) == old_master.port,
                    )
                )
                beats = [w.statistics().heartbeats for w in workers]
                await wait_until(
                    lambda: (
                        all(
                            w.statistics().heartbeats > b + 1
                            for w, b in zip(workers, beats, strict=True)
                        )
                        and all(runs.running(t) == 1 for t in tasks)
                    ),
                    20,
                    "heartbeats and every persistent task running once",
                )
                held = {p.task for p in await c.processes("p")}
                nursery.cancel_scope.cancel()
        assert held == set(tasks)
        runs.check_no_overlap()


# ---------------------------------------------------------------- Sentinel


async def test_sentinel_failover_under_load() -> None:
    """SIGKILL the master while workers hold persistent tasks and a producer
    enqueues: the workers follow the promoted replica, every persistent task runs
    again with a larger token, and the old master restarted empty takes no write."""
    ns = "sf" + secrets.token_hex(3)
    tasks = [f"device-{i}".encode() for i in range(4)]
    with sentinel_setup(sentinels=1, down_after_ms=400) as setup:
        # A URL naming the replica directly is refused: it is not a master.
        with pytest.raises(MeshConnectionError, match="is a replica of"):
            async with mesh.open_client(setup.replica.url, namespace=ns):
                pass  # pragma: no cover
        runs = Runs()
        acked = 0
        one_shot_done = 0

        async def quick(p: Process) -> None:
            nonlocal one_shot_done
            one_shot_done += 1

        async with mesh.open_client(setup.url, namespace=ns) as c:
            for t in tasks:
                await c.ensure("p", t)

            async def produce() -> None:
                nonlocal acked
                while True:
                    try:
                        await c.enqueue("jobs", b"x")
                        acked += 1
                    except MeshConnectionError:
                        await trio.sleep(0.05)
                    await trio.sleep(0.005)

            workers: list[mesh.Worker] = []
            async with trio.open_nursery() as nursery:

                async def one() -> None:
                    async with mesh.open_worker(setup.url, namespace=ns, ttl=1) as w:
                        await w.start_work("p", runs.handler)
                        await w.start_work("jobs", quick)
                        workers.append(w)  # serving: a failover may begin
                        await trio.sleep_forever()

                for _ in range(2):
                    nursery.start_soon(one)
                nursery.start_soon(produce)
                await wait_until(
                    lambda: len(workers) == 2 and all(runs.tokens(t) for t in tasks),
                    10,
                    "both workers serving and first runs",
                )
                await wait_until(lambda: one_shot_done > 10, 10, "one-shot tasks to run")

                killed_at = trio.current_time()
                old = setup.master
                old.stop()  # SIGKILL
                await trio.to_thread.run_sync(
                    lambda: wait_for(
                        "Sentinel to promote the replica",
                        lambda: setup.master_port() == setup.replica.port,
                    )
                )
                # Restarted empty, on the same port, and unable to be demoted: it
                # stays a master with no data, which is what Sentinel must steer us from.
                old.args = (
                    *old.args,
                    "--rename-command", "REPLICAOF", "",
                    "--rename-command", "SLAVEOF", "",
                )  # fmt: skip
                await trio.to_thread.run_sync(old.start)
                # The lease (TTL 1 s) is shorter than Sentinel's failover: the workers
                # fence, rejoin on the promoted replica and run every task again.
                try:
                    await wait_until(
                        lambda: all(
                            runs.ran_since(t, killed_at) and runs.running(t) == 1 for t in tasks
                        ),
                        25,
                        "every persistent task to run again, once",
                    )
                except AssertionError:
                    print("runs", runs.started, runs.cancelled, [w.statistics() for w in workers])
                    raise
                done_before, acked_before = one_shot_done, acked
                await wait_until(
                    lambda: one_shot_done > done_before + 10 and acked > acked_before + 10,
                    10,
                    "enqueues and one-shot tasks to go on",
                )
                nursery.cancel_scope.cancel()
        assert setup.master_port() == setup.replica.port
        runs.check_no_overlap()
        for t in tasks:
            assert len(runs.tokens(t)) >= 2
        # The empty old master took nothing from the mesh.
        assert client(setup.master.port).dbsize() == 0


async def test_sentinel_discovery() -> None:
    with sentinel_setup() as setup:
        # The first sentinel is down: the next one answers.
        hosts = f"127.0.0.1:{free_port()},127.0.0.1:{setup.sentinels[0].port}"
        async with open_connection(f"redis+sentinel://{hosts}/mymaster/3") as conn:
            assert conn.node == ("127.0.0.1", setup.master.port)
            assert await conn.execute("CLIENT", "INFO") is not None
            assert b" db=3 " in await conn.execute("CLIENT", "INFO")
        with pytest.raises(MeshConnectionError, match="does not know the master 'nosuch'"):
            async with open_connection(setup.url.replace("/mymaster", "/nosuch")):
                pass  # pragma: no cover
        secret = "sentinel-s3cret"
        with pytest.raises(MeshConnectionError) as info:
            async with open_connection(f"{setup.url}?sentinel_password={secret}"):
                pass  # pragma: no cover
        assert "AUTH failed" in str(info.value)
        assert secret not in str(info.value)


async def test_fenced_worker_gives_up_handing_back_and_rejoins(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis is gone: the worker fences, its hand-back keeps failing, and it gives
    up after the TTL (peers recycle after T) instead of looping; it rejoins when
    a master answers again."""
    ns = "gu" + secrets.token_hex(3)
    async with mesh.open_worker(own_redis.url, namespace=ns, ttl=0.9) as w:
        own_redis.stop()
        with trio.fail_after(10):
            while "gave up handing back" not in caplog.text:  # noqa: ASYNC110 - poll
                await trio.sleep(0.02)
        await trio.to_thread.run_sync(own_redis.start)
        beats = w.statistics().heartbeats
        with trio.fail_after(10):
            while w.statistics().heartbeats <= beats + 1:  # noqa: ASYNC110 - poll
                await trio.sleep(0.02)
        assert w.statistics().fenced >= 1
        assert w.statistics().generation >= 2


async def test_min_replicas_waits_for_the_replica() -> None:
    """min_replicas=1 (URL option): an enqueue or ensure returns only once the
    replica has it, a persistent task's handler starts only once its claim is on
    the replica, and without a replica nothing is confirmed: enqueue raises and
    the worker's renewals do not count, so it fences."""
    ns = "mr" + secrets.token_hex(3)
    procs = f"{{{ns}}}:procs:p"
    with sentinel_setup() as setup:
        url = setup.url + "?min_replicas=1&connect_timeout=0.5"
        replica = client(setup.replica.port)
        seen_on_replica: list[int] = []
        runs = Runs()

        async def handler(p: Process) -> None:
            seen_on_replica.append(replica.hlen(procs))
            await runs.handler(p)

        async with mesh.open_client(url, namespace=ns) as c:
            assert c.min_replicas == 1
            await c.enqueue("q", b"a")
            assert replica.llen(f"{{{ns}}}:queue:q") == 1
            assert await c.ensure("p", b"dev")
            async with mesh.open_worker(url, namespace=ns, ttl=1.5) as w:
                assert w.min_replicas == 1
                await w.start_work("p", handler)
                await wait_until(lambda: runs.tokens(b"dev"), 5, "the handler to start")
                assert seen_on_replica == [1]
                setup.replica.stop()
                with pytest.raises(MeshConnectionError, match="only 0 of 1 replicas"):
                    await c.enqueue("q", b"b")
                await wait_until(lambda: runs.cancelled, 5, "the worker to fence")
                assert w.statistics().fenced >= 1
        # The argument wins over the URL.
        async with mesh.open_client(url, namespace=ns, min_replicas=0) as c:
            await c.enqueue("q", b"c")
        with pytest.raises(mesh.ConfigError, match="min_replicas"):
            async with mesh.open_client(url, namespace=ns, min_replicas=-1):
                pass  # pragma: no cover
