"""Rebalancing at fleet scale: a rolling restart and a mass failure.

``python -m bench.suites.balance_fleet converge [--tasks 30000] [--ttl 1.5]``: 3
workers (one per OS process, ``bench.children.balance_child``) own ``--tasks``
persistent tasks, 3 more join; the time from the first new worker serving
until every worker holds floor or ceil of the fair share (polled in Redis
every 50 ms), the moves (tasks whose process changed) against the minimum,
and each hand-over's gap (old handler exited -> new handler started, both
noted with CLOCK_MONOTONIC in the children).

``python -m bench.suites.balance_fleet rolling [--peers 10] [--tasks 10000] [--ttl 1.5]``:
``--peers`` workers (one per OS process) own ``--tasks`` persistent tasks;
each in turn is replaced as a deployment with a surge of one replaces it (a
new worker starts, then the old one gets SIGTERM and hands everything back
once its handlers exited), waiting after each until every worker holds
floor or ceil of its fair share. Reports the time, the final spread, and per
task the total gap (the sum over its hand-overs of: old handler exited ->
new handler started): mean, p99 and max over the tasks, and p50/p99 of
single hand-overs, and how many starts came before the old handler's exit
(must be 0).

``python -m bench.suites.balance_fleet massfail [--procs 10] [--per 10]
[--tasks 100000] [--ttl 1.5]`` runs ``--procs`` OS processes of ``--per``
workers each (``bench.children.mesh_child hold``) that own ``--tasks`` persistent
tasks, SIGKILLs half of the processes, and reports, by this process's
monotonic clock from the kill: when every task was held again by a live
worker (the sum of the survivors' held sets, polled every 20 ms; target
TTL + 0.5 s), the spread right then, and when every survivor held floor or
ceil of its fair share again (rebalancing).

Each starts its own redis-server (127.0.0.1, a free port).
``python -m bench --only balance_fleet`` runs all three (smaller with
``--quick``) as a section of the report.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._errors import CommandError
from mesh._keys import Keys
from mesh._scripts import load_scripts
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Section, figures_of
from .._util import Child, Children, children, mesh_child

QUEUE = "devices"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1)))] if xs else 0.0


def child_argv(
    url: str, workers: int, ttl: float, concurrency: int, gc_freeze: bool = False
) -> list[str]:
    return [
        sys.executable, "-m", "bench.children.balance_child", "--url", url, "--ns", "bench",
        "--queue", QUEUE, "--workers", str(workers), "--ttl", str(ttl),
        "--concurrency", str(concurrency), *(["--gc-freeze"] if gc_freeze else []),
    ]  # fmt: skip


async def spawn(
    kids: Children, url: str, ttl: float, concurrency: int, gc_freeze: bool = False
) -> tuple[Child, str, float]:
    """One child with one worker: (child, worker id, monotonic time it was ready)."""
    child = await kids.spawn("peer", child_argv(url, 1, ttl, concurrency, gc_freeze))
    wid = (await child.expect("worker ", 120)).split()[1]
    await child.expect("ready", 120)
    return child, wid, time.monotonic()


async def read_until(child: Child, last: str) -> list[str]:
    """Lines up to ``last`` (not included)."""
    out: list[str] = []
    while True:
        line = await child.lines.receive()
        if line is None or line == last:
            return out
        out.append(line)


async def dump(child: Child) -> list[str]:
    await child.send("dump")
    return await read_until(child, "end")


async def stop(child: Child) -> list[str]:
    """SIGTERM: the worker hands everything back; its last notes."""
    child.signal(signal.SIGTERM)
    notes = await read_until(child, "bye")
    await child.kill()
    return notes


def handovers(notes: list[str]) -> tuple[list[float], dict[str, float], int]:
    """From start/exit notes: every hand-over's gap (an owner's handler
    exited -> the next owner's started), the total gap per task, and how
    many times two owners' handlers of one task ran at once (must be 0).
    A handler with an exit and no start noted ran since before the notes."""
    runs: dict[str, dict[str, list[float]]] = {}
    for line in notes:
        kind, task, when, token = line.split()
        span = runs.setdefault(task, {}).setdefault(token, [-math.inf, math.inf])
        span[0 if kind == "s" else 1] = int(when) / 1e9
    gaps: list[float] = []
    total: dict[str, float] = {}
    overlaps = 0
    for task, spans in runs.items():
        ordered = sorted(spans.values())
        for prev, nxt in itertools.pairwise(ordered):
            if nxt[0] < prev[1]:
                overlaps += 1
            elif prev[1] < math.inf:
                gaps.append(nxt[0] - prev[1])
                total[task] = total.get(task, 0.0) + nxt[0] - prev[1]
    return gaps, total, overlaps


async def live_workers(conn: Connection, k: Keys) -> list[str]:
    """The registered workers whose lease is live. A worker that fenced
    itself (no heartbeat confirmed within R) rejoins under a new id."""
    while True:
        try:
            return await _live_workers(conn, k)
        except CommandError as exc:
            if not str(exc).startswith("BUSY"):
                raise
            # a script has run for more than lua-time-limit: ask again
            print("note: Redis answered BUSY", file=sys.stderr)
            await trio.sleep(0.1)


async def _live_workers(conn: Connection, k: Keys) -> list[str]:
    ids = [w.decode() for w in await conn.execute("ZRANGE", k.workers, 0, -1)]
    alive = await conn.pipeline([("EXISTS", k.heartbeat(w)) for w in ids]) if ids else []
    return [w for w, a in zip(ids, alive, strict=True) if a]


async def wait_balanced(
    conn: Connection, k: Keys, n: int, tasks: int, within: float = 900
) -> float:
    """Until ``n`` live workers hold all ``tasks``, each floor or ceil of
    the fair share; returns the monotonic time."""
    t = time.monotonic()
    while time.monotonic() - t < within:
        ids = await live_workers(conn, k)
        h = await held_by(conn, k, ids) if ids else []
        if len(ids) == n and sum(h) == tasks and max(h) - min(h) <= 1:
            return time.monotonic()
        await trio.sleep(0.05)
    raise RuntimeError(f"not balanced within {within} s: {h}")


async def rejoined(conn: Connection, k: Keys, first: set[str]) -> int:
    """How many live workers are not among the ids the children printed:
    rejoins after fencing themselves."""
    return len(set(await live_workers(conn, k)) - first)


async def ensure_all(client: mesh.Client, tasks: int) -> None:
    for i in range(0, tasks, 10_000):
        await client.ensure_many(QUEUE, [b"d%d" % j for j in range(i, min(tasks, i + 10_000))])


@attrs.frozen
class Peers:
    """A redis-server of this bench's own and what talks to it."""

    url: str
    conn: Connection
    client: mesh.Client
    kids: Children
    k: Keys
    #: (child, worker id, monotonic time it was ready) per peer
    peers: list[tuple[Child, str, float]]


@asynccontextmanager
async def bench_mesh() -> AsyncIterator[Peers]:
    """A redis-server of its own, a connection and a client (namespace
    ``bench``) to it, and a scope for children, with no peer yet."""
    with run_redis_server() as server:
        async with (
            open_connection(server.url) as conn,
            mesh.open_client(server.url, namespace="bench") as client,
            children() as kids,
        ):
            yield Peers(server.url, conn, client, kids, Keys("bench"), [])


@asynccontextmanager
async def balanced_peers(n: int, tasks: int, ttl: float, gc_freeze: bool) -> AsyncIterator[Peers]:
    """:func:`bench_mesh` with ``n`` peers (one worker per OS process) that
    hold ``tasks`` persistent tasks, balanced (the state converge and rolling
    start from); the children are killed on the way out."""
    async with bench_mesh() as m:
        m.peers.extend([await spawn(m.kids, m.url, ttl, tasks, gc_freeze) for _ in range(n)])
        await ensure_all(m.client, tasks)
        await wait_balanced(m.conn, m.k, n, tasks)
        yield m


async def converge(tasks: int, ttl: float, gc_freeze: bool = False) -> dict[str, float | str]:
    async with balanced_peers(3, tasks, ttl, gc_freeze) as m:
        conn, k, peers = m.conn, m.k, m.peers
        before = _pairs(await conn.execute("HGETALL", k.persistent(QUEUE)))
        for c, _, _ in peers:
            await dump(c)
        new = [await spawn(m.kids, m.url, ttl, tasks, gc_freeze) for _ in range(3)]
        t0 = new[0][2]  # the first new worker serves the queue
        peers += new
        done = await wait_balanced(conn, k, 6, tasks)
        await trio.sleep(3 * ttl)  # nothing more moves
        ids = await live_workers(conn, k)
        final = await held_by(conn, k, ids)
        rejoins = await rejoined(conn, k, {p[1] for p in peers})
        after = _pairs(await conn.execute("HGETALL", k.persistent(QUEUE)))
        notes = [line for c, _, _ in peers for line in await dump(c)]
    moves = sum(1 for t, pid in after.items() if before.get(t) != pid)
    gaps, _, overlaps = handovers(notes)
    return {
        "tasks": tasks,
        "ttl_s": ttl,
        "peers": "3 -> 6 (one worker per OS process)",
        "children_gc": "gc.freeze() once serving" if gc_freeze else "python default",
        "balanced_after_s": round(done - t0, 2),
        "all_three_serving_after_s": round(new[-1][2] - t0, 2),
        "moves": moves,
        "minimum_moves": tasks - 3 * (tasks // 6) - min(3, tasks % 6),
        "final_spread": f"{min(final)}-{max(final)}",
        "handover_p50_ms": round(1000 * pct(gaps, 0.5), 2),
        "handover_p99_ms": round(1000 * pct(gaps, 0.99), 2),
        "handover_max_ms": round(1000 * max(gaps), 2) if gaps else 0.0,
        "overlaps": overlaps,
        "rejoins_after_fencing": rejoins,
    }


def _pairs(reply: list[bytes]) -> dict[bytes, bytes]:
    return {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


async def rolling(
    peers_n: int, tasks: int, ttl: float, gc_freeze: bool = False
) -> dict[str, float | str]:
    async with balanced_peers(peers_n, tasks, ttl, gc_freeze) as m:
        conn, k, peers = m.conn, m.k, m.peers
        for c, _, _ in peers:
            await dump(c)
        notes: list[str] = []
        each = []
        t0 = time.monotonic()
        for _ in range(peers_n):
            # as a deployment with a surge of one: the new peer first
            t = time.monotonic()
            old = peers.pop(0)
            peers.append(await spawn(m.kids, m.url, ttl, tasks, gc_freeze))
            notes += await stop(old[0])
            await wait_balanced(conn, k, peers_n, tasks)
            each.append(time.monotonic() - t)
        took = time.monotonic() - t0
        await trio.sleep(3 * ttl)
        final = await held_by(conn, k, await live_workers(conn, k))
        rejoins = await rejoined(conn, k, {p[1] for p in peers})
        for c, _, _ in peers:
            notes += await dump(c)
    gaps, total, overlaps = handovers(notes)
    totals = [total.get(f"d{i}", 0.0) for i in range(tasks)]
    return {
        "peers": peers_n,
        "tasks": tasks,
        "ttl_s": ttl,
        "restart": "each peer: a new one starts, then the old one gets SIGTERM",
        "children_gc": "gc.freeze() once serving" if gc_freeze else "python default",
        "restart_all_s": round(took, 2),
        "restart_each_s_median": round(statistics.median(each), 2),
        "restart_each_s_max": round(max(each), 2),
        "handovers": len(gaps),
        "final_spread": f"{min(final)}-{max(final)}",
        "gap_per_task_mean_ms": round(1000 * statistics.fmean(totals), 2),
        "gap_per_task_p99_ms": round(1000 * pct(totals, 0.99), 2),
        "gap_per_task_max_ms": round(1000 * max(totals), 2),
        "handover_p50_ms": round(1000 * pct(gaps, 0.5), 2),
        "handover_p99_ms": round(1000 * pct(gaps, 0.99), 2),
        "overlaps": overlaps,
        "rejoins_after_fencing": rejoins,
    }


async def held_by(conn: Connection, k: Keys, ids: list[str]) -> list[int]:
    r = await conn.pipeline([("SCARD", k.held(w, QUEUE)) for w in ids])
    return [int(x) for x in r]


async def _hold_group(
    kids: Children, name: str, url: str, per: int, ttl: float, cap: int, extra: list[str]
) -> tuple[Child, list[str]]:
    """One OS process of ``per`` workers (``mesh_child hold``), once it serves,
    and its workers' ids."""
    child = await kids.spawn(
        name,
        mesh_child(
            "hold", "--url", url, "--ns", "bench", "--queue", QUEUE,
            "--workers", str(per), "--ttl", str(ttl), "--concurrency", str(cap), *extra,
        ),
    )  # fmt: skip
    ids: list[str] = []
    while True:
        line = await child.expect("", 120)
        if line == "ready":
            return child, ids
        if line.startswith("worker "):
            ids.append(line.split()[1])


async def _spy_on(survivors: list[Child], ttl: float, spy: str) -> list[trio.Process]:
    """py-spy on every survivor from just before the kill (it does not pause
    them: --nonblocking); flame-graph text per process into ``spy``."""
    spies = []
    for child in survivors:
        argv = [
            "py-spy", "record", "--nonblocking", "-r", "200",
            "-d", str(int(ttl + 6)), "-f", "raw",
            "-o", f"{spy}/survivor-{child.pid}.txt", "-p", str(child.pid),
        ]  # fmt: skip
        spies.append(
            await trio.lowlevel.open_process(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
    await trio.sleep(1.0)
    return spies


@attrs.define
class Takeover:
    """The survivors' held tasks after the kill, polled every 20 ms for at
    most 120 s: when all were held again (and the spread then), and when the
    survivors were balanced."""

    tasks: int
    n_alive: int
    polls: list[tuple[float, int]] = attrs.Factory(list)
    owned_at: float | None = None
    spread_then: tuple[int, int] = (0, 0)
    balanced_at: float | None = None

    async def run(
        self, conn: Connection, k: Keys, survivors: Callable[[], Awaitable[list[str]]], t0: float
    ) -> None:
        while time.monotonic() - t0 < 120:
            ids = await survivors()
            h = await held_by(conn, k, ids)
            now = time.monotonic() - t0
            self.polls.append((now, sum(h)))
            if self.owned_at is None and sum(h) == self.tasks:
                self.owned_at, self.spread_then = now, (min(h), max(h))
            if self.owned_at is not None and len(ids) == self.n_alive and max(h) - min(h) <= 1:
                self.balanced_at = now
                return
            await trio.sleep(0.02)


async def massfail(
    procs: int,
    per: int,
    tasks: int,
    ttl: float,
    spy: str | None = None,
    gc_threshold: int = 0,
    trace: str | None = None,
    gc_freeze: bool = False,
) -> dict[str, float | str]:
    if trace:
        # the children note their script calls (bench.children.mesh_child)
        os.environ["MESH_BENCH_TRACE"] = trace
    async with bench_mesh() as m:
        url, conn, client, kids, k = m.url, m.conn, m.client, m.kids, m.k
        # scripts that held Redis 100 ms or more, reported at the end
        await conn.execute("CONFIG", "SET", "slowlog-log-slower-than", "100000")
        await conn.execute("SLOWLOG", "RESET")
        cap = 2 * tasks // (procs * per) + 100  # what a survivor may come to hold
        extra = [*(["--gc-threshold", str(gc_threshold)] if gc_threshold else [])]
        extra += ["--gc-freeze"] if gc_freeze else []
        groups = [
            await _hold_group(kids, f"hold{i}", url, per, ttl, cap, extra) for i in range(procs)
        ]
        everyone = [w for _, ids in groups for w in ids]
        t = time.monotonic()
        await ensure_all(client, tasks)
        await wait_balanced(conn, k, procs * per, tasks)
        owned_after_ensure = time.monotonic() - t
        await trio.sleep(2 * ttl)  # settled: a few more heartbeats
        doomed = groups[: procs // 2]
        dead_pids = {str(child.pid) for child, _ in doomed}
        survivors = partial(_survivors, conn, k, dead_pids)
        spies = await _spy_on([c for c, _ in groups[procs // 2 :]], ttl, spy) if spy else []
        if trace:
            await _log_every_script_call(conn)
        # fences during the initial claims are not the mass failure's
        live_at_kill = set(await live_workers(conn, k))
        t0 = time.monotonic()
        for child, _ in doomed:
            child.signal(signal.SIGKILL)
        if trace:
            await _note_deadlines(conn, k, trace, t0, [w for _, ids in doomed for w in ids])
        n_alive = procs * per - len(doomed) * per
        watch = Takeover(tasks, n_alive)
        await watch.run(conn, k, survivors, t0)
        for s in spies:
            await s.wait()
        ids = await survivors()
        final = await held_by(conn, k, ids)
        live_now = set(await live_workers(conn, k))
        rejoins = len(live_now - set(everyone))
        fenced_after_kill = len(live_now - live_at_kill)
        if trace:
            await _dump_trace(conn, trace, t0, watch.polls)
            await conn.execute("CONFIG", "SET", "slowlog-log-slower-than", "100000")
        slow, mem = await _slow_and_memory(conn, everything=bool(trace))
    return {
        "processes": procs,
        "workers": procs * per,
        "tasks": tasks,
        "ttl_s": ttl,
        "all_owned_first_s": round(owned_after_ensure, 2),
        "killed_workers": procs * per - n_alive,
        "all_owned_again_after_s": -1.0 if watch.owned_at is None else round(watch.owned_at, 3),
        "target_s": ttl + 0.5,
        "spread_when_owned": "{}-{}".format(*watch.spread_then),
        "balanced_after_s": -1.0 if watch.balanced_at is None else round(watch.balanced_at, 3),
        "final_spread": f"{min(final)}-{max(final)}",
        "fair_share": tasks / n_alive,
        "rejoins_after_fencing": rejoins,
        "survivors_fenced_after_kill": fenced_after_kill,
        "redis_used_memory": mem.strip(),
        "scripts_over_100ms": _slow(slow),
        "children_gc_threshold": gc_threshold or "python default (10)",
        "children_gc": "gc.freeze() once serving" if gc_freeze else "python default",
    }


async def _survivors(conn: Connection, k: Keys, dead_pids: set[str]) -> list[str]:
    """The live workers but those of the processes ``dead_pids``."""
    # worker ids are <host>-<pid>-<random>[.<rejoin>]
    return [w for w in await live_workers(conn, k) if w.rsplit("-", 2)[1] not in dead_pids]


async def _log_every_script_call(conn: Connection) -> None:
    """Every script call of 1 ms or more from here on goes to SLOWLOG (with
    0, the commands inside scripts are logged too, and logging 200,000 of
    them doubled what the scripts cost Redis)."""
    await conn.execute("CONFIG", "SET", "slowlog-max-len", "1000000")
    await conn.execute("CONFIG", "SET", "slowlog-log-slower-than", "1000")
    await conn.execute("SLOWLOG", "RESET")


async def _slow_and_memory(conn: Connection, everything: bool) -> tuple[list[Any], str]:
    """The SLOWLOG entries of 100 ms or more (of all of them when
    ``everything``, else of the last 1,000), and Redis' used memory."""
    slow = [
        e
        for e in await conn.execute("SLOWLOG", "GET", "-1" if everything else "1000")
        if isinstance(e[2], int) and e[2] >= 100_000
    ]
    info = await conn.execute("INFO", "memory")
    mem = next(
        line.split(":")[1]
        for line in info.decode().splitlines()
        if line.startswith("used_memory_human")
    )
    return slow, mem


async def _note_deadlines(
    conn: Connection, k: Keys, trace: str, t0: float, dead: list[str]
) -> None:
    """The killed workers' lease deadlines (Redis clock) as seconds after
    the kill on this process's monotonic clock: ``DIR/deadlines.txt``."""
    redis_s = await _redis_minus_monotonic(conn)
    scores = await conn.pipeline([("ZSCORE", k.workers, w) for w in dead])
    lines = [
        f"{w} {float(sc) / 1000 - redis_s - t0:.4f}"
        for w, sc in zip(dead, scores, strict=True)
        if sc is not None
    ]
    _write(f"{trace}/deadlines.txt", lines)


def _write(path: str, lines: list[str]) -> None:
    with open(path, "w") as f:
        f.writelines(line + "\n" for line in lines)


async def _redis_minus_monotonic(conn: Connection) -> float:
    """Redis time minus this process's monotonic time, in seconds (the
    middle of the round trip)."""
    a = time.monotonic()
    sec, us = await conn.execute("TIME")
    b = time.monotonic()
    return int(sec) + int(us) / 1e6 - (a + b) / 2


async def _dump_trace(
    conn: Connection, trace: str, t0: float, polls: list[tuple[float, int]]
) -> None:
    """``DIR/slowlog.txt``: every command of 1 ms or more Redis ran since
    the kill (claims and recycles; heartbeats are shorter), oldest first:
    ``<unix s> <us> <command or script> <first key>``;
    ``DIR/owned.txt``: ``<s after kill> <tasks held by survivors>`` per poll;
    ``DIR/t0.txt``: the kill, monotonic ns, and Redis time minus
    monotonic time in seconds."""
    names = {s.sha: n for n, s in load_scripts().items()}
    entries = await conn.execute("SLOWLOG", "GET", "-1")
    lines = []
    for e in reversed(entries):
        args = [a.decode(errors="replace") for a in e[3]]
        name = args[0].lower()
        key = args[1] if len(args) > 1 else ""
        if name in ("evalsha", "eval") and len(args) > 3:
            name, key = names.get(args[1], args[1][:12]), args[3]
        lines.append(f"{e[1]} {e[2]} {name} {key}")
    _write(f"{trace}/slowlog.txt", lines)
    _write(f"{trace}/owned.txt", [f"{s:.4f} {n}" for s, n in polls])
    _write(f"{trace}/t0.txt", [f"{int(t0 * 1e9)} {await _redis_minus_monotonic(conn):.6f}"])


def _slow(entries: list[list[object]]) -> str:
    """The slow log as ``<script> x<count> max <ms>``: which scripts held
    Redis 100 ms or more at once."""
    names = {s.sha: n for n, s in load_scripts().items()}
    by: dict[str, list[float]] = {}
    for e in entries:
        args = e[3]
        assert isinstance(args, list)
        name = b" ".join(args[:1]).decode(errors="replace")
        if name.upper() in ("EVALSHA", "EVAL") and len(args) > 1:
            sha = args[1].decode(errors="replace")
            name = names.get(sha, sha[:12])
        us = e[2]
        assert isinstance(us, int)
        by.setdefault(name, []).append(us / 1000)
    return ", ".join(f"{n} x{len(v)} max {max(v):.0f} ms" for n, v in by.items()) or "none"


async def suite(ctx: Context) -> Section:
    """The three scenarios as a section of the report, ``ctx.runs`` times
    each, TTL 1.5 s, the children freezing their GC once serving (as ``mesh
    worker`` does)."""
    q = ctx.quick
    section = Section("balance_fleet", "Rebalancing at fleet scale", METHOD, runs=ctx.runs)
    converge_tasks, peers, rolling_tasks = (600, 3, 300) if q else (30_000, 10, 10_000)
    procs, per, massfail_tasks = (4, 5, 2_000) if q else (10, 10, 100_000)
    scenarios = [
        (
            f"converge 3 -> 6, {converge_tasks:,} tasks",
            partial(converge, converge_tasks, 1.5, True),
        ),
        (
            f"rolling {peers} peers, {rolling_tasks:,} tasks",
            partial(rolling, peers, rolling_tasks, 1.5, True),
        ),
        (
            f"massfail {procs} x {per}, {massfail_tasks:,} tasks",
            partial(massfail, procs, per, massfail_tasks, 1.5, gc_freeze=True),
        ),
    ]
    for scenario, measure in scenarios:
        ctx.log(f"balance_fleet: {scenario}")
        figures, notes = figures_of(scenario, [await measure() for _ in range(ctx.runs)])
        section.figures += figures
        section.notes += notes
    return section


METHOD = """
Measured by `bench/suites/balance_fleet.py` (its docstring has the details),
one worker per OS process unless said: *converge*: 3 workers own the tasks, 3
more join; the time until every worker holds floor or ceil of its fair share,
the moves against the minimum, each hand-over's gap; *rolling*: each peer in
turn replaced as a deployment with a surge of one does it, waiting for the
balance after each; *massfail*: half of the processes of fleets SIGKILLed;
when every task is held again, and when the survivors are balanced again.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("converge")
    c.add_argument("--tasks", type=int, default=30_000)
    c.add_argument("--ttl", type=float, default=1.5)
    r = sub.add_parser("rolling")
    r.add_argument("--peers", type=int, default=10)
    r.add_argument("--tasks", type=int, default=10_000)
    r.add_argument("--ttl", type=float, default=1.5)
    m = sub.add_parser("massfail")
    m.add_argument("--procs", type=int, default=10)
    m.add_argument("--per", type=int, default=10)
    m.add_argument("--tasks", type=int, default=100_000)
    m.add_argument("--ttl", type=float, default=1.5)
    m.add_argument("--py-spy", metavar="DIR", help="record the survivors with py-spy into DIR")
    m.add_argument(
        "--trace",
        metavar="DIR",
        help="a timeline into DIR: the children's script calls, every Redis command's time "
        "after the kill (SLOWLOG), the dead leases' deadlines (bench/findings.md: how the "
        "removed massfail_timeline.py read them)",
    )
    m.add_argument(
        "--gc-threshold",
        type=int,
        default=0,
        help="the children run gc.set_threshold(700, 10, N) (default: Python's, 10)",
    )
    for p in (c, r, m):
        p.add_argument(
            "--gc-freeze",
            action="store_true",
            help="the children call gc.freeze() once serving, as `mesh worker` does",
        )
    args = ap.parse_args(argv)
    res: dict[str, float | str]
    if args.what == "converge":
        res = trio.run(converge, args.tasks, args.ttl, args.gc_freeze)
    elif args.what == "rolling":
        res = trio.run(rolling, args.peers, args.tasks, args.ttl, args.gc_freeze)
    else:
        res = trio.run(
            massfail,
            args.procs,
            args.per,
            args.tasks,
            args.ttl,
            args.py_spy,
            args.gc_threshold,
            args.trace,
            args.gc_freeze,
        )
    for key, v in res.items():
        print(f"{key}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
