"""The collectors: a worker's statistics and the mesh-wide counts as
Prometheus metric families, built at scrape time.

prometheus-client calls ``collect()`` in its HTTP server's thread; the
collectors hop into the event loop's thread (``anyio.from_thread``) to read, so the
worker's state is only ever touched by its loop, and a Redis read uses the
client's trio-native connection.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import anyio.from_thread
import anyio.lowlevel
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .._client import Client
from .._errors import MeshError
from .._memory import MemoryInfo
from .._reads import QUEUE_COUNTS
from .._stats import FENCE_REASONS, Histogram
from .._view import MeshCounts, counts
from .._worker import Worker, WorkerStatistics

__all__ = ["MeshCollector", "WorkerCollector"]

log = logging.getLogger("mesh.metrics")


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = [
        (repr(float(b)), float(c)) for b, c in zip(h.bounds, h.cumulative, strict=True)
    ]
    out.append(("+Inf", float(h.count)))
    return out


class WorkerCollector(Collector):
    """One worker's metrics (``mesh_worker_*``), read from
    :meth:`mesh.Worker.statistics` at each scrape.

    Create it inside the worker's trio run (it remembers the trio token);
    register it with a ``prometheus_client.CollectorRegistry``. A scrape
    after the trio run ended yields no metrics.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._token = anyio.lowlevel.current_token()

    def collect(self) -> Iterator[Metric]:
        try:
            s = anyio.from_thread.run_sync(self._worker.statistics, token=self._token)
        except anyio.RunFinishedError:
            return
        yield from worker_metrics(s)


def worker_metrics(s: WorkerStatistics) -> Iterator[Metric]:
    """The ``mesh_worker_*`` metric families of one statistics snapshot."""
    info = InfoMetricFamily("mesh_worker", "The worker's current id and generation.")
    info.add_metric([], {"worker_id": s.worker_id, "generation": str(s.generation)})
    yield info
    running = GaugeMetricFamily(
        "mesh_worker_processes_running", "Handlers running now.", labels=["queue"]
    )
    per_queue = {
        name: CounterMetricFamily(f"mesh_worker_processes_{name}", text, labels=["queue"])
        for name, text in [
            ("started", "Processes whose handler was started."),
            ("finished", "Processes reported finished."),
            ("failed", "Handlers that raised (the task was handed back as failed)."),
            ("cancelled", "Handlers stopped by a cancel of their task or a fence."),
            (
                "moved",
                "Processes handed back for balance, to move to a peer below its fair share.",
            ),
        ]
    }
    claim = HistogramMetricFamily(
        "mesh_worker_claim_seconds", "Round-trip time of claims.", labels=["queue"]
    )
    handler = HistogramMetricFamily(
        "mesh_worker_handler_seconds", "How long handlers ran, any outcome.", labels=["queue"]
    )
    for q in s.queues.values():
        running.add_metric([q.queue], q.running)
        per_queue["started"].add_metric([q.queue], q.started)
        per_queue["finished"].add_metric([q.queue], q.finished)
        per_queue["failed"].add_metric([q.queue], q.failed)
        per_queue["cancelled"].add_metric([q.queue], q.cancelled)
        per_queue["moved"].add_metric([q.queue], q.moved)
        claim.add_metric([q.queue], _buckets(q.claim_seconds), q.claim_seconds.sum)
        handler.add_metric([q.queue], _buckets(q.handler_seconds), q.handler_seconds.sum)
    yield running
    yield from per_queue.values()
    yield claim
    yield handler
    if s.heartbeat_seconds is not None:
        hb = HistogramMetricFamily(
            "mesh_worker_heartbeat_seconds", "Round-trip time of confirmed heartbeats."
        )
        hb.add_metric([], _buckets(s.heartbeat_seconds), s.heartbeat_seconds.sum)
        yield hb
    fences = CounterMetricFamily(
        "mesh_worker_fences", "Times the worker fenced itself, by reason.", labels=["reason"]
    )
    for reason in FENCE_REASONS:
        fences.add_metric([reason], s.fences.get(reason, 0))
    yield fences
    yield CounterMetricFamily(
        "mesh_worker_recycled_workers",
        "Dead peers this worker recycled (takeovers).",
        value=s.peers_recycled,
    )
    yield CounterMetricFamily(
        "mesh_worker_recycled_processes",
        "Processes of dead peers this worker put back in their queues.",
        value=s.processes_recycled,
    )
    yield CounterMetricFamily(
        "mesh_worker_recycled_dead_lettered",
        "One-shot tasks of dead peers dead-lettered by this worker (last attempt crashed).",
        value=s.dead_lettered,
    )
    reconnects = CounterMetricFamily(
        "mesh_worker_redis_reconnects", "Reconnects to Redis, by link.", labels=["link"]
    )
    reconnects.add_metric(["commands"], s.reconnects)
    reconnects.add_metric(["events"], s.event_reconnects)
    yield reconnects
    if s.redis_memory is not None:
        yield from memory_metrics(s.redis_memory, "mesh_worker_redis")


def memory_metrics(m: MemoryInfo, prefix: str) -> Iterator[Metric]:
    """Redis's memory as last read (``INFO memory``): ``<prefix>_evicting``
    (1 when the ``maxmemory-policy``, its label, can evict leases and tasks;
    trio-mesh needs ``noeviction``), ``<prefix>_memory_used_bytes`` and
    ``<prefix>_maxmemory_bytes`` (0: no limit)."""
    evicting = GaugeMetricFamily(
        f"{prefix}_evicting",
        "1 if Redis's maxmemory-policy can evict leases and tasks (trio-mesh needs noeviction).",
        labels=["policy"],
    )
    evicting.add_metric([m.policy], 1 if m.evicting else 0)
    yield evicting
    yield GaugeMetricFamily(f"{prefix}_memory_used_bytes", "Redis used_memory.", m.used)
    yield GaugeMetricFamily(f"{prefix}_maxmemory_bytes", "Redis maxmemory (0: none).", m.maxmemory)


#: The most groups per queue :class:`MeshCollector` may list.
MAX_TOP_GROUPS = 1000


class MeshCollector(Collector):
    """The mesh-wide metrics (``mesh_*``), read from Redis at each scrape
    through ``client`` (see :func:`mesh._view.counts`: two round trips).

    Create it inside the client's trio run; register it with a
    ``prometheus_client.CollectorRegistry``. When Redis cannot be reached
    within ``timeout`` seconds (a read still waiting then is cancelled), or
    ``client`` is None (not connected yet: set :attr:`client` once it is), a
    scrape yields only ``mesh_redis_up 0``, at once; the outage is logged
    once (WARNING, logger ``mesh.metrics``), and so is the recovery (INFO).

    ``mesh_persistent_unowned_seconds``: how long the longest-unowned
    persistent task of each queue has had no owner, by the Redis clock,
    from the time the scripts record when a task is ensured, handed back or
    recycled (``{ns}:unowned:<Q>``).

    Groups (bounded: a queue may have a group per tenant): per queue
    ``mesh_queue_groups`` (the groups found) and, for a queue with groups,
    ``mesh_queue_group_jobs`` (its groups' jobs queued, running, delayed);
    per group, only the ``top_groups`` of each queue with the most jobs
    queued: ``mesh_group_queued``, ``mesh_group_running``,
    ``mesh_group_delayed`` and ``mesh_group_paused`` (label ``group``).

    Raises:
        ValueError: ``top_groups`` is not a whole number from 0 to 1000.
    """

    def __init__(
        self, client: Client | None, *, timeout: float = 0.5, top_groups: int = 10
    ) -> None:
        if isinstance(top_groups, bool) or not isinstance(top_groups, int):
            raise ValueError(f"top_groups must be a whole number, not {top_groups!r}")
        if not 0 <= top_groups <= MAX_TOP_GROUPS:
            raise ValueError(f"top_groups must be 0 to {MAX_TOP_GROUPS}, not {top_groups}")
        #: The client to read through; None: not connected (``mesh_redis_up 0``).
        self.client = client
        self._timeout = timeout
        self._top_groups = top_groups
        self._token = anyio.lowlevel.current_token()
        self._down: bool | None = None  # None: no read yet

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("mesh_redis_up", "1 if the last read of Redis succeeded.")
        try:
            c = anyio.from_thread.run(self._read, token=self._token)
        except anyio.RunFinishedError:
            c = None
        up.add_metric([], 0 if c is None else 1)
        yield up
        if c is not None:
            yield from self._metrics(c)
        elif self.client is not None and _refused(self.client):
            # unread because the node lacks the epoch: that is the news
            yield _epoch_gauge(True)

    async def _read(self) -> MeshCounts | None:
        """The counts, or None (Redis down, slow or not connected: logged at
        the first such read after one that succeeded)."""
        client = self.client
        if client is None:
            self.note_down("not connected")
            return None
        try:
            with anyio.move_on_after(self._timeout):
                c = await counts(client.reads, groups=self._top_groups)
                self.note_up()
                return c
            why = f"no answer within {self._timeout:g} s"
        except MeshError as exc:
            why = str(exc)
        self.note_down(why)
        return None

    def note_down(self, why: str) -> None:
        """Redis could not be read (``why``): logged if it could before."""
        if self._down is not True:
            log.warning("reading Redis failed: %s; mesh_redis_up is 0 until it is back", why)
        self._down = True

    def note_up(self) -> None:
        """Redis was read: logged if it could not be before."""
        if self._down:
            log.info("Redis is back: mesh_redis_up is 1")
        self._down = False

    def _metrics(self, c: MeshCounts) -> Iterator[Metric]:
        yield _epoch_gauge(c.epoch_missing)
        yield GaugeMetricFamily(
            "mesh_workers", "Registered workers (live, or dead and not yet recycled).", c.workers
        )
        yield GaugeMetricFamily(
            "mesh_workers_alive", "Workers whose lease has not run out.", c.workers_alive
        )
        # one gauge per count of a queue that has one (the table of counts)
        families = {
            c.name: GaugeMetricFamily(f"mesh_queue_{c.metric}", c.help, labels=["queue"])
            for c in QUEUE_COUNTS
            if c.metric is not None
        }
        persistent = GaugeMetricFamily(
            "mesh_persistent_tasks",
            "Persistent tasks, owned (a process runs it) or unowned.",
            labels=["queue", "state"],
        )
        unowned = GaugeMetricFamily(
            "mesh_persistent_unowned_seconds",
            "How long the longest-unowned persistent task of the queue has had no owner.",
            labels=["queue"],
        )
        paused = GaugeMetricFamily(
            "mesh_queue_paused",
            "1 while the queue is paused (no new one-shot task of it starts), else 0.",
            labels=["queue"],
        )
        for q in c.queues:
            i = q.info
            paused.add_metric([i.name], 1 if i.paused else 0)
            for state, family in families.items():
                family.add_metric([i.name], getattr(i, state))
            persistent.add_metric([i.name, "owned"], q.persistent_owned)
            persistent.add_metric([i.name, "unowned"], len(q.unowned))
            unowned.add_metric([i.name], q.longest_unowned(c.now))
        yield from families.values()
        yield persistent
        yield unowned
        vanished = GaugeMetricFamily(
            "mesh_persistent_vanished",
            "Persistent tasks gone from the queue's registry without a cancel (evicted or "
            "deleted); Client.reconcile restores them.",
            labels=["queue"],
        )
        for q in c.queues:
            vanished.add_metric([q.info.name], q.vanished)
        yield vanished
        if c.memory is not None:
            yield from memory_metrics(c.memory, "mesh_redis")
        yield paused
        yield from group_metrics(c)


def group_metrics(c: MeshCounts) -> Iterator[Metric]:
    """The groups' gauges (see :class:`MeshCollector`): a few series per
    queue and per listed group, however many groups there are."""
    found = GaugeMetricFamily(
        "mesh_queue_groups",
        "Groups of the queue holding jobs, paused or with settings of their own.",
        labels=["queue"],
    )
    jobs = GaugeMetricFamily(
        "mesh_queue_group_jobs",
        "Jobs of the queue's groups, queued, running or delayed (counted in the queue's too).",
        labels=["queue", "state"],
    )
    per_group = {
        name: GaugeMetricFamily(f"mesh_group_{name}", text, labels=["queue", "group"])
        for name, text in (
            ("queued", "Jobs queued in the group (the groups with the most queued only)."),
            ("running", "Jobs of the group running, against its concurrency cap."),
            ("delayed", "Jobs of the group waiting for a delay or a retry's backoff."),
            ("paused", "1 while the group is paused, else 0."),
        )
    }
    for q in c.queues:
        look = q.groups
        found.add_metric([q.info.name], look.total if look else 0)
        if look is None:
            continue
        for state, n in (("queued", look.queued), ("running", look.running)):
            jobs.add_metric([q.info.name, state], n)
        jobs.add_metric([q.info.name, "delayed"], look.delayed)
        for g in look.groups:
            labels = [q.info.name, g.name]
            per_group["queued"].add_metric(labels, g.queued)
            per_group["running"].add_metric(labels, g.running)
            per_group["delayed"].add_metric(labels, g.delayed)
            per_group["paused"].add_metric(labels, 0 if g.paused is None else 1)
    yield found
    yield jobs
    yield from per_group.values()


def _epoch_gauge(missing: bool) -> Metric:
    return GaugeMetricFamily(
        "mesh_namespace_epoch_missing",
        "1 if the namespace's epoch key is missing (a new namespace, or a master that "
        "restarted empty: workers refuse it until `mesh adopt-namespace`).",
        int(missing),
    )


def _refused(client: Client) -> bool:
    """The client's connection was refused a node that lacks the epoch."""
    epoch = client.reads.epoch
    return epoch is not None and epoch.refused
