"""Redis instructions per renewed lease of ``heartbeat.lua``, by version.

``python -m bench.tools.heartbeat_cost [--base REV] [--workers 1000] [--rounds 4]
[--annotate]`` starts its own redis-server under ``valgrind --tool=callgrind``
(127.0.0.1, a free port) and measures, for the scripts of ``REV`` (default
``main``) and of the working tree, what an idle fleet's heartbeats cost Redis:
``--workers`` workers of one namespace, set up as :func:`mesh.open_fleet`'s
workers are (registered, serving their queues, each in its queues' idle sets
after a claim that found nothing, or holding one persistent task), renewed
by ``heartbeat.lua`` calls built by each revision's own
:meth:`mesh._scripts.Binding.heartbeat_many` (as :class:`mesh._renewals.Renewals`
builds them: the due workers in calls of 50; and one per call, as an
``open_worker``'s own heartbeat loop sends it). The shapes:

- ``idle``: one queue, nothing held (``python -m bench --only fleet``'s
  10,000 workers that hold nothing);
- ``idle2``: two queues, nothing held;
- ``held``: one queue, one persistent task held by each worker (the
  fleet suite's comparison of fleets with ``open_worker``s).

Each revision runs in a child process of its own (its ``mesh`` package from
``git archive``, beside its ``protocol/``), so the two may differ in the
heartbeat's arguments and reply; the child sets up its namespace, renews
every lease twice (the balance each worker keeps comes to its steady
state), then ``--rounds`` more times with the counters zeroed before and
dumped after. Printed: instructions per renewed lease inside ``EVALSHA``
(the script's time, as SLOWLOG and ``commandstats`` count it) and for the
whole request (reading and parsing it, the script, writing the reply:
collection is on inside ``readQueryFromClient`` and
``handleClientsWithPendingWrites``), and Redis commands per renewed lease
(``INFO commandstats``, the EVALSHA itself not counted). Repeatable on a
loaded machine: instruction counts do not depend on the load.

With ``--annotate idle/50`` (a shape and a batch size) it also prints the
top of ``callgrind_annotate --inclusive=yes`` for the working tree's calls
of that shape and size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.tools import balance_cost

SHAPES = ("idle", "idle2", "held")
BATCHES = (50, 1)
TOGGLES = ("readQueryFromClient", "handleClientsWithPendingWrites")


@contextmanager
def redis_under_callgrind(tmp: str) -> Iterator[tuple[int, int, str]]:
    """A redis-server on a free loopback port under callgrind, collecting
    inside :data:`TOGGLES` only (:func:`bench.tools.balance_cost.redis_under_callgrind`);
    yields its port, its pid and the output file's name. Killed on the way out."""
    with balance_cost.redis_under_callgrind(tmp, TOGGLES) as (r, pid, out):
        port = int(r.connection_pool.connection_kwargs["port"])
        yield port, pid, out


def totals(f: str) -> tuple[int, int]:
    """(all instructions, those inside evalShaCommand) of a dump."""
    total = None
    for line in Path(f).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            total = int(line.split()[1])
            break
    assert total is not None, f
    a = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", f],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    for line in a.splitlines():
        if line.rstrip().endswith(":evalShaCommand [/usr/bin/redis-server]") or (
            "evalShaCommand" in line and "(" in line
        ):
            return total, int(line.split()[0].replace(",", ""))
    raise RuntimeError(f"no evalShaCommand in {f}")


FLOOR = b"""
-- A floor: what heartbeat.lua cannot do without while a lease is a key of its
-- own, checked by GET and renewed by PEXPIRE (one queue, no acks: workers'
-- leases at KEYS[6 + 3w], incarnations at ARGV[5 + 6(w - 1)]).
local n, lk = tonumber(ARGV[3]), {}
for w = 1, n do lk[w] = KEYS[6 + 3 * w] end
local leases = redis.call('MGET', unpack(lk))
local a = 5
for w = 1, n do
  if leases[w] == ARGV[a] then redis.call('PEXPIRE', lk[w], ARGV[1]) end
  a = a + 6
end
return 1
"""


# --- the child: one revision's mesh package --------------------------------


def child(port: int, pid: int, out: str, ns: str, workers: int, rounds: int) -> None:
    """Set up and measure every shape and batch size with the ``mesh`` on
    ``sys.path`` (one revision's); prints one JSON object."""
    import redis
    import trio

    import mesh
    from mesh._binding import Binding
    from mesh._errors import CommandError
    from mesh._keys import Keys
    from mesh._replies import HeartbeatRequest

    r = redis.Redis(port=port)
    recorded: list[tuple[Any, ...]] | None = None

    class Conn:
        async def execute(self, *args: Any) -> Any:
            if recorded is not None:
                recorded.append(args)
            try:
                return r.execute_command(*args)  # type: ignore[no-untyped-call]
            except redis.ResponseError as exc:
                msg = str(exc)
                raise CommandError(msg, msg.split()[0]) from exc

    conn = Conn()
    ttl = 600_000
    res: dict[str, Any] = {"mesh": mesh.__file__}

    async def setup(shape: str, k: Keys, b: Binding) -> list[str]:
        queues = ["q1", "q2"] if shape == "idle2" else ["q1"]
        ids = [f"w{i}" for i in range(workers)]
        for w in ids:
            await b.register(conn, w, "inc-" + w, ttl, b"{}")
            for q in queues:
                await b.serve(conn, w, "inc-" + w, q)
        if shape == "held":
            for i in range(0, workers, 500):
                await b.ensure(conn, "q1", [b"t%d" % j for j in range(i, min(workers, i + 500))])
        for w in ids:
            for q in queues:
                got = await b.claim(conn, w, "inc-" + w, q, 1, 0, fair=True, ttl_ms=ttl)
                want = 1 if shape == "held" else 0
                assert len(got.processes) == want, (w, q, got)
        for q in queues:
            idle = int(r.scard(k.idle(q)))
            assert idle == (0 if shape == "held" else workers), (q, idle)
        return ids

    async def beat(b: Binding, ids: list[str], queues: tuple[str, ...], batch: int) -> int:
        for i in range(0, len(ids), batch):
            reqs = [HeartbeatRequest(w, "inc-" + w, (), queues) for w in ids[i : i + batch]]
            for o in await b.heartbeat_many(conn, ttl, reqs):
                o.unwrap()
        return len(ids)

    async def measure(run: Callable[[], Awaitable[int]]) -> tuple[int, int, int, str]:
        """(leases run renewed, EVALSHA calls, commands) of ``run``, and the
        callgrind dump of it."""
        r.config_resetstat()
        balance_cost.dump(pid, out)  # zeroes the counters
        n = await run()
        f = balance_cost.dump(pid, out)
        stats = r.info("commandstats")
        cmds = sum(int(v["calls"]) for c, v in stats.items() if c != "cmdstat_evalsha")
        return n, int(stats["cmdstat_evalsha"]["calls"]), cmds, f

    async def main() -> None:
        nonlocal recorded
        for script in Binding(Keys(ns)).scripts.values():
            r.script_load(script.source)
        for shape in SHAPES:
            queues = ("q1", "q2") if shape == "idle2" else ("q1",)
            for batch in BATCHES:
                k = Keys(f"{ns}-{shape}-{batch}")
                b = Binding(k)
                ids = await setup(shape, k, b)
                for _ in range(2):
                    await beat(b, ids, queues, batch)

                async def rounds_of(
                    b: Binding = b,
                    ids: list[str] = ids,
                    queues: tuple[str, ...] = queues,
                    batch: int = batch,
                ) -> int:
                    n = 0
                    for _ in range(rounds):
                        n += await beat(b, ids, queues, batch)
                    return n

                n, calls, cmds, f = await measure(rounds_of)
                res[f"{shape}/{batch}"] = {"leases": n, "calls": calls, "commands": cmds,
                                           "file": f}  # fmt: skip
                if shape == "idle" and batch == 50:
                    # the floor: only the MGET of the leases and a PEXPIRE per
                    # lease, with the same keys and arguments
                    recorded = []
                    await beat(b, ids, queues, batch)
                    sent, recorded = recorded, None
                    sha = r.script_load(FLOOR)

                    async def floor(
                        sent: list[tuple[Any, ...]] = sent, sha: str = sha, leases: int = len(ids)
                    ) -> int:
                        for _ in range(rounds):
                            for c in sent:
                                assert r.evalsha(sha, *c[2:]) == 1
                        return rounds * leases

                    n, calls, cmds, f = await measure(floor)
                    res["floor"] = {"leases": n, "calls": calls, "commands": cmds, "file": f}
                for w in ids:  # the next shape's workers get the whole keyspace
                    r.delete(k.heartbeat(w))

    trio.run(main)
    print(json.dumps(res))


# --- the parent ------------------------------------------------------------


def checkout(rev: str | None, tmp: Path) -> Path:
    """The root holding ``mesh/`` and ``protocol/`` of ``rev`` (None: the
    working tree)."""
    return balance_cost.checkout(rev, tmp).parent


def run_child(root: Path, port: int, pid: int, out: str, ns: str, args: argparse.Namespace) -> Any:
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(
        [
            sys.executable, __file__, "--child", str(port), str(pid), out, ns,
            "--workers", str(args.workers), "--rounds", str(args.rounds),
        ],
        env=env, cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"the child for {root} failed:\n{proc.stderr}")
    res = json.loads(proc.stdout.splitlines()[-1])
    want = str(root / "mesh" / "__init__.py")
    assert res.pop("mesh") == want, f"the child imported another mesh than {want}"
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main", help="git revision to compare with")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--annotate", metavar="SHAPE/BATCH", help="e.g. idle/50: where the working tree's go"
    )
    ap.add_argument("--child", nargs=4, metavar=("PORT", "PID", "OUT", "NS"))
    args = ap.parse_args(argv)
    if args.child:
        port, pid, out, ns = args.child
        child(int(port), int(pid), out, ns, args.workers, args.rounds)
        return 0
    versions = {args.base: args.base, "this": None}
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_under_callgrind(tmp) as (port, pid, out):
        for name, rev in versions.items():
            root = checkout(rev, Path(tmp))
            res[name] = run_child(root, port, pid, out, "hb-" + name.replace("/", "_"), args)
            for key, m in res[name].items():
                f = m.pop("file")
                m["total"], m["eval"] = totals(f)
                if rev is None and key == args.annotate:
                    print(f"--- {key}, the working tree ---")
                    a = subprocess.run(
                        ["callgrind_annotate", "--inclusive=yes", f],
                        check=True, capture_output=True, text=True,
                    ).stdout  # fmt: skip
                    print("\n".join(a.splitlines()[:80]))
    base = args.base
    print(f"{args.workers} workers, {args.rounds} rounds; instructions per renewed lease")
    for shape in SHAPES:
        for batch in BATCHES:
            key = f"{shape}/{batch}"
            for name in versions:
                m = res[name][key]
                n = m["leases"]
                line = (
                    f"{shape:5s} batch {batch:3d} {name:10s} EVALSHA {m['eval'] / n:8.0f}"
                    f"  whole request {m['total'] / n:8.0f}"
                    f"  commands/lease {m['commands'] / n:5.2f}"
                )
                if name != base:
                    b0 = res[base][key]
                    line += (
                        f"  x{m['eval'] / b0['eval']:.3f} (EVALSHA)"
                        f"  x{m['total'] / b0['total']:.3f} (whole) of {base}"
                    )
                print(line)
    for name in versions:
        m = res[name]["floor"]
        base0 = res[base]["idle/50"]["eval"]
        print(
            f"floor (only MGET and PEXPIRE, idle batch 50) {name:10s} EVALSHA "
            f"{m['eval'] / m['leases']:8.0f}  whole request {m['total'] / m['leases']:8.0f}"
            f"  x{m['eval'] / base0:.3f} of {base}'s heartbeat"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
