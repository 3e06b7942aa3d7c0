"""Browsing a queue's jobs one by one: what :meth:`Client.jobs`,
:meth:`Client.job`, ``mesh jobs``/``mesh job`` and the dashboard's queue page
read, and the per-minute counts of the dashboard's charts.

Every read here is a plain pipeline of read commands, never ``MULTI`` (reads
must keep working when Redis is at its memory limit): a page is a snapshot
of positions, and a job that moves between states while it is read (claimed,
finished, retried) may show in either state, or, rarely, in none.

A page is addressed by an opaque cursor: the position after its last entry in
the state's order. Tasks claimed or added in front of that position between
two pages shift it, so a task may show twice or be skipped across pages; the
counts say how many there were when the page was read.

A page never carries whole payloads (one may be 64 MiB): ``peek.lua`` reads
each entry inside Redis and returns its first bytes, its size and a
fingerprint, a few calls a page (each stops at a byte budget, so a page of big
payloads never holds Redis up for long); :func:`payload` fetches one whole by
its ref. A payload over 1 MiB is queued as its stand-in (:mod:`mesh._blob`):
a page shows the first bytes and the size the stand-in carries and never
reads its blob, so a page of fifty 64 MiB payloads takes milliseconds (see
``bench/suites/payloads.py``); :func:`payload` reads the blob.

:attr:`Job.enqueued` is since when a persistent task has waited for an owner,
and the first enqueue time of a queued, delayed or running one-shot job of a
queue that keeps enqueue times (:meth:`Client.configure`'s ``enqueue_times``:
a write per enqueued job, so a queue keeps them only when asked); None
otherwise. A page reads them inside ``peek.lua`` (the page carries previews,
not the whole payloads that name them), a group's delayed jobs with one
``ZMSCORE`` per page.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple

import attrs

from ._blob import BlobGoneError, fetch, is_standin, parse_standin, stored
from ._errors import ConfigError
from ._keys import Keys, check_group, check_queue
from ._reads import JOB_STATES, JobReads
from ._replies import kind_level_group, parse_dead, parse_record, split_error
from ._types import DeadLetter, Process

__all__ = [
    "JOB_STATES",
    "Attempt",
    "Job",
    "JobPage",
    "MinuteCounts",
    "PAGES",
    "Completed",
    "check_state",
    "completed",
    "job",
    "jobs",
    "minute_counts",
    "payload",
]


#: Largest page.
MAX_LIMIT = 1000
#: Bytes of each payload a page carries (the rest stays in Redis).
PREVIEW = 256
# How far from its position a job is looked for by its ref (jobs ahead of it
# may have been claimed, or added in front of it, since the page was read).
_REF_WINDOW = 200
# Bytes of entries one peek.lua call reads at most (then it returns, and the
# next call goes on): a page of 64 MiB payloads never holds Redis up long.
_PEEK_BUDGET = 16 << 20
# Bytes of a stand-in before the payload's first bytes (mesh._blob: the mark,
# 40 hex digits, the size and two NUL bytes), read on top of a preview.
_STANDIN_HEAD = 80
# With a prefix, how many entries one call looks at (in chunks) at most.
_SCAN_CHUNK = 500
_SCAN_MAX = 20_000


@attrs.frozen
class Attempt:
    """One failed attempt of a job (its history: :attr:`Job.tries`).

    Attributes:
        when: when it failed, seconds on the Redis clock.
        worker: the worker that ran it.
        error: its error, on one line.
        traceback: its traceback, if one was recorded (error and traceback
            are cut to 1000 bytes together, keeping the start); None
            otherwise.
    """

    when: float
    worker: str
    error: str
    traceback: str | None = None


@attrs.frozen
class Job:
    """One task of a queue, as :meth:`Client.jobs` and :meth:`Client.job`
    found it. Times are seconds since the epoch on the Redis clock.

    A page of :meth:`Client.jobs` carries a preview of each payload (its
    first :data:`PREVIEW` bytes) and its size, never the whole of it: a
    payload may be 64 MiB. :func:`payload` fetches one whole, by ``ref``.

    Attributes:
        queue: the queue.
        task: the payload, or its first bytes in a page (``size`` says
            whether it is whole: :attr:`whole`).
        state: ``"queued"``, ``"delayed"``, ``"running"`` or ``"dead"``.
        persistent: a persistent task (one-shot otherwise).
        attempts: failed attempts so far (for a dead one, the last included).
        priority: 0..9 (one-shot tasks only).
        enqueued: since when a persistent task waits for an owner; when a
            queued, delayed or running one-shot job was first enqueued, if
            its queue keeps enqueue times (``Client.configure(queue,
            enqueue_times=True)``); None when not known.
        due: when a delayed task is due (None unless delayed).
        started: when a running process was claimed (None unless running).
        worker: the worker that runs it (running), or ran its last attempt
            (dead); None otherwise.
        token: the running process's fencing token (= its process id).
        error: the last error of a dead job, on one line (``"worker
            crashed: ..."`` when its worker died); None otherwise.
        traceback: that error's traceback, bounded (see
            :attr:`DeadLetter.traceback`); None when none was recorded.
        dead_at: when it was dead-lettered (None unless dead).
        size: the whole payload's size in bytes.
        ref: a short key that finds the job again (:func:`payload`): its
            state, its position (a running one: its token) and a fingerprint
            of its payload; None for a record built from a payload.
        tries: its last failed attempts, oldest first (at most 5: kept by
            ``give_back.lua`` from this version on, for a job that failed
            at least once and is still retried or dead); only
            :meth:`Client.job` reads them, a page has ``()``.
        group: the group of the queue it is in (see
            :meth:`Client.enqueue`), when the page was asked for by group
            or the job runs; None otherwise.
    """

    queue: str
    task: bytes
    state: str
    persistent: bool = False
    attempts: int = 0
    priority: int = 0
    enqueued: float | None = None
    due: float | None = None
    started: float | None = None
    worker: str | None = None
    token: int | None = None
    error: str | None = None
    dead_at: float | None = None
    size: int = attrs.field(default=attrs.Factory(lambda self: len(self.task), takes_self=True))
    ref: str | None = None
    tries: tuple[Attempt, ...] = ()
    traceback: str | None = None
    group: str | None = None

    @property
    def whole(self) -> bool:
        """Whether :attr:`task` is the whole payload (not a preview)."""
        return len(self.task) >= self.size

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values: the payload (or its preview) as
        text when it is UTF-8 (``task``), else None with ``task_hex`` set."""
        d = attrs.asdict(self)
        try:
            d["task"], d["task_hex"] = self.task.decode(), None
        except UnicodeDecodeError:
            d["task"], d["task_hex"] = None, self.task.hex()
        return d


@attrs.frozen
class JobPage:
    """One page of :meth:`Client.jobs`.

    Attributes:
        jobs: the records, in the state's order (queued: claim order; delayed:
            first due first; running: by token; dead: oldest first).
        next: the cursor of the next page (pass it as ``after``), None after
            the last.
        total: how many jobs the state had when the page was read.
    """

    jobs: tuple[Job, ...]
    next: str | None
    total: int


@attrs.frozen
class MinuteCounts:
    """Processes finished and failed per minute of one queue (the dashboard's
    charts), oldest first; ``minutes[i]`` is the start of the minute, seconds
    since the epoch on the Redis clock. Workers add their counts every few
    seconds, so the current minute is incomplete."""

    queue: str
    minutes: tuple[float, ...]
    finished: tuple[int, ...]
    failed: tuple[int, ...]


def check_state(state: object) -> str:
    """``state`` if it is one of :data:`JOB_STATES`.

    Raises:
        ConfigError: anything else.
    """
    if state not in JOB_STATES:
        raise ConfigError(f"invalid job state {state!r}: use one of {', '.join(JOB_STATES)}")
    assert isinstance(state, str)
    return state


def check_limit(limit: object) -> int:
    """``limit`` if it is a whole number 1..1000.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigError(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {limit!r}")
    return limit


def cursor_position(after: object) -> int:
    """The position a page's cursor names (0 for None).

    Raises:
        ConfigError: not a cursor a page gave.
    """
    if after is None:
        return 0
    if isinstance(after, str) and after[:1] == "c" and after[1:].isdigit() and len(after) < 20:
        return int(after[1:])
    raise ConfigError(f"invalid cursor {after!r}: pass the `next` of a page, or nothing")


async def jobs(
    reads: JobReads,
    queue: str,
    state: str,
    *,
    limit: int = 50,
    after: str | None = None,
    prefix: bytes | None = None,
    group: str | None = None,
) -> JobPage:
    """A page of the jobs of ``queue`` in ``state`` (see :meth:`Client.jobs`),
    each with the first :data:`PREVIEW` bytes of its payload (with
    ``prefix``, at least as many as the prefix has) and its size; with
    ``group``, those of that group.

    Raises:
        ConfigError: a bad queue, state, limit, cursor or group, or a group
            with a prefix.
        MeshConnectionError: Redis could not be reached.
        ProtocolError: a record in Redis is malformed.
    """
    check_queue(queue)
    check_state(state)
    check_limit(limit)
    start = cursor_position(after)
    if group is not None:
        check_group(group)
        if prefix is not None:
            raise ConfigError("a group's jobs are listed without a prefix")
        found, total = await _group_slice(reads, queue, group, state, start, limit)
        end = start + len(found)
        return JobPage(tuple(found), f"c{end}" if end < total else None, total)
    if prefix is None:
        found, total = await _slice(reads, queue, state, start, limit, PREVIEW)
        end = start + len(found)
        return JobPage(tuple(found), f"c{end}" if end < total else None, total)
    out: list[Job] = []
    pos, total = start, 0
    n = max(PREVIEW, len(prefix))
    while len(out) < limit and pos - start < _SCAN_MAX:
        chunk, total = await _slice(reads, queue, state, pos, _SCAN_CHUNK, n)
        if not chunk:
            break
        for j in chunk:
            pos += 1
            if j.task.startswith(prefix) or await _long_match(reads, queue, j, prefix):
                out.append(_cut(j, PREVIEW))
                if len(out) == limit:
                    break
    return JobPage(tuple(out), f"c{pos}" if pos < total else None, total)


async def _long_match(reads: JobReads, queue: str, j: Job, prefix: bytes) -> bool:
    """Whether the payload of ``j``, a big one whose stand-in carries fewer
    bytes than ``prefix`` (:mod:`mesh._blob`), starts with ``prefix``: its
    first bytes match, so its blob is read (a prefix longer than 256 bytes
    costs a read of each big payload it may match)."""
    if not len(j.task) < len(prefix) <= j.size or not prefix.startswith(j.task) or j.ref is None:
        return False
    whole = await payload(reads, queue, j.ref)
    return whole is not None and whole.startswith(prefix)


def _cut(j: Job, n: int) -> Job:
    return j if len(j.task) <= n else attrs.evolve(j, task=j.task[:n])


def fingerprint(payload: bytes) -> str:
    """The fingerprint of ``payload`` that a job's ref carries (as
    ``peek.lua`` computes it: see its header)."""
    data = b"%d\0" % len(payload) + payload[:1024] + b"\0" + payload[-1024:]
    return hashlib.sha1(data).hexdigest()[:16]


async def _slice(
    reads: JobReads, queue: str, state: str, start: int, count: int, n: int
) -> tuple[list[Job], int]:
    """Entries start..start+count-1 of the state's order with ``n`` bytes of
    each payload, and the state's total. A big payload's entry is its
    stand-in (:mod:`mesh._blob`): read with :data:`_STANDIN_HEAD` bytes more,
    its job shows the payload's first bytes and size, with no blob read."""
    got, total = await PAGES[state](reads, queue, start, start + count - 1, n + _STANDIN_HEAD)
    return [_unstand(j, n) for j in got], total


def _unstand(j: Job, n: int) -> Job:
    """``j`` with at most ``n`` bytes of its payload; a stand-in's job with
    the first bytes and the size of the payload it stands for."""
    s = parse_standin(j.task)
    if s is not None:
        return attrs.evolve(j, task=s.head[:n], size=s.size)
    return _cut(j, n)


class _Entry(NamedTuple):
    head: bytes
    size: int
    fp: str
    score: float | None
    persistent: bool
    attempts: int
    since: float | None
    level: int


async def _peek(
    reads: JobReads,
    key: str,
    shape: str,
    first: int,
    last: int,
    n: int,
    *,
    skip: int = 0,
    fields: int = 0,
    extras: Sequence[str] = (),
    names: Sequence[bytes] = (),
) -> tuple[int, list[_Entry | None]]:
    """``peek.lua``: the total of ``key`` and its entries first..last (or,
    of a hash, those of ``names``) as previews of ``n`` bytes; in as many
    calls as :data:`_PEEK_BUDGET` needs, each of which holds Redis up for a
    bounded time however big the payloads."""
    out: list[_Entry | None] = []
    total = 0
    while True:
        at = first + len(out)
        rest = names[len(out) :]
        reply = await reads.peek(
            key, extras, [shape, at, last, n, skip, fields, _PEEK_BUDGET, *rest]
        )
        total = int(reply[0])
        got = [_entry(e) for e in reply[1:]]
        out += got
        wanted = len(rest) if shape == "hash" else min(last, total - 1) - at + 1
        if not got or len(got) >= wanted:
            return total, out


def _entry(e: Any) -> _Entry | None:
    if e is None:
        return None
    head, size, fp, score, pers, att, since, level = e
    return _Entry(
        head,
        int(size),
        fp.decode() if isinstance(fp, bytes) else str(fp),
        float(score) if score is not None else None,
        pers == 1,
        int(att or 0),
        int(float(since)) / 1000 if since is not None else None,
        int(level or 0),
    )


def _extra_keys(k: Keys, queue: str) -> list[str]:
    """``peek.lua``'s lookup keys: with them, each entry's persistent flag,
    attempts, since when (unowned, or enqueued: :meth:`Keys.enqt`) and
    the priority it has while delayed (only a delayed page reads it: the
    others take the priority from the entry)."""
    ks = [k.persistent(queue), k.standby(queue), k.attempts(queue), k.unowned(queue)]
    return [*ks, k.delayed_prio(queue), k.enqt(queue)]


async def _dead(reads: JobReads, queue: str, start: int, end: int, n: int) -> tuple[list[Job], int]:
    """Dead letters start..end (oldest first), and how many there are."""
    total, got = await _peek(reads, reads.keys.dead(queue), "list", start, end, n, fields=5)
    out = []
    for i, e in enumerate(got):
        assert e is not None
        job = _dead_job(queue, parse_dead(e.head, queue))
        out.append(attrs.evolve(job, size=e.size, ref=f"dead.{start + i}.{e.fp}"))
    return out, total


async def _running(
    reads: JobReads, queue: str, start: int, end: int, n: int
) -> tuple[list[Job], int]:
    """Processes start..end by token (oldest claim first), and how many run."""
    pids = sorted(await reads.process_ids(queue), key=int)
    page = pids[start : end + 1]
    if not page:
        return [], len(pids)
    key = reads.keys.procs(queue)
    extras = _extra_keys(reads.keys, queue)
    _, got = await _peek(reads, key, "hash", 0, 0, n, fields=8, names=page, extras=extras)
    out = []
    for pid, e in zip(page, got, strict=True):
        if e is None:
            continue  # finished since the HKEYS
        rec = e.head
        out.append(_running_job(queue, parse_record(pid, rec, queue), _kind_priority(rec), e))
    return out, len(pids)


def _running_job(queue: str, p: Process, level: int, e: _Entry | None = None) -> Job:
    job = Job(
        queue,
        p.task,
        "running",
        persistent=p.persistent,
        attempts=p.attempts,
        priority=level,
        started=p.started,
        worker=p.worker_id,
        token=p.token,
        group=p.group,
        enqueued=e.since if e is not None and not p.persistent else None,
    )
    fp = e.fp if e is not None else fingerprint(p.task)
    return attrs.evolve(
        job, size=e.size if e is not None else len(p.task), ref=f"running.{p.token}.{fp}"
    )


def _dead_job(queue: str, d: DeadLetter) -> Job:
    return Job(
        queue,
        d.task,
        "dead",
        attempts=d.attempts,
        worker=d.worker or None,
        error=d.error,
        dead_at=d.when or None,
        traceback=d.traceback,
        priority=d.priority,
        group=d.group,
    )


async def _delayed(
    reads: JobReads, queue: str, start: int, end: int, n: int
) -> tuple[list[Job], int]:
    """Delayed tasks start..end by due time, and how many there are."""
    total, got = await _peek(
        reads,
        reads.keys.delayed(queue),
        "zset",
        start,
        end,
        n,
        extras=_extra_keys(reads.keys, queue),
    )
    out = []
    for i, e in enumerate(got):
        assert e is not None
        extra = (e.persistent, e.attempts, e.level, e.since)
        job = _delayed_job(queue, e.head, e.score, extra)
        out.append(attrs.evolve(job, size=e.size, ref=f"delayed.{start + i}.{e.fp}"))
    return out, total


def _delayed_job(
    queue: str, payload: bytes, due: Any, extra: tuple[bool, int, int, float | None]
) -> Job:
    """A delayed task's Job: ``due`` its score (ms), ``extra`` what
    :func:`_extras` read of it (persistent, attempts, level, since)."""
    pers, att, lv, since = extra
    return Job(
        queue,
        payload,
        "delayed",
        persistent=pers,
        attempts=att,
        priority=lv,
        enqueued=since,
        due=int(float(due)) / 1000,
    )


async def _queued(
    reads: JobReads, queue: str, start: int, end: int, n: int
) -> tuple[list[Job], int]:
    """Queued tasks start..end: those with a priority (highest first), then
    the list; and how many are queued."""
    n_prio, n_list = await reads.sizes(queue, "prio", "queue")
    k = reads.keys
    extras = _extra_keys(k, queue)
    entries: list[tuple[bytes, int, _Entry]] = []
    if start < n_prio:
        _, got = await _peek(
            reads, k.prio(queue), "zset", start, min(end, n_prio - 1), n, skip=16, extras=extras
        )
        entries += [(e.head[16:], int(e.head[:1]), e) for e in got if e is not None]
    if end >= n_prio:
        _, got = await _peek(
            reads, k.queue(queue), "list", max(0, start - n_prio), end - n_prio, n, extras=extras
        )
        entries += [(e.head, 0, e) for e in got if e is not None]
    return [
        Job(
            queue,
            t,
            "queued",
            persistent=e.persistent,
            attempts=e.attempts,
            priority=level,
            enqueued=e.since,
            size=e.size,
            ref=f"queued.{start + i}.{e.fp}",
        )
        for i, (t, level, e) in enumerate(entries)
    ], n_prio + n_list


async def _group_slice(
    reads: JobReads, queue: str, group: str, state: str, start: int, count: int
) -> tuple[list[Job], int]:
    """Entries start..start+count-1 of ``group``'s jobs in ``state``, and
    their total: queued ones in claim order (those with a priority first,
    highest first, then its list), running ones by token, delayed ones by due
    time, dead ones oldest first. Queued ones are read by position; the
    others by reading every running process, delayed job of the queue's
    groups or dead letter of the queue (previews only), as their keys are
    per queue, not per group."""
    got_jobs, total = await _group_entries(reads, queue, group, state, start, count)
    return [_unstand(j, PREVIEW) for j in got_jobs], total


async def _group_entries(
    reads: JobReads, queue: str, group: str, state: str, start: int, count: int
) -> tuple[list[Job], int]:
    """What :func:`_group_slice` lists, each payload read with
    :data:`_STANDIN_HEAD` bytes more than a preview (a stand-in's head)."""
    k = reads.keys
    n = PREVIEW + _STANDIN_HEAD
    if state == "running":
        pids = sorted(await reads.process_ids(queue), key=int)
        extras = _extra_keys(k, queue)
        _, got = await _peek(
            reads, k.procs(queue), "hash", 0, 0, n, fields=8, names=pids, extras=extras
        )
        mine = []
        for pid, e in zip(pids, got, strict=True):
            if e is not None:  # else finished since the HKEYS
                p = parse_record(pid, e.head, queue)
                if p.group == group:
                    mine.append(_running_job(queue, p, _kind_priority(e.head), e))
        return mine[start : start + count], len(mine)
    if state == "dead":
        (n_dead,) = await reads.sizes(queue, "dead")
        _, got = await _peek(reads, k.dead(queue), "list", 0, n_dead - 1, n, fields=5)
        dead = []
        for i, e in enumerate(got):
            if e is not None:
                d = parse_dead(e.head, queue)
                if d.group == group:
                    job = attrs.evolve(_dead_job(queue, d), size=e.size, ref=f"dead.{i}.{e.fp}")
                    dead.append(job)
        return dead[start : start + count], len(dead)
    if state == "delayed":
        return await _group_delayed(reads, queue, group, start, count)
    extras = _extra_keys(k, queue)
    n_prio, n_list = await reads.group_sizes(queue, group)
    end = start + count - 1
    entries: list[tuple[bytes, int, _Entry]] = []
    if start < n_prio:
        _, got = await _peek(
            reads,
            k.group_prio(queue, group),
            "zset",
            start,
            min(end, n_prio - 1),
            n,
            skip=16,
            extras=extras,
        )
        entries += [(e.head[16:], int(e.head[:1]), e) for e in got if e is not None]
    if end >= n_prio:
        _, got = await _peek(
            reads,
            k.group_jobs(queue, group),
            "list",
            max(0, start - n_prio),
            end - n_prio,
            n,
            extras=extras,
        )
        entries += [(e.head, 0, e) for e in got if e is not None]
    return [
        Job(
            queue,
            t,
            "queued",
            attempts=e.attempts,
            priority=level,
            enqueued=e.since,
            size=e.size,
            group=group,
        )
        for t, level, e in entries
    ], n_prio + n_list


async def _group_delayed(
    reads: JobReads, queue: str, group: str, start: int, count: int
) -> tuple[list[Job], int]:
    """``group``'s delayed jobs (waiting for a delay or a retry's backoff)
    start..start+count-1 by due time, and their total (each member is read
    whole: see :meth:`JobReads.group_delayed`)."""
    found = await reads.group_delayed(queue, group)
    head = len(group) + 1
    page = found[start : start + count]
    times = await reads.enqueue_times(queue, [m[head + 2 :] for _, m in page])
    out = []
    for (due, m), at in zip(page, times, strict=True):
        level = m[head + 1] - 48
        payload = m[head + 2 :]
        out.append(
            Job(
                queue,
                payload[: PREVIEW + _STANDIN_HEAD],
                "delayed",
                priority=level,
                due=int(due) / 1000,
                enqueued=int(float(at)) / 1000 if at is not None else None,
                size=len(payload),
                group=group,
            )
        )
    return out, len(found)


#: How a page of each job state (:data:`~mesh._reads.JOB_STATES`) is read.
PAGES: dict[str, Callable[[JobReads, str, int, int, int], Awaitable[tuple[list[Job], int]]]] = {
    "queued": _queued,
    "delayed": _delayed,
    "running": _running,
    "dead": _dead,
}


def _kind_priority(rec: bytes) -> int:
    kind = rec.split(b"\0", 2)[1]
    try:
        return kind_level_group(kind)[0]
    except ValueError:
        return 0


async def _extras(
    reads: JobReads, queue: str, payloads: Sequence[bytes], *, levels: bool
) -> list[tuple[bool, int, int, float | None]]:
    """Per payload: persistent, failed attempts, priority (of a delayed
    one, with ``levels``), since when unowned (persistent tasks)."""
    got = await reads.job_extras(queue, payloads, levels=levels)
    pers, standby, attempts, unowned, enqt = got[:5]
    since = [u if u is not None else t for u, t in zip(unowned, enqt, strict=True)]
    lv = got[5] if levels else [None] * len(payloads)
    return [
        (
            pers[i] is not None or standby[i] == 1,
            int(attempts[i] or 0),
            int(lv[i] or 0),
            int(float(since[i])) / 1000 if since[i] is not None else None,
        )
        for i in range(len(payloads))
    ]


def parse_ref(ref: object) -> tuple[str, int, str]:
    """(state, position or token, fingerprint) of a job's ref.

    Raises:
        ConfigError: not a ref a page gave.
    """
    parts = ref.split(".") if isinstance(ref, str) and len(ref) < 80 else []
    if (
        len(parts) != 3
        or parts[0] not in JOB_STATES
        or not parts[1].isdigit()
        or len(parts[2]) != 16
        or any(c not in "0123456789abcdef" for c in parts[2])
    ):
        raise ConfigError(f"invalid job ref {str(ref)[:80]!r}: pass the ref of a listed job")
    return parts[0], int(parts[1]), parts[2]


async def payload(reads: JobReads, queue: str, ref: str, *, whole: bool = True) -> bytes | None:
    """The whole payload of the job ``ref`` names (a :attr:`Job.ref` of a
    page): looked for at its position and up to a few hundred positions
    around it (jobs ahead of it may have left or come since), by the
    fingerprint of its payload; None if it is no longer there. A payload of
    more than 1 MiB is read from its blob (:mod:`mesh._blob`): one more read;
    with ``whole=False``, what the queue holds is returned instead (the
    stand-in of such a payload, which every call that names a task takes:
    its record, cancel, a dead letter's requeue or purge), and no blob is
    read.

    Raises:
        ConfigError: a bad queue name or ref.
        MeshConnectionError: Redis could not be reached.
        ProtocolError: a record in Redis is malformed.
    """
    check_queue(queue)
    found = await _stored(reads, queue, ref)
    if found is None or not whole or not is_standin(found):
        return found
    try:
        return await fetch(reads.check(), reads.keys, found)
    except BlobGoneError:
        return None


async def _stored(reads: JobReads, queue: str, ref: str) -> bytes | None:
    """What the queue holds for the job ``ref`` names (a big payload's
    stand-in: :mod:`mesh._blob`); None if it is no longer there."""
    state, at, fp = parse_ref(ref)
    if state == "running":
        rec = await reads.process_record(queue, at)
        if rec is None:
            return None
        run = parse_record(str(at).encode(), rec, queue).task
        return run if fingerprint(run) == fp else None
    # at its position first, then ever wider around it (each entry looked at
    # is copied once inside Redis: a 64 MiB one costs)
    hits: list[int] = []
    for reach in (0, 4, 32, _REF_WINDOW):
        first = max(0, at - reach)
        near, _ = await _slice(reads, queue, state, first, at + reach - first + 1, 0)
        hits = [first + i for i, j in enumerate(near) if j.ref is not None and j.ref.endswith(fp)]
        if hits:
            break
    for pos in sorted(hits, key=lambda p: abs(p - at)):
        task: bytes | None
        if state == "dead":
            rec = await reads.entry(queue, "dead", pos)
            task = parse_dead(rec, queue).task if rec is not None else None
        elif state == "delayed":
            task = await reads.entry(queue, "delayed", pos)
        else:
            (n_prio,) = await reads.sizes(queue, "prio")
            if pos < n_prio:
                member = await reads.entry(queue, "prio", pos)
                task = member[16:] if member is not None else None
            else:
                task = await reads.entry(queue, "queue", pos - n_prio)
        if task is not None and fingerprint(task) == fp:
            return bytes(task)
    return None


def _glob_escape(data: bytes) -> bytes:
    out = bytearray()
    for b in data:
        if b in b"\\*?[]":
            out += b"\\"
        out.append(b)
    return bytes(out)


async def job(reads: JobReads, queue: str, payload: bytes) -> Job | None:
    """Where ``payload`` is on ``queue`` (see :meth:`Client.job`): the first
    of running, queued, delayed and dead that has it (a dead one: its latest
    dead letter), or None; with its attempt history when it failed before.

    Raises:
        ConfigError: a bad queue name.
        MeshConnectionError: Redis could not be reached.
        ProtocolError: a record in Redis is malformed.
    """
    held = stored(payload)  # a big one: as the queue holds it (mesh._blob)
    found = await _job(reads, queue, held)
    if found is not None and held is not payload:
        found = attrs.evolve(found, task=payload, size=len(payload))
    elif found is not None and is_standin(held):
        found = _unstand(found, PREVIEW)  # named by its stand-in: a preview
    if found is None or (found.attempts == 0 and found.state != "dead"):
        return found
    raw = await reads.tries(queue, held)
    return attrs.evolve(found, tries=parse_tries(raw))


def parse_tries(raw: bytes | None) -> tuple[Attempt, ...]:
    """The attempts of a :meth:`Keys.tries` field (``()`` for none, or for
    one that is not of the documented shape)."""
    if not raw:
        return ()
    try:
        items = json.loads(raw.decode(errors="replace"))
        return tuple(
            Attempt(int(w) / 1000, str(who), *split_error(str(err))) for w, who, err in items
        )
    except (ValueError, TypeError):
        return ()


async def _job(reads: JobReads, queue: str, payload: bytes) -> Job | None:
    """:func:`job` without the attempt history.

    Raises:
        ConfigError: a bad queue name.
        MeshConnectionError: Redis could not be reached.
        ProtocolError: a record in Redis is malformed.
    """
    check_queue(queue)
    k = reads.keys
    fp = fingerprint(payload)
    pids, at, due, n_prio, n_dead = await reads.whereabouts(queue, payload)
    found: list[Job] = []
    if pids:
        # by fingerprint first: the other processes' payloads stay in Redis
        _, got = await _peek(reads, k.procs(queue), "hash", 0, 0, 0, fields=8, names=pids)
        for pid, e in zip(pids, got, strict=True):
            if e is not None and e.fp == fp and e.size == len(payload):
                rec = await reads.process_record(queue, pid)
                if rec is not None and rec.endswith(payload):
                    p = parse_record(pid, rec, queue)
                    if p.task == payload:
                        found.append(_running_job(queue, p, _kind_priority(rec)))
    if found:
        first = min(found, key=lambda j: j.token or 0)
        if first.persistent:
            return first
        (at,) = await reads.enqueue_times(queue, [payload])
        return attrs.evolve(first, enqueued=int(float(at)) / 1000 if at is not None else None)
    level = 0
    queued = at is not None
    if not queued and int(n_prio):
        found_level = await _prio_level(reads, queue, payload)
        queued, level = found_level is not None, found_level or 0
    if queued or due is not None:
        (extra,) = await _extras(reads, queue, [payload], levels=due is not None and not queued)
        if queued:
            pers, att, _, since = extra
            return Job(
                queue,
                payload,
                "queued",
                persistent=pers,
                attempts=att,
                priority=level,
                enqueued=since,
            )
        return _delayed_job(queue, payload, due, extra)
    # the latest dead letter of the payload: read from the end, in chunks, by
    # fingerprint (the other dead letters' payloads stay in Redis)
    end = int(n_dead) - 1
    while end >= 0:
        begin = max(0, end - _SCAN_CHUNK + 1)
        _, got = await _peek(reads, k.dead(queue), "list", begin, end, 0, fields=5)
        for i in reversed(range(len(got))):
            e = got[i]
            if e is not None and e.fp == fp and e.size == len(payload):
                rec = await reads.entry(queue, "dead", begin + i)
                if rec is not None and rec.endswith(payload):
                    d = parse_dead(rec, queue)
                    if d.task == payload:
                        return _dead_job(queue, d)
        end = begin - 1
    return None


async def _prio_level(reads: JobReads, queue: str, payload: bytes) -> int | None:
    """The priority level ``payload`` is queued at (a ZSCAN of the queue's
    priority set), or None if it is not there."""
    pattern = b"[1-9]" + b"[0-9]" * 15 + _glob_escape(payload)
    cursor = b"0"
    while True:
        cursor, flat = await reads.scan_prio(queue, cursor, pattern)
        for m in flat[0::2]:
            if m[16:] == payload:
                return int(m[:1])
        if cursor in (b"0", 0, "0"):
            return None


async def minute_counts(
    reads: JobReads, queues: Iterable[str], minutes: int = 60
) -> tuple[float, list[MinuteCounts]]:
    """The Redis time (s) and, per queue, the processes finished and failed
    in each of the last ``minutes`` minutes (the current one last).

    Raises:
        ConfigError: a bad queue name, or ``minutes`` not 1..1440.
        MeshConnectionError: Redis could not be reached.
    """
    names = [check_queue(q) for q in queues]
    if isinstance(minutes, bool) or not isinstance(minutes, int) or not 1 <= minutes <= 1440:
        raise ConfigError(f"minutes must be a whole number from 1 to 1440, got {minutes!r}")
    got = await reads.minute_stats(names)
    sec = int(got[0][0])
    now_minute = sec // 60
    span = range(now_minute - minutes + 1, now_minute + 1)
    out = []
    for q, flat in zip(names, got[1:], strict=True):
        h = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
        out.append(
            MinuteCounts(
                q,
                tuple(float(m * 60) for m in span),
                tuple(int(h.get(b"p%d" % m, 0)) for m in span),
                tuple(int(h.get(b"f%d" % m, 0)) for m in span),
            )
        )
    return float(sec), out


@attrs.frozen
class Completed:
    """A finished job whose result its queue keeps (a queue with a result
    TTL: ``finish_results.lua``), as :func:`completed` found it.

    Attributes:
        queue: the queue.
        task: the payload's first bytes (``size``: its whole size).
        size: the payload's size.
        finished: when it finished, seconds on the Redis clock.
        worker: the worker that ran it.
        result: the first bytes of the value its handler returned (None: it
            returned nothing).
        result_size: the value's whole size (0 when it returned nothing).
    """

    queue: str
    task: bytes
    size: int
    finished: float
    worker: str
    result: bytes | None
    result_size: int


async def completed(
    reads: JobReads,
    queue: str,
    *,
    limit: int = 50,
    after: str | None = None,
    preview: int = PREVIEW,
) -> tuple[list[Completed], str | None]:
    """A page of the finished jobs of ``queue`` whose results are kept (their
    result records, found by ``SCAN``, newest first within the page: at
    least ``limit`` while there are more, and what one ``SCAN`` step found
    beyond it, at most 1000), each
    with the first ``preview`` bytes of its payload and result; and the
    cursor of the next page (None after the last). Only the first bytes of
    each record are read (``GETRANGE``), whatever its size.

    Raises:
        ConfigError: a bad queue name, limit or cursor.
        MeshConnectionError: Redis could not be reached.
    """
    check_queue(queue)
    check_limit(limit)
    if after is None:
        cursor = b"0"
    elif isinstance(after, str) and after[:1] == "s" and after[1:].isdigit() and len(after) < 24:
        cursor = after[1:].encode()
    else:
        raise ConfigError(f"invalid cursor {after!r}: pass the `next` of a page, or nothing")
    pattern = _glob_escape(reads.keys.prefix.encode()) + b"result:*:" + _glob_escape(queue.encode())
    found: list[bytes] = []
    for _ in range(_SCAN_MAX // _SCAN_CHUNK):
        cursor, names = await reads.scan_results(cursor, pattern)
        found += [n for n in names if n.endswith(b":" + queue.encode())]
        if cursor in (b"0", 0, "0") or len(found) >= limit:
            break
    nxt = (
        None
        if cursor in (b"0", 0, "0")
        else "s" + (cursor.decode() if isinstance(cursor, bytes) else str(cursor))
    )
    heads = await reads.ranges([("GETRANGE", n, 0, 100 + preview) for n in found])
    out: list[Completed] = []
    tails: list[tuple[Any, ...]] = []
    parsed = []
    for name, head in zip(found, heads, strict=True):
        parts = head.split(b"\0", 4)
        if len(parts) != 5 or parts[0] not in (b"v", b"n") or not parts[3].isdigit():
            continue  # gone since the SCAN, or not a result record
        start = len(head) - len(parts[4])
        size = int(parts[3])
        parsed.append((name, parts, size))
        tails += [
            ("GETRANGE", name, start + size, start + size + preview + _STANDIN_HEAD - 1),
            ("STRLEN", name),
        ]
    got = await reads.ranges(tails)
    for i, (_name, parts, size) in enumerate(parsed):
        head_len = len(b"\0".join(parts[:4])) + 1
        task, total = got[2 * i], int(got[2 * i + 1])
        task_size = max(0, total - head_len - size)
        big = parse_standin(task)  # a big payload's record holds its stand-in
        if big is not None:
            task, task_size = big.head, big.size
        out.append(
            Completed(
                queue,
                task[:preview],
                task_size,
                int(parts[1]) / 1000,
                parts[2].decode(errors="replace"),
                parts[4][: min(size, preview)] if parts[0] == b"v" else None,
                size,
            )
        )
    out.sort(key=lambda c: -c.finished)
    return out, nxt
