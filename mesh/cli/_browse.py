"""``mesh jobs`` (a page of a queue's jobs in one state), ``mesh job`` (one
payload's record), ``mesh pause`` and ``mesh resume``."""

from __future__ import annotations

import argparse
import time
from typing import Any

import mesh
from mesh._browse import JOB_STATES, MAX_LIMIT

from ._common import (
    UsageError,
    add_target_options,
    dump_json,
    json_task,
    queue_arg,
    run_client,
    show_task,
    table,
    target,
    task_bytes,
)
from ._groups import group_arg

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``jobs``, ``job``, ``pause`` and ``resume`` to the ``mesh`` parser."""
    p = sub.add_parser(
        "jobs",
        help="list a queue's jobs in one state, a page at a time",
        description="List the jobs of QUEUE in STATE, a page at a time: queued (in claim "
        "order), delayed (first due first), running (by token) or dead (oldest first). "
        "Times are UTC, on the Redis clock. The last line names the cursor of the next page "
        "(pass it to --after). Each payload shows its first bytes and its size; the page never "
        "carries a whole payload. With --group, the jobs of that group of QUEUE in --state "
        "(queued, in the group's order, by default); without it, the queued state lists the "
        "jobs in no group.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument("--state", choices=JOB_STATES, metavar="STATE",
                   help=f"{', '.join(JOB_STATES[:-1])} or {JOB_STATES[-1]} "
                   "(required without --group)")  # fmt: skip
    p.add_argument("--group", type=group_arg, metavar="GROUP",
                   help="a group's jobs, in --state (default: queued)")  # fmt: skip
    p.add_argument("--limit", type=_limit, default=50, metavar="N",
                   help=f"jobs per page, 1..{MAX_LIMIT} (default 50)")  # fmt: skip
    p.add_argument("--after", metavar="CURSOR", help="the cursor a previous page printed")
    p.add_argument("--prefix", metavar="TEXT", help="only payloads that start with TEXT")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the page as JSON")
    p.set_defaults(func=_jobs)

    p = sub.add_parser(
        "job",
        help="show where one payload is on a queue",
        description="Show the record of PAYLOAD on QUEUE: running (worker, token), queued, "
        "delayed (due time) or dead (its last error); exit status 1 if it is in none of them.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument("task", metavar="PAYLOAD", help="the payload")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the record as JSON (null: none)")
    p.set_defaults(func=_job)

    for name, doc in (
        (
            "pause",
            "Pause QUEUE for every worker: no new one-shot job of it starts; running ones "
            "finish, enqueues are kept, persistent tasks keep their owners and are handed over "
            "as usual.",
        ),
        ("resume", "Resume a paused QUEUE: its idle workers are woken at once."),
    ):
        p = sub.add_parser(name, help=doc.split(":")[0].split(".")[0].lower(), description=doc)
        p.add_argument("queue", metavar="QUEUE", type=queue_arg)
        add_target_options(p)
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        p.set_defaults(func=_pause if name == "pause" else _resume)


def _limit(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_LIMIT}: {text!r}")
    return n


def utc(t: float | None) -> str:
    """A Redis-clock time as ``YYYY-MM-DD HH:MM:SS`` UTC, ``-`` if None."""
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def job_json(j: mesh.Job) -> dict[str, Any]:
    """A job record for JSON output: the payload (in a page, its first
    bytes: ``whole`` says which) as :func:`json_task`, its ``size``."""
    return {
        "queue": j.queue,
        "task": json_task(_head(j)),
        "size": j.size,
        "whole": j.whole,
        "state": j.state,
        "persistent": j.persistent,
        "attempts": j.attempts,
        "priority": j.priority,
        "enqueued": j.enqueued,
        "due": j.due,
        "started": j.started,
        "worker": j.worker,
        "token": j.token,
        "error": j.error,
        "traceback": j.traceback,
        "dead_at": j.dead_at,
        "ref": j.ref,
        "group": j.group,
        "tries": [
            {"when": a.when, "worker": a.worker, "error": a.error, "traceback": a.traceback}
            for a in j.tries
        ],
    }


def _head(j: mesh.Job) -> bytes:
    """The payload, or of a preview its first bytes without a UTF-8
    character its end cut in two."""
    if j.whole:
        return j.task
    for cut in range(4):
        part = j.task[: len(j.task) - cut]
        try:
            part.decode()
        except UnicodeDecodeError:
            continue
        return part
    return j.task


def _cell(j: mesh.Job, width: int = 40) -> str:
    text = show_task(_head(j), width)
    return text if j.whole or text.endswith("...") else text + "..."


def size_text(n: int) -> str:
    """A size in bytes for humans: ``512 B``, ``3.0 KiB``, ``64.0 MiB``."""
    if n < 1024:
        return f"{n} B"
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _jobs(args: argparse.Namespace) -> int:
    t = target(args)
    prefix = task_bytes(args.prefix) if args.prefix is not None else None
    state = _state(args.state, args.group, prefix)

    async def go(client: mesh.Client) -> int:
        try:
            page = await client.jobs(
                args.queue,
                state,
                limit=args.limit,
                after=args.after,
                prefix=prefix,
                group=args.group,
            )
        except mesh.ConfigError as exc:
            raise UsageError(str(exc)) from None
        if args.json:
            dump_json(
                {
                    "queue": args.queue,
                    "state": state,
                    "group": args.group,
                    "total": page.total,
                    "next": page.next,
                    "jobs": [job_json(j) for j in page.jobs],
                }
            )
            return 0
        where = "" if args.group is None else f" in group {args.group}"
        print(f"{page.total} {state}{where} on {args.queue}")
        timed = await _timed(client, args.queue)
        if page.jobs:
            headers, rows = _rows(state, page.jobs, grouped=args.group is not None, timed=timed)
            for line in table(headers, rows, right="SIZE ATTEMPTS PRIO TOKEN"):
                print(line)
            if not timed and state != "dead" and not all(j.persistent for j in page.jobs):
                print(untimed_hint(args.queue))
        if page.next is not None:
            print(f"more: --after {page.next}")
        return 0

    return run_client(t, go)


def _state(state: str | None, group: str | None, prefix: bytes | None) -> str:
    """The state ``mesh jobs`` lists: ``--state``, or with ``--group``
    queued by default.

    Raises:
        UsageError: no state without a group; a group with a prefix.
    """
    if group is None:
        if state is None:
            raise UsageError("--state is required: queued, delayed, running or dead")
        return state
    if prefix is not None:
        raise UsageError("--prefix does not combine with --group")
    return state or "queued"


def untimed_hint(queue: str) -> str:
    """What ``mesh jobs`` and ``mesh job`` say of a queue that keeps no
    enqueue times, in place of a bare ``-``."""
    return f"enqueue times: not kept (mesh configure {queue} --enqueue-times on)"


async def _timed(client: mesh.Client, queue: str) -> bool:
    """Whether ``queue`` keeps the enqueue times of its one-shot jobs."""
    policy = await client.policy(queue)
    return policy is not None and policy.enqueue_times


def _rows(
    state: str, jobs: tuple[mesh.Job, ...], *, grouped: bool = False, timed: bool = False
) -> tuple[list[str], list[list[object]]]:
    kind = ["persistent" if j.persistent else "one-shot" for j in jobs]
    # a timed queue's running and delayed one-shot jobs show when they were
    # enqueued (its queued ones in WAITING SINCE, as persistent tasks do)
    since = (
        (["ENQUEUED (UTC)"], [[utc(j.enqueued)] for j in jobs]) if timed else ([], [[]] * len(jobs))
    )
    if grouped and state == "queued":  # one-shot
        head = ["WAITING SINCE (UTC)"] if timed else []
        return ["TASK", "SIZE", "PRIO", "ATTEMPTS", *head], [
            [_cell(j), size_text(j.size), j.priority, j.attempts, *s]
            for j, s in zip(jobs, since[1], strict=True)
        ]
    if state == "running":
        return [
            "TASK",
            "SIZE",
            "KIND",
            "WORKER",
            "TOKEN",
            "STARTED (UTC)",
            "ATTEMPTS",
            *since[0],
        ], [
            [_cell(j), size_text(j.size), k, j.worker, j.token, utc(j.started), j.attempts, *s]
            for j, k, s in zip(jobs, kind, since[1], strict=True)
        ]
    if state == "dead":
        return ["TASK", "SIZE", "ATTEMPTS", "DEAD SINCE (UTC)", "WORKER", "ERROR"], [
            [
                _cell(j),
                size_text(j.size),
                j.attempts,
                utc(j.dead_at),
                j.worker or "-",
                (j.error or "-")[:80],
            ]
            for j in jobs
        ]
    if state == "delayed":
        return ["TASK", "SIZE", "KIND", "DUE (UTC)", "PRIO", "ATTEMPTS", *since[0]], [
            [_cell(j), size_text(j.size), k, utc(j.due), j.priority, j.attempts, *s]
            for j, k, s in zip(jobs, kind, since[1], strict=True)
        ]
    return ["TASK", "SIZE", "KIND", "PRIO", "ATTEMPTS", "WAITING SINCE (UTC)"], [
        [_cell(j), size_text(j.size), k, j.priority, j.attempts, utc(j.enqueued)]
        for j, k in zip(jobs, kind, strict=True)
    ]


def _job(args: argparse.Namespace) -> int:
    t = target(args)
    task = task_bytes(args.task)

    async def go(client: mesh.Client) -> int:
        j = await client.job(args.queue, task)
        if args.json:
            dump_json(None if j is None else job_json(j))
            return 0 if j is not None else 1
        if j is None:
            print(f"{show_task(task)}: not on {args.queue} (finished, cancelled or never queued)")
            return 1
        fields: list[tuple[str, object]] = [
            ("queue", j.queue),
            ("task", show_task(j.task, 200)),
            ("state", j.state),
            ("kind", "persistent" if j.persistent else "one-shot"),
            ("attempts", j.attempts),
            ("priority", j.priority),
        ]
        if j.enqueued is not None and (j.persistent or j.state == "queued"):
            fields.append(("waiting since", utc(j.enqueued) + " UTC"))
        elif j.enqueued is not None:
            fields.append(("enqueued", utc(j.enqueued) + " UTC"))
        elif not j.persistent and j.state != "dead" and not await _timed(client, j.queue):
            fields.append(("enqueued", untimed_hint(j.queue).removeprefix("enqueue times: ")))
        if j.due is not None:
            fields.append(("due", utc(j.due) + " UTC"))
        if j.started is not None:
            fields.append(("started", utc(j.started) + " UTC"))
        if j.worker is not None:
            fields.append(("worker", j.worker))
        if j.token is not None:
            fields.append(("token", j.token))
        if j.dead_at is not None:
            fields.append(("dead since", utc(j.dead_at) + " UTC"))
        if j.error is not None:
            fields.append(("error", " ".join(j.error.split()) or "-"))
        for n, a in enumerate(reversed(j.tries)):
            what = f"{utc(a.when)} UTC on {a.worker}: {' '.join(a.error.split()) or '-'}"
            fields.append(("failed" if n else "failed (last)", what[:300]))
        width = max(len(k) for k, _ in fields)
        for k, v in fields:
            print(f"{k + ':':<{width + 1}} {v}")
        if j.traceback is not None:
            print("traceback of the last error:")
            for line in j.traceback.splitlines():
                print("  " + line)
        return 0

    return run_client(t, go)


def _pause(args: argparse.Namespace) -> int:
    t = target(args)

    async def go(client: mesh.Client) -> int:
        changed = await client.pause(args.queue)
        if args.json:
            dump_json({"queue": args.queue, "paused": True, "changed": changed})
        else:
            print(f"paused {args.queue}" if changed else f"{args.queue} was paused already")
        return 0

    return run_client(t, go)


def _resume(args: argparse.Namespace) -> int:
    t = target(args)

    async def go(client: mesh.Client) -> int:
        changed = await client.resume(args.queue)
        if args.json:
            dump_json({"queue": args.queue, "paused": False, "changed": changed})
        else:
            print(f"resumed {args.queue}" if changed else f"{args.queue} was not paused")
        return 0

    return run_client(t, go)
