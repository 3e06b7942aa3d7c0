"""Looking at a whole mesh from outside: what ``mesh status``, the dashboard
and the metrics exporter read.

Two reads, both from a :class:`~mesh.Client` (no lease, no worker needed):

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
  :class:`~mesh._client.QueueBalance` as :meth:`Client.workers`), and the
  workers' descriptions are read once per worker.

Both use the Redis clock (:meth:`Client.time`), never this machine's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ._client import Client, QueueBalance, _load_info, _pairs
from ._epoch import epoch_missing
from ._errors import CommandError
from ._eval import run_reads
from ._memory import INFO_MEMORY, MemoryInfo, parse_memory_info, read_memory
from ._replies import parse_record
from ._types import DelayedTask, Process, QueueInfo, QueueShare, WorkerInfo

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
    being ``ellipsis``. Sync, no I/O."""
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


async def snapshot(
    client: Client, *, processes: bool = False, delayed: int | None = None
) -> Snapshot:
    """Read workers, queue counts (all queues in one step, a read-only script) and,
    optionally, the running processes and the first ``delayed`` delayed
    tasks of each queue that has some.

    Raises:
        MeshConnectionError: Redis could not be reached.

    Nothing is written; a cancelled call leaves nothing behind.
    """
    now = await client.time()
    memory = await read_memory(client._check())
    client.memory.update(memory)
    workers = await client.workers()
    queues = await client.queue_infos()
    c = await counts(client)
    vanished = {q.info.name: q.vanished for q in c.queues if q.vanished}
    procs = await client.processes() if processes else None
    due = None
    if delayed is not None:
        due = {}
        for q in queues:
            if q.delayed:
                due[q.name] = await client.delayed(q.name, limit=delayed)
    return Snapshot(now, workers, queues, procs, due, memory, vanished, c.epoch_missing)


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
    """

    info: QueueInfo
    persistent_owned: int
    unowned: tuple[bytes, ...]
    unowned_since: Mapping[bytes, float] = attrs.field(factory=dict)
    vanished: int = 0

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


async def counts(client: Client) -> MeshCounts:
    """Read the mesh-wide counts: two round trips (the clock, the list of
    queues and ``INFO memory``, then one read-only script for everything
    else: a consistent view, which Redis answers at the memory limit too,
    where it refuses ``MULTI``). A policy that can evict and persistent
    tasks that vanished are logged once (see :class:`~mesh._memory.MemoryWatch`).

    Its cost in Redis is O(log workers) plus, per queue, O(persistent tasks)
    (to tell owned from unowned ones, and since when those are unowned).

    Raises:
        MeshConnectionError: Redis could not be reached.
    """
    conn = client._check()
    k = client._keys
    (sec, usec), names, epoch, memory = _checked(
        await conn.pipeline(
            [("TIME",), ("SMEMBERS", k.queues), ("GET", k.epoch), INFO_MEMORY],
            raise_on_error=False,
        )
    )
    now_ms = int(sec) * 1000 + int(usec) // 1000
    queues = sorted(q.decode() for q in names)
    cmds: list[tuple[Any, ...]] = [("ZCARD", k.workers), ("ZCOUNT", k.workers, now_ms, "+inf")]
    for q in queues:
        cmds += [
            ("LLEN", k.queue(q)),
            ("ZCARD", k.delayed(q)),
            ("HLEN", k.procs(q)),
            ("HGETALL", k.persistent(q)),
            ("SMEMBERS", k.standby(q)),
            ("LLEN", k.dead(q)),
            ("ZRANGE", k.unowned(q), 0, -1, "WITHSCORES"),
            ("ZCARD", k.prio(q)),
            ("HGETALL", k.share(q)),
            ("EXISTS", k.paused(q)),
        ]
    replies = await run_reads(conn, cmds)  # at the memory limit too, unlike MULTI
    out = []
    for i, q in enumerate(queues):
        group = replies[2 + 10 * i : 2 + 10 * (i + 1)]
        queued, delayed, running, persistent, standby, dead, since, prio, share, paused = group
        queued += prio  # tasks with a priority are queued too
        out.append(
            _queue_counts(
                q,
                queued,
                delayed,
                running,
                persistent,
                standby,
                dead,
                since,
                _pairs(share),
                paused,
            )
        )
    info = _memory_of(client, memory)
    _tell_vanished(client, out)
    workers = int(replies[0])
    missing = epoch_missing(_epoch(client), epoch)
    return MeshCounts(now_ms / 1000, workers, int(replies[1]), out, info, missing)


def _checked(replies: list[Any]) -> list[Any]:
    """A pipeline's replies whose last two are ``GET`` of the epoch and
    ``INFO memory``: the first error of the others is raised; those of the
    last two (an ACL without ``+get`` on the key or ``+info``) are left in
    place."""
    for r in replies[:-2]:
        if isinstance(r, CommandError):
            raise r
    return replies


def _epoch(client: Client) -> Any:
    """The :class:`~mesh._epoch.Epoch` of the client's connection (None:
    not checked)."""
    return client._conn.topology.epoch


def _memory_of(client: Client, reply: object) -> MemoryInfo | None:
    """The reading of ``INFO memory`` in a pipeline's replies (None: refused,
    by an ACL without ``+info``), given to the client's watch (which logs a
    policy that can evict once)."""
    info = None
    if isinstance(reply, bytes | str) and not isinstance(reply, CommandError):
        try:
            info = parse_memory_info(reply)
        except ValueError:
            info = None
    client.memory.update(info)
    return info


def _tell_vanished(client: Client, queues: Sequence[QueueCounts]) -> None:
    """Log persistent tasks missing without a cancel: one error line per
    queue each time its number changes (not one per read)."""
    for q in queues:
        was = client.vanished.get(q.info.name, 0)
        if q.vanished != was:
            if q.vanished:
                log.error(
                    "queue %s: %d persistent task(s) vanished without a cancel (evicted, or "
                    "deleted behind the mesh's back; is maxmemory-policy noeviction?): "
                    "Client.reconcile(queue, desired) puts them back",
                    q.info.name,
                    q.vanished,
                )
                client.vanished[q.info.name] = q.vanished
            else:
                client.vanished.pop(q.info.name, None)


def _queue_counts(
    q: str,
    queued: int,
    delayed: int,
    running: int,
    persistent: Sequence[bytes],
    standby: Sequence[bytes],
    dead: int,
    since: Sequence[bytes],
    share: Mapping[bytes, bytes],
    paused: int = 0,
) -> QueueCounts:
    owned = 0
    unowned = list(standby)
    tasks = list(standby)
    for i in range(0, len(persistent), 2):
        tasks.append(persistent[i])
        if persistent[i + 1]:
            owned += 1
        else:
            unowned.append(persistent[i])
    total = owned + len(unowned)
    info = QueueInfo(q, int(queued), int(delayed), int(running), total, int(dead), paused == 1)
    unowned_since = {since[j]: int(since[j + 1]) / 1000 for j in range(0, len(since), 2)}
    # The weight the scripts counted in, against that of the tasks present.
    present = total
    if b":heavy" in share:
        present = sum(int(share.get(b"w" + t, b"1")) for t in tasks)
    vanished = max(0, int(share.get(b":weight", b"0")) - present)
    return QueueCounts(info, owned, tuple(sorted(unowned)), unowned_since, vanished)


#: Commands per queue in :func:`overview`'s read script.
_PER_QUEUE = 13


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


async def overview(client: Client, info_cache: dict[str, dict[str, Any]] | None = None) -> Overview:
    """Read everything the dashboard shows in two round trips.

    Args:
        info_cache: worker id -> its description (host, pid, started), kept
            by the caller between calls so that each worker's description
            is read once; ids no longer registered are dropped from it.

    Raises:
        MeshConnectionError: Redis could not be reached.
        ProtocolError: a process record is malformed.
    """
    conn = client._check()
    k = client._keys
    cache: dict[str, dict[str, Any]] = {} if info_cache is None else info_cache
    (sec, usec), names, flat, epoch, memory = _checked(
        await conn.pipeline(
            [
                ("TIME",),
                ("SMEMBERS", k.queues),
                ("ZRANGE", k.workers, 0, -1, "WITHSCORES"),
                ("GET", k.epoch),
                INFO_MEMORY,
            ],
            raise_on_error=False,
        )
    )
    now_ms = int(sec) * 1000 + int(usec) // 1000
    queues = sorted(q.decode() for q in names)
    deadlines = {flat[i].decode(): int(float(flat[i + 1])) for i in range(0, len(flat), 2)}
    for gone in set(cache) - set(deadlines):
        del cache[gone]
    new = sorted(set(deadlines) - set(cache))
    cmds: list[tuple[Any, ...]] = []
    for q in queues:
        cmds += [
            ("LLEN", k.queue(q)),
            ("ZCARD", k.delayed(q)),
            ("HGETALL", k.procs(q)),
            ("HGETALL", k.persistent(q)),
            ("SMEMBERS", k.standby(q)),
            ("LLEN", k.dead(q)),
            ("SMEMBERS", k.servers(q)),
            ("ZRANGE", k.unowned(q), 0, -1, "WITHSCORES"),
            ("ZCARD", k.prio(q)),
            ("HGETALL", k.share(q)),
            ("HGETALL", k.moving(q)),
            ("HGETALL", k.reserved(q)),
            ("EXISTS", k.paused(q)),
        ]
    if new:
        cmds.append(("HMGET", k.info, *new))
    replies = await run_reads(conn, cmds)  # at the memory limit too, unlike MULTI
    fresh: dict[str, dict[str, Any]] = {}
    if new:
        for w, raw in zip(new, replies[-1], strict=True):
            fresh[w] = _load_info(raw)
            if fresh[w].get("started"):  # complete: a joining worker writes it twice
                cache[w] = fresh[w]
    serves: dict[str, list[str]] = {w: [] for w in deadlines}
    held: dict[str, int] = dict.fromkeys(deadlines, 0)
    shares: dict[str, list[QueueShare]] = {w: [] for w in deadlines}
    processes: list[Process] = []
    out: list[QueueCounts] = []
    for i, q in enumerate(queues):
        group = replies[_PER_QUEUE * i : _PER_QUEUE * (i + 1)]
        queued, delayed, procs, persistent, standby, dead, servers, since, prio = group[:9]
        share_hash, moving, reserved = (_pairs(r) for r in group[9:12])
        queued += prio  # tasks with a priority are queued too
        on_q: dict[str, int] = {}
        holder: dict[bytes, str] = {}
        for j in range(0, len(procs), 2):
            p = parse_record(procs[j], procs[j + 1], q)
            processes.append(p)
            holder[procs[j]] = p.worker_id
            on_q[p.worker_id] = on_q.get(p.worker_id, 0) + 1
            if p.worker_id in held:
                held[p.worker_id] += 1
        balance = QueueBalance.read(
            q,
            share_hash.get(b":weight"),
            share_hash.get(b":capacity"),
            moving,
            reserved,
            [holder[pid] for pid in moving if pid in holder],
        )
        for w_b in servers:
            w = w_b.decode()
            serves.setdefault(w, []).append(q)
            shares.setdefault(w, []).append(
                balance.of(
                    w, on_q.get(w, 0), share_hash.get(b"c" + w_b), share_hash.get(b"h" + w_b)
                )
            )
        running = len(procs) // 2
        out.append(
            _queue_counts(
                q,
                queued,
                delayed,
                running,
                persistent,
                standby,
                dead,
                since,
                share_hash,
                group[12],
            )
        )
    processes.sort(key=lambda p: p.token)
    workers = []
    for w, deadline in sorted(deadlines.items()):
        info = cache.get(w) or fresh.get(w, {})
        workers.append(
            WorkerInfo(
                id=w,
                alive=deadline > now_ms,
                queues=tuple(serves.get(w, ())),
                processes=held[w],
                lease_left=(deadline - now_ms) / 1000,
                host=str(info.get("host", "")),
                pid=int(info.get("pid", 0)),
                started=float(info.get("started", 0.0)),
                shares=tuple(shares.get(w, ())),
            )
        )
    _tell_vanished(client, out)
    missing = epoch_missing(_epoch(client), epoch)
    return Overview(now_ms / 1000, workers, out, processes, _memory_of(client, memory), missing)
