"""trio-mesh A/B against another source tree, in one run, interleaved:
``python -m bench.tools.ab_throughput --a /tmp/main-tree [--b .] [--rounds 3]``.

Each round runs, on one redis-server and in this order: the bare loop (the
limit, :mod:`bench.suites.throughput`), trio-mesh of tree A and of tree B at
concurrency 10, then A and B at concurrency 100 (B before A in every second
round); N no-op tasks each. Per
round it prints tasks/s, Redis CPU and worker CPU per task, Redis commands
per task, and B / A and B / the loop; at the end each ratio's min, median
and max over the rounds. A tree is any checkout with ``mesh/`` and
``bench/`` (``git archive main | tar -x -C /tmp/main-tree``), imported with
``PYTHONPATH=<tree>``; B defaults to this checkout.
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

import trio

from mesh._connection import open_connection
from mesh.testing import run_redis_server

from .._context import Context
from .._util import median
from ..suites.throughput import LOOP, Contender, RunResult, Sizes, one_run


def row(name: str, r: RunResult, n: int) -> str:
    return (
        f"  {name:<14} {n / r.processing:>9,.0f} tasks/s  Redis {r.redis_cpu / n * 1e6:6.2f} µs"
        f"  worker {r.worker_cpu / n * 1e6:6.2f} µs  commands {r.commands / n:5.2f}"
    )


async def main(a: Path, b: Path, rounds: int, tasks: int) -> None:
    ctx = Context(runs=rounds)
    sizes = Sizes(tasks=tasks)
    loop = Contender(LOOP, "loop")
    pairs = {
        conc: (
            Contender(f"A c{conc}", "mesh", concurrency=conc, tree=str(a)),
            Contender(f"B c{conc}", "mesh", concurrency=conc, tree=str(b)),
        )
        for conc in (10, 100)
    }
    ratios: dict[str, list[float]] = {}

    def note(name: str, v: float) -> None:
        ratios.setdefault(name, []).append(v)

    with run_redis_server() as server:
        async with open_connection(server.url) as conn:
            for r in range(rounds):
                print(f"round {r + 1}/{rounds} ({secrets.token_hex(2)})", flush=True)
                lr = await one_run(ctx, server.url, conn, loop, sizes)
                print(row("bare loop", lr, tasks), flush=True)
                for conc, (ca, cb) in pairs.items():
                    got = {}
                    # A then B in odd rounds, B then A in even ones (a trend in
                    # the machine's load does not favour one)
                    for name, c in [("A", ca), ("B", cb)][:: 1 if r % 2 == 0 else -1]:
                        got[name] = await one_run(ctx, server.url, conn, c, sizes)
                        print(row(f"{name} c{conc}", got[name], tasks), flush=True)
                    ra, rb = got["A"], got["B"]
                    note(f"B/A rate c{conc}", ra.processing / rb.processing)
                    note(f"B/A Redis CPU per task c{conc}", rb.redis_cpu / ra.redis_cpu)
                    note(
                        f"B/A worker CPU per task c{conc}", rb.worker_cpu / max(ra.worker_cpu, 1e-9)
                    )
                    if conc == 10:
                        note("A/loop rate c10", lr.processing / ra.processing)
                        note("B/loop rate c10", lr.processing / rb.processing)
                        note("A/loop Redis CPU c10", ra.redis_cpu / lr.redis_cpu)
                        note("B/loop Redis CPU c10", rb.redis_cpu / lr.redis_cpu)
                        note("A/loop worker CPU c10", ra.worker_cpu / max(lr.worker_cpu, 1e-9))
                        note("B/loop worker CPU c10", rb.worker_cpu / max(lr.worker_cpu, 1e-9))
    print(f"over {rounds} rounds, {tasks:,} tasks each (min / median / max):")
    for name, vs in ratios.items():
        print(f"  {name:<28} {min(vs):5.2f} / {median(vs):5.2f} / {max(vs):5.2f}")


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tools.ab_throughput", description=__doc__)
    p.add_argument("--a", type=Path, required=True, help="source tree A (the baseline)")
    p.add_argument("--b", type=Path, default=Path.cwd(), help="source tree B (default: .)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tasks", type=int, default=20_000)
    args = p.parse_args()
    trio.run(main, args.a.resolve(), args.b.resolve(), args.rounds, args.tasks)


if __name__ == "__main__":
    cli()
