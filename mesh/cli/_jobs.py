"""``mesh dead-letters`` (list, requeue or purge a queue's dead letters) and
``mesh configure`` (a queue's policy)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import attrs

import mesh
from mesh._group_reads import read_group_settings
from mesh._policy import policy_fields
from mesh._schedule import MIN_EVERY, spec_of

from ._common import (
    UsageError,
    add_target_options,
    count_arg,
    dump_json,
    format_utc,
    json_task,
    queue_arg,
    run_client,
    seconds_arg,
    show_task,
    table,
    target,
    task_bytes,
    tasks_from_args,
)
from ._groups import add_settings_options, group_defaults, settings_text

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the job-queue subcommands to the ``mesh`` parser."""
    _add_dead_letters(sub)
    _add_configure(sub)
    _add_schedule(sub)


def _add_dead_letters(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh dead-letters``."""
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


def _add_configure(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh configure``."""
    p = sub.add_parser(
        "configure",
        help="show or set a queue's policy (attempts, backoff, timeout, result TTL)",
        description="Set the policy of QUEUE in Redis: every worker serving it applies it "
        "within one heartbeat interval, whatever its own options. Options not given keep "
        "their value. Without options, show the policy.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument(
        "--max-attempts", type=count_arg("max_attempts"), metavar="N", help="0: no limit"
    )
    p.add_argument("--backoff", type=seconds_arg("backoff"), metavar="S", help="first retry delay")
    p.add_argument(
        "--backoff-max", type=seconds_arg("backoff_max"), metavar="S", help="longest retry delay"
    )
    p.add_argument(
        "--timeout", type=seconds_arg("timeout"), metavar="S", help="handler time limit (0: none)"
    )
    p.add_argument(
        "--result-ttl",
        type=seconds_arg("result_ttl"),
        metavar="S",
        help="keep results S seconds (0: not kept)",
    )
    p.add_argument(
        "--rate-limit",
        type=_rate,
        metavar="N[/S]",
        help="at most N claims per S seconds (default 1) across the mesh (0: no limit)",
    )
    p.add_argument(
        "--enqueue-times",
        type=_on_off,
        metavar="on|off",
        help="keep each one-shot job's first enqueue time (mesh jobs, the dashboard); "
        "costs a write per job",
    )
    add_settings_options(p, "group-")
    p.add_argument("--clear", action="store_true", help="remove the queue's policy")
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the policy as JSON")
    p.set_defaults(func=_configure)


def _add_schedule(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh schedule``."""
    p = sub.add_parser(
        "schedule",
        help="add, list or remove periodic tasks",
        description="Periodic tasks: each tick enqueues one one-shot copy of TASK on QUEUE, "
        "exactly once across the mesh (any worker fires it).",
    )
    ssub = p.add_subparsers(dest="schedule_command", metavar="ACTION", required=True)
    a = ssub.add_parser("add", help="add or replace a periodic task")
    a.add_argument("queue", metavar="QUEUE", type=queue_arg)
    a.add_argument("task", metavar="TASK", help="the payload")
    when = a.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--every",
        type=seconds_arg("every", MIN_EVERY),
        metavar="S",
        help=f"a tick every S seconds ({MIN_EVERY:g} or more)",
    )
    when.add_argument(
        "--cron", type=_cron, metavar="EXPR", help="a cron expression, in UTC (needs cronsim)"
    )
    add_target_options(a)
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.set_defaults(func=_schedule_add)
    ls = ssub.add_parser("list", help="list periodic tasks")
    ls.add_argument("queue", metavar="QUEUE", type=queue_arg, nargs="?")
    add_target_options(ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_schedule_list)
    rm = ssub.add_parser("remove", help="remove a periodic task")
    rm.add_argument("queue", metavar="QUEUE", type=queue_arg)
    rm.add_argument("task", metavar="TASK", help="the payload")
    add_target_options(rm)
    rm.add_argument("--json", action="store_true", help="print the result as JSON")
    rm.set_defaults(func=_schedule_remove)


def _schedule_add(args: argparse.Namespace) -> int:
    t = target(args)
    task = task_bytes(args.task)

    async def go(client: mesh.Client) -> int:
        new = await client.schedule(args.queue, task, every=args.every, cron=args.cron)
        if args.json:
            dump_json({"queue": args.queue, "task": json_task(task), "added": new})
        else:
            verb = "added" if new else "replaced"
            print(f"{verb} periodic task {show_task(task)} on {args.queue}")
        return 0

    return run_client(t, go)


def _schedule_list(args: argparse.Namespace) -> int:
    t = target(args)

    async def go(client: mesh.Client) -> int:
        got = await client.schedules(args.queue)
        if args.json:
            dump_json(
                [
                    {
                        "queue": s.queue,
                        "task": json_task(s.task),
                        "every": s.every,
                        "cron": s.cron,
                        "next_run": s.next_run,
                    }
                    for s in got
                ]
            )
            return 0
        if not got:
            print("no periodic tasks")
            return 0
        rows = [
            (
                s.queue,
                show_task(s.task, 40),
                f"every {s.every:g}s" if s.every is not None else f"cron {s.cron}",
                format_utc(s.next_run),
            )
            for s in got
        ]
        for line in table(("QUEUE", "TASK", "WHEN", "NEXT (UTC)"), rows):
            print(line)
        return 0

    return run_client(t, go)


def _schedule_remove(args: argparse.Namespace) -> int:
    t = target(args)
    task = task_bytes(args.task)

    async def go(client: mesh.Client) -> int:
        had = await client.unschedule(args.queue, task)
        if args.json:
            dump_json({"queue": args.queue, "task": json_task(task), "removed": had})
        elif had:
            print(f"removed periodic task {show_task(task)} from {args.queue}")
        else:
            print(f"no periodic task {show_task(task)} on {args.queue}")
        # nothing there is exit 1, as `mesh job` for a job that is not there
        return 0 if had else 1

    return run_client(t, go)


def _cron(text: str) -> str:
    try:
        spec_of(None, text)
    except mesh.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _rate(text: str) -> tuple[int, float]:
    n, slash, per = text.partition("/")
    if slash and not per.strip():
        raise argparse.ArgumentTypeError(f"no seconds after the '/': {text!r} (N or N/S)")
    try:
        count = int(n)
        seconds = float(per) if slash else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"not N or N/S: {text!r}") from None
    if count < 0 or not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"need N >= 0 and S > 0, got {text!r}")
    try:
        policy_fields(rate_limit=(count, seconds))
    except mesh.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return count, seconds


def _on_off(text: str) -> bool:
    """``on`` or ``off`` (as an argparse type)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _configure(args: argparse.Namespace) -> int:
    t = target(args)
    opts = {
        k: getattr(args, k)
        for k in (
            "max_attempts",
            "backoff",
            "backoff_max",
            "timeout",
            "result_ttl",
            "rate_limit",
            "enqueue_times",
        )
        if getattr(args, k) is not None
    }
    opts.update(group_defaults(args))
    if args.clear and opts:
        raise UsageError("--clear takes no other option")

    async def go(client: mesh.Client) -> int:
        if args.clear:
            had = await client.clear_policy(args.queue)
            if args.json:
                dump_json({"queue": args.queue, "cleared": had})
            else:
                print(f"{args.queue}: policy {'cleared' if had else 'was not set'}")
            return 0
        policy = await client.configure(args.queue, **opts) if opts else None
        if policy is None:
            policy = await client.policy(args.queue)
        if args.json:
            dump_json(
                {"queue": args.queue, "policy": None if policy is None else attrs.asdict(policy)}
            )
        elif policy is None:
            print(f"{args.queue}: no policy (its workers' options apply)")
        else:
            print(
                f"{args.queue}: max_attempts={policy.max_attempts} backoff={policy.backoff:g}s "
                f"backoff_max={policy.backoff_max:g}s timeout={policy.timeout:g}s "
                f"result_ttl={policy.result_ttl:g}s"
                + (
                    f" rate_limit={policy.rate_limit}/{policy.rate_period:g}s"
                    if policy.rate_limit
                    else ""
                )
                + f" enqueue_times={'on' if policy.enqueue_times else 'off'}"
                + f" (set by {policy.source or 'configure'})"
            )
        if group_defaults(args):
            r = client.reads
            default = await read_group_settings(r.check(), r.keys, args.queue, "")
            if args.json:
                dump_json({"queue": args.queue, "group_default": attrs.asdict(default)})
            else:
                print(f"{args.queue}: default for every group: {settings_text(default)}")
        return 0

    return run_client(t, go)


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
                format_utc(d.when) if d.when else "-",
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
