"""The client's writes of tasks: enqueue (now, later, by priority), ensure
and reconcile persistent tasks, cancel, delete a queue. One script call
each (see :mod:`mesh._scripts`), then ``WAIT`` for ``min_replicas``.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Mapping

from ._binding import payload_bytes
from ._blob import standins, stored
from ._client_core import ClientCore
from ._errors import ConfigError
from ._keys import check_group, check_queue
from ._share import check_weight
from ._types import ReconcileResult
from ._units import MAX_UNIX_TIME, seconds_ms
from ._validate import whole

log = logging.getLogger("mesh.client")

__all__ = ["MAX_PRIORITY", "ClientWrites", "check_priority"]

#: Task priorities run from 0 (the default) to this.
MAX_PRIORITY = 9


class ClientWrites(ClientCore):
    """Putting tasks on queues and taking them off (part of :class:`~mesh.Client`)."""

    async def enqueue(
        self,
        queue: str,
        task: bytes | str,
        *,
        delay: float | None = None,
        at: datetime.datetime | float | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> None:
        """Put a one-shot task at the back of ``queue`` and nudge its workers;
        with ``delay`` or ``at``, put it in the queue's delayed set instead,
        to become ready at that time of the Redis clock.

        Args:
            delay: seconds from now (Redis clock), from 0 to ten years
                (``mesh._units.MAX_SECONDS``, 315,360,000).
            at: a timezone-aware :class:`datetime.datetime`, or a Unix time
                in seconds, up to 9999-12-31T23:59:59Z; a time in the past is
                due at once. Not both.
            priority: 0 (the default) to 9. Workers claim the highest
                priority first, FIFO within one. A task keeps its priority
                when it is handed back, recycled or retried (it goes back to
                the front of its level, or when due after a delay or a
                backoff), and a requeued dead letter its priority (and
                group). With a ``group``, a priority orders the group's
                own jobs: its higher ones start first.
            group: put it in this group of the queue (a tenant, an account,
                a device: 1 to 200 of ``A-Z a-z 0-9 _ . : / @ + = -``).
                Workers take turns among the groups with jobs ready
                (weighted round-robin), and a group's settings
                (:meth:`configure_group`) cap how many of its jobs run at
                once across the mesh and how fast they start. FIFO within a
                group (and a priority of the group); a retried job goes back
                to the front of its group. A group needs nothing made
                beforehand, and leaves no key behind once empty.

        A delayed task is durable (it is in Redis, not in any worker), listed
        by :meth:`delayed` and counted in :meth:`queue_info`, and removed by
        :meth:`cancel`. A payload is delayed at most once per queue: delaying
        one that is delayed already (or waiting for a retry) keeps one
        entry, due at the earlier time.

        Raises:
            TypeError, ValueError, ConfigError: a bad payload, queue name,
                ``delay`` or ``at`` (a naive datetime, both given, a negative
                delay or one over ten years, a time after the year 9999), or
                a ``priority`` that is not a whole number from 0 to 9;
                nothing was sent.
            ConflictError: the payload is a persistent task of ``queue``.
            MeshConnectionError: Redis could not be reached; or, with
                ``min_replicas``, fewer replicas acknowledged the write within
                ``connect_timeout``: it is on the master, and a failover may
                lose it (enqueue again: a duplicate is the safe side).
        """
        await self.enqueue_many(queue, [task], delay=delay, at=at, priority=priority, group=group)

    async def enqueue_many(
        self,
        queue: str,
        tasks: Iterable[bytes | str],
        *,
        delay: float | None = None,
        at: datetime.datetime | float | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> int:
        """Put one-shot tasks at the back of ``queue`` (of its level
        ``priority``), in order, atomically (all or none), in one round trip;
        with ``delay`` or ``at``, in the delayed set instead (see
        :meth:`enqueue`).

        Returns:
            How many were enqueued; with ``delay``/``at``, how many were newly
            delayed (a payload delayed already is not counted again).
        Raises:
            As :meth:`enqueue`; on ConflictError none was enqueued.
        """
        conn = self._check()
        check_queue(queue)
        when = _due(delay, at)
        check_priority(priority)
        if group is not None:
            check_group(group)
        payloads = self._payloads(tasks)
        if not payloads:
            return 0
        b = self._binding
        if group is not None:
            g = group
            in_ms, at_ms = when if when is not None else (None, None)
            r = await self._with_blobs(
                conn,
                payloads,
                lambda ps: b.enqueue_group(
                    conn, queue, g, ps, in_ms=in_ms, at_ms=at_ms, priority=priority
                ),
            )
            await self._replicated(conn)
            return len(payloads) if when is None else r.added
        if when is None:
            await self._with_blobs(conn, payloads, lambda ps: b.enqueue(conn, queue, ps, priority))
            await self._replicated(conn)
            return len(payloads)
        in_ms, at_ms = when
        r = await self._with_blobs(
            conn,
            payloads,
            lambda ps: b.delay(conn, queue, ps, in_ms=in_ms, at_ms=at_ms, priority=priority),
        )
        await self._replicated(conn)
        return r.added

    async def ensure(self, queue: str, task: bytes | str, *, weight: int = 1) -> bool:
        """Make ``task`` a persistent task of ``queue``: one live owner at a time,
        for as long as it is not cancelled.

        ``weight`` (a whole number from 1 to 1,000,000, default 1) is the
        task's part of the load: the fair share that peers balance is by
        weight against each worker's capacity (see
        :meth:`Worker.start_work`). Ensuring a task that is there already
        sets its weight (and the mesh rebalances if it changed).

        Returns:
            True if it was added, False if it was there already (queued,
            waiting for a retry, or running).
        Raises:
            TypeError, ValueError, ConfigError: a bad payload, queue name or
                weight (nothing was sent).
            ConflictError: the payload is queued, delayed (or waiting for a
                retry) or running as a one-shot task of ``queue`` (as
                :meth:`enqueue` refuses a persistent one). Costs a read of
                the queue and of its running processes' records: O(their
                number).
            MeshConnectionError: as for :meth:`enqueue` (``min_replicas``
                included); ensuring again is safe.
        """
        return (await self.ensure_many(queue, [task], weight=weight))[0]

    async def ensure_many(
        self, queue: str, tasks: Iterable[bytes | str], *, weight: int = 1
    ) -> list[bool]:
        """:meth:`ensure` for several tasks in one round trip, each with
        ``weight``; one bool each.

        Raises:
            As :meth:`ensure`; on ConflictError none was added.
        """
        conn = self._check()
        check_queue(queue)
        check_weight(weight)
        payloads = self._payloads(tasks)
        if not payloads:
            return []
        b = self._binding
        added = await self._with_blobs(conn, payloads, lambda ps: b.ensure(conn, queue, ps, weight))
        await self._replicated(conn)
        return added

    async def reconcile(
        self,
        queue: str,
        tasks: Iterable[bytes | str] | Mapping[bytes | str, int],
        *,
        weight: int = 1,
    ) -> ReconcileResult:
        """Make the persistent tasks of ``queue`` exactly ``tasks``: ensure the
        missing ones, cancel (wherever they run) the others. Each gets
        ``weight``, or, when ``tasks`` is a mapping, its value there (see
        :meth:`ensure`; a task there already takes the weight given).

        Each step is atomic; the whole is not: a concurrent ``ensure`` by
        someone else may survive or be cancelled. Safe to repeat. It also
        restores persistent tasks that vanished without a cancel (evicted,
        or deleted behind the mesh's back: ``mesh status`` shows them), and
        then recounts the queue's weight sums, which still counted them.

        Returns:
            The payloads this call added and the payloads this call cancelled
            (one that a concurrent call cancelled first is not reported; a
            cancelled payload of more than 1 MiB is reported as its stand-in,
            see :mod:`mesh._blob`: it is not read back to be reported).
        """
        conn = self._check()
        check_queue(queue)
        check_weight(weight)
        weights: dict[bytes, int] = {}
        if isinstance(tasks, Mapping):
            for t, w in tasks.items():
                check_weight(w)
                weights[payload_bytes(t)] = w
            want = list(dict.fromkeys(self._payloads(tasks.keys())))
        else:
            want = list(dict.fromkeys(self._payloads(tasks)))
        have = set(await self._reads.persistent(queue))
        # the queue holds a big payload's stand-in (mesh._blob): compared so
        wanted = set(standins(want))
        extra = sorted(have - wanted)
        added: list[bytes] = []
        by_weight: dict[int, list[bytes]] = {}
        for p in want:
            by_weight.setdefault(weights.get(p, weight), []).append(p)
        b = self._binding
        for w, group in sorted(by_weight.items()):

            async def ensure(ps: list[bytes], w: int = w) -> list[bool]:
                return await b.ensure(conn, queue, ps, w)

            flags = await self._with_blobs(conn, group, ensure)
            added += [p for p, f in zip(group, flags, strict=True) if f]
        cancelled: list[bytes] = []
        for p in extra:
            if sum(await self._binding.cancel(conn, queue, p)):
                cancelled.append(p)
        # Tasks that vanished without a cancel (evicted, deleted) and were
        # added back above left the queue's weight sums counting them twice.
        was, now = await self._binding.recount(conn, queue)
        if was != now:
            log.warning(
                "queue %s: reconcile found the persistent tasks' weight counted as %d where "
                "%d is there (tasks had vanished without a cancel): recounted",
                queue,
                was,
                now,
            )
        return ReconcileResult(tuple(added), tuple(cancelled))

    async def cancel(self, queue: str, task: bytes | str, *, group: str | None = None) -> int:
        """Cancel a task by payload anywhere in the mesh: every queued (or
        waiting-to-retry) copy is removed, it stops being a persistent task,
        and every running process of it is cancelled on whatever worker runs
        it (at once over pub/sub, and durably: a worker that missed the
        message stops it within one heartbeat interval). A cancelled process
        can no longer be finished. The copies queued in a group (or waiting
        there for a delay or a retry) are removed when ``group`` names it;
        a running one is cancelled whatever its group.

        Returns:
            How many copies were removed plus how many processes were cancelled.
        """
        conn = self._check()
        check_queue(queue)
        if group is not None:
            check_group(group)
        payload = stored(payload_bytes(task, named=True))  # a big one: as the queue holds it
        removed, cancelled = await self._binding.cancel(conn, queue, payload, group)
        return removed + cancelled

    async def delete_queue(self, queue: str) -> int:
        """Delete ``queue`` and everything in it (queued, delayed, dead-lettered
        and persistent tasks); running processes are cancelled as by
        :meth:`cancel`. Workers that serve it go on serving it, empty.

        Returns:
            How many tasks were removed (queued, waiting for a retry and
            dead-lettered ones) plus how many processes were cancelled.
        """
        conn = self._check()
        check_queue(queue)
        removed, cancelled = await self._binding.delete_queue(conn, queue)
        return removed + cancelled


def check_priority(priority: object) -> int:
    """``priority`` if it is a whole number from 0 to :data:`MAX_PRIORITY`.

    Raises:
        ConfigError: anything else.
    """
    return whole("priority", priority, 0, MAX_PRIORITY)


def _due(
    delay: float | None, at: datetime.datetime | float | None
) -> tuple[int, int | None] | None:
    """``delay``/``at`` as (ms from now, None) or (0, ms since the epoch), or
    None for neither.

    Raises:
        ConfigError: both given, a naive datetime, a number out of range
            (see :func:`mesh._units.seconds_ms`).
        TypeError: not a number or datetime.
    """
    if delay is None and at is None:
        return None
    if delay is not None and at is not None:
        raise ConfigError("give delay or at, not both")
    if delay is not None:
        return seconds_ms("delay", delay), None
    if isinstance(at, datetime.datetime):
        if at.tzinfo is None or at.tzinfo.utcoffset(at) is None:
            raise ConfigError(
                f"at={at.isoformat()} is a naive datetime: give it a timezone "
                "(e.g. datetime.now(timezone.utc)), or pass a Unix time"
            )
        t: object = at.timestamp()
    elif isinstance(at, int | float) and not isinstance(at, bool):
        t = at
    else:
        raise TypeError(f"at must be a datetime or a Unix time, not {type(at).__name__}")
    return 0, seconds_ms("at", t, maximum=MAX_UNIX_TIME)
