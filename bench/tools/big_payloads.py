"""Listing jobs with big payloads: time and peak memory of the listing
process, and bytes on the wire, with 64 MiB payloads (the largest allowed).

Starts its own redis-server (never 127.0.0.1:6379), fills one queue with
``--count`` one-shot jobs of ``--mib`` MiB each (built inside Redis by a
script, so filling is quick), then, each in a fresh process so its peak
memory is its own:

* ``Client.jobs(limit=count)``: seconds, the peak RSS of that process
  against its RSS just before the call, and the slowest PING another
  connection saw meanwhile (how long Redis was held up at once);
* ``mesh jobs QUEUE --state queued --limit count``: seconds, peak RSS.

    python -m bench.tools.big_payloads [--count 50] [--mib 64]

Prints the figures; the target (issue 32) is under 1 s and under 50 MB for
50 jobs of 64 MiB. Needs about count x mib of memory for Redis.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import trio

import mesh
from mesh.testing import run_redis_server

FILL = """
local n, size = tonumber(ARGV[1]), tonumber(ARGV[2])
local block = string.rep('x', 1048576)
local parts = {}
for i = 1, size do parts[i] = block end
local body = table.concat(parts)
for i = 1, n do
  redis.call('RPUSH', KEYS[1], string.format('job-%04d:', i) .. body)
end
return redis.call('LLEN', KEYS[1])
"""

LIST = """
import resource, sys, time, trio, mesh
async def go():
    async with mesh.open_client(sys.argv[1], namespace="bench") as c, \\
            mesh.open_client(sys.argv[1], namespace="bench") as other:
        await c.jobs("big", "queued", limit=1)  # connected, scripts loaded
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        worst = 0.0
        async def ping():
            nonlocal worst
            while True:
                t0 = time.perf_counter()
                await other._conn.execute("PING")
                worst = max(worst, time.perf_counter() - t0)
                await trio.sleep(0.01)
        async with trio.open_nursery() as n:
            n.start_soon(ping)
            t = time.perf_counter()
            page = await c.jobs("big", "queued", limit=int(sys.argv[2]))
            took = time.perf_counter() - t
            n.cancel_scope.cancel()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(took, before, peak, len(page.jobs), sum(j.size for j in page.jobs), worst)
trio.run(go)
"""

CLI = """
import resource, subprocess, sys, time
t = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True)
took = time.perf_counter() - t
print(took, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode,
      len(r.stdout))
"""


async def fill(url: str, count: int, mib: int) -> None:
    async with mesh.open_client(url, namespace="bench") as c:
        key = c._keys.queue("big")
        await c._conn.execute("EVAL", FILL, 1, key, count, mib)
        await c._conn.execute("SADD", c._keys.queues, "big")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with run_redis_server(["--proto-max-bulk-len", "1gb"]) as server:
        t = time.perf_counter()
        trio.run(fill, server.url, args.count, args.mib)
        print(f"filled {args.count} jobs of {args.mib} MiB in {time.perf_counter() - t:.1f} s")
        out = subprocess.run(
            [sys.executable, "-c", LIST, server.url, str(args.count)],
            capture_output=True, text=True, env=env, check=True,
        ).stdout.split()  # fmt: skip
        took, before, peak, n, total = float(out[0]), int(out[1]), int(out[2]), out[3], out[4]
        print(
            f"Client.jobs(limit={args.count}): {n} jobs ({int(total) >> 20} MiB of payloads) "
            f"in {took:.3f} s; peak RSS {peak / 1024:.1f} MB ({(peak - before) / 1024:+.1f} MB "
            "over the process before the call); the slowest PING of another connection "
            f"meanwhile {float(out[5]) * 1000:.0f} ms (how long one peek.lua call held Redis)"
        )
        cmd = [sys.executable, "-m", "mesh.cli", "jobs", "big", "--state", "queued", "--limit",
               str(args.count), "--redis", server.url, "--namespace", "bench"]  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-c", CLI, *cmd], capture_output=True, text=True, env=env, check=True
        ).stdout.split()
        print(
            f"mesh jobs --limit {args.count}: {float(out[0]):.3f} s (the whole command, "
            f"Python's start included), peak RSS {int(out[1]) / 1024:.1f} MB, exit {out[2]}, "
            f"{out[3]} bytes printed"
        )


if __name__ == "__main__":
    main()
