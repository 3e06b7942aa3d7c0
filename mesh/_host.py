"""The host: what the workers of one OS process share.

A worker is a member of a host. The host owns, for all its members:

* the **connection** (one reply timeout, one topology that follows the
  master: Sentinel failover and the namespace epoch are watched there) and
  the **pub/sub connection** (one ping interval);
* the **listener**, which routes each message to the member its channel
  names (a wake, a cancel), and key-expiry events to the reaper; after a
  reconnect every member looks at the durable state again;
* the **reaper** (:mod:`mesh._supervisor`), which stands for all its
  members (it draws whether to act on a death with probability ``herd`` x
  members / workers in the mesh);
* who **renews the leases** and gives **turns to join** (:mod:`mesh._renewals`);
* the periodic-task **scheduler** and the **policy reader** (one ``HMGET``
  per H for the queues of all its members);
* the **memory watch** (:mod:`mesh._memory`): Redis's eviction policy;
* the **per-minute counts** of its members for the dashboard's charts
  (:mod:`mesh._history`), one report every few seconds.

:func:`~mesh.open_worker` is a host of one, :func:`~mesh.open_fleet` a host
of many, both made by :func:`open_host`. The only differences: a host of one
renews its lease with a heartbeat loop of its own (sent at once when due),
and its member counts the reaper's work as its own; a host of many batches
its members' renewals within a short window and paces their joins.

A member talks to its host through :class:`Member` (what the host needs
of it) and the host's public attributes; neither touches the other's
private members.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import attrs

from ._binding import Binding
from ._connection import Connection, open_connection
from ._errors import ClosedError, CommandError, ConfigError, MeshConnectionError, raise_single
from ._history import REPORT_INTERVAL, CountsReporter
from ._keys import Keys
from ._lease import Lease, LeaseTiming
from ._memory import MemoryWatch, read_memory, watch_memory
from ._policy import PolicyWatch, QueuePolicy
from ._pubsub import Message, PubSub, open_pubsub
from ._renewals import Joins, OwnHeartbeat, Renewals
from ._schedule import run_scheduler
from ._shielded import ShieldedTasks
from ._stats import Recorder
from ._supervisor import Reaper
from ._topology import Topology
from ._url import RedisConfig

__all__ = ["Host", "Member", "check_server", "default_name", "open_host", "subscribe_expiry"]

log = logging.getLogger("mesh.worker")


@attrs.frozen(eq=False)
class Member:
    """A worker as its host sees it: its lease (current identity, runners,
    identities it has had, queues it serves), where a cancel of one of its
    processes goes, where a queue's policy read by the host goes, and its
    counters."""

    lease: Lease
    cancel_process: Callable[[str], None]
    apply_policy: Callable[[str, QueuePolicy], None]
    stats: Recorder  # its counters (the per-minute counts are reported from them)


class _ServedQueues(Mapping[str, None]):
    """The queues the host's members run, for the policy reader."""

    def __init__(self, members: list[Member]) -> None:
        self._members = members

    def _all(self) -> dict[str, None]:
        return {q: None for m in self._members for q in m.lease.gen.runners}

    def __getitem__(self, q: str) -> None:
        return self._all()[q]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


class Host:
    """The shared machinery of one OS process's workers (see the module's
    docstring). Get one from :func:`open_host`."""

    def __init__(
        self,
        conn: Connection,
        pubsub: PubSub,
        keys: Keys,
        timing: LeaseTiming,
        name: str,
        *,
        min_replicas: int,
        of_one: bool,
        join_window: float = 0.0,
    ) -> None:
        self.conn = conn
        self.pubsub = pubsub
        self.keys = keys
        self.binding = Binding(keys)
        self.timing = timing
        self.name = name
        self.min_replicas = min_replicas
        self.of_one = of_one
        """A host of one (open_worker): its member shares :attr:`stats`."""
        self.renewals: OwnHeartbeat | Renewals = (
            OwnHeartbeat(conn, self.binding, min_replicas)
            if of_one
            else Renewals(conn, self.binding, timing, min_replicas, Joins(join_window))
        )
        self.stats = Recorder()
        """The reaper's counters (a host of one's are its worker's)."""
        self.members: list[Member] = []
        # the counters of members that left lately: their last counts go in the
        # next per-minute counts report (or the one made when the host closes)
        self._left: list[tuple[float, Recorder]] = []
        self._by_id: dict[str, Member] = {}
        self._policies: dict[str, QueuePolicy] = {}
        self.reaper = Reaper(
            conn,
            self.binding,
            ttl=timing.ttl,
            queues=lambda: {q: None for m in self.members for q in m.lease.served()},
            own=lambda: {i for m in self.members for i in m.lease.ids},
            me=self._me,
            recorder=self.stats,
            weight=lambda: max(1, len(self.members)),
        )
        self.memory = MemoryWatch(f"{'worker' if of_one else 'fleet'} {name}")
        """Redis's eviction policy, read once per poll for the whole host."""
        self.closed = False
        self._registered = anyio.Event()  # a member registered: the reaper starts

    def _me(self) -> str:
        if self.of_one:
            return f"worker {self.members[0].lease.gen.id if self.members else self.name}"
        return f"fleet {self.name}"

    def member_stats(self) -> Recorder:
        """The counters for a new member: a host of one's own (its worker
        counts the reaper's work), else a fresh one."""
        return self.stats if self.of_one else Recorder()

    def add(self, member: Member) -> None:
        """Route ``member``'s messages to it from now on (sync).

        Raises:
            ClosedError: the host is closed."""
        if self.closed:
            raise ClosedError(f"this {'worker' if self.of_one else 'fleet'} is closed")
        self.members.append(member)

    def registered(self) -> None:
        """A member registered: the host's reaper runs from now on (it
        counts the mesh with its own member in it). Sync."""
        self._registered.set()

    def remove(self, member: Member) -> None:
        """Stop routing to ``member`` (sync); its counts are still reported."""
        if member in self.members:
            self.members.remove(member)
            self._left.append((anyio.current_time(), member.stats))

    def _count_recorders(self) -> list[Recorder]:
        now = anyio.current_time()
        self._left = [(t, r) for t, r in self._left if now - t < 3 * REPORT_INTERVAL]
        recorders = [m.stats for m in self.members] + [r for _, r in self._left]
        # a host of one's member counts in the host's own recorder: once
        return list({id(r): r for r in recorders}.values())

    def _member(self, wid: str) -> Member | None:
        m = self._by_id.get(wid)
        if m is None or m.lease.gen.id != wid or m not in self.members:
            self._by_id = {m.lease.gen.id: m for m in self.members}
            m = self._by_id.get(wid)
        return m

    async def _reap(self) -> None:
        await self._registered.wait()
        await self.reaper.run()

    def _apply_policy(self, queue: str, policy: QueuePolicy) -> None:
        # Read every H; applied to every member only when it changed (a worker
        # that starts serving the queue reads the stored policy itself).
        if self._policies.get(queue) == policy:
            return
        self._policies[queue] = policy
        for m in self.members:
            m.apply_policy(queue, policy)

    async def _listen(self) -> None:
        expired, wake, cancel = await subscribe_expiry(self.pubsub, self.conn, self.keys)
        async for msg in self.pubsub:
            self._dispatch(msg, expired, wake, cancel)

    def _dispatch(self, msg: Message, expired: bytes, wake: bytes, cancel: bytes) -> None:
        if msg.kind == "reconnected":
            # We may have missed anything: look at the durable state again.
            for m in list(self.members):
                for runner in m.lease.gen.runners.values():
                    runner.nudge()
            self.reaper.wake()
            return
        ch = msg.channel
        if ch.startswith(wake):
            # Redis took the member out of the queue's idle set to wake it: claim.
            to = self._member(ch[len(wake) :].decode())
            if to is not None:
                target = to.lease.gen.runners.get(msg.data.decode())
                if target is not None:
                    target.nudge()
        elif ch.startswith(cancel):
            to = self._member(ch[len(cancel) :].decode())
            if to is not None:
                to.cancel_process(msg.data.decode())
        elif ch == expired:
            if self.keys.parse_heartbeat_key(msg.data) is not None:
                self.reaper.heard_expiry()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The host's trio tasks: the listener, the memory watch, the batched
        renewals (a host of many), the reaper (once a member registered),
        and one scheduler that also
        re-reads the policies of every queue a member serves (one round trip
        per H). Runs until cancelled."""
        async with anyio.create_task_group() as nursery:
            nursery.start_soon(self._listen)
            nursery.start_soon(watch_memory, self.conn, self.memory)
            await nursery.start(self.renewals.run)
            nursery.start_soon(self._reap)
            watch = PolicyWatch(self.keys.policy, _ServedQueues(self.members), self._apply_policy)
            nursery.start_soon(run_scheduler, self.conn, self.binding, self.timing.interval, watch)
            # the per-minute counts of the dashboard's charts, for every member
            # in one report every few seconds (and a last one when it closes)
            counts = CountsReporter(self.conn, self.binding, self._count_recorders)
            nursery.start_soon(counts.run)
            task_status.started()


def default_name() -> str:
    """``<host>-<pid>-<random>``: a default worker id or fleet name."""
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:60]
    return f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


@asynccontextmanager
async def open_host(
    config: RedisConfig,
    keys: Keys,
    timing: LeaseTiming,
    name: str,
    *,
    min_replicas: int,
    of_one: bool,
    join_window: float = 0.0,
) -> AsyncIterator[Host]:
    """Open the connections of a host named ``name`` and run its machinery
    inside this block, shielded from the caller's cancellations (its members
    keep renewing while they stop after a cancellation from outside).
    ``of_one``: a host of one (:func:`~mesh.open_worker`), else of many
    (:func:`~mesh.open_fleet`, ``join_window`` paces its joins).

    Leaving the block stops the machinery (members must have left).

    Raises:
        ConfigError: Redis's eviction policy may evict leases.
        MeshConnectionError: Redis cannot be reached at start.
    """
    # A half-open socket must not hold a fenced worker's hand-back forever.
    reply_timeout = max(2 * timing.ttl, 5.0)
    # One topology for both connections: they follow the master together (key-expiry
    # events are node-local). "Not executed here" replies are retried within R.
    topology = Topology(config, route_key=keys.prefix, epoch_key=keys.epoch)
    async with open_connection(
        config,
        name=f"{'mesh-worker' if of_one else 'mesh-fleet'}:{name}",
        reply_timeout=reply_timeout,
        topology=topology,
        reroute_timeout=timing.fence_after,
        # its writes are fenced by Redis (each lease's incarnation)
        direct_writes=True,
    ) as conn:
        await check_server(conn)
        # The event link only speeds things up: every H the heartbeat brings
        # the durable state (work, cancels, overdue leases) anyway. Probing it
        # every T, not every second, is enough, and 1,000 idle workers then
        # cost Redis 1,000 / T pings a second, not 1,000. At most every 30 s:
        # with long leases H is long too, and a dead link would cost that.
        ping = min(max(1.0, timing.ttl), 30.0)
        events = f"{'mesh-events' if of_one else 'mesh-fleet-events'}:{name}"
        async with open_pubsub(config, name=events, ping_interval=ping, topology=topology) as ps:
            host = Host(
                conn,
                ps,
                keys,
                timing,
                name,
                min_replicas=min_replicas,
                of_one=of_one,
                join_window=join_window,
            )
            try:
                async with anyio.create_task_group() as nursery:
                    tasks = ShieldedTasks(nursery)
                    try:
                        await tasks.start(host.run)
                        yield host
                    finally:
                        host.closed = True
                        tasks.cancel()
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as eg:
                raise_single(eg)


async def subscribe_expiry(
    pubsub: PubSub, conn: Connection, keys: Keys
) -> tuple[bytes, bytes, bytes]:
    """Subscribe ``pubsub`` to the key-expiry events of ``conn``'s db and
    return the channel names a listener tells apart: that expiry channel,
    then the namespace's wake and cancel channel prefixes. A connection lost
    meanwhile is not an error: the pub/sub connection subscribes again when
    it reconnects. Cancellation passes through."""
    expired = f"__keyevent@{conn.config.db}__:expired".encode()
    try:
        await pubsub.subscribe(expired)
    except MeshConnectionError:
        pass  # subscribed on the reconnect
    return expired, keys.wake_prefix.encode(), keys.cancel_prefix.encode()


async def check_server(conn: Connection) -> None:
    """Refuse an eviction policy that can evict heartbeat keys, read from
    ``INFO memory`` (allowed by the documented ACL), else ``CONFIG GET``;
    where neither is allowed, :class:`MemoryWatch` warns once instead."""
    info = await read_memory(conn)
    if info is not None:
        policy = info.policy
    else:
        try:
            r = await conn.execute("CONFIG", "GET", "maxmemory-policy")
        except CommandError:
            return
        if len(r) != 2:
            return
        policy = r[1].decode()
    if policy not in ("noeviction",):
        raise ConfigError(
            f"Redis maxmemory-policy is {policy!r}: it may evict leases and tasks; "
            "trio-mesh needs 'noeviction'"
        )
