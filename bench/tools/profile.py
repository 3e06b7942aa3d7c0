"""Profile a worker process with py-spy while a benchmark scenario runs, and
summarise where its time goes.

    python -m bench.tools.profile throughput [--tasks 100000] [--out DIR]
        one trio-mesh worker process (concurrency 10) works off the tasks
    python -m bench.tools.profile herd [--workers 250] [--dead 100] [--out DIR]
        one process of 250 idle workers while 100 peers die at once

py-spy attaches to the worker process (``--nonblocking``: the process is not
paused to take a sample) and writes collapsed stacks; the summary lists the
functions with the most samples, inclusive and self. With ``--out`` the
collapsed stacks are kept there (``<scenario>.txt``, the input of
flamegraph.pl or speedscope); otherwise they are deleted.
"""

from __future__ import annotations

import argparse
import collections
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

import mesh
from mesh._connection import open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from .._util import Child, children, mesh_child, poll_until


def py_spy() -> str:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy (or the bench extra)")
    return exe


def summarise(raw: Path, top: int = 25) -> str:
    incl: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        count = int(n)
        total += count
        frames = stack.split(";")
        for f in set(frames):
            incl[f] += count
        self_[frames[-1]] += count
    out = [f"{total} samples", "", "inclusive:"]
    out += [f"  {c / total * 100:5.1f}%  {f}" for f, c in incl.most_common(top)]
    out += ["", "self:"]
    out += [f"  {c / total * 100:5.1f}%  {f}" for f, c in self_.most_common(top)]
    return "\n".join(out)


async def attach(pid: int, raw: Path, seconds: float) -> trio.Process:
    return await trio.lowlevel.open_process(
        [
            py_spy(), "record", "--pid", str(pid), "--rate", "500", "--nonblocking",
            "--format", "raw", "--output", str(raw), "--duration", str(int(seconds) + 1),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def throughput(args: argparse.Namespace, raw: Path) -> None:
    with run_redis_server() as server:
        url, ns = server.url, "pf" + secrets.token_hex(3)
        k = Keys(ns)
        async with children() as kids, open_connection(url) as conn:
            w = await kids.spawn("worker", mesh_child("throughput", "--url", url, "--ns", ns))
            await w.expect("ready", 60)
            async with mesh.open_client(url, namespace=ns) as client:
                await client.enqueue_many("bench", [b"%d" % i for i in range(args.tasks)])
            spy = await attach(w.pid, raw, args.tasks / 10_000)
            await trio.sleep(0.5)  # py-spy is attached
            t0 = trio.current_time()
            await w.send("go")

            async def done() -> bool:
                a, b = await conn.pipeline([("LLEN", k.queue("bench")), ("HLEN", k.procs("bench"))])
                return int(a) + int(b) == 0

            t1 = await poll_until(done, interval=0.002, within=600)
            print(f"{args.tasks:,} tasks in {t1 - t0:.2f} s = {args.tasks / (t1 - t0):,.0f}/s")
            await spy.wait()


async def herd(args: argparse.Namespace, raw: Path) -> None:
    with run_redis_server(["--maxclients", "10000"]) as server:
        url, ns = server.url, "ph" + secrets.token_hex(3)
        k = Keys(ns)
        async with children() as kids, open_connection(url) as conn:

            async def group(n: int, ttl: float, name: str) -> Child:
                c = await kids.spawn(
                    name,
                    mesh_child(
                        "hold", "--url", url, "--ns", ns, "--queue", "devices",
                        "--workers", str(n), "--ttl", str(ttl),
                    ),
                )  # fmt: skip
                await c.expect("ready", 300)
                return c

            live = await group(args.workers, 10.0, "live")
            dead = await group(args.dead, 1.0, "dying")
            async with mesh.open_client(url, namespace=ns) as client:
                tasks = [f"d{i}" for i in range(10 * (args.workers + args.dead))]
                await client.ensure_many("devices", tasks)

                async def held() -> bool:
                    return int(await conn.execute("HLEN", k.procs("devices"))) == len(tasks)

                await poll_until(held, interval=0.05, within=120)
            spy = await attach(live.pid, raw, 15)
            await trio.sleep(0.5)
            t0 = trio.current_time()
            await dead.kill()

            async def back() -> bool:
                return int(await conn.execute("LLEN", k.queue("devices"))) == 10 * int(args.dead)

            t1 = await poll_until(back, interval=0.05, within=120)
            print(f"{args.dead} dead workers' tasks back in the queue after {t1 - t0:.2f} s")
            await spy.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.profile")
    parser.add_argument("scenario", choices=["throughput", "herd"])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=250)
    parser.add_argument("--dead", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trio-mesh-profile-") as d:
        raw = (args.out or Path(d)) / f"{args.scenario}.txt"
        raw.parent.mkdir(parents=True, exist_ok=True)
        run = {"throughput": throughput, "herd": herd}[args.scenario]
        trio.run(run, args, raw)
        print(summarise(raw))


if __name__ == "__main__":
    main()
