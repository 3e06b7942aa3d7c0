"""The worker's lease: its identities (generations), joining, the heartbeat,
and retiring.

A :class:`Lease` runs one **generation** at a time: one identity (worker id
+ incarnation) with its lease. The generation's trio tasks (the heartbeat and
one runner per served queue, with every handler) live in one cancel scope
whose *deadline* is the self-fence deadline: the time the last confirmed
heartbeat was sent plus R. Each confirmed heartbeat pushes the deadline on;
if none is confirmed in time, trio itself cancels every handler at R, before
peers may take over at T (R < T). A heartbeat that finds the lease gone or
superseded cancels the scope at once. Either way the lease then retires the
old identity (hands back what it still holds) and registers a new one: a
fenced identity is never revived.

The heartbeat's reply is fanned out with one :meth:`QueueRunner.on_heartbeat`
call per runner; the lease knows nothing else about queues.

A stop (the worker leaving) is the worker's business: it stops the runners
while the heartbeat goes on (the lease is kept until every handler exited,
invariant 10), then calls :meth:`Lease.close`, which ends the generation and
retires it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

import anyio
import anyio.abc
import attrs

from ._binding import Binding
from ._connection import Connection
from ._errors import CommandError, ConfigError, FencedError, MeshConnectionError
from ._keys import Keys
from ._pubsub import PubSub
from ._replies import HeartbeatReply
from ._runner import QueueRunner
from ._stats import Recorder
from ._supervisor import Reaper
from ._types import Process
from ._units import MAX_SECONDS
from ._validate import is_number, seconds

__all__ = ["Generation", "HeartbeatDriver", "Lease", "LeaseTiming"]

log = logging.getLogger("mesh.worker")


class HeartbeatDriver(Protocol):
    """Renews leases and gives turns to join: a host's (:mod:`mesh._host`).
    :meth:`renew` sends ``gen``'s heartbeats until cancelled and hands each
    outcome to its lease (:meth:`Lease.renewed`, :meth:`Lease.renewal_failed`
    or :meth:`Lease.fenced`, sync, no I/O): a host of one with a heartbeat
    loop of its own (:class:`mesh._renewals.OwnHeartbeat`), a host of many
    with its members' renewals batched (:class:`mesh._renewals.Renewals`)."""

    async def renew(self, lease: Lease, gen: Generation) -> None:
        """Renew ``gen``'s lease until cancelled."""

    async def join_turn(self) -> None:
        """Wait for a worker's turn to join (a host of many spreads the
        registrations of its workers that join at once). Cancellable."""

    async def rejoin_turn(self, lease: Lease) -> None:
        """Wait for ``lease``'s turn to hand back and rejoin after a fence.
        Cancellable."""


@attrs.frozen
class LeaseTiming:
    """A worker's lease timing (:attr:`Worker.timing`), in seconds: a heartbeat
    every ``interval`` (H); every handler cancelled after ``fence_after`` (R)
    without a confirmed heartbeat; peers may recycle the worker ``ttl`` (T)
    after its last renewal. Always H < R < T."""

    ttl: float
    interval: float
    fence_after: float

    @classmethod
    def make(cls, ttl: float, interval: float | None, fence_after: float | None) -> LeaseTiming:
        """Raises:
        ConfigError: unless 0.01 <= interval < fence_after < ttl (whole ms)."""
        if not is_number(ttl):
            raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
        if not ttl <= MAX_SECONDS:  # 1e20 reached Lua, 1e308 made fence_after inf
            seconds("ttl", ttl)  # names the bound (ten years); NaN too
        h = ttl / 3 if interval is None else interval
        r = 2 * ttl / 3 if fence_after is None else fence_after
        h, r, t = round(h, 3), round(r, 3), round(ttl, 3)
        if not (0.01 <= h < r < t):
            raise ConfigError(
                f"lease timing must satisfy 0.01 s <= heartbeat interval < fence_after < ttl; "
                f"got interval={h} s, fence_after={r} s, ttl={t} s"
                + (" (ttl is too small)" if ttl < 0.04 else "")
            )
        return cls(t, h, r)


class Generation:
    """One identity of the worker."""

    def __init__(self, worker_id: str, number: int) -> None:
        self.id = worker_id
        self.number = number
        self.incarnation = secrets.token_hex(8)
        self.scope = anyio.CancelScope()
        self.runners: dict[str, QueueRunner] = {}
        # Runners of queues stop_work() left whose handlers outlived the
        # stop grace: their processes are handed back as the handlers exit.
        self.draining: dict[str, QueueRunner] = {}
        self.nursery: anyio.abc.TaskGroup | None = None
        self.fence_reason: str | None = None
        # Cancels of process ids no runner knew yet (a claim reply still on
        # its way): id -> when it came. A runner that then claims the id does
        # not start it. Pruned after the TTL.
        self.early_cancels: dict[str, float] = {}
        # The heartbeat's state: cancels seen (acknowledged in the next one),
        # the first unanswered heartbeat of an outage, the random spread of
        # the next renewal (wide at first, then narrow).
        self.acks: list[str] = []
        self.trouble_since: float | None = None
        self.spread = 0.5

    def fence(self, reason: str) -> None:
        if self.fence_reason is None:
            self.fence_reason = reason
        self.scope.cancel()

    def check(self, fence_after: float, process: Process | None = None) -> None:
        """Raise unless this identity still holds its lease by its own
        reckoning (see :meth:`mesh.Worker.check_lease`): not fenced, not
        stopping, its self-fence deadline not passed, and ``process`` (if
        given) one of its own. Sync: the clock, not Redis.

        Raises:
            FencedError: the lease is, or may be, gone.
        """
        if self.fence_reason is not None:
            raise FencedError(f"worker {self.id} is fenced ({self.fence_reason})")
        if anyio.current_time() >= self.scope.deadline:
            raise FencedError(f"worker {self.id}: no heartbeat confirmed within {fence_after} s")
        if self.scope.cancel_called:
            raise FencedError(f"worker {self.id} is stopping")
        if process is not None and process.worker_id != self.id:
            raise FencedError(
                f"process {process.id} belongs to worker {process.worker_id}, "
                f"which this worker gave up (it is {self.id} now)"
            )


class Lease:
    """The generations of one worker, and the heartbeat of the current one.

    Args:
        queues: the queues the worker serves now (served again on a rejoin,
            and named to ``recycle.lua`` when retiring).
        start_runners: called in each new generation's nursery to start its
            runners.
        cancel_process: a process id the heartbeat's inbox says is cancelled.
        recorder: the worker's counters (heartbeats, fences, hand-backs on
            retiring).
        driver: who renews the lease and gives turns to join: the host's
            (:mod:`mesh._renewals`).
    """

    def __init__(
        self,
        conn: Connection,
        pubsub: PubSub,
        binding: Binding,
        timing: LeaseTiming,
        base_id: str,
        reaper: Reaper,
        *,
        queues: Callable[[], Iterable[str]],
        start_runners: Callable[[Generation], Awaitable[None]],
        cancel_process: Callable[[str], None],
        recorder: Recorder,
        driver: HeartbeatDriver,
        capacity: Callable[[str], int] = lambda queue: 1,
    ) -> None:
        self._conn = conn
        self._capacity = capacity  # the worker's capacity on a queue it serves
        self._pubsub = pubsub
        self._binding = binding
        self._keys: Keys = binding.keys
        self.timing = timing
        self._base_id = base_id
        self._reaper = reaper
        self._queues = queues
        self._start_runners = start_runners
        self._cancel_process = cancel_process
        self._stats = recorder
        self._driver = driver  # who renews the lease (the host's)
        self.gen = Generation(base_id, 1)
        self.ids = {base_id}  # every identity this worker has had
        self._reconnects_seen = -1  # the connection's count at the last heartbeat
        self.ready = anyio.Event()
        self.closing = False
        self.stopped = anyio.Event()

    def served(self) -> list[str]:
        """The queues the worker serves now (sync)."""
        return list(self._queues())

    async def current(self) -> Generation:
        """The current generation, once it is registered and running."""
        await self.ready.wait()
        return self.gen

    def close(self) -> None:
        """End the current generation (heartbeat and runners) and retire it;
        no new one is started. :attr:`stopped` is set when that is done."""
        self.closing = True
        self.gen.scope.cancel()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Register, then run generation after generation until closed. The
        first registration's errors propagate (before ``started``)."""
        gen = self.gen
        first = True
        previous = ""
        try:
            while True:
                if first:
                    await self._driver.join_turn()
                sent = await self._register(gen, first=first)
                if first:
                    task_status.started()
                    first = False
                elif not self.closing:
                    log.info("worker %s rejoined the mesh as %s", previous, gen.id)
                fenced = False
                try:
                    gen.scope.deadline = sent + self.timing.fence_after
                    if self.closing:
                        gen.scope.cancel()
                    with gen.scope:
                        async with anyio.create_task_group() as nursery:
                            gen.nursery = nursery
                            nursery.start_soon(self._driver.renew, self, gen)
                            await self._start_runners(gen)
                            self.ready.set()
                            await anyio.sleep_forever()
                    fenced = not self.closing
                finally:
                    self.ready = anyio.Event()
                    if not fenced:
                        # Closing, or an error or cancellation is on its way
                        # out: hand everything back before going.
                        with anyio.move_on_after(self.timing.ttl) as cs:
                            cs.shield = True
                            await self._retire(gen)
                if not fenced:
                    return
                self._stats.fenced(gen.fence_reason)
                if gen.fence_reason is None:
                    gen.fence_reason = (
                        f"no heartbeat confirmed within {self.timing.fence_after} s"
                        + ("; Redis unreachable" if not self._conn.connected else "")
                    )
                log.warning(
                    "worker %s fenced (%s); its processes were stopped; rejoining",
                    gen.id,
                    gen.fence_reason,
                )
                await self._driver.rejoin_turn(self)
                await self._retire(gen)
                if self.closing:
                    return
                previous = gen.id
                gen = self.gen = Generation(
                    f"{self._base_id}.{secrets.token_hex(3)}", gen.number + 1
                )
                self.ids.add(gen.id)
        finally:
            self.stopped.set()

    async def _register(self, gen: Generation, *, first: bool) -> float:
        """Join the mesh as ``gen``. The first time, errors propagate (a bad
        id, an unreachable Redis). When rejoining after a fence, every
        expected error is retried with backoff, under a fresh id where the
        old one may be taken, until it works or the lease is closed.

        Returns:
            When the attempt that worked was sent: the new lease's fence
            deadline counts from then, not from the first, failed attempts."""
        backoff = 0.05
        tries = 0
        while True:
            sent = anyio.current_time()
            try:
                # Measure from a live connection: an attempt that first waited
                # for a reconnect would start its fence deadline too early.
                await self._conn.execute("PING")
                sent = anyio.current_time()
                await self._join(gen)
                return sent
            except (MeshConnectionError, CommandError, FencedError, ConfigError) as exc:
                if first:
                    raise
                if self.closing:
                    return sent
                tries += 1
                log.log(
                    logging.WARNING if tries == 1 else logging.DEBUG,
                    "worker %s could not rejoin yet (%s); retrying",
                    gen.id,
                    exc,
                )
                if isinstance(exc, ConfigError | FencedError):
                    gen.id = f"{self._base_id}.{secrets.token_hex(3)}"
                    self.ids.add(gen.id)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, self.timing.interval)

    async def _join(self, gen: Generation) -> None:
        # register.lua adds when it started, by the Redis clock, in the same
        # step: the description is never seen without it.
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        await self._binding.register(
            self._conn, gen.id, gen.incarnation, int(self.timing.ttl * 1000), info
        )
        for q in list(self._queues()):
            await self._binding.serve(self._conn, gen.id, gen.incarnation, q, self._capacity(q))
        try:
            # Sharded where the server has it: the scripts SPUBLISH wakes and
            # cancels there (include/nudge.lua), sparing a cluster the broadcast.
            await self._pubsub.subscribe(
                self._keys.cancel_channel(gen.id), self._keys.wake_channel(gen.id), sharded=True
            )
        except MeshConnectionError:
            pass  # it stays registered and is subscribed on the reconnect

    async def _retire(self, gen: Generation) -> None:
        """Hand back what ``gen`` still holds and remove it; retried until Redis
        answers, for at most the TTL (then peers recycle what is left after T),
        or until cancelled."""
        backoff = 0.05
        with anyio.move_on_after(self.timing.ttl) as bounded:
            while True:
                try:
                    r = await self._binding.recycle(
                        self._conn,
                        gen.id,
                        leave=True,
                        incarnation=gen.incarnation,
                        queues=list(self._queues()),
                    )
                    if r.returned:
                        self._stats.handed_back += r.returned
                        log.info("worker %s handed back %d processes", gen.id, r.returned)
                    break
                except FencedError:
                    break  # superseded by someone else: nothing of ours to hand back
                except (MeshConnectionError, CommandError) as exc:
                    log.debug("worker %s could not hand back yet: %s", gen.id, exc)
                    await anyio.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
        if bounded.cancelled_caught:
            log.warning(
                "worker %s gave up handing back after %g s; peers recycle its "
                "processes when its lease expires",
                gen.id,
                self.timing.ttl,
            )
        try:
            await self._pubsub.unsubscribe(
                self._keys.cancel_channel(gen.id), self._keys.wake_channel(gen.id)
            )
        except MeshConnectionError:
            pass

    def fenced(self, gen: Generation, message: str) -> None:
        """A heartbeat found ``gen``'s lease gone or superseded: fence it.
        A lease gone before its TTL could have run out since the last
        confirmed renewal did not expire: it was deleted, evicted (a
        maxmemory-policy other than noeviction) or lost by Redis; said in
        one warning line (see :mod:`mesh._memory`). Sync: no I/O."""
        t = self.timing
        renewed = gen.scope.deadline - t.fence_after  # sent time of the last confirmed one
        early = renewed + t.ttl - anyio.current_time()
        if "no lease" in message and early > t.ttl / 10:
            log.warning(
                "worker %s: its lease vanished %.1f s before it could have expired: "
                "evicted (is Redis's maxmemory-policy noeviction?), deleted, or lost by "
                "Redis (a restart or failover); it stops its processes and rejoins",
                gen.id,
                early,
            )
        gen.fence(message)

    def renewal_failed(self, gen: Generation, sent: float, exc: Exception) -> float:
        """A heartbeat sent at ``sent`` failed with ``exc`` (Redis unreachable,
        or refusing). Retried until it works or the fence deadline passes (a
        full Redis does not refuse renewals: heartbeat.lua's first write is
        one Redis lets through at the memory limit). Said
        once per outage, not once per try. Returns when to try again."""
        t = self.timing
        what = "Redis unreachable" if isinstance(exc, MeshConnectionError) else "refused"
        if gen.trouble_since is None:
            gen.trouble_since = sent
            log.warning(
                "worker %s: heartbeat failed, %s: %s; retrying (its handlers are "
                "cancelled %g s after the last confirmed heartbeat)",
                gen.id,
                what,
                exc,
                t.fence_after,
            )
        else:
            log.debug("worker %s: heartbeat failed again: %s", gen.id, exc)
        return anyio.current_time() + min(t.interval / 4, 0.25)

    def renewed(
        self,
        gen: Generation,
        sent: float,
        queues: Sequence[str],
        reply: HeartbeatReply,
        reconnects: int | None = None,
    ) -> float:
        """A heartbeat sent at ``sent`` for ``queues`` was confirmed: push the
        fence deadline on, act on the cancel inbox, fan the reply out to the
        runners and the reaper. Sync: no I/O. ``reconnects``: the connection's
        count now, if the caller has it at hand. Returns when the next
        heartbeat is due."""
        t = self.timing
        if gen.trouble_since is not None:
            log.info(
                "worker %s: heartbeat confirmed again, %.1f s after the first that failed",
                gen.id,
                sent - gen.trouble_since,
            )
            gen.trouble_since = None
        if reconnects is None:
            reconnects = self._conn.statistics().reconnects
        if reconnects > self._reconnects_seen:
            if self._reconnects_seen >= 0:
                log.info("worker %s: the connection to Redis was lost and is back", gen.id)
            self._reconnects_seen = reconnects
        now = anyio.current_time()
        self._stats.heartbeats += 1
        self._stats.heartbeat.observe(now - sent)
        gen.scope.deadline = sent + t.fence_after
        gen.acks = list(reply.inbox)
        for pid in gen.acks:
            self._cancel_process(pid)
        if gen.early_cancels:
            stale = sent - t.ttl
            for pid, at in list(gen.early_cancels.items()):
                if at < stale:
                    del gen.early_cancels[pid]
        for q, beat in zip(queues, reply.beats(), strict=True):
            runner = gen.runners.get(q)
            if runner is not None:
                runner.on_heartbeat(beat)
        if reply.next_deadline_ms <= 0:
            self._reaper.deadline_passed(-reply.next_deadline_ms / 1000)
        # Renew a little early, at random (never late: R counts from the last
        # confirmed renewal), so that peers started together do not renew in
        # lockstep: their heartbeats are the reapers' backstop, and a
        # mesh-wide burst of them would wake every reaper at once.
        nxt = sent + t.interval * (1 - gen.spread * random.random())
        gen.spread = 0.05
        return nxt
