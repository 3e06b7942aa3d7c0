"""``mesh status``: the workers and queues of a namespace, once or live."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

import anyio
import attrs
import trio

import mesh
from mesh._epoch import EPOCH_MISSING_HINT, observing
from mesh._reads import QUEUE_COUNTS
from mesh._types import DelayedTask, Process
from mesh._view import Snapshot, share_text, snapshot

from ._common import (
    Target,
    add_target_options,
    dump_json,
    format_seconds,
    format_utc,
    json_task,
    positive_float,
    show_task,
    table,
    target,
)

__all__ = ["as_json", "register", "render", "share_text"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status`` to the ``mesh`` parser."""
    p = sub.add_parser(
        "status",
        help="show workers and queues",
        description="Show the workers (alive, age, lease left, queues, processes) and the "
        "queues (queued, delayed, running, persistent, dead) of a namespace.",
    )
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print JSON (one line per refresh)")
    p.add_argument("--processes", "-p", action="store_true", help="also list every running process")
    p.add_argument(
        "--delayed",
        "-d",
        nargs="?",
        type=_count,
        const=20,
        metavar="N",
        help="also list the next N delayed tasks of each queue (default 20), the first due "
        "first, with their due time (Redis clock) and priority",
    )
    p.add_argument("--watch", "-w", action="store_true", help="refresh until Ctrl-C (then exit 0)")
    p.add_argument(
        "--interval",
        "-n",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes with --watch (default 1)",
    )
    p.set_defaults(func=_status)


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def epoch_text(namespace: str) -> str:
    """What ``mesh status`` says when the namespace's epoch is missing."""
    return f"the epoch of namespace {namespace} is missing: {EPOCH_MISSING_HINT}"


def render(snap: Snapshot, t: Target) -> list[str]:
    """The snapshot as aligned text lines."""
    lines = [
        f"{t.shown}  namespace {t.namespace}  "
        f"{time.strftime('%H:%M:%S', time.gmtime(snap.now))} UTC",
        "",
        *_workers(snap),
        "",
        *_queues(snap),
        *_warnings(snap, t),
        "",
    ]
    if snap.memory is not None:
        lines.append(f"REDIS MEMORY  {snap.memory.text()}")
    else:
        lines.append("REDIS MEMORY  unknown (INFO not allowed: grant +info)")
    if snap.delayed is not None:
        lines += ["", *_delayed(snap, snap.delayed)]
    if snap.processes is not None:
        lines += ["", *_processes(snap, snap.processes)]
    return lines


def _workers(snap: Snapshot) -> list[str]:
    if not snap.workers:
        return ["WORKERS: none"]
    alive = sum(w.alive for w in snap.workers)
    return [
        f"WORKERS ({alive} alive, {len(snap.workers) - alive} dead)",
        *table(
            ["ID", "ALIVE", "AGE", "LEASE", "PROCS", "QUEUES", "SHARE", "HOST", "PID"],
            [
                [
                    w.id,
                    "yes" if w.alive else "DEAD",
                    format_seconds(snap.now - w.started) if w.started else "-",
                    format_seconds(w.lease_left),
                    w.processes,
                    ",".join(w.queues) or "-",
                    share_text(w.shares),
                    w.host or "-",
                    w.pid or "-",
                ]
                for w in snap.workers
            ],
            right="AGE LEASE PROCS PID",
        ),
    ]


def _queues(snap: Snapshot) -> list[str]:
    if not snap.queues:
        return ["QUEUES: none"]
    # a column per count of a queue, from the one table of them
    counts = [c.name for c in QUEUE_COUNTS]
    heads = [c.upper() for c in counts]
    timed = [f"ENQUEUE TIMES kept for: {', '.join(snap.timed)}"] if snap.timed else []
    return [
        "QUEUES",
        *table(
            ["QUEUE", *heads, "PAUSED"],
            [
                [q.name, *(getattr(q, c) for c in counts), "yes" if q.paused else "no"]
                for q in snap.queues
            ],
            right=" ".join(heads),
        ),
        *timed,
    ]


def _warnings(snap: Snapshot, t: Target) -> list[str]:
    lines = []
    if snap.epoch_missing:
        lines.append(f"WARNING: {epoch_text(t.namespace)}")
    for name, n in sorted(snap.vanished.items()):
        lines.append(
            f"ERROR: queue {name}: {n} persistent task(s) vanished without a cancel "
            "(evicted or deleted); Client.reconcile restores them"
        )
    return lines


def _delayed(snap: Snapshot, delayed: Mapping[str, list[DelayedTask]]) -> list[str]:
    if not delayed:
        return ["DELAYED: none"]
    rows = []
    for q in snap.queues:
        shown = delayed.get(q.name, [])
        for d in shown:
            rows.append(
                [
                    q.name,
                    show_task(d.task, 40),
                    format_utc(d.due, ms=True),
                    format_seconds(d.due - snap.now) if d.due > snap.now else "now",
                    d.priority,
                ]
            )
        if len(shown) < q.delayed:
            rows.append([q.name, f"({q.delayed - len(shown)} more)", "", "", ""])
    return [
        "DELAYED (due times on the Redis clock, UTC)",
        *table(["QUEUE", "TASK", "DUE", "IN", "PRIORITY"], rows, right="IN PRIORITY"),
    ]


def _processes(snap: Snapshot, processes: list[Process]) -> list[str]:
    if not processes:
        return ["PROCESSES: none"]
    return [
        "PROCESSES",
        *table(
            ["TOKEN", "QUEUE", "TASK", "KIND", "WORKER", "AGE", "ATTEMPTS"],
            [
                [
                    p.token,
                    p.queue,
                    show_task(p.task, 40),
                    "persistent" if p.persistent else "one-shot",
                    p.worker_id,
                    format_seconds(snap.now - p.started) if p.started else "-",
                    p.attempts,
                ]
                for p in processes
            ],
            right="TOKEN AGE ATTEMPTS",
        ),
    ]


def as_json(snap: Snapshot, t: Target) -> dict[str, Any]:
    """The snapshot as a JSON-able dict."""
    out: dict[str, Any] = {
        "redis": t.shown,
        "namespace": t.namespace,
        "time": snap.now,
        "workers": [
            {
                "id": w.id,
                "alive": w.alive,
                "age": round(snap.now - w.started, 3) if w.started else None,
                "lease_left": round(w.lease_left, 3),
                "queues": list(w.queues),
                "processes": w.processes,
                "shares": [attrs.asdict(sh) for sh in w.shares],
                "host": w.host,
                "pid": w.pid,
            }
            for w in snap.workers
        ],
        "queues": [attrs.asdict(q) for q in snap.queues],
        "memory": attrs.asdict(snap.memory) if snap.memory is not None else None,
        "vanished": dict(snap.vanished),
        "epoch_missing": snap.epoch_missing,
    }
    if snap.delayed is not None:
        out["delayed"] = [
            {"queue": q, "task": json_task(d.task), "due": d.due, "priority": d.priority}
            for q, ds in snap.delayed.items()
            for d in ds
        ]
    if snap.processes is not None:
        out["processes"] = [
            {
                "id": p.id,
                "token": p.token,
                "queue": p.queue,
                "task": json_task(p.task),
                "persistent": p.persistent,
                "worker": p.worker_id,
                "attempts": p.attempts,
                "started": p.started,
            }
            for p in snap.processes
        ]
    return out


def _status(args: argparse.Namespace) -> int:
    t = target(args)
    with observing():  # look without writing the epoch: a missing one stays said
        return trio.run(_run, args, t)


async def _run(args: argparse.Namespace, t: Target) -> int:
    async with mesh.open_client(t.config, namespace=t.namespace) as client:
        if not args.watch:
            snap = await snapshot(client.reads, processes=args.processes, delayed=args.delayed)
            if args.json:
                dump_json(as_json(snap, t))
            else:
                print("\n".join(render(snap, t)))
            return 0
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as nursery:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                await _watch(client, args, t)
    return 0


async def _watch(client: mesh.Client, args: argparse.Namespace, t: Target) -> None:
    tty = sys.stdout.isatty() and not args.json
    if tty:
        sys.stdout.write("\x1b[2J")
    try:
        while True:
            try:
                snap = await snapshot(client.reads, processes=args.processes, delayed=args.delayed)
            except mesh.MeshConnectionError as exc:
                # Keep watching: the connection reconnects by itself.
                lines = [f"{t.shown}  namespace {t.namespace}", "", f"Redis: {exc}"]
                if args.json:
                    dump_json({"redis": t.shown, "namespace": t.namespace, "error": str(exc)})
            else:
                lines = render(snap, t)
                if args.json:
                    dump_json(as_json(snap, t))
            if not args.json:
                if tty:
                    # Home, each line then clear to its end, then clear below:
                    # redraws in place without flicker.
                    sys.stdout.write("\x1b[H" + "".join(f"{ln}\x1b[K\n" for ln in lines) + "\x1b[J")
                else:
                    sys.stdout.write("\n".join(lines) + "\n\n")
                sys.stdout.flush()
            await anyio.sleep(args.interval)
    finally:
        if tty:
            sys.stdout.flush()
