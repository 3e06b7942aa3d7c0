"""The Redis cost of looking: ``mesh exporter`` scrapes and the
``mesh dashboard`` poller against a mesh of 1,000 workers holding 10,000
persistent tasks (plus 10 one-shot queues with a few tasks each).

The mesh's state is written straight through the protocol scripts (register,
serve, ensure, claim), with leases long enough not to expire during the run,
so that no worker process runs and Redis spends its CPU on the exporter or
the dashboard alone: what is measured is their own cost, which depends on
the state they read, not on the workers being busy. Redis CPU is ``INFO cpu``
(user + sys) over a window, minus the same window with nothing polling.

Run: ``python -m bench.observe [--workers 1000] [--window 20]``.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request

import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh._scripts import Binding
from mesh.testing import run_redis_server

from ._util import redis_cpu

QUEUE = "devices"


async def populate(conn: Connection, ns: str, workers: int, per_worker: int) -> None:
    b = Binding(Keys(ns))
    ttl_ms = 3_600_000
    await b.ensure(conn, QUEUE, [f"device-{i}".encode() for i in range(workers * per_worker)])
    for i in range(workers):
        w = f"w{i:04d}"
        inc = "inc-" + w
        await b.register(
            conn, w, inc, ttl_ms, json.dumps({"host": "h", "pid": i, "started": 1}).encode()
        )
        await conn.execute(
            "HSET", Keys(ns).info, w, json.dumps({"host": "h", "pid": i, "started": 1})
        )
        await b.serve(conn, w, inc, QUEUE)
        await b.claim(conn, w, inc, QUEUE, per_worker, 0, ttl_ms=ttl_ms)
    for q in range(10):
        await b.enqueue(conn, f"jobs-{q}", [b"x"] * 5)


async def cpu_over(conn: Connection, window: float) -> float:
    """% of one core Redis used over ``window`` seconds."""
    c0, t0 = await redis_cpu(conn), trio.current_time()
    await trio.sleep(window)
    c1, t1 = await redis_cpu(conn), trio.current_time()
    return (c1 - c0) / (t1 - t0) * 100


async def main(workers: int, per_worker: int, window: float, scrape: float) -> None:
    from prometheus_client import CollectorRegistry

    from mesh.dashboard import serve_dashboard
    from mesh.metrics import MeshCollector, serve_metrics

    ns = "observe"
    with run_redis_server() as server:
        async with open_connection(server.url) as conn:
            t = time.monotonic()
            await populate(conn, ns, workers, per_worker)
            print(
                f"populated {workers} workers, {workers * per_worker} persistent tasks "
                f"in {time.monotonic() - t:.1f} s"
            )
            base = await cpu_over(conn, window)
            print(f"nothing polling: Redis {base:.3f}% of a core")
            async with mesh.open_client(server.url, namespace=ns) as client:
                registry = CollectorRegistry(auto_describe=False)
                registry.register(MeshCollector(client))
                async with serve_metrics(registry, port=0) as (host, port):
                    url = f"http://{host}:{port}/metrics"

                    def get() -> int:
                        with urllib.request.urlopen(url, timeout=30) as r:
                            return len(r.read())

                    async def scraper() -> None:
                        while True:
                            t0 = time.monotonic()
                            await trio.to_thread.run_sync(get)
                            took.append(time.monotonic() - t0)
                            await trio.sleep(scrape)

                    took: list[float] = []
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(scraper)
                        cpu = await cpu_over(conn, window)
                        nursery.cancel_scope.cancel()
                    print(
                        f"mesh exporter scraped every {scrape:g} s: Redis {cpu:.3f}% "
                        f"(minus idle: {cpu - base:.3f}%), {len(took)} scrapes, "
                        f"median {sorted(took)[len(took) // 2] * 1000:.0f} ms each"
                    )
                async with serve_dashboard(client, interval=1.0) as page:

                    def get_state() -> int:
                        with urllib.request.urlopen(page + "state", timeout=30) as r:
                            return len(r.read())

                    size = await trio.to_thread.run_sync(get_state)
                    cpu = await cpu_over(conn, window)
                    print(
                        f"mesh dashboard polling every 1 s: Redis {cpu:.3f}% "
                        f"(minus idle: {cpu - base:.3f}%); state {size} bytes"
                    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--per-worker", type=int, default=10)
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--scrape", type=float, default=1.0)
    a = p.parse_args()
    trio.run(main, a.workers, a.per_worker, a.window, a.scrape)
