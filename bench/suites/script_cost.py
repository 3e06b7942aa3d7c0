"""What the scripts cost Redis, counted rather than timed: the instructions
redis-server runs per task (valgrind's callgrind, which counts every
instruction the server executes: the same count on every run, on any load of
the machine), for this tree and for a base tree, in the same run.

Timed A/Bs of a worker on a shared two-core machine move by 10-20% from run
to run (bench/suites/groups.py's ungrouped A/B, throughput's ``--base``);
a change of a few per cent in what a script does is below that noise, and
this count sees it. It does not count the worker's side (see the throughput
suite's worker CPU per task).

For each measure, a fresh redis-server runs under ``valgrind
--tool=callgrind --instr-atstart=no``; the driver
(bench/children/script_cost_child.py, run with the measured tree's mesh)
loads each script first and turns the count on only around the measure, so
the one-time load and compile of the scripts are not in it:

* ``claim, batch B``: a serial loop of ``finish_and_claim`` over N plain
  one-shot tasks, B per call (a worker at concurrency 10 claims about 30 per
  call, at 100 about 100);
* ``enqueue, batch B``: N small payloads in ``enqueue_many`` calls of B.

    python -m bench --only script_cost [--base TREE]   (a section of the report)
    python -m bench.suites.script_cost [--base TREE] [--tasks N]

Needs valgrind (and callgrind_control) on PATH; without it the section says
so and measures nothing. The base tree is ``--base``, else 8fa163c (main
before groups, issue 36's head) extracted with ``git archive``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import trio

from mesh.testing import _ping, find_redis_server, free_port

from .._context import Context
from .._report import Figure, Section, Target
from .groups import base_tree

CHILD = Path(__file__).resolve().parent.parent / "children" / "script_cost_child.py"
#: (mode, batch): the measures, in the report's order
MEASURES = [("claim", 10), ("claim", 30), ("claim", 100), ("enqueue", 1000)]


def count(tree: str, mode: str, n: int, batch: int) -> float:
    """Redis instructions per task of one measure at ``tree`` (see the module
    docstring).

    Raises:
        RuntimeError: the driver or redis-server failed (their output in the
            message).
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as d:
        out = Path(d) / "callgrind.out"
        server = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--hz", "1",
             "--save", "", "--appendonly", "no", "--dir", d],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120  # it starts in seconds under valgrind
            while not _ping(port):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server under valgrind did not start")
                time.sleep(0.1)
            url = f"redis://127.0.0.1:{port}"
            argv = [
                sys.executable,
                "-P",
                str(CHILD),
                url,
                str(server.pid),
                mode,
                str(n),
                str(batch),
            ]
            env = {**os.environ, "PYTHONPATH": tree}
            child = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
            if child.returncode != 0 or not child.stdout.startswith("done"):
                raise RuntimeError(f"script_cost child failed: {child.stdout}{child.stderr}")
            tasks = int(child.stdout.split()[1])
            server.terminate()  # redis-server exits cleanly; callgrind writes its counts
            server.wait(timeout=300)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        totals = [ln for ln in out.read_text().splitlines() if ln.startswith("totals:")]
        if not totals:
            raise RuntimeError("callgrind wrote no totals")
        return int(totals[0].split()[1]) / tasks


def measure(
    tree: str, base: str, n: int, measures: list[tuple[str, int]] = MEASURES
) -> dict[str, tuple[float, float]]:
    """Each of ``measures`` at ``tree`` and at ``base``, two at a time (one
    per core: the counts do not depend on the load): label -> (this tree,
    base tree)."""
    jobs = [(t, m, b) for m, b in measures for t in (tree, base)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda j: count(j[0], j[1], n, j[2]), jobs))
    return {f"{m}, batch {b}": (got[2 * i], got[2 * i + 1]) for i, (m, b) in enumerate(measures)}


async def suite(ctx: Context, n: int = 0, measures: list[tuple[str, int]] = MEASURES) -> Section:
    """The counts as a section of the report (one run: a count is the same
    on every run); ``n`` tasks per measure (0: 20,000, 2,000 with --quick)."""
    n = n or (2_000 if ctx.quick else 20_000)
    section = Section("script_cost", "What the scripts cost Redis", METHOD.format(n=n), runs=1)
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        section.notes.append("valgrind is not installed here: nothing was counted.")
        return section
    with base_tree(ctx) as (base, what):
        ctx.log(f"script_cost: {len(MEASURES) * 2} counts under valgrind, 2 at a time")
        rows = await trio.to_thread.run_sync(measure, os.getcwd(), base, n, measures)
    for label, (here, there) in rows.items():
        section.figures.append(
            Figure(f"{label}: Redis instructions per task, this tree", "Ir", [here])
        )
        section.figures.append(Figure(f"{label}: the same, base tree", "Ir", [there]))
        f = Figure(f"{label}: this tree / the base tree", "x", [here / there])
        if label.startswith("claim"):
            f.target = Target("<=", 1.03, "<= 1.03 (issue 36: the plain path as before groups)")
        section.figures.append(f)
    section.notes.append(f"The base tree: {what}.")
    return section


METHOD = """
Redis instructions per task, counted by valgrind's callgrind in a
redis-server of its own per measure (the same count on every run, whatever
else the machine does), for this tree and a base tree in the same run; the
scripts are loaded before the count starts. `claim, batch B`: a serial loop
of `finish_and_claim` over {n:,} plain one-shot tasks, B per call (a worker at
concurrency 10 claims about 30 per call, at 100 about 100); `enqueue, batch
B`: {n:,} small payloads in `enqueue_many` calls of B. The worker's own CPU is
not counted here (the throughput suite's worker CPU per task is).
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="", help="the base tree (default: 8fa163c, git archive)")
    ap.add_argument("--tasks", type=int, default=20_000)
    args = ap.parse_args()
    with base_tree(Context(base=args.base)) as (base, what):
        rows = measure(os.getcwd(), base, args.tasks)
    print(f"base tree: {what}")
    for label, (here, there) in rows.items():
        print(f"{label}: this tree {here:,.0f}, base {there:,.0f} Redis instructions per task "
              f"({here / there:.3f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
