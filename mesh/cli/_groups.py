"""``mesh groups`` (a look at a queue's groups) and ``mesh group
pause|resume|configure|clear`` (one group's pause and settings); the
``--group`` of ``mesh enqueue`` and ``mesh cancel`` is in :mod:`._tasks`,
and the queue's default for every group in ``mesh configure``."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

import mesh
from mesh._client_groups import group_fields
from mesh._group_reads import GroupInfo, GroupSettings, GroupsLook, read_group_settings
from mesh._keys import check_group

from ._common import (
    add_target_options,
    count_arg,
    dump_json,
    queue_arg,
    run_client,
    table,
    target,
)

__all__ = ["add_settings_options", "group_arg", "group_defaults", "rate_arg", "register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``groups`` and ``group`` to the ``mesh`` parser."""
    _add_groups(sub)
    _add_group(sub)


def group_arg(name: str) -> str:
    """An argparse type for group names (the rule of queue names)."""
    try:
        return check_group(name)
    except mesh.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_groups(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "groups",
        help="list a queue's groups: jobs queued, running against the cap, settings",
        description="List the groups of QUEUE that hold jobs, are paused or have settings "
        "of their own, the most jobs queued first (at most --limit), then the totals of all "
        "groups and the queue's default settings for every group. Read only.",
    )
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument(
        "--limit",
        type=count_arg("limit", 1, 10_000),
        default=20,
        metavar="N",
        help="list at most N groups (default 20)",
    )
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the look as JSON")
    p.set_defaults(func=_groups)


def _add_group(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "group",
        help="pause, resume, configure or clear one group of a queue",
        description="Act on group GROUP of QUEUE across the whole mesh.",
    )
    gsub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (
        ("pause", "no worker starts a job of the group until resumed (running ones go on)"),
        ("resume", "the group's jobs start again"),
        ("clear", "remove the group's own settings: it follows the queue's default again"),
    ):
        a = gsub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        _queue_group(a)
        a.set_defaults(func=_group_action)
    c = gsub.add_parser(
        "configure",
        help="set the group's concurrency, rate limit or weight",
        description="Set the settings of GROUP (those not given keep their value, or the "
        "queue's default); without options, show them. They hold across the whole mesh "
        "from the next claim on.",
    )
    _queue_group(c)
    add_settings_options(c, "")
    c.set_defaults(func=_group_configure)


def _queue_group(p: argparse.ArgumentParser) -> None:
    p.add_argument("queue", metavar="QUEUE", type=queue_arg)
    p.add_argument("group", metavar="GROUP", type=group_arg)
    add_target_options(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def add_settings_options(p: argparse.ArgumentParser, prefix: str) -> None:
    """``--concurrency``, ``--rate`` and ``--weight`` of a group (with
    ``prefix`` "group-": the queue's default, for ``mesh configure``)."""
    what = "every group's default " if prefix else ""
    api = prefix.replace("-", "_")  # the client's keyword: group_weight
    p.add_argument(
        f"--{prefix}concurrency",
        type=count_arg(f"{api}concurrency"),
        metavar="N",
        help=f"{what}most jobs running at once across the mesh (0: no cap; 1: strict order)",
    )
    p.add_argument(
        f"--{prefix}rate",
        type=rate_arg,
        metavar="N[/S]",
        help=f"{what}most jobs started per S seconds (default 1) across the mesh (0: none)",
    )
    p.add_argument(
        f"--{prefix}weight",
        type=count_arg(f"{api}weight", 1, 1000),
        metavar="N",
        help=f"{what}share of the claims against the other ready groups (1 to 1000)",
    )


def settings_text(s: GroupSettings) -> str:
    """``concurrency=2 rate=5/1s weight=3``, "-" for a setting not set."""
    rate = "-" if s.rate_limit is None else f"{s.rate_limit}/{s.rate_period or 1:g}s"
    return f"concurrency={_or_dash(s.concurrency)} rate={rate} weight={_or_dash(s.weight)}"


def _or_dash(v: int | None) -> str:
    return "-" if v is None else str(v)


def _group_json(g: GroupInfo) -> dict[str, Any]:
    out = attrs.asdict(g)
    out["settings"] = attrs.asdict(g.settings)
    out["own"] = attrs.asdict(g.own)
    return out


def _look_json(queue: str, look: GroupsLook) -> dict[str, Any]:
    return {
        "queue": queue,
        "groups": [_group_json(g) for g in look.groups],
        "total": look.total,
        "queued": look.queued,
        "running": look.running,
        "delayed": look.delayed,
        "default": attrs.asdict(look.default),
    }


def _row(g: GroupInfo) -> list[object]:
    s = g.settings
    cap = "-" if not s.concurrency else str(s.concurrency)
    rate = "-" if not s.rate_limit else f"{s.rate_limit}/{s.rate_period:g}s"
    state = "ready" if g.ready else ("waiting" if g.waiting_until else "-")
    return [
        g.name,
        g.queued,
        f"{g.running}/{cap}",
        g.delayed,
        s.weight,
        rate,
        "yes" if g.paused is not None else "-",
        state,
    ]


def _groups(args: argparse.Namespace) -> int:
    t = target(args)

    async def go(client: mesh.Client) -> int:
        look = await client.groups(args.queue, limit=args.limit)
        if args.json:
            dump_json(_look_json(args.queue, look))
            return 0
        if look.groups:
            headers = ["GROUP", "QUEUED", "RUNNING/CAP", "DELAYED", "WEIGHT", "RATE"]
            headers += ["PAUSED", "READY"]
            for line in table(headers, map(_row, look.groups), "QUEUED RUNNING/CAP DELAYED"):
                print(line)
        else:
            print(f"{args.queue}: no groups")
        shown = f", {len(look.groups)} shown" if look.total > len(look.groups) else ""
        print(
            f"{look.total} group{'' if look.total == 1 else 's'}{shown}: {look.queued} queued, "
            f"{look.running} running, {look.delayed} delayed"
        )
        print(f"default for every group: {settings_text(look.default)}")
        return 0

    return run_client(t, go)


def _group_action(args: argparse.Namespace) -> int:
    t = target(args)

    async def go(client: mesh.Client) -> int:
        q, g = args.queue, args.group
        if args.action == "clear":
            await client.clear_group(q, g)
            result: dict[str, Any] = {"queue": q, "group": g, "cleared": True}
            text = f"{q} group {g}: own settings cleared (the queue's default applies)"
        else:
            pause = args.action == "pause"
            fn = client.pause_group if pause else client.resume_group
            changed = await fn(q, g)
            result = {"queue": q, "group": g, "paused": pause, "changed": changed}
            text = f"{q} group {g}: {args.action}d" + ("" if changed else " (no change)")
        if args.json:
            dump_json(result)
        else:
            print(text)
        return 0

    return run_client(t, go)


def _group_configure(args: argparse.Namespace) -> int:
    t = target(args)
    opts = _settings_given(args, "")

    async def go(client: mesh.Client) -> int:
        q, g = args.queue, args.group
        if opts:
            own = await client.configure_group(q, g, **opts)
        else:
            own = await _own_settings(client, q, g)
        if args.json:
            dump_json({"queue": q, "group": g, "own": attrs.asdict(own)})
        else:
            print(f"{q} group {g}: {settings_text(own)} (-: the queue's default)")
        return 0

    return run_client(t, go)


async def _own_settings(client: mesh.Client, queue: str, group: str) -> GroupSettings:
    """The own settings of ``group`` (none: all None)."""
    r = client.reads
    return await read_group_settings(r.check(), r.keys, queue, group)


def _settings_given(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The group settings given as options (``prefix`` "group_" for the
    queue's default), as keyword arguments of the client's calls."""
    names = {"concurrency": "concurrency", "rate": "rate_limit", "weight": "weight"}
    out = {}
    for opt, kw in names.items():
        v = getattr(args, prefix + opt)
        if v is not None:
            out[(prefix + kw) if prefix else kw] = v
    return out


def group_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """``mesh configure``'s ``--group-*`` options as keyword arguments of
    :meth:`mesh.Client.configure` (``group_concurrency``, ...)."""
    return _settings_given(args, "group_")


def rate_arg(text: str) -> tuple[int, float]:
    """An argparse type: a group's rate limit, ``N`` (per second) or
    ``N/S`` (per S seconds), refused as the client would refuse it."""
    n, slash, per = text.partition("/")
    try:
        count = int(n)
        seconds = float(per) if slash else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"not N or N/S: {text!r}") from None
    try:
        group_fields(None, (count, seconds), None)
    except mesh.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return count, seconds
