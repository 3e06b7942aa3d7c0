"""Cancel latency: 10 workers, 1,000 running processes; time from
``Client.cancel()`` returning to the handler's cancellation.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from dataclasses import dataclass

import trio

import mesh
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import Child, children, mesh_child, percentile

QUEUE = "long"


@dataclass(frozen=True)
class Sizes:
    workers: int = 10
    per_process: int = 5
    processes: int = 1_000


FULL = Sizes()
QUICK = Sizes(processes=200)


async def running(kids: list[Child]) -> int:
    total = 0
    for k in kids:
        await k.send("count")
        total += int((await k.expect("count", 30)).split()[1])
    return total


async def wait_running(kids: list[Child], n: int, within: float) -> None:
    with trio.fail_after(within):
        while await running(kids) != n:  # noqa: ASYNC110 (a poll with a deadline)
            await trio.sleep(0.02)


@dataclass
class Samples:
    after_return: list[float]  # s, from cancel() returning (clamped at 0)
    after_call: list[float]  # s, from cancel() being called
    early: int  # handlers cancelled before cancel() returned
    call: list[float]  # s, how long cancel() itself took


async def one_run(url: str, sizes: Sizes, kind: str) -> Samples:
    ns = "cx" + secrets.token_hex(3)
    nproc = math.ceil(sizes.workers / sizes.per_process)
    concurrency = math.ceil(sizes.processes / sizes.workers)
    fleet = kind.endswith("fleets")
    loop = "asyncio" if "asyncio" in kind else "trio"
    payloads = [f"{kind.split(',')[0]}-{i:06d}" for i in range(sizes.processes)]
    async with children() as kids_, mesh.open_client(url, namespace=ns) as client:
        kids = []
        left = sizes.workers
        for i in range(nproc):
            n = min(left, sizes.per_process)
            left -= n
            argv = mesh_child(
                "hold", "--url", url, "--ns", ns, "--queue", QUEUE,
                "--workers", str(n), "--concurrency", str(concurrency),
                *(["--fleet"] if fleet else []), "--loop", loop,
            )  # fmt: skip
            kids.append(await kids_.spawn(f"cancel workers {i}", argv))
        for k in kids:
            await k.expect("ready", 120)
        await trio.sleep(0.5)  # first claims back: a nudge during one is lost (findings.md)
        if kind.startswith("persistent"):
            await client.ensure_many(QUEUE, payloads)
        else:
            await client.enqueue_many(QUEUE, payloads)
        await wait_running(kids, sizes.processes, 120)
        await trio.sleep(0.2)  # let the claim-and-start burst settle
        called: dict[str, int] = {}
        returned: dict[str, int] = {}
        order = payloads[:]
        random.shuffle(order)
        for p in order:
            called[p] = time.monotonic_ns()
            n = await client.cancel(QUEUE, p)
            returned[p] = time.monotonic_ns()
            if n != 1:
                raise RuntimeError(f"cancel({p!r}) returned {n}, expected 1")
        await wait_running(kids, 0, 60)
        cancelled: dict[str, int] = {}
        for k in kids:
            await k.send("dump")
            while (line := await k.expect("", 30)) != "end":
                _, task, t = line.split()
                cancelled[task] = int(t)
    if set(cancelled) != set(payloads):
        raise RuntimeError(f"{len(set(payloads) - set(cancelled))} handlers were not cancelled")
    raw = [(cancelled[p] - returned[p]) / 1e9 for p in payloads]
    return Samples(
        after_return=[max(0.0, x) for x in raw],
        after_call=[(cancelled[p] - called[p]) / 1e9 for p in payloads],
        early=sum(1 for x in raw if x <= 0),
        call=[(returned[p] - called[p]) / 1e9 for p in payloads],
    )


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    section = Section(
        "cancel",
        "Cancel latency",
        METHOD.format(
            w=sizes.workers,
            p=sizes.processes,
            per=sizes.per_process,
            nproc=math.ceil(sizes.workers / sizes.per_process),
        ),
        runs=ctx.runs,
    )
    p = percentile
    with run_redis_server() as server:
        for kind in ("persistent", "one-shot", "persistent, fleets", "persistent, asyncio"):
            res: list[Samples] = []
            for r in range(ctx.runs):
                ctx.log(f"cancel: run {r + 1}/{ctx.runs}: {sizes.processes:,} {kind} processes")
                res.append(await one_run(server.url, sizes, kind))
                s = res[-1]
                ctx.log(
                    f"  after return p50 {p(s.after_return, 50) * 1e3:.2f} ms, "
                    f"p99 {p(s.after_return, 99) * 1e3:.2f} ms; cancel() call p50 "
                    f"{p(s.call, 50) * 1e3:.2f} ms"
                )
            label = f"{kind}: after cancel() returned"
            section.samples[label] = ("ms", [x * 1e3 for s in res for x in s.after_return])
            section.limits[label] = 10
            section.figures += [
                Figure(
                    f"{kind}: after cancel() returned, p50",
                    "ms",
                    [p(s.after_return, 50) * 1e3 for s in res],
                ),
                Figure(
                    f"{kind}: after cancel() returned, p99",
                    "ms",
                    [p(s.after_return, 99) * 1e3 for s in res],
                    target=Target("<", 10, "< 10 ms"),
                ),
                Figure(
                    f"{kind}: after cancel() was called, p50",
                    "ms",
                    [p(s.after_call, 50) * 1e3 for s in res],
                ),
                Figure(
                    f"{kind}: after cancel() was called, p99",
                    "ms",
                    [p(s.after_call, 99) * 1e3 for s in res],
                ),
                Figure(f"{kind}: cancel() call, p50", "ms", [p(s.call, 50) * 1e3 for s in res]),
                Figure(f"{kind}: cancel() call, p99", "ms", [p(s.call, 99) * 1e3 for s in res]),
                Figure(
                    f"{kind}: cancelled before cancel() returned",
                    "%",
                    [s.early / len(s.after_return) * 100 for s in res],
                ),
            ]
    return section


METHOD = """
{w} workers ({per} `open_worker`s per OS process, {nproc} processes) hold {p:,}
running processes whose handlers sleep until cancelled; a cancelled handler
notes `time.monotonic_ns()` (CLOCK_MONOTONIC, shared by every process of the
machine) in its `except trio.Cancelled`. The parent cancels every task, one
`Client.cancel()` after the other in random order, noting the same clock when
each call starts and returns. Two kinds: persistent tasks (`ensure_many`) and
one-shot tasks (`enqueue_many`) that run until cancelled. "After cancel()
returned" is the issue's figure; a handler cancelled before the call returned
(the cancel message overtook the script's reply) counts as 0, and how often that
happened is shown. p50/p99 over the {p:,} cancels of a run; figures are the
median, min and max over the runs. "Persistent, fleets": the same persistent
tasks, with the workers of each OS process in one fleet (`mesh.open_fleet`), so
every cancel reaches its worker through the process's one shared pub/sub
connection. "Persistent, asyncio": the persistent tasks with the worker processes on
asyncio (`--loop asyncio`), whose handlers catch `asyncio.CancelledError`.
"""
