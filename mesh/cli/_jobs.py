"""``mesh dead-letters``: list, requeue or purge a queue's dead letters."""

from __future__ import annotations

import argparse
import time
from typing import Any

import mesh

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
    tasks_from_args,
)

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the job-queue subcommands to the ``mesh`` parser."""
    p = sub.add_parser(
        "dead-letters",
        help="list, requeue or purge a queue's dead letters",
        description="List the dead letters of QUEUE (oldest first: payload, attempts, last "
        "error, last worker, when), or with --requeue put them back on the queue with their "
        "attempts reset, or with --purge drop them. TASKs limit --requeue/--purge to those "
        "payloads.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument(
        "tasks",
        metavar="TASK",
        nargs="*",
        help="payloads to requeue or purge (default: all); '-' reads more from stdin",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--requeue", action="store_true", help="put them back on the queue")
    what.add_argument("--purge", action="store_true", help="drop them")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_dead_letters)


def _dead_letters(args: argparse.Namespace) -> int:
    t = target(args)
    tasks = tasks_from_args(args.tasks) if args.tasks else None
    if tasks is not None and not (args.requeue or args.purge):
        raise UsageError("TASKs are for --requeue or --purge; listing shows every dead letter")

    async def go(client: mesh.Client) -> int:
        if args.requeue or args.purge:
            verb = "requeued" if args.requeue else "purged"
            fn = client.requeue_dead if args.requeue else client.purge_dead
            n = await fn(args.queue, tasks)
            if args.json:
                dump_json({"queue": args.queue, verb: n})
            else:
                print(f"{verb} {n} dead letter{'' if n == 1 else 's'} of {args.queue}")
            return 0
        dead = await client.dead_letters(args.queue)
        if args.json:
            out: list[dict[str, Any]] = [
                {
                    "task": json_task(d.task),
                    "attempts": d.attempts,
                    "error": d.error,
                    "worker": d.worker,
                    "when": d.when,
                }
                for d in dead
            ]
            dump_json({"queue": args.queue, "dead_letters": out})
            return 0
        if not dead:
            print(f"no dead letters on {args.queue}")
            return 0
        rows = [
            (
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.when)) if d.when else "-",
                d.attempts,
                d.worker or "-",
                show_task(d.task, 40),
                show_task(d.error.encode(), 80) or "-",
            )
            for d in dead
        ]
        for line in table(("WHEN (UTC)", "ATTEMPTS", "WORKER", "TASK", "ERROR"), rows, "ATTEMPTS"):
            print(line)
        return 0

    return run_client(t, go)
