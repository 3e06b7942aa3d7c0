"""Delayed tasks coming due at once: ``python -m bench --only delayed``, or
alone ``python -m bench.suites.delayed``.

N one-shot tasks are enqueued with ``at=`` one instant a few seconds ahead
(Redis clock), so they all come due together, while W worker processes
(concurrency 10 each, a no-op handler) wait idle. Measured from the due time
until every task ran: the wall time and the Redis CPU per task. Then the same
N tasks are enqueued without a delay on the same workers, for comparison
(the plain queue's throughput in the same run).

Part of ``python -m bench`` (section "Delayed tasks due at once", a fresh
redis-server per run); alone, e.g. ``python -m bench.suites.delayed --tasks 100000
--workers 2`` (``--plain-only`` runs on versions without delayed tasks).
"""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass

import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section
from .._util import children, mesh_child, poll_until, redis_cpu

QUEUE = "bench"


@dataclass(frozen=True)
class Sizes:
    tasks: int = 100_000
    workers: int = 2  # worker processes, concurrency 10 each

    @property
    def lead(self) -> float:
        """Seconds between enqueueing and the due time: room to enqueue."""
        return 2.0 + self.tasks / 20_000


FULL = Sizes()
QUICK = Sizes(tasks=5_000)

METHOD = """
{n:,} one-shot tasks are enqueued with `at=` one instant {lead:g} s ahead
(Redis clock), in calls of 10,000, while {w} worker processes (concurrency 10
each, a no-op handler) wait idle; measured from the due time until every
task ran: the wall time and the Redis CPU per task (`INFO cpu`). Then the
same {n:,} tasks are enqueued without a delay on the same workers: the plain
queue in the same run (its Redis CPU includes the enqueue, which the delayed
figure does not). A fresh redis-server per run.
"""


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    n = sizes.tasks
    section = Section(
        "delayed",
        "Delayed tasks due at once",
        METHOD.format(n=n, lead=sizes.lead, w=sizes.workers),
        runs=ctx.runs,
    )
    res = []
    for r in range(ctx.runs):
        ctx.log(f"delayed: run {r + 1}/{ctx.runs}: {n:,} tasks due at once")
        res.append(await measure(n, sizes.workers, sizes.lead, plain_only=False))
        ctx.log(
            f"  all ran {res[-1]['delayed_seconds']:.2f} s after the due time, "
            f"plain {res[-1]['plain_seconds']:.2f} s"
        )
    section.figures += [
        Figure(f"{n:,} due at once: all ran after", "s", [x["delayed_seconds"] for x in res]),
        Figure("due at once: rate", "tasks/s", [n / x["delayed_seconds"] for x in res]),
        Figure(
            "due at once: Redis CPU per task",
            "µs",
            [x["delayed_redis_us_per_task"] for x in res],
        ),
        Figure("plain queue, same tasks: rate", "tasks/s", [n / x["plain_seconds"] for x in res]),
        Figure(
            "plain queue: Redis CPU per task (enqueue included)",
            "µs",
            [x["plain_redis_us_per_task"] for x in res],
        ),
    ]
    return section


async def pending(conn: Connection, keys: Keys) -> int:
    r = await conn.pipeline(
        [
            ("ZCARD", keys.delayed(QUEUE)),
            ("LLEN", keys.queue(QUEUE)),
            ("HLEN", keys.procs(QUEUE)),
        ]
    )
    return sum(int(x) for x in r)


async def measure(n: int, workers: int, lead: float, plain_only: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    with run_redis_server() as server:
        ns = "dl" + secrets.token_hex(3)
        keys = Keys(ns)
        async with (
            open_connection(server.url) as conn,
            mesh.open_client(server.url, namespace=ns) as client,
            children() as kids,
        ):
            ws = []
            for i in range(workers):
                argv = mesh_child(
                    "throughput", "--url", server.url, "--ns", ns, "--queue", QUEUE,
                    "--concurrency", "10",
                )  # fmt: skip
                ws.append(await kids.spawn(f"worker {i}", argv))
            for w in ws:
                await w.expect("ready", 60)
            for w in ws:
                await w.send("go")
            for w in ws:
                await w.expect("started", 60)
            payloads = [b"%d" % i for i in range(n)]

            async def done() -> bool:
                return await pending(conn, keys) == 0

            # delayed: all due at one instant
            due = await client.time() + lead
            if plain_only:
                payloads_delayed: list[bytes] = []
            else:
                payloads_delayed = payloads
            for i in range(0, len(payloads_delayed), 10_000):
                await client.enqueue_many(QUEUE, payloads_delayed[i : i + 10_000], at=due)
            if payloads_delayed:
                if await client.time() >= due:
                    raise RuntimeError(f"enqueueing took longer than the lead of {lead} s")
                assert await pending(conn, keys) == n
                await trio.sleep(due - await client.time())
                cpu0 = await redis_cpu(conn)
                t0 = trio.current_time()
                t1 = await poll_until(done, interval=0.005, within=max(120.0, n / 100))
                cpu1 = await redis_cpu(conn)
                out["delayed_seconds"] = t1 - t0
                out["delayed_redis_us_per_task"] = (cpu1 - cpu0) / n * 1e6

            # plain: the same tasks, no delay
            cpu0 = await redis_cpu(conn)
            t0 = trio.current_time()
            for i in range(0, n, 10_000):
                await client.enqueue_many(QUEUE, payloads[i : i + 10_000])
            t1 = await poll_until(done, interval=0.005, within=max(120.0, n / 100))
            cpu1 = await redis_cpu(conn)
            out["plain_seconds"] = t1 - t0
            out["plain_redis_us_per_task"] = (cpu1 - cpu0) / n * 1e6
            await kids.kill_all()
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.suites.delayed", description=__doc__)
    p.add_argument("--tasks", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lead", type=float, default=0.0, help="seconds ahead (default: by size)")
    p.add_argument(
        "--plain-only", action="store_true", help="only the plain queue (runs on older versions)"
    )
    a = p.parse_args()
    lead = a.lead or 2.0 + a.tasks / 20_000
    r = trio.run(measure, a.tasks, a.workers, lead, a.plain_only)
    print(f"{a.tasks} tasks, {a.workers} worker processes x concurrency 10")
    if not a.plain_only:
        print(
            f"delayed, all due at once: all ran {r['delayed_seconds']:.2f} s after the due "
            f"time ({a.tasks / r['delayed_seconds']:,.0f} tasks/s), "
            f"Redis CPU {r['delayed_redis_us_per_task']:.1f} µs per task"
        )
    print(
        f"plain enqueue, same tasks: all ran in {r['plain_seconds']:.2f} s "
        f"({a.tasks / r['plain_seconds']:,.0f} tasks/s), "
        f"Redis CPU {r['plain_redis_us_per_task']:.1f} µs per task (enqueue included)"
    )


if __name__ == "__main__":
    main()
