"""Who renews a host's leases, and when its workers join.

A host of one (:func:`~mesh.open_worker`) renews its worker's lease with a
heartbeat loop of its own (:class:`OwnHeartbeat`): one ``heartbeat.lua``
call every H, sent at once when due, as it always was. A host of many
(:func:`~mesh.open_fleet`) renews its workers' leases together
(:class:`Renewals`): the renewals that come due within a short window go in
one call of up to :data:`MAX_BATCH` leases, and workers that join together
take turns (:class:`Joins`). Both are a :class:`~mesh._lease.HeartbeatDriver`:
the lease asks its host's driver, with no branch of its own.
"""

from __future__ import annotations

import math

import anyio
import anyio.abc
import anyio.lowlevel
import outcome

from ._binding import Binding
from ._connection import Connection
from ._errors import CommandError, FencedError, MeshConnectionError
from ._lease import Generation, Lease, LeaseTiming
from ._replies import HeartbeatRequest

__all__ = ["JOIN_BURST", "JOIN_RATE", "MAX_BATCH", "Joins", "OwnHeartbeat", "Renewals"]

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
            await anyio.lowlevel.checkpoint()
            step = min(1 / self._rate, self.window / self.waiting)
            now = anyio.current_time()
            self._at = max(self._at, now - self._burst * step) + step
            wait = self._at - now
            self.longest = max(self.longest, wait)
            if wait > 0:
                await anyio.sleep(wait)
            self.joined += 1
        finally:
            self.waiting -= 1


class Renewals:
    """A host of many's heartbeat driver: it renews its workers' leases
    together (a :class:`~mesh._lease.HeartbeatDriver`).

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
        self._added = anyio.Event()
        self.calls = 0  # heartbeat.lua calls sent
        self.renewals = 0  # leases in them
        self.largest = 0  # the most leases in one call

    async def renew(self, lease: Lease, gen: Generation) -> None:
        """Renew ``gen``'s lease with the others' until cancelled."""
        self.add(lease, gen)
        try:
            await anyio.sleep_forever()
        finally:
            self.remove(lease, gen)

    def add(self, lease: Lease, gen: Generation) -> None:
        """Renew ``gen``'s lease from now on, starting at once (sync)."""
        self._due[(lease, gen)] = anyio.current_time()
        self._added.set()

    def remove(self, lease: Lease, gen: Generation) -> None:
        """Stop renewing ``gen``'s lease (sync); a reply on its way is dropped."""
        self._due.pop((lease, gen), None)

    async def join_turn(self) -> None:
        """A worker's turn to join (see :class:`Joins`)."""
        await self.joins.turn()

    async def rejoin_turn(self, lease: Lease) -> None:
        """Workers that fenced themselves together (the connection was down
        for more than R) hand back and rejoin in turns, from when Redis
        answers again, not all in the instant it does. Waits for a PING
        answered (retried with backoff) first, unless ``lease`` is closing.
        Cancellable."""
        backoff = 0.05
        while not lease.closing:
            try:
                await self._conn.execute("PING")
                break
            except (MeshConnectionError, CommandError):
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, self._timing.interval)
        await self.joins.turn()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Send due heartbeats until cancelled."""
        async with anyio.create_task_group() as nursery:
            task_status.started()
            last = -math.inf
            while True:
                now = anyio.current_time()
                due = [key for key, at in self._due.items() if at <= now]
                if due:
                    last = now
                    in_flight = now + self._timing.fence_after  # sent again if unanswered
                    for key in due:
                        self._due[key] = in_flight
                    for i in range(0, len(due), MAX_BATCH):
                        nursery.start_soon(self._send, now, due[i : i + MAX_BATCH])
                nxt = min(self._due.values(), default=math.inf)
                with anyio.CancelScope(deadline=nxt):
                    await self._added.wait()
                self._added = anyio.Event()
                await anyio.sleep_until(last + self.window)

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
            with anyio.move_on_after(t.fence_after):
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


class OwnHeartbeat:
    """A host of one's heartbeat driver: one heartbeat loop per lease, each
    renewal its own ``heartbeat.lua`` call, sent as soon as it is due; joins
    take no turns. With ``min_replicas``, a renewal counts once that many
    replicas have it (``WAIT``)."""

    def __init__(self, conn: Connection, binding: Binding, min_replicas: int = 0) -> None:
        self._conn = conn
        self._binding = binding
        self._min_replicas = min_replicas

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Nothing to run: each lease's :meth:`renew` is its own loop."""
        task_status.started()

    async def join_turn(self) -> None:
        """No pacing: returns at once."""

    async def rejoin_turn(self, lease: Lease) -> None:
        """No pacing: returns at once (the hand-back retries on its own)."""

    async def renew(self, lease: Lease, gen: Generation) -> None:
        """Renew ``gen``'s lease every H until cancelled or fenced: a reply
        not confirmed within R is sent again; an error is retried (see
        :meth:`Lease.renewal_failed`)."""
        t = lease.timing
        ttl_ms = int(t.ttl * 1000)
        while True:
            sent = anyio.current_time()
            queues = list(gen.runners)
            reply = None
            try:
                with anyio.move_on_after(t.fence_after):
                    renewal = await self._binding.heartbeat(
                        self._conn, gen.id, gen.incarnation, ttl_ms, gen.acks, queues
                    )
                    # With min_replicas, a renewal counts once replicas have it.
                    await self._conn.wait_replicas(self._min_replicas, t.fence_after)
                    reply = renewal
            except FencedError as exc:
                lease.fenced(gen, str(exc))
                return
            except (MeshConnectionError, CommandError) as exc:
                await anyio.sleep_until(lease.renewal_failed(gen, sent, exc))
                continue
            if reply is None:
                continue
            await anyio.sleep_until(lease.renewed(gen, sent, queues, reply))
