"""The client: put tasks on queues, cancel them, look at the mesh.

A client is not a peer: it holds no lease and runs no task of its own, so it
is cheap and can live anywhere (a web handler, a cron job, the CLI).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
import outcome

from . import _browse
from ._balance import check_weight, fair_share
from ._binding import Binding, payload_bytes
from ._browse import Job, JobPage, MinuteCounts
from ._connection import Connection, open_connection
from ._diskless import warn_diskless_delay
from ._epoch import adopt_value
from ._errors import ClosedError, CommandError, ConfigError, DeadLetterError, MeshError
from ._eval import run_reads
from ._keys import Keys, check_queue
from ._loop import require_loop
from ._memory import MemoryWatch
from ._policy import QueuePolicy, parse_policy, policy_fields
from ._pubsub import open_pubsub
from ._replies import parse_dead, parse_record, parse_result
from ._schedule import Schedule, cron_next, parse_spec, spec_of, split_id
from ._topology import Topology
from ._types import (
    DeadLetter,
    DelayedTask,
    Process,
    QueueInfo,
    QueueShare,
    ReconcileResult,
    WorkerInfo,
)
from ._units import MAX_UNIX_TIME, seconds_ms
from ._url import RedisConfig, check_min_replicas, coerce_config
from ._validate import seconds, whole

log = logging.getLogger("mesh.client")

__all__ = ["DEFAULT_MAX_PAYLOAD", "Client", "open_client"]

DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024
# result(): the queue's awaiting key (finish publishes done messages only
# while it exists) lives this long and is refreshed this often while waiting
AWAITING_TTL_MS = 10_000
AWAITING_REFRESH = 1.0


class Client:
    """Operations on the queues of one namespace. Get one from :func:`open_client`
    (or :attr:`Worker.client`).

    Every method is one or a few Redis round trips. On a broken connection a
    method raises :class:`MeshConnectionError`; whether a write that was in
    flight happened is then unknown (enqueue is at-least-once: retrying may
    enqueue twice). On cancellation the same holds: the command may or may not
    have run.
    """

    def __init__(
        self,
        conn: Connection,
        keys: Keys,
        *,
        min_replicas: int,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ):
        """A client on ``conn``, in the namespace of ``keys``.

        Args:
            min_replicas: replicas that must acknowledge an enqueue or ensure
                before it returns (0: none). Required, so that no client is
                built without deciding it (a fleet's client once ignored it).
            max_payload: refuse task payloads longer than this many bytes.

        Raises:
            ConfigError: ``min_replicas`` is not a whole number >= 0.
        """
        self._min_replicas = whole("min_replicas", min_replicas, 0)
        self._conn = conn
        self._keys = keys
        self._binding = Binding(keys)
        self._max_payload = max_payload
        self._closed = False
        self.memory = MemoryWatch("client")
        """Redis's memory and eviction policy as this client's reads for
        ``mesh status``, the dashboard and the exporter last saw them (see
        :mod:`mesh._memory`): a policy that can evict is logged once."""
        self.vanished: dict[str, int] = {}
        """Per queue, persistent tasks missing without a cancel, as last
        reported (see :func:`mesh._view.counts`)."""

    @property
    def namespace(self) -> str:
        """The namespace this client works in."""
        return self._keys.namespace

    def _check(self) -> Connection:
        if self._closed:
            raise ClosedError("this client is closed")
        return self._conn

    def _payloads(self, tasks: Iterable[object]) -> list[bytes]:
        if isinstance(tasks, str | bytes | bytearray | memoryview):
            raise TypeError("tasks must be an iterable of payloads, not a single payload")
        return [payload_bytes(t, self._max_payload) for t in tasks]

    # --- tasks -------------------------------------------------------------

    @property
    def min_replicas(self) -> int:
        """Replicas that must acknowledge an enqueue or ensure before it
        returns (``WAIT``); fixed when the client is built."""
        return self._min_replicas

    async def enqueue(
        self,
        queue: str,
        task: bytes | str,
        *,
        delay: float | None = None,
        at: datetime.datetime | float | None = None,
        priority: int = 0,
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
                backoff). Dead letters are requeued at priority 0.

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
        await self.enqueue_many(queue, [task], delay=delay, at=at, priority=priority)

    async def enqueue_many(
        self,
        queue: str,
        tasks: Iterable[bytes | str],
        *,
        delay: float | None = None,
        at: datetime.datetime | float | None = None,
        priority: int = 0,
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
        payloads = self._payloads(tasks)
        if not payloads:
            return 0
        if when is None:
            await self._binding.enqueue(conn, queue, payloads, priority)
            await self._replicated(conn)
            return len(payloads)
        in_ms, at_ms = when
        r = await self._binding.delay(
            conn, queue, payloads, in_ms=in_ms, at_ms=at_ms, priority=priority
        )
        await self._replicated(conn)
        return r.added

    async def configure(
        self,
        queue: str,
        *,
        max_attempts: int | None = None,
        backoff: float | None = None,
        backoff_max: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the handlers' timeout, not this call's
        result_ttl: float | None = None,
        rate_limit: int | tuple[int, float] | None = None,
    ) -> QueuePolicy:
        """Set the policy of ``queue`` in Redis; every worker serving it
        applies it (within one heartbeat interval), whatever its
        ``start_work`` options. Options not given (None) keep their stored
        value, or the default for a queue without a policy.

        Args:
            max_attempts: failed attempts after which a one-shot task is
                dead-lettered (0: no limit). Default 5.
            backoff: retry n waits ``backoff * 2**(n-1)`` seconds, capped
                at ``backoff_max``. Default 1.0.
            backoff_max: the cap. Default 60.0.
            timeout: seconds a handler may run; a longer one is cancelled
                and the attempt counts as failed (``TimeoutError`` in its
                dead-letter record). 0: no timeout (the default).
            result_ttl: keep each finished task's return value (and each
                dead letter's failure) this many seconds, for
                :meth:`result`. 0: results are not kept (the
                default; a plain queue costs nothing more).

            rate_limit: at most N claims per second (``N``), or per
                ``seconds`` (``(N, seconds)``), across the whole mesh: a
                token bucket in Redis, checked by every claim (a full bucket
                allows a burst of N). 0: no limit (the default).

        Returns:
            The policy stored now.
        Raises:
            ConfigError: a value out of range (nothing was written): every
                duration is a number of seconds from 0 to ten years.
        """
        conn = self._check()
        check_queue(queue)
        fields = policy_fields(
            max_attempts=max_attempts,
            backoff=backoff,
            backoff_max=backoff_max,
            timeout=timeout,
            result_ttl=result_ttl,
            rate_limit=rate_limit,
        )
        try:
            raw = await self._binding.configure(conn, queue, "set", "configure", fields)
        except CommandError as exc:
            if exc.code == "BAD_ARG":
                raise ConfigError(str(exc).removeprefix("BAD_ARG ")) from None
            raise
        assert raw is not None
        return parse_policy(raw, queue)

    async def policy(self, queue: str) -> QueuePolicy | None:
        """The stored policy of ``queue``, or None if it has none (its
        workers then apply their own ``start_work`` options, and the first of
        them to serve it stores those)."""
        check_queue(queue)
        raw = await self._check().execute("HGET", self._keys.policy, queue)
        return None if raw is None else parse_policy(raw, queue)

    async def clear_policy(self, queue: str) -> bool:
        """Remove the stored policy of ``queue``. Workers serving it keep
        applying the policy they have until they restart; the next worker to
        serve it stores its own options.

        Returns:
            Whether there was one.
        """
        check_queue(queue)
        conn = self._check()
        had = await conn.execute("HEXISTS", self._keys.policy, queue)
        await self._binding.configure(conn, queue, "clear", "", [])
        return bool(had)

    async def result(
        self,
        queue: str,
        task: bytes | str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - waiting is the point of this call
    ) -> bytes | None:
        """Wait for the outcome of the latest finished instance of ``task`` on
        ``queue``, a queue whose policy keeps results (``result_ttl``, see
        :meth:`configure`), and return what its handler returned: bytes
        (a ``str`` was encoded as UTF-8), or None.

        It returns at once if the outcome is there already (kept for
        ``result_ttl`` seconds after the task finished). Otherwise it waits
        for the queue's done message and checks again, and also checks
        again after 50 ms, 100 ms, ... up to every second (a lost message
        costs at most a second); no polling loop is needed in your code.
        One pub/sub connection is opened for the wait, and while it waits
        the queue's ``awaiting`` key is kept (workers publish done messages
        only while someone awaits them; it expires 10 s after the last
        waiter left).

        Raises:
            DeadLetterError: the latest outcome is a dead letter (it failed
                its last allowed attempt); ``exc.dead_letter`` has its
                attempts, last error, last worker and time. A dead letter
                counts until it is requeued or purged.
            MeshError: the task finished while this call waited and no
                result was kept (the queue kept no results when it ran: a
                ``result_ttl`` set just before the enqueue may reach the
                workers after the task ran), so none will come.
            TimeoutError: no outcome within ``timeout`` seconds (None: wait
                for ever). On a queue without ``result_ttl`` nothing is kept,
                so only a dead letter or a finish seen while waiting ends
                the wait.
            TypeError, ValueError, ConfigError: a bad payload, queue name or
                timeout.
            MeshConnectionError: Redis could not be reached.

        On cancellation nothing is left behind (the pub/sub connection is
        closed).
        """
        conn = self._check()
        check_queue(queue)
        payload = payload_bytes(task, self._max_payload)
        if timeout is not None:
            seconds("timeout", timeout)
        deadline = anyio.current_time() + (math.inf if timeout is None else timeout)
        got = await self._outcome(conn, queue, payload)
        if got is not None:
            return got.unwrap()
        async with open_pubsub(
            conn.config, name=f"mesh-result:{self.namespace}", route_key=self._keys.prefix
        ) as ps:
            # on the namespace's master (a cluster's SPUBLISH stays in its shard)
            await ps.subscribe(self._keys.done_channel(queue), sharded=True)
            # finish publishes done messages only while this key exists: set
            # after subscribing, refreshed while waiting, left to expire
            awaiting = self._keys.awaiting(queue)
            await conn.execute("SET", awaiting, b"", "PX", AWAITING_TTL_MS)
            marked = anyio.current_time()
            wait = 0.05
            while True:
                # checked after subscribing and marking: a finish before it
                # is seen here, one after it is published
                got = await self._outcome(conn, queue, payload)
                if got is not None:
                    return got.unwrap()
                now = anyio.current_time()
                if now - marked >= AWAITING_REFRESH:
                    await conn.execute("SET", awaiting, b"", "PX", AWAITING_TTL_MS)
                    marked = now
                if now >= deadline:
                    raise TimeoutError(
                        f"no outcome of the task on queue {queue} within {timeout:g} s"
                    )
                finished = False
                with anyio.CancelScope(deadline=min(deadline, now + wait)):
                    async for msg in ps:
                        if msg.data == payload or msg.kind == "reconnected":
                            finished = msg.kind != "reconnected"
                            break
                wait = min(wait * 2, 1.0)
                if finished and await self._outcome(conn, queue, payload) is None:
                    # finish keeps the result before it publishes: none is kept
                    raise MeshError(
                        f"the task finished on queue {queue} with no result kept (the "
                        "queue's policy kept no results when it ran); none will come"
                    )

    async def _outcome(
        self, conn: Connection, queue: str, payload: bytes
    ) -> outcome.Outcome[bytes | None] | None:
        """The latest outcome of ``payload``: its kept result or its latest
        dead letter, whichever is later; None if neither exists."""
        k = self._keys
        rec, dead = await _transaction(
            conn, [("GET", k.result(queue, payload)), ("LRANGE", k.dead(queue), 0, -1)]
        )
        res = parse_result(rec, payload) if rec is not None else None
        last: DeadLetter | None = None
        for raw in dead:
            if raw.endswith(payload):
                d = parse_dead(raw, queue)
                if d.task == payload:
                    last = d
        if last is not None and (res is None or last.when >= res[0]):
            return outcome.Error(
                DeadLetterError(
                    f"the task was dead-lettered after {last.attempts} attempts: "
                    f"{last.error or 'failed'}",
                    last,
                )
            )
        if res is not None:
            return outcome.Value(res[1])
        return None

    async def schedule(
        self,
        queue: str,
        task: bytes | str,
        *,
        every: float | None = None,
        cron: str | None = None,
    ) -> bool:
        """Make ``task`` a periodic task of ``queue``: each tick enqueues one
        one-shot copy of it, exactly once across the mesh (any worker fires
        it, whatever queues it serves). Unique per (queue, task): scheduling
        it again replaces its period and restarts its ticks.

        Args:
            every: a tick every this many seconds (0.05 to ten years), the first
                one period from now (Redis clock).
            cron: a cron expression, evaluated in UTC (needs the ``cronsim``
                package: ``pip install 'trio-mesh[cron]'``).

        Exactly one of the two. While no worker runs, ticks are missed; the
        first worker to run again fires one copy, not one per missed tick.

        Returns:
            True if the schedule is new, False if it replaced one.
        Raises:
            ConfigError: neither or both of every and cron, a period too
                short, a bad cron expression, cronsim missing.
            TypeError, ValueError: a bad payload or queue name.
        """
        conn = self._check()
        check_queue(queue)
        payload = payload_bytes(task, self._max_payload)
        spec = spec_of(every, cron)
        first = None
        if cron is not None:
            first = cron_next(spec[5:], round(await self.time() * 1000))
        new, _ = await self._binding.schedule(conn, queue, payload, spec, first)
        return new

    async def unschedule(self, queue: str, task: bytes | str) -> bool:
        """Remove the periodic task (``queue``, ``task``); copies it enqueued
        already stay.

        Returns:
            Whether it existed.
        """
        conn = self._check()
        check_queue(queue)
        return await self._binding.unschedule(conn, queue, payload_bytes(task))

    async def schedules(self, queue: str | None = None) -> list[Schedule]:
        """The periodic tasks (of ``queue``, or of every queue), the next due
        first."""
        conn = self._check()
        if queue is not None:
            check_queue(queue)
        k = self._keys
        flat, specs = await _transaction(
            conn,
            [("ZRANGE", k.schedules, 0, -1, "WITHSCORES"), ("HGETALL", k.schedule_specs)],
        )
        spec_of_id = {specs[i]: specs[i + 1] for i in range(0, len(specs), 2)}
        out = []
        for i in range(0, len(flat), 2):
            q, payload = split_id(flat[i])
            spec = spec_of_id.get(flat[i])
            if spec is None or (queue is not None and q != queue):
                continue
            every, expr = parse_spec(spec)
            out.append(Schedule(q, payload, every, expr, int(float(flat[i + 1])) / 1000))
        return out

    async def delayed(self, queue: str, *, limit: int | None = None) -> list[DelayedTask]:
        """The tasks of ``queue`` waiting for their due time (enqueued with a
        delay, or failed and waiting for a retry), the first due first: all,
        or the first ``limit``.

        Raises:
            ConfigError: a bad queue name or a ``limit`` below 0.
        """
        check_queue(queue)
        if limit is not None:
            whole("limit", limit)
        if limit == 0:
            return []
        conn = self._check()
        k = self._keys
        end = -1 if limit is None else limit - 1
        r, leveled = await _transaction(
            conn,
            [
                ("ZRANGE", k.delayed(queue), 0, end, "WITHSCORES"),
                ("EXISTS", k.delayed_prio(queue)),
            ],
        )
        payloads = r[0::2]
        levels = [None] * len(payloads)
        if leveled and payloads:
            levels = await conn.execute("HMGET", k.delayed_prio(queue), *payloads)
        return [
            DelayedTask(p, int(float(due)) / 1000, int(lv or 0))
            for p, due, lv in zip(payloads, r[1::2], levels, strict=True)
        ]

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
        added = await self._binding.ensure(conn, queue, payloads, weight)
        await self._replicated(conn)
        return added

    async def _replicated(self, conn: Connection) -> None:
        """With ``min_replicas``, return only once that many replicas have the
        writes made so far (``WAIT``, bounded by the URL's connect_timeout);
        MeshConnectionError otherwise."""
        if self.min_replicas:
            await conn.wait_replicas(self.min_replicas, conn.config.connect_timeout)

    async def adopt_namespace(self) -> None:
        """The operator's step after a master lost the namespace (restarted
        empty) and no node that holds it will come back: make the namespace
        on the master this client is connected to the one every process
        uses from now on. Processes that refuse that master (its epoch is not
        the one they knew, see docs/operating.md) accept it at their next
        connect attempt; what the lost copy held is gone (re-declare the
        persistent tasks: :meth:`reconcile`).

        Raises:
            MeshConnectionError, CommandError: as for any write.

        On cancellation the write may or may not have happened; run it again.
        """
        value = adopt_value()
        await self._conn.execute("SET", self._keys.epoch, value)
        epoch = self._conn.topology.epoch
        if epoch is not None:
            epoch.known = value

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
            (one that a concurrent call cancelled first is not reported).
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
        have = set(await self._persistent(conn, queue))
        wanted = set(want)
        extra = sorted(have - wanted)
        added: list[bytes] = []
        by_weight: dict[int, list[bytes]] = {}
        for p in want:
            by_weight.setdefault(weights.get(p, weight), []).append(p)
        for w, group in sorted(by_weight.items()):
            flags = await self._binding.ensure(conn, queue, group, w)
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

    async def cancel(self, queue: str, task: bytes | str) -> int:
        """Cancel a task by payload anywhere in the mesh: every queued (or
        waiting-to-retry) copy is removed, it stops being a persistent task,
        and every running process of it is cancelled on whatever worker runs
        it (at once over pub/sub, and durably: a worker that missed the
        message stops it within one heartbeat interval). A cancelled process
        can no longer be finished.

        Returns:
            How many copies were removed plus how many processes were cancelled.
        """
        conn = self._check()
        check_queue(queue)
        removed, cancelled = await self._binding.cancel(conn, queue, payload_bytes(task))
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

    # --- looking -----------------------------------------------------------

    async def queues(self) -> list[str]:
        """Names of the queues that have been used (enqueued to, ensured on,
        or served), sorted."""
        r = await self._check().execute("SMEMBERS", self._keys.queues)
        return sorted(q.decode() for q in r)

    async def tasks(self, queue: str) -> list[bytes]:
        """The queued payloads of ``queue`` in claim order (next first: those
        with a priority, the highest first, then the others). Tasks waiting
        for a retry or their due time are not included (see :meth:`delayed`)."""
        check_queue(queue)
        k = self._keys
        prio, plain = await _transaction(
            self._check(), [("ZRANGE", k.prio(queue), 0, -1), ("LRANGE", k.queue(queue), 0, -1)]
        )
        return [m[16:] for m in prio] + list(plain)

    async def queue_length(self, queue: str) -> int:
        """How many tasks are queued (not running, not waiting for a retry),
        those with a priority included."""
        check_queue(queue)
        k = self._keys
        cmds = [("LLEN", k.queue(queue)), ("ZCARD", k.prio(queue))]
        n, p = await _transaction(self._check(), cmds)
        return int(n) + int(p)

    async def queue_info(self, queue: str) -> QueueInfo:
        """Counts of one queue, read in one round trip."""
        (info,) = await self.queue_infos([queue])
        return info

    async def queue_infos(self, queues: Iterable[str] | None = None) -> list[QueueInfo]:
        """Counts of several queues (default: every known queue, sorted), read
        together in one transaction and one round trip after the list of
        queues."""
        names = [check_queue(q) for q in queues] if queues is not None else await self.queues()
        if not names:
            return []
        k = self._keys
        cmds = []
        for q in names:
            cmds += [
                ("LLEN", k.queue(q)),
                ("ZCARD", k.delayed(q)),
                ("HLEN", k.procs(q)),
                ("HLEN", k.persistent(q)),
                ("SCARD", k.standby(q)),
                ("LLEN", k.dead(q)),
                ("ZCARD", k.prio(q)),
                ("EXISTS", k.paused(q)),
            ]
        r = [int(x) for x in await _transaction(self._check(), cmds)]
        out = []
        for i, q in enumerate(names):
            queued, delayed, running, p_run, p_standby, dead, prio, paused = r[8 * i : 8 * i + 8]
            out.append(
                QueueInfo(q, queued + prio, delayed, running, p_run + p_standby, dead, paused == 1)
            )
        return out

    # --- browsing jobs, pausing ------------------------------------------

    async def jobs(
        self,
        queue: str,
        state: str = "queued",
        *,
        limit: int = 50,
        after: str | None = None,
        prefix: bytes | str | None = None,
    ) -> JobPage:
        """One page of the jobs of ``queue`` in ``state``: ``"queued"`` (in
        claim order), ``"delayed"`` (first due first), ``"running"`` (by
        token) or ``"dead"`` (oldest first). Pass a page's ``next`` as
        ``after`` for the following page (None after the last). With
        ``prefix``, only payloads that start with it (a page then looks at
        up to 20,000 entries, and may come back short with a ``next``).

        Each job carries the first 256 bytes of its payload and its
        ``size``, never the whole payload (one may be 64 MiB): ``Job.whole``
        says whether ``task`` is all of it; :meth:`job` gives one whole.

        Read with pipelined reads (no transaction): a job that moves while it
        is read may show in either state; positions shift as tasks are
        claimed (see :mod:`mesh._browse`).

        Raises:
            ConfigError: a bad queue name, state, limit (1..1000) or cursor.
            MeshConnectionError: Redis could not be reached.
            ProtocolError: a record in Redis is malformed.
        """
        p = None if prefix is None else self._payloads([prefix])[0]
        return await _browse.jobs(
            self._check(), self._keys, queue, state, limit=limit, after=after, prefix=p
        )

    async def job(self, queue: str, task: bytes | str) -> Job | None:
        """The record of ``task`` on ``queue``: running, else queued, else
        delayed, else its latest dead letter; None if it is in none of them
        (finished, cancelled, never enqueued).

        Raises:
            ConfigError, TypeError, ValueError: a bad queue name or payload.
            MeshConnectionError: Redis could not be reached.
        """
        (payload,) = self._payloads([task])
        return await _browse.job(self._check(), self._keys, queue, payload)

    async def pause(self, queue: str) -> bool:
        """Pause ``queue`` for every worker of the namespace: from now on no
        worker starts a one-shot task of it. Running processes finish;
        enqueues are taken and wait; delayed tasks that come due move to the
        queue and wait there. Persistent tasks are not affected: they keep
        their owners and are handed over and claimed as usual (a pause must
        not take them down). A worker of a protocol before 8 ignores it.

        Returns:
            True if the queue was not paused before.
        Raises:
            ConfigError: a bad queue name.
            MeshConnectionError: Redis could not be reached.
        """
        check_queue(queue)
        return await self._binding.pause(self._check(), queue, "pause")

    async def resume(self, queue: str) -> bool:
        """End a pause of ``queue``: its idle workers are woken for the tasks
        queued at once (as an enqueue wakes them).

        Returns:
            True if the queue was paused.
        Raises:
            ConfigError: a bad queue name.
            MeshConnectionError: Redis could not be reached.
        """
        check_queue(queue)
        return await self._binding.pause(self._check(), queue, "resume")

    async def paused(self) -> dict[str, float]:
        """The paused queues among the known ones, each with since when (Redis
        clock, seconds)."""
        names = await self.queues()
        if not names:
            return {}
        got = await self._check().pipeline([("GET", self._keys.paused(q)) for q in names])
        return {q: int(v) / 1000 for q, v in zip(names, got, strict=True) if v is not None}

    async def minute_counts(
        self, queues: Iterable[str] | None = None, *, minutes: int = 60
    ) -> list[MinuteCounts]:
        """Processes finished and failed per minute over the last ``minutes``
        (1..1440; 120 are kept), per queue (default: every known queue), as
        workers report them every few seconds (the dashboard's charts).

        Raises:
            ConfigError: a bad queue name or ``minutes``.
            MeshConnectionError: Redis could not be reached.
        """
        names = list(queues) if queues is not None else await self.queues()
        _, out = await _browse.minute_counts(self._check(), self._keys, names, minutes)
        return out

    async def time(self) -> float:
        """The Redis clock, in seconds: the clock that ``Process.started``,
        ``WorkerInfo.started`` and every lease use."""
        sec, usec = await self._check().execute("TIME")
        return int(sec) + int(usec) / 1e6

    async def dead_letters(self, queue: str) -> list[DeadLetter]:
        """The dead letters of ``queue``, oldest first: one-shot tasks that
        failed their last allowed attempt (or whose workers kept crashing),
        each with its attempts, last error, last worker and the time it was
        dead-lettered. A payload dead-lettered twice is listed twice.

        Raises:
            ProtocolError: an entry is not a dead-letter record (protocol 4 and later).
        """
        check_queue(queue)
        r = await self._check().execute("LRANGE", self._keys.dead(queue), 0, -1)
        return [parse_dead(rec, queue) for rec in r]

    async def requeue_dead(self, queue: str, tasks: Iterable[bytes | str] | None = None) -> int:
        """Put dead letters of ``queue`` back at the back of the queue, with
        their attempt counts reset, atomically: all of them, or those whose
        payload is in ``tasks``. A payload that has become a persistent task
        of the queue since stays a dead letter.

        Returns:
            How many were requeued (a payload dead-lettered twice counts
            twice, and is queued twice).
        Raises:
            TypeError, ValueError, ConfigError: bad payloads or queue name.
        """
        return await self._dead(queue, "requeue", tasks)

    async def purge_dead(self, queue: str, tasks: Iterable[bytes | str] | None = None) -> int:
        """Drop dead letters of ``queue``, atomically: all of them, or those
        whose payload is in ``tasks``. The live queue is left alone.

        Returns:
            How many records were dropped.
        Raises:
            TypeError, ValueError, ConfigError: bad payloads or queue name.
        """
        return await self._dead(queue, "purge", tasks)

    async def _dead(self, queue: str, mode: str, tasks: Iterable[bytes | str] | None) -> int:
        conn = self._check()
        check_queue(queue)
        payloads = None if tasks is None else self._payloads(tasks)
        if payloads == []:
            return 0
        done, _ = await self._binding.dead(conn, queue, mode, payloads)
        return done

    async def persistent_tasks(self, queue: str) -> dict[bytes, str | None]:
        """The persistent tasks of ``queue``, each with the id of the process
        that runs it, or None while it is queued or waiting for a retry."""
        check_queue(queue)
        return await self._persistent(self._check(), queue)

    async def _persistent(self, conn: Connection, queue: str) -> dict[bytes, str | None]:
        """Payload -> process id (running) or None (queued or delayed), read in
        one transaction: a claim or a give back may move a payload between
        the two keys, and two separate reads could miss it."""
        k = self._keys
        running, standby = await _transaction(
            conn, [("HGETALL", k.persistent(queue)), ("SMEMBERS", k.standby(queue))]
        )
        out: dict[bytes, str | None] = dict.fromkeys(standby)
        # a queued one may also be a field with the value "" (while the hash is small)
        out.update((running[i], running[i + 1].decode() or None) for i in range(0, len(running), 2))
        return out

    async def processes(self, queue: str | None = None) -> list[Process]:
        """Running processes of one queue, or of every known queue, in claim order."""
        conn = self._check()
        queues = [check_queue(queue)] if queue is not None else await self.queues()
        if not queues:
            return []
        replies = await conn.pipeline([("HGETALL", self._keys.procs(q)) for q in queues])
        out = []
        for q, r in zip(queues, replies, strict=True):
            out += [parse_record(r[i], r[i + 1], q) for i in range(0, len(r), 2)]
        out.sort(key=lambda p: p.token)
        return out

    async def workers(self) -> list[WorkerInfo]:
        """Every registered worker, live or dead-but-not-yet-recycled, by id."""
        conn = self._check()
        k = self._keys
        now_r, ids = await conn.pipeline([("TIME",), ("ZRANGE", k.workers, 0, -1, "WITHSCORES")])
        now_ms = int(now_r[0]) * 1000 + int(now_r[1]) // 1000
        entries = [(ids[i].decode(), int(float(ids[i + 1]))) for i in range(0, len(ids), 2)]
        if not entries:
            return []
        cmds: list[tuple[Any, ...]] = []
        for w, _ in entries:
            cmds += [("EXISTS", k.heartbeat(w)), ("SMEMBERS", k.serves(w)), ("HGET", k.info, w)]
        r = await conn.pipeline(cmds)
        served = [sorted(q.decode() for q in r[3 * i + 1]) for i in range(len(entries))]
        pairs = [(w, q) for (w, _), qs in zip(entries, served, strict=True) for q in qs]
        cmds = []
        for w, q in pairs:
            cmds += [("SCARD", k.held(w, q)), ("HMGET", k.share(q), "c" + w, "h" + w)]
        r2 = await conn.pipeline(cmds) if pairs else []
        counts = r2[0::2]
        weights = r2[1::2]
        shares = await self._shares(sorted({q for qs in served for q in qs}))
        out, pos = [], 0
        for i, (w, deadline) in enumerate(entries):
            held = [int(c) for c in counts[pos : pos + len(served[i])]]
            fields = weights[pos : pos + len(served[i])]
            n = sum(held)
            pos += len(served[i])
            mine = [
                shares[q].of(w, h, cap_b, extra_b)
                for q, h, (cap_b, extra_b) in zip(served[i], held, fields, strict=True)
            ]
            info = _load_info(r[3 * i + 2])
            out.append(
                WorkerInfo(
                    id=w,
                    alive=r[3 * i] == 1,
                    queues=tuple(served[i]),
                    processes=n,
                    lease_left=(deadline - now_ms) / 1000,
                    host=str(info.get("host", "")),
                    pid=int(info.get("pid", 0)),
                    started=float(info.get("started", 0.0)),
                    shares=tuple(mine),
                )
            )
        out.sort(key=lambda w: w.id)
        return out

    async def _shares(self, queues: list[str]) -> dict[str, QueueBalance]:
        """Per queue, what its fair shares are made of (see :class:`QueueBalance`)."""
        if not queues:
            return {}
        k = self._keys
        cmds: list[tuple[Any, ...]] = []
        for q in queues:
            cmds += [
                ("HMGET", k.share(q), ":weight", ":capacity"),
                ("HGETALL", k.moving(q)),
                ("HGETALL", k.reserved(q)),
            ]
        r = await self._check().pipeline(cmds)
        out = {}
        for j, q in enumerate(queues):
            weight, capacity = r[3 * j]
            moving, reserved = _pairs(r[3 * j + 1]), _pairs(r[3 * j + 2])
            holders = []
            if moving:
                recs = await self._check().execute("HMGET", k.procs(q), *moving)
                holders = [rec.split(b"\0", 1)[0].decode() for rec in recs if rec]
            out[q] = QueueBalance.read(q, weight, capacity, moving, reserved, holders)
        return out


@attrs.frozen
class QueueBalance:
    """What the fair shares of one queue are made of, as read from Redis: the
    one place that turns those reads into :class:`QueueShare` values, for
    :meth:`Client.workers` (``mesh status``) and the dashboard's
    :func:`mesh._view.overview` alike. Sync, no I/O.

    Attributes:
        queue: the queue.
        weight: T, the total weight of its persistent tasks
            (``:weight`` of ``{ns}:share:<Q>``).
        capacity: C, the total capacity of its servers (``:capacity``),
            at least 1.
        incoming: per worker, the persistent tasks on their way to it (marked
            to move to it, or handed back and reserved for it).
        outgoing: per worker, its processes a rebalance asked it to hand back.
    """

    queue: str
    weight: int
    capacity: int
    incoming: Mapping[str, int]
    outgoing: Mapping[str, int]

    @classmethod
    def read(
        cls,
        queue: str,
        weight: bytes | None,
        capacity: bytes | None,
        moving: Mapping[bytes, bytes],
        reserved: Mapping[bytes, bytes],
        holders: Iterable[str],
    ) -> QueueBalance:
        """From the share hash's ``:weight`` and ``:capacity``, the queue's
        ``moving`` and ``reserved`` hashes (values ``R:ms``: for worker R),
        and the worker holding each process in ``moving``."""
        incoming: dict[str, int] = {}
        for v in [*moving.values(), *reserved.values()]:
            to = v.decode().rsplit(":", 1)[0]
            incoming[to] = incoming.get(to, 0) + 1
        outgoing: dict[str, int] = {}
        for holder in holders:
            outgoing[holder] = outgoing.get(holder, 0) + 1
        return cls(queue, int(weight or 0), max(1, int(capacity or 0)), incoming, outgoing)

    def of(self, worker: str, held: int, capacity: bytes | None, extra: bytes | None) -> QueueShare:
        """``worker``'s share, holding ``held`` processes of the queue, with
        its ``c`` + id and ``h`` + id fields of the share hash (its capacity,
        1 when absent; the weight of its processes beyond one each, 0 when
        absent)."""
        cap = int(capacity or 1)
        share = fair_share(self.weight, self.capacity, cap)
        return QueueShare(
            self.queue,
            held,
            math.floor(share),
            math.ceil(share),
            self.incoming.get(worker, 0),
            self.outgoing.get(worker, 0),
            weight=held + int(extra or 0),
            share=share,
            capacity=cap,
        )


def _pairs(reply: Any) -> dict[bytes, bytes]:
    """An HGETALL reply (a flat list, or a map) as a dict."""
    if isinstance(reply, dict):
        return reply
    return {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


#: Task priorities run from 0 (the default) to this.
MAX_PRIORITY = 9


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


def _load_info(raw: bytes | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


async def _transaction(conn: Connection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """The replies of the read ``commands`` run as one step: one consistent
    view of several keys (scripts move tasks between them), one round trip.
    A read-only script (:func:`run_reads`), not ``MULTI``/``EXEC``: Redis
    answers it at the memory limit too.

    Raises:
        CommandError: a command got an error reply (nothing is answered).
    """
    return await run_reads(conn, commands)


@asynccontextmanager
async def open_client(
    url: str | RedisConfig = "redis://127.0.0.1:6379",
    *,
    namespace: str = "mesh",
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    min_replicas: int | None = None,
) -> AsyncIterator[Client]:
    """Connect a :class:`Client` to the mesh ``namespace`` at ``url``.

    Args:
        url: ``redis://``, ``rediss://`` (TLS), ``unix://``, ``redis+sentinel://``
            or ``redis+cluster://`` URL (see :func:`~mesh.parse_url`). Replies that
            mean "not executed here" (a failover, a moved slot) are re-routed to
            the master and retried for up to the URL's ``connect_timeout``.
        namespace: isolates one mesh from others on the same Redis.
        max_payload: refuse task payloads longer than this many bytes.
        min_replicas: ``enqueue``/``ensure`` return only once this many
            replicas have the write (``WAIT``, up to ``connect_timeout``), else
            raise MeshConnectionError (see docs/guarantees.md). Default: the
            URL's ``min_replicas`` query parameter, else 0.

    Raises:
        ConfigError: a bad URL, namespace or ``min_replicas`` (before
            connecting); called outside trio (from asyncio, say).
        MeshConnectionError: Redis cannot be reached (fails fast).

    The connection is closed when the block is left; a cancelled block leaves
    nothing behind.
    """
    require_loop("mesh.open_client")
    keys = Keys(namespace)
    config = coerce_config(url)
    replicas = check_min_replicas(config, min_replicas)
    topology = Topology(config, route_key=keys.prefix, epoch_key=keys.epoch)
    async with open_connection(config, name=f"mesh-client:{namespace}", topology=topology) as conn:
        client = Client(conn, keys, min_replicas=replicas, max_payload=max_payload)
        await warn_diskless_delay(conn, replicas, "client")
        try:
            yield client
        finally:
            client._closed = True
