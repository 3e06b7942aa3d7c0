"""A worker as a real OS process, for the fault tests and the soak.

Run as ``python -m mesh._harness.driver --redis URL --sink URL --prefix P --namespace NS ...``.
It serves a persistent queue (``--persistent``), a one-shot queue
(``--oneshot``) and optionally a queue served without a handler
(``--manual``), and reports everything its handlers do to the fenced sink
(see ``sink.py``): actions ``start``/``act``/``done`` (fenced by token), and
notes ``ready``, ``id`` (the worker rejoined under a new id), ``cancelled``,
``claimed``, ``finish``, ``log`` (a warning of the mesh), ``exit`` (with the
worker's statistics). SIGTERM or SIGINT leaves the worker block gracefully
(every process handed back) and exits 0.

A payload starting with ``!`` carries directives for the handler, separated by
``;``: ``kill`` (SIGKILL this process when the handler starts), ``hold=S`` (a
one-shot job takes S seconds), ``stallwrite`` (a persistent handler, at its
third action, blocks the whole process until the sink has seen a newer owner,
then writes with a *synchronous* client: a write already on its way when the
owner was paused, which no cancellation can stop), ``ignorecancel`` (a
one-shot job sleeps ``hold`` seconds shielded from cancellation), ``fail``
(a one-shot handler raises), ``stallonce`` (as ``stallwrite``, but only the
first owner of the task that reaches its third action stalls: the soak's
"late write" fault, which must not turn into a poison task), ``slowstop=S``
(a handler, persistent or one-shot, takes S seconds, shielded, to clean up
when cancelled, then reports ``cancelled``: its exit).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable

import anyio

import mesh
from mesh._client import DEFAULT_MAX_PAYLOAD
from mesh._connection import open_connection
from mesh._harness import sink
from mesh._loop import LOOPS, run


def directives(task: bytes) -> dict[str, str]:
    if not task.startswith(b"!"):
        return {}
    out = {}
    for part in task[1:].decode("ascii", "replace").split(";"):
        k, _, v = part.partition("=")
        out[k.strip()] = v.strip()
    return out


class Captured(logging.Handler):
    """Keeps the mesh's warnings to send to the sink as ``log`` notes."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:500])


async def main(args: argparse.Namespace) -> int:
    captured = Captured(getattr(logging, args.log_level))
    logging.getLogger("mesh").addHandler(captured)
    logging.getLogger("mesh").setLevel(captured.level)
    async with open_connection(args.sink, name=f"sink:{args.tag}") as sconn:

        async def report(
            task: bytes, token: int, worker: str, action: str, extra: str = ""
        ) -> bool:
            cmd = sink.report_command(
                args.prefix, task, token, worker, action, tag=args.tag, extra=extra
            )
            return bool(await sconn.execute(*cmd))

        async def note_shielded(task: bytes, token: int, worker: str, action: str, x: str) -> None:
            with anyio.move_on_after(2) as cs:
                cs.shield = True
                await report(task, token, worker, action, x)

        worker: mesh.Worker | None = None
        stats: dict[str, object] = {}
        try:
            async with mesh.open_worker(
                args.redis,
                namespace=args.namespace,
                ttl=args.ttl,
                heartbeat_interval=args.interval,
                fence_after=args.fence_after,
                worker_id=args.worker_id,
                max_payload=args.max_payload,
                stop_grace=args.stop_grace,
            ) as worker:
                await Handlers(args, worker, report, note_shielded, captured).serve()
                left_at = time.monotonic()
        except mesh.MeshError as exc:
            if worker is not None:
                raise
            await report(b"", 0, args.worker_id or "", "startfail", f"{type(exc).__name__}: {exc}")
            print(f"driver: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        s = worker.statistics()
        r = worker._reaper.statistics()
        stats = {
            "worker": s.worker_id,
            "fenced": s.fenced,
            "started": s.processes_started,
            "finished": s.processes_finished,
            "cancelled": s.processes_cancelled,
            "heartbeats": s.heartbeats,
            "reaper_workers": r.workers_recycled,
            "reaper_processes": r.processes_recycled,
            "leave_s": round(time.monotonic() - left_at, 4),
        }
        await report(b"", 0, worker.id, "exit", json.dumps(stats))
    return 0


class Handlers:
    """What the worker runs: the handlers of its queues, the manual loop,
    and the watches that report to the sink."""

    def __init__(
        self,
        args: argparse.Namespace,
        worker: mesh.Worker,
        report: Callable[..., Awaitable[bool]],
        note_shielded: Callable[..., Awaitable[None]],
        captured: Captured,
    ) -> None:
        self.args = args
        self.worker = worker
        self.report = report
        self.note_shielded = note_shielded
        self.captured = captured

    async def device(self, p: mesh.Process) -> None:
        await self.report(p.task, p.token, p.worker_id, "start", str(p.attempts))
        d = directives(p.task)
        if "kill" in d:
            os.kill(os.getpid(), signal.SIGKILL)
        n = 0
        try:
            while True:
                await anyio.sleep(self.args.act_every)
                n += 1
                if n == 3 and (
                    "stallwrite" in d or ("stallonce" in d and first_stall(self.args, p))
                ):
                    stall_then_write(self.args, p)
                await self.report(p.task, p.token, p.worker_id, "act")
        except anyio.get_cancelled_exc_class():
            await self.slow_stop(d)
            await self.note_shielded(p.task, p.token, p.worker_id, "cancelled", "")
            raise

    async def job(self, p: mesh.Process) -> None:
        await self.report(p.task, p.token, p.worker_id, "start", str(p.attempts))
        d = directives(p.task)
        if "kill" in d:
            os.kill(os.getpid(), signal.SIGKILL)
        if "fail" in d:
            raise RuntimeError(f"task {p.task!r} fails on purpose")
        hold = float(d.get("hold", self.args.job_time))
        try:
            if "ignorecancel" in d:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(hold)
            else:
                await anyio.sleep(hold)
        except anyio.get_cancelled_exc_class():
            await self.slow_stop(d)
            await self.note_shielded(p.task, p.token, p.worker_id, "cancelled", "")
            raise
        await self.report(p.task, p.token, p.worker_id, "done")

    async def slow_stop(self, d: dict[str, str]) -> None:
        if "slowstop" in d:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(float(d["slowstop"]))

    async def manual(self) -> None:
        while True:
            try:
                p = await self.worker.dequeue(self.args.manual)
            except (mesh.MeshConnectionError, mesh.FencedError) as exc:
                await self.report(b"", 0, self.worker.id, "log", f"dequeue: {exc}")
                await anyio.sleep(0.05)
                continue
            if p is None:
                await anyio.sleep(0.01)
                continue
            await self.report(p.task, p.token, p.worker_id, "claimed")
            await anyio.sleep(float(directives(p.task).get("hold", self.args.job_time)))
            try:
                ok = await self.worker.finish(p)
            except mesh.MeshConnectionError as exc:
                await self.report(p.task, p.token, p.worker_id, "log", f"finish: {exc}")
                continue
            await self.report(p.task, p.token, p.worker_id, "finish", str(ok))

    async def watch_id(self) -> None:
        last = self.worker.id
        while True:
            await anyio.sleep(0.01)
            if self.worker.id != last:
                await self.report(b"", 0, self.worker.id, "id", last)
                last = self.worker.id

    async def flush_logs(self) -> None:
        while True:
            await anyio.sleep(0.05)
            recs, self.captured.records = self.captured.records, []
            for r in recs:
                await self.report(b"", 0, self.worker.id, "log", r)

    async def serve(self) -> None:
        """Serve the queues until SIGTERM or SIGINT."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            queues = (
                (self.args.persistent, self.device),
                (self.args.oneshot, self.job),
                (self.args.manual, None),
            )
            for queue, handler in queues:
                if queue:
                    await self.worker.start_work(
                        queue,
                        handler,
                        concurrency=self.args.concurrency,
                        max_attempts=self.args.max_attempts,
                        backoff=self.args.backoff,
                        rebalance=not self.args.no_rebalance,
                    )
            async with anyio.create_task_group() as nursery:
                nursery.start_soon(self.watch_id)
                nursery.start_soon(self.flush_logs)
                if self.args.manual:
                    nursery.start_soon(self.manual)
                await self.report(b"", 0, self.worker.id, "ready", str(os.getpid()))
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()


def first_stall(args: argparse.Namespace, p: mesh.Process) -> bool:
    """Whether this owner is the first of its task to ask (SET NX in the sink)."""
    import redis

    r = redis.Redis.from_url(args.sink)
    try:
        return bool(r.set(f"{args.prefix}:stalled:".encode() + p.task, p.token, nx=True))
    finally:
        r.close()


def stall_then_write(args: argparse.Namespace, p: mesh.Process) -> None:
    """Freeze the whole process (no trio checkpoint) until the sink has a newer
    owner of the task, then write one action synchronously: the write of a
    paused owner that was already on its way."""
    import redis

    r = redis.Redis.from_url(args.sink)
    hi, _ = sink.keys(args.prefix)
    deadline = time.monotonic() + 20 * args.ttl
    try:
        while time.monotonic() < deadline:
            v = r.hget(hi, p.task)
            if v is not None and int(v) > p.token:
                break
            time.sleep(0.01)
        cmd = sink.report_command(
            args.prefix, p.task, p.token, p.worker_id, "act", tag=args.tag, extra="late"
        )
        r.execute_command(*cmd)  # type: ignore[no-untyped-call]
    finally:
        r.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--sink", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--ttl", type=float, default=1.0)
    ap.add_argument("--interval", type=float, default=None)
    ap.add_argument("--fence-after", type=float, default=None)
    ap.add_argument("--worker-id", default=None)
    ap.add_argument("--stop-grace", type=float, default=10.0)
    ap.add_argument(
        "--no-rebalance",
        action="store_true",
        help="never ask peers for tasks (for tests about failover, where a peer that "
        "joins must not take tasks over before the fault)",
    )
    ap.add_argument("--persistent", default="devices")
    ap.add_argument("--oneshot", default="jobs")
    ap.add_argument("--manual", default="")
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--max-attempts", type=int, default=5)
    ap.add_argument("--backoff", type=float, default=1.0)
    ap.add_argument("--act-every", type=float, default=0.05)
    ap.add_argument("--job-time", type=float, default=0.02)
    ap.add_argument("--log-level", default="WARNING", help="mesh log records sent as notes")
    ap.add_argument("--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD)
    ap.add_argument(
        "--loop",
        default="trio",
        choices=LOOPS,
        help="the event loop of this worker and its handlers",
    )
    return ap.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    sys.exit(run(parsed.loop, main, parsed))
