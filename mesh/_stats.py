"""A worker's statistics: the one place its counters live.

The runners, the heartbeat and the reaper of a worker write into one
:class:`Recorder` (plain attribute increments and a bisect per timing: no
I/O, no lock, no allocation on the hot path); :meth:`Worker.statistics`
turns it, together with the connection's and the pub/sub link's own
counters, into one frozen :class:`~mesh.WorkerStatistics`. Metrics
(:mod:`mesh.metrics`) read that snapshot at scrape time and nothing else.

Timings are kept as histograms with fixed bucket bounds (cumulative counts,
the Prometheus convention), so a snapshot says how often something took up
to each bound, not only an average.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import attrs

__all__ = [
    "FENCE_REASONS",
    "Histogram",
    "LATENCY_BOUNDS",
    "QueueStatistics",
    "Recorder",
    "RUN_BOUNDS",
    "fence_reason",
]

#: Bounds (seconds) for Redis round trips: heartbeats and claims.
LATENCY_BOUNDS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
#: Bounds (seconds) for handler runs.
RUN_BOUNDS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0,
)  # fmt: skip

#: Why a worker fenced itself: Redis said its lease was gone (expired or
#: recycled), Redis said a newer incarnation holds it, or no heartbeat was
#: confirmed within the fence deadline R.
FENCE_REASONS: tuple[str, ...] = ("lease_expired", "lease_superseded", "heartbeat_timeout")


def fence_reason(message: str | None) -> str:
    """The :data:`FENCE_REASONS` entry for a fence's message (None: timed out)."""
    if message is None:
        return "heartbeat_timeout"
    if "superseded" in message:
        return "lease_superseded"
    if "no lease" in message:
        return "lease_expired"
    return "heartbeat_timeout"


@attrs.frozen
class Histogram:
    """A distribution of durations, Prometheus style.

    Attributes:
        bounds: upper bounds of the buckets, in seconds, increasing.
        cumulative: per bound, how many observations were at most that
            bound (the last ``+Inf`` bucket is ``count``).
        count: how many observations.
        sum: their total, in seconds.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    count: int
    sum: float


class _Timing:
    """A mutable histogram (see :class:`Histogram`)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> Histogram:
        cumulative = []
        total = 0
        for c in self.counts[:-1]:
            total += c
            cumulative.append(total)
        return Histogram(self.bounds, tuple(cumulative), total + self.counts[-1], self.sum)


@attrs.frozen
class QueueStatistics:
    """One queue's counters on one worker (see :attr:`WorkerStatistics.queues`).

    Attributes:
        queue: the queue.
        running: handlers running now.
        started: processes whose handler was started.
        finished: processes reported finished (Redis took the report).
        failed: handlers that raised, handed back as failed (Redis took it).
        cancelled: handlers stopped by a cancel of their task (or a fence).
        claims: claim round trips made.
        claim_seconds: round-trip time of those claims.
        handler_seconds: how long handlers ran, whatever their outcome.
        moved: processes handed back for balance, to move to a peer below
            its fair share (their handlers were stopped for that, not
            cancelled: not counted in ``cancelled``).
    """

    queue: str
    running: int
    started: int
    finished: int
    failed: int
    cancelled: int
    claims: int
    claim_seconds: Histogram
    handler_seconds: Histogram
    moved: int = 0


class QueueCounters:
    """What a :class:`QueueRunner` records for its queue (kept across the
    worker's identities)."""

    __slots__ = (
        "cancelled",
        "claim",
        "failed",
        "finished",
        "handed_back",
        "handler",
        "moved_out",
        "pulled",
        "started",
    )

    def __init__(self) -> None:
        self.handed_back = 0  # handed back unharmed after a stop (invariant 10)
        self.moved_out = 0  # handed back for balance, to a peer below its share
        self.pulled = 0  # processes of peers marked to move here (rebalancing)
        self.started = 0
        self.finished = 0
        self.failed = 0
        self.cancelled = 0
        self.claim = _Timing(LATENCY_BOUNDS)
        self.handler = _Timing(RUN_BOUNDS)

    def snapshot(self, queue: str, running: int) -> QueueStatistics:
        return QueueStatistics(
            queue,
            running,
            self.started,
            self.finished,
            self.failed,
            self.cancelled,
            sum(self.claim.counts),
            self.claim.snapshot(),
            self.handler.snapshot(),
            self.moved_out,
        )


class Recorder:
    """The mutable counters of one worker: per queue, heartbeats, fences.
    Recycling counters are the reaper's (it records into this too)."""

    def __init__(self) -> None:
        self.queues: dict[str, QueueCounters] = {}
        self.heartbeats = 0
        self.heartbeat = _Timing(LATENCY_BOUNDS)
        self.fences: dict[str, int] = dict.fromkeys(FENCE_REASONS, 0)
        self.reap_checks = 0
        self.recycle_calls = 0
        self.workers_recycled = 0
        self.processes_recycled = 0
        self.dead_lettered = 0
        self.handed_back = 0  # processes handed back when an identity retired

    def queue(self, name: str) -> QueueCounters:
        """The counters of queue ``name``, created on first use."""
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = QueueCounters()
        return q

    def fenced(self, message: str | None) -> str:
        """Count a fence; returns its reason (one of :data:`FENCE_REASONS`)."""
        reason = fence_reason(message)
        self.fences[reason] += 1
        return reason

    def fences_snapshot(self) -> Mapping[str, int]:
        return dict(self.fences)
