"""Producer and worker processes of the peers (SAQ, arq, streaQ) for the
throughput benchmark.

Standalone on purpose: it runs under the peers' interpreter (their own
virtual environment, see ``bench/peers.txt``), which has no trio-mesh.

    python _peer_child.py LIB produce --url URL --n N
        enqueues N no-op tasks the library's fastest documented way, prints
        ``enqueued <seconds>`` (connection set-up not included)
    python _peer_child.py LIB work --url URL --concurrency C
        builds the worker, prints ``ready``, waits for ``go`` on stdin, runs
        the worker until killed
    python _peer_child.py LIB version
        prints ``version <library version> <redis client and version>``

LIB is ``saq``, ``arq`` or ``streaq``; ``--poll-delay`` sets arq's
``poll_delay``; ``--backend trio`` runs streaQ on trio (default asyncio).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from importlib.metadata import version
from typing import Any, Literal

QUEUE = "bench"
ENQUEUE_CONCURRENCY = 20  # as in SAQ's own benchmark (benchmarks/simple.py)


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def wait_for_go() -> bool:
    line: str = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return line.strip() == "go"


async def gather_bounded(make: Any, n: int) -> None:
    sem = asyncio.Semaphore(ENQUEUE_CONCURRENCY)

    async def one() -> None:
        async with sem:
            await make()

    await asyncio.gather(*(one() for _ in range(n)))


# --- SAQ ----------------------------------------------------------------------


async def saq_noop(ctx: Any) -> None:
    pass


async def saq_produce(url: str, n: int) -> float:
    from saq import Queue

    queue = Queue.from_url(url, name=QUEUE)
    await queue.connect()
    t = time.perf_counter()
    await gather_bounded(lambda: queue.enqueue("saq_noop"), n)
    elapsed = time.perf_counter() - t
    await queue.disconnect()
    return elapsed


async def saq_work(url: str, concurrency: int, args: argparse.Namespace) -> None:
    from saq import Queue, Worker

    queue = Queue.from_url(url, name=QUEUE)
    await queue.connect()
    worker = Worker(queue, functions=[saq_noop], concurrency=concurrency)
    out("ready")
    if await wait_for_go():
        await worker.start()


# --- arq ----------------------------------------------------------------------


async def arq_noop(ctx: Any) -> None:
    pass


def arq_settings(url: str) -> Any:
    from arq.connections import RedisSettings

    return RedisSettings.from_dsn(url)


async def arq_produce(url: str, n: int) -> float:
    from arq import create_pool

    redis = await create_pool(arq_settings(url))
    t = time.perf_counter()
    await gather_bounded(lambda: redis.enqueue_job("arq_noop"), n)
    elapsed = time.perf_counter() - t
    await redis.aclose()
    return elapsed


async def arq_work(url: str, concurrency: int, args: argparse.Namespace) -> None:
    from arq.worker import Worker

    kw = {} if args.poll_delay is None else {"poll_delay": args.poll_delay}
    worker = Worker(
        functions=[arq_noop],
        redis_settings=arq_settings(url),
        max_jobs=concurrency,
        handle_signals=False,
        **kw,
    )
    out("ready")
    if await wait_for_go():
        await worker.main()


# --- streaQ ---------------------------------------------------------------------


def streaq_worker(url: str, concurrency: int, backend: Literal["asyncio", "trio"]) -> Any:
    from streaq import Worker

    worker = Worker(
        redis_url=url,
        concurrency=concurrency,
        queue_name=QUEUE,
        handle_signals=False,
        anyio_backend=backend,
    )

    async def noop() -> None:
        pass

    worker.noop = worker.task(silent=True)(noop)  # registered as "noop"
    return worker


async def streaq_produce(url: str, n: int) -> float:
    worker = streaq_worker(url, 10, "asyncio")
    async with worker:
        tasks = [worker.noop.enqueue() for _ in range(n)]
        t = time.perf_counter()
        await worker.enqueue_many(tasks)
        return time.perf_counter() - t


def streaq_work(url: str, concurrency: int, args: argparse.Namespace) -> None:
    import anyio

    worker = streaq_worker(url, concurrency, args.backend)

    async def main() -> None:
        out("ready")
        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        if line.strip() == "go":
            await worker.run_async()

    anyio.run(main, backend=args.backend)


# --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lib", choices=["saq", "arq", "streaq"])
    parser.add_argument("role", choices=["produce", "work", "version"])
    parser.add_argument("--url", default="")
    parser.add_argument("--n", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--poll-delay", type=float, default=None)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in ("saq", "arq", "streaq"):
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.role == "version":
        client = "coredis" if args.lib == "streaq" else "redis"
        out(f"version {version(args.lib)} {client}-{version(client)}")
        return
    if args.role == "produce":
        produce = {"saq": saq_produce, "arq": arq_produce, "streaq": streaq_produce}[args.lib]
        elapsed = asyncio.run(produce(args.url, args.n))
        out(f"enqueued {elapsed:.6f}")
        return
    if args.lib == "streaq":
        streaq_work(args.url, args.concurrency, args)
        return
    work = {"saq": saq_work, "arq": arq_work}[args.lib]
    try:
        asyncio.run(work(args.url, args.concurrency, args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
