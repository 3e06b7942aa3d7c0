"""Every raw read of a namespace's state, and the one table of a queue's keys.

:data:`QUEUE_KEYS` says, for each key a queue has, how its size is read and
how it is read whole (and parsed); :data:`QUEUE_COUNTS` says which of those
keys make up each count of a queue (each job state, and its persistent
tasks), and how the exporter names it. A :class:`QueueRead` picks from the
table what one look needs of every queue, so the client's counts
(:meth:`Reader.queue_infos`), the exporter's (:func:`mesh._view.counts`) and
the dashboard's (:func:`mesh._view.overview`) are built from the same rows.
A :class:`Reader` sends every read: the :class:`~mesh.Client`'s,
:mod:`mesh._view`'s and :mod:`mesh._browse`'s.

Reads that must agree with each other (a task may move between two keys
while they are read) go as one read-only script (:func:`run_reads`, one
round trip, answered at Redis's memory limit too, unlike ``MULTI``); the
others are pipelined. Nothing here writes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from ._connection import Connection
from ._errors import ClosedError, CommandError
from ._eval import run_reads, run_script
from ._keys import Keys
from ._memory import INFO_MEMORY, MemoryInfo, MemoryWatch, read_memory
from ._policy import QueuePolicy, parse_policy
from ._replies import parse_dead, parse_record
from ._schedule import Schedule, parse_spec, split_id
from ._scripts import load_scripts
from ._share import QueueBalance
from ._types import DeadLetter, DelayedTask, Process, QueueShare, WorkerInfo

__all__ = [
    "COUNTS",
    "INFO",
    "JobReads",
    "JOB_STATES",
    "OVERVIEW",
    "QUEUE_COUNTS",
    "QUEUE_KEYS",
    "QueueInfo",
    "QueueCount",
    "MeshHead",
    "QueueKey",
    "QueueRead",
    "Reader",
    "load_info",
    "pairs",
    "queue_info",
    "size",
    "worker_info",
]

Command = tuple[Any, ...]


def pairs(reply: Any) -> dict[bytes, bytes]:
    """An HGETALL reply (a flat list, or a map) as a dict."""
    if isinstance(reply, dict):
        return reply
    return {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


def _scores(reply: Any) -> dict[bytes, int]:
    """A ``ZRANGE ... WITHSCORES`` reply as member -> score (whole ms)."""
    return {reply[i]: int(float(reply[i + 1])) for i in range(0, len(reply), 2)}


def _same(reply: Any) -> Any:
    return reply


def load_info(raw: bytes | None) -> dict[str, Any]:
    """A worker's description (``{ns}:info``'s field: host, pid, started),
    ``{}`` when missing or not a JSON object."""
    if not raw:
        return {}
    try:
        info = json.loads(raw)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


@attrs.frozen
class QueueKey:
    """One key of every queue: its name (:class:`~mesh._keys.Keys`' method),
    the command that reads its size (with ``size_args`` after the key; a
    nil reply is 0), the command (after the key) that reads it whole, with
    the parser of that reply, and what its size is when read whole
    (``count`` of the parsed reply)."""

    key: Callable[[Keys, str], str]
    size: str
    whole: tuple[Any, ...]
    parse: Callable[[Any], Any] = list
    size_args: tuple[Any, ...] = ()
    count: Callable[[Any], int] = len


def _grouped(fields: Mapping[bytes, bytes]) -> int:
    """The jobs queued in all of a queue's groups: the ``:n`` field of
    ``{ns}:groups:<Q>`` (kept by the scripts)."""
    return int(fields.get(b":n", b"0"))


#: The keys of a queue (see protocol/README.md), the one table of them.
QUEUE_KEYS: dict[str, QueueKey] = {
    "queue": QueueKey(Keys.queue, "LLEN", ("LRANGE", 0, -1)),
    "prio": QueueKey(Keys.prio, "ZCARD", ("ZRANGE", 0, -1)),
    "delayed": QueueKey(Keys.delayed, "ZCARD", ("ZRANGE", 0, -1, "WITHSCORES"), _scores),
    "procs": QueueKey(Keys.procs, "HLEN", ("HGETALL",), pairs),
    "persistent": QueueKey(Keys.persistent, "HLEN", ("HGETALL",), pairs),
    "standby": QueueKey(Keys.standby, "SCARD", ("SMEMBERS",)),
    "dead": QueueKey(Keys.dead, "LLEN", ("LRANGE", 0, -1)),
    "paused": QueueKey(Keys.paused, "EXISTS", ("GET",), _same),
    "unowned": QueueKey(Keys.unowned, "ZCARD", ("ZRANGE", 0, -1, "WITHSCORES"), _scores),
    "servers": QueueKey(Keys.servers, "SCARD", ("SMEMBERS",)),
    "share": QueueKey(Keys.share, "HLEN", ("HGETALL",), pairs),
    "moving": QueueKey(Keys.moving, "HLEN", ("HGETALL",), pairs),
    "reserved": QueueKey(Keys.reserved, "HLEN", ("HGETALL",), pairs),
    # a queue's groups (mesh._group_reads): the jobs queued in all of them,
    # and those delayed (a delay, or a retry's backoff)
    "grouped": QueueKey(Keys.groups, "HGET", ("HGETALL",), pairs, (":n",), _grouped),
    "gdelayed": QueueKey(Keys.group_delayed, "ZCARD", ("ZRANGE", 0, -1, "WITHSCORES"), _scores),
    # whether the queue has groups at all (running, paused, settings)
    "groups": QueueKey(Keys.groups, "HLEN", ("HGETALL",), pairs),
}


@attrs.frozen
class QueueCount:
    """One count of a queue: the attribute of :class:`~mesh.QueueInfo` that
    holds it, the queue keys whose sizes add up to it, the exporter's gauge
    of it (``mesh_queue_<metric>`` with ``help``; None: none of its own) and
    whether it is a state a job can be in (one :meth:`Client.jobs` lists)."""

    name: str
    keys: tuple[str, ...]
    metric: str | None
    help: str
    state: bool = True


#: A queue's counts, in the order ``mesh status``, the dashboard and the
#: exporter show them. A new job state is a new row here, its key's row in
#: :data:`QUEUE_KEYS` and its attribute of :class:`QueueInfo` (below).
QUEUE_COUNTS: tuple[QueueCount, ...] = (
    QueueCount("queued", ("queue", "prio", "grouped"), "length", "Tasks waiting to be claimed."),
    QueueCount(
        "delayed",
        ("delayed", "gdelayed"),
        "delayed",
        "Tasks waiting for their due time: enqueued with a delay or at a time, "
        "or failed and waiting for a retry.",
    ),
    QueueCount("running", ("procs",), "running", "Processes (claimed tasks) on any worker."),
    QueueCount(
        "persistent",
        ("persistent", "standby"),
        None,
        "Persistent tasks of the queue, wherever they are.",
        state=False,
    ),
    QueueCount("dead", ("dead",), "dead_letters", "Dead-lettered one-shot tasks."),
)

#: The states a job can be in (:meth:`Client.jobs`), in the order shown.
JOB_STATES: tuple[str, ...] = tuple(c.name for c in QUEUE_COUNTS if c.state)


@attrs.frozen
class QueueInfo:
    """A queue's counts (see :meth:`Client.queue_info`), read together: one
    attribute per row of :data:`QUEUE_COUNTS` (kept beside it), and whether
    the queue is paused.

    Attributes:
        name: the queue.
        queued: tasks waiting to be claimed (those queued in its groups
            included).
        delayed: tasks waiting for their due time (enqueued with a delay,
            or failed and waiting for a retry; its groups' included).
        running: processes (claimed tasks) on any worker.
        persistent: persistent tasks of the queue, wherever they are.
        dead: dead-lettered one-shot tasks.
        paused: whether the queue is paused (:meth:`Client.pause`): no new
            one-shot task of it starts.
    """

    name: str
    queued: int
    delayed: int
    running: int
    persistent: int
    dead: int
    paused: bool = False


@attrs.frozen
class QueueRead:
    """What one look reads of every queue: the keys whose size it needs and
    those it reads whole (names of :data:`QUEUE_KEYS`)."""

    sizes: tuple[str, ...]
    wholes: tuple[str, ...] = ()

    def commands(self, keys: Keys, queue: str) -> list[Command]:
        """The commands for ``queue``, sizes first."""
        out: list[Command] = []
        for name in self.sizes:
            row = QUEUE_KEYS[name]
            out.append((row.size, row.key(keys, queue), *row.size_args))
        for name in self.wholes:
            row = QUEUE_KEYS[name]
            out.append((row.whole[0], row.key(keys, queue), *row.whole[1:]))
        return out

    def parse(self, replies: Sequence[Any]) -> dict[str, Any]:
        """One queue's replies by key name: a size as an int, a whole key
        parsed by its row."""
        n = len(self.sizes)
        got: dict[str, Any] = {
            name: int(r or 0) for name, r in zip(self.sizes, replies[:n], strict=True)
        }
        for name, r in zip(self.wholes, replies[n:], strict=True):
            got[name] = QUEUE_KEYS[name].parse(r)
        return got

    def __len__(self) -> int:
        return len(self.sizes) + len(self.wholes)


def size(got: Mapping[str, Any], name: str) -> int:
    """The size of key ``name`` in a queue's parsed replies, read as a size
    or whole."""
    v = got[name]
    return v if isinstance(v, int) else QUEUE_KEYS[name].count(v)


def queue_info(queue: str, got: Mapping[str, Any]) -> QueueInfo:
    """:class:`~mesh.QueueInfo` of ``queue`` from its parsed replies (of a
    :class:`QueueRead` that reads every key a job state or the info needs)."""
    counts = {c.name: sum(size(got, k) for k in c.keys) for c in QUEUE_COUNTS}
    return QueueInfo(queue, paused=got["paused"] == 1, **counts)


_COUNTED = tuple(dict.fromkeys(k for c in QUEUE_COUNTS for k in c.keys))
_WHOLE = ("persistent", "standby", "unowned", "share")
#: What :meth:`Reader.queue_infos` reads of each queue.
INFO = QueueRead((*_COUNTED, "paused"))
#: What the exporter's counts read of each queue (:func:`mesh._view.counts`);
#: ``groups`` tells the queues whose groups it then reads.
COUNTS = QueueRead((*(k for k in _COUNTED if k not in _WHOLE), "paused", "groups"), _WHOLE)
#: What the dashboard reads of each queue (:func:`mesh._view.overview`):
#: the processes whole, to tell who holds what.
OVERVIEW = QueueRead(
    (*(k for k in _COUNTED if k not in (*_WHOLE, "procs")), "paused"),
    ("procs", *_WHOLE, "servers", "moving", "reserved"),
)


@attrs.frozen
class MeshHead:
    """The first round trip of a whole-mesh look: the clock, the queues, the
    namespace's epoch and ``INFO memory`` (the last two as replied, an error
    included: an ACL may refuse them), and the workers' lease deadlines
    (ms) when asked for."""

    now_ms: int
    queues: list[str]
    epoch: Any
    memory: Any
    deadlines: dict[str, int]


class JobReads:
    """A reader's connection and the job browser's reads (:mod:`mesh._browse`):
    entries by position, previews of entries (``peek.lua``), where a
    payload is, the attempts kept of it, the per-minute counts and the kept
    results. Plain pipelines, never one step: a page is a snapshot of
    positions (see :mod:`mesh._browse`)."""

    def __init__(self, conn: Connection, keys: Keys) -> None:
        self._conn = conn
        self._closed = False
        self.keys = keys

    def check(self) -> Connection:
        """The connection.

        Raises:
            ClosedError: the client it belongs to is closed.
        """
        if self._closed:
            raise ClosedError("this client is closed")
        return self._conn

    def close(self) -> None:
        """Refuse every read from now on (the connection is its opener's to close)."""
        self._closed = True

    async def peek(self, key: str, extras: Sequence[str], args: Sequence[Any]) -> Any:
        """One ``peek.lua`` call on ``key`` (and the queue's ``extras`` keys)."""
        return await run_script(self.check(), load_scripts()["peek"], [key, *extras], args)

    async def process_ids(self, queue: str) -> list[bytes]:
        """The ids of the running processes of ``queue`` (unordered)."""
        return list(await self.check().execute("HKEYS", self.keys.procs(queue)))

    async def process_record(self, queue: str, pid: bytes | int) -> bytes | None:
        """The record of process ``pid`` of ``queue``, None if it is gone."""
        rec: bytes | None = await self.check().execute("HGET", self.keys.procs(queue), pid)
        return rec

    async def sizes(self, queue: str, *names: str) -> list[int]:
        """The sizes of the queue keys ``names`` (of :data:`QUEUE_KEYS`), pipelined."""
        read = QueueRead(names)
        got = read.parse(await self.check().pipeline(read.commands(self.keys, queue)))
        return [got[n] for n in names]

    async def group_sizes(self, queue: str, group: str) -> tuple[int, int]:
        """(queued jobs with a priority, without one) of ``group`` of ``queue``."""
        k = self.keys
        got = await self.check().pipeline(
            [("ZCARD", k.group_prio(queue, group)), ("LLEN", k.group_jobs(queue, group))]
        )
        return int(got[0]), int(got[1])

    async def group_delayed(self, queue: str, group: str) -> list[tuple[float, bytes]]:
        """(due time in ms, member) of every delayed job of ``group`` of
        ``queue`` (``{ns}:gdelayed:<Q>``, members ``G NUL flag level
        payload``), by due time: a ZSCAN matching the group's members (a group
        name has no glob character)."""
        key = self.keys.group_delayed(queue)
        pattern = group.encode() + b"\0*"
        found: list[tuple[float, bytes]] = []
        cursor: Any = 0
        while True:
            cursor, items = await self.check().execute(
                "ZSCAN", key, cursor, "MATCH", pattern, "COUNT", 1000
            )
            found += [(float(items[i + 1]), items[i]) for i in range(0, len(items), 2)]
            if int(cursor) == 0:
                return sorted(found)

    async def entry(self, queue: str, name: str, pos: int) -> bytes | None:
        """The entry at ``pos`` of the queue's list or sorted set ``name`` (of
        :data:`QUEUE_KEYS`), None past its end."""
        row = QUEUE_KEYS[name]
        key = row.key(self.keys, queue)
        if row.size == "LLEN":
            got: bytes | None = await self.check().execute("LINDEX", key, pos)
            return got
        members = await self.check().execute("ZRANGE", key, pos, pos)
        return members[0] if members else None

    async def job_extras(
        self, queue: str, payloads: Sequence[bytes], *, levels: bool
    ) -> list[list[Any]]:
        """Per payload (one list each): its field of the persistent hash,
        whether it is in the standby set, its attempts, since when unowned
        (ms), its enqueue time (ms, a one-shot job of a queue that keeps
        them) and, with ``levels``, its delayed priority."""
        k = self.keys
        cmds: list[Command] = [
            ("HMGET", k.persistent(queue), *payloads),
            ("SMISMEMBER", k.standby(queue), *payloads),
            ("HMGET", k.attempts(queue), *payloads),
            ("ZMSCORE", k.unowned(queue), *payloads),
            ("ZMSCORE", k.enqt(queue), *payloads),
        ]
        if levels:
            cmds.append(("HMGET", k.delayed_prio(queue), *payloads))
        return list(await self.check().pipeline(cmds))

    async def enqueue_times(self, queue: str, payloads: Sequence[bytes]) -> list[Any]:
        """The enqueue time (ms) of each of ``payloads`` (as queued) on
        ``queue``, None where none is kept: one ``ZMSCORE``."""
        if not payloads:
            return []
        return list(await self.check().execute("ZMSCORE", self.keys.enqt(queue), *payloads))

    async def whereabouts(self, queue: str, payload: bytes) -> list[Any]:
        """Where ``payload`` may be, pipelined: the process ids, its position
        in the plain list, its due time (ms), and the sizes of the priority
        set and of the dead letters."""
        k = self.keys
        return list(
            await self.check().pipeline(
                [
                    ("HKEYS", k.procs(queue)),
                    ("LPOS", k.queue(queue), payload),
                    ("ZSCORE", k.delayed(queue), payload),
                    ("ZCARD", k.prio(queue)),
                    ("LLEN", k.dead(queue)),
                ]
            )
        )

    async def scan_prio(self, queue: str, cursor: bytes, pattern: bytes) -> tuple[Any, list[bytes]]:
        """One ``ZSCAN`` step of the queue's priority set: the next cursor and
        the members and scores found."""
        cursor, flat = await self.check().execute(
            "ZSCAN", self.keys.prio(queue), cursor, "MATCH", pattern, "COUNT", 1000
        )
        return cursor, flat

    async def tries(self, queue: str, payload: bytes) -> bytes | None:
        """The failed attempts kept of ``payload`` (a :meth:`Keys.tries` field)."""
        field = hashlib.sha1(payload).hexdigest()
        got: bytes | None = await self.check().execute("HGET", self.keys.tries(queue), field)
        return got

    async def minute_stats(self, queues: Sequence[str]) -> list[Any]:
        """The Redis ``TIME`` and each queue's per-minute counts hash, pipelined."""
        stats = [("HGETALL", self.keys.stats(q)) for q in queues]
        return list(await self.check().pipeline([("TIME",), *stats]))

    async def scan_results(self, cursor: bytes, pattern: bytes) -> tuple[Any, list[bytes]]:
        """One ``SCAN`` step for result records: the next cursor and the names."""
        cursor, names = await self.check().execute("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
        return cursor, names

    async def ranges(self, commands: Sequence[Command]) -> list[Any]:
        """``GETRANGE``/``STRLEN`` of result records, pipelined (none: ``[]``)."""
        return list(await self.check().pipeline(list(commands))) if commands else []


class Reader(JobReads):
    """Every read of one namespace's state, on one connection. The client
    reads through it, and so do ``mesh status``, the dashboard and the
    exporter (:mod:`mesh._view`), and the job browser (:mod:`mesh._browse`).

    Attributes:
        keys: the namespace's key names.
        memory: Redis's memory and eviction policy as the last whole-mesh
            look saw them (a policy that can evict is logged once).
        vanished: per queue, persistent tasks missing without a cancel, as
            last reported.
    """

    def __init__(self, conn: Connection, keys: Keys) -> None:
        super().__init__(conn, keys)
        self.memory = MemoryWatch("client")
        self.vanished: dict[str, int] = {}

    @property
    def epoch(self) -> Any:
        """The :class:`~mesh._epoch.Epoch` the connection checks (None: not checked)."""
        return self._conn.topology.epoch

    async def time(self) -> float:
        """The Redis clock, in seconds."""
        sec, usec = await self.check().execute("TIME")
        return int(sec) + int(usec) / 1e6

    async def queues(self) -> list[str]:
        """The known queues, sorted."""
        r = await self.check().execute("SMEMBERS", self.keys.queues)
        return sorted(q.decode() for q in r)

    async def timed_queues(self) -> list[str]:
        """The queues that keep the enqueue times of their one-shot jobs
        (``{ns}:timed``), sorted."""
        r = await self.check().execute("SMEMBERS", self.keys.timed())
        return sorted(q.decode() for q in r)

    async def read_memory(self) -> MemoryInfo | None:
        """``INFO memory``, told to :attr:`memory`."""
        info = await read_memory(self.check())
        self.memory.update(info)
        return info

    async def queue_infos(self, names: Sequence[str]) -> list[QueueInfo]:
        """The counts of ``names``, read in one step."""
        if not names:
            return []
        cmds = [c for q in names for c in INFO.commands(self.keys, q)]
        r = await run_reads(self.check(), cmds)
        n = len(INFO)
        return [queue_info(q, INFO.parse(r[n * i : n * (i + 1)])) for i, q in enumerate(names)]

    async def tasks(self, queue: str) -> list[bytes]:
        """The queued payloads, in claim order."""
        k = self.keys
        prio, plain = await run_reads(
            self.check(), [("ZRANGE", k.prio(queue), 0, -1), ("LRANGE", k.queue(queue), 0, -1)]
        )
        return [m[16:] for m in prio] + list(plain)

    async def queue_length(self, queue: str) -> int:
        """How many tasks are queued, those with a priority included."""
        k = self.keys
        n, p = await run_reads(self.check(), [("LLEN", k.queue(queue)), ("ZCARD", k.prio(queue))])
        return int(n) + int(p)

    async def paused(self, names: Sequence[str]) -> dict[str, float]:
        """The paused queues among ``names``, each with since when (s)."""
        if not names:
            return {}
        got = await self.check().pipeline([("GET", self.keys.paused(q)) for q in names])
        return {q: int(v) / 1000 for q, v in zip(names, got, strict=True) if v is not None}

    async def processes(self, queues: Sequence[str]) -> list[Process]:
        """The running processes of ``queues``, in claim order."""
        if not queues:
            return []
        replies = await self.check().pipeline([("HGETALL", self.keys.procs(q)) for q in queues])
        out = []
        for q, r in zip(queues, replies, strict=True):
            out += [parse_record(pid, rec, q) for pid, rec in pairs(r).items()]
        out.sort(key=lambda p: p.token)
        return out

    async def persistent(self, queue: str) -> dict[bytes, str | None]:
        """Payload -> process id (running) or None (queued or delayed), read in
        one step: a claim or a give back may move a payload between the two
        keys, and two separate reads could miss it."""
        k = self.keys
        running, standby = await run_reads(
            self.check(), [("HGETALL", k.persistent(queue)), ("SMEMBERS", k.standby(queue))]
        )
        out: dict[bytes, str | None] = dict.fromkeys(standby)
        # a queued one may also be a field with the value "" (while the hash is small)
        out.update((t, pid.decode() or None) for t, pid in pairs(running).items())
        return out

    async def delayed(self, queue: str, limit: int | None) -> list[DelayedTask]:
        """The delayed tasks of ``queue``, the first due first (all, or ``limit``)."""
        k = self.keys
        end = -1 if limit is None else limit - 1
        r, leveled = await run_reads(
            self.check(),
            [
                ("ZRANGE", k.delayed(queue), 0, end, "WITHSCORES"),
                ("EXISTS", k.delayed_prio(queue)),
            ],
        )
        payloads = r[0::2]
        levels = [None] * len(payloads)
        if leveled and payloads:
            levels = await self.check().execute("HMGET", k.delayed_prio(queue), *payloads)
        return [
            DelayedTask(p, int(float(due)) / 1000, int(lv or 0))
            for p, due, lv in zip(payloads, r[1::2], levels, strict=True)
        ]

    async def schedules(self, queue: str | None) -> list[Schedule]:
        """The periodic tasks (of ``queue``, or of every queue), the next due first."""
        k = self.keys
        flat, specs = await run_reads(
            self.check(),
            [("ZRANGE", k.schedules, 0, -1, "WITHSCORES"), ("HGETALL", k.schedule_specs)],
        )
        spec_of_id = pairs(specs)
        out = []
        for i in range(0, len(flat), 2):
            q, payload = split_id(flat[i])
            spec = spec_of_id.get(flat[i])
            if spec is None or (queue is not None and q != queue):
                continue
            every, expr = parse_spec(spec)
            out.append(Schedule(q, payload, every, expr, int(float(flat[i + 1])) / 1000))
        return out

    async def policy(self, queue: str) -> QueuePolicy | None:
        """The stored policy of ``queue``, or None."""
        raw = await self.check().execute("HGET", self.keys.policy, queue)
        return None if raw is None else parse_policy(raw, queue)

    async def has_policy(self, queue: str) -> bool:
        """Whether ``queue`` has a stored policy."""
        return bool(await self.check().execute("HEXISTS", self.keys.policy, queue))

    async def dead_letters(self, queue: str) -> list[DeadLetter]:
        """The dead letters of ``queue``, oldest first."""
        r = await self.check().execute("LRANGE", self.keys.dead(queue), 0, -1)
        return [parse_dead(rec, queue) for rec in r]

    async def outcome(self, queue: str, payload: bytes) -> tuple[bytes | None, list[bytes]]:
        """The kept result record of ``payload`` and the queue's dead letters,
        read in one step."""
        k = self.keys
        rec, dead = await run_reads(
            self.check(), [("GET", k.result(queue, payload)), ("LRANGE", k.dead(queue), 0, -1)]
        )
        return rec, list(dead)

    async def workers(self) -> list[WorkerInfo]:
        """Every registered worker, by id (see :meth:`Client.workers`)."""
        conn = self.check()
        k = self.keys
        now_r, ids = await conn.pipeline([("TIME",), ("ZRANGE", k.workers, 0, -1, "WITHSCORES")])
        now_ms = int(now_r[0]) * 1000 + int(now_r[1]) // 1000
        entries = [(w.decode(), ms) for w, ms in _scores(ids).items()]
        if not entries:
            return []
        cmds: list[Command] = []
        for w, _ in entries:
            cmds += [("EXISTS", k.heartbeat(w)), ("SMEMBERS", k.serves(w))]
            cmds.append(("HGET", k.info, w))
        r = await conn.pipeline(cmds)
        served = [sorted(q.decode() for q in r[3 * i + 1]) for i in range(len(entries))]
        cmds = []
        for (w, _), qs in zip(entries, served, strict=True):
            for q in qs:
                cmds += [("SCARD", k.held(w, q)), ("HMGET", k.share(q), "c" + w, "h" + w)]
        r2 = await conn.pipeline(cmds) if cmds else []
        shares = await self.shares(sorted({q for qs in served for q in qs}))
        out, pos = [], 0
        for i, (w, deadline) in enumerate(entries):
            qs = served[i]
            got = r2[2 * pos : 2 * (pos + len(qs))]
            pos += len(qs)
            held = [int(c) for c in got[0::2]]
            mine = [
                shares[q].of(w, h, cap, extra)
                for q, h, (cap, extra) in zip(qs, held, got[1::2], strict=True)
            ]
            alive = r[3 * i] == 1
            info = load_info(r[3 * i + 2])
            out.append(worker_info(w, alive, qs, sum(held), deadline - now_ms, info, mine))
        out.sort(key=lambda info: info.id)
        return out

    async def shares(self, queues: list[str]) -> dict[str, QueueBalance]:
        """Per queue, what its fair shares are made of."""
        if not queues:
            return {}
        read = QueueRead((), ("share", "moving", "reserved"))
        k = self.keys
        r = await self.check().pipeline([c for q in queues for c in read.commands(k, q)])
        out = {}
        for j, q in enumerate(queues):
            got = read.parse(r[3 * j : 3 * j + 3])
            moving = got["moving"]
            holders = []
            if moving:
                recs = await self.check().execute("HMGET", k.procs(q), *moving)
                holders = [rec.split(b"\0", 1)[0].decode() for rec in recs if rec]
            share = got["share"]
            weight, capacity = share.get(b":weight"), share.get(b":capacity")
            out[q] = QueueBalance.read(q, weight, capacity, moving, got["reserved"], holders)
        return out

    async def head(self, *, workers: bool) -> MeshHead:
        """The first round trip of a whole-mesh look (see :class:`MeshHead`).

        Raises:
            CommandError: of any read but the epoch's and ``INFO``'s.
        """
        k = self.keys
        cmds: list[Command] = [("TIME",), ("SMEMBERS", k.queues)]
        if workers:
            cmds.append(("ZRANGE", k.workers, 0, -1, "WITHSCORES"))
        got = await self.check().pipeline(
            [*cmds, ("GET", k.epoch), INFO_MEMORY], raise_on_error=False
        )
        for r in got[:-2]:
            if isinstance(r, CommandError):
                raise r
        (sec, usec), names = got[0], got[1]
        flat = _scores(got[2]) if workers else {}
        deadlines = {w.decode(): ms for w, ms in flat.items()}
        now_ms = int(sec) * 1000 + int(usec) // 1000
        return MeshHead(now_ms, sorted(q.decode() for q in names), got[-2], got[-1], deadlines)

    async def queues_read(
        self,
        head: MeshHead,
        read: QueueRead,
        *,
        before: Sequence[Command] = (),
        after: Sequence[Command] = (),
    ) -> tuple[list[Any], list[dict[str, Any]], list[Any]]:
        """The second round trip of a whole-mesh look: ``read`` of every
        queue of ``head``, with ``before`` and ``after``, in one step.

        Returns:
            The replies of ``before``, each queue's parsed replies, those of
            ``after``.
        """
        cmds = [*before]
        for q in head.queues:
            cmds += read.commands(self.keys, q)
        r = await run_reads(self.check(), [*cmds, *after])
        n, b = len(read), len(before)
        groups = [read.parse(r[b + n * i : b + n * (i + 1)]) for i in range(len(head.queues))]
        return r[:b], groups, r[len(cmds) :]

    async def counts_read(self) -> tuple[MeshHead, int, int, list[dict[str, Any]]]:
        """What the exporter reads, in two round trips: the head, the workers
        registered and those alive (by lease deadline), and :data:`COUNTS`
        of each queue."""
        k = self.keys
        head = await self.head(workers=False)
        alive = ("ZCOUNT", k.workers, head.now_ms, "+inf")
        (n, live), groups, _ = await self.queues_read(
            head, COUNTS, before=[("ZCARD", k.workers), alive]
        )
        return head, int(n), int(live), groups

    async def overview_read(
        self, describe: Callable[[Mapping[str, int]], Sequence[str]]
    ) -> tuple[MeshHead, list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """What the dashboard reads, in two round trips: the head (with the
        workers' deadlines), :data:`OVERVIEW` of each queue, and the
        descriptions of the workers ``describe`` names (given the deadlines)."""
        head = await self.head(workers=True)
        new = list(describe(head.deadlines))
        after = [("HMGET", self.keys.info, *new)] if new else []
        _, groups, tail = await self.queues_read(head, OVERVIEW, after=after)
        infos = {w: load_info(raw) for w, raw in zip(new, tail[0] if new else [], strict=True)}
        return head, groups, infos


def worker_info(
    w: str,
    alive: bool,
    queues: Iterable[str],
    held: int,
    left_ms: int,
    info: Mapping[str, Any],
    shares: Iterable[QueueShare],
) -> WorkerInfo:
    """A :class:`~mesh.WorkerInfo` from what was read of worker ``w``: its
    lease (alive, ms left), its queues and processes, its description
    (host, pid, started) and its shares."""
    return WorkerInfo(
        id=w,
        alive=alive,
        queues=tuple(queues),
        processes=held,
        lease_left=left_ms / 1000,
        host=str(info.get("host", "")),
        pid=int(info.get("pid", 0)),
        started=float(info.get("started", 0.0)),
        shares=tuple(shares),
    )
