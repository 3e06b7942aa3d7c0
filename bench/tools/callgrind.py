"""Instructions per task of a trio-mesh worker, counted by callgrind: a
figure that does not depend on the load of the machine.

    python -m bench.tools.callgrind [--small 2000] [--large 10000] [--concurrency 10]
                              [--prefetch 0] [--batch 0]

A parent (not under valgrind) runs a redis-server, enqueues the tasks, and
runs one worker process under ``valgrind --tool=callgrind``: it starts a
worker serving the queue with a no-op handler, and leaves when its handler
has run for every task. This is done with ``--small`` and with ``--large``
tasks; the difference of the two instruction totals divided by the
difference of the task counts is the worker's instructions per task, with
interpreter start-up, imports, connecting and leaving cancelled out.
"""

from __future__ import annotations

import argparse
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

import mesh
from mesh.testing import run_redis_server


async def child(url: str, ns: str, n: int, concurrency: int, prefetch: int, batch: int) -> None:
    done = trio.Event()
    count = 0

    async def noop(process: mesh.Process) -> None:
        nonlocal count
        count += 1
        if count >= n:
            done.set()

    async def noop_batch(processes: list[mesh.Process]) -> None:
        nonlocal count
        count += len(processes)
        if count >= n:
            done.set()

    async with mesh.open_worker(url, namespace=ns) as worker:
        extra: dict[str, Any] = {"prefetch": prefetch} if prefetch else {}
        if batch:
            await worker.start_work(
                "q", batch_handler=noop_batch, batch=batch, concurrency=concurrency, **extra
            )
        else:
            await worker.start_work("q", noop, concurrency=concurrency, **extra)
        await done.wait()


def total_instructions(out: Path) -> int:
    for line in out.read_text().splitlines():
        m = re.match(r"(?:summary|totals):\s+(\d+)", line)
        if m:
            return int(m.group(1))
    raise RuntimeError(f"no totals in {out}")


def measure(url: str, n: int, args: argparse.Namespace, d: Path) -> int:
    ns = "cg" + secrets.token_hex(3)

    async def enqueue() -> None:
        async with mesh.open_client(url, namespace=ns) as client:
            await client.enqueue_many("q", [b"%d" % i for i in range(n)])

    trio.run(enqueue)
    out = d / f"cg.{n}.out"
    subprocess.run(
        [
            "valgrind", "-q", "--tool=callgrind", f"--callgrind-out-file={out}",
            sys.executable, "-m", "bench.tools.callgrind", "--child", url, ns, str(n),
            "--concurrency", str(args.concurrency), "--prefetch", str(args.prefetch),
            "--batch", str(args.batch),
        ],
        check=True,
    )  # fmt: skip
    return total_instructions(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=int, default=2000)
    p.add_argument("--large", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--prefetch", type=int, default=0)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--keep", default=None, help="keep the callgrind outputs under this folder")
    p.add_argument("--child", nargs=3, metavar=("URL", "NS", "N"))
    args = p.parse_args()
    if args.child:
        url, ns, n = args.child
        trio.run(child, url, ns, int(n), args.concurrency, args.prefetch, args.batch)
        return
    with run_redis_server() as server, tempfile.TemporaryDirectory() as tmp:
        d = Path(args.keep or tmp)
        d.mkdir(parents=True, exist_ok=True)
        small = measure(server.url, args.small, args, d)
        large = measure(server.url, args.large, args, d)
    per = (large - small) / (args.large - args.small)
    print(
        f"concurrency {args.concurrency}, prefetch {args.prefetch}, batch {args.batch}: "
        f"{small:,} instructions for {args.small} tasks, {large:,} for {args.large}: "
        f"{per:,.0f} instructions per task"
    )


if __name__ == "__main__":
    main()
