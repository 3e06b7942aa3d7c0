"""Memory: Redis bytes per queued task and per running process (``INFO
memory`` ``used_memory`` deltas), for one-shot and persistent tasks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section, Target
from .._util import chunks, used_memory

QUEUE = "mem"
WORKER = "probe-worker-0"


@dataclass(frozen=True)
class Sizes:
    tasks: int = 100_000
    payload: int = 32
    short_queues: tuple[int, ...] = (10, 100)  # also measured: queues this long
    short_total: int = 20_000  # tasks over all the short queues


FULL = Sizes()
QUICK = Sizes(tasks=10_000, short_total=2_000)


def payloads(n: int, size: int) -> list[bytes]:
    """``n`` distinct payloads of exactly ``size`` bytes (persistent tasks are
    unique per payload)."""
    return [f"{i:0{size}d}".encode()[-size:] for i in range(n)]


@dataclass
class Costs:
    queued: float  # bytes per queued task
    running: float  # bytes per running process (state of the task while it runs)


async def measure(conn: Connection, sizes: Sizes, kind: str) -> Costs:
    await conn.execute("FLUSHALL")
    keys = Keys("m" + secrets.token_hex(3))
    b = Binding(keys)
    inc = secrets.token_hex(8)
    # the worker that will claim exists before the baseline
    await b.register(conn, WORKER, inc, 600_000, b"{}")
    await b.serve(conn, WORKER, inc, QUEUE)
    tasks = payloads(sizes.tasks, sizes.payload)
    m0 = await used_memory(conn)
    for batch in chunks(tasks, 1_000):
        if kind == "persistent":
            await b.ensure(conn, QUEUE, batch)
        else:
            await b.enqueue(conn, QUEUE, batch)
    m1 = await used_memory(conn)
    claimed = 0
    while claimed < sizes.tasks:
        r = await b.claim(conn, WORKER, inc, QUEUE, 1_000, 0)
        if not r.processes:
            raise RuntimeError(f"claimed {claimed} of {sizes.tasks}")
        claimed += len(r.processes)
    m2 = await used_memory(conn)
    return Costs((m1 - m0) / sizes.tasks, (m2 - m0) / sizes.tasks)


async def measure_short(conn: Connection, sizes: Sizes, kind: str, length: int) -> float:
    """Bytes per queued task when the tasks are spread over many queues of
    ``length`` tasks each (a queue's own keys are part of the cost)."""
    await conn.execute("FLUSHALL")
    b = Binding(Keys("m" + secrets.token_hex(3)))
    tasks = payloads(sizes.short_total, sizes.payload)
    m0 = await used_memory(conn)
    for i, batch in enumerate(chunks(tasks, length)):
        if kind == "persistent":
            await b.ensure(conn, f"{QUEUE}-{i}", batch)
        else:
            await b.enqueue(conn, f"{QUEUE}-{i}", batch)
    return (await used_memory(conn) - m0) / len(tasks)


async def run(ctx: Context, sizes: Sizes | None = None) -> Section:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    limit = sizes.payload + 100
    section = Section(
        "memory",
        "Memory",
        METHOD.format(
            n=sizes.tasks,
            size=sizes.payload,
            short=sizes.short_total,
            lengths=" and ".join(map(str, sizes.short_queues)),
        ),
        runs=ctx.runs,
    )
    with run_redis_server() as server:
        async with open_connection(server.url) as conn:
            for kind in ("one-shot", "persistent"):
                res = []
                for r in range(ctx.runs):
                    ctx.log(f"memory: run {r + 1}/{ctx.runs}: {sizes.tasks:,} {kind} tasks")
                    res.append(await measure(conn, sizes, kind))
                    ctx.log(
                        f"  {res[-1].queued:.1f} B per queued task, "
                        f"{res[-1].running:.1f} B per running process"
                    )
                short: dict[int, list[float]] = {}
                for length in sizes.short_queues:
                    short[length] = []
                    for _ in range(ctx.runs):
                        short[length].append(await measure_short(conn, sizes, kind, length))
                    ctx.log(f"  {short[length][-1]:.1f} B per queued task, queues of {length}")
                section.figures += [
                    Figure(
                        f"{kind}: per queued task ({sizes.payload} B payload)",
                        "B",
                        [c.queued for c in res],
                        target=Target("<=", limit, f"<= payload + 100 = {limit} B"),
                    ),
                    Figure(
                        f"{kind}: per running process ({sizes.payload} B payload)",
                        "B",
                        [c.running for c in res],
                    ),
                ]
                section.figures += [
                    Figure(
                        f"{kind}: per queued task, in queues of {length}",
                        "B",
                        short[length],
                        target=Target("<=", limit, f"<= payload + 100 = {limit} B"),
                    )
                    for length in sizes.short_queues
                ]
    return section


METHOD = """
On an empty redis-server (FLUSHALL before each run) one worker is registered
and serves the queue; then `INFO memory` `used_memory` is read, {n:,} tasks of
{size} bytes each (distinct payloads) are put on the queue in script calls of
1,000 (`enqueue.lua` for one-shot tasks, `ensure.lua` for persistent tasks,
which also keeps the payload in the queue's standby set: at this size the
persistent hash is not compact), `used_memory` is
read again, then the worker claims every task (`claim.lua`, 1,000 per call)
and `used_memory` is read a third time. Bytes per queued task = second minus
first reading, divided by {n:,}; bytes per running process = third minus first
reading divided by {n:,} (everything Redis keeps for the task while it runs:
the process record with its payload, the worker's held set entry, and for a
persistent task its entry in the persistent hash, payload -> process id). The
queue list and the standby set are empty then.

The same {short:,} tasks of {size} bytes spread over queues of {lengths}
tasks each (one script call per queue) measure small queues, where a queue's
own keys count and Redis keeps small hashes compact (a persistent task's
payload then waits in the persistent hash with an empty value, not in the
standby set: see `protocol/include/to_standby.lua`).
"""
