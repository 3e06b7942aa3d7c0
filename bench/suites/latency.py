"""Enqueue-to-start latency at a light steady rate: one producer enqueues one
task at a time at 500 tasks/s, one worker process (concurrency 10) notes when
each handler starts; trio-mesh and BullMQ, interleaved in the same run.

Both systems' children speak one line protocol (``bench/children/mesh_child.py``
``latency-work`` / ``latency-produce`` and ``bench/children/bullmq_driver.js``
with the same roles), so one :func:`one_run` drives either.
"""

from __future__ import annotations

import math
import secrets
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass

import trio

from mesh._connection import Connection, open_connection
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import Child, children, mesh_child, percentile, poll_until
from .throughput import BASE, tree_child

QUEUE = "bench"
P99_TARGET_MS = 5.0


@dataclass(frozen=True)
class Sizes:
    tasks: int = 3_000
    warmup: int = 250  # the first tasks of each run, left out of the figures
    rate: float = 500.0  # tasks/s
    concurrency: int = 10
    bullmq: bool = True


FULL = Sizes()
QUICK = Sizes(tasks=600, warmup=100)


@dataclass(frozen=True)
class System:
    label: str  # "trio-mesh" or "BullMQ 6.7.0"
    worker: list[str]  # argv of the worker process
    producer: list[str]  # argv of the producer process


@dataclass(frozen=True)
class Latencies:
    """One system's run: enqueue-to-start latencies after the warm-up, and
    the rate the producer reached."""

    ms: list[float]  # in order of enqueueing
    rate: float  # tasks/s, from the first enqueue to the last
    clock_window_ms: float  # how closely the worker's clock was checked against ours

    @property
    def p50(self) -> float:
        return percentile(self.ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.ms, 99)

    @property
    def max(self) -> float:
        return max(self.ms) if self.ms else math.nan


def summarize(
    rows: Iterable[tuple[int, int]],
    n: int,
    warmup: int,
    first_ns: int,
    last_ns: int,
    clock_window_ns: int = 0,
) -> Latencies:
    """The figures of one run from the worker's ``(task index, start -
    enqueue ns)`` rows and the producer's first and last enqueue times: the
    latencies of tasks ``warmup`` to ``n - 1`` in ms, in order of index, and
    the achieved rate (``n - 1`` intervals over the span of the enqueues).

    Raises:
        RuntimeError: a task started twice, never, or was not ours.
    """
    by_index: dict[int, int] = {}
    for i, ns in rows:
        if i in by_index:
            raise RuntimeError(f"task {i} started twice")
        by_index[i] = ns
    if sorted(by_index) != list(range(n)):
        missing = sorted(set(range(n)) - set(by_index))
        extra = sorted(set(by_index) - set(range(n)))
        raise RuntimeError(f"tasks not started: {missing[:10]}; not ours: {extra[:10]}")
    span = (last_ns - first_ns) / 1e9
    return Latencies(
        ms=[by_index[i] / 1e6 for i in range(warmup, n)],
        rate=(n - 1) / span if span > 0 else math.nan,
        clock_window_ms=clock_window_ns / 1e6,
    )


async def check_clock(worker: Child) -> int:
    """Ask the worker for its clock between two reads of ours
    (``time.monotonic_ns()``, CLOCK_MONOTONIC): its reading must fall between
    them, or its start times could not be read against anything. Returns
    the window (ns) the check had.

    Raises:
        RuntimeError: the worker's clock is not this machine's CLOCK_MONOTONIC.
    """
    before = time.monotonic_ns()
    await worker.send("clock")
    theirs = int((await worker.expect("clock", 30)).split()[1])
    after = time.monotonic_ns()
    if not before <= theirs <= after:
        raise RuntimeError(
            f"{worker.name}: its clock read {theirs}, ours {before}..{after}: "
            "not the same CLOCK_MONOTONIC"
        )
    return after - before


async def one_run(conn: Connection, system: System, sizes: Sizes) -> Latencies:
    """Start the system's worker and producer, let the producer enqueue at
    the steady rate, wait until the worker has started every task, and read
    its latencies."""
    await conn.execute("FLUSHALL")
    n = sizes.tasks
    async with children() as kids:
        worker = await kids.spawn(f"{system.label} worker", system.worker)
        producer = await kids.spawn(f"{system.label} producer", system.producer)
        await worker.expect("ready", 60)
        await producer.expect("ready", 60)
        window = await check_clock(worker)
        await producer.send("go")
        done = await producer.expect("enqueued", 60 + 2 * n / sizes.rate)
        _, sent, first, last = done.split()
        if int(sent) != n:
            raise RuntimeError(f"{system.label}: the producer enqueued {sent}, not {n}")

        async def all_started() -> bool:
            await worker.send("count")
            return int((await worker.expect("count", 30)).split()[1]) >= n

        # polled only once the producer is done: nothing disturbs the paced part
        await poll_until(all_started, interval=0.05, within=60)
        await worker.send("dump")
        rows = []
        while (line := await worker.expect("", 30)) != "end":
            if line.startswith("latency "):
                _, i, ns = line.split()
                rows.append((int(i), int(ns)))
    return summarize(rows, n, sizes.warmup, int(first), int(last), window)


def node_versions(node: str) -> str:
    """``"v20.20.2, libuv 1.46.0"``: which libuv's ``uv_hrtime`` timed BullMQ."""
    try:
        r = subprocess.run(
            [node, "-p", "process.version + ', libuv ' + process.versions.uv"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "version unknown"
    return r.stdout.strip() if r.returncode == 0 else "version unknown"


def systems(ctx: Context, sizes: Sizes, url: str, ns: str) -> tuple[list[System], list[str]]:
    """trio-mesh, and BullMQ where it can be installed (else a note why not)."""
    common = ["--url", url]
    c = ["--concurrency", str(sizes.concurrency)]
    p = ["--n", str(sizes.tasks), "--rate", f"{sizes.rate:g}"]
    mesh_args = [*common, "--ns", ns, "--queue", QUEUE]
    out = [
        System(
            "trio-mesh",
            mesh_child("latency-work", *mesh_args, *c),
            mesh_child("latency-produce", *mesh_args, *p),
        )
    ]
    if ctx.base:
        # trio-mesh at the base tree (python -m bench --base), same runs
        out.append(
            System(
                f"trio-mesh, {BASE}",
                tree_child(ctx.base, "latency-work", *mesh_args, *c),
                tree_child(ctx.base, "latency-produce", *mesh_args, *p),
            )
        )
    notes = []
    if sizes.bullmq:
        b, why = ctx.bullmq()
        if b is None:
            notes.append(why)
        else:
            out.append(
                System(
                    f"BullMQ {b.version.split()[0]}",
                    b.argv("latency-work", *common, *c),
                    b.argv("latency-produce", *common, *p),
                )
            )
            notes.append(
                f"BullMQ ran under {b.node} ({node_versions(b.node)}): bullmq {b.version} "
                "(bench/_node.py)."
            )
    return out, notes


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    section = Section(
        "latency",
        "Enqueue-to-start latency at a light steady rate",
        METHOD.format(
            n=sizes.tasks,
            w=sizes.warmup,
            rate=sizes.rate,
            c=sizes.concurrency,
            m=sizes.tasks - sizes.warmup,
            secs=sizes.tasks / sizes.rate,
            period=1000 / sizes.rate,
        ),
        runs=ctx.runs,
    )
    results: dict[str, list[Latencies | None]] = {}
    with run_redis_server() as server:
        ns = "lat" + secrets.token_hex(3)
        measured, notes = systems(ctx, sizes, server.url, ns)
        section.notes += notes
        async with open_connection(server.url) as conn:
            for r in range(ctx.runs):
                # alternate the order, so that neither always goes first
                for s in measured if r % 2 == 0 else measured[::-1]:
                    ctx.log(f"latency: run {r + 1}/{ctx.runs}: {s.label}")
                    try:
                        res: Latencies | None = await one_run(conn, s, sizes)
                    except trio.TooSlowError:
                        res = None
                        ctx.log(f"latency: {s.label} timed out")
                        section.notes.append(f"{s.label}: run {r + 1} timed out")
                    results.setdefault(s.label, []).append(res)
                    if res is not None:
                        ctx.log(
                            f"  p50 {res.p50:.2f} ms, p99 {res.p99:.2f} ms, "
                            f"max {res.max:.2f} ms at {res.rate:.0f} tasks/s"
                        )
    nan = math.nan
    for s in measured:
        rs = results[s.label]
        section.figures += [
            Figure(f"{s.label}: p50", "ms", [x.p50 if x else nan for x in rs]),
            Figure(
                f"{s.label}: p99",
                "ms",
                [x.p99 if x else nan for x in rs],
                target=(
                    Target("<", P99_TARGET_MS, f"< {P99_TARGET_MS:g} ms")
                    if s.label == "trio-mesh"
                    else None
                ),
            ),
            Figure(f"{s.label}: max", "ms", [x.max if x else nan for x in rs]),
            Figure(
                f"{s.label}: achieved enqueue rate",
                "tasks/s",
                [x.rate if x else nan for x in rs],
                note=f"asked for {sizes.rate:g}",
            ),
        ]
        section.samples[s.label] = ("ms", [v for x in rs if x for v in x.ms])
    section.limits["trio-mesh"] = P99_TARGET_MS
    mesh = results[measured[0].label]
    for s in measured[1:]:
        other = results[s.label]
        if s.label.endswith(BASE):
            section.figures.append(
                Figure(
                    "trio-mesh p99 / at the base tree, same run",
                    "x",
                    [m.p99 / b.p99 if m and b else nan for m, b in zip(mesh, other, strict=True)],
                    target=Target("<=", 1.1, "<= 1.1 (within 10%)"),
                    note=f"per run: both measured in the same run; the base tree: {ctx.base}",
                )
            )
            continue
        section.figures.append(
            Figure(
                f"{s.label} p99 / trio-mesh p99, same run",
                "x",
                [b.p99 / m.p99 if m and b else nan for m, b in zip(mesh, other, strict=True)],
                target=Target(">=", 3.0, ">= 3 (issue 34)"),
                note="per run: both measured in the same run",
            )
        )
    windows = [x.clock_window_ms for rs in results.values() for x in rs if x]
    if windows:
        section.notes.append(
            "Clock check: before each run the parent read CLOCK_MONOTONIC, asked the worker "
            "for its clock (trio-mesh: `time.monotonic_ns()`, BullMQ: "
            "`process.hrtime.bigint()`) and read its own again; every worker's reading fell "
            f"in between (widest window {max(windows):.2f} ms)."
        )
    return section


METHOD = """
A light steady load: a producer process enqueues {n:,} one-shot no-op tasks
one at a time at {rate:g} tasks/s (one every {period:g} ms, {secs:g} s per
run) on an absolute schedule (task i is due at start + i / {rate:g}: trio
`sleep_until`, Node `setTimeout` for the time left, so a late task does not
shift the ones after it), and one worker process at concurrency {c} serves
the queue. Each payload carries its enqueue time, read just before the
enqueue call; the handler reads the clock as it starts; the latency is
start - enqueue time: the enqueue call, the wake-up of the waiting worker,
its claim and the hand-off to the handler. The first {w} tasks of each run
(the worker's first claims, Node's JIT) are left out; p50, p99 and max are
over the other {m:,}. The achieved rate (first to last enqueue) shows the
load stayed light.

trio-mesh: `Client.enqueue` in the producer, `open_worker` +
`start_work(queue, handler, concurrency={c})` in the worker
(`bench/children/mesh_child.py latency-produce` / `latency-work`), times from
`time.monotonic_ns()`. BullMQ (`bench/children/bullmq_driver.js`, the same
roles): `Queue.add` with `removeOnComplete` and `removeOnFail`, one `Worker`
at concurrency {c} with default options, times from `process.hrtime.bigint()`.
Installed as in the throughput benchmark (`bench/_node.py`: from the npm
registry into a scratch folder) and skipped, with a note, where node, npm or
the registry is missing.

Both clocks are CLOCK_MONOTONIC, one clock for every process of a Linux
machine: Python's `time.monotonic_ns()` is `clock_gettime(CLOCK_MONOTONIC)`
(`time.get_clock_info("monotonic")`), and Node's `process.hrtime.bigint()` is
libuv's `uv_hrtime()`, which on Linux is `clock_gettime(CLOCK_MONOTONIC)`
(libuv `src/unix/linux.c`, `uv__hrtime` with `UV_CLOCK_PRECISE`). Each
system's two stamps come from its own producer and worker; before each run
the parent checks the worker's clock against its own (see the notes).

Each run measures both systems on the same redis-server (`FLUSHALL` before
each), one after the other, the order alternating from run to run; "BullMQ
p99 / trio-mesh p99" is taken per run. Figures are the median, min and max
over the runs.
"""
