"""The worker: one peer of the mesh.

A worker runs, inside its own nursery:

* a **generation**: one identity (worker id + incarnation) with its lease.
  The generation's trio tasks (the heartbeat and one runner per served queue,
  with every handler) live in one cancel scope whose *deadline* is the
  self-fence deadline: the time the last confirmed heartbeat was sent plus R.
  Each confirmed heartbeat pushes the deadline on; if none is confirmed in
  time, trio itself cancels every handler at R, before peers may take over at
  T (R < T). A heartbeat that finds the lease gone or superseded cancels the
  scope at once. Either way the worker then retires the old identity (hands
  back what it still holds) and registers a new one: a fenced identity is
  never revived.
* a **reaper** (:mod:`mesh._supervisor`) that recycles dead peers.
* a **listener** for pub/sub nudges: a wake (a queue it serves has tasks
  and Redis took it out of the queue's idle set), cancel of a process, key
  expiry (a peer died). Pub/sub is only a nudge: the heartbeat reply
  carries the durable cancel inbox and which queues have work, and a
  reconnect triggers a full re-check.

Leaving :func:`open_worker` cancels every handler, waits for them to exit,
then hands every process back to the front of its queue in one script and
wakes idle peers, so a peer takes over at once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

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
from ._keys import Keys, check_queue, check_worker_id
from ._pubsub import Message, PubSub, open_pubsub
from ._runner import Handler, QueueConfig, QueueRunner, check_handler
from ._scripts import Binding
from ._stats import Histogram, QueueStatistics, Recorder
from ._supervisor import Reaper
from ._topology import Topology
from ._types import Process
from ._url import RedisConfig, parse_url

__all__ = ["LeaseTiming", "Worker", "WorkerStatistics", "open_worker"]

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
        if not isinstance(ttl, int | float) or isinstance(ttl, bool):
            raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
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


class _Generation:
    """One identity of the worker."""

    def __init__(self, worker_id: str, number: int) -> None:
        self.id = worker_id
        self.number = number
        self.incarnation = secrets.token_hex(8)
        self.scope = trio.CancelScope()
        self.runners: dict[str, QueueRunner] = {}
        self.nursery: trio.Nursery | None = None
        self.fence_reason: str | None = None
        self.beat = trio.Event()
        # Cancels of process ids no runner knew yet (a claim reply still on
        # its way): id -> when it came. A runner that then claims the id does
        # not start it. Pruned after the TTL.
        self.early_cancels: dict[str, float] = {}

    def fence(self, reason: str) -> None:
        if self.fence_reason is None:
            self.fence_reason = reason
        self.scope.cancel()


class Worker:
    """One peer of the mesh. Get one from :func:`open_worker`."""

    def __init__(
        self,
        conn: Connection,
        pubsub: PubSub,
        keys: Keys,
        timing: LeaseTiming,
        base_id: str,
        max_payload: int,
    ) -> None:
        self._conn = conn
        self._pubsub = pubsub
        self._keys = keys
        self._binding = Binding(keys)
        self.timing = timing
        self._base_id = base_id
        self._queues: dict[str, QueueConfig] = {}
        self._gen = _Generation(base_id, 1)
        self._gen_ready = trio.Event()
        self._closing = False
        self._closed = False
        self._stopped = trio.Event()
        self._stats = Recorder()
        self._ids = {base_id}  # every identity this worker has had
        self._reconnects_seen = -1  # the connection's count at the last heartbeat
        self._reaper = Reaper(
            conn,
            self._binding,
            ttl=timing.ttl,
            queues=lambda: self._queues,
            own=lambda: self._ids,
            me=lambda: f"worker {self._gen.id}",
            recorder=self._stats,
        )
        self._queue_lock = trio.Lock()
        self.client = Client(conn, keys, max_payload=max_payload)
        """A :class:`Client` on this worker's connection."""

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
        )

    async def start_work(
        self,
        queue: str,
        handler: Handler | None = None,
        *,
        concurrency: int = 10,
        max_attempts: int = 5,
        backoff: float = 1.0,
        backoff_max: float = 60.0,
        balance: bool = True,
    ) -> None:
        """Serve ``queue``.

        With a ``handler``, the worker claims up to ``concurrency`` tasks at a
        time and runs ``await handler(process)`` for each, in its own cancel
        scope: returning finishes the process (the task leaves the mesh and
        its payload is published on the queue's done channel); raising gives
        it back as failed (a one-shot task is retried after ``backoff`` *
        2^(n-1) seconds, capped at ``backoff_max``, and goes to the queue's
        dead letters after ``max_attempts`` failed attempts, crashes of its
        worker included; a persistent task is retried after the same backoff,
        without limit); a cancel of its payload cancels the scope. Without a
        handler, use :meth:`dequeue`, :meth:`finish` and :meth:`give_back`.

        Args:
            concurrency: at most this many processes of this queue at once
                (for persistent tasks: how many this worker may own).
            max_attempts: 0 for no limit.
            balance: claim persistent tasks only up to a fair share
                (ceil(persistent tasks / workers serving the queue), counted
                against all this worker's processes of the queue), so they
                spread over the peers. Tasks a fair share leaves queued are
                taken anyway one heartbeat interval later if no peer took
                them. Live processes are never moved to rebalance.

        Raises:
            ConfigError: bad queue name or arguments, or already served.
            TypeError: ``handler`` is not an async callable (an ``async def``
                function, a ``functools.partial`` of one, or an object with
                an ``async def __call__``): a plain ``def`` is refused here,
                before any task runs.
            FencedError, MeshConnectionError: as from Redis.

        On cancellation (or any error) the queue is not served by this object;
        Redis may still list the worker as a server of it until the worker
        leaves, which only affects the fair share.
        """
        check_queue(queue)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"concurrency must be a whole number >= 1, got {concurrency!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 0:
            raise ConfigError(f"max_attempts must be a whole number >= 0, got {max_attempts!r}")
        if not (0 <= backoff <= backoff_max):
            raise ConfigError(f"need 0 <= backoff <= backoff_max, got {backoff!r}, {backoff_max!r}")
        if handler is not None:
            check_handler(handler)
        self._check_open()
        async with self._queue_lock:
            if queue in self._queues:
                raise ConfigError(f"queue {queue!r} is served already; stop_work() it first")
            cfg = QueueConfig(
                queue, handler, concurrency, max_attempts, backoff, backoff_max, balance
            )
            self._queues[queue] = cfg
            try:
                gen = await self._current_generation()
                await self._binding.serve(self._conn, gen.id, gen.incarnation, queue)
                await self._start_runner(gen, cfg)
            except BaseException:
                del self._queues[queue]
                raise

    async def stop_work(self, queue: str) -> int:
        """Stop serving ``queue``: cancel its handlers, wait for them to exit,
        and hand every process of it back to the front of the queue.

        Returns:
            How many processes were handed back.
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
            if runner is not None:
                await runner.stop()
            return await self._binding.unserve(self._conn, gen.id, queue)

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

    async def give_back(self, process: Process, *, failed: bool = False) -> bool:
        """Hand ``process`` back: to the front of its queue, or, with
        ``failed=True``, as a failed attempt (retry after a backoff, or dead
        letter at the queue's attempt limit).

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
        )
        return r[0][0] != 0

    # --- internals -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise ClosedError("this worker is stopped")

    def _incarnation_of(self, process: Process) -> str:
        return self._gen.incarnation if process.worker_id == self._gen.id else ""

    async def _current_generation(self) -> _Generation:
        await self._gen_ready.wait()
        return self._gen

    async def _start_runner(self, gen: _Generation, cfg: QueueConfig) -> None:
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
        )
        gen.runners[cfg.queue] = runner
        await gen.nursery.start(runner.run)

    def _cancel_process(self, pid: str) -> None:
        gen = self._gen
        for runner in gen.runners.values():
            if runner.cancel_process(pid):
                return
        gen.early_cancels[pid] = trio.current_time()

    async def _register(self, gen: _Generation, *, first: bool) -> float:
        """Join the mesh as ``gen``. The first time, errors propagate (a bad
        id, an unreachable Redis). When rejoining after a fence, every
        expected error is retried with backoff, under a fresh id where the
        old one may be taken, until it works or the worker is closed.

        Returns:
            When the attempt that worked was sent: the new lease's fence
            deadline counts from then, not from the first, failed attempts."""
        backoff = 0.05
        tries = 0
        while True:
            sent = trio.current_time()
            try:
                # Measure from a live connection: an attempt that first waited
                # for a reconnect would start its fence deadline too early.
                await self._conn.execute("PING")
                sent = trio.current_time()
                await self._join(gen)
                return sent
            except (MeshConnectionError, CommandError, FencedError, ConfigError) as exc:
                if first:
                    raise
                if self._closing:
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
                    self._ids.add(gen.id)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.timing.interval)

    async def _join(self, gen: _Generation) -> None:
        host, pid = socket.gethostname(), os.getpid()
        info = json.dumps({"host": host, "pid": pid, "started": 0}).encode()
        now = await self._binding.register(
            self._conn, gen.id, gen.incarnation, int(self.timing.ttl * 1000), info
        )
        # when it started, by the Redis clock
        info = json.dumps({"host": host, "pid": pid, "started": now / 1000}).encode()
        await self._conn.execute("HSET", self._keys.info, gen.id, info)
        for q in list(self._queues):
            await self._binding.serve(self._conn, gen.id, gen.incarnation, q)
        try:
            await self._pubsub.subscribe(
                self._keys.cancel_channel(gen.id), self._keys.wake_channel(gen.id)
            )
        except MeshConnectionError:
            pass  # it stays registered and is subscribed on the reconnect

    async def _retire(self, gen: _Generation) -> None:
        """Hand back what ``gen`` still holds and remove it; retried until Redis
        answers, for at most the TTL (then peers recycle what is left after T),
        or until cancelled."""
        backoff = 0.05
        with trio.move_on_after(self.timing.ttl) as bounded:
            while True:
                try:
                    r = await self._binding.recycle(
                        self._conn,
                        gen.id,
                        leave=True,
                        incarnation=gen.incarnation,
                        queues=self._queues,
                    )
                    if r.returned:
                        log.info("worker %s handed back %d processes", gen.id, r.returned)
                    break
                except FencedError:
                    break  # superseded by someone else: nothing of ours to hand back
                except (MeshConnectionError, CommandError) as exc:
                    log.debug("worker %s could not hand back yet: %s", gen.id, exc)
                    await trio.sleep(backoff)
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

    async def _heartbeat_loop(self, gen: _Generation) -> None:
        t = self.timing
        ttl_ms = int(t.ttl * 1000)
        acks: list[str] = []
        # Renew a little early, at random (never late: R counts from the last
        # confirmed renewal), so that peers started together do not renew in
        # lockstep: their heartbeats are the reapers' backstop, and a
        # mesh-wide burst of them would wake every reaper at once.
        spread = 0.5
        trouble_since: float | None = None  # the first unanswered heartbeat
        while True:
            sent = trio.current_time()
            queues = list(gen.runners)
            reply = None
            try:
                with trio.move_on_after(t.fence_after):
                    reply = await self._binding.heartbeat(
                        self._conn, gen.id, gen.incarnation, ttl_ms, acks, queues
                    )
            except FencedError as exc:
                gen.fence(str(exc))
                return
            except (MeshConnectionError, CommandError) as exc:
                # Retried until it works or the fence deadline passes (an OOM
                # Redis refuses the lease renewal: we fence, we do not crash).
                # Said once per outage, not once per try.
                what = "Redis unreachable" if isinstance(exc, MeshConnectionError) else "refused"
                if trouble_since is None:
                    trouble_since = sent
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
                await trio.sleep(min(t.interval / 4, 0.25))
                continue
            if reply is None:
                continue
            if trouble_since is not None:
                log.info(
                    "worker %s: heartbeat confirmed again, %.1f s after the first that failed",
                    gen.id,
                    sent - trouble_since,
                )
                trouble_since = None
            reconnects = self._conn.statistics().reconnects
            if reconnects > self._reconnects_seen:
                if self._reconnects_seen >= 0:
                    log.info("worker %s: the connection to Redis was lost and is back", gen.id)
                self._reconnects_seen = reconnects
            self._stats.heartbeats += 1
            self._stats.heartbeat.observe(trio.current_time() - sent)
            gen.scope.deadline = sent + t.fence_after
            acks = list(reply.inbox)
            for pid in acks:
                self._cancel_process(pid)
            stale = sent - t.ttl
            for pid, at in list(gen.early_cancels.items()):
                if at < stale:
                    del gen.early_cancels[pid]
            per_queue = zip(
                queues,
                reply.queue_states,
                reply.held,
                reply.idle,
                reply.idle_servers,
                strict=True,
            )
            for q, state, held, idle, idle_servers in per_queue:
                runner = gen.runners.get(q)
                if runner is None:
                    continue
                runner.check_held(held)
                runner.check_idle(idle)
                if state == 0:
                    runner.nudge()
                elif state > 0:
                    runner.retry_due(reply.now_ms + state, state / 1000, idle_servers)
            if reply.next_deadline_ms <= 0:
                self._reaper.deadline_passed(-reply.next_deadline_ms / 1000)
            gen.beat.set()
            gen.beat = trio.Event()
            await trio.sleep_until(sent + t.interval * (1 - spread * random.random()))
            spread = 0.05

    async def _run_generations(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        gen = self._gen
        first = True
        previous = ""
        try:
            while True:
                sent = await self._register(gen, first=first)
                if first:
                    task_status.started()
                    first = False
                elif not self._closing:
                    log.info("worker %s rejoined the mesh as %s", previous, gen.id)
                fenced = False
                try:
                    gen.scope.deadline = sent + self.timing.fence_after
                    if self._closing:
                        gen.scope.cancel()
                    with gen.scope:
                        async with trio.open_nursery() as nursery:
                            gen.nursery = nursery
                            nursery.start_soon(self._heartbeat_loop, gen)
                            for cfg in list(self._queues.values()):
                                await self._start_runner(gen, cfg)
                            self._gen_ready.set()
                            await trio.sleep_forever()
                    fenced = not self._closing
                finally:
                    self._gen_ready = trio.Event()
                    if not fenced:
                        # Closing, or an error or cancellation is on its way
                        # out: hand everything back before going.
                        with trio.move_on_after(self.timing.ttl) as cs:
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
                await self._retire(gen)
                if self._closing:
                    return
                previous = gen.id
                gen = self._gen = _Generation(
                    f"{self._base_id}.{secrets.token_hex(3)}", gen.number + 1
                )
                self._ids.add(gen.id)
        finally:
            self._stopped.set()

    async def _listen(self) -> None:
        k = self._keys
        expired = f"__keyevent@{self._conn.config.db}__:expired".encode()
        wake = k.wake_prefix.encode()
        cancel = k.cancel_prefix.encode()
        try:
            await self._pubsub.subscribe(expired)
        except MeshConnectionError:
            pass  # subscribed on the reconnect
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

    async def _close(self) -> None:
        """Cancel every handler, wait for them to exit, hand everything back
        (bounded by the TTL: after that, peers recycle what is left)."""
        self._closing = True
        self._gen.scope.cancel()
        with trio.move_on_after(self.timing.ttl + 1):
            await self._stopped.wait()


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
) -> AsyncIterator[Worker]:
    """Join the mesh ``namespace`` at ``url`` as a worker.

    Registers a lease (a heartbeat key with TTL ``ttl``), then runs the
    heartbeat (every ``heartbeat_interval``, default ttl/3), self-fencing
    (every handler is cancelled if no heartbeat was confirmed for
    ``fence_after``, default 2*ttl/3), the peer supervisor and the event
    listener, all inside this block. Serve queues with
    :meth:`Worker.start_work`.

    Leaving the block (normally, by an exception, or by cancellation) cancels
    every handler, waits for them to exit, then hands every process back to
    the front of its queue and wakes idle peers, so peers take over at once.

    Args:
        worker_id: default ``<host>-<pid>-<random>``. Must not be in use.

    Raises:
        ConfigError: bad URL, namespace, worker id or timing (nothing started),
            or the worker id is in use.
        MeshConnectionError: Redis cannot be reached at start.
        ProtocolError: the namespace holds data of another protocol version.
    """
    config = parse_url(url) if isinstance(url, str) else url
    keys = Keys(namespace)
    timing = LeaseTiming.make(ttl, heartbeat_interval, fence_after)
    if worker_id is None:
        host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())[:60]
        worker_id = f"{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"
    check_worker_id(worker_id)
    # A half-open socket must not hold a fenced worker's hand-back forever.
    reply_timeout = max(2 * timing.ttl, 5.0)
    # One topology for both connections: they follow the master together (key-expiry
    # events are node-local). "Not executed here" replies are retried within R.
    topology = Topology(config, route_key=keys.prefix)
    async with open_connection(
        config,
        name=f"mesh-worker:{worker_id}",
        reply_timeout=reply_timeout,
        topology=topology,
        reroute_timeout=timing.fence_after,
    ) as conn:
        await _check_server(conn)
        # The event link only speeds things up: every H the heartbeat brings
        # the durable state (work, cancels, overdue leases) anyway. Probing it
        # every T, not every second, is enough, and 1,000 idle workers then
        # cost Redis 1,000 / T pings a second, not 1,000. At most every 30 s:
        # with long leases H is long too, and a dead link would cost that.
        ping = min(max(1.0, timing.ttl), 30.0)
        name = f"mesh-events:{worker_id}"
        async with open_pubsub(config, name=name, ping_interval=ping, topology=topology) as pubsub:
            worker = Worker(conn, pubsub, keys, timing, worker_id, max_payload)
            reaper = worker._reaper
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(worker._listen)
                    await nursery.start(worker._run_generations)
                    await nursery.start(reaper.run)
                    try:
                        yield worker
                    finally:
                        with trio.CancelScope(shield=True):
                            await worker._close()
                        worker._closed = True
                        worker.client._closed = True
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as eg:
                raise_single(eg)


async def _check_server(conn: Connection) -> None:
    """Refuse an eviction policy that can evict heartbeat keys; the check is
    skipped where CONFIG is not allowed (managed Redis, ACL)."""
    try:
        r = await conn.execute("CONFIG", "GET", "maxmemory-policy")
    except CommandError:
        return
    if len(r) == 2:
        policy = r[1].decode()
        if policy not in ("noeviction",):
            raise ConfigError(
                f"Redis maxmemory-policy is {policy!r}: it may evict leases and tasks; "
                "trio-mesh needs 'noeviction'"
            )
