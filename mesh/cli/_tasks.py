"""``mesh enqueue``, ``ensure``, ``cancel``, ``reconcile`` and ``delete-queue``:
one client call each."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import anyio.to_thread

import mesh
from mesh._balance import MAX_WEIGHT
from mesh._client import MAX_PRIORITY, check_priority
from mesh._units import MAX_UNIX_TIME

from ._common import (
    CliError,
    UsageError,
    add_target_options,
    dump_json,
    json_task,
    queue_arg,
    run_client,
    seconds_arg,
    show_task,
    split_tasks,
    target,
    tasks_from_args,
)
from ._groups import group_arg

__all__ = ["register"]

_BATCH = 10_000  # tasks per script call when many come from stdin

_TASKS_HELP = (
    "task payloads; '-' reads more, one per line, from stdin (empty lines are skipped). "
    "Put '--' before tasks that start with '-'"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the task subcommands to the ``mesh`` parser."""
    _add_enqueue(sub)
    _add_ensure(sub)
    _add_cancel(sub)
    _add_reconcile(sub)
    _add_delete_queue(sub)
    _add_adopt_namespace(sub)


def _add_enqueue(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh enqueue``."""
    p = sub.add_parser(
        "enqueue",
        help="put one-shot tasks on a queue",
        description="Put one-shot tasks at the back of QUEUE, in order. Each runs once "
        "(at least once: a task whose worker dies runs again elsewhere).",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument("tasks", metavar="TASK", nargs="+", help=_TASKS_HELP)
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--delay",
        type=seconds_arg("delay"),
        metavar="S",
        help="ready S seconds from now (Redis clock), not at once (at most 10 years)",
    )
    when.add_argument(
        "--at",
        type=_when,
        metavar="TIME",
        help="ready at TIME: ISO 8601 with a timezone (2030-01-01T09:00:00+00:00) "
        "or a Unix time in seconds (up to the year 9999)",
    )
    p.add_argument(
        "--priority",
        type=_priority,
        default=0,
        metavar="N",
        help="0 (the default) to 9: workers claim the highest priority first, in order within one",
    )
    p.add_argument(
        "--group",
        type=group_arg,
        metavar="G",
        help="put them in group G of QUEUE (a tenant, an account): workers take turns among "
        "the groups, and G's settings (mesh group configure) cap its jobs; not with --priority",
    )
    _data_options(p)
    p.set_defaults(func=_enqueue)


def _add_ensure(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh ensure``."""
    p = sub.add_parser(
        "ensure",
        help="make tasks persistent tasks of a queue",
        description="Make each TASK a persistent task of QUEUE: owned by exactly one live "
        "worker until cancelled, moved when that worker dies or stops. A task that is "
        "there already is left alone (but for its weight, set to --weight).",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument("tasks", metavar="TASK", nargs="+", help=_TASKS_HELP)
    _weight_option(p)
    _data_options(p)
    p.set_defaults(func=_ensure)


def _add_cancel(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh cancel``."""
    p = sub.add_parser(
        "cancel",
        help="cancel a task by payload, wherever it is",
        description="Cancel each TASK on QUEUE: remove its queued copies, stop it being a "
        "persistent task, and cancel every running process of it on whatever worker runs it. "
        "One line (with --json, one JSON object) per task.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument("tasks", metavar="TASK", nargs="+", help=_TASKS_HELP)
    p.add_argument(
        "--group",
        type=group_arg,
        metavar="G",
        help="also remove the copies queued or delayed in group G of QUEUE",
    )
    _data_options(p)
    p.set_defaults(func=_cancel)


def _add_reconcile(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh reconcile``."""
    p = sub.add_parser(
        "reconcile",
        help="make a queue's persistent tasks exactly a given set",
        description="Make the persistent tasks of QUEUE exactly the tasks listed, one per "
        "line, in FILE or on stdin: ensure the missing ones, cancel the others. The list "
        "must end with a newline (a list cut short by a producer that died is refused), "
        "and a change that would cancel more than half of the queue's persistent tasks "
        "is refused (exit 2) without --yes. Nothing is changed when refused.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument(
        "--file", "-f", metavar="FILE", help="the desired tasks, one per line (default: stdin)"
    )
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="accept an empty set (cancels every persistent task of QUEUE; with "
        "persistent tasks there, --yes too)",
    )
    p.add_argument(
        "--dry-run",
        "-n",
        action="store_true",
        help="print what would be added and cancelled, and change nothing",
    )
    p.add_argument(
        "--yes",
        "-y",
        action="store_true",
        help="cancel even when that is more than half of the queue's persistent tasks",
    )
    _weight_option(p)
    _data_options(p)
    p.set_defaults(func=_reconcile)


def _add_delete_queue(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh delete-queue``."""
    p = sub.add_parser(
        "delete-queue",
        help="delete a queue and everything in it",
        description="Delete QUEUE: its queued, delayed, dead-lettered and persistent tasks; "
        "its running processes are cancelled. Asks first unless --yes.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    _data_options(p)
    p.set_defaults(func=_delete_queue)


def _add_adopt_namespace(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mesh adopt-namespace``."""
    p = sub.add_parser(
        "adopt-namespace",
        help="make the master's copy of the namespace the one to use (after a data loss)",
        description="After a master lost the namespace (restarted empty) and no node that "
        "holds it will come back: make the namespace on the master the URL leads to the one "
        "every process uses. Processes that refuse that master (docs/operating.md, 'A master "
        "restarted empty') accept it at their next connect attempt. What was lost stays "
        "lost: re-declare the persistent tasks (mesh reconcile). Asks first unless --yes.",
    )
    p.add_argument("--yes", "-y", action="store_true", help="do not ask")
    _data_options(p)
    p.set_defaults(func=_adopt_namespace)


def _priority(text: str) -> int:
    try:
        return check_priority(int(text))
    except (ValueError, mesh.ConfigError):
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 0 to {MAX_PRIORITY}, got {text!r}"
        ) from None


def weight_arg(text: str) -> int:
    """A task weight or worker capacity: a whole number from 1 to 1,000,000."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_WEIGHT:
        raise argparse.ArgumentTypeError(
            f"must be a whole number from 1 to {MAX_WEIGHT:,}, not {text!r}"
        )
    return n


def _weight_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--weight",
        type=weight_arg,
        default=1,
        metavar="N",
        help="each task's weight in the fair share that peers balance (1 to 1,000,000; "
        "default 1): a worker's share is the total weight times its capacity over the total "
        "capacity of the queue's workers",
    )


def _data_options(p: argparse.ArgumentParser) -> None:
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _enqueue(args: argparse.Namespace) -> int:
    t = target(args)
    tasks = tasks_from_args(args.tasks)

    async def go(client: mesh.Client) -> int:
        n = 0
        for i in range(0, len(tasks), _BATCH):
            batch = tasks[i : i + _BATCH]
            with _naming_conflicts(batch):
                n += await client.enqueue_many(
                    args.queue,
                    batch,
                    delay=args.delay,
                    at=args.at,
                    priority=args.priority,
                    group=args.group,
                )
        delayed = args.delay is not None or args.at is not None
        where = args.queue if args.group is None else f"{args.queue} group {args.group}"
        if args.json:
            out: dict[str, Any] = {"queue": args.queue, "delayed" if delayed else "enqueued": n}
            if args.group is not None:
                out["group"] = args.group
            dump_json(out)
        elif delayed:
            print(f"delayed {_count(n, 'task')} on {where}")
        else:
            print(f"enqueued {_count(n, 'task')} on {where}")
        return 0

    return run_client(t, go)


def _ensure(args: argparse.Namespace) -> int:
    t = target(args)
    tasks = list(dict.fromkeys(tasks_from_args(args.tasks)))

    async def go(client: mesh.Client) -> int:
        added: list[bytes] = []
        existing: list[bytes] = []
        for i in range(0, len(tasks), _BATCH):
            batch = tasks[i : i + _BATCH]
            with _naming_conflicts(batch):
                flags = await client.ensure_many(args.queue, batch, weight=args.weight)
            for task, new in zip(batch, flags, strict=True):
                (added if new else existing).append(task)
        if args.json:
            dump_json(
                {
                    "queue": args.queue,
                    "added": [json_task(x) for x in added],
                    "existing": [json_task(x) for x in existing],
                }
            )
        else:
            print(
                f"{args.queue}: {len(added)} added, {len(existing)} there already" + _listing(added)
            )
        return 0

    return run_client(t, go)


def _cancel(args: argparse.Namespace) -> int:
    t = target(args)
    tasks = list(dict.fromkeys(tasks_from_args(args.tasks)))

    async def go(client: mesh.Client) -> int:
        for task in tasks:
            n = await client.cancel(args.queue, task, group=args.group)
            if args.json:
                dump_json({"queue": args.queue, "task": json_task(task), "cancelled": n})
            elif n:
                print(
                    f"cancelled {show_task(task)} on {args.queue}: "
                    + _count(
                        n, "queued copy or running process", "queued copies or running processes"
                    )
                )
            else:
                print(f"nothing to cancel: {show_task(task)} is not on {args.queue}")
        return 0

    return run_client(t, go)


def _reconcile(args: argparse.Namespace) -> int:
    t = target(args)
    if args.file in (None, "-"):
        tasks = _desired(sys.stdin.buffer.read(), "stdin")
    else:
        try:
            with open(args.file, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise UsageError(f"cannot read {args.file}: {exc.strerror or exc}") from None
        tasks = _desired(data, args.file)
    tasks = list(dict.fromkeys(tasks))
    if not tasks and not args.allow_empty and not args.dry_run:
        raise UsageError(
            "the desired set is empty: that would cancel every persistent task of "
            f"{args.queue}; pass --allow-empty if you mean it"
        )

    async def go(client: mesh.Client) -> int:
        have = await client.persistent_tasks(args.queue)
        wanted = set(tasks)
        extra = sorted(set(have) - wanted)
        if args.dry_run:
            missing = [x for x in tasks if x not in have]
            _print_reconcile(args, missing, extra, len(tasks) - len(missing), dry_run=True)
            return 0
        if 2 * len(extra) > len(have) and not args.yes:
            raise UsageError(
                f"refusing to cancel {len(extra)} of the {len(have)} persistent tasks of "
                f"{args.queue} (more than half) without --yes: nothing was changed "
                "(--dry-run lists the changes)"
            )
        r = await client.reconcile(args.queue, tasks, weight=args.weight)
        _print_reconcile(args, r.added, r.cancelled, len(tasks) - len(r.added), dry_run=False)
        return 0

    return run_client(t, go)


def _desired(data: bytes, source: str) -> list[bytes]:
    """The desired set of ``mesh reconcile``: the lines of ``data``.

    Raises:
        CliError: ``data`` does not end with a newline (a producer cut short
            mid-line, whose last task may be a truncated payload), or a line
            is over the payload limit. Exit status 1: the data is bad.
    """
    if data and not data.endswith(b"\n"):
        last = data.rsplit(b"\n", 1)[-1]
        raise CliError(
            f"{source} ends in the middle of a line (no newline after {show_task(last, 30)}): "
            "the list may have been cut short, so nothing was changed; end it with a newline"
        )
    return split_tasks(data, source)


def _print_reconcile(
    args: argparse.Namespace,
    added: Sequence[bytes],
    cancelled: Sequence[bytes],
    unchanged: int,
    *,
    dry_run: bool,
) -> None:
    if args.json:
        out: dict[str, Any] = {
            "queue": args.queue,
            "added": [json_task(x) for x in added],
            "cancelled": [json_task(x) for x in cancelled],
            "unchanged": unchanged,
        }
        if dry_run:
            out["dry_run"] = True
        dump_json(out)
    elif dry_run:
        print(
            f"{args.queue} (dry run, nothing changed): would add {len(added)}{_listing(added)}, "
            f"would cancel {len(cancelled)}{_listing(cancelled)}, {unchanged} unchanged"
        )
    else:
        print(
            f"{args.queue}: {len(added)} added{_listing(added)}, "
            f"{len(cancelled)} cancelled{_listing(cancelled)}, {unchanged} unchanged"
        )


def _delete_queue(args: argparse.Namespace) -> int:
    t = target(args)
    if not args.yes and not sys.stdin.isatty():
        raise UsageError(
            f"refusing to delete queue {args.queue} without --yes (stdin is not a terminal)"
        )

    async def go(client: mesh.Client) -> int:
        if not args.yes:
            i = await client.queue_info(args.queue)
            question = (
                f"delete queue {args.queue} ({i.queued} queued, {i.delayed} delayed, "
                f"{i.running} running, {i.persistent} persistent, {i.dead} dead)? [y/N] "
            )
            answer = await anyio.to_thread.run_sync(_ask, question, abandon_on_cancel=True)
            if answer.strip().lower() not in ("y", "yes"):
                print("not deleted", file=sys.stderr)
                return 1
        n = await client.delete_queue(args.queue)
        out: dict[str, Any] = {"queue": args.queue, "deleted": n}
        if args.json:
            dump_json(out)
        else:
            print(
                f"deleted queue {args.queue}: "
                + _count(
                    n,
                    "task removed (queued, delayed or dead-lettered) or process cancelled",
                    "tasks removed (queued, delayed or dead-lettered) or processes cancelled",
                )
            )
        return 0

    return run_client(t, go)


def _adopt_namespace(args: argparse.Namespace) -> int:
    t = target(args)
    if not args.yes and not sys.stdin.isatty():
        raise UsageError(
            f"refusing to adopt namespace {t.namespace} without --yes (stdin is not a terminal)"
        )

    async def go(client: mesh.Client) -> int:
        if not args.yes:
            question = (
                f"make namespace {t.namespace} on {client._conn.node} the one every process "
                "uses (what other copies held is given up)? [y/N] "
            )
            answer = await anyio.to_thread.run_sync(_ask, question, abandon_on_cancel=True)
            if answer.strip().lower() not in ("y", "yes"):
                print("not adopted", file=sys.stderr)
                return 1
        await client.adopt_namespace()
        if args.json:
            dump_json({"namespace": t.namespace, "adopted": True})
        else:
            print(f"adopted namespace {t.namespace} on {t.shown}")
        return 0

    return run_client(t, go)


_unix_time = seconds_arg("at", maximum=MAX_UNIX_TIME)


def _when(text: str) -> datetime.datetime | float:
    try:
        float(text)
    except ValueError:
        pass
    else:
        return _unix_time(text)
    try:
        t = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time or a Unix time: {text!r}") from None
    if t.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no timezone: add one (e.g. +00:00 or Z)")
    _unix_time(repr(t.timestamp()))  # the range of a Unix time
    return t


_CALL_INDEX = re.compile(r"^task (\d+) of this call ")


@contextlib.contextmanager
def _naming_conflicts(batch: Sequence[bytes]) -> Iterator[None]:
    """A refusal of one task of ``batch`` (``task 2 of this call is a
    persistent task ...``: an index into the script call, which means nothing
    to the person who typed the payloads) names the payload instead.

    Raises:
        CliError: for a :class:`mesh.ConflictError` (nothing of the batch was
            sent: the script refuses the whole call).
    """
    try:
        yield
    except mesh.ConflictError as exc:
        message = str(exc)
        m = _CALL_INDEX.match(message)
        if m and int(m[1]) < len(batch):
            message = f"task {show_task(batch[int(m[1])])} " + message[m.end() :]
        raise CliError(message) from None


def _ask(question: str) -> str:
    try:
        return input(question)
    except EOFError:
        return ""


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _listing(tasks: Sequence[bytes], limit: int = 5) -> str:
    if not tasks:
        return ""
    shown = ", ".join(show_task(x, 30) for x in tasks[:limit])
    more = f", ... {len(tasks) - limit} more" if len(tasks) > limit else ""
    return f" ({shown}{more})"
