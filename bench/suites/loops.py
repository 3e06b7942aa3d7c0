"""trio-mesh on its two event loops: the same worker (one OS process, no-op
handlers) on trio, on asyncio and on uvloop, measured in the same run:
throughput at concurrency 10 and 100, and enqueue-to-start latency at a light
steady rate (issue 31's targets: asyncio at least 0.85x trio's throughput at
concurrency 10, and its p99 at most 1.3x trio's)."""

from __future__ import annotations

import math
import secrets

import trio

from mesh._connection import open_connection
from mesh._loop import RUNNERS
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import mesh_child
from . import latency, throughput

LOOPS = RUNNERS  # trio first: the ratios are over trio


async def run(ctx: Context) -> Section:
    tsizes = throughput.QUICK if ctx.quick else throughput.FULL
    lsizes = latency.QUICK if ctx.quick else latency.FULL
    section = Section(
        "loops",
        "trio-mesh on trio, asyncio and uvloop",
        METHOD.format(
            n=tsizes.tasks,
            c=tsizes.concurrency,
            high=tsizes.high,
            rate=lsizes.rate,
            ln=lsizes.tasks,
            w=lsizes.warmup,
        ),
        runs=ctx.runs,
    )
    rates: dict[tuple[str, int], list[float]] = {}
    p99: dict[str, list[float]] = {}
    with run_redis_server() as server:
        async with open_connection(server.url) as conn:
            for r in range(ctx.runs):
                order = LOOPS if r % 2 == 0 else LOOPS[::-1]
                for conc in (tsizes.concurrency, tsizes.high):
                    for loop in order:
                        c = throughput.Contender(
                            f"trio-mesh on {loop}, c{conc}", "mesh", concurrency=conc,
                            extra=("--loop", loop),
                        )  # fmt: skip
                        ctx.log(f"loops: run {r + 1}/{ctx.runs}: {c.label}")
                        res = await throughput.one_run(ctx, server.url, conn, c, tsizes)
                        rate = tsizes.tasks / res.processing
                        rates.setdefault((loop, conc), []).append(rate)
                        ctx.log(f"  {rate:,.0f} tasks/s")
                for loop in order:
                    ns = "lp" + secrets.token_hex(3)
                    args = ["--url", server.url, "--ns", ns, "--queue", latency.QUEUE]
                    system = latency.System(
                        f"trio-mesh on {loop}",
                        mesh_child(
                            "latency-work", *args, "--concurrency", str(lsizes.concurrency),
                            "--loop", loop,
                        ),
                        mesh_child(
                            "latency-produce", *args, "--n", str(lsizes.tasks),
                            "--rate", f"{lsizes.rate:g}", "--loop", loop,
                        ),
                    )  # fmt: skip
                    ctx.log(f"loops: run {r + 1}/{ctx.runs}: {system.label} latency")
                    try:
                        got = (await latency.one_run(conn, system, lsizes)).p99
                    except trio.TooSlowError:
                        got = math.nan
                        section.notes.append(f"{system.label}: latency run {r + 1} timed out")
                    p99.setdefault(loop, []).append(got)
                    ctx.log(f"  p99 {got:.3f} ms")
    for conc in (tsizes.concurrency, tsizes.high):
        for loop in LOOPS:
            section.figures.append(
                Figure(f"{loop}, concurrency {conc}", "tasks/s", rates[(loop, conc)])
            )
        for loop in LOOPS[1:]:
            section.figures.append(
                Figure(
                    f"{loop} / trio, concurrency {conc}, same run",
                    "x",
                    [
                        a / t
                        for a, t in zip(rates[(loop, conc)], rates[("trio", conc)], strict=True)
                    ],
                    target=(
                        Target(">=", 0.85, ">= 0.85")
                        if loop == "asyncio" and conc == tsizes.concurrency
                        else None
                    ),
                )
            )
    for loop in LOOPS:
        section.figures.append(Figure(f"{loop}: enqueue-to-start p99", "ms", p99[loop]))
    for loop in LOOPS[1:]:
        section.figures.append(
            Figure(
                f"{loop} p99 / trio p99, same run",
                "x",
                [a / t for a, t in zip(p99[loop], p99["trio"], strict=True)],
                target=Target("<=", 1.3, "<= 1.3") if loop == "asyncio" else None,
            )
        )
    return section


METHOD = """
The same trio-mesh worker child (`bench/children/mesh_child.py`, one OS
process) with `--loop trio`, `--loop asyncio` (the standard library's loop)
and `--loop uvloop`, on one redis-server, the three interleaved in each run
(the order reversed every other run), so each ratio compares one run's
figures. Throughput: {n:,} no-op one-shot tasks enqueued first, then drained
at concurrency {c} and {high} (as the throughput benchmark: the time from
"go" until Redis holds no task). Latency: a producer on the same loop
enqueues {ln:,} tasks one at a time at {rate:g} tasks/s and the worker
(concurrency 10) notes each handler start; p99 of start - enqueue over all
but the first {w} (as the latency benchmark).
"""
