"""The cost of a queue that keeps enqueue times (issue 32, item 7), against
one that does not, in the same run: ``python -m bench.enqueue_times``.

One redis-server of its own and one worker process (this one: a trio worker,
concurrency 100, a no-op handler). Each round runs an untimed and a timed
queue one after the other (the order alternates): N one-shot jobs enqueued
in calls of 100, then the time until the worker has finished them all, and
the Redis time the scripts took (``INFO commandstats``, evalsha) per job.
Then the memory: 100,000 small jobs queued on each queue (payloads of 20
bytes), ``used_memory`` before and after and ``MEMORY USAGE`` of the times'
sorted set.
"""

from __future__ import annotations

import argparse
import statistics

import anyio
import trio

import mesh
from mesh._connection import Connection
from mesh.testing import run_redis_server

from ._util import command_stats, info


class Counter:
    """The jobs the handler finished; ``all_done`` is set at ``n``."""

    def __init__(self) -> None:
        self.n, self.done, self.all_done = 0, 0, trio.Event()

    def reset(self, n: int) -> None:
        self.n, self.done, self.all_done = n, 0, trio.Event()

    def tick(self) -> None:
        self.done += 1
        if self.done >= self.n:
            self.all_done.set()


async def _round(
    client: mesh.Client, conn: Connection, queue: str, n: int, counter: Counter
) -> tuple[float, float]:
    """(jobs/s, Redis µs of scripts per job) of ``n`` jobs on ``queue``."""
    _, us0 = await command_stats(conn, "evalsha")
    start = trio.current_time()
    counter.reset(n)
    for i in range(0, n, 100):
        await client.enqueue_many(queue, [b"job-%08d" % j for j in range(i, min(i + 100, n))])
    await counter.all_done.wait()
    took = trio.current_time() - start
    _, us1 = await command_stats(conn, "evalsha")
    return n / took, (us1 - us0) / n


async def main(n: int, rounds: int) -> None:
    with run_redis_server() as server:
        url = server.url
        async with mesh.open_client(url, namespace="bench") as client:
            await client.configure("timed", enqueue_times=True)
            await client.configure("untimed", enqueue_times=False)
            conn = client._conn
            done = Counter()

            async def handler(p: mesh.Process) -> None:
                done.tick()

            got: dict[str, list[tuple[float, float]]] = {"untimed": [], "timed": []}
            async with mesh.open_worker(url, namespace="bench") as w:
                for q in ("untimed", "timed"):
                    await w.start_work(q, handler, concurrency=100)
                await _round(client, conn, "untimed", n // 10, done)  # warm up
                await _round(client, conn, "timed", n // 10, done)
                for r in range(rounds):
                    order = ("untimed", "timed") if r % 2 == 0 else ("timed", "untimed")
                    for q in order:
                        got[q].append(await _round(client, conn, q, n, done))
                for q in ("untimed", "timed"):
                    await w.stop_work(q)
            print(f"{n} no-op one-shot jobs per round, {rounds} rounds, median (each round):")
            for q in ("untimed", "timed"):
                rate = statistics.median(x[0] for x in got[q])
                us = statistics.median(x[1] for x in got[q])
                each = ", ".join(f"{x[0]:,.0f}" for x in got[q])
                print(f"  {q:8} {rate:9,.0f} jobs/s ({each}); Redis {us:.2f} us of scripts per job")
            ratio = statistics.median(x[0] for x in got["timed"]) / statistics.median(
                x[0] for x in got["untimed"]
            )
            print(f"  timed / untimed: {ratio:.3f}x jobs/s")
            # memory: 100,000 small jobs queued on each queue
            m = 100_000
            for q in ("untimed", "timed"):
                before = int((await info(conn, "memory"))["used_memory"])
                for i in range(0, m, 1000):
                    await client.enqueue_many(q, [b"payload-%012d" % j for j in range(i, i + 1000)])
                after = int((await info(conn, "memory"))["used_memory"])
                usage = await conn.execute("MEMORY", "USAGE", client._keys.enqt(q), "SAMPLES", 0)
                grew = (after - before) / m
                print(
                    f"  {q:8} {m:,} queued jobs of 20 bytes: used_memory +{grew:.1f} B/job"
                    + (f"; MEMORY USAGE of enqt: {int(usage) / m:.1f} B/job" if usage else "")
                )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    anyio.run(main, a.jobs, a.rounds, backend="trio")
