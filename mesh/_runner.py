"""One queue served with a handler: claim in batches, run each process in its
own cancel scope, report outcomes in batches.

Three parts, in the manner of h11: the decisions (:mod:`mesh._runner_core`,
no I/O: what to claim and how many, which outcomes to report, stop pacing,
rebalance pulls, re-checks, backoff), the handler pool (:mod:`mesh._pool`:
the trio tasks that run handlers, each process in a cancel scope of its own),
and here the thin loop that asks the core what to do, does it through the
protocol binding, and feeds the replies back.

The runner claims as many tasks as it has free slots in one ``claim.lua``
call, and reports every process that ended since the last call in one
``finish.lua`` (and one ``give_back.lua`` for failures) call, so a busy queue
costs about two script calls per batch rather than per task. A finish report
and the next claim go out in the same write (one round trip): Redis runs the
finish first, so the claim can take the slots it freed.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable

import anyio
import anyio.abc

from ._binding import Binding
from ._blob import fetch
from ._connection import Connection
from ._errors import CommandError, FencedError, MeshConnectionError
from ._pool import MOVED as MOVED
from ._pool import HandlerPool, _Slot
from ._queue_config import Batched as Batched
from ._queue_config import BatchHandler as BatchHandler
from ._queue_config import Handler as Handler
from ._queue_config import QueueConfig as QueueConfig
from ._replies import QueueBeat
from ._runner_core import STOP_CHUNK, Action, RunnerCore
from ._runner_io import RunnerIO
from ._stats import QueueCounters
from ._types import Process

# The handler kinds and MOVED are re-exported for mesh/__init__.py (the public
# names), QueueConfig for those who build a runner.
__all__ = ["MOVED", "BatchHandler", "Batched", "Handler", "QueueConfig", "QueueRunner"]

log = logging.getLogger("mesh.worker")

# The actions, as plain names (read once per turn).
_CLAIM, _FINISH, _FAILED = Action.CLAIM, Action.FINISH, Action.FAILED
_RETURNED, _PULL, _WAIT, _EXIT = Action.RETURNED, Action.PULL, Action.WAIT, Action.EXIT

#: Seconds a claim or report in flight when a stop begins may take to come
#: back before the stop drops it (a hung connection must not hold a stop).
STOP_IO_GRACE = 0.5


class QueueRunner:
    """Serves one queue for one generation (identity) of a worker."""

    def __init__(
        self,
        conn: Connection,
        binding: Binding,
        worker_id: str,
        incarnation: str,
        config: QueueConfig,
        counters: QueueCounters,
        on_fenced: Callable[[str], None],
        balance_wait: float = 1.0,
        ttl: float = 0.0,
        early_cancels: dict[str, float] | None = None,
        replicate: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._config = config
        self._counters = counters
        self._on_fenced = on_fenced
        self._core = core = RunnerCore(config, counters, balance_wait, ttl)
        self._out = core.out
        self._pool = pool = HandlerPool(config, core, counters)
        pool.fetch = functools.partial(fetch, conn, binding.keys)
        # With min_replicas, ``replicate`` waits until a claim is on the
        # replicas (WAIT) before its persistent tasks' handlers start.
        self._io = RunnerIO(
            conn,
            binding,
            worker_id,
            incarnation,
            core,
            pool,
            {} if early_cancels is None else early_cancels,
            replicate,
        )
        self.running: dict[str, _Slot] = pool.running
        self.policy = core.policy
        self._io_scope: anyio.CancelScope | None = None
        self.handed_back = 0
        """How many processes this runner handed back after a stop."""
        self.keep_ms = 0
        """> 0: a stop keeps persistent tasks reserved for this worker id for
        that long (a sticky restart), instead of handing them to anyone."""
        self._scope = anyio.CancelScope()
        self._exited = anyio.Event()
        self._balance_wait = balance_wait

    @property
    def config(self) -> QueueConfig:
        """How this runner serves its queue. Set a new one (a policy read
        from Redis) and the next claim, report and handler use it."""
        return self._config

    @config.setter
    def config(self, config: QueueConfig) -> None:
        self._config = self._pool.config = self._io.config = config
        self._core.reconfigure(config)

    # --- signals from the worker (sync, no I/O) ----------------------------

    def nudge(self) -> None:
        """There may be tasks to claim."""
        self._core.nudge()
        self._pool.wakeup.set()

    def wake_in(self, seconds: float) -> None:
        """A task becomes due for a retry in ``seconds``."""
        self._core.wake_in(self._pool.now(), seconds)
        self._pool.wakeup.set()

    def retry_due(self, due_ms: int, seconds: float, idle_servers: int) -> None:
        """The heartbeat says a delayed task of this queue is due at
        ``due_ms`` (Redis clock), ``seconds`` from now. Every server of the
        queue hears it, and if all claimed at that moment all but one would
        claim in vain: each acts with probability ``HERD / idle_servers``,
        drawn once per due time. One that does not act still claims at its
        first heartbeat after the due time (the task then counts as ready),
        and with many idle servers that heartbeat comes soon.
        """
        if self._core.retry_due(due_ms, idle_servers):
            self.wake_in(seconds)

    def on_heartbeat(self, beat: QueueBeat) -> None:
        """What the worker's heartbeat says about this queue (sync, no I/O):
        re-check if Redis holds fewer processes than run here, claim if no
        wake could reach this runner, claim when tasks are ready or a
        delayed one comes due, hand back what a rebalance asked for (once
        each handler has exited), and ask for tasks when below the fair
        share (see :mod:`mesh._balance`)."""
        self.release(beat.release)
        if self._core.plan_pull(beat, self.config.handler is not None):
            self._pool.wakeup.set()
        self.check_held(beat.held)
        self.check_idle(beat.idle)
        if beat.state == 0:
            self.nudge()
        elif beat.state > 0:
            self.retry_due(beat.now_ms + beat.state, beat.state / 1000, beat.idle_servers)

    def check_idle(self, in_idle_set: bool) -> None:
        """The heartbeat saw whether Redis has this runner's worker in the
        queue's idle set. With a free slot, not held back by the fair share
        and not about to claim anyway, a runner that is not there would never
        be woken (its wake was popped, and the message lost): claim, which
        puts it back if there is nothing to take."""
        if self._core.check_idle(in_idle_set, self._pool.free()):
            self.nudge()

    def check_held(self, held_in_redis: int) -> None:
        """The heartbeat saw ``held_in_redis`` processes of this queue held by
        us in Redis. Fewer than we run means some were lost (their handlers
        are stopped); more than we run, beyond what reports and a claim in
        flight may account for, means Redis holds processes nobody runs here
        (a finish or a hand-back lost in a failover, a claim whose reply was
        lost): they are handed back. Either way: re-check (:meth:`_resync`,
        one SMEMBERS), only on such a mismatch."""
        if self._core.check_held(held_in_redis, len(self.running)):
            self._pool.wakeup.set()

    def cancel_process(self, pid: str) -> bool:
        """Cancel the handler of process ``pid`` (cancelled in the mesh); its
        outcome is not reported. Returns whether it ran here."""
        slot = self.running.get(pid)
        if slot is None:
            return False
        self._pool.cancel_slot(slot)
        return True

    def release(self, pids: Iterable[str]) -> None:
        """Hand these processes back for balance: their handlers are
        cancelled, and each process is handed back (reserved, by Redis, for
        the worker it moves to) once its handler has exited."""
        for pid in pids:
            slot = self.running.get(pid)
            if slot is not None and not slot.cancel_requested:
                slot.cancel(stopping=True, reason=MOVED)
                self._counters.moved_out += 1
                self._pool.unqueue(slot)

    # --- stopping -------------------------------------------------------------

    def begin_stop(self) -> None:
        """Stop claiming and cancel every handler, :data:`STOP_CHUNK` at a
        time: the next group when the one before is handed back, or
        :data:`STOP_PACE` after it at the latest (every handler at once if
        Redis cannot be reached). The loop keeps running (and
        the worker keeps renewing its lease): it hands each process back, to
        the front of its queue and with no attempt counted, only once its
        handler has exited, and ends when no handler is left (invariant 10).
        A handler that returns or raises while stopping is reported as
        finished or failed, as usual."""
        if self._io_scope is not None:
            # A claim or report in flight gets STOP_IO_GRACE to come back,
            # then it is dropped (see _run): it was most likely written
            # already (the worker's connection writes at once), so its reply
            # says what it did (a finish report counted, a claim's processes
            # handed back unstarted) rather than leaving that unknown.
            io = self._io_scope
            io.deadline = min(io.deadline, anyio.current_time() + STOP_IO_GRACE)
        # Handlers are cancelled STOP_CHUNK at a time (see _cancel_next), so
        # that each group is handed back while the next one exits: a peer
        # starts the first tasks after one group's exits and round trips, not
        # after all of them. What never started ends here at once.
        started = []
        for slot in list(self.running.values()):
            if not slot.cancel_requested:
                if slot.scope is None:  # its handler has not started
                    slot.cancel(stopping=True)
                    self._pool.unqueue(slot)
                else:
                    started.append(slot.process.id)
        self._core.begin_stop(started)
        self._cancel_next()
        if self._core.stop_order:
            # The later groups by time, whatever the loop is doing (waiting
            # for Redis, say): every handler is cancelled within STOP_PACE
            # per group of the stop's start.
            try:
                if self._pool.nursery is None:
                    raise RuntimeError("not running")
                self._pool.nursery.start_soon(
                    self._pace_stop, name=f"mesh stop {self.config.queue}"
                )
            except RuntimeError:  # the loop is not running (its nursery closed): no pacing
                self._cancel_rest()
        self._pool.wakeup.set()

    async def _pace_stop(self) -> None:
        """Cancel the stop's next group once STOP_PACE has passed since the
        last one (the loop cancels one sooner each time it hands a group
        back); ends when every handler of the stop is cancelled."""
        core = self._core
        while core.stop_order:
            await anyio.sleep_until(core.cancel_at)
            if core.stop_due(anyio.current_time()):
                self._cancel_next()

    def _cancel_rest(self) -> None:
        """Cancel every handler the stop has not cancelled yet (sync, no I/O)."""
        self._cancel_next(len(self._core.stop_order))

    def _cancel_next(self, n: int = STOP_CHUNK) -> None:
        """Cancel the handlers of the stop's next group (sync, no I/O)."""
        running = self.running
        for pid in self._core.stop_group(anyio.current_time(), self._cancellable, n):
            slot = running[pid]
            slot.cancel(stopping=True)
            self._pool.unqueue(slot)

    def _cancellable(self, pid: str) -> bool:
        """Whether the handler of ``pid`` still runs and was not cancelled."""
        slot = self.running.get(pid)
        return slot is not None and not slot.cancel_requested

    @property
    def exited(self) -> bool:
        """Whether the loop ended (after a stop: every handler exited and every
        outcome was reported, or the loop was cancelled)."""
        return self._exited.is_set()

    async def wait_exited(self) -> None:
        """Wait until the loop has ended."""
        await self._exited.wait()

    async def stop(self, grace: float = float("inf")) -> bool:
        """Cancel every handler and hand each process back once its handler
        has exited (:meth:`begin_stop`); wait at most ``grace`` seconds for
        that.

        Returns:
            True if every handler exited within the grace. If not, the loop
            keeps running: the handlers still running keep their processes,
            and each is handed back when it exits (call :meth:`abort` to end
            the loop instead, e.g. when the lease is given up).
        """
        self.begin_stop()
        with anyio.move_on_after(grace):
            await self._exited.wait()
        return self._exited.is_set()

    def abort(self) -> None:
        """Cancel the loop itself: it reports what it has in hand (bounded)
        and ends once the handlers still running have exited; their
        processes stay held (the worker's retirement, or its peers after
        the lease ran out, hand them back)."""
        self._scope.cancel()

    def stopping_slots(self) -> list[tuple[Process, float]]:
        """The processes whose handlers still run, with when each started
        (trio's clock)."""
        return [(s.process, s.started) for s in self.running.values()]

    # --- the loop ------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Claim and run until cancelled. Raises nothing but Cancelled: a fenced
        lease is reported through ``on_fenced`` and ends the loop."""
        try:
            with self._scope:
                await self._run(task_status)
        finally:
            # Handlers that returned or raised before the loop was stopped
            # still get their outcome reported (shielded, bounded): otherwise
            # leaving or stop_work() would hand a finished task back to its
            # queue and it would run again. What is not reported in time is
            # handed back, as before.
            if self._out.in_hand():
                with anyio.move_on_after(self._balance_wait) as cs:
                    cs.shield = True
                    try:
                        self.handed_back += await self._io.report(self.keep_ms)
                    except (MeshConnectionError, CommandError, FencedError):
                        pass
            self._exited.set()

    async def _run(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as handlers:
            self._pool.nursery = handlers
            task_status.started()
            # begin_stop() gives this scope a deadline: a claim or report in
            # flight then is dropped if it does not come back within
            # STOP_IO_GRACE (a report is sent again while stopping; what a
            # dropped claim took stays held, and is handed back by unserve or
            # the worker's retirement). One scope for every turn while
            # serving, not one per turn: entering and leaving a trio cancel
            # scope costs about as much as a no-op handler run.
            with anyio.CancelScope() as self._io_scope:
                while not self._core.stopping:
                    await self._turn()
            self._io_scope = None
            if not await self._io.drain(self._balance_wait):
                self._cancel_rest()
            while await self._turn():
                pass
            # Every handler has exited: end the idle pool.
            self._pool.end()

    async def _turn(self) -> bool:
        """One turn of the loop, serving or stopping alike: do what the core
        says comes next, through the runner's round trips (:mod:`mesh._runner_io`),
        or wait until something changes (while serving, at most until the next
        due time). Returns False once stopped (no handler left, everything
        reported).

        The one error path: a FencedError reports the lost lease and ends the
        loop; a connection or command error is logged and the turn is tried
        again after the core's backoff (while stopping, every handler left is
        cancelled at once: nothing can be handed back meanwhile)."""
        core, pool = self._core, self._pool
        if pool.queued and self._config.prefetch != 0 and not core.stopping:
            pool.hand_back_stuck()
        else:
            core.look_at = math.inf
        action, n = core.next_action(pool.now(), pool.free(), len(pool.running))
        if action is _WAIT:
            due = math.inf if core.stopping else min(core.next_due, core.look_at)
            if due == math.inf:
                await pool.wakeup.wait()
            else:
                with pool.loop.CancelScope(deadline=due):
                    await pool.wakeup.wait()
            pool.wakeup = pool.loop.Event()
            return True
        if action is _EXIT:
            return False
        io = self._io
        try:
            if action is _CLAIM:
                await io.claim(n)
                core.claim_done()
            elif action is _FINISH:
                await io.finish()
            elif action is _FAILED:
                await io.give_back_failed()
            elif action is _RETURNED:
                if core.stop_order:
                    # The next group exits while the one before is handed back.
                    self._cancel_next()
                self.handed_back += await io.give_back_returned(self.keep_ms)
            elif action is _PULL:
                await io.rebalance(n)
            else:
                await io.resync()
        except FencedError as exc:
            self._on_fenced(str(exc))
            self.abort()
        except (MeshConnectionError, CommandError) as exc:
            delay = core.failed_turn(isinstance(exc, MeshConnectionError))
            # An unreachable Redis is reported once, by the heartbeat.
            log.log(
                logging.DEBUG if isinstance(exc, MeshConnectionError) else logging.WARNING,
                "queue %s: %s; retrying in %.2fs",
                self._config.queue,
                exc,
                delay,
            )
            if core.stopping:
                self._cancel_rest()
            await anyio.sleep(delay)
        return True
