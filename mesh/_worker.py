"""The worker: one peer of the mesh, a member of a host (:mod:`mesh._host`).

A worker runs, inside its own nursery, its **lease** (:mod:`mesh._lease`):
one identity at a time, with the heartbeat that renews it (through its
host's driver, :mod:`mesh._renewals`) and fans its reply out to the runners,
self-fencing, and rejoining under a new identity after a fence; and one
**runner** per queue served with a handler (:mod:`mesh._served`,
:mod:`mesh._runner`). Its host owns what the workers of one process share:
the connections, the listener for pub/sub nudges (a wake, a cancel, a key
expiry; only a nudge: the heartbeat reply carries the durable cancel inbox
and which queues have work, and a reconnect triggers a full re-check), the
reaper that recycles dead peers, the scheduler and the policy reader.
:func:`open_worker` is a host of one; :func:`join` makes a worker a member
of any host (a fleet's too, :mod:`mesh._fleet`).

Leaving :func:`open_worker` cancels every handler and keeps renewing the
lease while they exit (at most ``stop_grace``): each process is handed back
to the front of its queue, with no attempt counted, once its handler has
exited, and idle peers are woken, so a peer takes over at once but never
while the old handler may still run (invariant 10).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import anyio
import attrs

from ._client import DEFAULT_MAX_PAYLOAD, Client
from ._diskless import warn_diskless_delay
from ._errors import (
    ClosedError,
    ConfigError,
    raise_single,
)
from ._host import Host, Member, default_name, open_host
from ._keys import Keys, check_queue, check_worker_id
from ._lease import Generation, Lease, LeaseTiming
from ._loop import require_loop
from ._memory import MemoryInfo
from ._queue_config import served_options
from ._runner import BatchHandler, Handler
from ._served import Served
from ._shielded import ShieldedTasks
from ._stats import Histogram, QueueStatistics
from ._types import Process
from ._url import RedisConfig, check_min_replicas, coerce_config
from ._validate import seconds

__all__ = [
    "LeaseTiming",
    "Worker",
    "WorkerStatistics",
    "join",
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
        host: Host,
        base_id: str,
        max_payload: int,
        stop_grace: float = 10.0,
        rejoin_grace: float = 0.0,
    ) -> None:
        self._host = host
        self._conn = host.conn
        self._pubsub = host.pubsub
        self._keys = host.keys
        self._binding = host.binding
        self._reaper = host.reaper
        self.timing = host.timing
        self.min_replicas = host.min_replicas
        self.stop_grace = stop_grace
        """How long a stop waits for handlers to exit (seconds)."""
        self.rejoin_grace = rejoin_grace
        """How long this worker's persistent tasks wait for it after it
        leaves (seconds; 0: not at all)."""
        self._stop_started: float | None = None
        self._base_id = base_id
        self._closing = False
        self._closed = False
        self._stats = host.member_stats()
        self._lease = Lease(
            host.conn,
            host.pubsub,
            host.binding,
            host.timing,
            base_id,
            host.reaper,
            queues=lambda: self._served.configs,
            start_runners=lambda gen: self._served.start_runners(gen),
            cancel_process=lambda pid: self._served.cancel_process(pid),
            recorder=self._stats,
            driver=host.renewals,
            capacity=lambda q: self._served.capacity(q),
        )
        self._served = Served(host, self._lease, self._stats)
        self._queues = self._served.configs  # the queues served now
        self._member = Member(
            self._lease, self._served.cancel_process, self._served.apply_policy, self._stats
        )
        self.client = Client(
            host.conn, host.keys, min_replicas=host.min_replicas, max_payload=max_payload
        )
        """A :class:`Client` on this worker's connection."""

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
        self._gen.check(self.timing.fence_after, process)

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
            redis_memory=self._host.memory.info,
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
        prefetch: int | None = None,
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
                ``concurrency``, so that a slot freed by a handler starts the
                next process at once instead of waiting a round trip to Redis
                for it. The default, None, adapts: while handlers take no
                more than about two claim round trips and the queue has a
                backlog, up to ``concurrency`` more are claimed (the next
                claim is in flight while the current batch runs); none once
                handlers are long or the queue is empty, and while every slot
                runs a handler that has run a few round trips, what waits
                here is handed back. 0: never; n: always up to n (a handler
                that runs long then holds up to n processes that a peer
                could run). A prefetched process is claimed:
                held by this worker (it counts in the queue's running
                processes and in this worker's share, and peers recycle it if
                this worker dies), but its handler waits here for a free slot;
                at most ``concurrency`` handlers still run at once. A cancel
                of a prefetched process that has not started ends it without
                running its handler; a stop hands it back unharmed. While
                every slot runs a persistent task's handler (which may never
                end), nothing is claimed beyond ``concurrency`` and what was
                prefetched is handed back. A number is for plain handlers
                only (a batch handler already takes what is claimed
                together; with one, the default claims nothing beyond).

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
        retry = {"max_attempts": max_attempts, "backoff": backoff, "backoff_max": backoff_max}
        cfg, local, explicit = served_options(
            queue,
            handler,
            batch_handler,
            concurrency,
            batch,
            retry,
            balance=balance,
            rebalance=rebalance,
            capacity=capacity,
            prefetch=prefetch,
        )
        self._check_open()
        await self._served.start(cfg, local, explicit)

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
        return await self._served.stop(queue, self.stop_grace)

    def running(self) -> list[tuple[Process, float]]:
        """The processes whose handlers run now, each with how long it has
        been running (seconds). Sync: no I/O. During a stop, these are the
        handlers the stop is waiting for."""
        return self._served.running()

    def stop_time_left(self) -> float | None:
        """Seconds left of :attr:`stop_grace` while the worker is stopping
        (None before). Sync."""
        if self._stop_started is None:
            return None
        return max(0.0, self._stop_started + self.stop_grace - anyio.current_time())

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
        return await self._served.claim_one(queue)

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
        return await self._served.finish(process)

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
        return await self._served.give_back(process, failed, error)

    # --- internals -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise ClosedError("this worker is stopped")

    async def _current_generation(self) -> Generation:
        return await self._lease.current()

    async def _leave(self) -> None:
        """The end of the worker's block: :meth:`_close`, shielded (it runs to
        its end while the block is being cancelled too), then the worker and
        its client refuse further calls."""
        with anyio.CancelScope(shield=True):
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
        self._stop_started = anyio.current_time()
        gen = self._gen
        runners = self._served.runners()
        for r in runners:
            r.keep_ms = int(self.rejoin_grace * 1000)
            r.begin_stop()
        with anyio.move_on_after(self.stop_grace):
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
        with anyio.move_on_after(self.timing.ttl + 1):
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
    require_loop("mesh.open_worker")
    config = coerce_config(url)
    keys = Keys(namespace)
    timing = LeaseTiming.make(ttl, heartbeat_interval, fence_after)
    replicas = check_min_replicas(config, min_replicas)
    worker_id = worker_options(worker_id, stop_grace, rejoin_grace)
    # a host of one: its own connections, reaper, scheduler and heartbeat loop
    opened = open_host(config, keys, timing, worker_id, min_replicas=replicas, of_one=True)
    async with opened as host, join(host, worker_id, max_payload, stop_grace, rejoin_grace) as w:
        await warn_diskless_delay(host.conn, replicas, f"worker {w.id}")
        yield w


@asynccontextmanager
async def join(
    host: Host, worker_id: str, max_payload: int, stop_grace: float, rejoin_grace: float
) -> AsyncIterator[Worker]:
    """Join the mesh as a worker, a member of ``host``, for the length of
    this block: register (errors propagate), serve, and leave as
    :func:`open_worker` says. Its lease runs shielded from the caller's
    cancellations: a block cancelled from outside still keeps the lease
    while its handlers exit and hands each process back after its handler
    exited.

    Raises:
        ClosedError: the host is closed.
        ConfigError, MeshConnectionError: the registration failed.
    """
    worker = Worker(host, worker_id, max_payload, stop_grace, rejoin_grace)
    host.add(worker._member)
    try:
        async with anyio.create_task_group() as nursery:
            tasks = ShieldedTasks(nursery)
            try:
                await tasks.start(worker._lease.run)
                host.registered()
                try:
                    yield worker
                finally:
                    await worker._leave()
            finally:
                tasks.cancel()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as eg:
        raise_single(eg)
    finally:
        host.remove(worker._member)


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
        worker_id = default_name()
    check_worker_id(worker_id)
    return worker_id
