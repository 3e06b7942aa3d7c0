"""Redis instructions of a mass failure's scripts, by version.

``python -m bench.tools.massfail_cost [--base REV] [--tasks 20000] [--empty 200]``
starts its own redis-server under ``valgrind --tool=callgrind
--toggle-collect=evalShaCommand`` (127.0.0.1, a free port) and replays,
for the scripts of ``REV`` (default ``main``) and of the working tree, the
Redis side of ``bench.tools.balance_fleet massfail`` at a smaller scale: 10
workers own ``--tasks`` persistent tasks (claims of 250, fair share on,
as runners make them); 5 of them die (their lease keys go); reapers
recycle them (``recycle.lua``, two dead workers per call, as
:meth:`mesh._supervisor.Reaper._parts` groups them at this size); the 5
survivors claim everything back (claims of 250, fair share on). Then
``--empty`` dead workers that held nothing are recycled, 16 per call and
all in one call (issue 14's fleets: 1,000 idle workers of one process die
at once).

Only the calls measured go as ``EVALSHA`` (counted); the rest as ``EVAL``.
Prints instructions per claimed persistent task (takeover claims), per
recycled process and per empty dead worker: repeatable on a loaded machine.
Both versions are called with the working tree's keys and arguments
(:class:`mesh._scripts.Binding`), so they must share the key layout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis
import trio

from bench.tools.balance_cost import checkout, expand_all, redis_under_callgrind
from bench.tools.script_cost import dump_total
from mesh._binding import Binding
from mesh._errors import CommandError
from mesh._keys import Keys
from mesh._scripts import load_scripts

Q = "devices"
TTL_MS = 600_000


class Conn:
    """An :class:`mesh._scripts.Executor` on a redis-py client that runs one
    version's scripts: ``EVALSHA`` of that version's script while
    ``counted``, ``EVAL`` of its source otherwise."""

    def __init__(self, r: redis.Redis, d: Path) -> None:
        self.r = r
        self.counted = False
        self.src: dict[str, bytes] = {}
        self.sha: dict[str, str] = {}
        here = {s.sha: n for n, s in load_scripts().items()}
        self._name = here
        for name, src in expand_all(d).items():
            self.src[name] = src
            self.sha[name] = r.script_load(src)

    async def execute(self, *args: Any) -> Any:
        if args and args[0] == "EVALSHA":
            name = self._name[args[1]]
            if self.counted:
                args = ("EVALSHA", self.sha[name], *args[2:])
            else:
                args = ("EVAL", self.src[name], *args[2:])
        try:
            return self.r.execute_command(*args)  # type: ignore[no-untyped-call]
        except redis.ResponseError as exc:
            raise CommandError(str(exc)) from exc


async def scenario(
    c: Conn, ns: str, tasks: int, empty: int, pid: int, out: str
) -> dict[str, float]:
    b = Binding(Keys(ns))
    k = b.keys
    ws = [f"w{i}" for i in range(10)]

    async def join(w: str) -> None:
        await b.register(c, w, "inc-" + w, TTL_MS, b"{}")
        await b.serve(c, w, "inc-" + w, Q)

    async def claim_all(who: list[str]) -> int:
        got, busy = 0, True
        while busy:
            busy = False
            for w in who:
                r = await b.claim(c, w, "inc-" + w, Q, 250, 0, fair=True, ttl_ms=TTL_MS)
                got += len(r.processes)
                busy = busy or bool(r.processes)
        return got

    def counted(on: bool) -> None:
        c.counted = on

    for w in ws:
        await join(w)
    for i in range(0, tasks, 1000):
        await b.ensure(c, Q, [b"d%d" % j for j in range(i, min(tasks, i + 1000))])
    await claim_all(ws)
    dead, alive = ws[:5], ws[5:]
    back = 0
    for w in dead:
        c.r.delete(k.heartbeat(w))
        back += int(c.r.scard(k.held(w, Q)))
    dump_total(pid, out)  # zero the counters
    counted(True)
    for i in range(0, len(dead), 2):
        await b.recycle_dead(c, dead[i : i + 2], queues=[Q])
    counted(False)
    rec, _ = dump_total(pid, out)
    counted(True)
    took = await claim_all(alive)
    counted(False)
    cl, _ = dump_total(pid, out)
    assert took == back, (took, back)
    res = {"recycle_per_process": rec / back, "claim_per_task": cl / took}
    for per in dict.fromkeys((16, empty)):
        idle = [f"e{per}-{i}" for i in range(empty)]
        for w in idle:
            await join(w)
            c.r.delete(k.heartbeat(w))
        dump_total(pid, out)
        counted(True)
        for i in range(0, empty, per):
            await b.recycle_dead(c, idle[i : i + per], queues=[Q])
        counted(False)
        n, _ = dump_total(pid, out)
        res[f"empty_worker_{per}_per_call"] = n / empty
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main", help="git revision to compare with")
    ap.add_argument("--tasks", type=int, default=20_000)
    ap.add_argument("--empty", type=int, default=200)
    args = ap.parse_args(argv)
    versions = {args.base: args.base, "this": None}
    res: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_under_callgrind(tmp) as (r, pid, out):
        for name, rev in versions.items():
            c = Conn(r, checkout(rev, Path(tmp)))
            res[name] = trio.run(scenario, c, "mf-" + name, args.tasks, args.empty, pid, out)
    base = res[args.base]
    for what in base:
        for name in versions:
            m = res[name][what]
            print(f"{what:26s} {name:8s} {m:10.0f} instructions  x{m / base[what]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
