"""Listing jobs with big payloads: time and peak memory of the listing
process, and bytes on the wire, with 64 MiB payloads (the largest allowed).

Starts its own redis-server (never 127.0.0.1:6379), fills one queue with
``--count`` one-shot jobs of ``--mib`` MiB each, stored out of line as the
client stores any payload over 1 MiB (protocol 10: a blob each, the queue
holding their stand-ins; built inside Redis by a script, so filling is
quick), then, each in a fresh process so its peak memory is its own:

* ``Client.jobs(limit=count)``: seconds, the peak RSS of that process
  against its RSS just before the call, and the slowest PING another
  connection saw meanwhile (how long Redis was held up at once);
* ``mesh jobs QUEUE --state queued --limit count``: seconds, peak RSS.

    python -m bench.suites.payloads [--count 50] [--mib 64]
    python -m bench --only payloads        (a section of the report)

Prints the figures; the target (issue 32) is under 1 s and under 50 MB for
50 jobs of 64 MiB: 0.002 s and 45 MB peak RSS on 2 cores (10.1 s before the
payloads went out of line, when Redis copied each whole entry into
``peek.lua``). Needs about count x mib of memory for Redis.
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

from .._context import Context
from .._report import Section, Target, figures_of

# What put_blob.lua and enqueue.lua leave for a payload over 1 MiB (protocol
# 10, mesh/_blob.py): its blob (one reference) and its stand-in in the list.
FILL = """
local n, size = tonumber(ARGV[1]), tonumber(ARGV[2])
local block = string.rep('x', 1048576)
local parts = {}
for i = 1, size do parts[i] = block end
local body = table.concat(parts)
local prefix = string.match(KEYS[1], '^(%b{}:)')
for i = 1, n do
  local p = string.format('job-%04d:', i) .. body
  local sha = redis.sha1hex(p)
  redis.call('HSET', prefix .. 'blob:' .. sha, 'd', p, 'n', 1)
  local standin = '\\0mesh-blob\\0' .. sha .. '\\0' .. #p .. '\\0' .. string.sub(p, 1, 256)
  redis.call('RPUSH', KEYS[1], standin)
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
        # the fill stores them as the client does: one check that it did
        page = await c.jobs("big", "queued", limit=1)
        assert page.jobs[0].size == mib * 2**20 + 9, page.jobs[0]
        await c._conn.execute("SADD", c._keys.queues, "big")


def measure(count: int, mib: int) -> dict[str, float]:
    """Fill a queue with ``count`` jobs of ``mib`` MiB, then list them both
    ways, each in a fresh process; the figures by name."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with run_redis_server(["--proto-max-bulk-len", "1gb"]) as server:
        t = time.perf_counter()
        trio.run(fill, server.url, count, mib)
        filled = time.perf_counter() - t
        out = subprocess.run(
            [sys.executable, "-c", LIST, server.url, str(count)],
            capture_output=True, text=True, env=env, check=True,
        ).stdout.split()  # fmt: skip
        cmd = [sys.executable, "-m", "mesh.cli", "jobs", "big", "--state", "queued", "--limit",
               str(count), "--redis", server.url, "--namespace", "bench"]  # fmt: skip
        cli = subprocess.run(
            [sys.executable, "-c", CLI, *cmd], capture_output=True, text=True, env=env, check=True
        ).stdout.split()
    return {
        "fill (s)": filled,
        "Client.jobs: time (s)": float(out[0]),
        "Client.jobs: peak RSS (MB)": int(out[2]) / 1024,
        "Client.jobs: peak RSS over the process before the call (MB)": (int(out[2]) - int(out[1]))
        / 1024,
        "Client.jobs: payload bytes listed (MiB)": int(out[4]) / 2**20,
        "the slowest PING of another connection meanwhile (ms)": float(out[5]) * 1000,
        "mesh jobs: the whole command, Python's start included (s)": float(cli[0]),
        "mesh jobs: peak RSS (MB)": int(cli[1]) / 1024,
        "mesh jobs: exit status": float(cli[2]),
    }


async def suite(ctx: Context) -> Section:
    """Listing big payloads as a section of the report, ``ctx.runs`` times."""
    count, mib = (5, 8) if ctx.quick else (50, 64)
    section = Section(
        "payloads", "Listing jobs with big payloads", METHOD.format(count=count, mib=mib),
        runs=ctx.runs,
    )  # fmt: skip
    rows = []
    for r in range(ctx.runs):
        ctx.log(f"payloads: run {r + 1}/{ctx.runs}")
        rows.append(await trio.to_thread.run_sync(measure, count, mib))
    figures, notes = figures_of(f"{count} jobs of {mib} MiB", rows)
    for f in figures:  # issue 32's aim, for the full sizes
        if f.label.endswith("Client.jobs: time (s)"):
            f.target = Target("<", 1.0, "< 1 s")
        elif f.label.endswith("Client.jobs: peak RSS (MB)"):
            f.target = Target("<", 50.0, "< 50 MB")
    section.figures += figures
    section.notes += notes
    return section


METHOD = """
One queue of {count} one-shot jobs of {mib} MiB each, stored out of line as
the client stores payloads over 1 MiB (a blob each, the queue holding their
stand-ins; built inside Redis by a script), listed in a fresh process each
way, so each peak is its own:
`Client.jobs(limit={count})` (its time, its peak RSS, and the slowest PING
another connection saw meanwhile: how long one `peek.lua` call held Redis), and
`mesh jobs QUEUE --state queued --limit {count}`. Issue 32's aim: under 1 s and
under 50 MB for 50 jobs of 64 MiB; a page reads the stand-ins (a few hundred
bytes each) and never a blob (mesh/_browse.py).
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    for key, v in measure(args.count, args.mib).items():
        print(f"{key}: {v:.3f}")


if __name__ == "__main__":
    main()
