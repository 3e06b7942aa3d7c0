"""Delayed tasks coming due at once: ``python -m bench.delayed``.

N one-shot tasks are enqueued with ``at=`` one instant a few seconds ahead
(Redis clock), so they all come due together, while W worker processes
(concurrency 10 each, a no-op handler) wait idle. Measured from the due time
until every task ran: the wall time and the Redis CPU per task. Then the same
N tasks are enqueued without a delay on the same workers, for comparison
(the plain queue's throughput in the same run).

Not part of ``python -m bench`` (yet): run it alone, e.g.
``python -m bench.delayed --tasks 100000 --workers 2``.
"""

from __future__ import annotations

import argparse
import secrets

import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from ._util import children, mesh_child, poll_until, redis_cpu

QUEUE = "bench"


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
    p = argparse.ArgumentParser(prog="python -m bench.delayed", description=__doc__)
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
