"""One queue served with a handler: claim in batches, run each process in its
own cancel scope, report outcomes in batches.

Handlers run in a pool of long-lived trio tasks (at most ``concurrency``),
each running one process after the other in a cancel scope that only the
process it runs can reach, and that is replaced once cancelled: starting a
process costs a reschedule rather than a new trio task and a new cancel
scope (about half the worker's CPU per no-op task before). Each handler runs
in a fresh copy of the runner's context, as in a trio task of its own. A
batch handler (``QueueConfig.batch``) gets the processes claimed together in
calls of up to ``batch``, and each of them finishes or fails on its own.

The runner claims as many tasks as it has free slots in one ``claim.lua``
call, and reports every process that ended since the last call in one
``finish.lua`` (and one ``give_back.lua`` for failures) call, so a busy queue
costs about two script calls per batch rather than per task. A finish report
and the next claim go out in the same write (one round trip): Redis runs the
finish first, so the claim can take the slots it freed.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import math
import random
import types
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from typing import Any, cast

import attrs
import outcome
import trio

from . import _telemetry
from ._balance import BalancePolicy, check_capacity, pull_count
from ._connection import Connection
from ._errors import CommandError, ConfigError, FencedError, MeshConnectionError, MeshError
from ._keys import check_queue
from ._policy import QueuePolicy
from ._scripts import Binding, ClaimReply, QueueBeat, ResultsToKeep
from ._stats import QueueCounters
from ._types import Process
from ._validate import seconds_field, whole, whole_field

__all__ = ["BatchHandler", "Batched", "Handler", "QueueConfig", "QueueRunner", "check_handler"]

log = logging.getLogger("mesh.worker")

#: About this many idle servers of a queue act on a delayed task's due time.
HERD = 3

#: Seconds a claim or report in flight when a stop begins may take to come
#: back before the stop drops it (a hung connection must not hold a stop).
STOP_IO_GRACE = 0.5

#: A stop cancels its handlers this many at a time, and hands each group back
#: while the next one exits (QueueRunner._stop_step, _pace_stop) ...
STOP_CHUNK = 100
#: ... the next group at the latest this long after the one before, whatever
#: became of it (a group of slow cleanups holds up no other handler's stop).
STOP_PACE = 0.01

Handler = Callable[[Process], Awaitable[Any]]
BatchHandler = Callable[[list[Process]], Awaitable[Sequence[Any] | None]]


def check_handler(handler: object) -> None:
    """Refuse a handler that is not an async callable: an ``async def``
    function or method, a :func:`functools.partial` of one, or an object
    whose ``__call__`` is ``async def``. A plain ``def`` would run its side
    effects, then fail every attempt on ``await`` until dead-lettered.

    Raises:
        TypeError: not callable, or not async; the message says what to do.
    """
    if not callable(handler):
        raise TypeError(
            f"handler must be an async callable taking a Process, not {type(handler).__name__}"
        )
    if _is_async_callable(handler):
        return
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    raise TypeError(
        f"handler {name} is not async: a handler is 'async def handler(process)', a "
        "functools.partial of one, or an object with 'async def __call__' (a plain def, "
        "or a lambda that returns a coroutine, is refused before any task runs)"
    )


@attrs.frozen
class Batched:
    """A batch handler and its batch size, as a value of the APP mapping of
    ``mesh worker`` (``{"rows": mesh.Batched(write_rows, 100)}``): that queue
    is served with ``start_work(queue, batch_handler=handler, batch=size)``.
    See :meth:`mesh.Worker.start_work` for what a batch handler returns.

    Raises:
        TypeError: ``handler`` is not an async callable, or ``size`` is not
            a whole number >= 1.
    """

    handler: BatchHandler = attrs.field(validator=lambda _i, _a, h: check_handler(h))
    size: int = attrs.field(
        default=10, validator=lambda _i, _a, n: whole("batch size", n, 1, error=TypeError)
    )


def _is_async_callable(obj: object) -> bool:
    while isinstance(obj, functools.partial):
        obj = obj.func
    if inspect.iscoroutinefunction(obj):
        return True
    if inspect.isroutine(obj) or inspect.isclass(obj):
        return False
    return inspect.iscoroutinefunction(getattr(obj, "__call__", None))  # noqa: B004


def preview(task: bytes, width: int = 40) -> str:
    """A payload for a log line: quoted text when it is printable UTF-8,
    else a ``b'...'`` literal; cut to about ``width`` characters."""
    head = task[: 4 * width]  # a cut payload, never a copy of a large one
    text: str | None
    try:
        text = head.decode()
    except UnicodeDecodeError as exc:
        # cut inside a character: what came before it is still text
        cut = len(head) < len(task) and exc.start > len(head) - 4
        text = head[: exc.start].decode() if cut else None
    shown = repr(text) if text is not None and text.isprintable() else repr(head)
    return shown if len(shown) <= width and len(head) == len(task) else shown[: width - 4] + "...'"


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _handler(_instance: object, _attribute: object, handler: Any) -> None:
    if handler is not None:
        check_handler(handler)


@attrs.frozen
class QueueConfig:
    """How a worker serves one queue: ``start_work``'s options, checked here.

    Raises:
        ConfigError: on construction, a bad queue name, a value out of
            range (named in the message), ``batch`` above ``concurrency``,
            ``prefetch`` with a batch handler, or ``backoff`` above
            ``backoff_max``.
        TypeError: a queue name that is not a str, a handler that is not an
            async callable.
    """

    queue: str = attrs.field(validator=lambda _i, _a, q: check_queue(q))
    # With batch > 0, a BatchHandler (up to ``batch`` processes per call).
    handler: Handler | BatchHandler | None = attrs.field(validator=_handler)
    concurrency: int = attrs.field(validator=whole_field(1))
    max_attempts: int = attrs.field(validator=whole_field())
    backoff: float = attrs.field(validator=seconds_field())
    backoff_max: float = attrs.field(validator=seconds_field())
    balance: bool = True
    rebalance: bool = True
    # seconds a handler may run (0: no limit)
    timeout: float = attrs.field(default=0.0, validator=seconds_field())
    # seconds results are kept (0: not kept)
    result_ttl: float = attrs.field(default=0.0, validator=seconds_field())
    rate: tuple[int, int] | None = None  # at most (claims, per ms) across the mesh
    # 0: handler(process); n >= 1: handler(up to n processes)
    batch: int = attrs.field(default=0, validator=whole_field())
    # this worker's part of the queue's fair share (see _balance)
    capacity: int = attrs.field(default=1, validator=lambda _i, _a, c: check_capacity(c))
    # Processes claimed beyond ``concurrency``, held here until a slot frees
    # (0: none; plain handlers only).
    prefetch: int = attrs.field(default=0, validator=whole_field())

    def __attrs_post_init__(self) -> None:
        if self.batch > self.concurrency:
            raise ConfigError(
                f"batch ({self.batch}) is more than concurrency ({self.concurrency}), the "
                "most processes at once: a batch could never be full"
            )
        if self.prefetch and self.batch:
            raise ConfigError(
                "prefetch is for plain handlers: a batch handler already gets the processes "
                "claimed together (raise batch or concurrency instead)"
            )
        if self.backoff > self.backoff_max:
            raise ConfigError(
                f"need backoff <= backoff_max, got {self.backoff!r}, {self.backoff_max!r}"
            )

    def with_policy(self, p: QueuePolicy) -> QueueConfig:
        """This config under the queue's policy ``p``."""
        return attrs.evolve(
            self,
            max_attempts=p.max_attempts,
            backoff=p.backoff,
            backoff_max=p.backoff_max,
            timeout=p.timeout,
            result_ttl=p.result_ttl,
            rate=(p.rate_limit, round(p.rate_period * 1000)) if p.rate_limit > 0 else None,
        )


def describe_error(exc: BaseException, limit: int = 2000) -> str:
    """An exception as ``Type: message``, on one line, at most ``limit``
    characters: what a dead-letter record keeps of a failure."""
    msg = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def result_bytes(value: object, p: Process) -> bytes | None:
    """A handler's return value as a result to keep: bytes (``str`` as
    UTF-8) or None. Anything else is logged and kept as None."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    log.warning(
        "queue %s: the handler of process %s returned a %s; only bytes, str or None are "
        "kept as results (kept as None)",
        p.queue,
        p.id,
        type(value).__name__,
    )
    return None


class _Slot:
    """One process run here: queued for a handler trio task of the pool,
    then running in that trio task's cancel scope."""

    __slots__ = (
        "batch", "cancel_requested", "dropped", "hit", "process", "scope", "started", "stopping",
    )  # fmt: skip

    def __init__(self, process: Process, started: float, batch: _Batch | None = None) -> None:
        self.process = process
        # The scope the handler runs in, once a pool trio task took it.
        self.scope: trio.CancelScope | None = None
        self.started = started  # when it was claimed (trio's clock)
        # True once the handler was cancelled to hand its process back (a
        # stop), not because the process was cancelled in the mesh.
        self.stopping = False
        self.cancel_requested = False
        self.batch = batch
        # Of a batch call: cancelled in the mesh while the call goes on, so
        # no longer run here (see QueueRunner._cancel_slot).
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


def _cancel(scope: trio.CancelScope, reason: str | None) -> None:
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


#: At most this many processes per claim (claim.lua takes up to 1,000): a
#: script holds up every client of Redis while it runs, heartbeats included,
#: and a claim costs Redis about 15 us per persistent task. Fifty survivors of
#: a mass failure each claiming 1,000 at once held Redis for seconds on a
#: loaded machine; in claims of 250, another client's heartbeat waits behind
#: at most one claim of each, a quarter as long.
CLAIM_MAX = 250

#: A claim reply with more processes than this starts their handlers this
#: many at a time, one event loop batch after another (see :func:`_paced`).
START_CHUNK = 100

_STARTING: trio.lowlevel.RunVar[trio.Lock] = trio.lowlevel.RunVar("mesh_starting")


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
    (:meth:`QueueRunner._fan_out`): the next chunk is queued once
    ``waiting()`` says the pool took the last one (or could not take more),
    or after a few batches whatever it says."""
    try:
        lock = _STARTING.get()
    except LookupError:
        lock = trio.Lock()
        _STARTING.set(lock)
    with trio.CancelScope(shield=True):
        async with lock:
            for i in range(0, len(items), START_CHUNK):
                queue(items[i : i + START_CHUNK])
                # until the pool took the chunk (its first handler to yield
                # hands the others out; a few batches at most), and one more
                # batch, in which the handlers handed out make their first step
                for _ in range(4):
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    if not waiting():
                        break
                await trio.lowlevel.cancel_shielded_checkpoint()


class _Stop(Exception):
    """Sent to a parked pool trio task: the runner is done, exit."""


@types.coroutine
def _in_context(
    ctx: contextvars.Context,
    coro: Generator[Any, Any, Any] | Awaitable[Any],
    runner: QueueRunner | None = None,
    first: Any = _NOTHING,
) -> Generator[Any, Any, Any]:
    """Await ``coro`` with each of its steps run in ``ctx``: a handler run by
    a long-lived pool trio task sees a fresh copy of the runner's context
    (what a trio task of its own would see), so what one handler sets in a
    context variable never leaks into the next one. Exceptions (Cancelled
    included) pass through unchanged. Each time the handler yields to trio
    (it blocks, or passes a checkpoint), the processes still queued on
    ``runner`` are handed to pool trio tasks of their own
    (:meth:`QueueRunner._fan_out`). ``first``: what the coroutine yielded
    at its first step, taken already by the caller (see
    :meth:`QueueRunner._run_one`)."""
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
        if runner is not None and runner._queued:
            runner._fan_out()
        try:
            arg = yield msg
            send = c.send
        except BaseException as exc:  # thrown in by trio: forward it
            send, arg = c.throw, exc


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
        # With min_replicas: waits until a claim is on the replicas (WAIT)
        # before its persistent tasks' handlers start.
        self._replicate = replicate
        self._conn = conn
        self._binding = binding
        self._wid = worker_id
        self._inc = incarnation
        self.config = config
        self._counters = counters
        self._on_fenced = on_fenced
        self.running: dict[str, _Slot] = {}
        self._done: list[str] = []
        self._failed: list[str] = []
        # process id -> (payload, return value) of each finished process not
        # yet reported, on a queue that keeps results
        self._results: dict[str, tuple[bytes, bytes | None]] = {}
        # process id -> (payload, error) of each failure not yet reported
        self._fail_info: dict[str, tuple[bytes, str]] = {}
        # Processes whose handler exited after a stop cancelled it: handed
        # back unharmed (no attempt counted) by the loop, in batches.
        self._returned: list[str] = []
        self._stopping = False
        # The handlers a stop has yet to cancel, and when the next group is due.
        self._stop_order: deque[_Slot] = deque()
        self._cancel_at = math.inf
        self._pull = 0  # tasks to ask peers for (rebalance), 0: none
        # (held weight, total weight, total capacity) when a request marked
        # nothing: not asked again until one of them changes
        self._fruitless: tuple[int, int, int] | None = None
        self._servers: list[str] = []  # the queue's servers, as last learned
        self.policy = BalancePolicy()
        self._io_scope: trio.CancelScope | None = None
        self.handed_back = 0
        """How many processes this runner handed back after a stop."""
        self.keep_ms = 0
        """> 0: a stop keeps persistent tasks reserved for this worker id for
        that long (a sticky restart), instead of handing them to anyone."""
        self._maybe_work = True
        self._resync_needed = False
        # Processes Redis may hold for us that this runner does not count
        # right now: those of reports in flight (they leave Redis when the
        # report runs) and up to n of a claim in flight (its reply, not yet
        # here). The heartbeat's held count may exceed ours by that much.
        self._unsure = 0
        self._next_due = float("inf")
        self._wakeup = trio.Event()
        self._scope = trio.CancelScope()
        self._exited = trio.Event()
        self._balance_wait = balance_wait
        # 0.9 of it: the clocks of Redis and of this runner may differ by a
        # little, and a task held back at the start of the wait has waited
        # the whole of it when the runner claims again
        self._patience_ms = max(2, int(balance_wait * 900))
        self._ttl_ms = int(ttl * 1000)
        self._held_back_since: float | None = None
        self._early_cancels = {} if early_cancels is None else early_cancels
        # why each failed process failed, until its give-back says what next
        self._why: dict[str, tuple[Process, str]] = {}
        self._due_drawn: tuple[int, bool] = (-1, False)
        # The handler pool: long-lived trio tasks (at most concurrency), each
        # running one process (or one batch call) after the other, so that
        # starting a process costs a reschedule, not a trio task and a cancel
        # scope (see _serve). Idle ones are parked in _idle; work that finds
        # none idle and the pool full waits in _queued.
        self._idle: list[trio.lowlevel.Task] = []
        self._queued: deque[_Slot | _Batch] = deque()
        self._pool = 0
        self._handlers: trio.Nursery | None = None
        self._ctx = contextvars.copy_context()
        # trio's clock, read without trio.current_time()'s two calls around
        # it (set when the loop starts)
        self._now: Callable[[], float] = trio.current_time
        # Whether handler runs get spans (asked once per claimed batch).
        self._traced = False

    # --- signals from the worker (sync, no I/O) ----------------------------

    def nudge(self) -> None:
        """There may be tasks to claim."""
        self._maybe_work = True
        self._wakeup.set()

    def wake_in(self, seconds: float) -> None:
        """A task becomes due for a retry in ``seconds``."""
        self._next_due = min(self._next_due, trio.current_time() + seconds)
        self._wakeup.set()

    def retry_due(self, due_ms: int, seconds: float, idle_servers: int) -> None:
        """The heartbeat says a delayed task of this queue is due at
        ``due_ms`` (Redis clock), ``seconds`` from now. Every server of the
        queue hears it, and if all claimed at that moment all but one would
        claim in vain: each acts with probability ``HERD / idle_servers``,
        drawn once per due time. One that does not act still claims at its
        first heartbeat after the due time (the task then counts as ready),
        and with many idle servers that heartbeat comes soon.
        """
        if self._due_drawn[0] != due_ms:
            act = idle_servers <= HERD or random.random() * idle_servers < HERD
            self._due_drawn = (due_ms, act)
        if self._due_drawn[1]:
            self.wake_in(seconds)

    def on_heartbeat(self, beat: QueueBeat) -> None:
        """What the worker's heartbeat says about this queue (sync, no I/O):
        re-check if Redis holds fewer processes than run here, claim if no
        wake could reach this runner, claim when tasks are ready or a
        delayed one comes due, hand back what a rebalance asked for (once
        each handler has exited), and ask for tasks when below the fair
        share (see :mod:`mesh._balance`)."""
        self.release(beat.release)
        c = self.config
        if c.balance and c.rebalance and c.handler is not None and not self._stopping:
            self._pull = pull_count(
                beat.weight,
                beat.persistent,
                beat.servers,
                beat.state == 0,
                self.policy,
                beat.capacity,
            )
            if self._pull and self._fruitless == (beat.weight, beat.persistent, beat.servers):
                # the last request found nothing that fits, and nothing changed
                self._pull = 0
            if self._pull:
                self._wakeup.set()
        self.check_held(beat.held)
        self.check_idle(beat.idle)
        if beat.state == 0:
            self.nudge()
        elif beat.state > 0:
            self.retry_due(beat.now_ms + beat.state, beat.state / 1000, beat.idle_servers)

    def cancel_process(self, pid: str) -> bool:
        """Cancel the handler of process ``pid`` (cancelled in the mesh); its
        outcome is not reported. Returns whether it ran here."""
        slot = self.running.get(pid)
        if slot is None:
            return False
        self._cancel_slot(slot)
        return True

    def _cancel_slot(self, slot: _Slot) -> None:
        """Cancel a process here that Redis no longer holds for us (cancelled
        in the mesh, or lost). One of a batch call whose other processes go
        on leaves ``running`` now (it is not ours, and not reported): the
        call's outcome for it is dropped."""
        slot.cancel(stopping=False)
        if self._unqueue(slot):
            return
        if slot.batch is not None and not slot.dropped:
            slot.dropped = True
            del self.running[slot.process.id]
            self._counters.cancelled += 1
            self._wakeup.set()

    def release(self, pids: Iterable[str]) -> None:
        """Hand these processes back for balance: their handlers are
        cancelled, and each process is handed back (reserved, by Redis, for
        the worker it moves to) once its handler has exited."""
        for pid in pids:
            slot = self.running.get(pid)
            if slot is not None and not slot.cancel_requested:
                slot.cancel(stopping=True, reason=MOVED)
                self._counters.moved_out += 1
                self._unqueue(slot)

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
        self._stopping = True
        if self._io_scope is not None:
            # A claim or report in flight gets STOP_IO_GRACE to come back,
            # then it is dropped (see _run): it was most likely written
            # already (the worker's connection writes at once), so its reply
            # says what it did (a finish report counted, a claim's processes
            # handed back unstarted) rather than leaving that unknown.
            io = self._io_scope
            io.deadline = min(io.deadline, trio.current_time() + STOP_IO_GRACE)
        # Handlers are cancelled STOP_CHUNK at a time (see _cancel_next), so
        # that each group is handed back while the next one exits: a peer
        # starts the first tasks after one group's exits and round trips, not
        # after all of them. What never started ends here at once.
        order = self._stop_order
        for slot in list(self.running.values()):
            if not slot.cancel_requested:
                if slot.scope is None:  # its handler has not started
                    slot.cancel(stopping=True)
                    self._unqueue(slot)
                else:
                    order.append(slot)
        self._cancel_next()
        if order:
            # The later groups by time, whatever the loop is doing (waiting
            # for Redis, say): every handler is cancelled within STOP_PACE
            # per group of the stop's start.
            try:
                if self._handlers is None:
                    raise RuntimeError("not running")
                self._handlers.start_soon(self._pace_stop, name=f"mesh stop {self.config.queue}")
            except RuntimeError:  # the loop is not running (its nursery closed): no pacing
                self._cancel_rest()
        self._wakeup.set()

    async def _pace_stop(self) -> None:
        """Cancel the stop's next group once STOP_PACE has passed since the
        last one (the loop cancels one sooner each time it hands a group
        back); ends when every handler of the stop is cancelled."""
        while self._stop_order:
            await trio.sleep_until(self._cancel_at)
            if trio.current_time() >= self._cancel_at:
                self._cancel_next()

    def _cancel_rest(self) -> None:
        """Cancel every handler the stop has not cancelled yet (sync, no I/O)."""
        self._cancel_next(len(self._stop_order))

    def _cancel_next(self, n: int = STOP_CHUNK) -> None:
        """Cancel the handlers of the next ``n`` processes of the stop, in
        the order they were claimed (sync, no I/O)."""
        order = self._stop_order
        while order and n > 0:
            slot = order.popleft()
            if slot.cancel_requested or self.running.get(slot.process.id) is not slot:
                continue  # cancelled in the mesh or ended meanwhile
            slot.cancel(stopping=True)
            self._unqueue(slot)
            n -= 1
        self._cancel_at = trio.current_time() + STOP_PACE

    @property
    def exited(self) -> bool:
        """Whether the loop ended (after a stop: every handler exited and every
        outcome was reported, or the loop was cancelled)."""
        return self._exited.is_set()

    async def wait_exited(self) -> None:
        """Wait until the loop has ended."""
        await self._exited.wait()

    # --- the loop ------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Claim and run until cancelled. Raises nothing but Cancelled: a fenced
        lease is reported through ``on_fenced`` and ends the loop."""
        self._now = trio.lowlevel.current_clock().current_time
        try:
            with self._scope:
                await self._run(task_status)
        finally:
            # Handlers that returned or raised before the loop was stopped
            # still get their outcome reported (shielded, bounded): otherwise
            # leaving or stop_work() would hand a finished task back to its
            # queue and it would run again. What is not reported in time is
            # handed back, as before.
            if self._done or self._failed or self._returned:
                with trio.move_on_after(self._balance_wait) as cs:
                    cs.shield = True
                    try:
                        await self._report()
                    except (MeshConnectionError, CommandError, FencedError):
                        pass
            self._exited.set()

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
        with trio.move_on_after(grace):
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

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        async with trio.open_nursery() as handlers:
            self._handlers = handlers
            task_status.started()
            backoff = 0.02
            # begin_stop() gives this scope a deadline: a claim or report in
            # flight then is dropped if it does not come back within
            # STOP_IO_GRACE (a report is sent again while stopping; what a
            # dropped claim took stays held, and is handed back by unserve or
            # the worker's retirement). One scope for every turn while
            # serving, not one per turn: entering and leaving a trio cancel
            # scope costs about as much as a no-op handler run.
            with trio.CancelScope() as self._io_scope:
                while not self._stopping:
                    backoff = await self._step(handlers, backoff)
            self._io_scope = None
            await self._drain()
            while not await self._stop_step():
                pass
            # Every handler has exited: end the idle pool.
            self._end_pool()

    async def _step(self, handlers: trio.Nursery, backoff: float) -> float:
        """One turn of the loop while serving; returns the next error backoff."""
        try:
            if self._resync_needed:
                await self._resync()
            if self._failed:
                await self._give_back_failed()
            if self.config.prefetch:
                self._hand_back_stuck()
            if self._returned:
                await self._give_back_returned()
            # Finished processes left self.running when their handler
            # ended: their slots count as free, and the finish report
            # goes out with the claim, ahead of it.
            free = self._free()
            if self._next_due <= trio.current_time():
                self._next_due = float("inf")
                self._maybe_work = True
            if free > 0 and self._maybe_work:
                await self._claim(handlers, min(free, CLAIM_MAX))
                return 0.02
            if self._pull:
                await self._rebalance()
            if self._done:
                await self._finish()
        except FencedError as exc:
            self._on_fenced(str(exc))
            self.abort()
            return backoff
        except (MeshConnectionError, CommandError) as exc:
            # An unreachable Redis is reported once, by the heartbeat.
            log.log(
                logging.DEBUG if isinstance(exc, MeshConnectionError) else logging.WARNING,
                "queue %s: %s; retrying in %.2fs",
                self.config.queue,
                exc,
                backoff,
            )
            await trio.sleep(backoff)
            if isinstance(exc, MeshConnectionError):
                # until a re-check succeeds: it can lose its connection too
                self._resync_needed = True
            return min(backoff * 2, 1.0)
        if self._done or self._failed or self._returned:
            return backoff
        if self._next_due == math.inf:
            await self._wakeup.wait()
        else:
            with trio.move_on_at(self._next_due):
                await self._wakeup.wait()
        self._wakeup = trio.Event()
        return backoff

    async def _drain(self) -> None:
        """The first step of a stop: stop being one of the queue's servers
        (``drain.lua``) while still holding its processes, so that peers
        claim what is handed back next at once, their fair share no longer
        counting this worker (without it, a peer at its share would be held
        back for a heartbeat interval). One attempt, bounded by the
        heartbeat interval; on an error or timeout the stop goes on all the
        same, and the share catches up when the worker unserves or retires."""
        with trio.move_on_after(self._balance_wait) as cs:
            try:
                await self._binding.drain(self._conn, self._wid, self._inc, self.config.queue)
            except (MeshConnectionError, CommandError, FencedError) as exc:
                log.debug("queue %s: could not drain before the stop: %s", self.config.queue, exc)
                self._cancel_rest()
                return
        if cs.cancelled_caught:
            self._cancel_rest()

    async def _stop_step(self) -> bool:
        """One turn of the loop while stopping: report outcomes, hand back
        the processes whose handlers exited. Returns True once no handler is
        left and everything was reported."""
        if self._stop_order and self._returned:
            # The next group exits while the one before is handed back.
            self._cancel_next()
        try:
            if self._failed:
                await self._give_back_failed()
            if self._returned:
                await self._give_back_returned()
            if self._done:
                await self._finish()
        except FencedError as exc:
            self._on_fenced(str(exc))
            self.abort()
            return False
        except (MeshConnectionError, CommandError) as exc:
            log.log(
                logging.DEBUG if isinstance(exc, MeshConnectionError) else logging.WARNING,
                "queue %s: %s; retrying in %.2fs",
                self.config.queue,
                exc,
                0.1,
            )
            # No pacing while nothing can be handed back: every handler is
            # cancelled now, and its process waits in hand for Redis.
            self._cancel_rest()
            await trio.sleep(0.1)
            return False
        if not self.running and not (self._done or self._failed or self._returned):
            return True
        if self.running and not (self._done or self._failed or self._returned):
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        return False

    async def _claim(self, handlers: trio.Nursery, n: int) -> None:
        """Claim up to ``n`` tasks and start them; processes that finished
        since the last report are reported in the same round trip, before
        the claim runs. Each of the two is handled as if sent alone: a
        claim that went through is started even if the finish failed, and
        the other way round; then the error is raised (a FencedError first)."""
        c = self.config
        now = trio.current_time()
        # Fair share first; a worker held back by it claims again one
        # balance_wait later and then takes, beyond its share, the persistent
        # tasks that had no owner for (about) that long: peers below their
        # share had their chance. Decided in Redis by how long each task
        # waited, not by this runner's clock, so a task a stopping peer has
        # just handed back goes to the peers below their share first.
        held_back = self._held_back_since
        fair = c.balance
        waited = held_back is not None and now - held_back >= self._balance_wait
        # Clear the flag before the round trip: a nudge that arrives while the
        # claim is in flight (work enqueued after Redis ran it) sets it again
        # and must not be overwritten by this reply.
        self._maybe_work = False
        # Take the finished list before awaiting: handlers that end while it
        # is in flight append to a fresh one, for the next report.
        done, self._done = self._done, []
        b = self._binding
        claim = b.claim_call(
            self._wid,
            self._inc,
            c.queue,
            n,
            c.max_attempts,
            fair=fair,
            backoff_ms=int(c.backoff * 1000),
            backoff_cap_ms=int(c.backoff_max * 1000),
            ttl_ms=self._ttl_ms,
            rate=c.rate,
            patience_ms=self._patience_ms if waited else 0,
        )
        unsure = len(done) + n
        self._unsure += unsure
        try:
            if done:
                finished, claimed = await b.finish_and_claim(
                    self._conn, self._wid, self._inc, c.queue, done, claim, self._keep(done)
                )
            else:
                finished = None
                claimed = outcome.Value(await b.run(self._conn, claim))
            self._counters.claim.observe(trio.current_time() - now)
        except BaseException:
            # No reply (a connection error, an error reply to a claim sent
            # alone, a cancellation): report these again later. After a
            # connection error the loop re-checks what Redis holds for us.
            self._done = done + self._done
            self._maybe_work = True
            self._unsure -= unsure
            raise
        try:
            # Each reply is taken as if it had come alone: a claim that went
            # through is started even if the finish failed, and the other way
            # round; then the error is raised, a FencedError first.
            errors: list[MeshError] = []
            if finished is not None:
                try:
                    self._counters.finished += sum(finished.unwrap())
                except MeshError as exc:
                    self._done = done + self._done
                    errors.append(exc)
            try:
                reply = claimed.unwrap()
            except MeshError as exc:
                self._maybe_work = True
                errors.append(exc)
            else:
                if self._replicate is not None and any(p.persistent for p in reply.processes):
                    # Not replicated: not started. Redis holds them for us; the
                    # loop's resync (after this connection error) hands them back.
                    await self._replicate()
                items = self._start_claimed(reply, n, now, held_back)
                if len(items) <= START_CHUNK:
                    self._queue(items)
                else:
                    await _paced(self._queue, items, self._could_take)
            if errors:
                raise next((e for e in errors if isinstance(e, FencedError)), errors[0])
        finally:
            self._unsure -= unsure

    def _start_claimed(
        self,
        reply: ClaimReply,
        asked: int,
        now: float,
        held_back: float | None,
    ) -> list[_Slot | _Batch]:
        """Take a claim's reply: its processes run here from now on (in
        :attr:`running`: a cancel, a release or a stop reaches them); returns
        what to hand to the handler pool (:meth:`_dispatch`), which the
        caller does at once, or paced for a large claim (:func:`_paced`).

        A claim that took fewer than it asked for (and was not held back)
        put this worker in the queue's idle set: whoever makes tasks ready
        wakes it. One that took all it asked for did not, so this runner
        claims again as soon as a slot frees (in the same write as the
        finish report), whether or not anything is known to be queued."""
        c = self.config
        self._maybe_work = self._maybe_work or reply.remaining > 0 or len(reply.processes) >= asked
        if reply.held_back:
            if held_back is None:
                self._held_back_since = now
            self.wake_in(self._balance_wait)
        else:
            self._held_back_since = None
        if reply.next_due_ms >= 0:
            # a delayed task (a retry, or enqueued with a delay) comes due
            self.wake_in(reply.next_due_ms / 1000)
        size = c.batch
        batch: _Batch | None = None
        self._traced = _telemetry.tracer is not None and _telemetry.active()
        claimed = trio.current_time()
        items: list[_Slot | _Batch] = []
        for p in reply.processes:
            if self._early_cancels.pop(p.id, None) is not None:
                # Cancelled in the mesh before this reply reached us; Redis
                # no longer holds it for us, so there is nothing to report.
                self._counters.cancelled += 1
                continue
            if self._stopping:
                # Claimed while a stop began: never started, handed back.
                self._returned.append(p.id)
                continue
            self._counters.started += 1
            if not size:
                slot = self.running[p.id] = _Slot(p, claimed)
                items.append(slot)
                continue
            if batch is None or len(batch.slots) >= size:
                batch = _Batch()
                items.append(batch)
            slot = self.running[p.id] = _Slot(p, claimed, batch)
            batch.slots.append(slot)
        return items

    def _could_take(self) -> bool:
        """Whether queued work waits for a pool trio task that could take it."""
        return bool(self._queued) and (bool(self._idle) or self._pool < self.config.concurrency)

    def _queue(self, items: Sequence[_Slot | _Batch]) -> None:
        """Queue claimed work for the handler pool, and make sure a pool trio
        task takes it (sync, no I/O)."""
        self._queued.extend(items)
        self._kick()

    # --- the handler pool ----------------------------------------------------

    def _free(self) -> int:
        """How many processes this runner may claim now (a batch handler's
        calls are made of the processes claimed together, so ``concurrency``
        bounds the processes at once with either kind of handler). With
        ``prefetch``, up to that many more are claimed and wait here for a
        free slot, unless every slot runs a persistent task (whose handler
        may never end: nothing claimed beyond it could start)."""
        c = self.config
        if c.prefetch and not self._slots_stuck():
            return c.concurrency + c.prefetch - len(self.running)
        return c.concurrency - len(self.running)

    def _slots_stuck(self) -> bool:
        """Whether every slot runs the handler of a persistent task."""
        c = self.config
        if len(self.running) - len(self._queued) < c.concurrency:
            return False
        started = sum(
            1 for s in self.running.values() if s.scope is not None and s.process.persistent
        )
        return started >= c.concurrency

    def _hand_back_stuck(self) -> None:
        """Hand back, unharmed, the prefetched processes queued here while
        every slot runs a persistent task's handler (they could wait for
        ever; a peer with a free slot can run them)."""
        if self._queued and self._slots_stuck():
            while self._queued:
                slot = cast(_Slot, self._queued.popleft())
                del self.running[slot.process.id]
                self._returned.append(slot.process.id)

    def _unqueue(self, slot: _Slot) -> bool:
        """Take ``slot`` out of the queue for a handler if it waits there
        (claimed, its handler not started): its cancel or stop is then
        recorded at once rather than when a slot frees. Returns whether it
        was queued."""
        if slot.batch is not None or slot.scope is not None or not self._queued:
            return False
        try:
            self._queued.remove(slot)
        except ValueError:
            return False  # handed to a pool trio task already: it records it
        del self.running[slot.process.id]
        self._cancelled(slot)
        return True

    def _dispatch(self, item: _Slot | _Batch) -> None:
        """Hand a process (or a batch call) to an idle pool trio task, or to
        a new one while the pool is below ``concurrency``; else it waits for
        the first pool trio task that comes free (sync, no I/O)."""
        if self._idle:
            trio.lowlevel.reschedule(self._idle.pop(), outcome.Value(item))
        elif self._pool < self.config.concurrency and self._handlers is not None:
            self._pool += 1
            self._handlers.start_soon(self._serve, item, name=f"mesh handlers {self.config.queue}")
        else:
            self._queued.append(item)

    def _kick(self) -> None:
        """Work was queued: make sure a pool trio task takes it. One is
        woken (or started) for the first item; it runs the next ones after
        it, one after the other, as long as their handlers do not yield to
        trio; the first handler that does hands every item still queued to
        pool trio tasks of their own (:meth:`_fan_out`). So handlers that
        never block (or block late) cost one trio task switch per claimed
        batch rather than one per process, and handlers that block all run
        at once, one scheduling round later than their first one."""
        if self._queued and (self._idle or self._pool < self.config.concurrency):
            self._dispatch(self._queued.popleft())

    def _fan_out(self) -> None:
        """Hand every queued item to an idle or new pool trio task, while the
        pool has room (sync, no I/O)."""
        queued = self._queued
        while queued and (self._idle or self._pool < self.config.concurrency):
            self._dispatch(queued.popleft())

    def _end_pool(self) -> None:
        """Tell every parked pool trio task to exit (the runner is done)."""
        while self._idle:
            trio.lowlevel.reschedule(self._idle.pop(), outcome.Error(_Stop()))

    async def _park(self) -> _Slot | _Batch:
        """Wait, idle, until :meth:`_dispatch` hands this pool trio task work.

        Raises:
            _Stop: the runner is done. On cancellation nothing was handed.
        """
        task = trio.lowlevel.current_task()
        self._idle.append(task)

        def abort(_: Any) -> trio.lowlevel.Abort:
            self._idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        item: _Slot | _Batch = await trio.lowlevel.wait_task_rescheduled(abort)
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
                with trio.CancelScope() as scope:
                    while True:
                        if item is None:
                            item = self._queued.popleft() if self._queued else await self._park()
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
                    if self._stopping and not self._queued:
                        return  # nothing more for this pool trio task to run
        except _Stop:
            pass
        finally:
            self._pool -= 1

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
                self._fail(slot.process, self._timed_out())
            elif slot.stopping:
                self._returned.append(slot.process.id)
            else:
                self._counters.cancelled += 1
        self._wakeup.set()

    def _timed_out(self) -> str:
        return f"TimeoutError: the handler ran longer than {self.config.timeout:g} s"

    def _fail(self, p: Process, error: str, why: str | None = None) -> None:
        self._failed.append(p.id)
        self._fail_info[p.id] = (p.task, error)
        self._why[p.id] = (p, why or error)

    def _finished(self, p: Process, value: object) -> None:
        self._done.append(p.id)
        if self.config.result_ttl > 0:
            self._results[p.id] = (p.task, result_bytes(value, p))

    async def _run_one(self, scope: trio.CancelScope, slot: _Slot) -> None:
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
        if p.persistent and self.config.prefetch:
            self._wakeup.set()  # every slot may be stuck now: see _hand_back_stuck
        handler = cast(Handler, self.config.handler)
        timeout = self.config.timeout
        now = self._now
        began = now()
        if timeout > 0:
            scope.deadline = began + timeout
        try:
            coro = _telemetry.traced(handler, p) if self._traced else handler(p)
            ctx = self._ctx.copy()
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
            self._fail(p, describe_error(exc), _one_line(exc))
        else:
            self._finished(p, value)
        finally:
            del self.running[p.id]
            if timeout > 0:
                scope.deadline = math.inf
            self._counters.handler.observe(now() - began)
        # A slot is free: the loop claims again if it may (a runner that is
        # not in the queue's idle set must look by itself, or no one wakes it).
        self._wakeup.set()

    async def _run_batch(self, scope: trio.CancelScope, b: _Batch) -> None:
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
        began = trio.current_time()
        if timeout > 0:
            scope.deadline = began + timeout
        try:
            value = await _in_context(self._ctx.copy(), handler(procs), self)
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
            self._counters.handler.observe(trio.current_time() - began)
        for slot, out in zip(live, outcomes, strict=True):
            p = slot.process
            if slot.dropped:
                continue  # cancelled in the mesh meanwhile: not ours to report
            if isinstance(out, BaseException):
                self._fail(p, describe_error(out), _one_line(out))
            else:
                self._finished(p, out)
        self._wakeup.set()

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

    def _keep(self, done: list[str]) -> ResultsToKeep | None:
        """The results to keep with the finish report of ``done`` (None: a
        queue without a result TTL, or a result missing). Forgets those of
        processes reported already."""
        if not self._results:
            return None
        pending = set(done) | set(self._done)
        for pid in [pid for pid in self._results if pid not in pending]:
            del self._results[pid]
        ttl_ms = round(self.config.result_ttl * 1000)
        if ttl_ms < 1 or any(pid not in self._results for pid in done):
            return None
        return ResultsToKeep(ttl_ms, {pid: self._results[pid] for pid in done})

    async def _report(self) -> None:
        """Report every outcome in hand, without claiming."""
        if self._done:
            await self._finish()
        if self._failed:
            await self._give_back_failed()
        if self._returned:
            await self._give_back_returned()

    async def _finish(self) -> None:
        # Take the list before awaiting: handlers that end while a report is
        # in flight append to a fresh list, for the next report. On an error
        # the taken ones go back, to be reported again.
        done, self._done = self._done, []
        self._unsure += len(done)
        try:
            results = await self._binding.finish(
                self._conn, self._wid, self._inc, self.config.queue, done, self._keep(done)
            )
        except BaseException:
            self._done = done + self._done
            raise
        finally:
            self._unsure -= len(done)
        self._counters.finished += sum(results)

    async def _give_back_failed(self) -> None:
        c = self.config
        failed, self._failed = self._failed, []
        self._unsure += len(failed)
        try:
            outcomes = await self._binding.give_back(
                self._conn,
                self._wid,
                c.queue,
                failed,
                failed=True,
                backoff_ms=int(c.backoff * 1000),
                backoff_cap_ms=int(c.backoff_max * 1000),
                errors=[self._fail_info.get(pid, (b"", ""))[1] for pid in failed],
            )
        except BaseException:
            self._failed = failed + self._failed
            raise
        finally:
            self._unsure -= len(failed)
        # Outcome 0: no longer ours (recycled or cancelled meanwhile), so
        # nothing of this failure was recorded: not counted as failed.
        self._counters.failed += sum(1 for result, _ in outcomes if result)
        for pid, (result, delay) in zip(failed, outcomes, strict=True):
            self._fail_info.pop(pid, None)
            self._log_failure(pid, result, delay)
            if result == 2:
                if delay > 0:
                    self.wake_in(delay / 1000)
                else:
                    self._maybe_work = True

    async def _rebalance(self) -> None:
        """Ask the peers above their share to hand tasks back to us."""
        n, self._pull = self._pull, 0
        n = min(n, self._free())
        if n <= 0:
            return
        reply, self._servers = await self._binding.rebalance(
            self._conn,
            self._wid,
            self._inc,
            self.config.queue,
            n,
            max(3 * self._ttl_ms, 2000),
            self._servers,
        )
        self._counters.pulled += reply.marked
        self._fruitless = None if reply.marked else (reply.held, reply.persistent, reply.servers)

    async def _give_back_returned(self) -> None:
        """Hand back, unharmed, the processes whose handlers a stop ended
        (their handlers have exited: no two owners)."""
        returned, self._returned = self._returned, []
        self._unsure += len(returned)
        try:
            outcomes = await self._binding.give_back(
                self._conn,
                self._wid,
                self.config.queue,
                returned,
                failed=False,
                keep_ms=self.keep_ms,
            )
        except BaseException:
            self._returned = returned + self._returned
            raise
        finally:
            self._unsure -= len(returned)
        back = sum(1 for result, _ in outcomes if result)
        self._counters.handed_back += back
        self.handed_back += back

    def _log_failure(self, pid: str, result: int, delay: int) -> None:
        """One line for a failed attempt: the queue, a preview of the payload,
        attempt n of max, why, and what happens next (its traceback was
        logged at DEBUG when the handler raised)."""
        entry = self._why.pop(pid, None)
        if entry is None:
            return
        p, why = entry
        n, limit = p.attempts + 1, self.config.max_attempts
        attempt = f"attempt {n}" if p.persistent or not limit else f"attempt {n} of {limit}"
        kind = "persistent task" if p.persistent else "task"
        if result == 3:
            log.warning(
                "queue %s: %s %s failed (%s): %s; dead-lettered",
                p.queue, kind, preview(p.task), attempt, why,
            )  # fmt: skip
            return
        if result == 0:
            nxt = "it was no longer this worker's (recycled or cancelled meanwhile)"
        elif result == 1 or delay <= 0:
            nxt = "retrying now"
        else:
            nxt = f"retrying in {delay / 1000:.3g} s"
        log.warning(
            "queue %s: %s %s failed (%s): %s; %s", p.queue, kind, preview(p.task), attempt, why, nxt
        )

    async def _resync(self) -> None:
        """Make what this runner runs agree with what Redis says it holds on
        this queue. Held in Redis but not run here (a claim whose reply was
        lost, a finish lost in a failover): handed back, and run again. Run
        here but no longer held (lost by Redis, e.g. a failover that dropped
        writes; the task may have a new owner by now): its handler is
        cancelled. A connection or command error propagates and the loop
        tries again."""
        reply = await self._conn.execute(
            "SMEMBERS", self._binding.keys.held(self._wid, self.config.queue)
        )
        held = {pid.decode() for pid in reply}
        ours = set(self.running) | set(self._done) | set(self._failed) | set(self._returned)
        lost = sorted(held - ours)
        if lost:
            self._unsure += len(lost)
            try:
                await self._binding.give_back(
                    self._conn, self._wid, self.config.queue, lost, failed=False
                )
            finally:
                self._unsure -= len(lost)
            log.info(
                "queue %s: handed back %d processes Redis held for this worker and it did not run "
                "(a claim reply or a finish lost)",
                self.config.queue,
                len(lost),
            )
        ghosts = [pid for pid in self.running if pid not in held]
        for pid in ghosts:
            log.warning(
                "queue %s: process %s is no longer held in Redis; cancelling it",
                self.config.queue,
                pid,
            )
            self._cancel_slot(self.running[pid])
        self._resync_needed = False
        self._maybe_work = True

    def check_idle(self, in_idle_set: bool) -> None:
        """The heartbeat saw whether Redis has this runner's worker in the
        queue's idle set. With a free slot, not held back by the fair share
        and not about to claim anyway, a runner that is not there would never
        be woken (its wake was popped, and the message lost): claim, which
        puts it back if there is nothing to take."""
        if (
            not in_idle_set
            and not self._maybe_work
            and self._held_back_since is None
            and self._free() > 0
        ):
            self.nudge()

    def check_held(self, held_in_redis: int) -> None:
        """The heartbeat saw ``held_in_redis`` processes of this queue held by
        us in Redis. Fewer than we run means some were lost (their handlers
        are stopped); more than we run, beyond what reports and a claim in
        flight may account for, means Redis holds processes nobody runs here
        (a finish or a hand-back lost in a failover, a claim whose reply was
        lost): they are handed back. Either way: re-check (:meth:`_resync`,
        one SMEMBERS), only on such a mismatch."""
        ours = len(self.running) + len(self._done) + len(self._failed) + len(self._returned)
        if held_in_redis < ours or held_in_redis > ours + self._unsure:
            self._resync_needed = True
            self._wakeup.set()
