"""Plain data the public API hands out. Frozen: they are snapshots."""

from __future__ import annotations

import attrs

__all__ = [
    "DeadLetter",
    "DelayedTask",
    "Process",
    "QueueShare",
    "ReconcileResult",
    "WorkerInfo",
]


@attrs.frozen
class Process:
    """One claim of a task by a worker.

    Attributes:
        id: the process id, unique in the namespace (the decimal form of
            ``token``).
        queue: the queue the task came from.
        task: the payload, byte for byte as it was enqueued.
        token: the fencing token: strictly increasing across the namespace
            (at least the Redis clock in microseconds, so also across a Redis
            restart that lost the data), so a later owner of the same task
            always holds a higher token than any earlier one. Hand it to
            downstream systems that should refuse a stale owner.
        worker_id: the worker that holds the process.
        persistent: True for a persistent task.
        attempts: how many earlier attempts of this payload failed (0 the
            first time).
        started: when it was claimed, in seconds of the Redis clock.
        group: the group of the queue the job came from (see
            :meth:`~mesh.Client.enqueue`'s ``group``), or None.
    """

    id: str
    queue: str
    task: bytes
    token: int
    worker_id: str
    persistent: bool
    attempts: int = 0
    started: float = 0.0
    group: str | None = None


@attrs.frozen
class QueueShare:
    """A worker's load on one queue it serves, against its fair share (see
    :attr:`WorkerInfo.shares`).

    Attributes:
        queue: the queue.
        held: processes of the queue the worker holds.
        fair_min, fair_max: floor and ceil of :attr:`share`; with every
            weight 1, a balanced mesh holds one of the two everywhere.
        incoming: persistent tasks on their way to it (a rebalance asked
            their holder to hand them back for it, or they wait reserved
            for it).
        outgoing: its processes a rebalance asked it to hand back.
        weight: the weight of the processes it holds (each persistent
            task's weight, 1 for others): what the fair share compares.
        share: its fair share of the queue, by weight: the total weight of
            the queue's persistent tasks * :attr:`capacity` / the total
            capacity of its servers. A balanced worker holds within one
            task's weight of it.
        capacity: its capacity on the queue.
    """

    queue: str
    held: int
    fair_min: int
    fair_max: int
    incoming: int = 0
    outgoing: int = 0
    weight: int = 0
    share: float = 0.0
    capacity: int = 1


@attrs.frozen
class WorkerInfo:
    """A worker as Redis sees it (see :meth:`Client.workers`).

    Attributes:
        id: the worker id.
        alive: its heartbeat key exists (its lease has not run out).
        queues: the queues it serves.
        processes: how many processes it holds, over all its queues.
        lease_left: seconds until its lease runs out if not renewed (negative:
            expired and not yet recycled).
        host, pid, started: where and since when it runs (``started`` in
            seconds of the Redis clock), as the worker described itself.
        shares: per queue it serves, what it holds against its fair share,
            and what is moving to or from it (rebalancing).
    """

    id: str
    alive: bool
    queues: tuple[str, ...]
    processes: int
    lease_left: float
    host: str = ""
    pid: int = 0
    started: float = 0.0
    shares: tuple[QueueShare, ...] = ()


@attrs.frozen
class ReconcileResult:
    """What :meth:`Client.reconcile` changed."""

    added: tuple[bytes, ...]
    cancelled: tuple[bytes, ...]


@attrs.frozen
class DelayedTask:
    """A task waiting in a queue's delayed set (see :meth:`Client.delayed`).

    Attributes:
        task: the payload.
        due: when it becomes ready, in seconds since the epoch on the Redis
            clock (it may be past: a claim moves it to the queue).
        priority: the priority it goes to when due (0 to 9).
    """

    task: bytes
    due: float
    priority: int = 0


@attrs.frozen
class DeadLetter:
    """A dead-lettered one-shot task (see :meth:`Client.dead_letters`).

    Attributes:
        task: the payload.
        attempts: failed attempts, the last one included.
        error: the last failure, on one line: the exception's type and
            message (at most 500 characters), or ``"worker crashed: ..."``
            when its worker died; empty if unknown (dead-lettered by
            protocol 3).
        worker: the id of the worker of the last attempt ("" if unknown).
        when: when it was dead-lettered, seconds since the epoch on the Redis
            clock (0.0 if unknown).
        traceback: the last failure's traceback, bounded (the record keeps
            2,000 bytes of error and traceback together: the innermost lines
            of a longer one); None when there is none (a crashed worker, a
            peer that records none, a record older than this version).
        priority: the priority it had (0..9); a requeue puts it back there.
        group: the group of the queue it was in, or None; a requeue puts it
            back into that group.
    """

    task: bytes
    attempts: int
    error: str
    worker: str
    when: float
    traceback: str | None = None
    priority: int = 0
    group: str | None = None
