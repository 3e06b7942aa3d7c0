"""The driver of ``bench/suites/script_cost.py``, run by path with the mesh of
the tree measured first on ``PYTHONPATH`` (it uses only calls that the base
tree has too).

    script_cost_child.py URL VALGRIND_PID MODE N BATCH

Fills a queue, makes one call of each script the measure runs (so that
Redis loads and compiles them before the count starts), then turns
callgrind's instrumentation of the redis-server on (``callgrind_control -i
on PID``), runs the measure, and turns it off:

* ``claim``: a serial loop of ``finish_and_claim`` (finish the BATCH
  processes claimed last, claim up to BATCH more) over N plain one-shot
  tasks, one worker, as a runner does at that batch;
* ``enqueue``: N small payloads in ``enqueue_many`` calls of BATCH.

Prints ``done <tasks>``.
"""

from __future__ import annotations

import subprocess
import sys

import trio

import mesh
from mesh._binding import Binding
from mesh._connection import open_connection
from mesh._keys import Keys

WORKER, INCARNATION, QUEUE = "w-0123456789ab", "inc0123456789abc", "q"


def instrument(pid: str, on: bool) -> None:
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", pid], check=True,
                   capture_output=True)  # fmt: skip


async def main(url: str, pid: str, mode: str, n: int, batch: int) -> None:
    b = Binding(Keys("cost"))
    payloads = [b"%d" % i for i in range(n)]
    async with open_connection(url) as conn, mesh.open_client(url, namespace="cost") as client:
        if mode == "enqueue":
            await client.enqueue_many("warm", [b"x"])
            instrument(pid, True)
            for i in range(0, n, batch):
                await client.enqueue_many(QUEUE, payloads[i : i + batch])
            instrument(pid, False)
            print("done", n)
            return
        await client.enqueue_many(QUEUE, payloads)
        await b.register(conn, WORKER, INCARNATION, 600_000, b"")
        await b.serve(conn, WORKER, INCARNATION, QUEUE)
        claim = b.claim_call(WORKER, INCARNATION, QUEUE, batch, 5, fair=True, ttl_ms=600_000)
        # the first call loads finish_claim.lua; its processes are the first finished
        _, got = await b.finish_and_claim(conn, WORKER, INCARNATION, QUEUE, [], claim)
        ids = [p.id for p in got.unwrap().processes]
        done = 0
        instrument(pid, True)
        while ids:
            _, got = await b.finish_and_claim(conn, WORKER, INCARNATION, QUEUE, ids, claim)
            done += len(ids)
            ids = [p.id for p in got.unwrap().processes]
        instrument(pid, False)
        print("done", done)


if __name__ == "__main__":
    url, pid, mode, n, batch = sys.argv[1:6]
    trio.run(main, url, pid, mode, int(n), int(batch))
