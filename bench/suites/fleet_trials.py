"""Fleets at scale: failover and cancel latency inside a large fleet, and a
fleet's rejoin (issue 14).

``python -m bench.suites.fleet_trials latency [--procs 10] [--per 1000] [--ttl 3]
[--kills 8] [--cancels 40]``: ``--procs`` OS processes, each one
:func:`mesh.open_fleet` of ``--per`` idle workers (``bench.children.mesh_child hold
--fleet``), serve the queue ``devices``. *Failover*: a persistent task of its
own per trial; once it runs, its owner's whole OS process (``--per``
workers) gets SIGKILL; the time until the task's handler starts in another
process (CLOCK_MONOTONIC, noted by the children), then a fresh process of
``--per`` workers replaces it. *Cancel*: a persistent task runs;
``client.cancel()``; the time until its handler saw the cancellation,
counted from before the call and from when it returned.

``python -m bench.suites.fleet_trials rejoin [--workers 5000] [--ttl 3] [--trials 3]``: one
fleet of ``--workers`` idle workers; Redis stops answering for R + 0.5 s
(``CLIENT PAUSE``), so every worker fences itself and rejoins under a new
id. Redis CPU is sampled every 100 ms from the end of the pause (``INFO
cpu``): the peak and the total, and the time until every worker is
registered again; with the fleet's join pacing off (``join_window=0``: all at
once) and on (the default, TTL / 2), alternating, in one run.

``python -m bench.suites.fleet_trials stop [--workers 1000] [--ttl 3] [--trials 3]``: one
fleet of ``--workers`` workers, each running one persistent task of its own;
the fleet's block is cancelled from outside (the child's stdin closes, and it
cancels the nursery around the fleet: the trio way to stop a service). The
time until every task is back in the queue (polled every 5 ms), and until the
process has exited.

Each starts its own redis-server (127.0.0.1, a free port).
``python -m bench --only fleet_trials`` runs all three (smaller with
``--quick``) as a section of the report.
"""

from __future__ import annotations

import argparse
import itertools
import math
import secrets
import signal
import sys
import time
from functools import partial

import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Section, figures_of
from .._util import Child, Children, children, mesh_child, percentile, poll_until, redis_cpu

QUEUE = "devices"


def load() -> str:
    """The 1-minute load average now."""
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def hold_argv(url: str, ns: str, workers: int, ttl: float, *extra: str) -> list[str]:
    return mesh_child(
        "hold", "--fleet", "--url", url, "--ns", ns, "--queue", QUEUE,
        "--workers", str(workers), "--ttl", str(ttl), "--concurrency", "1", *extra,
    )  # fmt: skip


async def spawn_fleet(kids: Children, name: str, argv: list[str]) -> tuple[Child, list[str]]:
    """A fleet child, once every worker of it serves the queue."""
    child = await kids.spawn(name, argv)
    ids: list[str] = []
    while True:
        line = await child.expect("", 600)
        if line == "ready":
            return child, ids
        if line.startswith("worker "):
            ids.append(line.split()[1])


class Notes:
    """Routes the children's lines: handler starts by task, the rest to
    each child's own channel (answers to ``dump``)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.starts: dict[str, list[tuple[Child, int]]] = {}
        self._changed = trio.Event()
        self.other: dict[Child, trio.MemoryReceiveChannel[str]] = {}
        self._other_send: dict[Child, trio.MemorySendChannel[str]] = {}

    def watch(self, child: Child) -> None:
        send, receive = trio.open_memory_channel[str](math.inf)
        self.other[child], self._other_send[child] = receive, send
        self._nursery.start_soon(self._pump, child)

    async def _pump(self, child: Child) -> None:
        while (line := await child.lines.receive()) is not None:
            if line.startswith("start "):
                _, task, ns = line.split()
                self.starts.setdefault(task, []).append((child, int(ns)))
                self._changed.set()
                self._changed = trio.Event()
            else:
                self._other_send[child].send_nowait(line)

    async def start_of(self, task: str, nth: int, within: float) -> tuple[Child, int]:
        """The ``nth`` (0-based) start of ``task``'s handler: (child, ns)."""
        with trio.fail_after(within):
            while len(self.starts.get(task, [])) <= nth:
                await self._changed.wait()
        return self.starts[task][nth]

    async def cancelled(self, child: Child, task: str) -> int:
        """When ``task``'s handler in ``child`` saw its cancellation (ns)."""
        while True:
            await child.send("dump")
            found = None
            while (line := await self.other[child].receive()) != "end":
                kind, t, ns = line.split()
                if kind == "cancelled" and t == task:
                    found = int(ns)
            if found is not None:
                return found
            await trio.sleep(0.001)


async def cancel_trials(client: mesh.Client, notes: Notes, cancels: int) -> dict[str, object]:
    """``cancels`` times: ensure a task, then cancel it once it runs; how long
    until it started, and until its handler saw the cancel (from the call,
    and from its return)."""
    out: dict[str, object] = {}
    before: list[float] = []
    after: list[float] = []
    first_start: list[float] = []  # ensure() called -> handler started
    for i in range(cancels):
        task = f"c{i}"
        t_ensure = time.monotonic_ns()
        await client.ensure(QUEUE, task)
        owner, started = await notes.start_of(task, 0, 120)
        first_start.append((started - t_ensure) / 1e6)
        a = time.monotonic_ns()
        assert await client.cancel(QUEUE, task) == 1
        b = time.monotonic_ns()
        seen = await notes.cancelled(owner, task)
        before.append((seen - a) / 1e6)
        after.append((seen - b) / 1e6)
    out["cancel_trials"] = cancels
    out["ensure_to_start_ms_p50"] = round(percentile(first_start, 50), 2)
    out["ensure_to_start_ms_max"] = round(max(first_start), 2)
    out["cancel_from_call_ms_p50"] = round(percentile(before, 50), 3)
    out["cancel_from_call_ms_p99"] = round(percentile(before, 99), 3)
    out["cancel_after_return_ms_p50"] = round(percentile(after, 50), 3)
    out["cancel_after_return_ms_p99"] = round(percentile(after, 99), 3)
    out["cancel_after_return_ms_max"] = round(max(after), 3)
    return out


async def latency(procs: int, per: int, ttl: float, kills: int, cancels: int) -> dict[str, object]:
    ns = "fl" + secrets.token_hex(3)
    out: dict[str, object] = {}
    with run_redis_server() as server:
        url = server.url
        async with (
            children() as kids,
            mesh.open_client(url, namespace=ns) as client,
            trio.open_nursery() as nursery,
        ):
            notes = Notes(nursery)
            t = time.monotonic()
            live: list[Child] = []
            n = 0
            for _ in range(procs):
                child, _ = await spawn_fleet(
                    kids, f"fleet {n}", hold_argv(url, ns, per, ttl, "--notes")
                )
                notes.watch(child)
                live.append(child)
                n += 1
            out["workers"] = procs * per
            out["started_in_s"] = round(time.monotonic() - t, 1)
            await trio.sleep(2 * ttl)  # settled: a few heartbeats each
            load_before = load()
            cpu0, t0 = await redis_cpu(client._conn), time.monotonic()
            await trio.sleep(10)
            out["idle_redis_cpu_percent"] = round(
                100 * (await redis_cpu(client._conn) - cpu0) / (time.monotonic() - t0), 1
            )

            # cancel latency first (the fleet as started)
            out.update(await cancel_trials(client, notes, cancels))

            # failover: the owner's whole process (``per`` workers) killed
            takeovers: list[float] = []
            for trial in range(kills):
                task = f"fo{trial}"
                if trial:
                    await client.cancel(QUEUE, f"fo{trial - 1}")
                await client.ensure(QUEUE, task)
                owner, _ = await notes.start_of(task, 0, 30)
                t0_ns = time.monotonic_ns()
                owner.signal(signal.SIGKILL)
                peer, start_ns = await notes.start_of(task, 1, ttl + 30)
                assert peer is not owner
                takeovers.append((start_ns - t0_ns) / 1e9)
                await owner.kill()
                live.remove(owner)
                child, _ = await spawn_fleet(
                    kids, f"fleet {n}", hold_argv(url, ns, per, ttl, "--notes")
                )
                notes.watch(child)
                live.append(child)
                n += 1
                await trio.sleep(ttl)  # the new process settles
            out["kills"] = kills
            out["killed_per_kill"] = per
            out["failover_s_p50"] = round(percentile(takeovers, 50), 3)
            out["failover_s_max"] = round(max(takeovers), 3)
            out["failover_p50_over_ttl"] = round(percentile(takeovers, 50) / ttl, 3)
            out["failover_max_over_ttl"] = round(max(takeovers) / ttl, 3)
            out["failover_all_s"] = " ".join(f"{x:.3f}" for x in takeovers)
            out["load_before"] = load_before
            out["load_after"] = load()
            nursery.cancel_scope.cancel()
    return out


async def registered_again(conn: Connection, k: Keys, n: int, old: set[str]) -> bool:
    if int(await conn.execute("ZCARD", k.workers)) != n:
        return False
    ids = {w.decode() for w in await conn.execute("ZRANGE", k.workers, 0, -1)}
    return not ids & old


async def one_rejoin(url: str, workers: int, ttl: float, window: float | None) -> dict[str, float]:
    ns = "rj" + secrets.token_hex(3)
    k = Keys(ns)
    extra = [] if window is None else ["--join-window", str(window)]
    async with children() as kids, open_connection(url, reply_timeout=60) as conn:
        child, ids = await spawn_fleet(kids, "fleet", hold_argv(url, ns, workers, ttl, *extra))
        await trio.sleep(2 * ttl)
        r = 2 * ttl / 3
        pause_ms = int((r + 0.5) * 1000)
        await conn.execute("CLIENT", "PAUSE", str(pause_ms))
        # our next command waits for the pause to end: samples from then on
        samples = [(time.monotonic(), await redis_cpu(conn))]
        t0 = samples[0][0]
        done = None
        died = ""
        while time.monotonic() - t0 < 60:
            await trio.sleep(0.1)
            samples.append((time.monotonic(), await redis_cpu(conn)))
            if child.proc.returncode is not None:
                # the storm can starve the fleet's process past its reply
                # timeout; its last words say how it ended
                died = child.stderr_tail(400).strip().splitlines()[-1]
                break
            if done is None and await registered_again(conn, k, workers, set(ids)):
                done = time.monotonic() - t0
            if done is not None and time.monotonic() - t0 > done + 1:
                break
        await child.kill()
    if died:
        print(f"the fleet process died: {died}", file=sys.stderr)
    rates = [(c1 - c0) / (s1 - s0) for (s0, c0), (s1, c1) in itertools.pairwise(samples)]
    end = [i for i, (s, _) in enumerate(samples) if s - t0 <= (done or 60)][-1]
    return {
        "fleet_process_died": float(bool(died)),
        "registered_again_s": round(done, 2) if done is not None else -1.0,
        "peak_redis_cpu_percent": round(100 * max(rates), 1),
        "redis_cpu_s_until_registered": round(samples[end][1] - samples[0][1], 3),
    }


async def rejoin(workers: int, ttl: float, trials: int) -> dict[str, object]:
    out: dict[str, object] = {"workers": workers, "ttl_s": ttl}
    loads = [load()]
    res: dict[str, list[dict[str, float]]] = {
        "all at once (join_window=0)": [],
        "paced (default)": [],
    }
    with run_redis_server() as server:
        for _ in range(trials):
            for label, window in (("all at once (join_window=0)", 0.0), ("paced (default)", None)):
                res[label].append(await one_rejoin(server.url, workers, ttl, window))
                print(label, res[label][-1], file=sys.stderr)
    loads.append(load())
    for label, rs in res.items():
        for key in rs[0]:
            out[f"{label}: {key}"] = " ".join(str(r[key]) for r in rs)
    out["load"] = " -> ".join(loads)
    return out


async def stop(workers: int, ttl: float, trials: int) -> dict[str, object]:
    back: list[float] = []
    exited: list[float] = []
    loads = [load()]
    with run_redis_server() as server:
        for _ in range(trials):
            ns = "fs" + secrets.token_hex(3)
            procs, queue = Keys(ns).procs(QUEUE), Keys(ns).queue(QUEUE)
            async with (
                children() as kids,
                open_connection(server.url) as conn,
                mesh.open_client(server.url, namespace=ns) as client,
            ):
                child, _ = await spawn_fleet(kids, "fleet", hold_argv(server.url, ns, workers, ttl))
                await client.ensure_many(QUEUE, [f"dev-{i}" for i in range(workers)])
                await poll_until(
                    partial(_at_least, conn, "HLEN", procs, workers), interval=0.05,
                    within=120,
                )  # fmt: skip
                t0 = trio.current_time()
                assert child.proc.stdin is not None
                await child.proc.stdin.aclose()
                t1 = await poll_until(
                    partial(_at_least, conn, "LLEN", queue, workers), interval=0.005,
                    within=60,
                )  # fmt: skip
                back.append(t1 - t0)
                with trio.fail_after(60):
                    await child.proc.wait()
                exited.append(trio.current_time() - t0)
                print(f"back {back[-1]:.3f} s, exited {exited[-1]:.3f} s", file=sys.stderr)
    loads.append(load())
    return {
        "workers (one OS process, one persistent task each)": workers,
        "every task back in the queue after (s)": " ".join(f"{x:.3f}" for x in back),
        "the process exited after (s)": " ".join(f"{x:.3f}" for x in exited),
        "load": " -> ".join(loads),
    }


async def _at_least(conn: Connection, command: str, key: str, n: int) -> bool:
    return int(await conn.execute(command, key)) >= n


async def suite(ctx: Context) -> Section:
    """The three scenarios as a section of the report, ``ctx.runs`` trials
    each (latency: as many rounds of kills and cancels)."""
    q = ctx.quick
    section = Section(
        "fleet_trials", "Fleets at scale: failover, cancel, rejoin and stop", METHOD, runs=ctx.runs
    )
    procs, per = (3, 100) if q else (10, 1000)
    kills, cancels = (2, 5) if q else (8, 40)
    scenarios = [
        (
            f"latency, {procs} fleets of {per:,}",
            ctx.runs,
            partial(latency, procs, per, 3.0, kills, cancels),
        ),
        ("rejoin", 1, partial(rejoin, 500 if q else 5000, 3.0, ctx.runs)),
        ("stop", 1, partial(stop, 100 if q else 1000, 3.0, ctx.runs)),
    ]
    for scenario, times, measure in scenarios:
        ctx.log(f"fleet_trials: {scenario}")
        figures, notes = figures_of(scenario, [await measure() for _ in range(times)])
        section.figures += figures
        section.notes += notes
    return section


METHOD = """
Measured by `bench/suites/fleet_trials.py` (its docstring has the details):
*latency*: OS processes, each one fleet of idle workers; a persistent task's
owner process gets SIGKILL (the time until the task's handler starts in
another process), and `client.cancel()` of a running task (the time until its
handler saw it); *rejoin*: one fleet whose Redis stops answering for R + 0.5 s,
so every worker fences itself and rejoins: Redis CPU and the time until all
are registered again, with the join pacing off and on; *stop*: a fleet whose
block is cancelled from outside: the time until every task is back in the
queue and until the process exited. TTL 3 s.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--procs", type=int, default=10)
    lat.add_argument("--per", type=int, default=1000)
    lat.add_argument("--ttl", type=float, default=3.0)
    lat.add_argument("--kills", type=int, default=8)
    lat.add_argument("--cancels", type=int, default=40)
    rj = sub.add_parser("rejoin")
    rj.add_argument("--workers", type=int, default=5000)
    rj.add_argument("--ttl", type=float, default=3.0)
    rj.add_argument("--trials", type=int, default=3)
    st = sub.add_parser("stop")
    st.add_argument("--workers", type=int, default=1000)
    st.add_argument("--ttl", type=float, default=3.0)
    st.add_argument("--trials", type=int, default=3)
    args = ap.parse_args(argv)
    res: dict[str, object]
    if args.what == "latency":
        res = trio.run(latency, args.procs, args.per, args.ttl, args.kills, args.cancels)
    elif args.what == "stop":
        res = trio.run(stop, args.workers, args.ttl, args.trials)
    else:
        res = trio.run(rejoin, args.workers, args.ttl, args.trials)
    for key, v in res.items():
        print(f"{key}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
