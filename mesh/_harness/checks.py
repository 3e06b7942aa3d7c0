"""Where every task is, read atomically from the mesh's Redis, and the
"one place" checks on it.

The snapshot is one read-only Lua script (atomic: no transition can happen
half-way through the read). It builds key names itself, which is fine for a
test tool on a single node (the mesh's own scripts never do).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import attrs

from mesh._keys import Keys

SNAPSHOT_LUA = b"""
local p = ARGV[1]
local out = {}
local workers = redis.call('ZRANGE', p .. 'workers', 0, -1)
local wl = {}
for _, w in ipairs(workers) do
  wl[#wl + 1] = {w, redis.call('EXISTS', p .. 'worker:' .. w)}
end
out[1] = wl
local qs = {}
for i = 2, #ARGV do
  local q = ARGV[i]
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
        return c

    def owners(self, queue: str, payload: bytes) -> list[Proc]:
        return [p for p in self.queues[queue].procs.values() if p.payload == payload]


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


async def snapshot(conn: Any, keys: Keys, queues: Iterable[str]) -> Snapshot:
    qs = list(queues)
    r = await conn.execute("EVAL", SNAPSHOT_LUA, 0, keys.prefix, *qs)
    workers = {w.decode(): bool(e) for w, e in r[0]}
    names = [w.decode() for w, _ in r[0]]
    out = {}
    for q, (queued, delayed, procs, pers, dead, held, standby, reserved) in zip(
        qs, r[1], strict=True
    ):
        ps = {}
        for pid, rec in _pairs(procs).items():
            parts = rec.split(b"\0", 8)
            ps[pid.decode()] = Proc(
                pid.decode(), parts[0].decode(), parts[1] == b"p", int(parts[2]), parts[8]
            )
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
