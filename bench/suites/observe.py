"""Looking at the mesh: the Redis CPU of ``mesh exporter`` scrapes and of the
``mesh dashboard`` poller, against 1,000 workers holding 10,000 persistent
tasks.

The mesh's state is written straight through the protocol scripts (register,
serve, ensure, claim) with hour-long leases, and no worker process runs: Redis
spends its CPU on the reader alone, and what is measured is the reader's own
cost, which depends on the state it reads, not on the workers being busy.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass

import trio

import mesh
from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import redis_cpu

QUEUE = "devices"


@dataclass(frozen=True)
class Sizes:
    workers: int = 1000
    per_worker: int = 10  # persistent tasks each holds
    window: float = 20.0  # seconds of INFO cpu per figure
    scrape: float = 1.0  # seconds between exporter scrapes
    interval: float = 1.0  # the dashboard's default


FULL = Sizes()
QUICK = Sizes(workers=100, window=3.0)

METHOD = """\
A mesh of {workers:,} registered workers serving one queue and holding {tasks:,} persistent
tasks ({per} each), plus 10 one-shot queues of 5 tasks, written through the protocol scripts
with hour-long leases; no worker process runs, so Redis spends its CPU on the reader alone.
Redis CPU is `INFO cpu` (user + sys) over {window:g} s, minus the same window with nothing
reading. The exporter is scraped over HTTP every {scrape:g} s (Prometheus scrapes every 15 s
by default: a fifteenth of this); the dashboard's poller reads every {interval:g} s (its
default), however many pages are open. Each read is two round trips whatever the number of
workers; both costs grow with the number of tasks held (the exporter reads the persistent-task
hash to tell owned from unowned tasks, the dashboard every process record)."""


async def populate(conn: Connection, ns: str, sizes: Sizes) -> None:
    keys = Keys(ns)
    b = Binding(keys)
    ttl_ms = 3_600_000
    tasks = [f"device-{i}".encode() for i in range(sizes.workers * sizes.per_worker)]
    await b.ensure(conn, QUEUE, tasks)
    for i in range(sizes.workers):
        w = f"w{i:04d}"
        inc = "inc-" + w
        info = json.dumps({"host": "bench", "pid": i, "started": 1})
        await b.register(conn, w, inc, ttl_ms, info.encode())
        await conn.execute("HSET", keys.info, w, info)
        await b.serve(conn, w, inc, QUEUE)
        await b.claim(conn, w, inc, QUEUE, sizes.per_worker, 0, ttl_ms=ttl_ms)
    for q in range(10):
        await b.enqueue(conn, f"jobs-{q}", [b"x"] * 5)


async def cpu_over(conn: Connection, window: float) -> float:
    """% of one core Redis used over ``window`` seconds."""
    c0, t0 = await redis_cpu(conn), trio.current_time()
    await trio.sleep(window)
    c1, t1 = await redis_cpu(conn), trio.current_time()
    return (c1 - c0) / (t1 - t0) * 100


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as r:
        return len(r.read())


async def exporter_cpu(client: mesh.Client, conn: Connection, sizes: Sizes) -> float:
    from prometheus_client import CollectorRegistry

    from mesh.metrics import MeshCollector, serve_metrics

    registry = CollectorRegistry(auto_describe=False)
    registry.register(MeshCollector(client))
    async with serve_metrics(registry, port=0) as (host, port):
        url = f"http://{host}:{port}/metrics"

        async def scraper() -> None:
            while True:
                await trio.to_thread.run_sync(_get, url)
                await trio.sleep(sizes.scrape)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(scraper)
            cpu = await cpu_over(conn, sizes.window)
            nursery.cancel_scope.cancel()
    return cpu


async def dashboard_cpu(client: mesh.Client, conn: Connection, sizes: Sizes) -> float:
    from mesh.dashboard import serve_dashboard

    async with serve_dashboard(client, interval=sizes.interval) as page:
        await trio.to_thread.run_sync(_get, page + "state")
        return await cpu_over(conn, sizes.window)


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    section = Section(
        "observe",
        "Dashboard and exporter",
        METHOD.format(
            workers=sizes.workers,
            tasks=sizes.workers * sizes.per_worker,
            per=sizes.per_worker,
            window=sizes.window,
            scrape=sizes.scrape,
            interval=sizes.interval,
        ),
        runs=ctx.runs,
    )
    idle: list[float] = []
    exporter: list[float] = []
    dashboard: list[float] = []
    ns = "observe"
    with run_redis_server() as server:
        async with (
            open_connection(server.url) as conn,
            mesh.open_client(server.url, namespace=ns) as client,
        ):
            ctx.log(
                f"observe: {sizes.workers:,} workers, {sizes.workers * sizes.per_worker:,} tasks"
            )
            await populate(conn, ns, sizes)
            for r in range(ctx.runs):
                idle.append(await cpu_over(conn, sizes.window))
                exporter.append(await exporter_cpu(client, conn, sizes) - idle[-1])
                dashboard.append(await dashboard_cpu(client, conn, sizes) - idle[-1])
                ctx.log(
                    f"observe: run {r + 1}/{ctx.runs}: idle {idle[-1]:.3f}%, exporter "
                    f"+{exporter[-1]:.3f}%, dashboard +{dashboard[-1]:.3f}% of a core"
                )
    target = Target("<", 1.0, "< 1% of a core")
    n = f"{sizes.workers:,} workers"
    section.figures += [
        Figure(f"Redis CPU, nothing reading, {n}", "% of a core", idle),
        Figure(
            f"mesh exporter scraped every {sizes.scrape:g} s: Redis CPU, {n}",
            "% of a core",
            exporter,
            target,
        ),
        Figure(
            f"mesh dashboard reading every {sizes.interval:g} s: Redis CPU, {n}",
            "% of a core",
            dashboard,
            target,
        ),
    ]
    return section
