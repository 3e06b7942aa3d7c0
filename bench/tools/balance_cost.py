"""The Redis time of a heartbeat and of a claim, before rebalancing and with it.

``python -m bench.tools.balance_cost [--calls 3000] [--rounds 3]`` starts its own
redis-server (127.0.0.1, a free port) and loads versions of the
scripts side by side: ``before`` (main at deac1f2, protocol 4 before
rebalancing), ``main-f8ba231`` (rebalancing, counts only),
``main-0fd0f83`` (protocol 6: task priorities, the fair share by counts),
``main-7bb04d2`` (protocol 7: the fair share by weight against capacity,
and ``heartbeat.lua`` in its batched form, one worker per call here) and
``this`` (the working tree). For each it
sets up the same state in a namespace of its own (a worker W serving one
queue with 30 persistent tasks it holds, 4 servers) and measures, round by
round and version by version in turn (so load drifts hit all alike):

- ``heartbeat.lua`` for W's one queue;
- ``claim.lua`` with the fair share on, nothing left to take.

Each figure is ``INFO commandstats`` (``cmdstat_evalsha`` usec / calls)
over ``--calls`` calls after ``CONFIG RESETSTAT``; the report gives the
median of the rounds and their min-max, and the ratio to ``before``.

With ``--callgrind`` the redis-server runs under ``valgrind
--tool=callgrind --toggle-collect=evalShaCommand`` and the figure is the
instructions executed inside EVALSHA per call (counters zeroed before and
dumped after the ``--calls`` calls): repeatable on a loaded machine, where
the times are not. ``--fleet N`` (with ``--callgrind``) also measures, for
the versions whose ``heartbeat.lua`` is batched (``main-7bb04d2`` and
``this``), one call renewing N workers that serve the queue (a fleet's
heartbeat; the queue has tasks ready, none held) and reports instructions
per worker.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from mesh.testing import run_redis_server

Q = "devices"
N_TASKS = 30
SERVERS = 4
VERSIONS = {
    "before": "deac1f2",
    "main-f8ba231": "f8ba231",
    "main-0fd0f83": "0fd0f83",
    "main-7bb04d2": "7bb04d2",
    "this": None,
}


class Scripts:
    """One version's scripts, loaded into the server, called by name."""

    def __init__(self, r: redis.Redis, d: Path) -> None:
        self.r = r
        self.sha: dict[str, str] = {}
        self.src: dict[str, bytes] = {}
        for name, src in expand_all(d).items():
            self.src[name] = src
            self.sha[name] = hashlib.sha1(src).hexdigest()
            r.script_load(src)

    def __call__(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self.r.evalsha(self.sha[name], len(keys), *keys, *args)


def checkout(rev: str | None, tmp: Path) -> Path:
    """The protocol/ directory of ``rev`` (None: the working tree), beside the
    ``mesh/`` of that revision (whose loader :func:`expand_all` runs)."""
    here = Path(__file__).resolve().parents[2]
    if rev is None:
        return here / "protocol"
    d = tmp / rev.replace("/", "_")
    d.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(here), "archive", rev, "mesh", "protocol"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
    return d / "protocol"


def expand_all(proto: Path) -> dict[str, bytes]:
    """Every script of ``proto`` (a protocol/ directory from :func:`checkout`)
    as the loader of the same revision expands it: the loading rule itself
    may differ between revisions (lib.lua pruned before include/ files)."""
    code = (
        "import sys; sys.path.insert(0, '.'); from mesh._scripts import load_scripts; "
        "sys.stdout.write(__import__('json').dumps("
        "{n: s.source.decode('latin-1') for n, s in load_scripts().items()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=proto.parent, check=True, capture_output=True
    ).stdout
    return {n: src.encode("latin-1") for n, src in json.loads(out).items()}


def setup(version: str, s: Scripts, ns: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The same state in every version; returns (heartbeat call, claim call)."""
    p = f"{{{ns}}}:"
    w = "w0"
    inc = "inc-w0"
    ttl = 600_000
    share = p + "share:" + Q
    new = version in ("this", "main-7bb04d2")  # protocol 7
    # heartbeat.lua renews many workers in one call (a fleet's), one here
    batched = b"n, how many workers" in s.src["heartbeat"]
    v6 = version == "main-0fd0f83"  # protocol 6: unowned, priorities; counts, no weights
    for i in range(SERVERS):
        wi = f"w{i}"
        keys = [p + "worker:" + wi, p + "workers", p + "info", p + "version"]
        ver = "7" if new else "6" if v6 else "4"
        s("register", keys, [wi, "inc-" + wi, ttl, b"{}", ver])
        keys = [p + "worker:" + wi, p + "serves:" + wi, p + "queues", p + "servers:" + Q]
        s("serve", keys + ([share] if new else []), [wi, "inc-" + wi, Q] + ([1] if new else []))
    keys = [p + "queue:" + Q, p + "queues", p + "persistent:" + Q, p + "standby:" + Q]
    keys += [p + "idle:" + Q, p + "delayed:" + Q]
    payloads = [b"d%d" % i for i in range(N_TASKS)]
    if new:
        keys += [p + "unowned:" + Q, share, p + "procs:" + Q, p + "prio:" + Q]
        s("ensure", keys, [Q, p + "wake:", 1, *payloads])
    elif v6:
        keys += [p + "unowned:" + Q, p + "prio:" + Q]
        s("ensure", keys, [Q, p + "wake:", *payloads])
    else:
        s("ensure", keys, [Q, p + "wake:", *payloads])
    claim_keys = [
        p + "worker:" + w,
        p + "serves:" + w,
        p + "queue:" + Q,
        p + "persistent:" + Q,
        p + "procs:" + Q,
        p + "held:" + w + ":" + Q,
        p + "attempts:" + Q,
        p + "delayed:" + Q,
        p + "token",
        p + "servers:" + Q,
        p + "standby:" + Q,
        p + "idle:" + Q,
    ]
    if version != "before":
        claim_keys.append(p + "reserved:" + Q)
    if new:
        claim_keys += [p + "unowned:" + Q, share, p + "prio:" + Q, p + "delayed_prio:" + Q]
    elif v6:
        claim_keys += [p + "unowned:" + Q, p + "prio:" + Q, p + "delayed_prio:" + Q]
    claim_args = [w, inc, Q, N_TASKS, 5, 0, 1000, 60000, ttl, 1, p + "wake:"]
    s("claim", claim_keys, claim_args)  # W takes all 30 (no fair share)
    fair_args = [w, inc, Q, 10, 5, 1, 1000, 60000, ttl, 1, p + "wake:"]
    hb_args: list[Any]
    if batched:
        hb_keys = [p + "workers", p + "queue:" + Q, p + "delayed:" + Q, p + "idle:" + Q]
        hb_keys += [p + "moving:" + Q, p + "reserved:" + Q, share, p + "prio:" + Q]
        hb_keys += [p + "worker:" + w, p + "inbox:" + w, p + "held:" + w + ":" + Q]
        hb_args = [ttl, 1, 1, w, inc, 0, 1, 1, ""]
        # as the Python peers do: give back the generation of the share
        # last read with nothing moving, so an unchanged one is not read again
        raw = s("heartbeat", hb_keys, hb_args)  # the first reads the share
        # 7bb04d2 nests the worker's reply; the working tree's is one flat list
        reply = raw[3][0] if isinstance(raw[3], list) else raw[3:]
        assert reply[4] == 1 and reply[5] >= 0, reply
        hb_args[-1] = reply[5]
    else:
        hb_keys = [p + "worker:" + w, p + "workers", p + "inbox:" + w]
        qk = [p + "queue:" + Q, p + "delayed:" + Q, p + "held:" + w + ":" + Q, p + "idle:" + Q]
        if version in ("main-f8ba231", "main-0fd0f83"):
            qk += [p + "persistent:" + Q, p + "standby:" + Q, p + "servers:" + Q]
            qk += [p + "moving:" + Q, p + "reserved:" + Q]
            if v6:
                qk.append(p + "prio:" + Q)
        elif new:
            qk += [p + "moving:" + Q, p + "reserved:" + Q, share, p + "prio:" + Q]
        hb_keys += qk
        hb_args = [w, inc, ttl, 0]
        if new:
            balance = s("heartbeat", hb_keys, hb_args)[7]  # the first reads the share
            assert balance[0] == 1 and balance[1] >= 0, balance
            hb_args.append(balance[1])
    return (
        lambda: s("heartbeat", hb_keys, hb_args),
        lambda: s("claim", claim_keys, fair_args),
    )


def fleet_setup(s: Scripts, ns: str, n: int) -> Callable[[], Any]:
    """N workers serving Q (protocol 7), renewed by one heartbeat.lua call."""
    p = f"{{{ns}}}:"
    ttl = 600_000
    share = p + "share:" + Q
    ids = [f"f{i}" for i in range(n)]
    for wi in ids:
        keys = [p + "worker:" + wi, p + "workers", p + "info", p + "version"]
        s("register", keys, [wi, "inc-" + wi, ttl, b"{}", "7"])
        keys = [p + "worker:" + wi, p + "serves:" + wi, p + "queues", p + "servers:" + Q]
        s("serve", [*keys, share], [wi, "inc-" + wi, Q, 1])
    keys = [p + "queue:" + Q, p + "queues", p + "persistent:" + Q, p + "standby:" + Q]
    keys += [p + "idle:" + Q, p + "delayed:" + Q, p + "unowned:" + Q, share]
    keys += [p + "procs:" + Q, p + "prio:" + Q]
    s("ensure", keys, [Q, p + "wake:", 1, *[b"d%d" % i for i in range(N_TASKS)]])
    hb_keys = [p + "workers", p + "queue:" + Q, p + "delayed:" + Q, p + "idle:" + Q]
    hb_keys += [p + "moving:" + Q, p + "reserved:" + Q, share, p + "prio:" + Q]
    hb_args: list[Any] = [ttl, 1, n]
    for wi in ids:
        hb_keys += [p + "worker:" + wi, p + "inbox:" + wi, p + "held:" + wi + ":" + Q]
        hb_args += [wi, "inc-" + wi, 0, 1, 1, ""]
    raw = s("heartbeat", hb_keys, hb_args)  # the first reads the share
    if isinstance(raw[3], list):  # 7bb04d2: one nested reply per worker
        gens = [rep[5] for rep in raw[3]]
    else:  # one flat list: per worker k, k ids, state, held, idle, balance
        gens, pos = [], 3
        for _ in ids:
            pos += 1 + raw[pos]
            assert raw[pos + 3] == 1, raw[pos : pos + 10]
            gens.append(raw[pos + 4])
            pos += 10 + raw[pos + 9]
    for i, g in enumerate(gens):
        assert g >= 0, gens
        hb_args[3 + 6 * i + 5] = g
    return lambda: s("heartbeat", hb_keys, hb_args)


def per_call(r: redis.Redis, call: Callable[[], Any], n: int) -> float:
    r.config_resetstat()
    for _ in range(n):
        call()
    st = r.info("commandstats")["cmdstat_evalsha"]
    return float(st["usec"]) / int(st["calls"])


def dump(pid: int, out: str) -> str:
    """Dump callgrind's counters of the server ``pid`` (which zeroes them);
    returns the file written (``out`` and a part number)."""
    before = set(glob.glob(out + "*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    for _ in range(300):
        new = set(glob.glob(out + "*")) - before
        if new:
            break
        time.sleep(0.1)
    (f,) = new
    time.sleep(0.3)  # the file is written in full
    return f


def total(f: str) -> int:
    """The instruction total of the callgrind file ``f``."""
    for line in Path(f).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {f}")


def instructions(pid: int, out: str, r: redis.Redis, call: Callable[[], Any], n: int) -> float:
    """Instructions inside EVALSHA per call, by callgrind."""
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    for _ in range(n):
        call()
    return total(dump(pid, out)) / n


@contextmanager
def redis_under_callgrind(
    tmp: str, toggles: tuple[str, ...] = ("evalShaCommand",)
) -> Iterator[tuple[redis.Redis, int, str]]:
    """A redis-server on a free loopback port under ``valgrind
    --tool=callgrind --toggle-collect=evalShaCommand`` (or the functions of
    ``toggles``: counted only inside them), its files in ``tmp``:
    yields a client, the server's pid (for ``callgrind_control``) and the
    callgrind output file. The server is killed on the way out, also on
    error; a server that does not answer PING within 60 s raises
    ``redis.ConnectionError``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(tmp, "cg.out")
    proc = subprocess.Popen(
        [
            "valgrind", "--tool=callgrind", *(f"--toggle-collect={t}" for t in toggles),
            f"--callgrind-out-file={out}", "redis-server", "--port", str(port),
            "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        r = redis.Redis(port=port)
        for i in range(600):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if i == 599:
                    raise
                time.sleep(0.1)
        try:
            yield r, proc.pid, out
        finally:
            r.close()
    finally:
        proc.kill()
        proc.wait()


def callgrind(calls_n: int, fleet: int = 0) -> int:
    with tempfile.TemporaryDirectory() as tmp, redis_under_callgrind(tmp) as (r, pid, out):
        res = {}
        for v, rev in VERSIONS.items():
            s = Scripts(r, checkout(rev, Path(tmp)))
            hb, claim = setup(v, s, "cost-" + v)
            res[(v, "heartbeat")] = instructions(pid, out, r, hb, calls_n)
            res[(v, "claim")] = instructions(pid, out, r, claim, calls_n)
            if fleet and v in ("main-7bb04d2", "this"):
                call = fleet_setup(s, "fleet-" + v, fleet)
                n = max(1, calls_n // 10)
                res[(v, "fleet")] = instructions(pid, out, r, call, n) / fleet
    for what in ("heartbeat", "claim"):
        base = res[("before", what)]
        for v in VERSIONS:
            m = res[(v, what)]
            print(f"{what:9s} {v:13s} {m:9.0f} instructions/call  x{m / base:.3f} of before")
    if fleet:
        base = res[("main-7bb04d2", "fleet")]
        for v in ("main-7bb04d2", "this"):
            m = res[(v, "fleet")]
            print(
                f"fleet of {fleet}: heartbeat {v:13s} {m:9.0f} instructions/worker"
                f"  x{m / base:.3f} of main-7bb04d2"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--callgrind", action="store_true")
    ap.add_argument("--fleet", type=int, default=0, help="with --callgrind: N workers per call")
    args = ap.parse_args(argv)
    if args.callgrind:
        return callgrind(args.calls, args.fleet)
    with tempfile.TemporaryDirectory() as tmp, run_redis_server() as server:
        r = redis.Redis(port=server.port)
        calls = {}
        for v, rev in VERSIONS.items():
            s = Scripts(r, checkout(rev, Path(tmp)))
            calls[v] = setup(v, s, "cost-" + v)
        res: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for v, (hb, claim) in calls.items():
                res.setdefault((v, "heartbeat"), []).append(per_call(r, hb, args.calls))
                res.setdefault((v, "claim"), []).append(per_call(r, claim, args.calls))
        r.close()
    for what in ("heartbeat", "claim"):
        base = statistics.median(res[("before", what)])
        for v in VERSIONS:
            xs = res[(v, what)]
            m = statistics.median(xs)
            print(
                f"{what:9s} {v:13s} {m:6.2f} us/call (min {min(xs):.2f}, max {max(xs):.2f})"
                f"  x{m / base:.3f} of before"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
