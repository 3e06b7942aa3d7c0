"""The handler pool of one queue's runner: the processes run here, each in
a cancel scope only it can reach, by long-lived trio tasks.

Handlers run in a pool of long-lived trio tasks (at most ``concurrency``),
each running one process after the other in a cancel scope that only the
process it runs can reach, and that is replaced once cancelled: starting a
process costs a reschedule rather than a new trio task and a new cancel
scope (about half the worker's CPU per no-op task before). Each handler runs
in a fresh copy of the runner's context, as in a trio task of its own. A
batch handler (``QueueConfig.batch``) gets the processes claimed together in
calls of up to ``batch``, and each of them finishes or fails on its own.

The pool does no I/O with Redis: it records each handler's outcome in the
runner core's :class:`~mesh._runner_core.Outcomes` and sets :attr:`HandlerPool.wakeup`
for the runner's loop (:mod:`mesh._runner`), which reports them.
"""

from __future__ import annotations

import contextvars
import logging
import math
import types
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import outcome
import trio

from . import _telemetry
from ._blob import is_standin
from ._loop import CancelScope, Event, current
from ._queue_config import BatchHandler, Handler, QueueConfig
from ._runner_core import RunnerCore, describe_error, one_line
from ._stats import QueueCounters
from ._types import Process

__all__ = ["MOVED", "START_CHUNK", "HandlerPool", "Item"]

log = logging.getLogger("mesh.worker")


class _Slot:
    """One process run here: queued for a handler trio task of the pool,
    then running in that trio task's cancel scope."""

    __slots__ = (
        "batch", "began", "cancel_requested", "dropped", "hit", "process", "scope", "started",
        "stopping",
    )  # fmt: skip

    def __init__(self, process: Process, started: float, batch: _Batch | None = None) -> None:
        self.process = process
        # The scope the handler runs in, once a pool trio task took it.
        self.scope: CancelScope | None = None
        self.started = started  # when it was claimed (trio's clock)
        self.began = started  # when its handler started (set then)
        # True once the handler was cancelled to hand its process back (a
        # stop), not because the process was cancelled in the mesh.
        self.stopping = False
        self.cancel_requested = False
        self.batch = batch
        # Of a batch call: cancelled in the mesh while the call goes on, so
        # no longer run here (see HandlerPool.cancel_slot).
        self.dropped = False
        # Its scope was cancelled (its pool trio task needs a new one).
        self.hit = False

    def cancel(self, stopping: bool, reason: str | None = None) -> None:
        """Cancel this process's handler: its scope now, or, before a pool
        trio task took it, at once when one does (the handler is not
        called). Of a batch call, a stop cancels the whole call (each of its
        processes is handed back), a cancel in the mesh only once every
        process of the call is cancelled (the others' work goes on; this
        one's outcome is dropped). ``reason`` (:data:`MOVED`) is the
        ``trio.Cancelled.reason`` the handler sees (trio 0.31 and later)."""
        b = self.batch
        if b is not None and stopping:
            for s in b.slots:
                s.stopping = s.cancel_requested = True
        else:
            self.stopping = stopping
            self.cancel_requested = True
        if self.scope is not None and (
            b is None or stopping or all(s.cancel_requested for s in b.slots)
        ):
            _cancel(self.scope, reason)
            self.hit = True
            if b is not None:
                b.hit = True


#: The reason of the cancel (``trio.Cancelled.reason``) of a handler whose
#: process is handed back for balance, to move to a peer below its fair share.
MOVED = "moved"


def _cancel(scope: CancelScope, reason: str | None) -> None:
    if reason is None:
        scope.cancel()
        return
    try:
        scope.cancel(reason=reason)
    except TypeError:  # trio before 0.31: no reasons
        scope.cancel()


class _Batch:
    """The processes of one batch handler call."""

    __slots__ = ("hit", "slots")

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.hit = False  # its scope was cancelled


_NOTHING: Any = object()

#: A claim reply with more processes than this starts their handlers this
#: many at a time, one event loop batch after another (see :func:`_paced`).
START_CHUNK = 100

_STARTING: anyio.lowlevel.RunVar[anyio.Lock] = anyio.lowlevel.RunVar("mesh_starting")


async def _paced(
    queue: Callable[[Sequence[_Slot | _Batch]], None],
    items: list[_Slot | _Batch],
    waiting: Callable[[], bool],
) -> None:
    """Hand ``items`` to ``queue`` :data:`START_CHUNK` at a time, with a
    trip through the event loop between chunks, one large claim of the OS
    process at a time (a lock per trio run).

    Why: a trio run batch runs every task that is ready, and polls I/O only
    between batches. A claim of 1,000 processes started at once made one
    batch of 1,000 task creations and 1,000 first handler steps; ten
    workers of a process taking over a dead peer's tasks together made
    batches of 1 to 2 s on a loaded machine, long enough for heartbeat
    replies to sit unread past the self-fence deadline (half the survivors
    of a mass failure fenced themselves). Paced, a batch holds at most one
    chunk's starts and the previous chunk's first steps, whatever the number
    of workers and claims, and a heartbeat reply is read within a batch or
    two.

    Shielded from cancellation: the processes are ours in Redis and in
    ``running`` already; each one is dispatched (one that was cancelled or
    stopped meanwhile ends at once in the pool, as if it had waited there).
    The pool starts a chunk's handlers when the first of them yields
    (:meth:`HandlerPool.fan_out`): the next chunk is queued once
    ``waiting()`` says the pool took the last one (or could not take more),
    or after a few batches whatever it says."""
    try:
        lock = _STARTING.get()
    except LookupError:
        lock = anyio.Lock()
        _STARTING.set(lock)
    with anyio.CancelScope(shield=True):
        async with lock:
            for i in range(0, len(items), START_CHUNK):
                queue(items[i : i + START_CHUNK])
                # until the pool took the chunk (its first handler to yield
                # hands the others out; a few batches at most), and one more
                # batch, in which the handlers handed out make their first step
                for _ in range(4):
                    await anyio.lowlevel.cancel_shielded_checkpoint()
                    if not waiting():
                        break
                await anyio.lowlevel.cancel_shielded_checkpoint()


class _Stop(Exception):
    """Sent to a parked pool trio task: the runner is done, exit."""


@types.coroutine
def _in_context(
    ctx: contextvars.Context,
    coro: Generator[Any, Any, Any] | Awaitable[Any],
    pool: HandlerPool | None = None,
    first: Any = _NOTHING,
) -> Generator[Any, Any, Any]:
    """Await ``coro`` with each of its steps run in ``ctx``: a handler run by
    a long-lived pool trio task sees a fresh copy of the runner's context
    (what a trio task of its own would see), so what one handler sets in a
    context variable never leaks into the next one. Exceptions (Cancelled
    included) pass through unchanged. Each time the handler yields to trio
    (it blocks, or passes a checkpoint), the processes still queued on
    ``pool`` are handed to pool trio tasks of their own
    (:meth:`HandlerPool.fan_out`). ``first``: what the coroutine yielded
    at its first step, taken already by the caller (see
    :meth:`HandlerPool._run_one`)."""
    c = cast(Any, coro)
    send: Callable[[Any], Any] = c.send
    arg: Any = None
    while True:
        if first is not _NOTHING:
            msg, first = first, _NOTHING
        else:
            try:
                msg = ctx.run(send, arg)
            except StopIteration as stop:
                return stop.value
        if pool is not None and pool.queued:
            pool.fan_out()
        try:
            arg = yield msg
            send = c.send
        except BaseException as exc:  # thrown in by trio: forward it
            send, arg = c.throw, exc


Item = _Slot | _Batch  # what a pool trio task runs: one process, or one batch call


class HandlerPool:
    """The processes of one queue run here, and the trio tasks that run
    their handlers (see the module docstring). Sync methods do no I/O and
    never block; :attr:`running` is the runner's (a process is in it from
    its claim until its handler ended, or it was cancelled or handed back)."""

    def __init__(self, config: QueueConfig, core: RunnerCore, counters: QueueCounters) -> None:
        self.config = config
        self.core = core
        self.loop = current()
        self._wake = self.loop.wake
        self.out = core.out
        self.counters = counters
        self.running: dict[str, _Slot] = {}
        # Set whenever the runner's loop has something to look at (an
        # outcome, a free slot); the loop replaces it after each wait.
        self.wakeup: Event = self.loop.Event()
        # Long-lived trio tasks (at most concurrency), each running one
        # process (or one batch call) after the other, so that starting a
        # process costs a reschedule, not a trio task and a cancel scope
        # (see _serve). Idle ones are parked in ``idle``; work that finds
        # none idle and the pool full waits in ``queued``.
        self.idle: list[Any] = []  # the parked ones' handles (mesh/_loop.py)
        self.queued: deque[_Slot | _Batch] = deque()
        self.size = 0
        self.nursery: anyio.abc.TaskGroup | None = None
        self.ctx = contextvars.copy_context()
        # the loop's clock, read without anyio.current_time()'s lookup of the
        # backend on every call
        self.now: Callable[[], float] = self.loop.clock()
        # Whether handler runs get spans (asked once per claimed batch).
        self.traced = False
        # Reads the payload of a stand-in (mesh._blob.fetch, bound to the
        # runner's connection): the one read of Redis a handler's trio task
        # makes, for a payload of more than 1 MiB, before its handler runs.
        self.fetch: Callable[[bytes], Awaitable[bytes]] | None = None

    def items(self, processes: Sequence[Process]) -> list[_Slot | _Batch]:
        """Take a claim's processes to start: each runs here from now on (in
        :attr:`running`: a cancel, a release or a stop reaches it); returns
        what to hand to the pool (:meth:`queue`, or :meth:`start_paced`): a slot per process, or
        with a batch handler a batch per up to ``batch`` of them."""
        size = self.config.batch
        batch: _Batch | None = None
        self.traced = _telemetry.tracer is not None and _telemetry.active()
        claimed = self.now()
        running = self.running
        items: list[_Slot | _Batch] = []
        for p in processes:
            if not size:
                slot = running[p.id] = _Slot(p, claimed)
                items.append(slot)
                continue
            if batch is None or len(batch.slots) >= size:
                batch = _Batch()
                items.append(batch)
            slot = running[p.id] = _Slot(p, claimed, batch)
            batch.slots.append(slot)
        return items

    async def start_paced(self, items: list[_Slot | _Batch]) -> None:
        """Hand the ``items`` of a claim of more than :data:`START_CHUNK` to
        the pool, paced (:func:`_paced`; shielded from cancellation); a
        smaller claim's go to :meth:`queue` at once."""
        await _paced(self.queue, items, self.could_take)

    def cancel_slot(self, slot: _Slot) -> None:
        """Cancel a process here that Redis no longer holds for us (cancelled
        in the mesh, or lost). One of a batch call whose other processes go
        on leaves ``running`` now (it is not ours, and not reported): the
        call's outcome for it is dropped."""
        slot.cancel(stopping=False)
        if self.unqueue(slot):
            return
        if slot.batch is not None and not slot.dropped:
            slot.dropped = True
            del self.running[slot.process.id]
            self.counters.cancelled += 1
            self.wakeup.set()

    def could_take(self) -> bool:
        """Whether queued work waits for a pool trio task that could take it."""
        return bool(self.queued) and (bool(self.idle) or self.size < self.config.concurrency)

    def queue(self, items: Sequence[_Slot | _Batch]) -> None:
        """Queue claimed work for the handler pool, and make sure a pool trio
        task takes it (sync, no I/O)."""
        self.queued.extend(items)
        self.kick()

    def free(self) -> int:
        """How many processes this runner may claim now (a batch handler's
        calls are made of the processes claimed together, so ``concurrency``
        bounds the processes at once with either kind of handler). With
        ``prefetch`` (or, by default, the core's adaptive
        :attr:`~mesh._runner_core.RunnerCore.depth`), up to that many more
        are claimed and wait here for a free slot, unless every slot runs a
        handler that may not free it soon (:meth:`slots_stuck`)."""
        c = self.config
        extra = self.core.depth if c.prefetch is None else c.prefetch
        if extra and not self.slots_stuck():
            return c.concurrency + extra - len(self.running)
        return c.concurrency - len(self.running)

    def _handlers(self) -> list[tuple[bool, float]]:
        """``(persistent, began)`` of each handler running."""
        running = self.running.values()
        return [(s.process.persistent, s.began) for s in running if s.scope is not None]

    def slots_stuck(self) -> bool:
        """Whether every slot runs the handler of a persistent task or, with
        adaptive pipelining, a long one (see
        :meth:`~mesh._runner_core.RunnerCore.slots_stuck`)."""
        if len(self.running) - len(self.queued) < self.config.concurrency:
            return False
        return self.core.slots_stuck(self.now(), self._handlers())[0]

    def hand_back_stuck(self) -> None:
        """Hand back, unharmed, the prefetched processes queued here while
        every slot is stuck (:meth:`slots_stuck`: they could wait for ever,
        or long; a peer with a free slot can run them). While every slot is
        busy but not stuck yet, the runner's loop is woken when it may be."""
        c = self.config
        self.core.look_at = math.inf
        if not self.queued or c.batch or len(self.running) - len(self.queued) < c.concurrency:
            return
        now = self.now()
        stuck, look_again = self.core.slots_stuck(now, self._handlers())
        if stuck:
            while self.queued:
                slot = cast(_Slot, self.queued.popleft())
                del self.running[slot.process.id]
                self.out.hand_back(slot.process.id)
        else:
            self.core.look_at = look_again

    def unqueue(self, slot: _Slot) -> bool:
        """Take ``slot`` out of the queue for a handler if it waits there
        (claimed, its handler not started): its cancel or stop is then
        recorded at once rather than when a slot frees. Returns whether it
        was queued."""
        if slot.batch is not None or slot.scope is not None or not self.queued:
            return False
        try:
            self.queued.remove(slot)
        except ValueError:
            return False  # handed to a pool trio task already: it records it
        del self.running[slot.process.id]
        self._cancelled(slot)
        return True

    def dispatch(self, item: _Slot | _Batch) -> None:
        """Hand a process (or a batch call) to an idle pool trio task, or to
        a new one while the pool is below ``concurrency``; else it waits for
        the first pool trio task that comes free (sync, no I/O)."""
        if self.idle:
            self._wake(self.idle.pop(), outcome.Value(item))
        elif self.size < self.config.concurrency and self.nursery is not None:
            self.size += 1
            self.nursery.start_soon(self._serve, item, name=f"mesh handlers {self.config.queue}")
        else:
            self.queued.append(item)

    def kick(self) -> None:
        """Work was queued: make sure a pool trio task takes it. One is
        woken (or started) for the first item; it runs the next ones after
        it, one after the other, as long as their handlers do not yield to
        trio; the first handler that does hands every item still queued to
        pool trio tasks of their own (:meth:`_fan_out`). So handlers that
        never block (or block late) cost one trio task switch per claimed
        batch rather than one per process, and handlers that block all run
        at once, one scheduling round later than their first one."""
        if self.queued and (self.idle or self.size < self.config.concurrency):
            self.dispatch(self.queued.popleft())

    def fan_out(self) -> None:
        """Hand every queued item to an idle or new pool trio task, while the
        pool has room (sync, no I/O)."""
        queued = self.queued
        while queued and (self.idle or self.size < self.config.concurrency):
            self.dispatch(queued.popleft())

    def end(self) -> None:
        """Tell every parked pool trio task to exit (the runner is done)."""
        while self.idle:
            self._wake(self.idle.pop(), outcome.Error(_Stop()))

    async def _park(self) -> _Slot | _Batch:
        """Wait, idle, until :meth:`_dispatch` hands this pool trio task work.

        Raises:
            _Stop: the runner is done. On cancellation nothing was handed.
        """
        task = self.loop.handle()
        self.idle.append(task)

        def abort(_: Any) -> trio.lowlevel.Abort:
            self.idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        item: _Slot | _Batch = await self.loop.park(task, abort)
        return item

    async def _serve(self, item: _Slot | _Batch | None) -> None:
        """One trio task of the handler pool: run ``item``, then whatever
        :meth:`_dispatch` hands it, one after the other, until the runner
        ends (the nursery is cancelled, or :meth:`_end_pool`).

        Each handler runs in this trio task's cancel scope, which only that
        handler's process can reach while it runs (``slot.scope``): a cancel
        of the process cancels it, with the same latency as a scope of its
        own. A scope that was cancelled (or whose deadline passed) is never
        used again; the next handler gets a new one. So a cancel scope is
        made per cancelled handler, not per handler."""
        try:
            while True:
                current: _Slot | _Batch | None = None
                with self.loop.CancelScope() as scope:
                    while True:
                        if item is None:
                            item = self.queued.popleft() if self.queued else await self._park()
                        current, item = item, None
                        if type(current) is _Slot:
                            await self._run_one(scope, current)
                        else:
                            await self._run_batch(scope, cast(_Batch, current))
                        hit, current = current.hit, None
                        # (cancel_called reads the clock: asked only when a
                        # deadline could have passed)
                        if hit or (self.config.timeout > 0 and scope.cancel_called):
                            break
                if current is not None:
                    # The handler ended by this scope's Cancelled: a cancel,
                    # a stop, or its time limit.
                    self._cancelled(current)
                    if self.core.stopping and not self.queued:
                        return  # nothing more for this pool trio task to run
        except _Stop:
            pass
        finally:
            self.size -= 1

    def _cancelled(self, item: _Slot | _Batch) -> None:
        """Record the outcome of a handler (or batch call) that ended by its
        scope's cancellation: handed back after a stop, dropped after a
        cancel in the mesh (Redis no longer holds it for us), failed after
        its time limit."""
        slots = [item] if isinstance(item, _Slot) else item.slots
        for slot in slots:
            if slot.dropped:
                continue  # counted when it was cancelled
            if not slot.cancel_requested:
                self.out.fail(slot.process, self._timed_out())
            elif slot.stopping:
                self.out.hand_back(slot.process.id)
            else:
                self.counters.cancelled += 1
        self.wakeup.set()

    def _timed_out(self) -> str:
        return f"TimeoutError: the handler ran longer than {self.config.timeout:g} s"

    async def _run_one(self, scope: CancelScope, slot: _Slot) -> None:
        """Run the handler of one process in ``scope`` and record how it
        ended (a Cancelled of ``scope`` propagates: :meth:`_serve` records
        that)."""
        p = slot.process
        if slot.cancel_requested:
            # cancelled before this trio task took it: the handler never runs
            del self.running[p.id]
            self._cancelled(slot)
            return
        slot.scope = scope
        if self.queued and self.config.prefetch != 0:
            self.wakeup.set()  # every slot may be stuck now: see hand_back_stuck
        handler = cast(Handler, self.config.handler)
        timeout = self.config.timeout
        now = self.now
        began = slot.began = now()
        if timeout > 0:
            scope.deadline = began + timeout
        try:
            coro: Awaitable[Any]
            if p.task[:1] == b"\0" and is_standin(p.task):
                coro = self._whole(handler, p)
            else:
                coro = _telemetry.traced(handler, p) if self.traced else handler(p)
            ctx = self.ctx.copy()
            # The first step here: a handler that does not yield to trio
            # ends in it, with no generator around it.
            try:
                msg = ctx.run(cast(Any, coro).send, None)
            except StopIteration as stop:
                value = stop.value
            else:
                value = await _in_context(ctx, coro, self, msg)
        except Exception as exc:
            log.debug("handler of queue %s, process %s raised:", p.queue, p.id, exc_info=True)
            self.out.fail(p, describe_error(exc), one_line(exc))
        else:
            self.out.finished(p, value)
        finally:
            del self.running[p.id]
            if timeout > 0:
                scope.deadline = math.inf
            self.counters.handler.observe(now() - began)
        # A slot is free: the loop claims again if it may (a runner that is
        # not in the queue's idle set must look by itself, or no one wakes it).
        self.wakeup.set()

    async def _run_batch(self, scope: CancelScope, b: _Batch) -> None:
        """Run the batch handler on the processes of ``b`` in ``scope`` and
        record each one's outcome (a Cancelled of ``scope`` propagates:
        :meth:`_serve` records that)."""
        live = [s for s in b.slots if not s.cancel_requested]
        if not live:
            for slot in b.slots:
                if not slot.dropped:
                    del self.running[slot.process.id]
            self._cancelled(b)
            return
        for slot in b.slots:
            slot.scope = scope
        procs = [s.process for s in live]
        handler = cast(BatchHandler, self.config.handler)
        timeout = self.config.timeout
        began = self.now()
        if timeout > 0:
            scope.deadline = began + timeout
        try:
            if any(q.task[:1] == b"\0" and is_standin(q.task) for q in procs):
                value = await _in_context(self.ctx.copy(), self._whole_batch(handler, procs), self)
            else:
                value = await _in_context(self.ctx.copy(), handler(procs), self)
        except Exception as exc:
            log.debug("batch handler of queue %s raised:", self.config.queue, exc_info=True)
            outcomes: Sequence[Any] = [exc] * len(procs)
        else:
            outcomes = self._batch_outcomes(procs, value)
        finally:
            for slot in b.slots:
                if not slot.dropped:
                    del self.running[slot.process.id]
            if timeout > 0:
                scope.deadline = math.inf
            self.counters.handler.observe(self.now() - began)
        for slot, out in zip(live, outcomes, strict=True):
            p = slot.process
            if slot.dropped:
                continue  # cancelled in the mesh meanwhile: not ours to report
            if isinstance(out, BaseException):
                self.out.fail(p, describe_error(out), one_line(out))
            else:
                self.out.finished(p, out)
        self.wakeup.set()

    async def _resolve(self, p: Process) -> Process:
        """``p`` with its whole payload in place of its stand-in (see
        :mod:`mesh._blob`); raises BlobGoneError when the blob is gone (the
        attempt fails: a handler never sees a stand-in)."""
        if not is_standin(p.task):
            return p
        assert self.fetch is not None, "a runner sets the pool's fetch"
        return attrs.evolve(p, task=await self.fetch(p.task))

    async def _whole(self, handler: Handler, p: Process) -> Any:
        """The handler run on ``p`` with its big payload read first."""
        whole = await self._resolve(p)
        return await (_telemetry.traced(handler, whole) if self.traced else handler(whole))

    async def _whole_batch(self, handler: BatchHandler, procs: list[Process]) -> Any:
        """The batch handler run on ``procs`` with their big payloads read
        first."""
        return await handler([await self._resolve(q) for q in procs])

    def _batch_outcomes(self, procs: list[Process], value: object) -> Sequence[Any]:
        """What a batch handler returned, as one outcome per process: None
        finishes them all; a sequence of one entry per process finishes each
        (the entry is its result) or, for an exception instance, fails it.
        Anything else fails them all with a TypeError."""
        if value is None:
            return [None] * len(procs)
        if isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray):
            if len(value) == len(procs):
                return value
        err = TypeError(
            f"the batch handler of queue {self.config.queue} returned {type(value).__name__}"
            + (f" of {len(value)}" if isinstance(value, Sequence) else "")
            + f" for {len(procs)} processes; expected None or one outcome per process"
        )
        log.error("%s", err)
        return [err] * len(procs)
