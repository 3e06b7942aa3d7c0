"""Throughput: N no-op one-shot tasks, enqueue time and processing time, one
worker OS process with concurrency 10 (the shape of SAQ's own benchmark), for
trio-mesh, SAQ, arq and streaQ on the same redis-server; and trio-mesh with 2
worker processes.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from .._context import PEER_CHILD, Context
from .._report import Figure, Section, Target, num
from .._util import (
    children,
    cpu_seconds,
    info,
    machine_ticks,
    median,
    mesh_child,
    poll_until,
    redis_cpu,
)

QUEUE = "bench"
POLL = 0.002


@dataclass(frozen=True)
class Sizes:
    tasks: int = 20_000
    concurrency: int = 10
    high: int = 100  # the second concurrency of trio-mesh and BullMQ (0: none)
    peers: bool = True  # SAQ, arq and streaQ
    worqr: bool = True
    bullmq: bool = True
    loop: bool = True  # the limit: a bare loop with trio-mesh's batching
    spin: int = 1_000_000  # rounds of each CPU-bound process of machine_scaling
    spins: int = 3  # machine_scaling: how many times 1 alone and 2 at once, alternating


FULL = Sizes()
QUICK = Sizes(tasks=2_000, spin=200_000, spins=1)


@dataclass(frozen=True)
class Contender:
    label: str
    lib: str  # "mesh", "loop" (the bare loop) or a peer
    processes: int = 1
    concurrency: int = 0  # 0: the run's (Sizes.concurrency)
    extra: tuple[str, ...] = ()  # more arguments of its worker (trio-mesh: e.g. --loop)
    batch: int = 0  # trio-mesh: a batch handler of up to this many processes per call
    prefetch: int = -1  # trio-mesh: processes claimed beyond the concurrency (-1: the default)
    tree: str = ""  # trio-mesh: run the children of this source tree (--base)


MESH1 = "trio-mesh, 1 worker process"
#: trio-mesh with pipelining off (prefetch=0): one claim in flight at a time
SERIAL = "prefetch 0 (serial round trips)"
#: trio-mesh at the tree given with ``python -m bench --base``
BASE = "base tree"
LOOP = "the limit: a bare Python loop with trio-mesh's batching"


def mesh_high(sizes: Sizes) -> str:
    return f"trio-mesh, 1 worker process, concurrency {sizes.high}"


def contenders(ctx: Context, sizes: Sizes) -> tuple[list[Contender], list[str]]:
    """The headline ones first (trio-mesh, the limit, BullMQ and Worqr at the
    run's concurrency; trio-mesh and BullMQ at the high one), then trio-mesh's
    variants, then the Python peers."""
    out = [Contender(MESH1, "mesh")]
    notes = []
    if sizes.loop:
        out.append(Contender(LOOP, "loop"))
    bullmq = None
    if sizes.bullmq:
        bullmq, why = ctx.bullmq()
        if bullmq is None:
            notes.append(why)
        else:
            v = bullmq.version.split()[0]
            out.append(Contender(f"BullMQ {v} (Node), concurrency {sizes.concurrency}", "bullmq"))
    if sizes.worqr:
        w, why = ctx.worqr()
        if w is None:
            notes.append(why)
        else:
            out.append(Contender(f"Worqr {w.version.split()[0]} (Node)", "worqr"))
    if sizes.high:
        out.append(Contender(mesh_high(sizes), "mesh", concurrency=sizes.high))
        if bullmq is not None:
            v = bullmq.version.split()[0]
            out.append(
                Contender(
                    f"BullMQ {v} (Node), concurrency {sizes.high}", "bullmq", concurrency=sizes.high
                )
            )
    out += [
        Contender("trio-mesh, 2 worker processes", "mesh", processes=2),
        Contender(
            f"trio-mesh, 1 worker process, batch handler (batch {sizes.concurrency})",
            "mesh",
            batch=sizes.concurrency,
        ),
        Contender(f"trio-mesh, 1 worker process, {SERIAL}", "mesh", prefetch=0),
        Contender(f"trio-mesh, 2 worker processes, {SERIAL}", "mesh", processes=2, prefetch=0),
    ]
    if ctx.base:
        # the same at another source tree (python -m bench --base), same run
        out += [
            Contender(f"{MESH1}, {BASE}", "mesh", tree=ctx.base),
            Contender(f"{mesh_high(sizes)}, {BASE}", "mesh", concurrency=sizes.high, tree=ctx.base),
        ]
    if not sizes.peers:
        return out, notes
    for lib, label, extra in (
        ("saq", "SAQ {v}", ()),
        ("streaq", "streaQ {v} (asyncio)", ()),
        ("streaq", "streaQ {v} (trio)", ("--backend", "trio")),
        ("arq", "arq {v} (defaults, poll_delay 0.5 s)", ()),
        ("arq", "arq {v} (poll_delay 10 ms)", ("--poll-delay", "0.01")),
    ):
        pv = ctx.peer_version(lib)
        if pv is None:
            notes.append(
                f"{lib} skipped: it cannot be imported by {ctx.peer_python()} "
                "(run `python -m bench --setup-peers`)"
            )
            continue
        out.append(Contender(label.format(v=pv.split()[0]), lib, extra=extra))
    return out, notes


def pending_probe(lib: str, ns: str) -> tuple[Callable[[Connection], Awaitable[int]], int]:
    """How many tasks are not done yet, read from each library's own state,
    and how many Redis commands one probe costs: trio-mesh: queued + running
    processes (the bare loop keeps the same two); Worqr: its queue list + its
    working processes set; BullMQ: its wait and active lists; SAQ: its
    ``incomplete`` sorted set (what SAQ's benchmark polls); arq: its queue
    sorted set (a job leaves it when finished); streaQ: the stream length (a
    finished task is XACKed and XDELed)."""
    two: tuple[tuple[str, str], tuple[str, str]] | None = None
    if lib in ("mesh", "loop"):
        k = Keys(ns)
        two = (("LLEN", k.queue(QUEUE)), ("HLEN", k.procs(QUEUE)))
    elif lib == "worqr":
        two = (("LLEN", f"worqr-bench:queues:{QUEUE}"),
               ("SCARD", f"worqr-bench:workingProcesses:{QUEUE}"))  # fmt: skip
    elif lib == "bullmq":
        two = (("LLEN", f"bull:{QUEUE}:wait"), ("LLEN", f"bull:{QUEUE}:active"))
    if two is not None:
        commands = two

        async def pending2(conn: Connection) -> int:
            a, b = await conn.pipeline(commands)
            return int(a) + int(b)

        return pending2, 2
    cmd = {
        "saq": ("ZCARD", f"saq:{QUEUE}:incomplete"),
        "arq": ("ZCARD", "arq:queue"),
        "streaq": ("XLEN", f"streaq:{QUEUE}:queues:normal"),
    }[lib]

    async def peer_pending(conn: Connection) -> int:
        return int(await conn.execute(*cmd))

    return peer_pending, 1


@dataclass
class RunResult:
    enqueue: float
    processing: float
    redis_cpu: float
    worker_cpu: float
    commands: int  # Redis commands run while processing, inside scripts too (our polls excluded)
    scripts: int  # EVALSHA/EVAL calls while processing
    busy: float  # share of all the machine's cores busy while processing (0..1)


async def one_run(
    ctx: Context, url: str, conn: Connection, c: Contender, sizes: Sizes
) -> RunResult:
    n = sizes.tasks
    await conn.execute("FLUSHALL")
    ns = "tp" + secrets.token_hex(3)
    pending, probe_cost = pending_probe(c.lib, ns)
    within = max(120.0, n / 50)
    conc = str(c.concurrency or sizes.concurrency)
    async with children() as kids:
        workers = []
        for i in range(c.processes):
            if c.lib == "mesh":
                argv = tree_child(
                    c.tree, "throughput", "--url", url, "--ns", ns, "--queue", QUEUE,
                    "--concurrency", conc, "--batch", str(c.batch),
                    *(("--prefetch", str(c.prefetch)) if c.prefetch >= 0 else ()),
                    *c.extra,
                )  # fmt: skip
            elif c.lib == "loop":
                argv = mesh_child(
                    "loop", "--url", url, "--ns", ns, "--queue", QUEUE, "--concurrency", conc
                )
            elif c.lib in ("worqr", "bullmq"):
                argv = node_argv(ctx, c.lib, "work", "--url", url, "--concurrency", conc)
            else:
                argv = [
                    ctx.peer_python(), str(PEER_CHILD), c.lib, "work", "--url", url,
                    "--concurrency", conc, *c.extra,
                ]  # fmt: skip
            workers.append(await kids.spawn(f"{c.lib} worker {i}", argv))
        for w in workers:
            await w.expect("ready", 60)
        if c.lib in ("mesh", "loop"):
            argv = tree_child(
                c.tree, "produce", "--url", url, "--ns", ns, "--queue", QUEUE, "--n", str(n)
            )
        elif c.lib in ("worqr", "bullmq"):
            argv = node_argv(ctx, c.lib, "produce", "--url", url, "--n", str(n))
        else:
            argv = [
                ctx.peer_python(), str(PEER_CHILD), c.lib, "produce", "--url", url, "--n", str(n),
            ]  # fmt: skip
        producer = await kids.spawn(f"{c.lib} producer", argv)
        enqueue = float((await producer.expect("enqueued", within)).split()[1])
        got = await pending(conn)
        if got != n:
            raise RuntimeError(f"{c.label}: {got} tasks pending after enqueueing {n}")
        cpu0 = await redis_cpu(conn)
        cmd0 = int((await info(conn, "stats"))["total_commands_processed"])
        ev0 = await script_calls(conn)
        wcpu0 = sum(cpu_seconds(w.pid) for w in workers)
        ticks0 = machine_ticks()
        t0 = trio.current_time()
        for w in workers:
            await w.send("go")

        polls = 0

        async def done() -> bool:
            nonlocal polls
            polls += 1
            return await pending(conn) == 0

        t1 = await poll_until(done, interval=POLL, within=within)
        ticks1 = machine_ticks()
        wcpu1 = sum(cpu_seconds(w.pid) for w in workers)
        cpu1 = await redis_cpu(conn)
        cmd1 = int((await info(conn, "stats"))["total_commands_processed"])
        ev1 = await script_calls(conn)
    ours = polls * probe_cost + 3  # the polls, INFO cpu and commandstats
    busy = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1])
    return RunResult(
        enqueue, t1 - t0, cpu1 - cpu0, wcpu1 - wcpu0, cmd1 - cmd0 - ours, ev1 - ev0, busy
    )


@dataclass
class Scaling:
    """What the machine does with a second process that shares nothing."""

    speed: float  # rounds per second of one process alone (how fast the machine is)
    rate: float  # 2 processes at once / 1 alone, in rounds per second
    cpu: float  # CPU seconds a process takes for its rounds: 2 at once / 1 alone


async def machine_scaling(sizes: Sizes) -> Scaling:
    """How much more two CPU-bound processes that share nothing (no Redis, no
    I/O: :mod:`bench.children.spin_child`) get done on this machine than one: the
    ceiling of "2 worker processes / 1" for any software. One alone and two at
    once alternate ``sizes.spins`` times; the medians are compared. Each
    process is started and waits for ``go``, so interpreter start-up is not
    timed; two at once are timed to the later one's end."""
    argv = [sys.executable, "-m", "bench.children.spin_child", str(sizes.spin)]
    one: list[tuple[float, float]] = []
    two: list[tuple[float, float]] = []
    for _ in range(sizes.spins):
        for k, into in ((1, one), (2, two)):
            async with children() as kids:
                spinners = [await kids.spawn(f"spinner {i}", argv) for i in range(k)]
                for c in spinners:
                    await c.expect("ready", 60)
                for c in spinners:
                    await c.send("go")
                got = [(await c.expect("spun", 120)).split()[1:] for c in spinners]
            into.append((max(float(g[0]) for g in got), median([float(g[1]) for g in got])))
    wall1, wall2 = median([w for w, _ in one]), median([w for w, _ in two])
    cpu1, cpu2 = median([c for _, c in one]), median([c for _, c in two])
    return Scaling(speed=sizes.spin / wall1, rate=2 * wall1 / wall2, cpu=cpu2 / cpu1)


def tree_child(tree: str, *args: str) -> list[str]:
    """argv of a trio-mesh child: this checkout's, or with ``tree`` the one of
    that source tree (its ``mesh`` and ``bench`` first on ``PYTHONPATH``; a
    tree from before bench/ was grouped has ``bench/_mesh_child.py``)."""
    if not tree:
        return mesh_child(*args)
    grouped = (Path(tree) / "bench" / "children" / "mesh_child.py").is_file()
    module = "bench.children.mesh_child" if grouped else "bench._mesh_child"
    # -P: not the working directory first (its bench/ may be another tree's)
    return ["env", f"PYTHONPATH={tree}", sys.executable, "-P", "-m", module, *args]


def node_argv(ctx: Context, lib: str, role: str, *args: str) -> list[str]:
    w, why = ctx.worqr() if lib == "worqr" else ctx.bullmq()
    if w is None:
        raise RuntimeError(why)
    return w.argv(role, *args)


async def script_calls(conn: Connection) -> int:
    """EVALSHA + EVAL calls so far (from INFO commandstats)."""
    stats = await info(conn, "commandstats")
    n = 0
    for cmd in ("cmdstat_evalsha", "cmdstat_eval"):
        if cmd in stats:
            n += int(stats[cmd].split(",")[0].split("=")[1])
    return n


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    if not ctx.peers:
        sizes = dataclasses.replace(sizes, peers=False)
    n = sizes.tasks
    conts, notes = contenders(ctx, sizes)
    section = Section(
        "throughput",
        "Throughput",
        METHOD.format(
            n=n,
            c=sizes.concurrency,
            hi=sizes.high,
            poll=POLL * 1000,
            spins=sizes.spins,
            spin=sizes.spin,
        ),
        runs=ctx.runs,
        notes=notes,
    )
    results: dict[str, list[RunResult | None]] = {c.label: [] for c in conts}
    scaling: list[Scaling] = []
    with run_redis_server() as server:
        async with open_connection(server.url) as conn:
            for r in range(ctx.runs):
                ctx.log(f"throughput: run {r + 1}/{ctx.runs}: the machine, 2 processes / 1")
                scaling.append(await machine_scaling(sizes))
                ctx.log(
                    f"  {scaling[-1].rate:.2f}x the work, each process's CPU time "
                    f"{scaling[-1].cpu:.2f}x"
                )
                for c in conts:
                    ctx.log(f"throughput: run {r + 1}/{ctx.runs}: {c.label}")
                    try:
                        res = await one_run(ctx, server.url, conn, c, sizes)
                    except trio.TooSlowError:
                        ctx.log(f"throughput: {c.label} timed out")
                        res = None
                        section.notes.append(f"{c.label}: run {r + 1} timed out")
                    results[c.label].append(res)
                    if res:
                        ctx.log(
                            f"  enqueue {res.enqueue:.3f} s, processing {res.processing:.3f} s "
                            f"= {n / res.processing:,.0f} tasks/s"
                        )
    nan = math.nan
    best_peer = 0.0
    rates: dict[str, Figure] = {}
    for c in conts:
        rs = results[c.label]
        rate = Figure(
            f"{c.label}: processing",
            "tasks/s",
            [n / x.processing if x else nan for x in rs],
        )
        rates[c.label] = rate
        if c.lib not in ("mesh", "loop"):
            best_peer = max(best_peer, rate.median)
    ratios = headline(conts, results, sizes)
    section.figures += ratios
    section.headline = headline_table(conts, results, sizes, ratios)
    for c in conts:
        rs = results[c.label]
        enq = Figure(f"{c.label}: enqueue {n:,}", "s", [x.enqueue if x else nan for x in rs])
        plain1 = c.label == MESH1
        if plain1:
            enq.target = Target("<", 0.1 * n / 20_000, f"< {0.1 * n / 20_000:g} s")
        if c.lib != "loop":  # its tasks are trio-mesh's, enqueued the same way
            section.figures.append(enq)
        rate = rates[c.label]
        if plain1:
            rate.target = Target(">=", 10_000, ">= 10,000 tasks/s")
        section.figures.append(rate)
        section.figures.append(
            Figure(
                f"{c.label}: Redis CPU per task",
                "µs",
                [x.redis_cpu / n * 1e6 if x else nan for x in rs],
            )
        )
        section.figures.append(
            Figure(
                f"{c.label}: Redis commands per task",
                "",
                [x.commands / n if x else nan for x in rs],
            )
        )
        if c.lib in ("mesh", "loop"):
            section.figures.append(
                Figure(
                    f"{c.label}: script calls per task",
                    "",
                    [x.scripts / n if x else nan for x in rs],
                )
            )
        section.figures.append(
            Figure(
                f"{c.label}: the machine's cores busy",
                "%",
                [100 * x.busy if x else nan for x in rs],
                note="all processes, the kernel's work for them included",
            )
        )
        section.figures.append(
            Figure(
                f"{c.label}: worker CPU per task",
                "µs",
                [x.worker_cpu / n * 1e6 if x else nan for x in rs],
            )
        )
    if best_peer > 0:
        mesh1 = rates[MESH1]
        section.figures.append(
            Figure(
                "trio-mesh (1 process) / best peer",
                "x",
                [v / best_peer for v in mesh1.runs],
                target=Target(">=", 1.0, "ahead of every peer"),
                note="per run, divided by the best peer's median",
            )
        )
    mesh1_runs = results[MESH1]
    mesh2_runs = results["trio-mesh, 2 worker processes"]
    section.figures.append(
        Figure(
            "trio-mesh: 2 worker processes / 1",
            "x",
            [b.processing / a.processing if a and b else nan
             for a, b in zip(mesh2_runs, mesh1_runs, strict=True)],
            target=Target(">=", 1.6, ">= 1.6x"),
            note="per run",
        )
    )  # fmt: skip
    for label, unit, values, note in (
        (
            "the machine: 1 CPU-bound process alone",
            "M rounds/s",
            [x.speed / 1e6 for x in scaling],
            "per run: how fast this machine runs Python, to compare runs on other machines",
        ),
        (
            "the machine: 2 CPU-bound processes / 1 (no Redis, nothing shared)",
            "x",
            [x.rate for x in scaling],
            "per run, just before trio-mesh's: the ceiling of the line above for any software",
        ),
        (
            "the machine: CPU time of the same work, 2 processes at once / 1 alone",
            "x",
            [x.cpu for x in scaling],
            "per run: above 1, the two cores share the hardware under them",
        ),
    ):
        section.figures.append(Figure(label, unit, values, note=note))
    section.figures.append(
        Figure(
            "trio-mesh: 2 worker processes / 1, over the machine's 2 / 1",
            "x",
            [b.processing / a.processing / m.rate if a and b else nan
             for a, b, m in zip(mesh2_runs, mesh1_runs, scaling, strict=True)],
            note="per run: 1 is as well as the machine scales work that shares nothing",
        )
    )  # fmt: skip
    batched = next((c for c in conts if c.batch), None)
    if batched is not None:
        section.figures.append(
            same_run(f"trio-mesh: batch handler (batch {batched.batch}) / plain handler",
                     results[batched.label], mesh1_runs, note="per run, 1 worker process each")
        )  # fmt: skip
    serial = next((c for c in conts if c.prefetch == 0 and c.processes == 1), None)
    if serial is not None:
        section.figures.append(
            same_run("trio-mesh: the default (adaptive pipelining) / prefetch 0",
                     mesh1_runs, results[serial.label], note="per run, 1 worker process each")
        )  # fmt: skip
    serial2 = next((c for c in conts if c.prefetch == 0 and c.processes == 2), None)
    if serial2 is not None and serial is not None:
        section.figures.append(
            same_run("trio-mesh, prefetch 0: 2 worker processes / 1",
                     results[serial2.label], results[serial.label], note="per run")
        )  # fmt: skip
    for c in conts:
        if c.tree:
            # trio-mesh at this tree / at the base tree (python -m bench --base)
            here = results[c.label.removesuffix(f", {BASE}")]
            section.figures.append(
                same_run(f"{c.label.removesuffix(f', {BASE}')}: this tree / the base tree",
                         here, results[c.label], note=f"per run; the base tree: {c.tree}")
            )  # fmt: skip
            for what, get in (
                ("Redis CPU", lambda r: r.redis_cpu),
                ("worker CPU", lambda r: r.worker_cpu),
            ):
                section.figures.append(
                    per_task(f"{what} per task, concurrency {c.concurrency or sizes.concurrency}: "
                             "this tree / the base tree", here, results[c.label], get, None)
                )  # fmt: skip
    worqr = next((c for c in conts if c.lib == "worqr"), None)
    peers = sorted({c.lib for c in conts if c.lib not in ("mesh", "loop", "worqr", "bullmq")})
    if peers:
        versions = ", ".join(f"{lib} {ctx.peer_version(lib)}" for lib in peers)
        section.notes.append(f"Peers ran under {ctx.peer_python()}: {versions}.")
    if worqr is not None:
        w, _ = ctx.worqr()
        assert w is not None
        section.notes.append(f"Worqr ran under {w.node}: worqr {w.version} (bench/_node.py).")
    if any(c.lib == "bullmq" for c in conts):
        b, _ = ctx.bullmq()
        assert b is not None
        section.notes.append(f"BullMQ ran under {b.node}: bullmq {b.version} (bench/_node.py).")
    return section


def same_run(
    label: str,
    a: list[RunResult | None],
    b: list[RunResult | None],
    *,
    target: Target | None = None,
    note: str = "per run: each run measures both, one after the other",
) -> Figure:
    """A's rate over B's, run by run (B's processing time over A's)."""
    return Figure(
        label,
        "x",
        [y.processing / x.processing if x and y else math.nan for x, y in zip(a, b, strict=True)],
        target=target,
        note=note,
    )


def per_task(
    label: str,
    a: list[RunResult | None],
    b: list[RunResult | None],
    what: Callable[[RunResult], float],
    target: Target | None,
) -> Figure:
    """A's per-task cost over B's, run by run (same task count: a ratio of totals)."""
    return Figure(
        label,
        "x",
        [what(x) / what(y) if x and y and what(y) else math.nan for x, y in zip(a, b, strict=True)],
        target=target,
        note="per run: both measured in the same run",
    )


def headline(
    conts: list[Contender], results: dict[str, list[RunResult | None]], sizes: Sizes
) -> list[Figure]:
    """Issue 34's targets, each a same-run ratio: trio-mesh at the run's
    concurrency against the bare loop, BullMQ and Worqr; at the high
    concurrency against BullMQ; its Redis and worker CPU per task against the
    loop's."""
    by_lib: dict[tuple[str, int], Contender] = {}
    for c in conts:
        if c.processes == 1 and not c.batch and c.prefetch < 0 and not c.extra and not c.tree:
            by_lib.setdefault((c.lib, c.concurrency or sizes.concurrency), c)
    lo, hi = sizes.concurrency, sizes.high
    mesh = results[MESH1]
    out = []
    loop = by_lib.get(("loop", lo))
    if loop is not None:
        rl = results[loop.label]
        out.append(same_run(f"trio-mesh (concurrency {lo}) / the bare loop, same run", mesh, rl,
                            target=Target(">=", 0.7, ">= 0.7")))  # fmt: skip
    for lib, name, want in (("bullmq", "BullMQ", 3.5), ("worqr", "Worqr", 3.5)):
        peer = by_lib.get((lib, lo))
        if peer is not None:
            out.append(
                same_run(f"trio-mesh / {name}, both at concurrency {lo}, same run", mesh,
                         results[peer.label], target=Target(">=", want, f">= {want:g}x"))
            )  # fmt: skip
    m_hi, b_hi = by_lib.get(("mesh", hi)), by_lib.get(("bullmq", hi))
    if hi and m_hi is not None and b_hi is not None:
        out.append(
            same_run(f"trio-mesh / BullMQ, both at concurrency {hi}, same run",
                     results[m_hi.label], results[b_hi.label], target=Target(">=", 6.0, ">= 6x"))
        )  # fmt: skip
    if loop is not None:
        rl = results[loop.label]
        for what, get, most in (
            ("Redis CPU", lambda r: r.redis_cpu, 1.8),
            ("worker CPU", lambda r: r.worker_cpu, 1.5),
        ):
            out.append(
                per_task(f"{what} per task: trio-mesh (concurrency {lo}) / the bare loop",
                         mesh, rl, get, Target("<=", most, f"<= {most:g}x"))
            )  # fmt: skip
    return out


def headline_table(
    conts: list[Contender],
    results: dict[str, list[RunResult | None]],
    sizes: Sizes,
    ratios: list[Figure],
) -> str:
    """The report's headline: trio-mesh, the limit, BullMQ and Worqr, one
    worker process each, side by side (median, min-max over the runs), and
    the same-run ratios with their targets."""
    n, nan = sizes.tasks, math.nan
    mesh = results[MESH1]

    def cell(f: Figure) -> str:
        if math.isnan(f.median):
            return "n/a"
        return f"{num(f.median)} ({num(f.min)}-{num(f.max)})"

    head = [
        f"{n:,} no-op tasks per run, one worker process each, every system in the same run "
        "(see Throughput for the method).",
        "",
        "| system | concurrency | tasks/s | trio-mesh (10) / it | Redis CPU per task, µs "
        "| worker CPU per task, µs | Redis commands per task |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    rows = []
    for c in conts:
        if (
            c.processes != 1
            or c.batch
            or c.prefetch >= 0
            or c.tree
            or c.extra
            or c.lib not in ("mesh", "loop", "bullmq", "worqr")
        ):
            continue
        rs = results[c.label]
        conc = c.concurrency or sizes.concurrency
        rate = Figure("", "", [n / x.processing if x else nan for x in rs])
        vs = Figure("", "", [y.processing / x.processing if x and y else nan
                             for x, y in zip(mesh, rs, strict=True)])  # fmt: skip
        rcpu = Figure("", "", [x.redis_cpu / n * 1e6 if x else nan for x in rs])
        wcpu = Figure("", "", [x.worker_cpu / n * 1e6 if x else nan for x in rs])
        cmds = Figure("", "", [x.commands / n if x else nan for x in rs])
        name = c.label.split(",")[0] if c.lib != "loop" else c.label
        rows.append(
            f"| {name} | {conc} | {cell(rate)} | {'' if c.label == MESH1 else cell(vs)} "
            f"| {cell(rcpu)} | {cell(wcpu)} | {cell(cmds)} |"
        )
    targets = ["", "| same run | median | min | max | target | verdict |",
               "|---|--:|--:|--:|---|---|"]  # fmt: skip
    for f in ratios:
        t = f.target.text if f.target else ""
        targets.append(
            f"| {f.label} | {num(f.median)} | {num(f.min)} | {num(f.max)} | {t} | {f.verdict()} |"
        )
    return "\n".join(head + rows + (targets if ratios else []))


METHOD = """
{n:,} no-op one-shot tasks per run, one worker OS process with concurrency {c}
(SAQ's own benchmark shape), every library on the same redis-server in the same
run (FLUSHALL before each library; each run measures every library once, in the
same order, so trio-mesh and Worqr alternate). For each library and run:

1. the worker process(es) start, connect and build their worker, then wait for a
   `go` line on stdin (so interpreter start-up and imports are not timed);
2. a separate producer process enqueues the tasks the library's fastest
   documented way, timed inside the producer around the enqueue call only:
   trio-mesh `enqueue_many` (one script call), Worqr `enqueue` of an array
   (one `LPUSH` in a `MULTI`), streaQ `enqueue_many` (one pipeline), SAQ
   `enqueue` and arq `enqueue_job` with 20 concurrent calls (as in SAQ's
   `benchmarks/simple.py`);
3. the parent sends `go` to the workers and polls the library's own record of
   unfinished tasks every {poll:g} ms on its own connection: trio-mesh queued +
   running processes (`LLEN` + `HLEN`), Worqr its queue list and its set of
   working processes (`LLEN` + `SCARD`), SAQ its `incomplete` sorted set (what
   SAQ's benchmark polls), arq its queue sorted set (a job leaves it when it is
   finished), streaQ the stream length (finished tasks are acknowledged and
   deleted). Processing time runs from `go` to the first poll that sees zero, so
   it includes each worker's own start (registration, first fetch).

BullMQ (6.7.0 with ioredis 6.0.0, Node, `bench/children/bullmq_driver.js`)
enqueues with one `Queue.addBulk` of every job (each with `removeOnComplete`
and `removeOnFail`: no record kept, as trio-mesh keeps none) and runs one
`Worker` with the no-op processor at concurrency {c} and {hi}, beside
trio-mesh at {c} and {hi}; the parent polls its `wait` and `active` lists.
It is installed from the npm registry into a scratch folder
(`bench/_node.py`) and skipped, with a note, where node, npm or the registry
is missing.

**The limit** is a bare Python loop on trio-mesh's own connection
(`bench/children/mesh_child.py loop`) with trio-mesh's batching and nothing
else: one small Lua script per round trip that finishes the previous {c}
tasks (`HDEL` from the queue's running hash) and claims the next {c} (`LPOP`
of {c}, `HSET` of each as running); no lease, no heartbeat, no handler, no
framework. Its tasks are trio-mesh's, enqueued the same way, and polled the
same way. "trio-mesh / the bare loop" is the fraction of that limit trio-mesh
reaches, and its Redis and worker CPU per task are read against the loop's,
all per run.

Worqr (1.2.3, Node, `bench/children/worqr_driver.js`) runs its readme's `doWork`
loop {c} times at once: `dequeue`, the no-op handler, `await finishProcess`,
until `dequeue` finds the queue empty; a `work` event starts loops up to {c}.
It is installed from its tarball into a scratch folder (`bench/_node.py`) and
skipped, with a note, where node, npm or the tarball is missing.

trio-mesh is measured twice with one worker process: with a plain handler
(`start_work(queue, handler, concurrency={c})`, the figure compared with the
peers) and with a batch handler (`start_work(queue, batch_handler=...,
batch={c})`: one call per claim of up to {c} processes, each finished on its
own), to show what a batch handler saves where bulk work fits; and with
`prefetch=0` (1 and 2 worker processes): pipelining off, one claim round
trip at a time, against the default, which pipelines while handlers are
short and the queue has a backlog (see "Prefetch and pipelining" in the
concepts). With `python -m bench --base TREE`, trio-mesh at that source tree
runs too (at {c} and {hi}, one worker process), in the same runs.

"2 worker processes / 1" is read against what the machine itself does with a
second process: at the start of each run, {spins} times alternating, one
CPU-bound Python process alone and two at once (`bench/children/spin_child.py`: a loop
of small dicts and byte strings, no I/O, nothing shared, {spin:,} rounds each,
timed inside each process after a `go`); "the machine: 2 CPU-bound processes /
1" is twice the median time of one alone over the median time of two at once
(the later one's end), the most that any software gets from a second process
here. "CPU time of the same work, 2 at once / 1 alone" says why, where it is
above 1: each process ran all the time (its CPU time equals its wall time) and
still took longer, so the two cores share the hardware under them.

The handler does nothing (no extra Redis command per task for anyone). The
producer, the workers, the polling parent and redis-server share the machine's
cores. "Redis CPU per task" is the server's `used_cpu_user + used_cpu_sys`
delta over the processing time divided by the number of tasks (the parent's
polling included, the same for every library); "Redis commands per task" is the
`total_commands_processed` delta over the same span without the parent's polls
(commands run inside Lua scripts count too: it is the work Redis does, not the
round trips); for trio-mesh "script calls per task" counts the `EVALSHA` calls
(claims, finish reports, heartbeats, reaper checks); a finish report and the
next claim share one round trip, so a busy worker makes about half as many
round trips as script calls; "worker CPU per task" is the
worker processes' user + system time over the same span; "the machine's cores
busy" is the share of all the machine's cores (`/proc/stat`: user, nice,
system, irq and softirq time, over all time but steal included) that anything
used over the same span: workers, redis-server, the polling parent, the
kernel. One worker process that waits for each round trip keeps about one
core busy between it and Redis; "2 worker processes / 1" cannot be more than
what the second core adds. The peers run in their
own virtual environment (`bench/peers.txt`) because arq needs redis-py < 6 and
SAQ's redis extra redis-py < 8, while trio-mesh needs redis-py 8.
"""
