"""Looking at a whole mesh from outside: what ``mesh status``, the dashboard
and the metrics exporter read.

Three looks, each through a :class:`~mesh._reads.Reader` (a client's
:attr:`~mesh.Client.reads`: no lease, no worker needed), which sends every
read and owns the table of a queue's keys:

* :func:`snapshot`: workers (with their queues and how many processes each
  holds), queue counts and, optionally, every running process. Its cost grows
  with the number of workers (a few commands each): for people looking.
* :func:`counts`: the mesh-wide numbers that metrics need, in two round trips
  whatever the number of workers (live workers are counted by lease deadline
  with ``ZCOUNT``): for machines polling.
* :func:`overview`: everything the dashboard shows (workers with their fair
  shares, queues, processes, persistent tasks and their owners) in two round
  trips and a number of commands that grows with the number of queues, not of
  workers: who serves a queue comes from ``servers:<Q>``, what a worker holds
  from the process records, the fair shares from ``share:<Q>``, ``moving:<Q>``
  and ``reserved:<Q>`` (turned into shares by the same
  :class:`~mesh._share.QueueBalance` as :meth:`Client.workers`), and the
  workers' descriptions are read once per worker.

All use the Redis clock (:meth:`Client.time`), never this machine's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ._blob import parse_standin
from ._epoch import epoch_missing
from ._errors import CommandError
from ._group_reads import GroupsLook, read_groups
from ._memory import MemoryInfo, parse_memory_info
from ._reads import MeshHead, QueueInfo, Reader, queue_info, worker_info
from ._replies import parse_record
from ._share import QueueBalance
from ._types import DelayedTask, Process, QueueShare, WorkerInfo

log = logging.getLogger("mesh.memory")

__all__ = [
    "share_text",
    "show_payload",
    "MeshCounts",
    "Overview",
    "QueueCounts",
    "Snapshot",
    "counts",
    "overview",
    "snapshot",
]


def show_payload(task: bytes, width: int = 80, ellipsis: str = "…") -> str:
    """A payload for humans (``mesh status``, the dashboard): its text when
    it is printable UTF-8, else a ``b'...'`` literal (``b''`` for the empty
    payload, never a blank); cut to ``width`` characters, the last ones
    being ``ellipsis``; a big payload's stand-in (:mod:`mesh._blob`) as the
    payload's first bytes and an ``ellipsis``. Sync, no I/O."""
    big = parse_standin(task)
    if big is not None:
        return (
            show_payload(big.head, width, ellipsis).removesuffix(ellipsis)[: width - len(ellipsis)]
            + ellipsis
        )
    try:
        text = task.decode()
    except UnicodeDecodeError:
        text = repr(task)
    else:
        if not text or not text.isprintable():
            text = repr(task)
    return text if len(text) <= width else text[: width - len(ellipsis)] + ellipsis


def share_text(shares: Sequence[QueueShare]) -> str:
    """What a worker holds of each queue with persistent tasks against its
    fair share, by weight, and what is moving: ``devices 3/5 +2`` (it holds
    a weight of 3, a fair 5, 2 tasks on their way to it), ``devices
    10/4-5 -5``, ``devices 12/13-14 x2`` (a share of 13.3 at capacity 2);
    queues without persistent tasks are left out, ``-`` if none is left.
    What ``mesh status`` and the dashboard show. Sync, no I/O."""
    parts = []
    for sh in shares:
        if sh.fair_max == 0:
            continue
        fair = str(sh.fair_min) if sh.fair_min == sh.fair_max else f"{sh.fair_min}-{sh.fair_max}"
        moving = (f" +{sh.incoming}" if sh.incoming else "") + (
            f" -{sh.outgoing}" if sh.outgoing else ""
        )
        cap = f" x{sh.capacity}" if sh.capacity != 1 else ""
        parts.append(f"{sh.queue} {sh.weight or sh.held}/{fair}{moving}{cap}")
    return ", ".join(parts) or "-"


@attrs.frozen
class Snapshot:
    """One look at a namespace.

    Attributes:
        now: when it was taken, in seconds of the Redis clock.
        workers: every registered worker (live, or dead and not yet recycled).
        queues: the counts of every known queue.
        processes: every running process, if asked for.
        delayed: per queue with delayed tasks, the first due of them, if
            asked for.
    """

    now: float
    workers: list[WorkerInfo]
    queues: list[QueueInfo]
    processes: list[Process] | None
    delayed: dict[str, list[DelayedTask]] | None = None
    memory: MemoryInfo | None = None
    vanished: Mapping[str, int] = attrs.field(factory=dict)
    epoch_missing: bool = False
    """The namespace's epoch is missing (see :func:`mesh._epoch.epoch_missing`)."""
    timed: tuple[str, ...] = ()
    """The queues that keep the enqueue times of their one-shot jobs."""


async def snapshot(
    reads: Reader, *, processes: bool = False, delayed: int | None = None
) -> Snapshot:
    """Read workers, queue counts (all queues in one step, a read-only script) and,
    optionally, the running processes and the first ``delayed`` delayed
    tasks of each queue that has some.

    Raises:
        MeshConnectionError: Redis could not be reached.

    Nothing is written; a cancelled call leaves nothing behind.
    """
    now = await reads.time()
    memory = await reads.read_memory()
    workers = await reads.workers()
    queues = await reads.queue_infos(await reads.queues())
    c = await counts(reads)
    vanished = {q.info.name: q.vanished for q in c.queues if q.vanished}
    procs = await reads.processes(await reads.queues()) if processes else None
    due = None
    if delayed is not None:
        due = {}
        for q in queues:
            if q.delayed:
                due[q.name] = await reads.delayed(q.name, delayed)
    timed = tuple(await reads.timed_queues())
    return Snapshot(now, workers, queues, procs, due, memory, vanished, c.epoch_missing, timed)


@attrs.frozen
class QueueCounts:
    """A queue's counts for metrics (see :func:`counts`).

    Attributes:
        info: queued, delayed, running, persistent and dead, as in
            :meth:`Client.queue_infos`.
        persistent_owned: persistent tasks that a process runs now.
        unowned: payloads of the persistent tasks that no process runs (queued
            or waiting for a retry).
        unowned_since: per payload in ``unowned``, since when (seconds of the
            Redis clock) no process has run it: since it was ensured, handed
            back or recycled (``{ns}:unowned:<Q>``, kept by the scripts).
        vanished: persistent tasks that left the registry without a cancel,
            finish or delete (evicted, or deleted behind the mesh's back):
            the total weight the scripts keep beside the registry
            (``share:<Q>``'s ``:weight``, moved only by ensure, finish,
            cancel and delete_queue) less the weight of the tasks there.
            :meth:`Client.reconcile` puts them back.
        groups: a look at the queue's groups (the top ones by jobs queued,
            and totals), when :func:`counts` was asked for them and the
            queue has any; else None.
    """

    info: QueueInfo
    persistent_owned: int
    unowned: tuple[bytes, ...]
    unowned_since: Mapping[bytes, float] = attrs.field(factory=dict)
    vanished: int = 0
    groups: GroupsLook | None = None

    def longest_unowned(self, now: float) -> float:
        """Seconds that the longest-unowned persistent task has had no owner
        at ``now`` (Redis clock), 0.0 if every one has an owner."""
        if not self.unowned:
            return 0.0
        return max(0.0, now - min(self.unowned_since.get(t, now) for t in self.unowned))


@attrs.frozen
class MeshCounts:
    """The mesh-wide numbers (see :func:`counts`).

    Attributes:
        now: seconds of the Redis clock.
        workers: registered workers.
        workers_alive: those whose lease deadline has not passed.
        queues: per known queue, sorted by name.
    """

    now: float
    workers: int
    workers_alive: int
    queues: list[QueueCounts]
    memory: MemoryInfo | None = None
    epoch_missing: bool = False
    """The namespace's epoch is missing (see :func:`mesh._epoch.epoch_missing`)."""


async def counts(reads: Reader, *, groups: int | None = None) -> MeshCounts:
    """Read the mesh-wide counts: two round trips (the clock, the list of
    queues and ``INFO memory``, then one read-only script for everything
    else: a consistent view, which Redis answers at the memory limit too,
    where it refuses ``MULTI``). A policy that can evict and persistent
    tasks that vanished are logged once (see :class:`~mesh._memory.MemoryWatch`).

    Its cost in Redis is O(log workers) plus, per queue, O(persistent tasks)
    (to tell owned from unowned ones, and since when those are unowned).

    Args:
        groups: also look at the groups of each queue that has any (two
            more round trips per such queue, see
            :func:`mesh._group_reads.read_groups`), keeping the ``groups``
            with the most jobs queued (0: the totals only). None: not.

    Raises:
        MeshConnectionError: Redis could not be reached.
    """
    head, workers, alive, got_queues = await reads.counts_read()
    out = [queue_counts(q, got) for q, got in zip(head.queues, got_queues, strict=True)]
    if groups is not None:
        for i, got in enumerate(got_queues):
            if got["groups"] or got["gdelayed"]:
                look = await read_groups(reads.check(), reads.keys, out[i].info.name, groups)
                out[i] = attrs.evolve(out[i], groups=look)
    info = _memory_of(reads, head.memory)
    _tell_vanished(reads, out)
    missing = epoch_missing(reads.epoch, head.epoch)
    return MeshCounts(head.now_ms / 1000, workers, alive, out, info, missing)


def _memory_of(reads: Reader, reply: object) -> MemoryInfo | None:
    """The reading of ``INFO memory`` in a pipeline's replies (None: refused,
    by an ACL without ``+info``), given to the reader's watch (which logs a
    policy that can evict once)."""
    info = None
    if isinstance(reply, bytes | str) and not isinstance(reply, CommandError):
        try:
            info = parse_memory_info(reply)
        except ValueError:
            info = None
    reads.memory.update(info)
    return info


def _tell_vanished(reads: Reader, queues: Sequence[QueueCounts]) -> None:
    """Log persistent tasks missing without a cancel: one error line per
    queue each time its number changes (not one per read)."""
    for q in queues:
        was = reads.vanished.get(q.info.name, 0)
        if q.vanished != was:
            if q.vanished:
                log.error(
                    "queue %s: %d persistent task(s) vanished without a cancel (evicted, or "
                    "deleted behind the mesh's back; is maxmemory-policy noeviction?): "
                    "Client.reconcile(queue, desired) puts them back",
                    q.info.name,
                    q.vanished,
                )
                reads.vanished[q.info.name] = q.vanished
            else:
                reads.vanished.pop(q.info.name, None)


def queue_counts(q: str, got: Mapping[str, Any]) -> QueueCounts:
    """A queue's :class:`QueueCounts` from its parsed replies (of a
    :class:`~mesh._reads.QueueRead` that reads ``persistent``, ``standby``,
    ``unowned`` and ``share`` whole)."""
    persistent: Mapping[bytes, bytes] = got["persistent"]
    share: Mapping[bytes, bytes] = got["share"]
    owned = sum(1 for pid in persistent.values() if pid)
    unowned = [*got["standby"], *(t for t, pid in persistent.items() if not pid)]
    info = queue_info(q, got)
    unowned_since = {t: ms / 1000 for t, ms in got["unowned"].items()}
    # The weight the scripts counted in, against that of the tasks present.
    present = info.persistent
    if b":heavy" in share:
        tasks = [*got["standby"], *persistent]
        present = sum(int(share.get(b"w" + t, b"1")) for t in tasks)
    vanished = max(0, int(share.get(b":weight", b"0")) - present)
    return QueueCounts(info, owned, tuple(sorted(unowned)), unowned_since, vanished)


@attrs.frozen
class Overview:
    """What the dashboard shows (see :func:`overview`).

    Attributes:
        now: seconds of the Redis clock.
        workers: every registered worker; ``processes`` counts its process
            records, ``shares`` are as :meth:`Client.workers` reports them.
        queues: per known queue, with persistent tasks owned and unowned.
        processes: every running process, in token order.
    """

    now: float
    workers: list[WorkerInfo]
    queues: list[QueueCounts]
    processes: list[Process]
    memory: MemoryInfo | None = None
    epoch_missing: bool = False
    """The namespace's epoch is missing (see :func:`mesh._epoch.epoch_missing`)."""


async def overview(reads: Reader, info_cache: dict[str, dict[str, Any]] | None = None) -> Overview:
    """Read everything the dashboard shows in two round trips.

    Args:
        info_cache: worker id -> its description (host, pid, started), kept
            by the caller between calls so that each worker's description
            is read once; ids no longer registered are dropped from it.

    Raises:
        MeshConnectionError: Redis could not be reached.
        ProtocolError: a process record is malformed.
    """
    cache: dict[str, dict[str, Any]] = {} if info_cache is None else info_cache

    def describe(deadlines: Mapping[str, int]) -> list[str]:
        for gone in set(cache) - set(deadlines):
            del cache[gone]
        return sorted(set(deadlines) - set(cache))

    head, groups, fresh = await reads.overview_read(describe)
    for w, info in fresh.items():
        if info.get("started"):  # complete: a joining worker writes it twice
            cache[w] = info
    held = _Holdings(head.deadlines)
    out = [held.add(q, got) for q, got in zip(head.queues, groups, strict=True)]
    held.processes.sort(key=lambda p: p.token)
    workers = [
        worker_info(
            w,
            deadline > head.now_ms,
            held.serves.get(w, ()),
            held.held[w],
            deadline - head.now_ms,
            cache.get(w) or fresh.get(w, {}),
            held.shares.get(w, ()),
        )
        for w, deadline in sorted(head.deadlines.items())
    ]
    _tell_vanished(reads, out)
    return _overview(reads, head, workers, out, held.processes)


def _overview(
    reads: Reader,
    head: MeshHead,
    workers: list[WorkerInfo],
    queues: list[QueueCounts],
    processes: list[Process],
) -> Overview:
    missing = epoch_missing(reads.epoch, head.epoch)
    memory = _memory_of(reads, head.memory)
    return Overview(head.now_ms / 1000, workers, queues, processes, memory, missing)


class _Holdings:
    """What :func:`overview` gathers queue by queue: every process, and per
    worker the queues it serves, how many processes it holds and its shares."""

    def __init__(self, deadlines: Mapping[str, int]) -> None:
        self.serves: dict[str, list[str]] = {w: [] for w in deadlines}
        self.held: dict[str, int] = dict.fromkeys(deadlines, 0)
        self.shares: dict[str, list[QueueShare]] = {w: [] for w in deadlines}
        self.processes: list[Process] = []

    def add(self, q: str, got: Mapping[str, Any]) -> QueueCounts:
        """Take in queue ``q``'s parsed replies; its counts."""
        on_q: dict[str, int] = {}
        holder: dict[bytes, str] = {}
        for pid, rec in got["procs"].items():
            p = parse_record(pid, rec, q)
            self.processes.append(p)
            holder[pid] = p.worker_id
            on_q[p.worker_id] = on_q.get(p.worker_id, 0) + 1
            if p.worker_id in self.held:
                self.held[p.worker_id] += 1
        share = got["share"]
        moving = got["moving"]
        balance = QueueBalance.read(
            q,
            share.get(b":weight"),
            share.get(b":capacity"),
            moving,
            got["reserved"],
            [holder[pid] for pid in moving if pid in holder],
        )
        for w_b in got["servers"]:
            w = w_b.decode()
            self.serves.setdefault(w, []).append(q)
            mine = balance.of(w, on_q.get(w, 0), share.get(b"c" + w_b), share.get(b"h" + w_b))
            self.shares.setdefault(w, []).append(mine)
        return queue_counts(q, got)
