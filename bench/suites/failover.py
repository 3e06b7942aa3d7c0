"""Failover: the OS process that owns a persistent task is killed with SIGKILL
(or stopped with SIGTERM); how long until the task runs on a live peer.
"""

from __future__ import annotations

import math
import secrets
import signal
import time
from dataclasses import dataclass

import trio

import mesh
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import Child, Children, children, mesh_child, percentile, terminate


@dataclass(frozen=True)
class Sizes:
    trials: int = 20
    ttl: float = 1.0


FULL = Sizes()
QUICK = Sizes(trials=5)


async def spawn_worker(
    kids: Children, url: str, ns: str, ttl: float, i: int, loop: str = "trio"
) -> tuple[Child, str]:
    child = await kids.spawn(
        f"failover worker {i} ({loop})",
        mesh_child("failover", "--url", url, "--ns", ns, "--ttl", str(ttl), "--loop", loop),
    )
    line = await child.expect("ready", 60)
    return child, line.split()[1]


async def running(client: mesh.Client, task: str) -> list[mesh.Process]:
    """The processes of ``task`` on ``devices`` (a cancelled one may still be
    listed a moment, owned by a worker already replaced)."""
    return [p for p in await client.processes("devices") if p.task == task.encode()]


async def trials(url: str, sig: int, sizes: Sizes, loop: str = "trio") -> list[float]:
    """One run: ``sizes.trials`` takeovers, each after ``sig`` hit the owner
    (worker processes on ``loop``).
    Returns the seconds from the signal to the handler's start on the peer.

    Every trial moves a task of its own: the core counts a crash as a failed
    attempt and backs off a persistent task whose owners keep dying within
    ``backoff_max`` of claiming it (a crash loop), so killing the owner of the
    same task twenty times in a row would measure that backoff, not a
    failover (see findings.md)."""
    ns = "fo" + secrets.token_hex(3)
    out: list[float] = []
    async with children() as kids, mesh.open_client(url, namespace=ns) as client:
        live: dict[str, Child] = {}
        for i in range(2):
            child, wid = await spawn_worker(kids, url, ns, sizes.ttl, i, loop)
            live[wid] = child
        n = 2
        for trial in range(sizes.trials):
            task = f"device-{trial}"
            if trial:
                await client.cancel("devices", f"device-{trial - 1}")
            await client.ensure("devices", task)
            # this trial's task only (see running)
            with trio.fail_after(30):
                while not (procs := await running(client, task)):  # noqa: ASYNC110
                    await trio.sleep(0.005)
            owner_id = procs[0].worker_id
            # (a worker fenced under load rejoins as "<its id>.<suffix>")
            key = next(w for w in live if owner_id == w or owner_id.startswith(w + "."))
            owner = live.pop(key)
            ((_, standby),) = live.items()
            await owner.expect("start", 10)
            t0 = time.monotonic_ns()
            owner.signal(sig)
            line = await standby.expect("start", sizes.ttl + 30)
            out.append((int(line.split()[2]) - t0) / 1e9)
            if sig == signal.SIGKILL:
                await owner.kill()
            else:
                await terminate(owner, signal.SIGKILL, grace=sizes.ttl + 5)
            child, wid = await spawn_worker(kids, url, ns, sizes.ttl, n, loop)
            live[wid] = child
            n += 1
    return out


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    ttl = sizes.ttl
    section = Section(
        "failover",
        "Failover",
        METHOD.format(trials=sizes.trials, ttl=ttl),
        runs=ctx.runs,
    )
    kill: list[list[float]] = []
    term: list[list[float]] = []
    akill: list[list[float]] = []  # the same, with asyncio worker processes
    aterm: list[list[float]] = []
    with run_redis_server() as server:
        for r in range(ctx.runs):
            ctx.log(f"failover: run {r + 1}/{ctx.runs}: asyncio workers, SIGKILL and SIGTERM")
            akill.append(await trials(server.url, signal.SIGKILL, sizes, "asyncio"))
            aterm.append(await trials(server.url, signal.SIGTERM, sizes, "asyncio"))
            ctx.log(f"failover: run {r + 1}/{ctx.runs}: SIGKILL x {sizes.trials}")
            kill.append(await trials(server.url, signal.SIGKILL, sizes))
            ctx.log(f"  p50 {percentile(kill[-1], 50):.3f} s, p99 {percentile(kill[-1], 99):.3f} s")
            ctx.log(f"failover: run {r + 1}/{ctx.runs}: SIGTERM x {sizes.trials}")
            term.append(await trials(server.url, signal.SIGTERM, sizes))
            ctx.log(
                f"  p50 {percentile(term[-1], 50) * 1000:.1f} ms, "
                f"p99 {percentile(term[-1], 99) * 1000:.1f} ms"
            )
    p = percentile
    allk = [x for run in kill for x in run]
    allt = [x for run in term for x in run]
    n = len(allk)
    section.samples["SIGKILL"] = ("s", allk)
    section.limits["SIGKILL"] = ttl + 0.25
    section.samples["graceful stop (SIGTERM): hand-off"] = ("ms", [x * 1000 for x in allt])
    section.limits["graceful stop (SIGTERM): hand-off"] = 50
    section.figures += [
        Figure("SIGKILL: p50", "s", [p(x, 50) for x in kill]),
        Figure("SIGKILL: p99", "s", [p(x, 99) for x in kill]),
        Figure(
            f"SIGKILL: p99 of all {n} trials pooled",
            "s",
            [p(allk, 99)],
            target=Target("<", ttl + 0.25, f"< TTL + 0.25 s = {ttl + 0.25:g} s"),
        ),
        Figure("SIGKILL: p50 / TTL", "x", [p(x, 50) / ttl for x in kill]),
        Figure("SIGKILL: p99 / TTL", "x", [p(x, 99) / ttl for x in kill]),
        Figure("SIGKILL: max", "s", [max(x, default=math.nan) for x in kill]),
        Figure("graceful stop (SIGTERM): p50", "ms", [p(x, 50) * 1000 for x in term]),
        Figure("graceful stop (SIGTERM): p99", "ms", [p(x, 99) * 1000 for x in term]),
        Figure(
            f"graceful stop (SIGTERM): p99 of all {len(allt)} trials pooled",
            "ms",
            [p(allt, 99) * 1000],
            target=Target("<", 50, "< 50 ms"),
        ),
        Figure(
            "graceful stop (SIGTERM): max", "ms", [max(x, default=math.nan) * 1000 for x in term]
        ),
        Figure(
            "graceful stop (SIGTERM): trials over 50 ms",
            "trials",
            [float(sum(1 for v in x if v > 0.05)) for x in term],
        ),
    ]
    ak = [x for run in akill for x in run]
    at = [x for run in aterm for x in run]
    section.figures += [
        Figure("asyncio workers, SIGKILL: p99", "s", [p(x, 99) for x in akill]),
        Figure(
            f"asyncio workers, SIGKILL: p99 of all {len(ak)} trials pooled",
            "s",
            [p(ak, 99)],
            target=Target("<", ttl + 0.25, f"< TTL + 0.25 s = {ttl + 0.25:g} s"),
        ),
        Figure("asyncio workers, graceful stop: p99", "ms", [p(x, 99) * 1000 for x in aterm]),
        Figure(
            f"asyncio workers, graceful stop: p99 of all {len(at)} trials pooled",
            "ms",
            [p(at, 99) * 1000],
            target=Target("<", 50, "< 50 ms"),
        ),
    ]
    return section


METHOD = """
Two worker OS processes (`open_worker(ttl={ttl:g})`, heartbeat every TTL/3) serve
the queue `devices` (the rows "asyncio workers": the same with `--loop asyncio`, measured
in the same runs). A trial ensures a persistent task of its own (and cancels
the previous trial's), waits until it runs, then sends the owner's process
SIGKILL (or SIGTERM, upon which the worker leaves its `open_worker` block: it
cancels its handler and hands the task back), and waits for the handler to
start on the surviving peer; the peer's handler prints `time.monotonic_ns()`
when it starts, the parent took the same clock (CLOCK_MONOTONIC, shared by
every process of the machine) just before the signal. Then a fresh worker
process joins, so the next trial again has an owner and one standby. A task of
its own per trial, because the core counts a crash as a failed attempt of the
task and backs off a persistent task whose owners keep dying soon after
claiming it: twenty kills of one task's owner in a row would measure that
backoff. {trials} trials per run, p50 and p99 per run (linear interpolation
between closest ranks), figures are the median, min and max over the runs;
since a p99 of {trials} trials is nearly the largest of them, the targets are
judged on the p99 of all trials of all runs pooled. The server has
`notify-keyspace-events Ex`, so peers reap on the lease key's expiry event;
after SIGKILL the task cannot move before the lease, renewed at most TTL/3
earlier, runs out, so takeover is expected between 2/3 TTL and TTL plus the
detection delay (Redis' active expiry) and one reap + claim.
"""
