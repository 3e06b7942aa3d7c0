"""Fleets: many workers in one OS process that share what can be shared.

A worker from :func:`~mesh.open_worker` has its own connection, its own
pub/sub connection, its own reaper, its own heartbeat script call every H and
its own periodic-task scheduler and policy reader. That is right for one
worker per process; with a thousand per process it is what sets how many
workers one Redis can carry (each idle worker costs Redis a round trip every
H and a PING every T, and the reapers and schedulers multiply with the
workers).

The workers of a :class:`Fleet` (:func:`open_fleet`, then
:meth:`Fleet.open_worker` once per worker) are the same :class:`Worker`
objects with the same lease, runners, fencing and hand-back, but share:

* **one connection** for all their commands (pipelined by its writer);
* **one heartbeat call for many leases**: each worker's heartbeat loop runs
  as usual, but its renewal is queued and sent with those of the fleet's
  other workers that come due within a short window (``batch_window``,
  H/20 capped at 50 ms), up to 100 per ``heartbeat.lua`` call. The script
  fences each worker on its own: a worker whose lease is gone gets its own
  :class:`FencedError`, and the others of the call are renewed. A worker's
  self-fence deadline still counts from when *its* loop asked for the
  renewal (before the window), so the batching can only make it fence
  earlier, never later;
* **one pub/sub connection**: each worker subscribes its own cancel and wake
  channels on it, and the fleet's listener hands each message to the worker
  it names; key-expiry events go to the fleet's reaper;
* **one reaper**, which stands for all the fleet's workers: the supervisor
  draws whether to act on a death with probability ``herd`` x (workers in the
  fleet) / (workers in the mesh), so the mesh still has about ``herd``
  reapers on watch, as many as with one reaper per worker;
* **one** periodic-task scheduler and **one** policy reader (one ``HMGET`` per
  H for the queues of all its workers);
* **paced joins**: workers that join together (a fleet process starting,
  or its workers rejoining after fencing themselves when the connection
  came back) register in turns spread over ``join_window`` (:class:`Joins`),
  not all in the same instant.

Every worker of a fleet has the fleet's lease timing (one TTL per call). The
recycle counters (``peers_recycled`` and so on) are the fleet's
(:meth:`Fleet.statistics`), not its workers'.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager

import outcome
import trio

from ._client import DEFAULT_MAX_PAYLOAD, Client
from ._connection import Connection, open_connection
from ._errors import (
    ClosedError,
    CommandError,
    ConfigError,
    FencedError,
    MeshConnectionError,
    raise_single,
)
from ._history import CountsReporter
from ._keys import Keys
from ._lease import Generation, Lease, LeaseTiming
from ._memory import MemoryWatch, watch_memory
from ._policy import PolicyWatch, QueuePolicy
from ._pubsub import PubSub, open_pubsub
from ._schedule import run_scheduler
from ._scripts import Binding, HeartbeatRequest
from ._shielded import ShieldedTasks
from ._stats import Recorder
from ._supervisor import Reaper, ReaperStatistics
from ._topology import Topology
from ._transport import check_min_replicas
from ._trio import require_trio
from ._url import RedisConfig, parse_url
from ._validate import seconds
from ._worker import Worker, check_server, subscribe_expiry, worker_options

__all__ = ["Fleet", "open_fleet"]

log = logging.getLogger("mesh.worker")

MAX_BATCH = 100
"""At most this many leases per ``heartbeat.lua`` call (about 1 ms of Redis
time: a longer script would hold up every other client)."""


JOIN_RATE = 2000.0
"""A fleet's workers (re)join at most this many a second after the first
:data:`JOIN_BURST` (unless that would take longer than the fleet's
``join_window``: then faster, to end within it)."""

JOIN_BURST = 100
"""This many of a fleet's workers join at once without waiting."""


class Joins:
    """Spreads the (re)registrations of a fleet's workers that join together.

    When a fleet process starts (or restarts) it opens thousands of workers
    at once, and when its connection to Redis comes back after more than R
    every worker fenced itself and rejoins: each registration is a few
    script calls and a SUBSCRIBE, so thousands at once are a burst Redis
    (and the event loop) take all at once. Each join takes a turn: the first
    :data:`JOIN_BURST` go at once, the others one every 1 / :data:`JOIN_RATE`
    s, or closer so that all who are waiting are through within ``window``
    (a fraction of the TTL). A turn is first come, first served (a
    generic cell rate algorithm: no lock, no task).

    ``window`` 0: no pacing.
    """

    def __init__(self, window: float, rate: float = JOIN_RATE, burst: int = JOIN_BURST) -> None:
        self.window = window
        self._rate = rate
        self._burst = burst
        self._at = -math.inf  # when the last turn given is due (trio clock)
        self.waiting = 0
        self.joined = 0  # turns given
        self.longest = 0.0  # the longest wait for a turn, seconds

    async def turn(self) -> None:
        """Wait for a turn (cancellable: a cancelled wait keeps its place
        taken, which only makes the next turns come a little later)."""
        if self.window <= 0:
            return
        self.waiting += 1
        try:
            # the workers opened in the same batch count themselves first
            await trio.lowlevel.checkpoint()
            step = min(1 / self._rate, self.window / self.waiting)
            now = trio.current_time()
            self._at = max(self._at, now - self._burst * step) + step
            wait = self._at - now
            self.longest = max(self.longest, wait)
            if wait > 0:
                await trio.sleep(wait)
            self.joined += 1
        finally:
            self.waiting -= 1


class Renewals:
    """The fleet's heartbeat driver: it renews its workers' leases together.

    Each registered generation (:meth:`add`) has a time its next heartbeat
    is due. Every ``window`` seconds at most, the driver sends the due ones
    in ``heartbeat.lua`` calls of up to :data:`MAX_BATCH` leases, and hands
    each outcome to its lease (:meth:`Lease.renewed`,
    :meth:`Lease.renewal_failed`, or a fence), which says when the next is
    due. ``sent`` is when the call was sent, so each worker's fence deadline
    counts from then, as with a heartbeat loop of its own. A call not
    answered within R is dropped, and its workers' heartbeats are sent
    again (by then their handlers are cancelled, as they would be alone).
    """

    def __init__(
        self,
        conn: Connection,
        binding: Binding,
        timing: LeaseTiming,
        min_replicas: int,
        joins: Joins | None = None,
    ) -> None:
        self.joins = Joins(0.0) if joins is None else joins
        self._conn = conn
        self._binding = binding
        self._timing = timing
        self._ttl_ms = int(timing.ttl * 1000)
        self._min_replicas = min_replicas
        self.window = min(timing.interval / 20, 0.05)
        self._due: dict[tuple[Lease, Generation], float] = {}
        self._added = trio.Event()
        self.calls = 0  # heartbeat.lua calls sent
        self.renewals = 0  # leases in them
        self.largest = 0  # the most leases in one call

    def add(self, lease: Lease, gen: Generation) -> None:
        """Renew ``gen``'s lease from now on, starting at once (sync)."""
        self._due[(lease, gen)] = trio.current_time()
        self._added.set()

    def remove(self, lease: Lease, gen: Generation) -> None:
        """Stop renewing ``gen``'s lease (sync); a reply on its way is dropped."""
        self._due.pop((lease, gen), None)

    async def join_turn(self) -> None:
        """A worker's turn to (re)join (see :class:`Joins`)."""
        await self.joins.turn()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send due heartbeats until cancelled."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            last = -math.inf
            while True:
                now = trio.current_time()
                due = [key for key, at in self._due.items() if at <= now]
                if due:
                    last = now
                    in_flight = now + self._timing.fence_after  # sent again if unanswered
                    for key in due:
                        self._due[key] = in_flight
                    for i in range(0, len(due), MAX_BATCH):
                        nursery.start_soon(self._send, now, due[i : i + MAX_BATCH])
                nxt = min(self._due.values(), default=math.inf)
                with trio.move_on_at(nxt):
                    await self._added.wait()
                self._added = trio.Event()
                await trio.sleep_until(last + self.window)

    async def _send(self, sent: float, keys: list[tuple[Lease, Generation]]) -> None:
        t = self._timing
        queues = [list(gen.runners) for _, gen in keys]
        requests = [
            HeartbeatRequest(gen.id, gen.incarnation, tuple(gen.acks), tuple(qs))
            for (_, gen), qs in zip(keys, queues, strict=True)
        ]
        self.calls += 1
        self.renewals += len(keys)
        self.largest = max(self.largest, len(keys))
        results = None
        try:
            with trio.move_on_after(t.fence_after):
                answer = await self._binding.heartbeat_many(self._conn, self._ttl_ms, requests)
                # With min_replicas, renewals count once replicas have them.
                await self._conn.wait_replicas(self._min_replicas, t.fence_after)
                results = answer
        except (MeshConnectionError, CommandError) as exc:
            for lease, gen in keys:
                if (lease, gen) in self._due:
                    self._due[(lease, gen)] = lease.renewal_failed(gen, sent, exc)
            self._added.set()
            return
        if results is None:
            return  # unanswered within R: due again (see run)
        reconnects = self._conn.statistics().reconnects
        for (lease, gen), qs, result in zip(keys, queues, results, strict=True):
            if (lease, gen) not in self._due:
                continue  # gone meanwhile
            if isinstance(result, outcome.Error):
                assert isinstance(result.error, FencedError)
                del self._due[(lease, gen)]
                lease.fenced(gen, str(result.error))
            else:
                self._due[(lease, gen)] = lease.renewed(gen, sent, qs, result.unwrap(), reconnects)
        self._added.set()


class _ServedQueues(Mapping[str, None]):
    """The queues any worker of the fleet runs, for the policy reader."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def _all(self) -> dict[str, None]:
        return {q: None for w in self._fleet.workers for q in w._gen.runners}

    def __getitem__(self, q: str) -> None:
        return self._all()[q]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class Fleet:
    """Workers of one OS process that share a connection, a pub/sub
    connection, their heartbeat calls, a reaper, a scheduler and a policy
    reader. Get one from :func:`open_fleet`; open its workers with
    :meth:`open_worker`."""

    def __init__(
        self,
        conn: Connection,
        pubsub: PubSub,
        keys: Keys,
        timing: LeaseTiming,
        name: str,
        max_payload: int,
        min_replicas: int,
        join_window: float = 0.0,
    ) -> None:
        self._conn = conn
        self._pubsub = pubsub
        self._keys = keys
        self._binding = Binding(keys)
        self.timing = timing
        """The lease timing of every worker of the fleet."""
        self.name = name
        self._max_payload = max_payload
        self._min_replicas = min_replicas
        self.workers: list[Worker] = []
        """The fleet's workers now open."""
        self._by_id: dict[str, Worker] = {}
        self._policies: dict[str, QueuePolicy] = {}
        self._opened = 0  # workers opened so far (their default ids count them)
        self._stats = Recorder()
        self.renewals = Renewals(conn, self._binding, timing, min_replicas, Joins(join_window))
        self._reaper = Reaper(
            conn,
            self._binding,
            ttl=timing.ttl,
            queues=lambda: {q: None for w in self.workers for q in w._queues},
            own=lambda: {i for w in self.workers for i in w._lease.ids},
            me=lambda: f"fleet {self.name}",
            recorder=self._stats,
            weight=lambda: max(1, len(self.workers)),
        )
        self.client = Client(conn, keys, max_payload=max_payload)
        """A :class:`Client` on the fleet's connection."""
        self.memory = MemoryWatch(f"fleet {name}")
        """Redis's eviction policy, read once per poll for the whole fleet."""
        self._closed = False

    def statistics(self) -> ReaperStatistics:
        """What the fleet's reaper did (checks, recycles) since it started."""
        return self._reaper.statistics()

    @asynccontextmanager
    async def open_worker(
        self,
        *,
        worker_id: str | None = None,
        stop_grace: float = 10.0,
        rejoin_grace: float = 0.0,
    ) -> AsyncIterator[Worker]:
        """Join the mesh as one more worker of this fleet: as
        :func:`~mesh.open_worker` (same arguments, same lease, handlers,
        fencing, and hand-back on leaving), with the fleet's connection,
        lease timing and shared machinery.

        The default ``worker_id`` is the fleet's name and a count
        (``<fleet name>-<n>``).

        Raises:
            ConfigError: bad worker id or options, or the worker id is in use.
            ClosedError: the fleet is closed.
            MeshConnectionError: Redis could not be reached to register.
        """
        if self._closed:
            raise ClosedError("this fleet is closed")
        if worker_id is None:
            # Unique in the fleet by construction: 1,000 ids of 24 random bits
            # each (open_worker's default) collide in one process in 3% of fleets.
            self._opened += 1
            worker_id = f"{self.name}-{self._opened}"
        worker_id = worker_options(worker_id, stop_grace, rejoin_grace)
        worker = Worker(
            self._conn,
            self._pubsub,
            self._keys,
            self.timing,
            worker_id,
            self._max_payload,
            stop_grace,
            rejoin_grace,
            reaper=self._reaper,
            driver=self.renewals,
            housekeeping=False,
            memory=self.memory,
        )
        worker.min_replicas = worker.client.min_replicas = self._min_replicas
        worker._lease.min_replicas = self._min_replicas
        try:
            async with trio.open_nursery() as nursery:
                # shielded from the caller's cancellations, as in open_worker
                tasks = ShieldedTasks(nursery)
                try:
                    await tasks.start(worker._lease.run)
                    self.workers.append(worker)
                    try:
                        yield worker
                    finally:
                        await worker._leave()
                        self.workers.remove(worker)
                finally:
                    tasks.cancel()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            raise_single(eg)

    def _worker(self, wid: str) -> Worker | None:
        w = self._by_id.get(wid)
        if w is None or w.id != wid or w not in self.workers:
            self._by_id = {w.id: w for w in self.workers}
            w = self._by_id.get(wid)
        return w

    def _apply_policy(self, queue: str, policy: QueuePolicy) -> None:
        # Read every H; applied to every worker only when it changed (a worker
        # that starts serving the queue reads the stored policy itself).
        if self._policies.get(queue) == policy:
            return
        self._policies[queue] = policy
        for w in self.workers:
            w._apply_policy(queue, policy)

    async def _listen(self) -> None:
        expired, wake, cancel = await subscribe_expiry(self._pubsub, self._conn, self._keys)
        async for msg in self._pubsub:
            if msg.kind == "reconnected":
                for w in list(self.workers):
                    w._dispatch(msg, expired, wake, cancel)
                continue
            ch = msg.channel
            for prefix in (wake, cancel):
                if ch.startswith(prefix):
                    to = self._worker(ch[len(prefix) :].decode())
                    if to is not None:
                        to._dispatch(msg, expired, wake, cancel)
                    break
            else:
                if ch == expired and self._keys.parse_heartbeat_key(msg.data) is not None:
                    self._reaper.heard_expiry()

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen)
            nursery.start_soon(watch_memory, self._conn, self.memory)
            await nursery.start(self.renewals.run)
            await nursery.start(self._reaper.run)
            # one scheduler, which also re-reads the policies of every queue
            # any worker of the fleet serves (one round trip per H)
            watch = PolicyWatch(self._keys.policy, _ServedQueues(self), self._apply_policy)
            nursery.start_soon(
                run_scheduler, self._conn, self._binding, self.timing.interval, watch
            )
            # the per-minute counts of every worker of the fleet, in one report
            counts = CountsReporter(
                self._conn, self._binding, lambda: [w._stats for w in self.workers]
            )
            nursery.start_soon(counts.run)
            task_status.started()


@asynccontextmanager
async def open_fleet(
    url: str | RedisConfig = "redis://127.0.0.1:6379",
    *,
    namespace: str = "mesh",
    ttl: float = 3.0,
    heartbeat_interval: float | None = None,
    fence_after: float | None = None,
    name: str | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    min_replicas: int | None = None,
    join_window: float | None = None,
) -> AsyncIterator[Fleet]:
    """Open a fleet: the shared machinery for many workers of this OS process
    in the mesh ``namespace`` at ``url``; open each worker with
    :meth:`Fleet.open_worker` inside this block (and leave each before the
    block ends). The arguments mean what they mean for
    :func:`~mesh.open_worker`, for every worker of the fleet; ``name`` (default
    ``<host>-<pid>-<random>``) names the fleet's connections and log lines.

    ``join_window`` (default TTL / 2; 0: none) paces the registrations of
    workers that join together (a fleet process that starts, or workers
    that rejoin after fencing themselves when the connection to Redis came
    back after more than R): the first 100 go at once, the next at most
    2,000 a second, or faster so that all who wait are through within the
    window. A worker waits at most about the window for its turn; the fleet
    does not fence for it (a worker's lease starts with its registration).

    Leaving the block stops the shared machinery (the workers must have left).

    Raises:
        ConfigError: bad URL, namespace, timing or join window (nothing started);
            called outside trio (from asyncio, say).
        MeshConnectionError: Redis cannot be reached at start.
    """
    require_trio("mesh.open_fleet")
    config = parse_url(url) if isinstance(url, str) else url
    if join_window is not None and seconds("join_window", join_window) > 3600:
        raise ConfigError(f"join_window must be 0 to 3600 seconds, not {join_window!r}")
    keys = Keys(namespace)
    timing = LeaseTiming.make(ttl, heartbeat_interval, fence_after)
    replicas = check_min_replicas(config, min_replicas)
    if name is None:
        host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:60]
        name = f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"
    topology = Topology(config, route_key=keys.prefix, epoch_key=keys.epoch)
    async with open_connection(
        config,
        name=f"mesh-fleet:{name}",
        reply_timeout=max(2 * timing.ttl, 5.0),
        topology=topology,
        reroute_timeout=timing.fence_after,
        # its writes are fenced by Redis (each lease's incarnation)
        direct_writes=True,
    ) as conn:
        await check_server(conn)
        ping = min(max(1.0, timing.ttl), 30.0)
        async with open_pubsub(
            config, name=f"mesh-fleet-events:{name}", ping_interval=ping, topology=topology
        ) as pubsub:
            window = timing.ttl / 2 if join_window is None else join_window
            fleet = Fleet(conn, pubsub, keys, timing, name, max_payload, replicas, window)
            try:
                async with trio.open_nursery() as nursery:
                    # The renewals go on while the fleet's workers stop after
                    # a cancellation from outside (open_worker's shield).
                    tasks = ShieldedTasks(nursery)
                    try:
                        await tasks.start(fleet._run)
                        yield fleet
                    finally:
                        fleet._closed = True
                        tasks.cancel()
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as eg:
                raise_single(eg)
