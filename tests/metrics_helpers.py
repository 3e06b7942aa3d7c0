"""Helpers for tests of Prometheus metrics: serve a collector, scrape it,
read a sample, wait for one."""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.to_thread
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from mesh.metrics import serve_metrics
from mesh.testing import wait_until

__all__ = ["Samples", "scrape", "served", "until_scraped", "value"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(url: str) -> Samples:
    """GET the metrics page and parse it with prometheus-client's parser."""

    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            return str(r.read().decode())

    body = await anyio.to_thread.run_sync(get)
    out: Samples = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def until_scraped(
    url: str, pred: Callable[[Samples], bool], within: float = 10.0, what: str = ""
) -> Samples:
    async def scraped() -> Samples | None:
        s = await scrape(url)
        try:
            return s if pred(s) else None
        except KeyError:
            return None  # not there yet (e.g. a queue not served yet)

    return await wait_until(scraped, within, what, every=0.02)


@asynccontextmanager
async def served(collector: object) -> AsyncIterator[str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    async with serve_metrics(registry, port=0) as (host, port):
        assert host == "127.0.0.1"  # the default binds this machine only
        yield f"http://{host}:{port}/metrics"
