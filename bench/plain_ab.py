"""The plain queue, two versions of trio-mesh in one run: ``python -m bench.plain_ab``.

For a change to the claim path (a feature the plain queue must not pay
for), this runs the same measurements on two source trees, alternating A
and B, and prints each figure per run with its min and max:

- **claim cost**: Redis time per ``claim.lua`` call of 10 tasks on a queue
  that only ever had plain tasks (``INFO commandstats``, 2,000 claims in a
  row, no finish in between), and the client's wall time per call;
- **throughput**: ``python -m bench.delayed --plain-only`` of that tree
  (N no-op tasks, one worker process at concurrency 10): tasks/s and Redis
  CPU per task.

    python -m bench.plain_ab --a /path/to/old/checkout --b . --runs 3

Each tree is imported with ``PYTHONPATH=<tree>``, so a tree is any checkout
(``git worktree add /tmp/old <commit>``) that has ``mesh/`` and
``bench/delayed.py``. The claim measurement is this file run as a script in
that environment, so it uses only the tree's ``mesh``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

CLAIMS = 2_000
BATCH = 10


def child_claim_cost(claims: int) -> dict[str, float]:
    """Run in the tree under test: Redis µs and wall µs per claim of 10."""
    import time

    import trio

    from mesh._connection import open_connection
    from mesh._keys import Keys
    from mesh._scripts import Binding
    from mesh.testing import run_redis_server

    async def go(url: str) -> dict[str, float]:
        keys = Keys("ab")
        b = Binding(keys)
        async with open_connection(url) as conn:
            await b.register(conn, "w", "i", 600_000, b"{}")
            await b.serve(conn, "w", "i", "bench")
            n = claims * BATCH
            for i in range(0, n, 10_000):
                await b.enqueue(conn, "bench", [b"%d" % j for j in range(i, i + 10_000)])
            # warm up (script cache, allocator) outside the window
            await b.claim(conn, "w", "i", "bench", BATCH, 0, fair=True, ttl_ms=600_000)

            async def usec() -> tuple[int, int]:
                raw = (await conn.execute("INFO", "commandstats")).decode()
                m = re.search(r"cmdstat_evalsha:calls=(\d+),usec=(\d+)", raw)
                assert m is not None
                return int(m.group(1)), int(m.group(2))

            c0, u0 = await usec()
            t0 = time.perf_counter()
            for _ in range(claims - 1):
                r = await b.claim(conn, "w", "i", "bench", BATCH, 0, fair=True, ttl_ms=600_000)
                assert len(r.processes) == BATCH
            t1 = time.perf_counter()
            c1, u1 = await usec()
            return {
                "redis_us_per_claim": (u1 - u0) / (c1 - c0),
                "wall_us_per_claim": (t1 - t0) / (claims - 1) * 1e6,
            }

    with run_redis_server() as server:
        return trio.run(go, server.url)


def run_tree(tree: Path, tasks: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))

    def out(*argv: str) -> str:
        return subprocess.run(
            [sys.executable, *argv], env=env, cwd=tree, capture_output=True, text=True, check=True
        ).stdout

    r: dict[str, float] = json.loads(out(__file__, "--child", str(CLAIMS)).strip().splitlines()[-1])
    text = out("-m", "bench.delayed", "--plain-only", "--tasks", str(tasks), "--workers", "1")
    m = re.search(r"\(([\d,]+) tasks/s\), Redis CPU ([\d.]+) µs per task", text)
    if m is None:
        raise RuntimeError(f"unexpected output of bench.delayed in {tree}: {text!r}")
    r["tasks_per_s"] = float(m.group(1).replace(",", ""))
    r["redis_us_per_task"] = float(m.group(2))
    return r


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.plain_ab", description=__doc__)
    p.add_argument("--a", type=Path, required=True, help="the tree before (e.g. a worktree)")
    p.add_argument("--b", type=Path, default=Path("."), help="the tree after (default .)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tasks", type=int, default=20_000, help="tasks per throughput run")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child_claim_cost(a.child)))
        return
    trees = {"A": a.a.resolve(), "B": a.b.resolve()}
    for name, tree in trees.items():
        head = subprocess.run(
            ["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        print(f"{name}: {tree} ({head})", flush=True)
    print(f"load before: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for i in range(a.runs):
        for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
            r = run_tree(trees[name], a.tasks)
            results[name].append(r)
            rounded = {k: round(v, 2) for k, v in r.items()}
            print(f"run {i + 1} {name}: {json.dumps(rounded)}", flush=True)
    print(f"load after: {os.getloadavg()}")
    head = ("figure", "A min-max (median)", "B min-max (median)", "B/A median")
    print(f"{head[0]:<22} {head[1]:>30} {head[2]:>30} {head[3]:>10}")
    for key in ("redis_us_per_claim", "wall_us_per_claim", "tasks_per_s", "redis_us_per_task"):
        cells = []
        meds = []
        for name in ("A", "B"):
            vs = sorted(r[key] for r in results[name])
            med = vs[len(vs) // 2]
            meds.append(med)
            cells.append(f"{vs[0]:.2f}-{vs[-1]:.2f} ({med:.2f})")
        print(f"{key:<22} {cells[0]:>30} {cells[1]:>30} {meds[1] / meds[0]:>10.3f}")


if __name__ == "__main__":
    main()
