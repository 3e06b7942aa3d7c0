"""Groups of a queue (issue 36): fairness among backlogged groups, the cost
of many groups against one, and the ungrouped path against the tree before
groups, in one run.

Run alone as ``python -m bench --only groups`` (``--quick`` for small sizes,
``--groups-jobs N`` for the cost figure's size, ``--base TREE`` for the A/B's
base tree; without it, the tree of :data:`BASE_REV` is extracted with ``git
archive`` into a scratch folder).
"""

from __future__ import annotations

import math
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field, replace

import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import (
    REPO,
    children,
    cpu_seconds,
    info,
    median,
    mesh_child,
    poll_until,
    redis_cpu,
)
from . import throughput

QUEUE = "bench"
POLL = 0.002
BASE_REV = "8fa163c"
"""main just before groups: the base of the ungrouped A/B when no ``--base`` is given."""


@dataclass(frozen=True)
class Sizes:
    big: int = 100_000  # fairness: the big group's jobs, enqueued first
    small: int = 100  # fairness: then this many small groups
    small_jobs: int = 10  # of this many jobs each
    workers: int = 4  # fairness: worker processes
    concurrency: int = 10  # per worker process (fairness and cost)
    cost_jobs: int = 1_000_000  # cost: jobs of each side
    per_group: int = 10  # cost: jobs per group of the many-groups side
    ab_tasks: int = 20_000  # the ungrouped A/B: no-op tasks per trial
    ab_rounds: int = 3  # the ungrouped A/B: trials of each tree per run


FULL = Sizes()
QUICK = Sizes(big=10_000, cost_jobs=20_000, ab_tasks=2_000)


# --- filling the queue -----------------------------------------------------------


async def fill(client: mesh.Client, groups: list[tuple[str, int]], chunk: int = 50_000) -> None:
    """Enqueue ``n`` jobs into each group ``g`` of ``groups``, in order, 32
    calls in flight at once (a big group in calls of ``chunk``)."""
    limiter = trio.CapacityLimiter(32)

    async def one(g: str, payloads: list[bytes]) -> None:
        async with limiter:
            await client.enqueue_many(QUEUE, payloads, group=g)

    for g, n in groups:
        if n > chunk:  # in order: one call after the other
            for lo in range(0, n, chunk):
                await client.enqueue_many(
                    QUEUE, [b"%d" % i for i in range(lo, min(n, lo + chunk))], group=g
                )
    async with trio.open_nursery() as nursery:
        for g, n in groups:
            if n <= chunk:
                nursery.start_soon(one, g, [b"%d" % i for i in range(n)])


async def pending(conn: Connection, keys: Keys) -> int:
    """Jobs queued in the queue's groups and processes running."""
    n, running = await conn.pipeline(
        [("HGET", keys.groups(QUEUE), ":n"), ("HLEN", keys.procs(QUEUE))]
    )
    return int(n or 0) + int(running)


# --- a. fairness ------------------------------------------------------------------


@dataclass
class Fairness:
    big_done: int  # of the big group when the last small group's last job was done
    jain: float  # over every group's jobs done in the window
    window: float  # s: from the first job done to the first group running dry
    window_jobs: int


def jain(xs: list[int]) -> float:
    """Jain's fairness index: 1 when every x is equal, 1/n when one has all."""
    s, s2 = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * s2) if s2 else math.nan


def judge(done: list[tuple[int, str]], sizes: Sizes) -> Fairness:
    """Read the fairness figures from every job's end (monotonic ns, group)."""
    done.sort()
    last: dict[str, int] = {}
    for ns, g in done:
        last[g] = ns
    small = [g for g in last if g != "big"]
    if len(small) != sizes.small:
        raise RuntimeError(f"fairness: {len(small)} small groups seen, not {sizes.small}")
    end_small = max(last[g] for g in small)
    big_done = sum(1 for ns, g in done if g == "big" and ns <= end_small)
    # the window: while every group is backlogged, i.e. until the first
    # group's last job (jobs done strictly before it count)
    first_dry = min(last[g] for g in small)
    counts = dict.fromkeys(["big", *small], 0)
    for ns, g in done:
        if ns >= first_dry:
            break
        counts[g] += 1
    return Fairness(
        big_done=big_done,
        jain=jain(list(counts.values())),
        window=(first_dry - done[0][0]) / 1e9,
        window_jobs=sum(counts.values()),
    )


async def fairness_run(url: str, conn: Connection, sizes: Sizes) -> Fairness:
    await conn.execute("FLUSHALL")
    ns = "gf" + secrets.token_hex(3)
    keys = Keys(ns)
    async with mesh.open_client(url, namespace=ns) as client:
        await fill(client, [("big", sizes.big)])
        await fill(client, [(f"s{i}", sizes.small_jobs) for i in range(sizes.small)])
    big = keys.group_jobs(QUEUE, "big")
    async with children() as kids:
        argv = mesh_child("groups-work", "--url", url, "--ns", ns, "--queue", QUEUE,
                          "--concurrency", str(sizes.concurrency))  # fmt: skip
        workers = [await kids.spawn(f"groups worker {i}", argv) for i in range(sizes.workers)]
        for w in workers:
            await w.expect("ready", 60)
        for w in workers:
            await w.send("go")

        async def small_done() -> bool:
            n, left, running = await conn.pipeline(
                [("HGET", keys.groups(QUEUE), ":n"), ("LLEN", big), ("HLEN", keys.procs(QUEUE))]
            )
            return int(n or 0) - int(left) == 0 and int(running) <= sizes.workers * (
                sizes.concurrency + 1
            )

        await poll_until(small_done, interval=POLL, within=120)
        await trio.sleep(0.5)  # the small groups' last jobs end
        done: list[tuple[int, str]] = []
        for w in workers:
            await w.send("dump")
            while (line := await w.expect("", 60)) != "end":
                if line.startswith("g "):
                    _, t, g = line.split()
                    done.append((int(t), g))
    return judge(done, sizes)


# --- b. cost: many groups against one ---------------------------------------------


@dataclass
class Cost:
    rate: float  # jobs/s
    redis_us: float  # Redis CPU per job, µs
    worker_us: float  # worker CPU per job, µs
    enqueue: float  # s to enqueue (not part of the rate)
    commands: dict[str, tuple[float, float]]  # command -> (calls, µs) per job, while serving


async def command_costs(conn: Connection) -> dict[str, tuple[int, float]]:
    """INFO commandstats: command -> (calls, µs), inside scripts too."""
    out = {}
    for k, v in (await info(conn, "commandstats")).items():
        f = dict(x.split("=") for x in v.split(","))
        out[k.removeprefix("cmdstat_")] = (int(f["calls"]), float(f["usec"]))
    return out


def where(costs: list[Cost], top: int = 8) -> str:
    """The commands Redis spent the most time in per job, medians over the runs."""
    names = {k for c in costs for k in c.commands}
    rows = []
    for k in names:
        calls = median([c.commands.get(k, (0.0, 0.0))[0] for c in costs])
        us = median([c.commands.get(k, (0.0, 0.0))[1] for c in costs])
        rows.append((us, calls, k))
    rows.sort(reverse=True)
    script = sum(us for us, _, k in rows if k in ("evalsha", "eval"))
    inner = sum(us for us, _, k in rows if k not in OUTSIDE)
    return (
        ", ".join(f"{k} {calls:.2f} calls {us:.2f} µs" for us, calls, k in rows[:top])
        + f"; the scripts' own Lua (EVALSHA's time less the commands it ran): "
        f"{script - inner:.2f} µs"
    )


#: Commands not run by the scripts (our polls and probes, the scripts themselves).
OUTSIDE = {"evalsha", "eval", "info", "config|resetstat", "hget", "hlen", "ping", "script|load"}


SLICE = 2.0
"""s: each side's turn in :func:`cost_runs` (the two sides take turns)."""


@dataclass
class _Side:
    """What one side of :func:`cost_runs` has done so far."""

    ns: str
    keys: Keys
    client: mesh.Client
    jobs: int  # queued at the start
    enqueue: float  # s
    done: int = 0
    active: float = 0.0  # s of its turns, each from its resume to its last job's end
    redis_cpu: float = 0.0  # s of Redis CPU in its turns
    commands: dict[str, tuple[float, float]] = field(default_factory=dict)


async def cost_runs(
    url: str, conn: Connection, sides: dict[str, list[tuple[str, int]]], sizes: Sizes
) -> dict[str, Cost]:
    """Serve each side's groups (name -> [(group, jobs), ...]) with a worker
    process of its own, in turns of :data:`SLICE` seconds: one side's queue
    is resumed while the other's is paused, then paused again and its running
    jobs waited for, and so on until both are empty. The machine's speed
    drifts by a fifth over tens of seconds here (other tenants of the host),
    and a side served after the other whole took all of that drift into the
    ratio; in turns of two seconds both see it alike. Each side's rate is its
    jobs over the sum of its turns; its Redis CPU and command times are
    summed over its turns; its worker's CPU is over the whole run (an idle
    worker spends next to none)."""
    await conn.execute("FLUSHALL")
    run: dict[str, _Side] = {}
    async with AsyncExitStack() as stack:
        for key, groups in sides.items():
            ns = "gc" + secrets.token_hex(3)
            client = await stack.enter_async_context(mesh.open_client(url, namespace=ns))
            await client.pause(QUEUE)  # (before the first job: nothing starts early)
            t = trio.current_time()
            await fill(client, groups)
            n = sum(c for _, c in groups)
            run[key] = _Side(ns, Keys(ns), client, n, trio.current_time() - t)
            if (queued := await pending(conn, run[key].keys)) != n:
                raise RuntimeError(f"cost: {queued} jobs queued, not {n}")
        async with children() as kids:
            workers = {}
            for key, side in run.items():
                argv = mesh_child("throughput", "--url", url, "--ns", side.ns, "--queue", QUEUE,
                                  "--concurrency", str(sizes.concurrency))  # fmt: skip
                workers[key] = await kids.spawn(f"groups cost worker ({key})", argv)
            for w in workers.values():
                await w.expect("ready", 60)
            for w in workers.values():
                await w.send("go")
            await conn.execute("CONFIG", "RESETSTAT")
            wcpu0 = {key: cpu_seconds(w.pid) for key, w in workers.items()}
            while any(side.done < side.jobs for side in run.values()):
                for side in run.values():
                    if side.done < side.jobs:
                        await _turn(conn, side)
            wcpu = {key: cpu_seconds(w.pid) - wcpu0[key] for key, w in workers.items()}
    return {
        key: Cost(
            side.jobs / side.active,
            side.redis_cpu / side.jobs * 1e6,
            wcpu[key] / side.jobs * 1e6,
            side.enqueue,
            {k: (c / side.jobs, us / side.jobs) for k, (c, us) in side.commands.items()},
        )
        for key, side in run.items()
    }


async def _turn(conn: Connection, side: _Side) -> None:
    """One turn of ``side``: resume its queue, let it run for :data:`SLICE`
    seconds (less if it empties), pause it, and wait for its running jobs."""
    left0 = await pending(conn, side.keys)
    stats0, cpu0 = await command_costs(conn), await redis_cpu(conn)
    t0 = trio.current_time()
    await side.client.resume(QUEUE)

    async def empty() -> bool:
        return await pending(conn, side.keys) == 0

    with trio.move_on_at(t0 + SLICE):
        await poll_until(empty, interval=POLL * 5, within=SLICE + 1)
    await side.client.pause(QUEUE)

    async def idle() -> bool:
        return int(await conn.execute("HLEN", side.keys.procs(QUEUE))) == 0

    await poll_until(idle, interval=POLL, within=60)
    side.active += trio.current_time() - t0
    side.redis_cpu += await redis_cpu(conn) - cpu0
    side.done += left0 - await pending(conn, side.keys)
    for k, (c, us) in (await command_costs(conn)).items():
        c0, us0 = stats0.get(k, (0, 0.0))
        was = side.commands.get(k, (0.0, 0.0))
        side.commands[k] = (was[0] + c - c0, was[1] + us - us0)


# --- c. the ungrouped path against the tree before groups --------------------------


@contextmanager
def base_tree(ctx: Context) -> Iterator[tuple[str, str]]:
    """The base tree of the A/B and what it is: ``--base`` if given, else
    :data:`BASE_REV` extracted from this checkout's git (``git archive``)
    into a scratch folder removed afterwards."""
    if ctx.base:
        yield ctx.base, ctx.base
        return
    with tempfile.TemporaryDirectory(prefix="bench-base-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", BASE_REV, "mesh", "protocol", "bench"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield tmp, f"{BASE_REV} (git archive)"


# --- the section --------------------------------------------------------------------


async def suite(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    if ctx.groups_jobs:
        sizes = replace(sizes, cost_jobs=ctx.groups_jobs)
    many = [(f"t{i}", sizes.per_group) for i in range(sizes.cost_jobs // sizes.per_group)]
    one = [("all", sizes.cost_jobs)]
    section = Section(
        "groups",
        "Groups",
        METHOD.format(s=sizes, groups=len(many), poll=POLL * 1000, base=BASE_REV, slice=SLICE),
        runs=ctx.runs,
    )
    fair: list[Fairness] = []
    costs: dict[str, list[Cost]] = {"many": [], "one": []}
    ab: dict[str, list[throughput.RunResult | None]] = {"here": [], "base": []}
    tp = throughput.Sizes(tasks=sizes.ab_tasks, concurrency=sizes.concurrency)
    with base_tree(ctx) as (tree, what), run_redis_server() as server:
        here = throughput.Contender("trio-mesh, this tree", "mesh")
        base = throughput.Contender("trio-mesh, base tree", "mesh", tree=tree)
        async with open_connection(server.url) as conn:
            for r in range(ctx.runs):
                ctx.log(f"groups: run {r + 1}/{ctx.runs}: fairness")
                fair.append(await fairness_run(server.url, conn, sizes))
                ctx.log(f"  {fair[-1]}")
                ctx.log(f"groups: run {r + 1}/{ctx.runs}: cost, many and one in turns")
                order = [("many", many), ("one", one)]
                sides = dict(order if r % 2 == 0 else order[::-1])
                for key, cost in (await cost_runs(server.url, conn, sides, sizes)).items():
                    costs[key].append(cost)
                    ctx.log(f"  {key}: {cost}")
                pair = [("here", here), ("base", base)]
                for i in range(sizes.ab_rounds):
                    for key, c in pair if (r + i) % 2 == 0 else pair[::-1]:
                        ctx.log(f"groups: run {r + 1}/{ctx.runs}: ungrouped {i + 1}, {key}")
                        ab[key].append(await throughput.one_run(ctx, server.url, conn, c, tp))
    figures(section, sizes, fair, costs, ab)
    section.notes.append(f"The A/B's base tree: {what}.")
    return section


def figures(
    section: Section,
    sizes: Sizes,
    fair: list[Fairness],
    costs: dict[str, list[Cost]],
    ab: dict[str, list[throughput.RunResult | None]],
) -> None:
    s = sizes
    pct = Target("<", 5.0, "< 5%")
    f = section.figures
    f.append(Figure(f"fairness: the big group's jobs done when the small groups were "
                    f"(of {s.big:,})", "jobs", [x.big_done for x in fair]))  # fmt: skip
    f.append(Figure("fairness: the same, share of the big group", "%",
                    [100 * x.big_done / s.big for x in fair], target=pct))  # fmt: skip
    f.append(Figure(f"fairness: Jain's index over the {s.small + 1} groups' jobs done "
                    "while all were backlogged", "", [x.jain for x in fair],
                    target=Target(">=", 0.95, ">= 0.95"),
                    note="the window: first job done to the first small group's last"))  # fmt: skip
    f.append(Figure("fairness: the window", "s", [x.window for x in fair]))
    f.append(Figure("fairness: jobs done in the window", "jobs", [x.window_jobs for x in fair]))
    groups = s.cost_jobs // s.per_group
    for key, label in (("many", f"{groups:,} groups x {s.per_group}"),
                       ("one", f"1 group x {s.cost_jobs:,}")):  # fmt: skip
        cs = costs[key]
        f.append(Figure(f"cost, {label}: jobs/s", "jobs/s", [c.rate for c in cs]))
        f.append(Figure(f"cost, {label}: Redis CPU per job", "µs", [c.redis_us for c in cs]))
        f.append(Figure(f"cost, {label}: worker CPU per job", "µs", [c.worker_us for c in cs]))
        f.append(Figure(f"cost, {label}: enqueue (not timed in the rate)", "s",
                        [c.enqueue for c in cs]))  # fmt: skip
        section.notes.append(f"Cost, {label}: Redis time per job by command (INFO "
                             f"commandstats, inside scripts too; our polls included): "
                             f"{where(cs)}.")  # fmt: skip
    f.append(Figure(f"cost: {groups:,} groups / 1 group, jobs/s, same run", "x",
                    [a.rate / b.rate for a, b in zip(costs["many"], costs["one"], strict=True)],
                    target=Target(">=", 0.8, ">= 0.8x")))  # fmt: skip
    f.append(Figure(f"cost: {groups:,} groups / 1 group, Redis CPU per job", "x",
                    [a.redis_us / b.redis_us
                     for a, b in zip(costs["many"], costs["one"], strict=True)]))  # fmt: skip
    pairs = list(zip(ab["here"], ab["base"], strict=True))
    f.append(Figure(f"ungrouped, {s.ab_tasks:,} no-op tasks, 1 worker process, concurrency "
                    f"{s.concurrency}: this tree / the base tree", "x",
                    [b.processing / a.processing if a and b else math.nan for a, b in pairs],
                    target=Target(">=", 0.97, ">= 0.97x")))  # fmt: skip
    for what, attr in (("Redis CPU", "redis_cpu"), ("worker CPU", "worker_cpu")):
        f.append(Figure(f"ungrouped: {what} per task, this tree / the base tree", "x",
                        [getattr(a, attr) / getattr(b, attr)
                         if a and b and getattr(b, attr) else math.nan
                         for a, b in pairs]))  # fmt: skip
    f.append(Figure("ungrouped, this tree: tasks/s", "tasks/s",
                    [s.ab_tasks / a.processing if a else math.nan for a, _ in pairs]))  # fmt: skip


METHOD = """
One redis-server; per run, three parts in this order.

**Fairness.** {s.big:,} jobs are enqueued into one group (`big`), then
{s.small} groups of {s.small_jobs} jobs each; then {s.workers} worker processes
(`bench/children/mesh_child.py groups-work`) serve the queue at concurrency
{s.concurrency} each with a no-op handler that notes when it ends
(`time.monotonic_ns()`, one clock for the machine) and its job's group. Once
the small groups are empty and their jobs done, the notes are gathered.
"The big group's jobs done when the small groups were" counts the big group's
jobs that ended no later than the last small group's last job. Jain's index
is (Σx)² / (n·Σx²) over the {s.small} + 1 groups, x = a group's jobs ended in
the window where every group was backlogged: from the first job's end to
the first small group's last job's end (jobs ended strictly before it).

**Cost.** {s.cost_jobs:,} jobs in {groups:,} groups of {s.per_group}
(enqueued by 32 `enqueue_many(group=...)` calls in flight at once) in one
namespace, and the same number of jobs in one group (calls of 50,000) in
another, each queue paused; one worker process per namespace at concurrency
{s.concurrency} with a no-op handler (the throughput suite's child). Then
the two sides **take turns** of {slice:g} s until both are empty (which
goes first alternates from run to run): a turn resumes the side's queue,
pauses it after {slice:g} s (or once it is empty), and waits until its
running jobs are done (polled every {poll:g} ms). Each side's jobs/s is its
jobs over the sum of its turns; Redis CPU per job is the server's user +
system time over its turns divided by its jobs; worker CPU from /proc over
the whole run (a paused side's worker spends next to none). In turns, a
drift of the machine's speed falls on both sides alike: on this VM the
speed drifts by a fifth over tens of seconds, and when each side ran whole,
one after the other, the ratio of one run swung from 0.63 to 0.93.

**Ungrouped, against the tree before groups.** The throughput suite's run
(`throughput.one_run`: {s.ab_tasks:,} ungrouped no-op tasks, one worker
process at concurrency {s.concurrency}) for this tree and for the base tree
(`--base TREE`, else {base} extracted with `git archive`), {s.ab_rounds} pairs
per run, alternating which goes first; the ratio is the base's processing
time over this tree's, one value per pair (so these figures have
{s.ab_rounds} values per run).
"""
