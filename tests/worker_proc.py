"""A worker as a real OS process, for tests that kill, stop and resume it.

Every event goes to a Redis list (``--log``) as one line:
``event queue task token worker_id unix_time``. Events: ``start`` (a handler
began), ``act`` (a persistent handler acted, every 50 ms), ``cancelled`` (a
handler was cancelled), ``claimed`` and ``finish=True|False`` (the manual
one-shot path), ``ready`` (the worker serves its queues). With ``--timed N``
it also serves the queue ``timed`` (concurrency N): a payload ``name:seconds``
sleeps that long, with ``start`` and ``end`` events logged in batches (no
round trip in the handler, so that a short handler stays short).
"""

from __future__ import annotations

import argparse
import time

import trio

import mesh
import mesh._runner_core
from mesh._connection import Connection, open_connection


async def main(args: argparse.Namespace) -> None:
    async with (
        open_connection(args.redis) as log_conn,
        mesh.open_worker(args.redis, namespace=args.namespace, ttl=args.ttl) as worker,
    ):

        async def log(
            event: str, p: mesh.Process | None = None, conn: Connection = log_conn
        ) -> None:
            who = p.worker_id if p else worker.id
            what = f"{p.queue} {p.task.decode()} {p.token}" if p else "- - 0"
            await conn.execute("RPUSH", args.log, f"{event} {what} {who} {time.time():.6f}")

        async def device(p: mesh.Process) -> None:
            await log("start", p)
            try:
                while True:
                    await trio.sleep(0.05)
                    await log("act", p)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await log("cancelled", p)
                raise

        async def job(p: mesh.Process) -> None:
            await log("start", p)
            try:
                await trio.sleep(args.hold)
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await log("cancelled", p)
                raise

        # "timed": a payload "name:seconds" sleeps that long (0: not at all),
        # its events logged without a round trip in the handler (a short
        # handler stays short), in batches every few milliseconds
        pending: list[str] = []

        async def flush() -> None:
            while True:
                await trio.sleep(0.005)
                if pending:
                    lines = pending[:]
                    pending.clear()
                    await log_conn.execute("RPUSH", args.log, *lines)

        async def timed(p: mesh.Process) -> None:
            what = f"{p.queue} {p.task.decode()} {p.token} {p.worker_id}"
            pending.append(f"start {what} {time.time():.6f}")
            seconds = float(p.task.decode().rpartition(":")[2])
            if seconds:
                await trio.sleep(seconds)
            pending.append(f"end {what} {time.time():.6f}")

        if args.long_min is not None:
            # how long a handler runs before it counts as long (the tests
            # make it long enough to find work prefetched behind one)
            mesh._runner_core.LONG_MIN = args.long_min
        await worker.start_work("devices", device, concurrency=args.concurrency)
        if args.timed:
            await worker.start_work("timed", timed, concurrency=args.timed)
        if args.manual:
            await worker.start_work("manual")
        else:
            await worker.start_work("jobs", job, concurrency=args.concurrency)
        await log("ready")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush)
            if args.manual:
                while (p := await worker.dequeue("manual")) is None:  # noqa: ASYNC110
                    await trio.sleep(0.01)
                await log("claimed", p)
                await trio.sleep(args.hold)  # the test pauses us in here
                ok = await worker.finish(p)
                await log(f"finish={ok}", p)
            await trio.sleep_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--timed", type=int, default=0, help="serve 'timed', this concurrency")
    parser.add_argument("--long-min", type=float, default=None)
    try:
        trio.run(main, parser.parse_args())
    except KeyboardInterrupt:
        pass
