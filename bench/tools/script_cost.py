"""Redis instructions per task of a busy runner's scripts, by version.

``python -m bench.tools.script_cost [--base REV] [--tasks 5000] [--annotate]``
starts its own redis-server under ``valgrind --tool=callgrind
--toggle-collect=evalShaCommand`` (127.0.0.1, a free port) and measures, for
the scripts of ``REV`` (default ``main``) and of the working tree, what the
throughput benchmark's worker asks of Redis per task: one worker serving a
one-shot queue claims 10 (``claim.lua``, fair share on, as a runner does),
then reports those 10 finished (``finish.lua``), over and over until
``--tasks`` tasks are done; and the same with results kept
(``finish_results.lua``, a 16-byte value per task); and, for a version that
has it, the two as one call (``finish_claim.lua``: finish the last 10 and
claim 10), as a runner sends them.

The claims and the finishes are measured in separate passes over the same
steady state: in one pass the claims go as ``EVALSHA`` (counted) and the
finishes as ``EVAL`` (not counted, ``evalCommand`` is not inside
``evalShaCommand``), in the other the reverse. The figure is instructions
inside ``EVALSHA`` per task (per call / 10): repeatable on a loaded machine.
Both versions are called with the working tree's keys and arguments
(``mesh._scripts.Binding``), so they must share the key layout.

With ``--annotate`` it also prints the top of ``callgrind_annotate
--inclusive=yes`` of the working tree's claim and finish passes: where the
instructions go (Lua VM, the commands the scripts call, allocation).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench.tools.balance_cost import checkout, dump, expand_all, redis_under_callgrind, total
from mesh._binding import Binding
from mesh._eval import ScriptCall
from mesh._keys import PROTOCOL_VERSION, Keys
from mesh._replies import ResultsToKeep

Q = "jobs"
BATCH = 10


class Version:
    """One version's scripts, loaded into the server."""

    def __init__(self, r: redis.Redis, d: Path) -> None:
        self.r = r
        self.src: dict[str, bytes] = {}
        self.sha: dict[str, str] = {}
        for name, src in expand_all(d).items():
            self.src[name] = src
            self.sha[name] = r.script_load(src)

    def call(self, c: ScriptCall[Any], *, sha: bool = True) -> Any:
        name = c.script.name
        head = ("EVALSHA", self.sha[name]) if sha else ("EVAL", self.src[name])
        return self.r.execute_command(*head, len(c.keys), *c.keys, *c.args)

    def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self.r.evalsha(self.sha[name], len(keys), *keys, *args)


def prepare(v: Version, ns: str, tasks: int) -> tuple[Binding, str, str]:
    b = Binding(Keys(ns))
    k = b.keys
    w, inc = "w0", "inc-w0"
    v.run("register", [k.heartbeat(w), k.workers, k.info, k.version],
          [w, inc, 600_000, b"{}", PROTOCOL_VERSION])  # fmt: skip
    v.run("serve", [k.heartbeat(w), k.serves(w), k.queues, k.servers(Q), k.share(Q)],
          [w, inc, Q, 1])  # fmt: skip
    keys = [k.queue(Q), k.queues, k.persistent(Q), k.standby(Q), k.idle(Q), k.prio(Q)]
    payloads = [b"task-%08d" % i for i in range(tasks)]
    for i in range(0, tasks, 1000):
        v.run("enqueue", keys, [Q, k.wake_prefix, 0, *payloads[i : i + 1000]])
    return b, w, inc


def cycle(v: Version, b: Binding, w: str, inc: str, results: bool, count: str) -> Callable[[], int]:
    """One claim of 10 and the finish of those 10; ``count`` says which of
    the two goes as EVALSHA. Returns how many it claimed."""

    def run() -> int:
        claim = b.claim_call(w, inc, Q, BATCH, 0, fair=True, ttl_ms=600_000)
        r = v.call(claim, sha=count == "claim")
        ids = [x.decode() for x in r[3::4]]
        if not ids:
            return 0
        keep = None
        if results:
            keep = ResultsToKeep(60_000, {pid: (p, b"result-%s" % p[-8:]) for pid, p in
                                          zip(ids, r[6::4], strict=True)})  # fmt: skip
        fin = b.finish_call(w, inc, Q, ids, keep)
        assert all(v.call(fin, sha=count == "finish")), "finish refused"
        return len(ids)

    return run


def merged(v: Version, b: Binding, w: str, inc: str) -> Callable[[], int]:
    """The runner's round trip in one ``finish_claim.lua`` call: finish the
    processes of the last call, claim 10 (counted: EVALSHA). Returns how
    many it finished; 0 once the queue is empty and nothing is left."""
    k = b.keys
    claim = b.claim_call(w, inc, Q, BATCH, 0, fair=True, ttl_ms=600_000)
    keys = [*claim.keys, k.awaiting(Q)]
    args = [*claim.args, k.done_channel(Q)]
    held: list[str] = []
    compact = b"compact" in v.src["finish_claim"]  # its reply's form since 2026-11-28

    def run() -> int:
        reply = v.run("finish_claim", keys, [*args, *held])
        n = len(held)
        assert all(f == 1 for f in reply[len(reply) - n :]), "finish refused"
        body = reply[: len(reply) - n]
        if compact:  # {now, left, due, first id, c, mixed, payloads...}
            held[:] = [str(int(body[3]) + i) for i in range(int(body[4]))]
        else:
            held[:] = [x.decode() for x in body[3::4]]
        return n or len(held)

    return run


def dump_total(pid: int, out: str) -> tuple[int, str]:
    f = dump(pid, out)
    return total(f), f


def measure(pid: int, out: str, run: Callable[[], int]) -> tuple[float, str]:
    """Instructions inside EVALSHA per task of ``run`` (called until it
    returns 0, after a warm-up), and the callgrind file of the count."""
    for _ in range(5):  # warm up: the hashes reach their steady size
        run()
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    done = 0
    while True:
        got = run()
        if got == 0:
            break
        done += got
    total, f = dump_total(pid, out)
    return total / done, f


def main(argv: list[str] | None = None) -> int:
    global BATCH
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="main", help="git revision to compare with")
    ap.add_argument("--tasks", type=int, default=5000)
    ap.add_argument("--annotate", action="store_true")
    ap.add_argument("--batch", type=int, default=10, help="tasks per claim (default 10)")
    args = ap.parse_args(argv)
    BATCH = args.batch
    versions = {args.base: args.base, "this": None}
    res: dict[tuple[str, str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp, redis_under_callgrind(tmp) as (r, pid, out):
        n = 0
        for name, rev in versions.items():
            v = Version(r, checkout(rev, Path(tmp)))
            for results in (False, True):
                for count in ("claim", "finish"):
                    n += 1
                    b, w, inc = prepare(v, f"cost{n}", args.tasks)
                    per_task, f = measure(pid, out, cycle(v, b, w, inc, results, count))
                    what = "finish_results" if results and count == "finish" else count
                    res[(name, "results" if results else "plain", what)] = per_task
                    if args.annotate and rev is None:
                        print(f"--- {what} ({'results' if results else 'plain'}) ---")
                        a = subprocess.run(
                            ["callgrind_annotate", "--inclusive=yes", f],
                            check=True, capture_output=True, text=True,
                        ).stdout  # fmt: skip
                        print("\n".join(a.splitlines()[:60]))
            if "finish_claim" in v.sha:
                # the runner's round trip as one call: finish the last 10, claim 10
                n += 1
                b, w, inc = prepare(v, f"cost{n}", args.tasks)
                res[(name, "plain", "finish_claim")] = measure(pid, out, merged(v, b, w, inc))[0]
    base = args.base
    for shape in ("plain", "results"):
        for name in versions:
            c = res[(name, shape, "claim")]
            fk = "finish_results" if shape == "results" else "finish"
            fin = res[(name, shape, fk)]
            line = f"{shape:8s} {name:10s} claim {c:8.0f}  {fk} {fin:8.0f}  total {c + fin:8.0f}"
            if name != base:
                t0 = res[(base, shape, "claim")] + res[(base, shape, fk)]
                line += f"  x{(c + fin) / t0:.3f} of {base}"
            print(line + "  instructions per task")
            if shape == "plain" and (name, "plain", "finish_claim") in res:
                m = res[(name, "plain", "finish_claim")]
                t0 = res[(base, shape, "claim")] + res[(base, shape, "finish")]
                print(f"{'plain':8s} {name:10s} finish_claim (one call) {m:8.0f}"
                      f"  x{m / t0:.3f} of {base}'s two calls  instructions per task")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
