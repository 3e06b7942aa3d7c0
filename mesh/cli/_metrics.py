"""``mesh exporter``: serve the mesh-wide Prometheus metrics; and the
``--metrics-port`` of ``mesh worker``. Both need the ``metrics`` extra."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

import anyio
import trio

import mesh
from mesh._epoch import observing

from ._common import CliError, Target, add_target_options, count_arg, target

__all__ = [
    "add_worker_options",
    "check_worker_options",
    "port_arg",
    "register",
    "serve_worker_metrics",
]

log = logging.getLogger("mesh.cli")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``exporter`` to the ``mesh`` parser."""
    p = sub.add_parser(
        "exporter",
        help="serve mesh-wide Prometheus metrics read from Redis",
        description="Serve the mesh-wide metrics (queue lengths, delayed, dead letters, "
        "running, persistent tasks owned and unowned, live workers) at "
        "http://HOST:PORT/metrics, read from Redis at each scrape: no worker needs to run. "
        "Needs the metrics extra (pip install 'trio-mesh[metrics]'). While Redis cannot "
        "be reached (at start too) it keeps serving, mesh_redis_up 0 within a second, and "
        "logs the outage once and the recovery once. SIGINT or SIGTERM stops it (exit 0).",
    )
    add_target_options(p)
    p.add_argument("--port", type=port_arg, default=9808, help="port (default 9808; 0: any free)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only)",
    )
    p.add_argument(
        "--top-groups",
        type=count_arg("top_groups", 0, 1000),
        default=10,
        metavar="N",
        help="per queue with groups, series for the N groups with the most jobs queued "
        "(default 10; 0: only the totals): the number of series stays bounded however "
        "many groups there are",
    )
    p.set_defaults(func=_exporter)


def add_worker_options(p: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host`` for ``mesh worker``."""
    p.add_argument(
        "--metrics-port",
        type=port_arg,
        metavar="PORT",
        help="serve this worker's Prometheus metrics on PORT (0: any free); "
        "needs the metrics extra",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address for --metrics-port (default 127.0.0.1)",
    )


def port_arg(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, not {n}")
    return n


def _metrics_module() -> ModuleType:
    try:
        import mesh.metrics
    except ImportError:
        raise CliError("metrics need prometheus-client: pip install 'trio-mesh[metrics]'") from None
    return mesh.metrics


def check_worker_options(args: argparse.Namespace) -> None:
    """Raises CliError before anything starts if metrics were asked for and
    the extra is missing."""
    if args.metrics_port is not None:
        _metrics_module()


@asynccontextmanager
async def serve_worker_metrics(
    worker: mesh.Worker, args: argparse.Namespace
) -> AsyncIterator[None]:
    """Serve ``worker``'s metrics inside this block if ``--metrics-port``
    was given; otherwise do nothing."""
    if args.metrics_port is None:
        yield
        return
    m = _metrics_module()
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(m.WorkerCollector(worker))
    async with m.serve_metrics(registry, port=args.metrics_port, host=args.metrics_host) as addr:
        log.info("worker metrics at http://%s:%d/metrics", *addr)
        yield


def _exporter(args: argparse.Namespace) -> int:
    t = target(args)
    m = _metrics_module()
    logging.basicConfig(
        level="INFO",
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    with observing():  # look without writing the epoch: a missing one stays said
        return trio.run(_run_exporter, args, t, m)


async def _run_exporter(args: argparse.Namespace, t: Target, m: ModuleType) -> int:
    from prometheus_client import CollectorRegistry

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        collector = m.MeshCollector(None, top_groups=args.top_groups)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        async with (
            m.serve_metrics(registry, port=args.port, host=args.host) as addr,
            anyio.create_task_group() as nursery,
        ):
            log.info(
                "mesh-wide metrics of %s namespace %s at http://%s:%d/metrics",
                t.shown,
                t.namespace,
                *addr,
            )
            nursery.start_soon(_stay_connected, collector, t)
            async for signum in signals:
                log.info("%s received: stopping", signal.Signals(signum).name)
                break
            nursery.cancel_scope.cancel()
    return 0


async def _stay_connected(collector: Any, t: Target) -> None:
    """Keep ``collector.client`` a client of ``t``: while Redis cannot be
    reached (at start too) the exporter serves ``mesh_redis_up 0`` and
    tries again every :data:`_RECONNECT` seconds; the collector logs the
    outage once. Runs until cancelled."""
    while True:
        try:
            async with mesh.open_client(t.config, namespace=t.namespace) as client:
                collector.client = client
                try:
                    await anyio.sleep_forever()
                finally:
                    collector.client = None
        except mesh.MeshConnectionError as exc:
            collector.note_down(str(exc))
        await anyio.sleep(_RECONNECT)


#: Seconds between attempts to connect while Redis cannot be reached.
_RECONNECT = 1.0
