"""Fleets: many workers in one OS process that share what can be shared
(a host of many, :mod:`mesh._host`).

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
  H/20 capped at 50 ms), up to 100 per ``heartbeat.lua`` call
  (:class:`mesh._renewals.Renewals`). The script
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
  came back) register in turns spread over ``join_window`` (:class:`~mesh._renewals.Joins`),
  not all in the same instant.

:func:`~mesh.open_worker` is the same host with one member; the workers of
both are built by the same code (:func:`mesh._worker.join`).

Every worker of a fleet has the fleet's lease timing (one TTL per call). The
recycle counters (``peers_recycled`` and so on) are the fleet's
(:meth:`Fleet.statistics`), not its workers'.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ._client import DEFAULT_MAX_PAYLOAD, Client
from ._diskless import warn_diskless_delay
from ._errors import ClosedError, ConfigError
from ._host import Host, default_name, open_host
from ._keys import Keys
from ._lease import LeaseTiming
from ._loop import require_loop
from ._memory import MemoryWatch
from ._renewals import JOIN_BURST, JOIN_RATE, MAX_BATCH, Joins, Renewals
from ._supervisor import ReaperStatistics
from ._url import RedisConfig, check_min_replicas, coerce_config
from ._validate import seconds
from ._worker import Worker, join, worker_options

__all__ = ["JOIN_BURST", "JOIN_RATE", "MAX_BATCH", "Fleet", "Joins", "Renewals", "open_fleet"]

log = logging.getLogger("mesh.worker")


class Fleet:
    """Workers of one OS process that share a connection, a pub/sub
    connection, their heartbeat calls, a reaper, a scheduler and a policy
    reader: a host of many. Get one from :func:`open_fleet`; open its
    workers with :meth:`open_worker`."""

    def __init__(self, host: Host, max_payload: int) -> None:
        self._host = host
        self._max_payload = max_payload
        self.timing = host.timing
        """The lease timing of every worker of the fleet."""
        self.name = host.name
        self.workers: list[Worker] = []
        """The fleet's workers now open."""
        self._opened = 0  # workers opened so far (their default ids count them)
        self.client = Client(
            host.conn, host.keys, min_replicas=host.min_replicas, max_payload=max_payload
        )
        """A :class:`Client` on the fleet's connection, with the fleet's
        ``min_replicas``; it refuses calls (ClosedError) once the fleet's
        block is left."""

    @property
    def renewals(self) -> Renewals:
        """The fleet's batched renewals and paced joins."""
        assert isinstance(self._host.renewals, Renewals)
        return self._host.renewals

    @property
    def memory(self) -> MemoryWatch:
        """Redis's eviction policy, read once per poll for the whole fleet."""
        return self._host.memory

    def statistics(self) -> ReaperStatistics:
        """What the fleet's reaper did (checks, recycles) since it started."""
        return self._host.reaper.statistics()

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
        if self._host.closed:
            raise ClosedError("this fleet is closed")
        if worker_id is None:
            # Unique in the fleet by construction: 1,000 ids of 24 random bits
            # each (open_worker's default) collide in one process in 3% of fleets.
            self._opened += 1
            worker_id = f"{self.name}-{self._opened}"
        worker_id = worker_options(worker_id, stop_grace, rejoin_grace)
        opened: list[Worker] = []
        try:
            async with join(
                self._host, worker_id, self._max_payload, stop_grace, rejoin_grace
            ) as w:
                self.workers.append(w)
                opened.append(w)
                yield w
        finally:
            # listed until it has left (its handlers exited, its lease retired)
            for w in opened:
                self.workers.remove(w)


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
    require_loop("mesh.open_fleet")
    config = coerce_config(url)
    if join_window is not None and seconds("join_window", join_window) > 3600:
        raise ConfigError(f"join_window must be 0 to 3600 seconds, not {join_window!r}")
    keys = Keys(namespace)
    timing = LeaseTiming.make(ttl, heartbeat_interval, fence_after)
    replicas = check_min_replicas(config, min_replicas)
    name = default_name() if name is None else name
    window = timing.ttl / 2 if join_window is None else join_window
    async with open_host(
        config, keys, timing, name, min_replicas=replicas, of_one=False, join_window=window
    ) as host:
        # The renewals go on while the fleet's workers stop after a
        # cancellation from outside (the host's tasks are shielded).
        fleet = Fleet(host, max_payload)
        await warn_diskless_delay(host.conn, replicas, f"fleet {name}")
        try:
            yield fleet
        finally:
            fleet.client._closed = True
