"""Transport benchmark: calls/s of mesh's trio-native Redis connection.

Starts its own redis-server (never touches 127.0.0.1:6379) and measures
``execute("PING")`` and ``EVALSHA`` of a trivial script, sequentially from one trio
task and from 100 concurrent trio tasks (auto-pipelined).

    python -m bench.tools.transport [--seconds 2] [--tasks 100]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import trio

from mesh._connection import Connection, open_connection
from mesh.testing import run_redis_server

SCRIPT = b"return ARGV[1]"


async def sequential(conn: Connection, args: Sequence[bytes | str | int], seconds: float) -> float:
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(100):
            await conn.execute(*args)
        n += 100
    return n / (time.perf_counter() - start)


async def concurrent(
    conn: Connection, args: Sequence[bytes | str | int], seconds: float, tasks: int
) -> float:
    count = 0
    stop = False

    async def one() -> None:
        nonlocal count
        while not stop:
            await conn.execute(*args)
            count += 1

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(one)
        await trio.sleep(seconds)
        stop = True
    return count / (time.perf_counter() - start)


async def main(seconds: float, tasks: int) -> None:
    with run_redis_server() as server:
        async with open_connection(server.url) as conn:
            sha = await conn.execute("SCRIPT", "LOAD", SCRIPT)
            evalsha = ("EVALSHA", sha, 2, b"{ns}:queue:a", b"{ns}:worker:b", b"x" * 100, 42)
            for label, args in (("PING", ("PING",)), ("EVALSHA", evalsha)):
                before = conn.statistics()
                seq = await sequential(conn, args, seconds)
                mid = conn.statistics()
                con = await concurrent(conn, args, seconds, tasks)
                after = conn.statistics()
                per_write = (after.commands_sent - mid.commands_sent) / max(
                    1, after.writes - mid.writes
                )
                print(
                    f"{label:8} sequential: {seq:9,.0f} calls/s   "
                    f"{tasks} concurrent: {con:9,.0f} calls/s "
                    f"({per_write:.1f} commands per write)"
                )
                assert mid.commands_sent > before.commands_sent


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--tasks", type=int, default=100)
    ns = parser.parse_args()
    trio.run(main, ns.seconds, ns.tasks)
