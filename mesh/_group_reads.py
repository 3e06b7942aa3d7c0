"""The reads of a queue's groups (see "Groups" in ``protocol/README.md``):
each group's settings, what it holds and whether it is paused, for
:meth:`~mesh.Client.groups`, ``mesh groups``, the console and the exporter.
Nothing here writes.

A queue may have very many groups (a group per tenant or per device): a
look reads at most :data:`SCAN_MAX` of them (those running, paused,
waiting for a token or with settings of their own first, then the ready
ones, then the delayed ones) and returns the ``limit`` with the most jobs
queued; :class:`GroupsLook` says how many groups there were in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ._connection import Connection
from ._eval import run_reads, run_script
from ._keys import Keys
from ._scripts import load_scripts

__all__ = [
    "SCAN_MAX",
    "GroupInfo",
    "GroupSettings",
    "GroupsLook",
    "parse_group_settings",
    "read_group_settings",
    "read_groups",
    "running_jobs",
]

#: The most groups one look reads (see the module's docstring).
SCAN_MAX = 10_000


@attrs.frozen
class GroupSettings:
    """A group's own settings, or a queue's default for every group; None:
    not set (a group then takes the queue's default; the default then is
    no cap, no rate limit, weight 1).

    Attributes:
        concurrency: the most of its jobs running at once across the mesh
            (0: no cap).
        rate_limit: the most of its jobs started per ``rate_period`` (0:
            none).
        rate_period: seconds.
        weight: its share of the claims against the other ready groups.
    """

    concurrency: int | None = None
    rate_limit: int | None = None
    rate_period: float | None = None
    weight: int | None = None

    def over(self, default: GroupSettings) -> GroupSettings:
        """These settings with ``default``'s where these have none, then
        the built-in defaults: what the claim applies."""
        return GroupSettings(
            _first(self.concurrency, default.concurrency, 0),
            _first(self.rate_limit, default.rate_limit, 0),
            _first(self.rate_period, default.rate_period, 1.0),
            _first(self.weight, default.weight, 1),
        )


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def parse_group_settings(raw: bytes | None) -> GroupSettings:
    """Settings from a ``c:G`` or ``:default`` field ("c,r,p,w", each
    possibly empty); all None for None or a malformed value."""
    if not raw:
        return GroupSettings()
    parts = raw.decode(errors="replace").split(",")
    if len(parts) != 4 or not all(p == "" or p.isdigit() for p in parts):
        return GroupSettings()
    c, r, p, w = (int(x) if x else None for x in parts)
    return GroupSettings(c, r, None if p is None else p / 1000, w)


@attrs.frozen
class GroupInfo:
    """One group of a queue, as a look saw it.

    Attributes:
        name: the group.
        queued: its jobs waiting to start.
        running: its jobs running on the mesh (a retry waiting for its
            backoff counts: it holds its place).
        delayed: its jobs waiting for a delay or a retry's backoff.
        paused: since when it is paused (Unix seconds, Redis clock), or None.
        settings: what the claim applies (its own over the queue's default).
        own: its own settings (None where it takes the default).
        ready: whether it may start a job now (jobs queued, below its cap,
            not paused, not waiting for a token).
        waiting_until: when its rate limit gives it a token again (Unix
            seconds), or None.
    """

    name: str
    queued: int
    running: int
    delayed: int
    paused: float | None
    settings: GroupSettings
    own: GroupSettings
    ready: bool
    waiting_until: float | None


@attrs.frozen
class GroupsLook:
    """A look at a queue's groups: the top ones, and totals.

    Attributes:
        groups: at most ``limit`` groups, the most jobs queued first.
        total: how many groups the look found (at most
            :data:`SCAN_MAX` were read one by one).
        queued: jobs queued in all groups.
        delayed: jobs delayed in all groups.
        default: the queue's default settings for every group.
        running: jobs of all groups running on the mesh (a retry waiting
            for its backoff counts).
    """

    groups: list[GroupInfo]
    total: int
    queued: int
    delayed: int
    default: GroupSettings
    running: int = 0


async def read_groups(conn: Connection, keys: Keys, queue: str, limit: int) -> GroupsLook:
    """A look at ``queue``'s groups (see the module's docstring), in two
    round trips: the sets and the hash, then each named group's length.
    ``limit`` 0: the totals only (no group listed). Nothing is written;
    a cancelled call leaves nothing behind.

    Raises:
        MeshConnectionError: Redis could not be reached.
    """
    k = keys
    hash_, ready, wait, delayed, n_ready, n_delayed = await run_reads(
        conn,
        [
            ("HGETALL", k.groups(queue)),
            ("ZRANGE", k.group_ready(queue), 0, SCAN_MAX - 1),
            ("ZRANGE", k.group_wait(queue), 0, SCAN_MAX - 1, "WITHSCORES"),
            ("ZRANGE", k.group_delayed(queue), 0, SCAN_MAX - 1),
            ("ZCARD", k.group_ready(queue)),
            ("ZCARD", k.group_delayed(queue)),
        ],
    )
    fields = _pairs(hash_)
    # slots in use: a group with a cap counts its jobs running and its
    # retries waiting in 'r:G'; a group without one, its retries only (its
    # jobs running are told by their process records)
    running: dict[str, int] = {}
    default = parse_group_settings(fields.get(b":default"))
    for name, n in (await running_jobs(conn, keys, queue)).items():
        if not parse_group_settings(fields.get(b"c:" + name.encode())).over(default).concurrency:
            running[name] = n
    own: dict[str, GroupSettings] = {}
    paused: dict[str, float] = {}
    for f, v in fields.items():
        kind, name = f[:2], f[2:].decode()
        if kind == b"r:":
            running[name] = running.get(name, 0) + int(v)
        elif kind == b"c:":
            own[name] = parse_group_settings(v)
        elif kind == b"p:":
            paused[name] = int(v) / 1000
    waiting = {m.decode(): int(float(s)) / 1000 for m, s in zip(wait[::2], wait[1::2], strict=True)}
    late: dict[str, int] = {}
    for m in delayed:
        g = m.split(b"\0", 1)[0].decode()
        late[g] = late.get(g, 0) + 1
    ready_set = {m.decode() for m in ready if m}
    names = list(dict.fromkeys([*running, *paused, *waiting, *own, *ready_set, *late]))[:SCAN_MAX]
    # each group's queued jobs: its list and its jobs with a priority
    counts = (
        await run_reads(
            conn,
            [
                c
                for g in names
                for c in (("LLEN", k.group_jobs(queue, g)), ("ZCARD", k.group_prio(queue, g)))
            ],
        )
        if names
        else []
    )
    lengths = [int(counts[i]) + int(counts[i + 1]) for i in range(0, len(counts), 2)]
    infos = [
        GroupInfo(
            name=g,
            queued=int(n),
            running=running.get(g, 0),
            delayed=late.get(g, 0),
            paused=paused.get(g),
            settings=own.get(g, GroupSettings()).over(default),
            own=own.get(g, GroupSettings()),
            ready=g in ready_set,
            waiting_until=waiting.get(g),
        )
        for g, n in zip(names, lengths, strict=True)
    ]
    infos.sort(key=lambda i: (-i.queued, -i.running, i.name))
    total = max(len(names), int(n_ready) - (1 if b"" in ready else 0))
    queued = int(fields.get(b":n", b"0"))
    return GroupsLook(infos[:limit], total, queued, int(n_delayed), default, sum(running.values()))


#: bytes of process records one ``peek.lua`` call of :func:`running_jobs`
#: reads before it returns (the rest in the next call)
_PEEK_BUDGET = 16 << 20


async def running_jobs(conn: Connection, keys: Keys, queue: str) -> dict[str, int]:
    """Each group's jobs running in ``queue`` (processes), told by the
    kind in their process records (``peek.lua`` reads each record's head,
    never its payload): O(the queue's processes), in a round trip and one
    per 16 MiB of records. A process that ends meanwhile is not counted.

    Raises:
        MeshConnectionError: Redis could not be reached.
    """
    key = keys.procs(queue)
    rest: list[bytes] = list(await conn.execute("HKEYS", key))
    out: dict[str, int] = {}
    script = load_scripts()["peek"]
    while rest:
        reply = await run_script(conn, script, [key], ["hash", 0, 0, 0, 0, 8, _PEEK_BUDGET, *rest])
        got = reply[1:]
        if not got:
            break
        for e in got:
            if e is not None:
                kind = bytes(e[0]).split(b"\0", 2)[1]
                if kind[:1] == b"g" and len(kind) > 2:
                    name = kind[2:].decode()
                    out[name] = out.get(name, 0) + 1
        rest = rest[len(got) :]
    return out


async def read_group_settings(
    conn: Connection, keys: Keys, queue: str, group: str
) -> GroupSettings:
    """The own settings of ``group`` of ``queue`` (all None: it has none);
    ``group`` "": the queue's default for every group.

    Raises:
        MeshConnectionError: Redis could not be reached.
    """
    field = ":default" if group == "" else "c:" + group
    raw = await conn.execute("HGET", keys.groups(queue), field)
    return parse_group_settings(raw)


def _pairs(reply: Any) -> dict[bytes, bytes]:
    if isinstance(reply, dict):
        return reply
    r: Sequence[Any] = reply
    return {r[i]: r[i + 1] for i in range(0, len(r), 2)}
