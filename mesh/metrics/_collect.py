"""The collectors: a worker's statistics and the mesh-wide counts as
Prometheus metric families, built at scrape time.

prometheus-client calls ``collect()`` in its HTTP server's thread; the
collectors hop into the trio thread (``trio.from_thread``) to read, so the
worker's state is only ever touched by trio, and a Redis read uses the
client's trio-native connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
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
from .._stats import FENCE_REASONS, Histogram
from .._view import MeshCounts, counts
from .._worker import Worker, WorkerStatistics

__all__ = ["MeshCollector", "WorkerCollector"]


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
        self._token = trio.lowlevel.current_trio_token()

    def collect(self) -> Iterator[Metric]:
        try:
            s = trio.from_thread.run_sync(self._worker.statistics, trio_token=self._token)
        except trio.RunFinishedError:
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


class MeshCollector(Collector):
    """The mesh-wide metrics (``mesh_*``), read from Redis at each scrape
    through ``client`` (see :func:`mesh._view.counts`: two round trips).

    Create it inside the client's trio run; register it with a
    ``prometheus_client.CollectorRegistry``. When Redis cannot be reached,
    a scrape yields only ``mesh_redis_up 0``.

    ``mesh_persistent_unowned_seconds``: how long the longest-unowned
    persistent task of each queue has had no owner, by the Redis clock,
    from the time the scripts record when a task is ensured, handed back or
    recycled (``{ns}:unowned:<Q>``).
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._token = trio.lowlevel.current_trio_token()

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("mesh_redis_up", "1 if the last read of Redis succeeded.")
        try:
            c = trio.from_thread.run(counts, self._client, trio_token=self._token)
        except (MeshError, trio.RunFinishedError):
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from self._metrics(c)

    def _metrics(self, c: MeshCounts) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "mesh_workers", "Registered workers (live, or dead and not yet recycled).", c.workers
        )
        yield GaugeMetricFamily(
            "mesh_workers_alive", "Workers whose lease has not run out.", c.workers_alive
        )
        families = {
            name: GaugeMetricFamily(f"mesh_queue_{name}", text, labels=["queue"])
            for name, text in [
                ("length", "Tasks waiting to be claimed."),
                ("delayed", "Failed tasks waiting for their retry time."),
                ("dead_letters", "Dead-lettered one-shot tasks."),
                ("running", "Processes (claimed tasks) on any worker."),
            ]
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
            families["length"].add_metric([i.name], i.queued)
            families["delayed"].add_metric([i.name], i.delayed)
            families["dead_letters"].add_metric([i.name], i.dead)
            families["running"].add_metric([i.name], i.running)
            persistent.add_metric([i.name, "owned"], q.persistent_owned)
            persistent.add_metric([i.name, "unowned"], len(q.unowned))
            unowned.add_metric([i.name], q.longest_unowned(c.now))
        yield from families.values()
        yield persistent
        yield unowned
        yield paused
