"""Where a busy runner's CPU goes, piece by piece: each piece of the cycle of
one worker process at concurrency 10 (one finish(10) + claim(10) round trip,
then ten handlers) timed alone in a tight loop, in CPU time of this process.

    python -m bench --only parts          (a section of the report)
    python -m bench.suites.parts [--rounds 20000] [--repeat 3]

A sampling profiler (py-spy; the removed ``bench/tools/profile.py``, see
bench/findings.md) shows the shape; on a loaded two-core machine it also
counts, inside ``send``, the time the worker waits while redis-server (woken
by that send) runs on its core. These figures are the worker's own CPU per
piece, comparable with the throughput benchmark's "worker CPU per task" (per
task = per batch / 10).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio
import trio

import mesh
from mesh._binding import Binding
from mesh._connection import open_connection
from mesh._eval import ScriptCall, run_script
from mesh._keys import Keys
from mesh._pool import _Slot
from mesh._replies import ClaimReply
from mesh._runner import QueueConfig, QueueRunner
from mesh._stats import QueueCounters
from mesh._transport import pack as _pack
from mesh._types import Process
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section

BATCH = 10


def cpu() -> float:
    return time.process_time()


def build_and_pack(b: Binding, rounds: int) -> float:
    """CPU per batch to build a runner's finish(10) + claim(10) script calls
    and pack them (RESP)."""
    wid, inc = "w-0123456789abcdef", "0123456789abcdef"
    ids = [str(1_763_950_000_000_000 + i) for i in range(BATCH)]
    t = cpu()
    for _ in range(rounds):
        claim = b.claim_call(wid, inc, "bench", BATCH, 0, fair=True, ttl_ms=3000)
        finish = b.finish_call(wid, inc, "bench", ids)
        for call in (finish, claim):
            _pack(call.command())
    return (cpu() - t) / rounds


async def claim_reply(url: str) -> tuple[ScriptCall[ClaimReply], Any]:
    """A real claim call of 10 processes and its raw reply."""
    b = Binding(Keys("parts"))
    async with open_connection(url) as conn, mesh.open_client(url, namespace="parts") as client:
        await client.enqueue_many("bench", [b"%d" % i for i in range(BATCH)])
        await b.register(conn, "w", "i", 60_000, b"")
        await b.serve(conn, "w", "i", "bench")
        claim = b.claim_call("w", "i", "bench", BATCH, 0, ttl_ms=60_000)
        reply = await run_script(conn, claim.script, claim.keys, claim.args)
    assert len(claim.parse(reply).processes) == BATCH
    return claim, reply


def parse(claim: ScriptCall[ClaimReply], reply: Any, rounds: int) -> float:
    """CPU per batch to parse a claim reply of 10 processes."""
    t = cpu()
    for _ in range(rounds):
        claim.parse(reply)
    return (cpu() - t) / rounds


async def handlers(rounds: int, scope: bool) -> float:
    """CPU per batch to start 10 no-op handlers as trio tasks (each in a
    cancel scope of its own if ``scope``) and let them run and exit."""
    done: list[int] = []

    async def handler(i: int) -> None:
        pass

    async def run_handler(i: int) -> None:
        if scope:
            with trio.CancelScope():
                await handler(i)
        else:
            await handler(i)
        done.append(i)

    async with trio.open_nursery() as nursery:
        t = cpu()
        for _ in range(rounds):
            for i in range(BATCH):
                nursery.start_soon(run_handler, i)
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
        spent = cpu() - t
    t = cpu()
    for _ in range(rounds):  # the two checkpoints alone, taken off
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
    return (spent - (cpu() - t)) / rounds


async def pool(procs: list[Process], rounds: int) -> float:
    """CPU per batch to run 10 no-op handlers the way a runner does now:
    the processes queued, one long-lived handler trio task of the runner's
    pool woken (a reschedule) runs them one after the other while none
    yields to trio, each in that trio task's cancel scope and in a copy of
    the runner's context, its outcome noted."""

    async def handler(p: Process) -> None:
        pass

    r = QueueRunner(
        None,  # type: ignore[arg-type]  # no I/O here
        Binding(Keys("bench")),  # (its keys name the blobs the pool would fetch: none here)
        "w",
        "i",
        QueueConfig("bench", handler, BATCH, 0, 1.0, 1.0),
        QueueCounters(),
        lambda _: None,
    )
    pool = r._pool
    async with anyio.create_task_group() as nursery:
        pool.nursery = nursery
        for _ in range(2):  # the pool's trio tasks exist before the timing
            for p in procs:
                pool.running[p.id] = slot = _Slot(p, 0.0)
                pool.queued.append(slot)
            pool.kick()
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
        t = cpu()
        for _ in range(rounds):
            for p in procs:
                pool.running[p.id] = slot = _Slot(p, 0.0)
                pool.queued.append(slot)
            pool.kick()
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
            pool.out.done.clear()
        spent = cpu() - t
        pool.end()
    t = cpu()
    for _ in range(rounds):  # the two checkpoints alone, taken off
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
    return (spent - (cpu() - t)) / rounds


async def round_trips(url: str, rounds: int) -> tuple[float, float, float]:
    """CPU per round trip: PING through trio-mesh's Connection (with a
    reply_timeout, as a worker's), a pipeline of two PINGs (a finish report
    and its claim share one), and PING on a bare trio socket stream."""
    async with open_connection(url, reply_timeout=10.0) as conn:
        for _ in range(100):
            await conn.execute("PING")
        t = cpu()
        for _ in range(rounds):
            await conn.execute("PING")
        one = (cpu() - t) / rounds
        t = cpu()
        for _ in range(rounds):
            await conn.pipeline([("PING",), ("PING",)])
        two = (cpu() - t) / rounds
    host, _, port = url.split("//", 1)[1].split("/", 1)[0].rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        t = cpu()
        for _ in range(rounds):
            await stream.send_all(b"*1\r\n$4\r\nPING\r\n")
            await stream.receive_some(1024)
        bare = (cpu() - t) / rounds
    return one, two, bare


async def run(rounds: int, repeat: int) -> list[tuple[str, float]]:
    """Each piece ``repeat`` times; the least CPU of each (the machine's
    other load only ever adds)."""
    b = Binding(Keys("bench"))
    best: dict[str, float] = {}

    def keep(label: str, v: float) -> None:
        best[label] = min(v, best.get(label, v))

    with run_redis_server() as server:
        claim, reply = await claim_reply(server.url)
        for _ in range(repeat):
            keep("build + pack finish(10) + claim(10)", build_and_pack(b, rounds))
            keep("parse a claim reply of 10 processes", parse(claim, reply, rounds))
            keep("start + run 10 handlers (task + cancel scope each)", await handlers(rounds, True))
            keep("  the same without the cancel scopes", await handlers(rounds, False))
            keep(
                "run 10 handlers in the runner's pool (mesh._runner)",
                await pool(list(claim.parse(reply).processes), rounds),
            )
            one, two, bare = await round_trips(server.url, rounds)
            keep("round trip: Connection.execute(PING)", one)
            keep("round trip: Connection.pipeline(2 x PING)", two)
            keep("  for reference: bare trio stream PING", bare)
    return list(best.items())


async def suite(ctx: Context) -> Section:
    """The pieces as a section of the report: each piece's CPU per task (per
    batch of 10 / 10), the least of 3 in each of ``ctx.runs`` runs."""
    rounds = 2_000 if ctx.quick else 20_000
    method = METHOD.format(rounds=rounds)
    section = Section("parts", "Where a busy runner's CPU goes", method, runs=ctx.runs)
    per_run: list[dict[str, float]] = []
    for r in range(ctx.runs):
        ctx.log(f"parts: run {r + 1}/{ctx.runs}")
        per_run.append(dict(await run(rounds, 3)))
    for label in per_run[0]:
        values = [rows[label] * 1e6 / BATCH for rows in per_run]
        section.figures.append(Figure(label.strip(), "µs per task", values))
    return section


METHOD = """
Each piece of the cycle of one worker process at concurrency 10 (one
finish(10) + claim(10) round trip, then ten handlers) timed alone in a tight
loop of {rounds:,} batches, in CPU time of this process: the least of 3 (the
machine's other load only ever adds), per task (per batch / 10). Comparable
with the throughput suite's "worker CPU per task"; a sampling profiler on a
two-core machine also charges to `send` the time Redis runs on the worker's
core, which these figures leave out.
"""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.suites.parts")
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3, help="keep the least of so many")
    args = parser.parse_args()
    rows = trio.run(run, args.rounds, args.repeat)
    print(f"{'piece of one batch of 10':52s} {'us/batch':>9s} {'us/task':>8s}")
    for label, sec in rows:
        print(f"{label:52s} {sec * 1e6:9.1f} {sec * 1e6 / BATCH:8.2f}")


if __name__ == "__main__":
    main()
