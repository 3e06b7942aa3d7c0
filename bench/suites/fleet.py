"""Idle fleets at TTL 3 s (``python -m bench --only fleet``): the same number
of workers as ``open_worker``s and as fleets (:func:`mesh.open_fleet`),
alternating, and 10,000 workers as 10 fleets of 1,000 that serve a queue and
hold nothing. The measurement itself (:func:`bench.suites.scale.idle_fleets`)
shares its worker groups with the scale suite.
"""

from __future__ import annotations

from mesh._connection import open_connection
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .scale import FULL, QUICK, Run, Sizes, idle_fleets


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    """Idle fleets at TTL 3 s: ``open_worker``s and fleets of the same size,
    then the big fleet, in each run."""
    sizes = sizes or (QUICK if ctx.quick else FULL)
    section = Section(
        "fleet",
        "Idle fleets (issue 14: a fleet ten times larger)",
        FLEET_METHOD.format(
            fttl=sizes.fleet_ttl,
            cw=sizes.compare_processes * sizes.compare_per_process,
            cp=sizes.compare_processes,
            cper=sizes.compare_per_process,
            bw=sizes.big_processes * sizes.big_per_process,
            bp=sizes.big_processes,
            bper=sizes.big_per_process,
            fwin=sizes.fleet_window,
            fslow=sizes.fleet_slowlog,
        ),
        runs=ctx.runs,
    )
    runs: list[Run] = []
    most = max(
        sizes.compare_processes * sizes.compare_per_process,
        sizes.big_processes * sizes.big_per_process,
    )
    with run_redis_server(["--maxclients", str(max(10_000, 3 * most))]) as server:
        async with open_connection(server.url) as conn:
            for r in range(ctx.runs):
                ctx.log(f"fleet: run {r + 1}/{ctx.runs}")
                res = Run()
                await idle_fleets(ctx, server.url, conn, sizes, res)
                runs.append(res)
    f = section.figures
    for key, label in (
        ("solo", "open_workers"),
        ("fleet", "fleets"),
        ("big", "fleets"),
    ):
        xs = [x.idle[key] for x in runs if key in x.idle]
        if not xs:
            continue
        n = xs[0].workers
        who = f"{n:,} idle {label}, ttl {sizes.fleet_ttl:g} s" + (
            ", no tasks" if key == "big" else ""
        )
        f.append(
            Figure(
                f"{who}: Redis CPU",
                "% of a core",
                [x.redis_cpu for x in xs],
                target=Target("<", 20, "< 20%") if key == "big" else None,
            )
        )
        f.append(
            Figure(f"{who}: Redis CPU per worker", "µs/s", [x.redis_us_per_worker for x in xs])
        )
        f.append(Figure(f"{who}: worker processes' CPU", "% of a core", [x.worker_cpu for x in xs]))
        f.append(Figure(f"{who}: leases renewed", "/s", [x.renewals for x in xs]))
        f.append(Figure(f"{who}: heartbeat.lua calls", "/s", [x.heartbeat_calls for x in xs]))
        f.append(
            Figure(
                f"{who}: heartbeat.lua Redis time per renewed lease",
                "µs",
                [x.heartbeat_us for x in xs],
                note="SLOWLOG (a little high, see above)",
            )
        )
        f.append(
            Figure(f"{who}: commands run, scripts' own included", "/s", [x.commands for x in xs])
        )
        f.append(
            Figure(
                f"{who}: Redis time of all other commands",
                "ms/s",
                [x.other_us / 1000 for x in xs],
                note="SLOWLOG",
            )
        )
    pairs = [(x.idle["solo"], x.idle["fleet"]) for x in runs if "fleet" in x.idle]
    if pairs:
        f.append(
            Figure(
                f"Redis CPU per idle worker: {pairs[0][0].workers:,} open_workers / as many "
                "in fleets (same run)",
                "x",
                [a.redis_us_per_worker / b.redis_us_per_worker for a, b in pairs],
            )
        )
    return section


FLEET_METHOD = """
At TTL {fttl:g} s (a heartbeat every second), {cw:,} workers ({cp} OS processes x
{cper}) each holding one persistent task, first as `open_worker`s, then as one
fleet per process (`mesh.open_fleet`: one connection, one pub/sub connection,
one reaper and batched heartbeats per process), then {bw:,} workers as {bp}
fleets of {bper:,} that serve the queue and hold nothing (each waits in the
queue's idle set); in that order in each run. The tasks are ensured 500 at a
time, each batch held before the next. Over {fwin:g} s: `INFO cpu` of
redis-server (and the worker processes' CPU), the commands Redis ran (`INFO
commandstats`: those scripts run are counted too), and the leases renewed
(heartbeats the workers counted as confirmed); then for {fslow:g} s `SLOWLOG`:
the `heartbeat.lua` calls and their time per renewed lease (SLOWLOG logs every
command a script runs as well, which makes script times high), and the time of
every other command.
"""
