"""The replies of the protocol's scripts: the types the binding returns and
the parsers that build them from a script's reply (or from a record a script
wrote). Plain code: it imports nothing of the library but :mod:`mesh._errors`
and :mod:`mesh._types`, so the runner's I/O-free core can use the types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import outcome

from ._errors import FencedError, ProtocolError
from ._types import DeadLetter, Process

__all__ = [
    "ClaimReply",
    "CrashDeadLetter",
    "DelayReply",
    "HeartbeatReply",
    "HeartbeatRequest",
    "QueueBeat",
    "ReapCheck",
    "RebalanceReply",
    "RecycleManyReply",
    "RecycleReply",
    "ResultsToKeep",
    "kind_level_group",
    "parse_claim",
    "parse_claim_compact",
    "parse_dead",
    "parse_finish",
    "parse_heartbeats",
    "parse_record",
    "parse_result",
]


@attrs.frozen
class QueueBeat:
    """What one heartbeat says about one served queue (see heartbeat.lua)."""

    now_ms: int
    state: int  # 0: tasks ready; -1: none; N > 0: ms until a delayed task is due
    held: int  # processes Redis says the worker holds on the queue
    idle: bool  # whether the worker is in the queue's idle set
    idle_servers: int
    persistent: int = 0  # total weight of its persistent tasks (T; P with weights 1)
    servers: int = 1  # total capacity of its servers (C; S with capacities 1)
    release: tuple[str, ...] = ()  # processes a rebalance asks us to hand back
    capacity: int = 1  # the worker's capacity on the queue
    weight: int = 0  # the weight of the worker's processes there


@attrs.frozen
class HeartbeatReply:
    now_ms: int
    next_deadline_ms: int
    inbox: tuple[str, ...]
    queue_states: tuple[int, ...]
    held: tuple[int, ...]
    idle: tuple[bool, ...]
    idle_servers: tuple[int, ...]
    persistent: tuple[int, ...] = ()
    servers: tuple[int, ...] = ()
    release: tuple[tuple[str, ...], ...] = ()
    capacity: tuple[int, ...] = ()
    weight: tuple[int, ...] = ()

    def beats(self) -> list[QueueBeat]:
        """One :class:`QueueBeat` per queue named in the call, in its order."""
        per_queue = zip(
            self.queue_states,
            self.held,
            self.idle,
            self.idle_servers,
            self.persistent,
            self.servers,
            self.release,
            self.capacity,
            self.weight,
            strict=True,
        )
        return [QueueBeat(self.now_ms, *q) for q in per_queue]


@attrs.frozen
class HeartbeatRequest:
    """One worker's part of a ``heartbeat.lua`` call."""

    worker: str
    incarnation: str
    acks: tuple[str, ...] = ()  # process ids of cancels it has seen
    queues: tuple[str, ...] = ()  # the queues it serves, in the order beats() keeps


def parse_heartbeats(
    raw: Any,
    requests: Sequence[HeartbeatRequest],
    cache: dict[tuple[str, str], tuple[str, int, int, int, int]],
) -> list[outcome.Outcome[HeartbeatReply]]:
    """Split a ``heartbeat.lua`` reply into one outcome per worker; ``cache``
    keeps each (worker, queue)'s last balance (generation, T, C, capacity,
    extra weight), used when the reply says it still holds."""
    now, next_ms = int(raw[0]), int(raw[1])
    index: dict[str, int] = {}
    for r in requests:
        for q in r.queues:
            index.setdefault(q, len(index))
    idles = raw[2 : 2 + len(index)]
    # one flat list: each worker's part follows the last (heartbeat.lua)
    pos = 2 + len(index)
    out: list[outcome.Outcome[HeartbeatReply]] = []
    for r in requests:
        if isinstance(raw[pos], bytes):
            msg = raw[pos].decode()
            pos += 1
            out.append(outcome.Error(FencedError(msg.removeprefix("FENCED "))))
            continue
        n = int(raw[pos])
        inbox = tuple(x.decode() for x in raw[pos + 1 : pos + 1 + n])
        pos += 1 + n
        states, held, idle, release, shares = [], [], [], [], []
        for q in r.queues:
            states.append(int(raw[pos]))
            h = int(raw[pos + 1])
            held.append(h)
            idle.append(raw[pos + 2] == 1)
            pos += 3
            ids: tuple[str, ...] = ()
            if int(raw[pos]) == 0:
                pos += 1
                _, total, capacity, cap, extra = cache.get((r.worker, q), ("", 0, 1, 1, 0))
            else:
                gen, total, capacity, cap, extra, nrel = (int(x) for x in raw[pos + 1 : pos + 7])
                ids = tuple(x.decode() for x in raw[pos + 7 : pos + 7 + nrel])
                pos += 7 + nrel
                if gen >= 0:
                    cache[(r.worker, q)] = (str(gen), total, capacity, cap, extra)
                else:
                    cache.pop((r.worker, q), None)
            shares.append((total, capacity, cap, h + extra))
            release.append(ids)
        out.append(
            outcome.Value(
                HeartbeatReply(
                    now,
                    next_ms,
                    inbox,
                    tuple(states),
                    tuple(held),
                    tuple(idle),
                    tuple(int(idles[index[q]]) for q in r.queues),
                    tuple(x[0] for x in shares),
                    tuple(x[1] for x in shares),
                    tuple(release),
                    tuple(x[2] for x in shares),
                    tuple(x[3] for x in shares),
                )
            )
        )
    return out


@attrs.frozen
class ClaimReply:
    now_ms: int
    remaining: int
    processes: tuple[Process, ...]
    held_back: bool = False  # the fair share left persistent tasks for peers
    next_due_ms: int = -1  # ms until the first delayed task is due; -1: none


@attrs.frozen
class DelayReply:
    added: int  # payloads newly delayed (one delayed already keeps the earlier time)
    due_ms: int  # the due time, Redis clock
    now_ms: int


@attrs.frozen
class ResultsToKeep:
    """What a finish report keeps on a queue with a result TTL: per process
    id, its payload and what its handler returned (None, or bytes)."""

    ttl_ms: int
    values: Mapping[str, tuple[bytes, bytes | None]]


@attrs.frozen
class RecycleReply:
    alive: bool
    returned: int
    dead_lettered: int


class CrashDeadLetter(NamedTuple):
    """A task a recycle dead-lettered (its crashed worker's attempt was its
    last allowed one), for the recycler's log line."""

    queue: str
    head: bytes  # the payload's first 161 bytes
    attempts: int
    max_attempts: int
    worker: str  # the crashed worker


@attrs.frozen
class RecycleManyReply:
    """What one ``recycle.lua`` call did."""

    recycled: int  # workers that had anything left to recycle
    alive: list[str]  # workers found alive after all (left alone)
    returned: int  # processes handed back (or delayed)
    dead_lettered: int
    queues: list[str]  # the queues the call was given (learned ones included)
    dead: list[CrashDeadLetter] = attrs.Factory(list)  # the dead-lettered tasks


@attrs.frozen
class RebalanceReply:
    marked: int  # processes of peers marked to move to the caller
    persistent: int  # T, the total weight of the persistent tasks (P with weights 1)
    servers: int  # C, the total capacity of the servers (S with capacities 1)
    held: int  # the caller's held weight, what is on its way included


class ReapCheck(NamedTuple):
    now_ms: int
    next_ms: int  # until the earliest lease deadline still ahead; -1: none
    workers: int  # registered workers, live or not yet recycled
    dead: list[str]  # ids whose lease has run out


# A claim reply's processes are made without Process.__init__ (attrs' frozen
# __init__ sets each field through object.__setattr__, about a quarter of the
# cost of a claim reply): straight through the slots' descriptors, in the
# order of attrs.fields(Process) (tests/test_protocol.py checks that it
# builds what Process(...) does).
_PROCESS_SLOTS = (
    "id",
    "queue",
    "task",
    "token",
    "worker_id",
    "persistent",
    "attempts",
    "started",
    "group",
)
_PROCESS_SET = tuple(getattr(Process, name).__set__ for name in _PROCESS_SLOTS)


def parse_claim(r: Any, queue: str, worker: str) -> ClaimReply:
    """A :class:`ClaimReply` from a ``claim.lua`` reply: {now ms, tasks left
    (-1: held back), ms until the next delayed task (-1: none), then per
    process its id, persistent flag (1/0, or the name of the group of a
    group's job), failed attempts and payload}.

    Raises:
        ValueError, TypeError, IndexError: the reply is not of that shape.
    """
    now = int(r[0])
    started = now / 1000
    procs: list[Process] = []
    append = procs.append
    new = object.__new__
    set_id, set_queue, set_task, set_token = _PROCESS_SET[:4]
    set_worker, set_persistent, set_attempts, set_started, set_group = _PROCESS_SET[4:]
    for pid, persistent, attempts, task in zip(r[3::4], r[4::4], r[5::4], r[6::4], strict=True):
        p = new(Process)
        set_id(p, pid.decode())
        set_queue(p, queue)
        set_task(p, task)
        set_token(p, int(pid))
        set_worker(p, worker)
        set_persistent(p, persistent == 1)
        set_attempts(p, int(attempts))
        set_started(p, started)
        set_group(p, persistent.decode() if type(persistent) is bytes else None)
        append(p)
    left = int(r[1])
    return ClaimReply(now, max(left, 0), tuple(procs), held_back=left < 0, next_due_ms=int(r[2]))


def parse_claim_compact(r: Any, queue: str, worker: str) -> ClaimReply:
    """A :class:`ClaimReply` from the compact claim reply of
    ``finish_claim.lua`` (its finish flags taken off): {now ms, tasks left
    (-1: held back), ms until the next delayed task (-1: none), the first
    process id ("": none), c, mixed, the c payloads, then, if mixed is 1, per
    process its persistent flag (1/0, or the name of the group of a group's
    job) and failed attempts; if mixed is 2, per run of processes of one
    group its group (b"": none) and length}; process i has id first + i.

    Raises:
        ValueError, TypeError, IndexError: the reply is not of that shape.
    """
    now = int(r[0])
    c = int(r[4])
    mixed = r[5] == 1
    groups: list[str | None] | None = None
    if r[5] == 2:
        # runs of one group: (group or b"", length), in order
        groups = []
        for g, n in zip(r[6 + c :: 2], r[7 + c :: 2], strict=True):
            groups += [g.decode() or None] * int(n)
        if len(groups) != c:
            raise ValueError(f"a compact claim reply's runs of groups cover {len(groups)} of {c}")
    elif len(r) != 6 + c * (3 if mixed else 1):
        raise ValueError(f"a compact claim reply of {len(r)} items for {c} processes")
    procs: list[Process] = []
    if c:
        first = int(r[3])
        started = now / 1000
        append = procs.append
        new = object.__new__
        set_id, set_queue, set_task, set_token = _PROCESS_SET[:4]
        set_worker, set_persistent, set_attempts, set_started, set_group = _PROCESS_SET[4:]
        extra = r[6 + c :]
        for i, task in enumerate(r[6 : 6 + c]):
            token = first + i
            p = new(Process)
            set_id(p, str(token))
            set_queue(p, queue)
            set_task(p, task)
            set_token(p, token)
            set_worker(p, worker)
            if mixed:
                flag = extra[2 * i]
                set_persistent(p, flag == 1)
                set_attempts(p, int(extra[2 * i + 1]))
                set_group(p, flag.decode() if type(flag) is bytes else None)
            else:
                set_persistent(p, False)
                set_attempts(p, 0)
                set_group(p, groups[i] if groups is not None else None)
            set_started(p, started)
            append(p)
    left = int(r[1])
    return ClaimReply(now, max(left, 0), tuple(procs), held_back=left < 0, next_due_ms=int(r[2]))


#: The error kept in a dead-letter record is cut to this many bytes.
DEAD_ERROR_MAX = 2000


def split_error(text: str) -> tuple[str, str | None]:
    """A recorded failure as (its first line, the traceback below it or
    None): what ``describe_error`` writes, and one line from a peer that
    records no traceback."""
    head, nl, tb = text.partition("\n")
    return head, (tb if nl and tb else None)


def kind_level_group(kind: bytes) -> tuple[int, str | None]:
    """The priority level and group of a record's kind (``o``, ``o5``,
    ``g3tenant``; ``p`` gives (0, None)).

    Raises:
        ValueError: not a kind of the documented shape.
    """
    if kind[:1] == b"g" and kind[1:2].isdigit() and len(kind) > 2:
        return int(kind[1:2]), kind[2:].decode()
    if kind in _KINDS:
        return (int(kind[1:]) if len(kind) == 2 else 0), None
    raise ValueError(f"bad record kind {kind!r}")


def parse_dead(rec: bytes, queue: str) -> DeadLetter:
    """A :class:`DeadLetter` from an entry of ``{ns}:dead:<Q>``.

    Raises:
        ProtocolError: the entry is not of the documented shape.
    """
    parts = rec.split(b"\0", 5)
    try:
        when, attempts, worker, error, kind, payload = parts
        level, group = kind_level_group(kind)
        head, tb = split_error(error.decode(errors="replace"))
        return DeadLetter(
            payload,
            int(attempts),
            head,
            worker.decode(errors="replace"),
            int(when) / 1000,
            tb,
            level,
            group,
        )
    except ValueError:
        raise ProtocolError(f"malformed dead-letter record of queue {queue}") from None


def parse_result(rec: bytes, payload: bytes) -> tuple[float, bytes | None] | None:
    """(when, value) of a result record (``finish_results.lua``), or None if
    the record is of another payload (a SHA-1 collision) or malformed."""
    parts = rec.split(b"\0", 4)
    if len(parts) != 5 or parts[0] not in (b"v", b"n"):
        return None
    try:
        when, size = int(parts[1]), int(parts[3])
    except ValueError:
        return None
    rest = parts[4]
    if rest[size:] != payload:
        return None
    return when / 1000, (rest[:size] if parts[0] == b"v" else None)


def parse_finish(r: Any) -> list[bool]:
    return [x == 1 for x in r]


# A process record's kind: persistent, one-shot, one-shot with a priority;
# or b"g" + level + group: a group's job.
_KINDS = frozenset([b"p", b"o", *(f"o{i}".encode() for i in range(1, 10))])


def parse_record(pid: bytes, rec: bytes, queue: str) -> Process:
    """A :class:`Process` from a field and value of ``{ns}:procs:<Q>``.

    Raises:
        ProtocolError: the record is not of the documented shape.
    """
    parts = rec.split(b"\0", 8)
    kind = parts[1] if len(parts) == 9 else b""
    grouped = kind[:1] == b"g" and kind[1:2].isdigit() and len(kind) > 2
    group = kind[2:].decode() if grouped else None
    if len(parts) != 9 or (kind not in _KINDS and group is None):
        raise ProtocolError(f"malformed process record for process {pid!r} of queue {queue}")
    p = int(pid)
    return Process(
        str(p),
        queue,
        parts[8],
        p,
        parts[0].decode(),
        kind == b"p",
        int(parts[2]),
        int(parts[7]) / 1000,
        group,
    )
