"""Worker processes for :mod:`bench.suites.balance_fleet` (run by the parent as
``python -m bench.children.balance_child --url URL --ns NS ...``).

Runs ``--workers`` workers in this process, each serving ``--queue`` with a
handler that runs until cancelled and notes when it started and when it
exited (``time.monotonic_ns()``: CLOCK_MONOTONIC, one clock for every
process of the machine, so the parent can compare the notes of different
children). Prints ``worker <id>`` for each, then ``ready``.

Lines on stdin: ``dump`` prints ``s <payload> <ns> <token>`` for each start
and ``e <payload> <ns> <token>`` for each exit noted since the last dump,
then ``end``.
SIGTERM: every worker leaves its ``open_worker`` block (a graceful stop:
each task is handed back once its handler has exited), the notes not yet
dumped are printed, then ``bye``, and the process exits.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time

import trio

import mesh


def out(line: str) -> None:
    sys.stdout.write(line + "\n")


async def main(args: argparse.Namespace) -> None:
    notes: list[str] = []

    async def handler(p: mesh.Process) -> None:
        notes.append(f"s {p.task.decode()} {time.monotonic_ns()} {p.token}")
        try:
            await trio.sleep_forever()
        finally:
            notes.append(f"e {p.task.decode()} {time.monotonic_ns()} {p.token}")

    def flush() -> None:
        for line in notes:
            out(line)
        notes.clear()
        sys.stdout.flush()

    stop = trio.Event()
    ready = 0
    all_ready = trio.Event()

    async def one() -> None:
        nonlocal ready
        async with mesh.open_worker(args.url, namespace=args.ns, ttl=args.ttl) as worker:
            await worker.start_work(args.queue, handler, concurrency=args.concurrency)
            out(f"worker {worker.id}")
            sys.stdout.flush()
            ready += 1
            if ready == args.workers:
                all_ready.set()
            await stop.wait()

    async def commands() -> None:
        stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        buf = b""
        while True:
            data = await stream.receive_some(4096)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line == b"dump":
                    flush()
                    out("end")
                    sys.stdout.flush()

    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as workers:
                for _ in range(args.workers):
                    workers.start_soon(one)
                await all_ready.wait()
                if args.gc_freeze:
                    gc.freeze()  # as `mesh worker` does once serving
                out("ready")
                sys.stdout.flush()
                nursery.start_soon(commands)
                async for _ in signals:
                    stop.set()
                    break
            # every worker has left its block: all handed back
            flush()
            out("bye")
            sys.stdout.flush()
            nursery.cancel_scope.cancel()


def cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--ns", required=True)
    ap.add_argument("--queue", default="devices")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--ttl", type=float, default=1.5)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once serving")
    trio.run(main, ap.parse_args())


if __name__ == "__main__":
    cli()
