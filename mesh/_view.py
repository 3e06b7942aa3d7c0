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

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ._client import Client, QueueBalance, _load_info, _pairs
from ._scripts import parse_record
from ._types import DelayedTask, Process, QueueInfo, QueueShare, WorkerInfo

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
    it is printable UTF-8, else a ``b'...'`` literal; cut to ``width``
    characters, the last ones being ``ellipsis``. Sync, no I/O."""
    try:
        text = task.decode()
    except UnicodeDecodeError:
        text = repr(task)
    else:
        if not text.isprintable():
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


async def snapshot(
    client: Client, *, processes: bool = False, delayed: int | None = None
) -> Snapshot:
    """Read workers, queue counts (all queues in one transaction) and,
    optionally, the running processes and the first ``delayed`` delayed
    tasks of each queue that has some.

    Raises:
        MeshConnectionError: Redis could not be reached.

    Nothing is written; a cancelled call leaves nothing behind.
    """
    now = await client.time()
    workers = await client.workers()
    queues = await client.queue_infos()
    procs = await client.processes() if processes else None
    due = None
    if delayed is not None:
        due = {}
        for q in queues:
            if q.delayed:
                due[q.name] = await client.delayed(q.name, limit=delayed)
    return Snapshot(now, workers, queues, procs, due)


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
    """

    info: QueueInfo
    persistent_owned: int
    unowned: tuple[bytes, ...]
    unowned_since: Mapping[bytes, float] = attrs.field(factory=dict)

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


async def counts(client: Client) -> MeshCounts:
    """Read the mesh-wide counts: two round trips (the clock and the list of
    queues, then one transaction for everything else).

    Its cost in Redis is O(log workers) plus, per queue, O(persistent tasks)
    (to tell owned from unowned ones, and since when those are unowned).

    Raises:
        MeshConnectionError: Redis could not be reached.
    """
    conn = client._check()
    k = client._keys
    (sec, usec), names = await conn.pipeline([("TIME",), ("SMEMBERS", k.queues)])
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
            ("EXISTS", k.paused(q)),
        ]
    *_, replies = await conn.pipeline([("MULTI",), *cmds, ("EXEC",)])
    for r in replies:
        if isinstance(r, Exception):
            raise r
    out = []
    for i, q in enumerate(queues):
        group = replies[2 + 9 * i : 2 + 9 * (i + 1)]
        queued, delayed, running, persistent, standby, dead, since, prio, paused = group
        queued += prio  # tasks with a priority are queued too
        out.append(
            _queue_counts(q, queued, delayed, running, persistent, standby, dead, since, paused)
        )
    return MeshCounts(now_ms / 1000, int(replies[0]), int(replies[1]), out)


def _queue_counts(
    q: str,
    queued: int,
    delayed: int,
    running: int,
    persistent: Sequence[bytes],
    standby: Sequence[bytes],
    dead: int,
    since: Sequence[bytes],
    paused: int = 0,
) -> QueueCounts:
    owned = 0
    unowned = list(standby)
    for i in range(0, len(persistent), 2):
        if persistent[i + 1]:
            owned += 1
        else:
            unowned.append(persistent[i])
    total = owned + len(unowned)
    info = QueueInfo(q, int(queued), int(delayed), int(running), total, int(dead), paused == 1)
    unowned_since = {since[j]: int(since[j + 1]) / 1000 for j in range(0, len(since), 2)}
    return QueueCounts(info, owned, tuple(sorted(unowned)), unowned_since)


#: Commands per queue in :func:`overview`'s transaction.
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
    (sec, usec), names, flat = await conn.pipeline(
        [("TIME",), ("SMEMBERS", k.queues), ("ZRANGE", k.workers, 0, -1, "WITHSCORES")]
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
    *_, replies = await conn.pipeline([("MULTI",), *cmds, ("EXEC",)])
    for r in replies:
        if isinstance(r, Exception):
            raise r
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
            _queue_counts(q, queued, delayed, running, persistent, standby, dead, since, group[12])
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
    return Overview(now_ms / 1000, workers, out, processes)
