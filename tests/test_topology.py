"""Topologies against real Sentinel and Cluster setups started here (tests/topology.py):
discovery, the ROLE check, re-routing of "not executed here" replies, and workers
that follow the master through a failover."""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator

import anyio
import anyio.abc
import anyio.to_thread
import attrs
import pytest
import redis

import mesh
from mesh import MeshConnectionError, Process
from mesh._cluster import crc16, keyslot, parse_shards, parse_slots
from mesh._connection import open_connection
from mesh._eval import run_script
from mesh._harness.topology import (
    SERVICE,
    ClusterSetup,
    Runs,
    begin_migration,
    client,
    cluster_setup,
    end_migration,
    migrate_slot,
    move_keys,
    sentinel_setup,
    wait_for,
)
from mesh._scripts import Script
from mesh._topology import Topology
from mesh._url import parse_url
from mesh.testing import RedisServer, free_port, run_redis_server, wait_until

from .helpers import server_kind

NS = "topo" + secrets.token_hex(3)
ROUTE = f"{{{NS}}}:"
SLOT = keyslot(ROUTE)


# ---------------------------------------------------------------- pure parts


def test_keyslot_known_values() -> None:
    # Values from the Redis Cluster specification / CLUSTER KEYSLOT.
    assert keyslot("foo") == 12182
    assert keyslot("{user1000}.following") == keyslot("{user1000}.followers")
    assert keyslot("foo{}{bar}") == crc16(b"foo{}{bar}") % 16384  # empty tag: whole key
    assert keyslot("foo{{bar}}zap") == keyslot("{bar")
    assert keyslot(b"123456789") == 0x31C3 % 16384  # the CRC16/XMODEM check value


# ---------------------------------------------------------------- Cluster (shared)


#: Valkey 9 serves several dbs in cluster mode (``cluster-databases``); Redis
#: Cluster serves db 0 only.
CLUSTER_DBS = server_kind().name == "valkey" and server_kind().version >= (9,)
#: Sharded pub/sub (SSUBSCRIBE, SPUBLISH, PUBSUB SHARDNUMSUB) and CLUSTER SHARDS
#: came with Redis 7: on 6.2 the tests assert what that server does instead.
SHARDED = server_kind().version >= (7,)


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterSetup]:
    with cluster_setup(replica_of_slot=SLOT, databases=4 if CLUSTER_DBS else None) as setup:
        yield setup


def test_each_kind_of_url_has_its_finder() -> None:
    # No server: what the kind decides once, when the Topology is made.
    standalone = Topology(parse_url("redis://h:1"), epoch_key="{ns}:epoch")
    assert standalone.failover is None and standalone.sentinel_configs() == []
    assert standalone.epoch is not None and not standalone.epoch.strict
    assert not standalone.cluster
    sentinel = Topology(parse_url("redis+sentinel://s1,s2:5/svc/2"), epoch_key="{ns}:epoch")
    assert sentinel.failover is not None
    assert [(c.host, c.port, c.db) for c in sentinel.sentinel_configs()] == [
        ("s1", 26379, 0),
        ("s2", 5, 0),
    ]
    assert sentinel.epoch is not None and sentinel.epoch.strict
    seeds = Topology(parse_url("redis+cluster://a,b"), route_key="{ns}:", epoch_key="{ns}:epoch")
    assert seeds.cluster and seeds.failover is None
    assert seeds.epoch is not None and seeds.epoch.strict
    assert seeds.nodes.slot == keyslot("{ns}:")
    assert Topology(parse_url("redis+cluster://a")).epoch is None


def test_keyslot_matches_the_server(cluster: ClusterSetup) -> None:
    c = client(cluster.masters[0].port)
    for key in ("foo", ROUTE, "{a}b", "a{b", "{}x", "x" * 300, "ключ"):
        assert keyslot(key) == c.execute_command("CLUSTER", "KEYSLOT", key), key
    assert mesh.namespace_slot(NS) == c.execute_command("CLUSTER", "KEYSLOT", ROUTE + "queue:q")


async def test_shards_and_slots_give_the_same_map(cluster: ClusterSetup) -> None:
    async with open_connection(cluster.url()) as conn:
        slots = parse_slots(await conn.execute("CLUSTER", "SLOTS"))
        if not SHARDED:
            # Redis 6.2 has no CLUSTER SHARDS: the map comes from SLOTS alone
            with pytest.raises(mesh.CommandError, match="SHARDS"):
                await conn.execute("CLUSTER", "SHARDS")
            assert conn.topology.cluster
        else:
            shards = parse_shards(await conn.execute("CLUSTER", "SHARDS"), tls=False)
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
    topology.nodes.use_slots = True
    async with open_connection(urls[1], topology=topology) as conn:
        assert conn.node == ("127.0.0.1", owner)
        assert await conn.execute("GET", ROUTE + "k") == urls[-1].encode()


async def test_a_cluster_serves_the_dbs_it_has(cluster: ClusterSetup, redis_url: str) -> None:
    """Redis Cluster serves db 0 only, Valkey 9 the dbs below its
    ``cluster-databases`` (4 here). A db the node does not serve is refused
    with one line that says it is a cluster node, told by asking the node
    (``CLUSTER MYID``), not by the words of SELECT's error, which differ."""
    refused = 4 if CLUSTER_DBS else 2
    url = cluster.url(cluster.masters[0])
    with pytest.raises(MeshConnectionError) as info:
        async with open_connection(f"{url}/{refused}", route_key=ROUTE):
            pass  # pragma: no cover
    assert f"is a cluster node that does not serve db {refused} " in str(info.value), info.value
    if CLUSTER_DBS:
        owner = cluster.owner_port(SLOT)
        async with open_connection(f"{url}/2", route_key=ROUTE) as c:
            assert c.node == ("127.0.0.1", owner)
            assert await c.execute("SET", ROUTE + "db", "two") == b"OK"
        assert redis.Redis(port=owner, db=2).get(ROUTE + "db") == b"two"
        assert client(owner).get(ROUTE + "db") is None  # not in db 0
    # A standalone server's db out of range is not said to be a cluster's.
    with pytest.raises(MeshConnectionError) as info:
        async with open_connection(redis_url + "/99"):
            pass  # pragma: no cover
    assert "SELECT failed" in str(info.value) and "cluster" not in str(info.value), info.value


@pytest.mark.both_loops
async def test_moved_is_rerouted_not_raised(cluster: ClusterSetup, mesh_loop: str) -> None:
    # A connection pinned to the wrong master (as if the slot had moved since):
    # MOVED replies are re-routed and retried, in order, and no error escapes.
    owner = cluster.owner_port(SLOT)
    wrong = next(m for m in cluster.masters if m.port != owner)
    topology = Topology(parse_url(cluster.url(wrong)), route_key="{elsewhere}")
    topology.nodes.slot = next(
        e[0]
        for e in client(wrong.port).execute_command("CLUSTER", "SLOTS")
        if e[2][1] == wrong.port
    )
    key = ROUTE + "l-" + mesh_loop  # the cluster is the module's: a key each
    async with open_connection(cluster.url(wrong), topology=topology) as conn:
        assert conn.node == ("127.0.0.1", wrong.port)
        topology.nodes.slot = SLOT  # the next discovery looks for our namespace's master
        replies = await conn.pipeline([("DEL", key), ("RPUSH", key, "a"), ("RPUSH", key, "b")])
        assert replies == [0, 1, 2]
        assert await conn.execute("LRANGE", key, 0, -1) == [b"a", b"b"]
        assert conn.node == ("127.0.0.1", owner)
        assert conn.statistics().reroutes >= 1
    # A plain error reply stays the caller's.
    async with open_connection(cluster.url(), route_key=ROUTE) as conn:
        with pytest.raises(mesh.CommandError, match="WRONGTYPE"):
            await conn.execute("INCR", key)


async def test_ask_is_answered_with_asking(cluster: ClusterSetup) -> None:
    """During a slot migration, a command on a key the source no longer has gets
    ASK: it is sent once, after ASKING, to the importing node; the connection stays
    on its node. An EVALSHA of a script the importing node never saw still runs
    (NOSCRIPT there: EVAL, redirected the same way). A multi-key script whose keys
    are split between the nodes gets TRYAGAIN and is retried until the migration
    ends, then runs on the new owner. With min_replicas, the writes sent after ASK
    are confirmed with WAIT on the importing node too."""
    # A slot of the master that has a replica, moving to one that has none.
    source_port = cluster.owner_port(SLOT)
    tag = next(
        f"{{ask{i}}}"
        for i in range(10**6)
        if keyslot(f"{{ask{i}}}") != SLOT
        and cluster.owner_port(keyslot(f"{{ask{i}}}")) == source_port
    )
    slot = keyslot(tag)
    source = next(m for m in cluster.masters if m.port == source_port)
    target = next(m for m in cluster.masters if m.port != source_port)
    here, moved = tag + "here", tag + "moved"
    script = Script("probe", b"return redis.call('INCRBY', KEYS[1], ARGV[1])", "")
    script = attrs.evolve(script, sha=hashlib.sha1(script.source).hexdigest())
    client(source.port).set(here, "1")
    async with open_connection(cluster.url(), route_key=tag) as conn:
        assert conn.node == ("127.0.0.1", source.port)
        await conn.execute("SCRIPT", "LOAD", script.source)
        await anyio.to_thread.run_sync(begin_migration, cluster, slot, source, target)
        # A key the source does not have: ASK, then ASKING + SET on the target.
        assert await conn.execute("SET", moved, "v") == b"OK"
        assert await run_script(conn, script, [tag + "counter"], [5]) == 5
        assert await conn.execute("GET", here) == b"1"  # still served by the source
        stats = conn.statistics()
        assert conn.node == ("127.0.0.1", source.port)
        assert stats.reroutes == 0 and stats.asks >= 3  # SET, EVALSHA (NOSCRIPT), EVAL
        on_target = client(target.port).pipeline(transaction=False)
        on_target.execute_command("ASKING").get(moved).execute_command("ASKING")
        on_target.get(tag + "counter")
        assert on_target.execute() == [True, b"v", True, b"5"]
        count = client(source.port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
        assert count == 1  # only `here`: nothing was written on the source
        # The source has a replica, the importing node none: WAIT there fails.
        with pytest.raises(MeshConnectionError, match="where an ASK redirection sent writes"):
            await conn.wait_replicas(1, 0.2)
        # A script on a key each side has: TRYAGAIN until the slot has moved.
        results: list[object] = []

        async def split() -> None:
            results.append(
                await conn.execute(
                    "EVAL",
                    "return redis.call('MGET', KEYS[1], KEYS[2])",
                    2,
                    here,
                    moved,
                )
            )

        async with anyio.create_task_group() as nursery:
            nursery.start_soon(split)
            # five TRYAGAIN rounds (5 ms doubling: about 0.15 s), and no reply yet
            await wait_until(lambda: conn.statistics().retries >= 5, what="TRYAGAIN retries")
            assert not results  # still retrying
            await anyio.to_thread.run_sync(move_keys, slot, source, target)
            await anyio.to_thread.run_sync(end_migration, cluster, slot, target)
        assert results == [[b"1", b"v"]]
        assert conn.node == ("127.0.0.1", target.port)


async def test_slot_migration_under_load(cluster: ClusterSetup) -> None:
    """The namespace's slot moves to another master (IMPORTING/MIGRATING, MIGRATE a
    few keys at a time, SETSLOT NODE) while two workers hold persistent tasks and a
    producer enqueues one-shot tasks: scripts meet ASK and TRYAGAIN mid-migration;
    the workers end up on the new master; every acknowledged enqueue runs; the
    persistent tasks run once each, and again on the new master (under larger
    tokens) when a worker leaves."""
    ns = next(f"mg{i}" for i in range(10**6) if mesh.namespace_slot(f"mg{i}") != SLOT)
    slot = mesh.namespace_slot(ns)
    source_port = cluster.owner_port(slot)
    source = next(m for m in cluster.masters if m.port == source_port)
    target = next(m for m in cluster.masters if m.port != source_port)
    tasks = [f"device-{i}".encode() for i in range(4)]
    runs = Runs()
    acked: set[bytes] = set()
    done: set[bytes] = set()

    async def one_shot(p: Process) -> None:
        done.add(p.task)

    url = cluster.url(scheme="redis+cluster")
    async with mesh.open_client(url, namespace=ns) as c:
        for t in tasks:
            await c.ensure("p", t)

        async def produce() -> None:
            for n in range(10**9):
                payload = b"job-%d" % n
                try:
                    await c.enqueue("jobs", payload)
                    acked.add(payload)
                except MeshConnectionError:
                    pass  # unknown whether it ran: not acknowledged
                await anyio.sleep(0.005)

        workers: list[mesh.Worker] = []
        scopes: list[anyio.CancelScope] = []
        async with anyio.create_task_group() as nursery:

            async def one() -> None:
                with anyio.CancelScope() as scope:
                    async with mesh.open_worker(url, namespace=ns, ttl=3) as w:
                        await w.start_work("p", runs.handler)
                        await w.start_work("jobs", one_shot)
                        workers.append(w)
                        scopes.append(scope)
                        await anyio.sleep_forever()

            for _ in range(2):
                nursery.start_soon(one)
            nursery.start_soon(produce)
            await wait_until(
                lambda: len(workers) == 2 and all(w.statistics().running >= 2 for w in workers),
                15,
                "both workers serving, 2 persistent tasks each",
            )
            await wait_until(lambda: len(done) > 10, 10, "one-shot tasks to run")
            before = client(source.port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
            await anyio.to_thread.run_sync(begin_migration, cluster, slot, source, target)
            # A few keys at a time, with pauses: commands meet the slot half moved.
            moved = 0
            while True:
                step = await anyio.to_thread.run_sync(
                    lambda: move_keys(slot, source, target, batch=3, rounds=1)
                )
                if not step:
                    break
                moved += step
                await anyio.sleep(0.02)
            await anyio.to_thread.run_sync(end_migration, cluster, slot, target)
            assert before > 10 and moved > 10  # (keys may come and go meanwhile)
            beats = [w.statistics().heartbeats for w in workers]
            await wait_until(
                lambda: (
                    all(
                        w.statistics().heartbeats > b + 1
                        for w, b in zip(workers, beats, strict=True)
                    )
                    and all(runs.running(t) == 1 for t in tasks)
                ),
                15,
                "heartbeats on the new master and every persistent task running once",
            )
            assert all(w._conn.node == ("127.0.0.1", target.port) for w in workers)
            conns = [*(w._conn.statistics() for w in workers), c._conn.statistics()]
            asks, retries = sum(s.asks for s in conns), sum(s.retries for s in conns)
            assert asks + retries > 0  # the slot was met half moved
            # One worker leaves: its persistent tasks run again, claimed on the new master.
            leaving = workers[0]
            left = {p.task for p in await c.processes("p") if p.worker_id == leaving.id}
            scopes[0].cancel()
            await wait_until(
                lambda: (
                    all(runs.running(t) == 1 for t in tasks)
                    and workers[1].statistics().running >= 4
                ),
                15,
                "the other worker to take every persistent task",
            )
            since = len(done)
            await wait_until(lambda: len(done) > since + 10, 10, "one-shot tasks to go on")
            nursery.cancel_scope.cancel()
        # Every acknowledged enqueue ran (or waits in the queue).
        async with mesh.open_client(url, namespace=ns) as c2:
            queued = set(await c2.tasks("jobs"))
        assert acked <= done | queued, sorted(acked - done - queued)[:5]
    assert left and all(len(runs.tokens(t)) >= 2 for t in left)
    runs.check_no_overlap()
    assert client(source.port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert client(target.port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) > 0
    print(
        f"migration: {moved} keys moved, {asks} ASK, {retries} TRYAGAIN; fenced",
        [w.statistics().fenced for w in workers],
    )


def shard_subscribers(port: int, channel: str) -> int:
    """Subscribers of ``channel`` on the node at ``port``: sharded ones where
    the server has sharded pub/sub (Redis 7+), plain ones on Redis 6.2, where
    the mesh subscribes its sharded channels plainly on the same node."""
    sub = "SHARDNUMSUB" if SHARDED else "NUMSUB"
    reply = client(port).execute_command("PUBSUB", sub, channel)
    return int(reply[1])


async def test_sharded_nudges_follow_the_slot(cluster: ClusterSetup) -> None:
    """The worker's wake and cancel channels are SSUBSCRIBEd on the slot's master
    only; the scripts SPUBLISH there (no PUBLISH reaches the cluster bus), so a
    wake and a cancel from a client that came in through another node arrive with
    the heartbeat 10 s away. The slot then migrates: the old master drops the
    sharded subscriptions (an unasked sunsubscribe), the pubsub follows the slot to
    its new master, and a wake and a cancel published there arrive too. On Redis
    6.2, which has no sharded pub/sub: the channels are subscribed plainly on
    the slot's master, the scripts PUBLISH (the cluster bus broadcasts it), and
    a wake and a cancel arrive before and after the migration all the same."""
    ns = next(f"sh{i}" for i in range(10**6) if mesh.namespace_slot(f"sh{i}") != SLOT)
    slot = mesh.namespace_slot(ns)
    source_port = cluster.owner_port(slot)
    target = next(m for m in cluster.masters if m.port != source_port)
    others = [m.port for m in cluster.masters if m.port != source_port]
    started: list[bytes] = []
    cancelled: list[bytes] = []

    async def handler(p: Process) -> None:
        started.append(p.task)
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(p.task)
            raise

    def stats(port: int) -> dict[str, int]:
        info = client(port).info("commandstats")
        return {n: info.get(f"cmdstat_{n}", {}).get("calls", 0) for n in ("publish", "spublish")}

    async def wake_and_cancel(c: mesh.Client, w: mesh.Worker, task: bytes) -> None:
        idle = f"{{{ns}}}:idle:q"
        owner = cluster.owner_port(slot)
        await wait_until(lambda: client(owner).sismember(idle, w.id), 10, "the worker to be idle")
        await c.enqueue("q", task)
        await wait_until(lambda: task in started, 5, "the woken worker to claim")
        assert await c.cancel("q", task) == 1
        await wait_until(lambda: task in cancelled, 5, "the cancel to reach the handler")

    other_url = cluster.url(next(m for m in cluster.masters if m.port == others[0]))
    async with (
        mesh.open_client(other_url, namespace=ns) as c,
        mesh.open_worker(cluster.url(scheme="redis+cluster"), namespace=ns, ttl=30) as w,
    ):
        await w.start_work("q", handler)
        wake = f"{{{ns}}}:wake:{w.id}"
        await wait_until(
            lambda: shard_subscribers(source_port, wake) == 1, 5, "the sharded subscription"
        )
        assert [shard_subscribers(port, wake) for port in others] == [0, 0]
        for m in cluster.masters:
            client(m.port).config_resetstat()
        await wake_and_cancel(c, w, b"before")
        if not SHARDED:
            assert stats(source_port)["publish"] >= 2
            assert all(stats(m.port)["spublish"] == 0 for m in cluster.masters)
            reconnects = w._pubsub.reconnects
            await anyio.to_thread.run_sync(lambda: migrate_slot(cluster, slot, target))
            # 6.2 tells a subscriber nothing when a slot moves: the pub/sub
            # follows the slot once the worker's own commands meet MOVED (its
            # next heartbeat at the latest, 10 s); a nudge lost meanwhile is
            # made up by that heartbeat
            await wait_until(
                lambda: (
                    w._pubsub.reconnects > reconnects and shard_subscribers(target.port, wake) == 1
                ),
                25,
                "the subscription to follow, by a heartbeat",
            )
            assert shard_subscribers(source_port, wake) == 0
            await wake_and_cancel(c, w, b"after")
            assert started == [b"before", b"after"] and cancelled == started
            return
        assert stats(source_port)["spublish"] >= 2
        assert all(stats(m.port)["publish"] == 0 for m in cluster.masters)
        reconnects = w._pubsub.reconnects
        await anyio.to_thread.run_sync(lambda: migrate_slot(cluster, slot, target))
        await wait_until(
            lambda: w._pubsub.reconnects > reconnects and shard_subscribers(target.port, wake) == 1,
            10,
            "the subscription to follow",
        )
        assert shard_subscribers(source_port, wake) == 0
        assert w._pubsub._link.slot_moves >= 1  # the old master dropped the channels
        client(target.port).config_resetstat()
        await wake_and_cancel(c, w, b"after")
        assert stats(target.port)["spublish"] >= 2 and stats(target.port)["publish"] == 0
    assert started == [b"before", b"after"] and cancelled == started


@pytest.mark.both_loops
async def test_client_and_worker_on_other_nodes(cluster: ClusterSetup, mesh_loop: str) -> None:
    owner = cluster.owner_port(SLOT)
    other = next(m for m in cluster.masters if m.port != owner)
    runs = Runs()
    device = f"device-{mesh_loop}".encode()  # the cluster is the module's: one each
    async with mesh.open_client(cluster.url(cluster.replicas[0]), namespace=NS) as c:
        assert await c.ensure("p", device)
        async with mesh.open_worker(cluster.url(other), namespace=NS, ttl=3) as w:
            await w.start_work("p", runs.handler)
            await wait_until(lambda: runs.tokens(device), 10, "the persistent task to run")
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

            await wait_until(even, within=15, what="weights 4 and 8 of 12 at capacities 1, 2")
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


@pytest.mark.parametrize("where", ["seeds", "replica"])
def test_cli_demo_on_a_cluster(cluster: ClusterSetup, where: str) -> None:
    """`mesh demo --redis` on a cluster (a seed list, or a replica's plain URL)
    runs the whole tour and leaves no key behind on any master."""
    url = (
        cluster.url(scheme="redis+cluster")
        if where == "seeds"
        else cluster.url(cluster.replicas[0])
    )
    out = subprocess.run(
        [sys.executable, "-m", "mesh.cli", "demo", "--redis", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MOVED" not in out.stdout + out.stderr
    for m in cluster.masters:
        assert not list(client(m.port).scan_iter(match="{demo-*")), m.port


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
            async with anyio.create_task_group() as nursery:
                workers: list[mesh.Worker] = []

                async def one() -> None:
                    async with mesh.open_worker(url, namespace=ns, ttl=3) as w:
                        await w.start_work("p", runs.handler)
                        workers.append(w)  # serving: a failover may begin
                        await anyio.sleep_forever()

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
                await anyio.to_thread.run_sync(
                    lambda: client(replica.port).execute_command("CLUSTER", "FAILOVER")
                )
                try:
                    await anyio.to_thread.run_sync(
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
                # The sharded subscriptions (wake, cancel) followed to the new master.
                await wait_until(
                    lambda: all(
                        shard_subscribers(replica.port, f"{route}cancel:{w.id}") == 1
                        and shard_subscribers(old_master.port, f"{route}cancel:{w.id}") == 0
                        for w in workers
                    ),
                    10,
                    "the sharded subscriptions on the new master",
                )

                # 2. SIGKILL of the slot's master (now the former replica): the old
                # master is promoted back; the workers ride it out or fence and
                # rejoin, and every persistent task ends up running exactly once.
                replica.process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
                await anyio.to_thread.run_sync(
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
                await wait_until(
                    lambda: all(
                        shard_subscribers(old_master.port, f"{route}cancel:{w.id}") == 1
                        for w in workers
                    ),
                    10,
                    "the sharded subscriptions back on the old master",
                )
                held = {p.task for p in await c.processes("p")}
                nursery.cancel_scope.cancel()
        assert held == set(tasks)
        runs.check_no_overlap()


# ---------------------------------------------------------------- Sentinel


@pytest.mark.both_loops
async def test_sentinel_failover_under_load() -> None:
    """SIGKILL the master while workers hold persistent tasks and run one-shot tasks
    and a producer enqueues, all with min_replicas=1 (two replicas): the workers
    follow the promoted replica; every persistent task runs again, under a larger
    token; no acknowledged enqueue is lost; no two owners of a task overlap and the
    fenced sink refuses nothing; the old master, restarted empty, takes no write."""
    ns = "sf" + secrets.token_hex(3)
    tasks = [f"device-{i}".encode() for i in range(4)]
    with sentinel_setup(sentinels=1, down_after_ms=400, replicas=2) as setup:
        # A URL naming the replica directly is refused: it is not a master.
        with pytest.raises(MeshConnectionError, match="is a replica of"):
            async with mesh.open_client(setup.replica.url, namespace=ns):
                pass  # pragma: no cover
        url = setup.url + "?min_replicas=1"
        runs = Runs()
        acked: set[bytes] = set()
        done: set[bytes] = set()
        one_shot_tokens: list[tuple[int, float]] = []

        async def quick(p: Process) -> None:
            one_shot_tokens.append((p.token, anyio.current_time()))
            done.add(p.task)

        async with mesh.open_client(url, namespace=ns) as c:
            assert c.min_replicas == 1
            for t in tasks:
                await c.ensure("p", t)

            async def produce(task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
                with anyio.CancelScope() as scope:
                    task_status.started(scope)
                    for n in range(10**9):
                        payload = b"job-%d" % n
                        try:
                            await c.enqueue("jobs", payload)
                            acked.add(payload)  # acknowledged: on a replica too
                        except MeshConnectionError:
                            await anyio.sleep(0.05)  # unknown whether it ran
                        await anyio.sleep(0.002)

            workers: list[mesh.Worker] = []
            async with anyio.create_task_group() as nursery:

                async def one() -> None:
                    async with mesh.open_worker(url, namespace=ns, ttl=1) as w:
                        await w.start_work("p", runs.handler)
                        await w.start_work("jobs", quick)
                        workers.append(w)  # serving: a failover may begin
                        await anyio.sleep_forever()

                for _ in range(2):
                    nursery.start_soon(one)
                producer = await nursery.start(produce)
                await wait_until(
                    lambda: len(workers) == 2 and all(runs.tokens(t) for t in tasks),
                    10,
                    "both workers serving and first runs",
                )
                await wait_until(lambda: len(done) > 10, 10, "one-shot tasks to run")

                killed_at = anyio.current_time()
                old = setup.master
                old.stop()  # SIGKILL
                new_port = await anyio.to_thread.run_sync(
                    lambda: wait_for(
                        "Sentinel to promote a replica",
                        lambda: (port := setup.master_port()) != old.port and port,
                    )
                )
                promoted_at = anyio.current_time()
                # The other replica follows the new master (so min_replicas=1 can be
                # met again) before the old master comes back.
                (other,) = [r for r in (setup.replica, *setup.more_replicas) if r.port != new_port]
                await anyio.to_thread.run_sync(
                    lambda: wait_for(
                        "the other replica to follow the new master",
                        lambda: (
                            (info := client(other.port).info("replication")).get("master_port")
                            == new_port
                            and info["master_link_status"] == "up"
                        ),
                    )
                )
                # Restarted empty, on the same port, and unable to be demoted: it
                # stays a master with no data, which is what Sentinel must steer us from.
                old.args = (
                    *old.args,
                    "--rename-command", "REPLICAOF", "",
                    "--rename-command", "SLAVEOF", "",
                )  # fmt: skip
                await anyio.to_thread.run_sync(old.start)
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
                done_before, acked_before = len(done), len(acked)
                await wait_until(
                    lambda: len(done) > done_before + 10 and len(acked) > acked_before + 10,
                    10,
                    "enqueues and one-shot tasks to go on",
                )
                producer.cancel()
                # Every acknowledged enqueue runs: none was lost with the old master.
                await wait_until(lambda: acked <= done, 10, "every acknowledged enqueue to run")
                nursery.cancel_scope.cancel()
        # Never the old, empty master again (under load, with down-after 400 ms,
        # Sentinel may fail over once more, between the two replicas).
        assert setup.master_port() != old.port
        runs.check_no_overlap()
        for t in tasks:
            assert len(runs.tokens(t)) >= 2
        # Tokens never went backwards: every handler started after the promotion
        # holds a larger token than every handler started before the SIGKILL.
        before = [tok for _, tok, at in runs.started if at < killed_at]
        before += [tok for tok, at in one_shot_tokens if at < killed_at]
        after = [tok for _, tok, at in runs.started if at > promoted_at]
        after += [tok for tok, at in one_shot_tokens if at > promoted_at]
        assert before and after and max(before) < min(after)
        print(
            f"sentinel: {len(acked)} acknowledged enqueues, all run; {runs.actions} fenced "
            f"actions, {len(runs.refused)} refused; tokens {max(before)} -> {min(after)}"
        )
        # The empty old master took nothing from the mesh: no key, and no script
        # or write command ever ran there.
        old_master = client(setup.master.port)
        assert old_master.dbsize() == 0
        ran = set(old_master.info("commandstats"))
        assert not ran & {"cmdstat_evalsha", "cmdstat_eval", "cmdstat_set", "cmdstat_rpush"}, ran


async def test_sentinel_failover_shorter_than_the_ttl() -> None:
    """SENTINEL FAILOVER (the master demoted, a replica promoted in about a second)
    while workers with the default TTL (3 s, R = 2 s) hold persistent tasks: they
    follow the new master and no handler is cancelled or started again."""
    ns = "st" + secrets.token_hex(3)
    tasks = [f"device-{i}".encode() for i in range(4)]
    with sentinel_setup(sentinels=1, down_after_ms=400) as setup:
        runs = Runs()
        async with mesh.open_client(setup.url, namespace=ns) as c:
            for t in tasks:
                await c.ensure("p", t)
            workers: list[mesh.Worker] = []
            async with anyio.create_task_group() as nursery:

                async def one() -> None:
                    async with mesh.open_worker(setup.url, namespace=ns, ttl=3) as w:
                        await w.start_work("p", runs.handler)
                        workers.append(w)
                        await anyio.sleep_forever()

                for _ in range(2):
                    nursery.start_soon(one)
                # (a claimed process counts as running before its handler's
                # first line has run: wait for the four starts too)
                await wait_until(
                    lambda: (
                        len(workers) == 2
                        and all(w.statistics().running == 2 for w in workers)
                        and len(runs.started) == 4
                    ),
                    # (the second worker gets its two by a rebalance, a
                    # heartbeat or two after it joins: under CI's load, 15 s
                    # was not always enough, once in six full runs)
                    45,
                    "both workers serving, 2 persistent tasks each",
                )
                cancelled, started = len(runs.cancelled), len(runs.started)
                sentinel = client(setup.sentinels[0].port)
                await anyio.to_thread.run_sync(
                    lambda: wait_for(  # NOGOODSLAVE until Sentinel has polled the replica
                        "Sentinel to start a failover",
                        lambda: sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE),
                    )
                )
                await anyio.to_thread.run_sync(
                    lambda: wait_for(
                        "Sentinel to promote the replica",
                        lambda: setup.master_port() == setup.replica.port,
                    )
                )
                beats = [w.statistics().heartbeats for w in workers]
                await wait_until(
                    lambda: all(
                        w._conn.node == ("127.0.0.1", setup.replica.port)
                        and w.statistics().heartbeats > b + 1
                        for w, b in zip(workers, beats, strict=True)
                    ),
                    10,
                    "heartbeats on the new master",
                )
                assert len(runs.cancelled) == cancelled  # no handler stopped
                assert len(runs.started) == started  # none started again
                assert all(w.statistics().fenced == 0 for w in workers)
                nursery.cancel_scope.cancel()
    runs.check_no_overlap()


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
        await wait_until(lambda: "gave up handing back" in caplog.text, 10, "the give-up", 0.02)
        await anyio.to_thread.run_sync(own_redis.start)
        beats = w.statistics().heartbeats
        with anyio.fail_after(10):
            while w.statistics().heartbeats <= beats + 1:  # noqa: ASYNC110 - poll
                await anyio.sleep(0.02)
        assert w.statistics().fenced >= 1
        assert w.statistics().generation >= 2


async def test_a_claim_the_master_lost_is_stopped(own_redis: RedisServer) -> None:
    """A failover to a replica that missed the last writes, played on one server:
    the namespace goes back to a snapshot taken just before a worker claimed a
    persistent task (DUMP, then DEL + RESTORE in one transaction). The worker's
    lease is still there, but the claim is not: at its next heartbeat the worker
    finds it runs a process the master does not know and stops it; the task then
    runs again, once, under a larger token."""
    ns = "gh" + secrets.token_hex(3)
    runs = Runs()
    r = client(own_redis.port)

    async with mesh.open_client(own_redis.url, namespace=ns) as c:
        async with mesh.open_worker(own_redis.url, namespace=ns, ttl=3) as w:
            await w.start_work("p", runs.handler)
            assert await c.ensure("p", b"other")
            await wait_until(lambda: runs.tokens(b"other"), 5, "the first task to run")
            beats = w.statistics().heartbeats
            await wait_until(lambda: w.statistics().heartbeats > beats, 5, "a heartbeat")
            # The replica's view: everything up to now...
            snapshot = await anyio.to_thread.run_sync(
                lambda: {k: (r.dump(k), r.pttl(k)) for k in r.scan_iter(match=f"{{{ns}}}:*")}
            )
            # ... and then a write it never got: a persistent task and its claim.
            assert await c.ensure("p", b"dev")
            await wait_until(lambda: runs.tokens(b"dev"), 5, "the new task to run")
            (first,) = runs.tokens(b"dev")

            def fail_over() -> None:
                t = r.pipeline(transaction=True)
                t.delete(*r.scan_iter(match=f"{{{ns}}}:*"))
                for key, (dumped, pttl) in snapshot.items():
                    assert dumped is not None
                    t.restore(key, max(pttl, 0), dumped, replace=True)
                t.execute()

            await anyio.to_thread.run_sync(fail_over)
            # Lost with the claim: the ensure. The worker stops the ghost handler.
            await wait_until(lambda: runs.running(b"dev") == 0, 5, "the ghost to be stopped")
            assert (b"dev", first) in runs.cancelled
            assert runs.running(b"other") == 1  # the claim Redis still has runs on
            assert w.statistics().fenced == 0
            # Declared again (what reconcile does), it runs again under a larger token.
            assert await c.ensure("p", b"dev")
            await wait_until(lambda: runs.running(b"dev") == 1, 5, "the task to run again")
            assert runs.tokens(b"dev")[-1] > first
    runs.check_no_overlap()


@pytest.mark.both_loops
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
                # (counted once every handler has exited)
                await wait_until(lambda: w.statistics().fenced >= 1, 5, "the fence counted")
        # The argument wins over the URL.
        async with mesh.open_client(url, namespace=ns, min_replicas=0) as c:
            await c.enqueue("q", b"c")
        with pytest.raises(mesh.ConfigError, match="min_replicas"):
            async with mesh.open_client(url, namespace=ns, min_replicas=-1):
                pass  # pragma: no cover


@pytest.mark.slow
async def test_min_replicas_holds_everything_while_the_replica_lags() -> None:
    """A replica that stops acknowledging (SIGSTOP: the link stays up, so Redis
    still counts it as connected) with min_replicas=1: `ensure` and `enqueue`
    raise after connect_timeout instead of returning, the worker's renewals are
    not confirmed so it fences, and a persistent task it claimed on the master
    does not start. After SIGCONT the same calls return and every task runs, each
    handler only once its claim is on the replica."""
    ns = "lag" + secrets.token_hex(3)
    procs = f"{{{ns}}}:procs:p"
    token = f"{{{ns}}}:token"
    with (
        run_redis_server() as master,
        run_redis_server(("--replicaof", "127.0.0.1", str(free_port()))) as replica,
    ):
        r = client(replica.port)
        r.execute_command("REPLICAOF", "127.0.0.1", master.port)
        wait_for("the replica to sync", lambda: r.info("replication")["master_link_status"] == "up")
        url = master.url + "?min_replicas=1&connect_timeout=0.5"
        m = client(master.port)
        runs = Runs()
        on_replica: dict[bytes, bool] = {}

        async def handler(p: Process) -> None:
            on_replica[p.task] = bool(r.hexists(procs, p.id))
            await runs.handler(p)

        async with (
            mesh.open_client(url, namespace=ns) as c,
            mesh.open_worker(url, namespace=ns, ttl=1.5) as w,
        ):
            await w.start_work("p", handler)
            assert await c.ensure("p", b"dev1")
            await wait_until(lambda: runs.running(b"dev1") == 1, 5, "dev1 to start")
            before = int(m.get(token) or 0)
            os.kill(replica.pid, signal.SIGSTOP)
            try:
                with pytest.raises(MeshConnectionError, match="only 0 of 1 replicas"):
                    await c.ensure("p", b"dev2")  # on the master, not confirmed
                with pytest.raises(MeshConnectionError, match="only 0 of 1 replicas"):
                    await c.enqueue("q", b"job")
                await wait_until(lambda: int(m.get(token) or 0) > before, 5, "a claim of dev2")
                await wait_until(lambda: w.statistics().fenced >= 1, 5, "the worker to fence")
                assert runs.running(b"dev1") == 0  # its renewals did not count
                assert not runs.tokens(b"dev2")  # claimed on the master, never started
            finally:
                os.kill(replica.pid, signal.SIGCONT)
            await c.enqueue("q", b"job2")  # confirmed again
            assert await c.ensure("p", b"dev2") is False  # already there
            await wait_until(
                lambda: runs.running(b"dev1") == 1 and runs.running(b"dev2") == 1,
                10,
                "both tasks to run again",
            )
        assert on_replica == {b"dev1": True, b"dev2": True}
        assert len(runs.tokens(b"dev1")) >= 2
        runs.check_no_overlap()


# ---------------------------------------------------------------- groups (issue 36)


class GroupRuns:
    """A handler that holds each job ``hold`` seconds and notes, per group,
    the jobs done and the most of its jobs running at once in this process."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.done: list[tuple[str | None, bytes]] = []
        self.running: dict[str | None, int] = {}
        self.most: dict[str | None, int] = {}

    async def handler(self, p: Process) -> None:
        n = self.running[p.group] = self.running.get(p.group, 0) + 1
        self.most[p.group] = max(self.most.get(p.group, 0), n)
        try:
            await anyio.sleep(self.hold)
        finally:
            self.running[p.group] -= 1
        self.done.append((p.group, p.task))


async def test_groups_on_a_cluster(cluster: ClusterSetup) -> None:
    """The group keys are made inside the scripts from the namespace's prefix
    ({ns}: hash tag): a cluster runs every group script (enqueue, configure,
    pause, the claim among groups, cancel of a group's copy) on the
    namespace's slot, reached through other nodes, and the keys land there."""
    owner = cluster.owner_port(SLOT)
    other = next(m for m in cluster.masters if m.port != owner)
    runs = GroupRuns(0.05)
    jobs = {g: [f"{g}-{i}".encode() for i in range(6)] for g in ("ga", "gb", "gc")}
    async with mesh.open_client(cluster.url(cluster.replicas[0]), namespace=NS) as c:
        await c.configure_group("gq", "ga", concurrency=2)
        assert await c.pause_group("gq", "gc")
        for g, payloads in jobs.items():
            await c.enqueue_many("gq", payloads, group=g)
        await c.enqueue("gq", b"gone", group="gb")
        assert await c.cancel("gq", b"gone", group="gb") == 1
        assert client(owner).exists(ROUTE + "gq:gq|ga", ROUTE + "groups:gq") == 2
        async with mesh.open_worker(cluster.url(other), namespace=NS, ttl=3) as w:
            await w.start_work("gq", runs.handler, concurrency=8)
            want = {(g, p) for g in ("ga", "gb") for p in jobs[g]}
            await wait_until(lambda: set(runs.done) >= want, 15, "ga's and gb's jobs done")
            assert not [t for g, t in runs.done if g == "gc"]  # paused
            assert await c.resume_group("gq", "gc")
            want |= {("gc", p) for p in jobs["gc"]}
            await wait_until(lambda: set(runs.done) == want, 15, "gc's jobs done")
    assert len(runs.done) == len(want) and runs.most["ga"] <= 2
    assert b"gone" not in {t for _, t in runs.done}
    r = client(owner)
    assert [f for f in r.execute_command("HKEYS", ROUTE + "groups:gq") if f.startswith(b"r:")] == []
    assert not r.exists(ROUTE + "gq:gq|ga", ROUTE + "gready:gq")


async def test_groups_through_a_sentinel_failover() -> None:
    """SENTINEL FAILOVER while workers run a capped group's jobs: they follow
    the new master, every job is done, the cap holds in each worker, and no
    running count of the group is left on the new master."""
    ns = "sg" + secrets.token_hex(3)
    jobs = [f"j{i}".encode() for i in range(60)]
    with sentinel_setup(sentinels=1, down_after_ms=400) as setup:
        runs = GroupRuns(0.1)
        async with mesh.open_client(setup.url, namespace=ns) as c:
            await c.configure_group("q", "g", concurrency=3)
            await c.enqueue_many("q", jobs, group="g")
            async with anyio.create_task_group() as nursery:

                async def one() -> None:
                    async with mesh.open_worker(setup.url, namespace=ns, ttl=3) as w:
                        await w.start_work("q", runs.handler, concurrency=10)
                        await anyio.sleep_forever()

                for _ in range(2):
                    nursery.start_soon(one)
                await wait_until(lambda: len(runs.done) >= 3, 15, "the group's jobs to run")
                sentinel = client(setup.sentinels[0].port)
                await anyio.to_thread.run_sync(
                    lambda: wait_for(
                        "Sentinel to start a failover",
                        lambda: sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE),
                    )
                )
                await anyio.to_thread.run_sync(
                    lambda: wait_for(
                        "Sentinel to promote the replica",
                        lambda: setup.master_port() == setup.replica.port,
                    )
                )
                await wait_until(
                    lambda: {t for _, t in runs.done} >= set(jobs), 30, "every job done"
                )
                await wait_until(lambda: no_processes(c, "q"), 10, "nothing left running")
                nursery.cancel_scope.cancel()
            fields = client(setup.replica.port).execute_command("HKEYS", f"{{{ns}}}:groups:q")
        assert [f for f in fields if f.startswith(b"r:")] == []
    assert runs.most["g"] <= 3
    assert {t for _, t in runs.done} == set(jobs)


async def no_processes(c: mesh.Client, queue: str) -> bool:
    return not await c.processes(queue)
