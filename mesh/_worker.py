"""The worker: one peer of the mesh.

A worker runs, inside its own nursery:

* its **lease** (:mod:`mesh._lease`): one identity at a time, with the
  heartbeat that renews it and fans its reply out to the runners, self-fencing,
  and rejoining under a new identity after a fence;
* one **runner** per queue served with a handler (:mod:`mesh._runner`);
* a **reaper** (:mod:`mesh._supervisor`) that recycles dead peers;
* a **listener** for pub/sub nudges: a wake (a queue it serves has tasks
  and Redis took it out of the queue's idle set), cancel of a process, key
  expiry (a peer died). Pub/sub is only a nudge: the heartbeat reply
  carries the durable cancel inbox and which queues have work, and a
  reconnect triggers a full re-check.

Leaving :func:`open_worker` cancels every handler and keeps renewing the
lease while they exit (at most ``stop_grace``): each process is handed back
to the front of its queue, with no attempt counted, once its handler has
exited, and idle peers are woken, so a peer takes over at once but never
while the old handler may still run (invariant 10).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
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
from ._keys import Keys, check_queue, check_worker_id
from ._lease import Generation, HeartbeatDriver, Lease, LeaseTiming
from ._memory import MemoryInfo, MemoryWatch, read_memory, watch_memory
from ._policy import PolicyWatch, QueuePolicy, differences, parse_policy, policy_fields
from ._pubsub import Message, PubSub, open_pubsub
from ._runner import BatchHandler, Handler, QueueConfig, QueueRunner
from ._schedule import run_scheduler
from ._scripts import Binding
from ._shielded import ShieldedTasks
from ._stats import Histogram, QueueStatistics, Recorder
from ._supervisor import Reaper
from ._topology import Topology
from ._transport import check_min_replicas
from ._trio import require_trio
from ._types import Process
from ._url import RedisConfig, parse_url
from ._validate import seconds, whole

__all__ = [
    "LeaseTiming",
    "Worker",
    "WorkerStatistics",
    "check_server",
    "open_worker",
    "worker_options",
]

log = logging.getLogger("mesh.worker")


@attrs.frozen
class WorkerStatistics:
    """One view of a worker's counters since it started (see
    :meth:`Worker.statistics`): its runners', heartbeat's, reaper's,
    connection's and event link's. Metrics (``mesh.metrics``) read this.

    Attributes:
        worker_id: the current worker id.
        generation: 1, plus one per fence (each rejoin is a new identity).
        fenced: how many times it fenced itself (sum of ``fences``).
        processes_started: handlers started, over all queues (see ``queues``).
        processes_finished: processes reported finished, over all queues.
        processes_failed: handlers that raised, over all queues.
        processes_cancelled: handlers stopped by a cancel or a fence.
        running: handlers running now.
        heartbeats: heartbeats Redis confirmed.
        peers_recycled: dead peers this worker recycled (takeovers).
        processes_recycled: processes of dead peers it put back in their
            queues.
        dead_lettered: of those, one-shot tasks dead-lettered instead (their
            last allowed attempt crashed).
        fences: fences by reason (``lease_expired``, ``lease_superseded``,
            ``heartbeat_timeout``).
        heartbeat_seconds: heartbeat round trips (sent to confirmed).
        queues: per served (or once served) queue, by name.
        reap_checks: lease checks the reaper made.
        commands_sent: Redis commands its connection sent.
        reconnects: reconnects of its connection.
        event_reconnects: reconnects of its pub/sub link.
    """

    worker_id: str
    generation: int
    fenced: int
    processes_started: int
    processes_finished: int
    processes_failed: int
    processes_cancelled: int
    running: int
    heartbeats: int
    peers_recycled: int
    processes_recycled: int = 0
    dead_lettered: int = 0
    fences: Mapping[str, int] = attrs.field(factory=dict)
    heartbeat_seconds: Histogram | None = None
    queues: Mapping[str, QueueStatistics] = attrs.field(factory=dict)
    reap_checks: int = 0
    commands_sent: int = 0
    reconnects: int = 0
    event_reconnects: int = 0

    processes_handed_back: int = 0
    processes_moved: int = 0  # handed back to a peer below its share (rebalancing)
    redis_memory: MemoryInfo | None = None
    """Redis's memory and eviction policy as the host last read them (None:
    not read yet, or INFO not allowed)."""


class Worker:
    """One peer of the mesh. Get one from :func:`open_worker`."""

    min_replicas: int = 0
    """Replicas that must acknowledge a lease renewal (before it counts) and a
    persistent task's claim (before its handler starts); set by :func:`open_worker`."""

    def __init__(
        self,
        conn: Connection,
        pubsub: PubSub,
        keys: Keys,
        timing: LeaseTiming,
        base_id: str,
        max_payload: int,
        stop_grace: float = 10.0,
        rejoin_grace: float = 0.0,
        *,
        reaper: Reaper | None = None,
        driver: HeartbeatDriver | None = None,
        housekeeping: bool = True,
        memory: MemoryWatch | None = None,
    ) -> None:
        self._conn = conn
        self._pubsub = pubsub
        self._keys = keys
        self._binding = Binding(keys)
        self.timing = timing
        self.stop_grace = stop_grace
        """How long a stop waits for handlers to exit (seconds)."""
        self.rejoin_grace = rejoin_grace
        """How long this worker's persistent tasks wait for it after it
        leaves (seconds; 0: not at all)."""
        self._stop_started: float | None = None
        self._base_id = base_id
        self._queues: dict[str, QueueConfig] = {}
        self._closing = False
        self._closed = False
        self._stats = Recorder()
        self._counts = CountsReporter(conn, self._binding, lambda: (self._stats,))
        # A fleet's worker shares the fleet's reaper (and its scheduler and
        # policy reader: housekeeping=False) and its batched heartbeats.
        self._housekeeping = housekeeping
        self._reaper = reaper or Reaper(
            conn,
            self._binding,
            ttl=timing.ttl,
            queues=lambda: self._queues,
            own=lambda: self._lease.ids,
            me=lambda: f"worker {self._gen.id}",
            recorder=self._stats,
        )
        self._lease = Lease(
            conn,
            pubsub,
            self._binding,
            timing,
            base_id,
            self._reaper,
            queues=lambda: self._queues,
            start_runners=self._start_runners,
            cancel_process=self._cancel_process,
            recorder=self._stats,
            driver=driver,
            capacity=lambda q: self._queues[q].capacity if q in self._queues else 1,
        )
        self._queue_lock = trio.Lock()
        self.client = Client(conn, keys, max_payload=max_payload)
        """A :class:`Client` on this worker's connection."""
        # Redis's eviction policy, read by the host (open_worker or a fleet)
        self._memory = memory or MemoryWatch(f"worker {base_id}")

    @property
    def _gen(self) -> Generation:
        return self._lease.gen

    # --- public API ----------------------------------------------------------

    @property
    def id(self) -> str:
        """The current worker id. It changes when the worker was fenced and
        rejoined under a new identity."""
        return self._gen.id

    def check_lease(self, process: Process | None = None) -> None:
        """Raise unless this worker still holds its lease by its own reckoning:
        no fence happened and the self-fence deadline (R after the last
        confirmed heartbeat was sent) has not passed. With ``process``, also
        raise if that process belongs to an identity this worker has given
        up. Sync: it looks at the clock, not at Redis.

        Call it right before an external write that must not come from a
        stale owner. After a pause (SIGSTOP, a long GC, a suspended VM) the
        deadline has passed as soon as the process runs again, even in the
        one step a handler may take before its cancellation is delivered.
        Fencing tokens checked downstream remain the real defence.

        Raises:
            FencedError: the lease is, or may be, gone.
        """
        gen = self._gen
        if gen.fence_reason is not None:
            raise FencedError(f"worker {gen.id} is fenced ({gen.fence_reason})")
        if trio.current_time() >= gen.scope.deadline:
            raise FencedError(
                f"worker {gen.id}: no heartbeat confirmed within {self.timing.fence_after} s"
            )
        if gen.scope.cancel_called:
            raise FencedError(f"worker {gen.id} is stopping")
        if process is not None and process.worker_id != gen.id:
            raise FencedError(
                f"process {process.id} belongs to worker {process.worker_id}, "
                f"which this worker gave up (it is {gen.id} now)"
            )

    def statistics(self) -> WorkerStatistics:
        """A snapshot of the worker's counters (sync: no I/O, cannot fail)."""
        st = self._stats
        running = {q: len(rn.running) for q, rn in self._gen.runners.items()}
        queues = {q: c.snapshot(q, running.get(q, 0)) for q, c in sorted(st.queues.items())}
        per = queues.values()
        conn = self._conn.statistics()
        return WorkerStatistics(
            worker_id=self._gen.id,
            generation=self._gen.number,
            fenced=sum(st.fences.values()),
            processes_started=sum(q.started for q in per),
            processes_finished=sum(q.finished for q in per),
            processes_failed=sum(q.failed for q in per),
            processes_cancelled=sum(q.cancelled for q in per),
            running=sum(running.values()),
            heartbeats=st.heartbeats,
            peers_recycled=st.workers_recycled,
            processes_recycled=st.processes_recycled,
            dead_lettered=st.dead_lettered,
            fences=st.fences_snapshot(),
            heartbeat_seconds=st.heartbeat.snapshot(),
            queues=queues,
            reap_checks=st.reap_checks,
            commands_sent=conn.commands_sent,
            reconnects=conn.reconnects,
            event_reconnects=self._pubsub.reconnects,
            processes_handed_back=sum(q.handed_back for q in st.queues.values()) + st.handed_back,
            processes_moved=sum(q.moved_out for q in st.queues.values()),
            redis_memory=self._memory.info,
        )

    async def start_work(
        self,
        queue: str,
        handler: Handler | None = None,
        *,
        concurrency: int | None = None,
        max_attempts: int | None = None,
        backoff: float | None = None,
        backoff_max: float | None = None,
        balance: bool = True,
        rebalance: bool = True,
        batch_handler: BatchHandler | None = None,
        batch: int = 10,
        capacity: int = 1,
        prefetch: int = 0,
    ) -> None:
        """Serve ``queue``.

        With a ``handler``, the worker claims up to ``concurrency`` tasks at a
        time and runs ``await handler(process)`` for each, in its own cancel
        scope: returning finishes the process (the task leaves the mesh and
        its payload is published on the queue's done channel while a client
        awaits a result of the queue); raising gives
        it back as failed (a one-shot task is retried after ``backoff`` *
        2^(n-1) seconds, capped at ``backoff_max``, and goes to the queue's
        dead letters after ``max_attempts`` failed attempts, crashes of its
        worker included; a persistent task is retried after the same backoff,
        without limit); a cancel of its payload cancels the scope. Without a
        handler, use :meth:`dequeue`, :meth:`finish` and :meth:`give_back`.

        With a ``batch_handler`` instead, the worker runs ``await
        batch_handler(processes)`` on up to ``batch`` processes claimed
        together (fewer when fewer are queued: it never waits to fill a
        batch), each call in a cancel scope of its own, and each process of
        the call finishes or fails on its own: the call returns None (all
        finished) or a sequence with one entry per process, in order: an
        exception instance fails that process (retried, dead-lettered, as
        above), anything else finishes it (bytes, str or None: its result on
        a queue that keeps results). Raising fails every process of the
        call; so does returning anything else (logged). A cancel of one
        process of a running call does not interrupt the call (its other
        processes' work goes on): that process's outcome is dropped (it
        has left the mesh); a cancel of every process of the call cancels
        its scope. A stop (or a rebalance hand-back of one of its processes)
        cancels the call and hands each of its processes back. The queue's
        ``timeout`` limits each call: it fails every process of the call.

        Args:
            concurrency: at most this many processes of this queue at once
                (for persistent tasks: how many this worker may own); with a
                batch handler, batch calls at once are at most this many
                processes together. Default 10, or ``batch`` with a batch
                handler.
            max_attempts: 0 for no limit; default 5. With ``backoff``
                (default 1.0 s) and ``backoff_max`` (default 60.0 s) this is
                the retry policy for a queue that has no policy in Redis:
                then these become its policy (see :meth:`Client.configure`).
                A queue with a policy gets that one; an option given here
                that differs from it is reported with a warning on the
                ``mesh.worker`` logger, and the policy wins. The policy's
                ``timeout`` and ``result_ttl`` apply too. Every worker reads
                the policies of its queues again each heartbeat interval.
            backoff: seconds before the first retry (see ``max_attempts``).
            backoff_max: the longest retry delay.
            balance: claim persistent tasks only up to a fair share, so
                they spread over the peers: the queue's total weight of
                persistent tasks times this worker's ``capacity`` over the
                total capacity of the queue's servers (with every weight and
                capacity 1: ceil(persistent tasks / workers serving the
                queue)), counted against the weight of all this worker's
                processes of the queue (a one-shot one weighs 1). Tasks a
                fair share leaves queued are taken anyway one heartbeat
                interval later if no peer took them.
            rebalance: with ``balance``, also move running persistent tasks
                to even the load out when it changes (peers join or leave,
                tasks are added, weights or capacities change): a worker at
                least one below its share asks the peers above theirs for
                their surplus (by weight), which each hands back once the
                task's handler has exited, reserved for it (see
                :mod:`mesh._balance`). False: this worker never asks (its
                peers may still ask it to hand tasks back).
            batch_handler: serve the queue with this batch handler (not
                with ``handler``).
            batch: with ``batch_handler``, at most this many processes per
                call (at most ``concurrency``).
            capacity: this worker's part of the fair share of the queue, a
                whole number from 1 to 1,000,000 (default 1): a worker of
                capacity 2 is given twice the weight of one of capacity 1.
                Persistent tasks' weights are set by :meth:`Client.ensure`.
                It does not limit how many processes run here (that is
                ``concurrency``).
            prefetch: claim up to this many processes beyond
                ``concurrency`` (default 0: none), so that a slot freed by a
                handler starts the next process at once instead of waiting a
                round trip to Redis for it. A prefetched process is claimed:
                held by this worker (it counts in the queue's running
                processes and in this worker's share, and peers recycle it if
                this worker dies), but its handler waits here for a free slot;
                at most ``concurrency`` handlers still run at once. A cancel
                of a prefetched process that has not started ends it without
                running its handler; a stop hands it back unharmed. While
                every slot runs a persistent task's handler (which may never
                end), nothing is claimed beyond ``concurrency`` and what was
                prefetched is handed back. Plain handlers only (a batch
                handler already takes what is claimed together).

        Raises:
            ConfigError: bad queue name or arguments (both a ``handler`` and
                a ``batch_handler``, ``batch`` < 1 or above
                ``concurrency``, ``prefetch`` < 0 or with a
                ``batch_handler``), or already served.
            TypeError: ``handler`` is not an async callable (an ``async def``
                function, a ``functools.partial`` of one, or an object with
                an ``async def __call__``): a plain ``def`` is refused here,
                before any task runs.
            FencedError, MeshConnectionError: as from Redis.

        On cancellation (or any error) the queue is not served by this object;
        Redis may still list the worker as a server of it until the worker
        leaves, which only affects the fair share.
        """
        if batch_handler is not None:
            if handler is not None:
                raise ConfigError("give a handler or a batch_handler, not both")
            whole("batch", batch, 1)
        explicit: dict[str, Any] = {
            k: v
            for k, v in (
                ("max_attempts", max_attempts),
                ("backoff", backoff),
                ("backoff_max", backoff_max),
            )
            if v is not None
        }
        local = attrs.evolve(QueuePolicy(), **explicit)
        # the same checks as Client.configure (ConfigError): whole numbers,
        # seconds from 0 to ten years, backoff <= backoff_max
        policy_fields(
            max_attempts=local.max_attempts, backoff=local.backoff, backoff_max=local.backoff_max
        )
        cfg = QueueConfig(
            queue,
            handler if batch_handler is None else batch_handler,
            (10 if batch_handler is None else batch) if concurrency is None else concurrency,
            local.max_attempts,
            local.backoff,
            local.backoff_max,
            balance,
            rebalance,
            batch=0 if batch_handler is None else batch,
            capacity=capacity,
            prefetch=prefetch,
        )
        self._check_open()
        async with self._queue_lock:
            if queue in self._queues:
                raise ConfigError(f"queue {queue!r} is served already; stop_work() it first")
            if queue in self._gen.draining:
                raise ConfigError(
                    f"queue {queue!r} is still stopping: handlers that outlived the stop "
                    "grace still run"
                )
            self._queues[queue] = cfg
            try:
                gen = await self._current_generation()
                try:
                    await self._binding.serve(self._conn, gen.id, gen.incarnation, queue, capacity)
                    policy = await self._adopt_policy(gen.id, queue, local, explicit)
                    cfg = self._queues[queue] = cfg.with_policy(policy)
                    await self._start_runner(gen, cfg)
                except (FencedError, RuntimeError) as exc:
                    # RuntimeError: the generation's nursery closed under us
                    # (it ended: fenced, or stopping).
                    fenced = gen.scope.cancel_called or gen is not self._gen
                    if self._lease.closing or (isinstance(exc, FencedError) and not fenced):
                        raise
                    # This identity was fenced meanwhile: the next one serves
                    # the queue (it is in self._queues) and starts its runner.
                    await self._current_generation()
            except BaseException:
                del self._queues[queue]
                raise

    async def stop_work(self, queue: str) -> int:
        """Stop serving ``queue``: cancel its handlers and hand each process
        of it back to the front of the queue (no attempt counted) once its
        handler has exited. The lease is renewed meanwhile, so no peer starts
        a task while its handler here may still run.

        Returns after every handler exited and everything was handed back,
        or after :attr:`stop_grace` seconds at the latest: the handlers still
        running then keep their processes (the worker stays live and keeps
        its lease), and each is handed back as it exits; the queue cannot be
        served again until then.

        Returns:
            How many processes were handed back by the time it returns.
        Raises:
            ConfigError: the queue is not served.
            MeshConnectionError: Redis could not be reached; the handlers are
                stopped already and whatever is still held is handed back when
                the worker leaves (or recycled by peers).
        """
        check_queue(queue)
        self._check_open()
        async with self._queue_lock:
            if queue not in self._queues:
                raise ConfigError(f"queue {queue!r} is not served by this worker")
            del self._queues[queue]
            gen = self._gen
            runner = gen.runners.pop(queue, None)
            if runner is not None and not await runner.stop(self.stop_grace):
                left = runner.stopping_slots()
                log.warning(
                    "queue %s: %d handlers still run %g s after stop_work(); their processes "
                    "are handed back as they exit",
                    queue,
                    len(left),
                    self.stop_grace,
                )
                gen.draining[queue] = runner
                if gen.nursery is not None:
                    gen.nursery.start_soon(self._finish_draining, gen, queue, runner)
                return runner.handed_back
            back = await self._binding.unserve(self._conn, gen.id, queue)
            return back + (runner.handed_back if runner is not None else 0)

    async def _finish_draining(self, gen: Generation, queue: str, runner: QueueRunner) -> None:
        """Unserve ``queue`` once the handlers that outlived stop_work()'s
        grace have exited (retried until Redis answers)."""
        await runner.wait_exited()
        backoff = 0.05
        while True:
            try:
                await self._binding.unserve(self._conn, gen.id, queue)
                break
            except (MeshConnectionError, CommandError) as exc:
                log.debug("queue %s: could not unserve yet: %s", queue, exc)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
        gen.draining.pop(queue, None)

    def running(self) -> list[tuple[Process, float]]:
        """The processes whose handlers run now, each with how long it has
        been running (seconds). Sync: no I/O. During a stop, these are the
        handlers the stop is waiting for."""
        now = trio.current_time()
        gen = self._gen
        return [
            (p, now - started)
            for r in [*gen.runners.values(), *gen.draining.values()]
            for p, started in r.stopping_slots()
        ]

    def stop_time_left(self) -> float | None:
        """Seconds left of :attr:`stop_grace` while the worker is stopping
        (None before). Sync."""
        if self._stop_started is None:
            return None
        return max(0.0, self._stop_started + self.stop_grace - trio.current_time())

    async def dequeue(self, queue: str) -> Process | None:
        """Claim the next task of ``queue``, a queue served without a handler
        (a queue is served by a handler or by hand, not both).

        Returns:
            The new process, or None if the queue is empty.
        Raises:
            ConfigError: the queue is not served, or served by a handler.
            FencedError: the worker's lease is gone (it is rejoining).

        On cancellation or a connection error the claim may have happened
        without the caller seeing it: that process stays held by this worker
        until :meth:`stop_work` or leaving the worker hands it back.
        """
        check_queue(queue)
        self._check_open()
        cfg = self._queues.get(queue)
        if cfg is None:
            raise ConfigError(
                f"queue {queue!r} is not served by this worker; start_work() it first"
            )
        if cfg.handler is not None:
            raise ConfigError(
                f"queue {queue!r} is served by a handler; dequeue() is for queues without one"
            )
        gen = await self._current_generation()
        reply = await self._binding.claim(
            self._conn,
            gen.id,
            gen.incarnation,
            queue,
            1,
            cfg.max_attempts,
            backoff_ms=int(cfg.backoff * 1000),
            backoff_cap_ms=int(cfg.backoff_max * 1000),
            ttl_ms=int(self.timing.ttl * 1000),
            wake=False,
            rate=cfg.rate,
        )
        return reply.processes[0] if reply.processes else None

    async def finish(self, process: Process) -> bool:
        """Report ``process`` as finished: its task leaves the mesh.

        Returns:
            True if it was still this worker's live process; False if it had
            been recycled, cancelled or finished already, or this worker's
            lease is gone (then nothing changed).
        Raises:
            MeshConnectionError: unknown whether it finished; calling again is
                safe (it then returns False if the first call went through).
        """
        self._check_open()
        r = await self._binding.finish(
            self._conn,
            process.worker_id,
            self._incarnation_of(process),
            process.queue,
            [process.id],
        )
        return r[0]

    async def give_back(
        self, process: Process, *, failed: bool = False, error: str | None = None
    ) -> bool:
        """Hand ``process`` back: to the front of its queue, or, with
        ``failed=True``, as a failed attempt (retry after a backoff, or dead
        letter at the queue's attempt limit; ``error``, cut to 2,000
        characters, is kept in the dead-letter record).

        Returns:
            False if it was no longer this worker's process (nothing changed).
        Raises:
            MeshConnectionError: unknown whether it was handed back; calling
                again is safe.
        """
        self._check_open()
        cfg = self._queues.get(process.queue)
        backoff, cap = (cfg.backoff, cfg.backoff_max) if cfg else (1.0, 60.0)
        r = await self._binding.give_back(
            self._conn,
            process.worker_id,
            process.queue,
            [process.id],
            failed=failed,
            backoff_ms=int(backoff * 1000),
            backoff_cap_ms=int(cap * 1000),
            errors=[error[:2000]] if failed and error else None,
        )
        return r[0][0] != 0

    # --- internals -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise ClosedError("this worker is stopped")

    def _incarnation_of(self, process: Process) -> str:
        return self._gen.incarnation if process.worker_id == self._gen.id else ""

    async def _current_generation(self) -> Generation:
        return await self._lease.current()

    async def _start_runners(self, gen: Generation) -> None:
        if gen.nursery is not None and self._housekeeping:
            # the job-queue housekeeping of this generation, one round trip
            # per heartbeat interval: fire periodic tasks, and re-read the
            # policies of the served queues (a fleet's worker: the fleet's)
            watch = PolicyWatch(self._keys.policy, gen.runners, self._apply_policy)
            gen.nursery.start_soon(
                run_scheduler, self._conn, self._binding, self.timing.interval, watch
            )
            # the per-minute counts of the dashboard's charts, every few seconds
            gen.nursery.start_soon(self._counts.run)
        for cfg in list(self._queues.values()):
            await self._start_runner(gen, cfg)

    async def _start_runner(self, gen: Generation, cfg: QueueConfig) -> None:
        if cfg.handler is None or gen.nursery is None:
            return
        runner = QueueRunner(
            self._conn,
            self._binding,
            gen.id,
            gen.incarnation,
            cfg,
            self._stats.queue(cfg.queue),
            gen.fence,
            balance_wait=self.timing.interval,
            ttl=self.timing.ttl,
            early_cancels=gen.early_cancels,
            replicate=self._replicate if self.min_replicas else None,
        )
        gen.runners[cfg.queue] = runner
        await gen.nursery.start(runner.run)

    async def _adopt_policy(
        self, wid: str, queue: str, local: QueuePolicy, explicit: dict[str, Any]
    ) -> QueuePolicy:
        """The queue's stored policy; ``local`` (the start_work options) is
        stored first if the queue has none. Options given explicitly that the
        stored policy overrides are reported (a warning), not mixed in."""
        fields = policy_fields(
            max_attempts=local.max_attempts, backoff=local.backoff, backoff_max=local.backoff_max
        )
        raw = await self._binding.configure(self._conn, queue, "default", f"worker {wid}", fields)
        assert raw is not None
        policy = parse_policy(raw, queue)
        diff = differences(policy, explicit)
        if diff:
            log.warning(
                "queue %s: start_work options %s are overridden by the queue's policy (set by %s)",
                queue,
                ", ".join(diff),
                policy.source or "configure",
            )
        return policy

    def _apply_policy(self, queue: str, policy: QueuePolicy) -> None:
        """A policy read from Redis: the runner of ``queue`` uses it from now on."""
        cfg = self._queues.get(queue)
        if cfg is None:
            return
        new = cfg.with_policy(policy)
        if new == cfg:
            return
        self._queues[queue] = new
        runner = self._gen.runners.get(queue)
        if runner is not None:
            runner.config = new
        log.info("queue %s: applying the queue's policy %s", queue, policy)

    async def _replicate(self) -> None:
        """With ``min_replicas``: wait (up to R) until that many replicas have
        every write made so far; MeshConnectionError if they do not."""
        await self._conn.wait_replicas(self.min_replicas, self.timing.fence_after)

    def _cancel_process(self, pid: str) -> None:
        gen = self._gen
        for runner in gen.runners.values():
            if runner.cancel_process(pid):
                return
        gen.early_cancels[pid] = trio.current_time()

    async def _listen(self) -> None:
        expired, wake, cancel = await subscribe_expiry(self._pubsub, self._conn, self._keys)
        async for msg in self._pubsub:
            self._dispatch(msg, expired, wake, cancel)

    def _dispatch(self, msg: Message, expired: bytes, wake: bytes, cancel: bytes) -> None:
        if msg.kind == "reconnected":
            # We may have missed anything: look at the durable state again.
            for runner in self._gen.runners.values():
                runner.nudge()
            self._reaper.wake()
            return
        ch = msg.channel
        if ch.startswith(wake):
            # Redis took us out of the queue's idle set to wake us: claim.
            if ch[len(wake) :].decode() == self._gen.id:
                target = self._gen.runners.get(msg.data.decode())
                if target is not None:
                    target.nudge()
        elif ch.startswith(cancel):
            if ch[len(cancel) :].decode() == self._gen.id:
                self._cancel_process(msg.data.decode())
        elif ch == expired:
            if self._keys.parse_heartbeat_key(msg.data) is not None:
                self._reaper.heard_expiry()

    async def _leave(self) -> None:
        """The end of the worker's block: :meth:`_close`, shielded (it runs to
        its end while the block is being cancelled too), then the worker and
        its client refuse further calls."""
        with trio.CancelScope(shield=True):
            await self._close()
        self._closed = True
        self.client._closed = True

    async def _close(self) -> None:
        """Cancel every handler and keep the lease while they exit, at most
        :attr:`stop_grace`: each process is handed back once its handler has
        exited. Then stop the heartbeat and retire (hand back whatever is
        left, delete the lease). Handlers still running after the grace keep
        their processes: the lease is no longer renewed, and peers recycle
        them when it runs out (T later, counted as a crash)."""
        self._closing = True
        self._lease.closing = True  # a fence during the stop retires, no rejoin
        self._stop_started = trio.current_time()
        gen = self._gen
        runners = [*gen.runners.values(), *gen.draining.values()]
        for r in runners:
            r.keep_ms = int(self.rejoin_grace * 1000)
            r.begin_stop()
        with trio.move_on_after(self.stop_grace):
            for r in runners:
                await r.wait_exited()
        left = self.running()
        if left:
            log.warning(
                "worker %s: %d handlers still run after the stop grace of %g s (%s); "
                "the lease is no longer renewed: peers take their tasks over when it "
                "runs out, counting a failed attempt",
                gen.id,
                len(left),
                self.stop_grace,
                ", ".join(f"{p.queue} token {p.token}" for p, _ in left[:10]),
            )
        self._lease.close()
        with trio.move_on_after(self.timing.ttl + 1):
            await self._lease.stopped.wait()


@asynccontextmanager
async def open_worker(
    url: str | RedisConfig = "redis://127.0.0.1:6379",
    *,
    namespace: str = "mesh",
    ttl: float = 3.0,
    heartbeat_interval: float | None = None,
    fence_after: float | None = None,
    worker_id: str | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    stop_grace: float = 10.0,
    rejoin_grace: float = 0.0,
    min_replicas: int | None = None,
) -> AsyncIterator[Worker]:
    """Join the mesh ``namespace`` at ``url`` as a worker.

    Registers a lease (a heartbeat key with TTL ``ttl``), then runs the
    heartbeat (every ``heartbeat_interval``, default ttl/3), self-fencing
    (every handler is cancelled if no heartbeat was confirmed for
    ``fence_after``, default 2*ttl/3), the peer supervisor and the event
    listener, all inside this block. Serve queues with
    :meth:`Worker.start_work`.

    Leaving the block (normally, by an exception, or by cancellation) cancels
    every handler and keeps renewing the lease while they exit; each process
    is handed back to the front of its queue (no attempt counted) once its
    handler has exited, and idle peers are woken, so peers take over at once
    but never while the old handler may still run.

    Args:
        worker_id: default ``<host>-<pid>-<random>``. Must not be in use.
        min_replicas: confirm writes with ``WAIT``: a lease renewal counts only
            once this many replicas have it, a persistent task's handler starts
            only once its claim is on them, and the worker's client returns from
            ``enqueue``/``ensure`` only then (see docs/guarantees.md). Default:
            the URL's ``min_replicas`` query parameter, else 0 (no waiting).
        stop_grace: how long leaving (and :meth:`Worker.stop_work`) waits for
            cancelled handlers to exit (a shielded cleanup), in seconds,
            default 10. A handler still running after it keeps its process:
            the lease is then no longer renewed, and peers recycle the
            process when the lease runs out (T later), counting a failed
            attempt, as after a crash. Leaving the block still waits for
            such a handler (trio cannot abandon a trio task).
        rejoin_grace: a sticky restart (off by default, 0): leaving keeps
            this worker's persistent tasks reserved for ``worker_id`` for
            this many seconds instead of handing them to peers; a worker that
            joins under the same id within it gets them back (new processes,
            new tokens), and after it they go to anyone. The trade-off: those
            tasks are unowned for the length of the restart, rather than
            moving to a peer and back. Needs an explicit ``worker_id``.

    Raises:
        ConfigError: bad URL, namespace, worker id or timing (nothing started),
            or the worker id is in use; called outside trio (from asyncio, say).
        MeshConnectionError: Redis cannot be reached at start.
        ProtocolError: the namespace holds data of another protocol version.
    """
    require_trio("mesh.open_worker")
    config = parse_url(url) if isinstance(url, str) else url
    keys = Keys(namespace)
    timing = LeaseTiming.make(ttl, heartbeat_interval, fence_after)
    replicas = check_min_replicas(config, min_replicas)
    worker_id = worker_options(worker_id, stop_grace, rejoin_grace)
    # A half-open socket must not hold a fenced worker's hand-back forever.
    reply_timeout = max(2 * timing.ttl, 5.0)
    # One topology for both connections: they follow the master together (key-expiry
    # events are node-local). "Not executed here" replies are retried within R.
    topology = Topology(config, route_key=keys.prefix, epoch_key=keys.epoch)
    async with open_connection(
        config,
        name=f"mesh-worker:{worker_id}",
        reply_timeout=reply_timeout,
        topology=topology,
        reroute_timeout=timing.fence_after,
        # its writes are fenced by Redis (the lease's incarnation)
        direct_writes=True,
    ) as conn:
        await check_server(conn)
        # The event link only speeds things up: every H the heartbeat brings
        # the durable state (work, cancels, overdue leases) anyway. Probing it
        # every T, not every second, is enough, and 1,000 idle workers then
        # cost Redis 1,000 / T pings a second, not 1,000. At most every 30 s:
        # with long leases H is long too, and a dead link would cost that.
        ping = min(max(1.0, timing.ttl), 30.0)
        name = f"mesh-events:{worker_id}"
        async with open_pubsub(config, name=name, ping_interval=ping, topology=topology) as pubsub:
            worker = Worker(
                conn, pubsub, keys, timing, worker_id, max_payload, stop_grace, rejoin_grace
            )
            worker.min_replicas = worker.client.min_replicas = replicas
            worker._lease.min_replicas = replicas
            reaper = worker._reaper
            try:
                async with trio.open_nursery() as nursery:
                    # Shielded from cancellations of the caller's scopes: a
                    # block cancelled from outside still stops as described
                    # above (lease renewed, handlers cancelled in groups, each
                    # process handed back after its handler exited).
                    tasks = ShieldedTasks(nursery)
                    try:
                        tasks.start_soon(worker._listen)
                        tasks.start_soon(functools.partial(watch_memory, conn, worker._memory))
                        await tasks.start(worker._lease.run)
                        await tasks.start(reaper.run)
                        try:
                            yield worker
                        finally:
                            await worker._leave()
                    finally:
                        tasks.cancel()
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as eg:
                raise_single(eg)


def worker_options(worker_id: str | None, stop_grace: float, rejoin_grace: float) -> str:
    """Check a worker's options (see :func:`open_worker`); returns its id
    (a new ``<host>-<pid>-<random>`` if None).

    Raises:
        ConfigError: a bad id, grace, or rejoin_grace without an id.
    """
    seconds("stop_grace", stop_grace)
    seconds("rejoin_grace", rejoin_grace)
    if rejoin_grace > 0 and worker_id is None:
        raise ConfigError("rejoin_grace needs a stable worker_id: the one the worker rejoins as")
    if worker_id is None:
        host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:60]
        worker_id = f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"
    check_worker_id(worker_id)
    return worker_id


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
