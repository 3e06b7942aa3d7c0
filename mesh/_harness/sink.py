"""The fenced sink: the downstream system that every handler of the fault
tests reports to, and the referee of "one owner at a time".

It lives in a redis-server of its own (not the mesh's: killing or stalling the
mesh's Redis must not lose what the sink saw). Every report is one Lua call
that reads the sink's clock (``TIME``), so all events are ordered and timed by
one clock. Two kinds of report:

* an **action** (``start``, ``act``, ``done``) is *fenced*: the sink keeps the
  highest token seen per task and refuses a lower one, like a storage system
  that checks fencing tokens. Refused actions are recorded too (``ok`` false).
* a **note** (``cancelled``, ``ready``, ``id``, ``log``, ...) is recorded
  without a check.

Layout under a per-run prefix ``P``: ``P:hi`` HASH task -> highest accepted
token; ``P:ev`` STREAM of events with fields t (µs), a (action), ok, f
(fenced), task, tok, w (worker id), tag (which OS process), x (extra).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import attrs

REPORT_LUA = b"""
local t = redis.call('TIME')
local now = t[1] .. string.format('%06d', tonumber(t[2]))
local ok = 1
if ARGV[5] == '1' then
  local tok = tonumber(ARGV[2])
  local hi = redis.call('HGET', KEYS[1], ARGV[1])
  if hi and tonumber(hi) > tok then
    ok = 0
  elseif (not hi) or tonumber(hi) < tok then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  end
end
redis.call('XADD', KEYS[2], '*', 't', now, 'a', ARGV[4], 'ok', ok, 'f', ARGV[5],
  'task', ARGV[1], 'tok', ARGV[2], 'w', ARGV[3], 'tag', ARGV[6], 'x', ARGV[7])
return ok
"""

FENCED_ACTIONS = ("start", "act", "done")


def keys(prefix: str) -> tuple[str, str]:
    return f"{prefix}:hi", f"{prefix}:ev"


def report_command(
    prefix: str,
    task: bytes,
    token: int,
    worker: str,
    action: str,
    *,
    tag: str = "",
    extra: str = "",
) -> tuple[Any, ...]:
    """The ``EVAL`` command of one report (fenced if ``action`` is an action)."""
    hi, ev = keys(prefix)
    fenced = "1" if action in FENCED_ACTIONS else "0"
    return ("EVAL", REPORT_LUA, 2, hi, ev, task, token, worker, action, fenced, tag, extra)


async def now_us(conn: Any) -> int:
    """The sink's clock, in µs (the clock every event is stamped with)."""
    s, us = await conn.execute("TIME")
    return int(s) * 1_000_000 + int(us)


@attrs.frozen
class Event:
    seq: int  # position in the sink's serial order
    t: float  # seconds, sink clock
    action: str
    ok: bool
    fenced: bool
    task: bytes
    token: int
    worker: str
    tag: str
    extra: str


def _event(seq: int, flat: list[bytes]) -> Event:
    f = {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}
    return Event(
        seq,
        int(f[b"t"]) / 1e6,
        f[b"a"].decode(),
        f[b"ok"] == b"1",
        f[b"f"] == b"1",
        f[b"task"],
        int(f[b"tok"]),
        f[b"w"].decode(),
        f[b"tag"].decode(),
        f[b"x"].decode(errors="replace"),
    )


class EventLog:
    """The sink's events of one run, read incrementally."""

    def __init__(self, conn: Any, prefix: str) -> None:
        self._conn = conn
        self._stream = keys(prefix)[1]
        self._last = b"-"
        self.events: list[Event] = []

    async def update(self) -> list[Event]:
        """Read what is new; returns every event so far."""
        for _ in range(1000):  # 10k events per round
            start = self._last if self._last == b"-" else b"(" + self._last
            batch = await self._conn.execute("XRANGE", self._stream, start, "+", "COUNT", 10_000)
            if not batch:
                break
            for _id, flat in batch:
                self.events.append(_event(len(self.events), flat))
            self._last = batch[-1][0]
        return self.events


@attrs.define
class TaskHistory:
    """Everything one task's owners did, in sink order."""

    task: bytes
    events: list[Event] = attrs.Factory(list)

    def tokens(self) -> list[int]:
        return sorted({e.token for e in self.events if e.fenced})

    def first_action(self, token: int) -> Event | None:
        return next((e for e in self.events if e.fenced and e.ok and e.token == token), None)

    def actions(self, token: int) -> list[Event]:
        return [e for e in self.events if e.fenced and e.token == token]


@attrs.define
class Verdict:
    """What the sink saw, summed up.

    Attributes:
        tasks: tasks with at least one action.
        accepted, rejected: fenced actions accepted / refused (stale token).
        overlaps: (task, stale token, newer token, late attempts) where a
            stale owner attempted more than one action after the newer owner's
            first accepted action (one in-flight action is allowed: it was on
            its way when the owner was paused).
        late_attempts: all attempts of a stale token after a newer one
            started, the allowed in-flight ones included.
        max_owners: the most tokens of one task acting at once, counting an
            owner from its first to its last *accepted* action.
        max_attempting_owners: as ``max_owners``, but to the last *attempted*
            action, minus one allowed in-flight action per owner.
        done_count: one-shot tasks -> how many ``done`` actions were accepted.
    """

    tasks: int = 0
    accepted: int = 0
    rejected: int = 0
    overlaps: list[tuple[bytes, int, int, int]] = attrs.Factory(list)
    late_attempts: int = 0
    max_owners: int = 0
    max_attempting_owners: int = 0
    done_count: dict[bytes, int] = attrs.Factory(dict)

    @property
    def duplicates(self) -> int:
        """One-shot tasks whose ``done`` was accepted more than once."""
        return sum(1 for n in self.done_count.values() if n > 1)


def histories(events: Iterable[Event]) -> dict[bytes, TaskHistory]:
    out: dict[bytes, TaskHistory] = {}
    for e in events:
        if e.fenced or e.action == "cancelled":
            out.setdefault(e.task, TaskHistory(e.task)).events.append(e)
    return out


def _max_concurrent(intervals: list[tuple[int, int]]) -> int:
    """Most intervals (in sink order, inclusive) covering one point."""
    points = sorted(
        [(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals],
        key=lambda p: (p[0], -p[1]),
    )
    best = cur = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


def judge(events: list[Event]) -> Verdict:
    """Check every task's owners against each other (see :class:`Verdict`)."""
    v = Verdict()
    for h in histories(events).values():
        acts = [e for e in h.events if e.fenced]
        if not acts:
            continue
        v.tasks += 1
        v.accepted += sum(e.ok for e in acts)
        v.rejected += sum(not e.ok for e in acts)
        done = sum(1 for e in acts if e.action == "done" and e.ok)
        if any(e.action == "done" for e in acts):
            v.done_count[h.task] = done
        by_tok: dict[int, list[Event]] = defaultdict(list)
        for e in acts:
            by_tok[e.token].append(e)
        firsts = {t: next((e.seq for e in es if e.ok), None) for t, es in by_tok.items()}
        toks = sorted(by_tok)
        for i, t in enumerate(toks):
            newer = [s for u in toks[i + 1 :] if (s := firsts[u]) is not None]
            if not newer:
                continue
            superseded_at = min(newer)
            late = [e for e in by_tok[t] if e.seq > superseded_at]
            v.late_attempts += len(late)
            if len(late) > 1:
                newest = next(u for u in toks[i + 1 :] if firsts[u] == superseded_at)
                v.overlaps.append((h.task, t, newest, len(late)))
        accepted_iv = []
        attempted_iv = []
        for es in by_tok.values():
            ok = [e.seq for e in es if e.ok]
            if ok:
                accepted_iv.append((ok[0], ok[-1]))
            seqs = [e.seq for e in es]
            # one in-flight action of each owner is allowed to come late
            end = seqs[-2] if len(seqs) > 1 and not es[-1].ok else seqs[-1]
            attempted_iv.append((seqs[0], max(seqs[0], end)))
        v.max_owners = max(v.max_owners, _max_concurrent(accepted_iv))
        v.max_attempting_owners = max(v.max_attempting_owners, _max_concurrent(attempted_iv))
    return v
