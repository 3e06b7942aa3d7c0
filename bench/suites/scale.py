"""Scale: 1,000 workers (250 ``open_worker``s in each of 4 OS processes)
holding 10,000 persistent tasks. Idle Redis CPU, heartbeat and reap cost,
the Redis time to recycle 1, 10 and 100 dead workers, and the cost of a
claim from a queue of 10 and of 1,000,000 tasks. The idle fleets
(:mod:`bench.suites.fleet`) use this module's worker groups and sizes.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass, field

import trio

import mesh
from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh._scripts import load_scripts
from mesh._supervisor import Reaper
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import (
    Child,
    Children,
    SlowlogWindow,
    children,
    chunks,
    command_stats,
    cpu_seconds,
    info,
    median,
    mesh_child,
    percentile,
    poll_until,
    redis_cpu,
)

QUEUE = "devices"


@dataclass(frozen=True)
class Sizes:
    processes: int = 4
    per_process: int = 250
    concurrency: int = 10  # x workers = how many persistent tasks
    ttl: float = 10.0
    idle_window: float = 12.0  # a whole reaper period (ttl x 1..1.2)
    slowlog_window: float = 12.0
    recycle: tuple[int, ...] = (1, 10, 100)
    herd: int = 100  # dead workers for the natural (expiry-driven) reap
    long_queue: int = 1_000_000
    claim_samples: int = 200
    # idle fleets (TTL 3 s): solo workers and fleets of the same size,
    # alternating, then the big fleet
    fleet_ttl: float = 3.0
    compare_processes: int = 4
    compare_per_process: int = 250
    big_processes: int = 10
    big_per_process: int = 1_000
    fleet_window: float = 10.0
    fleet_slowlog: float = 3.0


FULL = Sizes()
QUICK = Sizes(
    processes=2,
    per_process=100,
    idle_window=3.0,
    slowlog_window=3.0,
    recycle=(1, 10),
    herd=10,
    long_queue=100_000,
    claim_samples=50,
    compare_processes=2,
    compare_per_process=50,
    big_processes=2,
    big_per_process=100,
    fleet_window=2.0,
    fleet_slowlog=1.0,
)


@dataclass
class Run:
    redis_cpu: float = math.nan  # % of one core
    worker_cpu: float = math.nan  # % of one core, all worker processes
    script: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # name -> (calls/s, mean µs, p99 µs)
    all_us_per_s: float = math.nan
    idle_scripts: float = math.nan  # script calls per second while idle
    idle_script_us: float = math.nan  # mean Redis time per call (commandstats)
    recycle_us: dict[int, float] = field(default_factory=dict)  # N -> Redis µs
    recycle_calls: dict[int, int] = field(default_factory=dict)  # N -> recycle.lua calls
    recycle_wall: dict[int, float] = field(default_factory=dict)  # N -> s (one reaper pass)
    herd_wall: float = math.nan  # s from SIGKILL to all tasks back (includes TTL)
    herd_ttl: float = math.nan
    herd_us: dict[str, float] = field(default_factory=dict)  # reaper script -> total µs
    herd_calls: dict[str, int] = field(default_factory=dict)
    isolated_us: dict[int, float] = field(default_factory=dict)  # idle servers -> Redis µs
    wake_calls: float = math.nan  # claim calls after one enqueue into an idle mesh
    wake_us: float = math.nan  # their Redis time
    wake_latency: float = math.nan  # s from enqueue to the task held
    due_calls: float = math.nan  # claim calls when a retry of an idle mesh is due
    due_us: float = math.nan
    claim_us: dict[tuple[int, int], float] = field(default_factory=dict)  # (queue, n) -> µs
    claim_wall: dict[tuple[int, int], float] = field(default_factory=dict)
    idle: dict[str, Idle] = field(default_factory=dict)  # "solo", "fleet", "big" -> figures


@dataclass
class Idle:
    """An idle mesh at the fleet TTL: what it costs Redis."""

    workers: int = 0
    redis_cpu: float = math.nan  # % of one core
    worker_cpu: float = math.nan  # % of one core, all worker processes
    renewals: float = math.nan  # leases renewed per second (heartbeats confirmed)
    commands: float = math.nan  # commands run per second, scripts' own included (commandstats)
    redis_us_per_worker: float = math.nan  # µs of Redis CPU per worker per second
    heartbeat_calls: float = math.nan  # heartbeat.lua calls per second (SLOWLOG)
    heartbeat_us: float = math.nan  # SLOWLOG µs of heartbeat.lua per renewed lease
    other_us: float = math.nan  # SLOWLOG µs per second of everything else


def sha_names() -> dict[bytes, str]:
    return {s.sha.encode(): name for name, s in load_scripts().items()}


def by_script(entries: list[tuple[int, list[bytes]]]) -> dict[str, list[int]]:
    names = sha_names()
    out: dict[str, list[int]] = {}
    for us, args in entries:
        if len(args) >= 2 and args[0].upper() == b"EVALSHA":
            name = names.get(args[1], "other script")
        else:
            name = args[0].decode(errors="replace").upper() if args else "?"
        out.setdefault(name, []).append(us)
    return out


async def spawn_group(
    kids: Children,
    url: str,
    ns: str,
    n: int,
    ttl: float,
    concurrency: int,
    name: str,
    *,
    fleet: bool = False,
) -> tuple[Child, list[str]]:
    child = await kids.spawn(
        name,
        mesh_child(
            "hold", "--url", url, "--ns", ns, "--queue", QUEUE, "--workers", str(n),
            "--ttl", str(ttl), "--concurrency", str(concurrency),
            *(["--fleet"] if fleet else []),
        ),
    )  # fmt: skip
    ids = []
    with trio.fail_after(300):
        while True:
            line = await child.expect("", 300)
            if line == "ready":
                break
            if line.startswith("worker "):
                ids.append(line.split()[1])
    # A work nudge that arrives while a runner's first claim is in flight is
    # lost (the claim's "queue empty" reply overwrites it; see findings.md),
    # and the task would then wait for the next heartbeat: ttl/3, 200 s for
    # the 600 s leases below. Give the first claims time to come back.
    await trio.sleep(0.5)
    return child, ids


async def procs_held(conn: Connection, k: Keys) -> tuple[int, int]:
    a, b = await conn.pipeline([("HLEN", k.procs(QUEUE)), ("LLEN", k.queue(QUEUE))])
    return int(a), int(b)


async def wait_held(conn: Connection, k: Keys, held: int, queued: int, within: float) -> None:
    async def ok() -> bool:
        return await procs_held(conn, k) == (held, queued)

    await poll_until(ok, interval=0.05, within=within)


async def one_run(ctx: Context, url: str, conn: Connection, sizes: Sizes) -> Run:
    res = Run()
    await conn.execute("FLUSHALL")
    ns = "sc" + secrets.token_hex(3)
    k = Keys(ns)
    b = Binding(k)
    nworkers = sizes.processes * sizes.per_process
    ntasks = nworkers * sizes.concurrency
    async with children() as kids, mesh.open_client(url, namespace=ns) as client:
        ctx.log(f"scale: starting {nworkers:,} workers")
        groups = []
        for i in range(sizes.processes):
            groups.append(
                await spawn_group(
                    kids, url, ns, sizes.per_process, sizes.ttl, sizes.concurrency, f"group {i}"
                )
            )
        ctx.log(f"scale: ensuring {ntasks:,} persistent tasks")
        for batch in chunks([f"device-{i:06d}" for i in range(ntasks)], 1_000):
            await client.ensure_many(QUEUE, batch)
        await wait_held(conn, k, ntasks, 0, 300)
        await trio.sleep(min(sizes.ttl, 5.0))  # every worker heartbeats and reaps at least once

        # --- idle CPU ------------------------------------------------------------
        ctx.log(f"scale: idle CPU over {sizes.idle_window:g} s")
        pids = [c.pid for c, _ in groups]
        e0 = await command_stats(conn, "evalsha")
        c0, w0, t0 = await redis_cpu(conn), sum(map(cpu_seconds, pids)), trio.current_time()
        await trio.sleep(sizes.idle_window)
        c1, w1, t1 = await redis_cpu(conn), sum(map(cpu_seconds, pids)), trio.current_time()
        e1 = await command_stats(conn, "evalsha")
        res.redis_cpu = (c1 - c0) / (t1 - t0) * 100
        res.worker_cpu = (w1 - w0) / (t1 - t0) * 100
        res.idle_scripts = (e1[0] - e0[0]) / (t1 - t0)
        res.idle_script_us = (e1[1] - e0[1]) / max(1, e1[0] - e0[0])

        # --- what the idle mesh runs ------------------------------------------------
        ctx.log(f"scale: SLOWLOG of the idle mesh over {sizes.slowlog_window:g} s")
        async with SlowlogWindow(conn, max_len=200_000) as w:
            t0 = trio.current_time()
            await trio.sleep(sizes.slowlog_window)
            t1 = trio.current_time()
        span = t1 - t0
        groups_us = by_script(w.entries)
        for name, us in groups_us.items():
            res.script[name] = (len(us) / span, sum(us) / len(us), percentile(us, 99))
        res.all_us_per_s = sum(us for us, _ in w.entries) / span

        # --- recycle N dead workers, the way a reaper does ----------------------------
        for n in sizes.recycle:
            ctx.log(f"scale: recycle {n} dead workers")
            victims, ids = await spawn_group(
                kids, url, ns, n, 600.0, sizes.concurrency, f"victims {n}"
            )
            extra = [f"victim-{n}-{i:05d}" for i in range(n * sizes.concurrency)]
            await client.ensure_many(QUEUE, extra)
            await wait_held(conn, k, ntasks + len(extra), 0, 120)
            await victims.kill()
            # Their leases would run out in 600 s: end them now, all at once.
            # DEL sends no expiry event; the deadlines move into the past, so
            # the first check finds them all.
            # The window opens first: a live peer's heartbeat may see the
            # overdue deadlines and its reaper take some of them at once.
            async with SlowlogWindow(conn) as w:
                await conn.pipeline(
                    [("DEL", k.heartbeat(wid)) for wid in ids]
                    + [("ZADD", k.workers, "XX", 0, wid) for wid in ids]
                )
                t0 = trio.current_time()
                reaper = Reaper(conn, b, ttl=sizes.ttl, queues=lambda: [QUEUE])
                done = await reaper.reap_once()
                t1 = trio.current_time()
                await wait_held(conn, k, ntasks, len(extra), 30)  # peers may take some
            if done < n:
                ctx.log(f"  (peers recycled {n - done} of them)")
            calls = w.script_calls(b.scripts["recycle"].sha)
            checks = w.script_calls(b.scripts["reap_check"].sha)
            res.recycle_us[n] = sum(us for us, _ in calls + checks)
            res.recycle_calls[n] = len(calls)
            res.recycle_wall[n] = t1 - t0
            for p in extra:
                await client.cancel(QUEUE, p)
            await wait_held(conn, k, ntasks, 0, 30)

        # --- the natural path: N workers die, every peer hears the expiry -------------
        n = sizes.herd
        ttl = 1.0
        ctx.log(f"scale: {n} workers (ttl {ttl:g} s) die, peers reap them")
        victims, ids = await spawn_group(kids, url, ns, n, ttl, sizes.concurrency, f"herd {n}")
        extra = [f"herd-{i:05d}" for i in range(n * sizes.concurrency)]
        await client.ensure_many(QUEUE, extra)
        await wait_held(conn, k, ntasks + len(extra), 0, 120)
        async with SlowlogWindow(conn, max_len=1_000_000) as w:
            t0 = time.monotonic()
            await victims.kill()

            async def recycled() -> bool:
                # every victim gone, and everything it held back in the mesh
                # (a survivor with room may already have claimed some of it).
                # A task whose earlier owner died too (a victim that missed its
                # lease under load and was recycled once already) waits out a
                # backoff in the delayed set, and, the survivors being full,
                # stays there: it counts as back too.
                scores = await conn.pipeline([("ZSCORE", k.workers, i) for i in ids])
                held, queued = await procs_held(conn, k)
                delayed, reserved = await conn.pipeline(
                    [("ZCARD", k.delayed(QUEUE)), ("HLEN", k.reserved(QUEUE))]
                )
                back = held + queued + int(delayed) + int(reserved)
                return all(x is None for x in scores) and back == ntasks + len(extra)

            await poll_until(recycled, interval=0.05, within=60)
            res.herd_wall = time.monotonic() - t0
            await trio.sleep(1.0)  # reapers that woke late
        res.herd_ttl = ttl
        for name, us in by_script(w.entries).items():
            if name in ("reap_check", "recycle", "claim"):
                res.herd_us[name] = sum(us)
                res.herd_calls[name] = len(us)
        for p in extra:
            await client.cancel(QUEUE, p)

        # --- claim from a short and from a long queue (the workers are still there) ----
        await claims(ctx, conn, sizes, res)
    # --- one task enqueued into a mesh of idle workers ------------------------------
    ctx.log(f"scale: one task enqueued, {nworkers:,} idle workers")
    await wake_idle(url, conn, sizes, res)
    # --- recycle with no other load, with and without idle servers to wake -------
    n = max(sizes.recycle)
    for idle in (0, nworkers):
        ctx.log(f"scale: recycle {n} dead workers on a quiet server, {idle} idle servers")
        res.isolated_us[idle] = await recycle_quiet(url, conn, n, sizes.concurrency, idle)
    return res


async def all_command_stats(conn: Connection) -> tuple[int, int]:
    """(calls, µs) so far of every command, from ``INFO commandstats``."""
    calls = usec = 0
    for k, v in (await info(conn, "commandstats")).items():
        if k.startswith("cmdstat_"):
            fields = dict(kv.split("=", 1) for kv in v.split(","))
            calls += int(fields["calls"])
            usec += int(fields["usec"])
    return calls, usec


async def beats(groups: list[Child]) -> int:
    total = 0
    for child in groups:
        await child.send("beats")
        total += int((await child.expect("beats", 30)).split()[1])
    return total


async def idle_mesh(
    ctx: Context,
    url: str,
    conn: Connection,
    procs: int,
    per: int,
    fleet: bool,
    sizes: Sizes,
    *,
    tasks: bool = True,
) -> Idle:
    """``procs`` OS processes of ``per`` workers each (``open_worker``s, or
    one fleet per process), TTL ``sizes.fleet_ttl``, serving one queue, with
    (``tasks``) one persistent task each, all running, or none (each worker
    then waits in the queue's idle set); then the idle cost over
    ``sizes.fleet_window``."""
    await conn.execute("FLUSHALL")
    ns = "fl" + secrets.token_hex(3)
    k = Keys(ns)
    n = procs * per
    res = Idle(workers=n)
    what = "fleets" if fleet else "open_workers"
    async with children() as kids, mesh.open_client(url, namespace=ns) as client:
        ctx.log(f"scale: {n:,} idle workers ({procs} x {per} {what}), ttl {sizes.fleet_ttl:g} s")
        groups = []
        for i in range(procs):
            child, _ = await spawn_group(
                kids, url, ns, per, sizes.fleet_ttl, 1, f"{what} {i}", fleet=fleet
            )
            groups.append(child)
        # A few hundred at a time: ten thousand claims and handler starts at
        # once would starve the worker processes (2 cores) past R, and they
        # would fence themselves (see findings.md).
        held = 0
        for batch in chunks([f"device-{i:06d}" for i in range(n if tasks else 0)], 500):
            await client.ensure_many(QUEUE, batch)
            held += len(batch)
            await wait_held(conn, k, held, 0, 300)
        await trio.sleep(sizes.fleet_ttl)  # settle: every worker renews and reaps
        pids = [c.pid for c in groups]
        b0, e0 = await beats(groups), await all_command_stats(conn)
        c0, w0, t0 = await redis_cpu(conn), sum(map(cpu_seconds, pids)), trio.current_time()
        await trio.sleep(sizes.fleet_window)
        c1, w1, t1 = await redis_cpu(conn), sum(map(cpu_seconds, pids)), trio.current_time()
        b1, e1 = await beats(groups), await all_command_stats(conn)
        span = t1 - t0
        res.redis_cpu = (c1 - c0) / span * 100
        res.worker_cpu = (w1 - w0) / span * 100
        res.renewals = (b1 - b0) / span
        res.commands = (e1[0] - e0[0]) / span
        res.redis_us_per_worker = (c1 - c0) / span / n * 1e6
        async with SlowlogWindow(conn, max_len=1_000_000) as w:
            b0, t0 = await beats(groups), trio.current_time()
            await trio.sleep(sizes.fleet_slowlog)
            b1, t1 = await beats(groups), trio.current_time()
        sha = Binding(k).scripts["heartbeat"].sha
        hb = [us for us, _ in w.script_calls(sha)]
        res.heartbeat_calls = len(hb) / (t1 - t0)
        res.heartbeat_us = sum(hb) / max(1, b1 - b0)
        res.other_us = (sum(us for us, _ in w.entries) - sum(hb)) / (t1 - t0)
        ctx.log(
            f"  Redis CPU {res.redis_cpu:.2f}% of a core, {res.renewals:,.0f} renewals/s in "
            f"{res.heartbeat_calls:,.0f} calls/s, {res.heartbeat_us:.1f} µs per renewal"
        )
    return res


async def idle_fleets(ctx: Context, url: str, conn: Connection, sizes: Sizes, res: Run) -> None:
    """Solo workers and fleets of the same size, one after the other (the
    same load hits both), then the big fleet."""
    p, per = sizes.compare_processes, sizes.compare_per_process
    res.idle["solo"] = await idle_mesh(ctx, url, conn, p, per, False, sizes)
    res.idle["fleet"] = await idle_mesh(ctx, url, conn, p, per, True, sizes)
    # No tasks: 10,000 claims and handler starts, even 500 at a time, starved
    # the 2 shared cores past R (every worker fenced and rejoined, in a storm).
    res.idle["big"] = await idle_mesh(
        ctx, url, conn, sizes.big_processes, sizes.big_per_process, True, sizes, tasks=False
    )


async def wake_idle(url: str, conn: Connection, sizes: Sizes, res: Run) -> None:
    """Every worker of the mesh serves a queue with a free slot and nothing
    queued; one task is enqueued, which wakes two of them (the task's server
    and a spare): count the claims and their Redis time, from the enqueue
    to one second after the task was claimed."""
    await conn.execute("FLUSHALL")
    ns = "wk" + secrets.token_hex(3)
    k = Keys(ns)
    async with children() as kids, mesh.open_client(url, namespace=ns) as client:
        for i in range(sizes.processes):
            await spawn_group(kids, url, ns, sizes.per_process, sizes.ttl, 1, f"idle {i}")
        sha = Binding(k).scripts["claim"].sha
        async with SlowlogWindow(conn) as w:
            t0 = time.monotonic()
            await client.enqueue(QUEUE, b"one")
            await wait_held(conn, k, 1, 0, 30)
            res.wake_latency = time.monotonic() - t0
            await trio.sleep(1.0)  # claims that came late
        calls = w.script_calls(sha)
        res.wake_calls = len(calls)
        res.wake_us = sum(us for us, _ in calls)
        # A retry: a task in the delayed set, due after every worker's next
        # heartbeat (each learns the due time from it).
        due_in = sizes.ttl / 3 * 1.2
        sec, usec = await conn.execute("TIME")
        due = int(sec) * 1000 + int(usec) // 1000 + int(due_in * 1000)
        async with SlowlogWindow(conn) as w:
            await conn.execute("ZADD", k.delayed(QUEUE), due, b"retry")
            await wait_held(conn, k, 2, 0, due_in + 30)
            await trio.sleep(1.0)
        calls = w.script_calls(sha)
        res.due_calls = len(calls)
        res.due_us = sum(us for us, _ in calls)


async def recycle_quiet(url: str, conn: Connection, n: int, per_worker: int, idle: int) -> float:
    """Redis time of recycling ``n`` dead workers holding ``per_worker``
    persistent processes each, with no worker processes running, while
    ``idle`` workers serve the queue with nothing to do (in its idle set),
    each with a connection subscribed to its wake channel, as a worker is.
    Returns µs."""
    await conn.execute("FLUSHALL")
    k = Keys("rq" + secrets.token_hex(3))
    b = Binding(k)
    host, port = url.removeprefix("redis://").split(":")
    streams = []
    try:
        for i in range(idle):
            wid, inc = f"idle-{i}", secrets.token_hex(8)
            await b.register(conn, wid, inc, 600_000, b"{}")
            await b.serve(conn, wid, inc, QUEUE)
            if (await b.claim(conn, wid, inc, QUEUE, 1, 0)).processes:
                raise RuntimeError(f"{wid} found a task")
            s = await trio.open_tcp_stream(host, int(port))
            streams.append(s)
            await s.send_all(b"SUBSCRIBE " + k.wake_channel(wid).encode() + b"\r\n")
        ids = []
        for i in range(n):
            wid, inc = f"dead-{i}", secrets.token_hex(8)
            await b.register(conn, wid, inc, 600_000, b"{}")
            await b.serve(conn, wid, inc, QUEUE)
            await b.ensure(conn, QUEUE, [f"q{i}-{j}".encode() for j in range(per_worker)])
            r = await b.claim(conn, wid, inc, QUEUE, per_worker, 0)
            if len(r.processes) != per_worker:
                raise RuntimeError(f"{wid} claimed {len(r.processes)}")
            ids.append(wid)
        await conn.pipeline(
            [("DEL", k.heartbeat(wid)) for wid in ids]
            + [("ZADD", k.workers, "XX", 0, wid) for wid in ids]
        )
        async with SlowlogWindow(conn) as w:
            if await Reaper(conn, b, ttl=600, queues=lambda: [QUEUE]).reap_once() != n:
                raise RuntimeError("the reaper did not recycle every dead worker")
        sha = (b.scripts["recycle"].sha, b.scripts["reap_check"].sha)
        return float(sum(us for us, _ in w.script_calls(sha[0]) + w.script_calls(sha[1])))
    finally:
        for s in streams:
            await s.aclose()


async def claims(ctx: Context, conn: Connection, sizes: Sizes, res: Run) -> None:
    """Claim cost from a queue of 10 and of ``sizes.long_queue`` tasks, in
    alternating blocks (so drift in the background load hits both alike):
    each sample claims n (1 or 10); then, outside what is measured, the
    processes are finished and as many tasks enqueued again, so the lengths
    stay put."""
    k = Keys("cl" + secrets.token_hex(3))
    b = Binding(k)
    inc = secrets.token_hex(8)
    wid = "claim-probe"
    await b.register(conn, wid, inc, 3_600_000, b"{}")
    lengths = {"short": 10, "long": sizes.long_queue}
    for q, length in lengths.items():
        await b.serve(conn, wid, inc, q)
        for batch in chunks([b"%d" % i for i in range(length)], 10_000):
            await b.enqueue(conn, q, batch)
    ctx.log(f"scale: claims from queues of 10 and {sizes.long_queue:,}")
    sha = b.scripts["claim"].sha
    blocks = 5
    for n in (1, 10):
        us: dict[str, list[int]] = {q: [] for q in lengths}
        walls: dict[str, list[float]] = {q: [] for q in lengths}
        for _ in range(blocks):
            for q in lengths:
                async with SlowlogWindow(conn) as w:
                    for _ in range(max(1, sizes.claim_samples // blocks)):
                        t0 = time.perf_counter()
                        r = await b.claim(conn, wid, inc, q, n, 0)
                        walls[q].append(time.perf_counter() - t0)
                        await b.finish(conn, wid, inc, q, [p.id for p in r.processes])
                        await b.enqueue(conn, q, [p.task for p in r.processes])
                us[q] += [u for u, _ in w.script_calls(sha)]
        for q, length in lengths.items():
            res.claim_us[(length, n)] = median(us[q])
            res.claim_wall[(length, n)] = median(walls[q]) * 1e6
    for q, length in lengths.items():
        if int(await conn.execute("LLEN", k.queue(q))) != length:
            raise RuntimeError("a queue of the claim benchmark changed length")
        await conn.execute("DEL", k.queue(q))


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    nworkers = sizes.processes * sizes.per_process
    ntasks = nworkers * sizes.concurrency
    section = Section(
        "scale",
        "Scale",
        METHOD.format(
            w=nworkers,
            t=ntasks,
            p=sizes.processes,
            per=sizes.per_process,
            ttl=sizes.ttl,
            idle=sizes.idle_window,
            slow=sizes.slowlog_window,
            herd=sizes.herd,
            nrec=max(sizes.recycle),
            samples=sizes.claim_samples,
            block=max(1, sizes.claim_samples // 5),
            long=sizes.long_queue,
        ),
        runs=ctx.runs,
    )
    runs: list[Run] = []
    # enough clients: two connections per worker
    with run_redis_server(["--maxclients", str(max(10_000, 3 * nworkers))]) as server:
        async with open_connection(server.url) as conn:
            for r in range(ctx.runs):
                ctx.log(f"scale: run {r + 1}/{ctx.runs}")
                runs.append(await one_run(ctx, server.url, conn, sizes))
                x = runs[-1]
                ctx.log(
                    f"  idle Redis CPU {x.redis_cpu:.2f}%, recycle "
                    + ", ".join(f"{n}: {us / 1000:.2f} ms" for n, us in x.recycle_us.items())
                )
    f = section.figures
    f.append(
        Figure(
            f"idle Redis CPU, {nworkers:,} workers",
            "% of a core",
            [x.redis_cpu for x in runs],
            target=Target("<", 5, "< 5%"),
        )
    )
    f.append(
        Figure(
            f"idle CPU of the {sizes.processes} worker processes",
            "% of a core",
            [x.worker_cpu for x in runs],
        )
    )
    for name in ("heartbeat", "reap_check"):
        f.append(
            Figure(
                f"{name}: calls per second",
                "/s",
                [x.script.get(name, (math.nan,) * 3)[0] for x in runs],
            )
        )
        f.append(
            Figure(
                f"{name}: Redis time per call, mean",
                "µs",
                [x.script.get(name, (math.nan,) * 3)[1] for x in runs],
            )
        )
        f.append(
            Figure(
                f"{name}: Redis time per call, p99",
                "µs",
                [x.script.get(name, (math.nan,) * 3)[2] for x in runs],
            )
        )
    f.append(
        Figure(
            "idle: script calls per second, all scripts",
            "/s",
            [x.idle_scripts for x in runs],
            note="INFO commandstats over the idle-CPU window (no SLOWLOG)",
        )
    )
    f.append(
        Figure(
            "idle: Redis time per script call, mean, all scripts",
            "µs",
            [x.idle_script_us for x in runs],
            note="INFO commandstats over the idle-CPU window (no SLOWLOG)",
        )
    )
    f.append(
        Figure(
            "idle: Redis time of all commands",
            "ms/s",
            [x.all_us_per_s / 1000 for x in runs],
            note="command execution only, from SLOWLOG",
        )
    )
    for n in sizes.recycle:
        f.append(
            Figure(
                f"recycle {n} dead worker{'s' if n > 1 else ''} ({n * sizes.concurrency:,} "
                "processes): Redis time",
                "ms",
                [x.recycle_us.get(n, math.nan) / 1000 for x in runs],
                target=Target("<", 50, "< 50 ms") if n == 100 else None,
                note="reap_check + recycle, all callers",
            )
        )
        f.append(
            Figure(
                f"recycle {n} dead worker{'s' if n > 1 else ''}: recycle.lua calls",
                "calls",
                [float(x.recycle_calls.get(n, 0)) for x in runs],
            )
        )
        f.append(
            Figure(
                f"recycle {n} dead worker{'s' if n > 1 else ''}: wall time of the reaper's pass",
                "ms",
                [x.recycle_wall.get(n, math.nan) * 1000 for x in runs],
            )
        )
    n = max(sizes.recycle)
    for subs in (0, nworkers):
        f.append(
            Figure(
                f"recycle {n} dead workers, quiet server, {subs:,} idle servers to wake: "
                "Redis time",
                "ms",
                [x.isolated_us.get(subs, math.nan) / 1000 for x in runs],
            )
        )
    f.append(
        Figure(
            f"{sizes.herd} workers SIGKILLed (ttl 1 s): until every task is back in the queue",
            "s",
            [x.herd_wall for x in runs],
        )
    )
    for name in ("reap_check", "recycle", "claim"):
        f.append(
            Figure(
                f"{sizes.herd} workers SIGKILLed: {name} calls by all peers",
                "calls",
                [float(x.herd_calls.get(name, 0)) for x in runs],
            )
        )
        f.append(
            Figure(
                f"{sizes.herd} workers SIGKILLed: {name} Redis time, all peers",
                "ms",
                [x.herd_us.get(name, 0) / 1000 for x in runs],
            )
        )
    enqueued = f"one task enqueued, {nworkers:,} idle workers"
    due = f"a retry comes due, {nworkers - 1:,} idle workers"
    for what, calls, us, note in (
        (
            enqueued,
            [x.wake_calls for x in runs],
            [x.wake_us for x in runs],
            "one per ready task and a spare (protocol 2: every idle runner claimed)",
        ),
        (
            due,
            [x.due_calls for x in runs],
            [x.due_us for x in runs],
            "about 3 act on the due time; the others learn at a heartbeat",
        ),
    ):
        f.append(Figure(f"{what}: claim calls", "calls", calls, note=note))
        f.append(Figure(f"{what}: claim Redis time", "ms", [u / 1000 for u in us]))
        if what == enqueued:
            latency = [x.wake_latency * 1000 for x in runs]
            f.append(Figure(f"{what}: until a worker holds it", "ms", latency))
    for n in (1, 10):
        short = [x.claim_us.get((10, n), math.nan) for x in runs]
        long = [x.claim_us.get((sizes.long_queue, n), math.nan) for x in runs]
        f.append(Figure(f"claim {n} from a queue of 10: Redis time, median", "µs", short))
        f.append(
            Figure(
                f"claim {n} from a queue of {sizes.long_queue:,}: Redis time, median", "µs", long
            )
        )
        f.append(
            Figure(
                f"claim {n}: queue of {sizes.long_queue:,} / queue of 10",
                "x",
                [a / b for a, b in zip(long, short, strict=True)],
                target=Target("<", 1.25, "the same (< 1.25x)"),
            )
        )
        f.append(
            Figure(
                f"claim {n} from a queue of {sizes.long_queue:,}: client wall time, median",
                "µs",
                [x.claim_wall.get((sizes.long_queue, n), math.nan) for x in runs],
            )
        )
    return section


METHOD = """
{p} worker OS processes run {per} `open_worker`s each ({w:,} workers, ttl {ttl:g} s,
so heartbeats every {ttl:g}/3 s, concurrency 10 each) and hold {t:,} persistent
tasks whose handlers sleep. Once every task runs, and after a settling pause:

- **Idle CPU**: `INFO cpu` `used_cpu_user + used_cpu_sys` of redis-server over
  {idle:g} s (and the worker processes' user + system time from `/proc`), and
  the calls and Redis time of every script (`INFO commandstats`, EVALSHA) in
  that window.
- **Heartbeat and reap cost**: then, for {slow:g} s, `SLOWLOG` with a threshold of
  0 µs records every command with the server's own execution time (no network,
  no queueing); EVALSHA calls are attributed to scripts by their SHA. SLOWLOG is
  off during the CPU window, since recording every command costs CPU itself:
  with it on, Redis also writes an entry for every command a script runs, and
  the script's time includes that (compare the mean per script call of both
  windows). "All commands" counts the commands clients sent (a script's
  commands are inside its time).
- **Recycle N dead workers** (N = 1, 10, 100): a further OS process starts N
  workers (lease 600 s) which claim 10 new persistent tasks each; the process is
  SIGKILLed, their lease keys DELeted (no expiry event) and their deadlines
  moved into the past, all at once; then the parent runs one pass of a
  `Reaper` (the worker's own supervisor: `reap_check.lua` for up to 16 dead
  workers, `recycle.lua` for those 16 in one call, until none is left). The
  Redis time (a little high: SLOWLOG, see above) is the sum of the SLOWLOG
  durations of every `reap_check.lua` and `recycle.lua` call in the window,
  whoever made it (a live peer's periodic
  check may take some of the dead workers; the window lasts until every task is
  back). Wall time is the reaper's pass, round trips included.
- **The same on a quiet server**: after the worker processes are gone, the
  recycle of {nrec} dead workers (10 processes each) is measured again with no
  other load, once with no other server of the queue and once with {w:,} idle
  servers (registered, in the queue's idle set, each with a connection
  subscribed to its wake channel): each `recycle.lua` call wakes up to one idle
  server per task it put back, and one more, with a PUBLISH each.
- **The natural path**: {herd} workers with a 1 s lease and 10 tasks each are
  SIGKILLed; every one of the {w:,} peers receives each lease key's expiry
  event; about three act on each (see the supervisor's design in
  `mesh/_supervisor.py`), and the reap lease gives each dead worker to one
  `recycle.lua`. Reported: the
  time from SIGKILL until every task is back in the queue (the lease has to run
  out first), and the calls and Redis time of both scripts, summed over all
  peers, from SIGKILL to one second after the last task came back; and of
  `claim.lua` (these peers are full, so none is idle and none is woken: the
  tasks stay queued).
- **One task into an idle mesh**: after those workers are gone, {w:,} new ones
  (same processes and lease) serve the queue with concurrency 1 and nothing
  queued; one task is enqueued. Reported: the `claim.lua` calls and their Redis
  time from the enqueue until one second after a worker holds it (the enqueue
  wakes two idle servers: one per task and a spare; under protocol 2 every
  runner with a free slot claimed), and the time until it is held. Then a
  task is put in the delayed set (a retry), due 1.2 H later so that every
  worker learns its due time from a heartbeat: the `claim.lua` calls until one
  second after it is held.
- **Claim**: in another namespace a probe worker claims from a queue of 10 and
  of {long:,} one-shot tasks ({samples} claims of 1 and of 10 tasks from each,
  in alternating blocks of {block}; after each claim the processes are finished
  and as many tasks enqueued again, so the lengths stay put). Reported: the
  median SLOWLOG duration of `claim.lua`, and the median wall time of
  `Binding.claim` on a loopback connection.
"""
