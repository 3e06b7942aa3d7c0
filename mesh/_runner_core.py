"""The runner's decisions, with no I/O: what a :class:`~mesh._runner.QueueRunner`
claims and how many, which outcomes it reports, when it asks peers for tasks
(a rebalance pull), when it re-checks what Redis holds for it, how a stop
cancels its handlers (:data:`STOP_CHUNK` at a time, paced by time), how
long it waits after an error, and how far it pipelines (claims beyond its
concurrency while handlers are short and the queue has a backlog, see
:meth:`RunnerCore.pipeline`).

Plain code, in the manner of h11's ``_state.py``: no trio, no Redis, no clock
but the ``now`` (seconds, trio's clock in the runner) each call is given. The
runner's loop (:mod:`mesh._runner`) asks :meth:`RunnerCore.next_action` what
to do, does it through the protocol binding, and feeds the replies back here;
the handler pool (:mod:`mesh._pool`) records each handler's outcome in
:class:`Outcomes`. Nothing here raises but on a programming error.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import random
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from ._balance import BalancePolicy, pull_count
from ._queue_config import QueueConfig
from ._replies import DEAD_ERROR_MAX, ClaimReply, QueueBeat, RebalanceReply, ResultsToKeep
from ._stats import QueueCounters, _Timing
from ._types import Process

__all__ = [
    "BACKOFF_MAX",
    "BACKOFF_MIN",
    "CLAIM_MAX",
    "DEPTH_MAX",
    "EWMA",
    "HERD",
    "HOLD_MAX",
    "LONG_MIN",
    "LONG_RTTS",
    "SHORT_RTTS",
    "STOP_CHUNK",
    "STOP_PACE",
    "STOP_RETRY",
    "Action",
    "Outcomes",
    "RunnerCore",
    "describe_error",
    "failure_line",
    "preview",
    "result_bytes",
]

log = logging.getLogger("mesh.worker")

#: About this many idle servers of a queue act on a delayed task's due time.
HERD = 3

#: A stop cancels its handlers this many at a time, and hands each group back
#: while the next one exits (:meth:`RunnerCore.stop_group`) ...
STOP_CHUNK = 100
#: ... the next group at the latest this long after the one before, whatever
#: became of it (a group of slow cleanups holds up no other handler's stop).
STOP_PACE = 0.01

#: At most this many processes per claim (claim.lua takes up to 1,000): a
#: script holds up every client of Redis while it runs, heartbeats included,
#: and a claim costs Redis about 15 us per persistent task. Fifty survivors of
#: a mass failure each claiming 1,000 at once held Redis for seconds on a
#: loaded machine; in claims of 250, another client's heartbeat waits behind
#: at most one claim of each, a quarter as long.
CLAIM_MAX = 250

#: Adaptive pipelining (``prefetch=None``, the default): while the last claim
#: found a backlog, the runner claims beyond ``concurrency`` about as many
#: processes as its slots run in one claim round trip, so that the next claim
#: is in flight while the current batch runs (:meth:`RunnerCore.pipeline`):
#: none while handlers take more than this many round trips on average ...
SHORT_RTTS = 2.0
#: ... at most this many times ``concurrency`` (claims of about three times
#: ``concurrency``: the per-call costs of Redis and of the worker shared by
#: three times as many processes; measured at concurrency 10, x0.85 Redis
#: and worker CPU per task against claims of twice ``concurrency``) ...
DEPTH_MAX = 5
#: ... and never so many that the runner holds more than this many processes
#: (claimed and in flight): a claim of this many already shares a round trip's
#: costs among enough processes; beyond it, measured, a runner gains nothing
#: and Redis spends more per process (at concurrency 100: none beyond).
HOLD_MAX = 100
#: A handler that has run this many round trips (and at least
#: :data:`LONG_MIN` seconds) is long: while every slot runs a long (or a
#: persistent) handler, nothing is claimed beyond ``concurrency`` and what
#: waits for a slot is handed back (:meth:`RunnerCore.slots_stuck`).
LONG_RTTS = 4.0
LONG_MIN = 0.002
#: The weight of the newest round trip's figures in the running means of the
#: claim round trip and of the handlers' run time.
EWMA = 0.25

#: Seconds between tries after a connection or command error while serving:
#: from the first, doubled each time up to the last; a claim that goes
#: through starts again from the first.
BACKOFF_MIN = 0.02
BACKOFF_MAX = 1.0
#: Seconds between tries after an error while stopping.
STOP_RETRY = 0.1


class Action(enum.Enum):
    """What the runner's loop does next (:meth:`RunnerCore.next_action`)."""

    RESYNC = "resync"  # re-check what Redis holds for us (SMEMBERS)
    FAILED = "failed"  # report the failures in hand (give_back.lua)
    RETURNED = "returned"  # hand back, unharmed, what a stop or a release ended
    CLAIM = "claim"  # claim (with the finish report in hand, one round trip)
    PULL = "pull"  # ask the peers above their share for tasks (rebalance.lua)
    FINISH = "finish"  # report the finished processes in hand (finish.lua)
    WAIT = "wait"  # nothing to do until woken (or the next due time)
    EXIT = "exit"  # stopped: no handler left, nothing in hand


# The actions as plain module names: an Enum member read through its class
# costs about ten times a global's, and next_action runs once per turn.
_RESYNC, _FAILED, _RETURNED, _CLAIM = Action.RESYNC, Action.FAILED, Action.RETURNED, Action.CLAIM
_PULL, _FINISH, _WAIT, _EXIT = Action.PULL, Action.FINISH, Action.WAIT, Action.EXIT


def _mean(
    old: float | None, timing: _Timing, seen: tuple[int, float], count: int | None = None
) -> float:
    """The running mean ``old`` (None: none yet) moved :data:`EWMA` of the
    way to the mean of what ``timing`` observed since ``seen`` (its count
    and total then; ``count``: its count now, if known); ``old`` (0 if None)
    if it observed nothing since."""
    n = sum(timing.counts) if count is None else count
    if n <= seen[0]:
        return 0.0 if old is None else old
    window = (timing.sum - seen[1]) / (n - seen[0])
    return window if old is None else old + EWMA * (window - old)


def failure_line(p: Process, why: str, max_attempts: int, result: int, delay_ms: int) -> str:
    """The one line logged for a failed attempt: the queue, a preview of the
    payload, attempt n (of max), why, and what happens next, from
    give_back.lua's ``result`` for it (0: no longer ours, 1: queued again,
    2: retried in ``delay_ms``, 3: dead-lettered)."""
    n = p.attempts + 1
    attempt = (
        f"attempt {n}" if p.persistent or not max_attempts else f"attempt {n} of {max_attempts}"
    )
    kind = "persistent task" if p.persistent else "task"
    if result == 3:
        nxt = "dead-lettered"
    elif result == 0:
        nxt = "it was no longer this worker's (recycled or cancelled meanwhile)"
    elif result == 1 or delay_ms <= 0:
        nxt = "retrying now"
    else:
        nxt = f"retrying in {delay_ms / 1000:.3g} s"
    return f"queue {p.queue}: {kind} {preview(p.task)} failed ({attempt}): {why}; {nxt}"


class Outcomes:
    """The outcomes in hand, not yet reported: finished (with the results
    to keep, on a queue that keeps them), failed (with why), and returned
    (handed back unharmed: a stop or a release ended their handlers).

    A report takes its list (``take_*``) before its round trip, so that
    handlers ending meanwhile add to a fresh one; on an error the loop puts
    the taken ones back (``restore_*``), to be reported again."""

    __slots__ = ("done", "fail_info", "failed", "result_ttl", "results", "returned", "why")

    def __init__(self, result_ttl: float) -> None:
        self.result_ttl = result_ttl
        self.done: list[str] = []
        self.failed: list[str] = []
        self.returned: list[str] = []
        # process id -> (payload, return value) of each finished process not
        # yet reported, on a queue that keeps results
        self.results: dict[str, tuple[bytes, bytes | None]] = {}
        # process id -> (payload, error) of each failure not yet reported
        self.fail_info: dict[str, tuple[bytes, str]] = {}
        # why each failed process failed, until its give-back says what next
        self.why: dict[str, tuple[Process, str]] = {}

    def in_hand(self) -> bool:
        """Whether any outcome waits to be reported."""
        return bool(self.done or self.failed or self.returned)

    def count(self) -> int:
        """How many outcomes wait to be reported."""
        return len(self.done) + len(self.failed) + len(self.returned)

    def ids(self) -> set[str]:
        """The process ids of every outcome in hand."""
        return set(self.done) | set(self.failed) | set(self.returned)

    def finished(self, p: Process, value: object) -> None:
        """``p``'s handler returned ``value``."""
        self.done.append(p.id)
        if self.result_ttl > 0:
            self.results[p.id] = (p.task, result_bytes(value, p))

    def fail(self, p: Process, error: str, why: str | None = None) -> None:
        """``p``'s handler failed: ``error`` is recorded with the task, ``why``
        (``error`` if None) goes in the log line."""
        self.failed.append(p.id)
        self.fail_info[p.id] = (p.task, error)
        self.why[p.id] = (p, why or error)

    def take_done(self) -> list[str]:
        """The finished processes to report now (see the class docstring)."""
        done, self.done = self.done, []
        return done

    def restore_done(self, done: list[str]) -> None:
        """A finish report of ``done`` did not go through: report them again."""
        self.done = done + self.done

    def keep(self, done: list[str]) -> ResultsToKeep | None:
        """The results to keep with the finish report of ``done`` (None: a
        queue without a result TTL, or a result missing). Forgets those of
        processes reported already."""
        if not self.results:
            return None
        pending = set(done) | set(self.done)
        for pid in [pid for pid in self.results if pid not in pending]:
            del self.results[pid]
        ttl_ms = round(self.result_ttl * 1000)
        if ttl_ms < 1 or any(pid not in self.results for pid in done):
            return None
        return ResultsToKeep(ttl_ms, {pid: self.results[pid] for pid in done})

    def take_failed(self) -> tuple[list[str], list[str]]:
        """The failed processes to report now, and the error of each."""
        failed, self.failed = self.failed, []
        return failed, [self.fail_info.get(pid, (b"", ""))[1] for pid in failed]

    def restore_failed(self, failed: list[str]) -> None:
        """A failure report of ``failed`` did not go through: report them again."""
        self.failed = failed + self.failed

    def take_returned(self) -> list[str]:
        """The processes to hand back unharmed now."""
        returned, self.returned = self.returned, []
        return returned

    def hand_back(self, pid: str) -> None:
        """``pid``'s handler ended unharmed (a stop or a release ended it, or
        it never started): hand it back."""
        self.returned.append(pid)

    def restore_returned(self, returned: list[str]) -> None:
        """A hand-back of ``returned`` did not go through: hand them back again."""
        self.returned = returned + self.returned


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


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


#: A failure's first line (``Type: message``) is cut to this many characters.
ERROR_HEAD = 500

_MESH_DIR = os.path.dirname(os.path.abspath(__file__))


def describe_error(exc: BaseException, limit: int = DEAD_ERROR_MAX) -> str:
    """What a dead-letter record and a job's attempt history keep of a
    failure, at most ``limit`` bytes (UTF-8) in all: ``Type: message`` on
    the first line (at most :data:`ERROR_HEAD` characters), then, when the
    exception has one, its traceback (the mesh's own frames above the
    handler left out), its innermost lines kept when the whole would not
    fit. The readers split the two at the first newline
    (:attr:`DeadLetter.error` and :attr:`DeadLetter.traceback`)."""
    head = one_line(exc)
    if len(head) > ERROR_HEAD:
        head = head[: ERROR_HEAD - 3] + "..."
    room = limit - len(head.encode()) - 1
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and _is_mesh(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if tb is None or room < 200:
        return head
    te = traceback.TracebackException(type(exc), exc, tb)
    lines = list(te.format())
    del lines[len(lines) - len(list(te.format_exception_only())) :]  # the head says it
    text = "".join(_short(line) for line in [*lines, head]).rstrip().encode()
    if len(text) > room:
        cut = text[len(text) - room + len(_CUT) :]
        cut = cut[cut.find(b"\n") + 1 :] if b"\n" in cut else cut
        text = _CUT + cut
    return head + "\n" + text.decode(errors="ignore")


_CUT = b"  ...\n"


def _short(chunk: str, width: int = 300) -> str:
    """Each line of ``chunk`` cut to ``width`` characters (a long message
    or source line, which the innermost lines must not be cut for)."""
    return "".join(
        line if len(line) <= width else line[: width - 4] + "...\n"
        for line in chunk.splitlines(keepends=True)
    )


def _is_mesh(filename: str) -> bool:
    return os.path.dirname(os.path.abspath(filename)) == _MESH_DIR


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


class RunnerCore:
    """Every decision of one queue's runner (see the module docstring).

    The loop tells it what happened (a heartbeat, a claim's reply, a report
    that went through or failed, a stop) and asks it what to do next; the
    handler pool records outcomes in :attr:`out`. ``now`` is always given by
    the caller, in seconds (trio's clock in the runner)."""

    def __init__(
        self,
        config: QueueConfig,
        counters: QueueCounters,
        balance_wait: float = 1.0,
        ttl: float = 0.0,
    ) -> None:
        self.config = config
        self.counters = counters
        self.out = Outcomes(config.result_ttl)
        # There may be tasks to claim (a nudge, a full claim, an error).
        self.maybe_work = True
        # When a delayed task (or the fair share's patience) comes due.
        self.next_due = math.inf
        # When to look again whether every slot is stuck (see slots_stuck):
        # a timer of its own, as next_due is consumed by the claim it
        # starts (a look again merged into it was lost when an earlier due
        # time fired first, and prefetched work then waited behind a long
        # handler until it ended).
        self.look_at = math.inf
        self.stopping = False
        # The handlers a stop has yet to cancel (process ids, in the order
        # they were claimed), and when the next group is due at the latest.
        self.stop_order: deque[str] = deque()
        self.cancel_at = math.inf
        self.pull = 0  # tasks to ask peers for (rebalance), 0: none
        # (held weight, total weight, total capacity) when a request marked
        # nothing: not asked again until one of them changes
        self.fruitless: tuple[int, int, int] | None = None
        self.servers: list[str] = []  # the queue's servers, as last learned
        self.policy = BalancePolicy()
        self.resync_needed = False
        # Processes Redis may hold for us that this runner does not count
        # right now: those of reports in flight (they leave Redis when the
        # report runs) and up to n of a claim in flight (its reply, not yet
        # here). The heartbeat's held count may exceed ours by that much.
        self.unsure = 0
        self.backoff = BACKOFF_MIN
        self.balance_wait = balance_wait
        # 0.9 of it: the clocks of Redis and of this runner may differ by a
        # little, and a task held back at the start of the wait has waited
        # the whole of it when the runner claims again
        self.patience_ms = max(2, int(balance_wait * 900))
        self.ttl_ms = int(ttl * 1000)
        self.held_back_since: float | None = None
        self.due_drawn: tuple[int, bool] = (-1, False)
        # Adaptive pipelining (see pipeline()): how many processes to claim
        # beyond concurrency now; the running means of the claim round trip
        # and of a handler's run (None: none ran yet), in seconds; and the
        # (count, total) of each timing at the last claim reply.
        self.depth = 0
        self.rtt = 0.0
        self.handler_mean: float | None = None
        self._claims_seen = (0, 0.0)
        self._handlers_seen = (0, 0.0)

    # --- what to do next ----------------------------------------------------

    def next_action(self, now: float, free: int, running: int) -> tuple[Action, int]:
        """What the loop does next, and how many (for CLAIM and PULL), given
        ``free`` slots (see :func:`free_slots`) and ``running`` handlers.

        While serving: re-check what Redis holds if asked to, report
        failures, hand back what was returned, claim when there may be work
        and a slot is free (the finish report goes with the claim), else
        pull for the fair share, else report what finished; else WAIT (until
        :attr:`next_due`). While stopping: report failures, hand back,
        report what finished; WAIT while handlers run, EXIT once none does.
        """
        out = self.out
        if self.stopping:
            if out.failed:
                return _FAILED, 0
            if out.returned:
                return _RETURNED, 0
            if out.done:
                return _FINISH, 0
            return (_WAIT if running else _EXIT), 0
        if self.resync_needed:
            return _RESYNC, 0
        if out.failed:
            return _FAILED, 0
        if out.returned:
            return _RETURNED, 0
        if self.next_due <= now:
            self.next_due = math.inf
            self.maybe_work = True
        if free > 0 and self.maybe_work:
            return _CLAIM, min(free, CLAIM_MAX)
        if self.pull:
            n, self.pull = min(self.pull, free), 0
            if n > 0:
                return _PULL, n
        if out.done:
            return _FINISH, 0
        return _WAIT, 0

    def failed_turn(self, connection: bool) -> float:
        """A turn failed with a connection error (``connection``) or a
        command error: returns the seconds to wait before the next. While
        serving, the wait doubles each time (:data:`BACKOFF_MIN` up to
        :data:`BACKOFF_MAX`) and a connection error makes the loop re-check
        what Redis holds (the connection may have lost replies). While
        stopping, :data:`STOP_RETRY` (and the loop cancels every handler
        left at once: no pacing while nothing can be handed back)."""
        if self.stopping:
            return STOP_RETRY
        delay, self.backoff = self.backoff, min(self.backoff * 2, BACKOFF_MAX)
        if connection:
            self.resync_needed = True  # until a re-check succeeds
        return delay

    # --- signals ------------------------------------------------------------

    def nudge(self) -> None:
        """There may be tasks to claim (a work event, a wake)."""
        self.maybe_work = True

    def reconfigure(self, config: QueueConfig) -> None:
        """Serve by ``config`` from now on (a policy read from Redis): the next
        claim, report and result kept use it."""
        self.config = config
        self.out.result_ttl = config.result_ttl

    def wake_in(self, now: float, seconds: float) -> None:
        """A task becomes due in ``seconds``: claim then."""
        self.next_due = min(self.next_due, now + seconds)

    def retry_due(
        self, due_ms: int, idle_servers: int, draw: Callable[[], float] | None = None
    ) -> bool:
        """Whether to act on a delayed task due at ``due_ms`` (Redis clock)
        that every server of the queue hears of: with probability ``HERD /
        idle_servers``, drawn (``draw()``, :func:`random.random` if None) once
        per due time; always with at most :data:`HERD` idle servers."""
        if self.due_drawn[0] != due_ms:
            act = idle_servers <= HERD or (draw or random.random)() * idle_servers < HERD
            self.due_drawn = (due_ms, act)
        return self.due_drawn[1]

    def plan_pull(self, beat: QueueBeat, has_handler: bool) -> bool:
        """How many tasks to ask peers for after ``beat`` (see
        :mod:`mesh._balance`); returns whether to ask now."""
        c = self.config
        if not (c.balance and c.rebalance and has_handler) or self.stopping:
            return False
        self.pull = pull_count(
            beat.weight, beat.persistent, beat.servers, beat.state == 0, self.policy, beat.capacity
        )
        if self.pull and self.fruitless == (beat.weight, beat.persistent, beat.servers):
            # the last request found nothing that fits, and nothing changed
            self.pull = 0
        return self.pull > 0

    def pulled(self, reply: RebalanceReply, servers: list[str]) -> None:
        """A rebalance request came back, with the queue's ``servers`` as
        Redis has them now: one that marked nothing is not made again until
        the queue's figures change."""
        self.servers = servers
        self.counters.pulled += reply.marked
        self.fruitless = None if reply.marked else (reply.held, reply.persistent, reply.servers)

    def check_idle(self, in_idle_set: bool, free: int) -> bool:
        """Whether to claim because no wake could reach this runner: not in
        the queue's idle set, with a free slot, not held back by the fair
        share and not about to claim anyway."""
        return not in_idle_set and not self.maybe_work and self.held_back_since is None and free > 0

    def check_held(self, held_in_redis: int, running: int) -> bool:
        """Whether what Redis holds for us (``held_in_redis``) disagrees with
        what runs here and is in hand, beyond what reports and a claim in
        flight may account for; if so a re-check (RESYNC) is due."""
        ours = running + self.out.count()
        if held_in_redis < ours or held_in_redis > ours + self.unsure:
            self.resync_needed = True
            return True
        return False

    def resync(self, held: set[str], running: Iterable[str]) -> tuple[list[str], list[str]]:
        """What Redis holds for us (``held``) against what runs here: returns
        the ids held but neither run nor in hand (to hand back: a claim whose
        reply was lost, a finish lost in a failover) and those run but no
        longer held (lost by Redis: their handlers are cancelled)."""
        run = list(running)
        lost = sorted(held - set(run) - self.out.ids())
        return lost, [pid for pid in run if pid not in held]

    def resynced(self) -> None:
        """The re-check is done (what it found was handed back or
        cancelled): claim again."""
        self.resync_needed = False
        self.maybe_work = True

    # --- round trips in flight ------------------------------------------------

    def sending(self, n: int) -> None:
        """A report of ``n`` processes goes out: until it is answered, Redis
        may hold them while this runner no longer counts them (see
        :meth:`check_held`)."""
        self.unsure += n

    def answered(self, n: int) -> None:
        """The round trip of ``n`` processes (a report, or a claim with its
        report, see :meth:`claim_begin`) came back or failed, and what it
        brought is counted here again."""
        self.unsure -= n

    # --- claims -------------------------------------------------------------

    def claim_begin(self, now: float, in_flight: int = 0) -> tuple[float | None, int]:
        """A claim goes out now, with ``in_flight`` processes Redis may hold
        for us until it is answered (:meth:`answered`): those of the finish
        report with it and those it asks for. Returns when the runner was
        first held back by the fair share (None: it was not), and the
        patience in ms to ask for (0: the fair share holds; else, one balance
        wait after being held back, take the persistent tasks unowned for
        about that long)."""
        self.unsure += in_flight
        held_back = self.held_back_since
        waited = held_back is not None and now - held_back >= self.balance_wait
        # Cleared before the round trip: a nudge that arrives while the claim
        # is in flight sets it again, and this claim's reply must not undo it.
        self.maybe_work = False
        return held_back, self.patience_ms if waited else 0

    def claim_done(self) -> None:
        """A claim went through (and so did the report with it): the error
        backoff starts again from :data:`BACKOFF_MIN`."""
        self.backoff = BACKOFF_MIN

    def claim_lost(self) -> None:
        """A claim got no reply (or an error): claim again at the next turn."""
        self.maybe_work = True

    def claimed(self, reply: ClaimReply, asked: int, now: float, held_back: float | None) -> None:
        """A claim of ``asked`` came back. One that took fewer than it asked
        for (and was not held back) put this worker in the queue's idle set:
        whoever makes tasks ready wakes it. One that took all it asked for
        did not, so the runner claims again as soon as a slot frees. Held
        back by the fair share: claim again one balance wait later."""
        self.maybe_work = self.maybe_work or reply.remaining > 0 or len(reply.processes) >= asked
        if reply.held_back:
            if held_back is None:
                self.held_back_since = now
            self.wake_in(now, self.balance_wait)
        else:
            self.held_back_since = None
        if reply.next_due_ms >= 0:
            # a delayed task (a retry, or enqueued with a delay) comes due
            self.wake_in(now, reply.next_due_ms / 1000)
        if self.config.prefetch is None:
            self.pipeline(reply.remaining > 0 or len(reply.processes) >= asked)

    # --- adaptive pipelining --------------------------------------------------

    def pipeline(self, backlog: bool) -> int:
        """After a claim reply (``backlog``: the queue had more ready than it
        took, or as many as it asked for): update the running means of the
        claim round trip and of the handlers' run time from the queue's
        counters, and set :attr:`depth`, how many processes to claim beyond
        ``concurrency``: with a backlog, as many as the slots run in one
        round trip (``concurrency * rtt / handler_mean``), at most
        :data:`DEPTH_MAX` times ``concurrency`` and :data:`HOLD_MAX` in all;
        none while handlers take more than :data:`SHORT_RTTS` round trips on
        average, with an empty queue, before any handler ran, or with a
        batch handler. Returns the depth.

        With a depth, the runner claims again as soon as a claim's
        processes are handed to the pool, and that claim (with the last
        batch's finish report) is in flight while they run. Whatever the
        depth, at most ``concurrency`` handlers run at once, and
        :meth:`slots_stuck` stops it while every slot runs a long handler."""
        c, counters = self.config, self.counters
        seen = self._claims_seen
        self.rtt = _mean(self.rtt if seen[0] else None, counters.claim, seen)
        self._claims_seen = (sum(counters.claim.counts), counters.claim.sum)
        h = counters.handler
        n = sum(h.counts)
        if n > self._handlers_seen[0]:
            self.handler_mean = _mean(self.handler_mean, h, self._handlers_seen, n)
            self._handlers_seen = (n, h.sum)
        mean = self.handler_mean
        most = min(DEPTH_MAX * c.concurrency, HOLD_MAX - c.concurrency)
        if not backlog or mean is None or c.batch or most <= 0 or mean > SHORT_RTTS * self.rtt:
            self.depth = 0
        elif mean * most <= c.concurrency * self.rtt:
            self.depth = most
        else:
            self.depth = math.ceil(c.concurrency * self.rtt / mean)
        return self.depth

    def long_after(self) -> float:
        """Seconds after which a running handler counts as long (see
        :data:`LONG_RTTS`)."""
        return max(LONG_RTTS * self.rtt, LONG_MIN)

    def slots_stuck(self, now: float, handlers: Iterable[tuple[bool, float]]) -> tuple[bool, float]:
        """Whether every slot runs a handler that may not free it soon, given
        ``(persistent, began)`` for each handler running: a persistent
        task's (it may never end), and with adaptive pipelining one that has
        run :meth:`long_after` or longer. If so, nothing is claimed beyond
        ``concurrency`` and what waits for a slot is handed back (a peer with
        a free slot can run it). Also returns when to look again (inf:
        there is no need): when the last handler to start becomes long, if
        every slot is busy but not yet stuck."""
        c = self.config
        adaptive = c.prefetch is None
        long_before = now - self.long_after() if adaptive else -math.inf
        stuck = short = 0
        latest = -math.inf
        for persistent, began in handlers:
            if persistent or began <= long_before:
                stuck += 1
            else:
                short += 1
                latest = max(latest, began)
        if stuck >= c.concurrency:
            return True, math.inf
        if adaptive and short and stuck + short >= c.concurrency:
            return False, latest + self.long_after()
        return False, math.inf

    def to_start(
        self, processes: Sequence[Process], early_cancels: dict[str, float]
    ) -> Sequence[Process]:
        """Which of a claim's processes to start: not those cancelled in the
        mesh before the reply reached us (taken from ``early_cancels``; Redis
        no longer holds them for us, nothing to report), nor, while
        stopping, any (handed back unstarted)."""
        counters = self.counters
        if not early_cancels and not self.stopping:
            counters.started += len(processes)
            return processes
        start: list[Process] = []
        for p in processes:
            if early_cancels.pop(p.id, None) is not None:
                counters.cancelled += 1
            elif self.stopping:
                self.out.hand_back(p.id)
            else:
                start.append(p)
        counters.started += len(start)
        return start

    # --- reports ------------------------------------------------------------

    def failures_reported(
        self, now: float, failed: list[str], outcomes: Sequence[tuple[int, int]]
    ) -> list[str]:
        """The report of ``failed`` came back with give_back.lua's ``(result,
        delay_ms)`` for each: counts the recorded ones, claims again for a
        retry queued now or due later, and returns the line to log for each
        (see :func:`failure_line`)."""
        out = self.out
        # Result 0: no longer ours (recycled or cancelled meanwhile), so
        # nothing of this failure was recorded: not counted as failed.
        self.counters.failed += sum(1 for result, _ in outcomes if result)
        lines = []
        for pid, (result, delay) in zip(failed, outcomes, strict=True):
            out.fail_info.pop(pid, None)
            entry = out.why.pop(pid, None)
            if entry is not None:
                p, why = entry
                lines.append(failure_line(p, why, self.config.max_attempts, result, delay))
            if result == 2:
                if delay > 0:
                    self.wake_in(now, delay / 1000)
                else:
                    self.maybe_work = True
        return lines

    # --- stopping -----------------------------------------------------------

    def begin_stop(self, started: Iterable[str]) -> None:
        """Stop claiming; the handlers of ``started`` (ids, in claim order)
        are to be cancelled :data:`STOP_CHUNK` at a time (:meth:`stop_group`)."""
        self.stopping = True
        self.stop_order.extend(started)

    def stop_due(self, now: float) -> bool:
        """Whether the stop's next group is due by time (:data:`STOP_PACE`
        after the one before), whatever became of that one."""
        return bool(self.stop_order) and now >= self.cancel_at

    def stop_group(self, now: float, live: Callable[[str], bool], n: int = STOP_CHUNK) -> list[str]:
        """The next ``n`` processes of the stop whose handlers to cancel, in
        the order they were claimed, skipping those ``live`` says are not
        (cancelled in the mesh, or ended meanwhile). The group after it is due
        :data:`STOP_PACE` from ``now`` at the latest."""
        order = self.stop_order
        group: list[str] = []
        while order and len(group) < n:
            pid = order.popleft()
            if live(pid):
                group.append(pid)
        self.cancel_at = now + STOP_PACE
        return group
