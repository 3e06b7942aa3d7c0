"""Rebalancing: how fast a mesh that grows from 3 to 6 peers evens out.

``python -m bench.tools.balance [--tasks 3000] [--ttl 1.5]`` starts its own
redis-server (127.0.0.1, a free port), runs 3 workers in this process that
own ``--tasks`` persistent tasks, starts 3 more, and reports:

- the time from the join until every worker holds floor or ceil of its fair
  share (±1), by trio's clock of this one process;
- the moves made (tasks started a second time), against the surplus (the
  minimum: what the first three held above their share);
- the handoff gap of each moved task: its old handler exited -> its new
  handler started (p50, p99, max);
- the Redis time (``INFO commandstats``, EVALSHA) spent per heartbeat-sized
  script call over the whole run, for orientation.

All workers share one process and one event loop, so the handoff gap
includes that loop's scheduling of 6 workers and thousands of handlers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter

import trio

import mesh
from mesh import Process
from mesh.testing import run_redis_server
from tests.test_balance import Owners  # records starts and exits, refuses two owners


def spread(owners: Owners, ids: list[str]) -> tuple[int, int]:
    c = Counter(owners.running.values())
    n = [c[w] for w in ids]
    return min(n), max(n)


async def run(tasks: int, ttl: float) -> dict[str, float]:
    owners = Owners()
    with run_redis_server() as server:
        url = server.url
        async with mesh.open_client(url, namespace="bench") as client, trio.open_nursery() as n:
            workers: list[mesh.Worker] = []
            done = trio.Event()

            async def one(task_status: trio.TaskStatus[mesh.Worker]) -> None:
                async with mesh.open_worker(url, namespace="bench", ttl=ttl) as w:
                    await w.start_work("devices", owners.handler, concurrency=tasks)
                    task_status.started(w)
                    await done.wait()

            for _ in range(3):
                workers.append(await n.start(one))
            await client.ensure_many("devices", [b"d%d" % i for i in range(tasks)])
            while len(owners.running) < tasks:  # noqa: ASYNC110 - a poll of a count
                await trio.sleep(0.05)
            ids = [w.id for w in workers]
            while True:
                lo, hi = spread(owners, ids)
                if hi - lo <= 1:
                    break
                await trio.sleep(0.05)
            # the minimum number of moves: the first three keep floor(P/6)
            # each, and ceil for up to (P mod 6) of them
            surplus = tasks - 3 * (tasks // 6) - min(3, tasks % 6)
            first = len(owners.starts)
            stats0 = await client._conn.execute("INFO", "commandstats")
            joined = trio.current_time()
            for _ in range(3):
                workers.append(await n.start(one))
            ids = [w.id for w in workers]
            while True:
                lo, hi = spread(owners, ids)
                if hi - lo <= 1 and sum(Counter(owners.running.values())[w] for w in ids) == tasks:
                    break
                await trio.sleep(0.01)
            balanced = trio.current_time() - joined
            await trio.sleep(3 * ttl)  # nothing more moves
            lo, hi = spread(owners, ids)
            stats1 = await client._conn.execute("INFO", "commandstats")
            moved = owners.starts[first:]
            by_task: dict[bytes, list[Process]] = {}
            for p, _ in owners.starts:
                by_task.setdefault(p.task, []).append(p)
            gaps = []
            for p, started in moved:
                prev = by_task[p.task][-2]
                gaps.append(started - owners.exits[prev.token])
            done.set()
    gaps.sort()
    evalsha = [_calls(stats0), _calls(stats1)]
    return {
        "tasks": tasks,
        "ttl_s": ttl,
        "balanced_after_s": round(balanced, 3),
        "moves": len(moved),
        "surplus": surplus,
        "final_min": lo,
        "final_max": hi,
        "gap_p50_ms": round(1000 * statistics.median(gaps), 2) if gaps else 0.0,
        "gap_p99_ms": round(1000 * gaps[int(0.99 * (len(gaps) - 1))], 2) if gaps else 0.0,
        "gap_max_ms": round(1000 * gaps[-1], 2) if gaps else 0.0,
        "evalsha_calls": evalsha[1][0] - evalsha[0][0],
        "evalsha_us_per_call": round(
            (evalsha[1][1] - evalsha[0][1]) / max(1, evalsha[1][0] - evalsha[0][0]), 1
        ),
    }


def _calls(info: bytes) -> tuple[int, int]:
    """EVALSHA calls and total microseconds from INFO commandstats."""
    for line in info.decode().splitlines():
        if line.startswith("cmdstat_evalsha:"):
            f = dict(kv.split("=") for kv in line.split(":", 1)[1].split(","))
            return int(f["calls"]), int(f["usec"])
    return 0, 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=3000)
    ap.add_argument("--ttl", type=float, default=1.5)
    args = ap.parse_args(argv)
    r = trio.run(run, args.tasks, args.ttl)
    for k, v in r.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
