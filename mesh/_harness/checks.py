"""Where every task is, read atomically from the mesh's Redis, and the
"one place" checks on it.

The snapshot is one read-only Lua script (atomic: no transition can happen
half-way through the read). It builds key names itself, which is fine for a
test tool on a single node (the mesh's own scripts never do). Given the names
of a queue's groups (issue 36), it reads their queued jobs, the queue's
delayed group jobs and its groups hash too: a group's job is then in one of
the places as well, and :func:`group_violations` checks the groups' caps and
running counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import attrs

from mesh._group_reads import parse_group_settings
from mesh._keys import Keys

SNAPSHOT_LUA = b"""
local p = ARGV[1]
local ngroups = tonumber(ARGV[2])
local out = {}
local workers = redis.call('ZRANGE', p .. 'workers', 0, -1)
local wl = {}
for _, w in ipairs(workers) do
  wl[#wl + 1] = {w, redis.call('EXISTS', p .. 'worker:' .. w)}
end
out[1] = wl
local qs = {}
for i = 3 + ngroups, #ARGV do
  local q = ARGV[i]
  local gq = {}
  for j = 3, 2 + ngroups do
    -- a group's queued jobs: those with a priority (their member's payload
    -- after the level and order number), then its list
    local jobs = {}
    for _, m in ipairs(redis.call('ZRANGE', p .. 'gp:' .. q .. '|' .. ARGV[j], 0, -1)) do
      jobs[#jobs + 1] = string.sub(m, 17)
    end
    for _, m in ipairs(redis.call('LRANGE', p .. 'gq:' .. q .. '|' .. ARGV[j], 0, -1)) do
      jobs[#jobs + 1] = m
    end
    gq[#gq + 1] = jobs
  end
  local held = {}
  for _, w in ipairs(workers) do
    held[#held + 1] = redis.call('SMEMBERS', p .. 'held:' .. w .. ':' .. q)
  end
  qs[#qs + 1] = {
    redis.call('LRANGE', p .. 'queue:' .. q, 0, -1),
    redis.call('ZRANGE', p .. 'delayed:' .. q, 0, -1),
    redis.call('HGETALL', p .. 'procs:' .. q),
    redis.call('HGETALL', p .. 'persistent:' .. q),
    redis.call('LRANGE', p .. 'dead:' .. q, 0, -1),
    held,
    redis.call('SMEMBERS', p .. 'standby:' .. q),
    redis.call('HKEYS', p .. 'reserved:' .. q),
    gq,
    redis.call('ZRANGE', p .. 'gdelayed:' .. q, 0, -1),
    redis.call('HGETALL', p .. 'groups:' .. q),
  }
end
out[2] = qs
local t = redis.call('TIME')
out[3] = t[1] * 1000 + math.floor(t[2] / 1000)
return out
"""


@attrs.frozen
class Proc:
    id: str
    worker: str
    persistent: bool
    attempts: int
    payload: bytes
    group: str | None = None  # the group of a group's job (record kind g<level><group>)


@attrs.frozen
class QueueState:
    queued: list[bytes]
    delayed: list[bytes]
    procs: dict[str, Proc]
    persistent: dict[bytes, str]  # running persistent payload -> process id
    dead: list[bytes]
    held: dict[str, set[str]]  # worker -> process ids
    standby: set[bytes]  # persistent payloads queued or delayed
    reserved: list[bytes] = attrs.field(factory=list)  # queued, reserved for a peer (rebalance)
    # groups (issue 36), of the groups named to snapshot(): group -> its queued jobs
    group_queued: dict[str, list[bytes]] = attrs.field(factory=dict)
    # the queue's delayed group jobs: (group, flag "r" retry / "d" delayed, payload)
    group_delayed: list[tuple[str, str, bytes]] = attrs.field(factory=list)
    group_hash: dict[bytes, bytes] = attrs.field(factory=dict)  # {ns}:groups:<Q>


@attrs.frozen
class Snapshot:
    workers: dict[str, bool]  # registered worker -> heartbeat key exists
    queues: dict[str, QueueState]
    now_ms: int

    def places(self, queue: str) -> Counter[bytes]:
        """How many times each payload is in the queue, delayed, running or dead."""
        q = self.queues[queue]
        c: Counter[bytes] = Counter(q.queued)
        c.update(q.reserved)
        c.update(q.delayed)
        c.update(p.payload for p in q.procs.values())
        c.update(q.dead)
        for jobs in q.group_queued.values():
            c.update(jobs)
        c.update(p for _, _, p in q.group_delayed)
        return c

    def owners(self, queue: str, payload: bytes) -> list[Proc]:
        return [p for p in self.queues[queue].procs.values() if p.payload == payload]


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _group_of(kind: bytes) -> str | None:
    """The group of a process record's kind ``g<level><group>``, else None."""
    if kind[:1] == b"g" and kind[1:2].isdigit() and len(kind) > 2:
        return kind[2:].decode()
    return None


async def snapshot(
    conn: Any, keys: Keys, queues: Iterable[str], groups: Iterable[str] = ()
) -> Snapshot:
    """Where every task of ``queues`` is, in one atomic read; with
    ``groups``, the queued jobs of these groups of every queue too (and each
    queue's delayed group jobs and groups hash). Raises what the connection
    raises (nothing is retried)."""
    qs = list(queues)
    gs = list(groups)
    r = await conn.execute("EVAL", SNAPSHOT_LUA, 0, keys.prefix, len(gs), *gs, *qs)
    workers = {w.decode(): bool(e) for w, e in r[0]}
    names = [w.decode() for w, _ in r[0]]
    out = {}
    for q, (queued, delayed, procs, pers, dead, held, standby, reserved, gq, gdel, gh) in zip(
        qs, r[1], strict=True
    ):
        ps = {}
        for pid, rec in _pairs(procs).items():
            parts = rec.split(b"\0", 8)
            ps[pid.decode()] = Proc(
                pid.decode(),
                parts[0].decode(),
                parts[1] == b"p",
                int(parts[2]),
                parts[8],
                _group_of(parts[1]),
            )
        gdelayed = []
        for m in gdel:
            g, _, rest = m.partition(b"\0")  # then the flag, the level, the payload
            gdelayed.append((g.decode(), rest[:1].decode(), rest[2:]))
        # a queued persistent task: in the standby set, or a field of the
        # persistent hash with the value "" (include/to_standby.lua)
        marks = _pairs(pers)
        out[q] = QueueState(
            list(queued),
            list(delayed),
            ps,
            {k: v.decode() for k, v in marks.items() if v},
            list(dead),
            {w: {x.decode() for x in h} for w, h in zip(names, held, strict=True)},
            set(standby) | {k for k, v in marks.items() if not v},
            list(reserved),
            {g: list(jobs) for g, jobs in zip(gs, gq, strict=True)},
            gdelayed,
            _pairs(gh),
        )
    return Snapshot(workers, out, int(r[2]))


def one_place_violations(
    snap: Snapshot,
    persistent: dict[str, set[bytes]],
    oneshot: dict[str, set[bytes]] | None = None,
) -> list[str]:
    """Every violation of "each task instance is in exactly one place".

    Args:
        persistent: per queue, the persistent tasks that must be in the mesh
            (each exactly once: queued, delayed or running; never dead).
        oneshot: per queue, the one-shot payloads (unique) that may be in the
            mesh: each at most once (queued, delayed, running or dead).
    """
    bad: list[str] = []
    for queue, state in snap.queues.items():
        places = snap.places(queue)
        for p in persistent.get(queue, ()):
            if places[p] != 1:
                bad.append(f"{queue}: persistent {p!r} is in {places[p]} places")
            if p in state.dead:
                bad.append(f"{queue}: persistent {p!r} is dead-lettered")
            mark = state.persistent.get(p)
            if mark is not None and p in state.standby:
                bad.append(f"{queue}: persistent {p!r} is both standing by and running as {mark}")
            elif p in state.standby:
                if p not in state.queued and p not in state.delayed and p not in state.reserved:
                    bad.append(f"{queue}: persistent {p!r} is standing by but not queued")
            elif mark is None:
                bad.append(f"{queue}: persistent {p!r} is in neither standby nor persistent")
            else:
                proc = state.procs.get(mark)
                if proc is None or proc.payload != p:
                    bad.append(f"{queue}: persistent {p!r} marked running as {mark}, is not")
        for p in (oneshot or {}).get(queue, ()):
            if places[p] > 1:
                bad.append(f"{queue}: one-shot {p!r} is in {places[p]} places")
        for pid, proc in state.procs.items():
            holders = [w for w, ids in state.held.items() if pid in ids]
            if holders != [proc.worker]:
                bad.append(f"{queue}: process {pid} of {proc.worker} is held by {holders}")
            if proc.worker not in snap.workers:
                bad.append(f"{queue}: process {pid} belongs to unregistered {proc.worker}")
        for w, ids in state.held.items():
            for pid in ids - set(state.procs):
                bad.append(f"{queue}: {w} holds {pid}, which is no process")
    return bad


def owner_violations(snap: Snapshot, queue: str, payloads: Iterable[bytes]) -> list[str]:
    """Every persistent task must be owned by exactly one *live* worker."""
    bad = []
    for p in payloads:
        owners = snap.owners(queue, p)
        if len(owners) != 1:
            bad.append(f"{queue}: {p!r} has {len(owners)} owners")
        elif not snap.workers.get(owners[0].worker):
            bad.append(f"{queue}: {p!r} is owned by {owners[0].worker}, which is not live")
    return bad


def running_by_group(snap: Snapshot, queue: str) -> Counter[str]:
    """How many of each group's jobs of ``queue`` run (processes) now."""
    return Counter(p.group for p in snap.queues[queue].procs.values() if p.group is not None)


def group_violations(snap: Snapshot, queue: str, caps: dict[str, int]) -> list[str]:
    """Every violation of the groups' bookkeeping in ``queue`` (issue 36),
    for a snapshot taken with every group of the queue named:

    * a group of ``caps`` (group -> concurrency) runs more jobs than its cap;
    * a group's count of slots in use (``r:G``) is not, for a group with a
      concurrency cap, its processes plus its retries waiting for their
      backoff (which hold their slot), and for a group without one, its
      retries (a group without a cap counts no job: protocol/README.md):
      a slot leaked, or one counted twice;
    * the count of queued group jobs (``:n``) is not the length of the
      groups' lists and priority sets.
    """
    state = snap.queues[queue]
    bad: list[str] = []
    running = running_by_group(snap, queue)
    for g, cap in caps.items():
        if running[g] > cap:
            bad.append(f"{queue}: group {g!r} runs {running[g]} jobs, above its cap {cap}")
    default = parse_group_settings(state.group_hash.get(b":default"))

    def capped(g: str) -> bool:
        own = parse_group_settings(state.group_hash.get(b"c:" + g.encode()))
        return (own.over(default).concurrency or 0) > 0

    holding = Counter({g: n for g, n in running.items() if capped(g)})
    holding += Counter(g for g, flag, _ in state.group_delayed if flag == "r")
    counted = {f[2:].decode(): int(v) for f, v in state.group_hash.items() if f.startswith(b"r:")}
    for g in sorted(set(counted) | set(holding)):
        if counted.get(g, 0) != holding[g]:
            bad.append(
                f"{queue}: group {g!r} counts {counted.get(g, 0)} slots in use, "
                f"holds {holding[g]} ({'processes and retries' if capped(g) else 'retries'})"
            )
    queued = sum(len(jobs) for jobs in state.group_queued.values())
    n = int(state.group_hash.get(b":n", b"0"))
    if n != queued:
        bad.append(f"{queue}: {n} group jobs counted queued (':n'), {queued} in the groups")
    return bad


# the fields of a groups hash that stay when nothing runs or is queued: the
# settings (a group's own, the queue's default) and how many groups have own
GROUP_SETTINGS_FIELDS = (b":default", b":c")


async def group_leftovers(conn: Any, keys: Keys, queue: str) -> list[str]:
    """What is left of ``queue``'s groups in Redis besides their settings,
    once every job is done: a running count (``r:G``: a leaked slot), a
    paused mark, the clock or queued count, a ready/wait/delayed set, a
    group list, or a token bucket without an expiry. Raises what the
    connection raises."""
    bad: list[str] = []
    fields = await conn.execute("HKEYS", keys.groups(queue))
    for f in fields:
        if not f.startswith(b"c:") and f not in GROUP_SETTINGS_FIELDS:
            bad.append(f"{queue}: field {f.decode()!r} left in {keys.groups(queue)}")
    for key in (keys.group_ready(queue), keys.group_wait(queue), keys.group_delayed(queue)):
        if await conn.execute("EXISTS", key):
            bad.append(f"{queue}: {key} left")
    for pattern in (f"{keys.prefix}gq:{queue}|*", f"{keys.prefix}gp:{queue}|*"):
        for key in await conn.execute("KEYS", pattern):
            bad.append(f"{queue}: {key.decode()} left")
    for key in await conn.execute("KEYS", f"{keys.prefix}grate:{queue}|*"):
        if await conn.execute("PTTL", key) < 0:
            bad.append(f"{queue}: {key.decode()} left without an expiry")
    return bad
