"""The timeline of one ``massfail --trace DIR`` run, after the kill.

``python -m bench.tools.massfail_timeline DIR``. Reads what ``bench.tools.balance_fleet
massfail --trace DIR`` (and ``MESH_BENCH_STALLS=DIR``) left there:
``deadlines.txt`` (the killed workers' lease deadlines), ``calls-<pid>.txt``
(each child's script calls), ``slowlog.txt`` (every Redis command of 1 ms
or more since the kill, with its time in Redis), ``owned.txt`` (the survivors' held tasks per
poll) and ``stalls-<pid>.txt``. Prints, in seconds after the kill on the
machine's monotonic clock: when the dead leases ran out, when reapers
checked and recycled (each call's round trip), when the survivors claimed
(per 250 ms: calls, processes, round trip), when all were owned again, the
event loop stalls of the survivors, and per script its calls, Redis time
(total, per call, per claimed process for claims) and its share of the time
from the first expiry to all owned.
"""

from __future__ import annotations

import collections
import glob
import os
import statistics
import sys


def _read(path: str) -> list[list[str]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split() for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    d = (argv or sys.argv[1:])[0]
    head = _read(f"{d}/t0.txt")[0]
    t0 = int(head[0])
    # unix second of Redis -> seconds after the kill
    offset = float(head[1]) + t0 / 1e9 if len(head) > 1 else None
    deadlines = sorted(float(x[1]) for x in _read(f"{d}/deadlines.txt"))
    owned = [(float(a), int(b)) for a, b in _read(f"{d}/owned.txt")]
    total = max((n for _, n in owned), default=0)
    owned_at = next((s for s, n in owned if n == total), None)
    print(f"dead leases ran out: {deadlines[0]:.3f} .. {deadlines[-1]:.3f} s ({len(deadlines)})")
    for frac in (0.5, 0.9, 0.99):
        at = next((s for s, n in owned if n >= total * frac and s > deadlines[0]), None)
        print(f"survivors held {frac:.0%} at {at} s")
    print(f"all owned again at {owned_at} s")
    calls: dict[str, list[tuple[float, float, int, int]]] = collections.defaultdict(list)
    for path in glob.glob(f"{d}/calls-*.txt"):
        pid = int(path.rsplit("-", 1)[1].split(".")[0])
        for sent, got, script, amount in _read(path):
            s, e = (int(sent) - t0) / 1e9, (int(got) - t0) / 1e9
            if e > 0:
                calls[script].append((s, e, int(amount), pid))
    for name in ("reap_check", "recycle"):
        xs = sorted(calls.get(name, []))
        busy = [x for x in xs if x[2] != 0]
        print(f"\n{name}: {len(xs)} calls after the kill, {len(busy)} that found/did something")
        for s, e, n, who in busy[:40]:
            print(f"  {s:7.3f} .. {e:7.3f} ({1000 * (e - s):6.1f} ms) n={n} pid={who}")
    claims = sorted(x for x in calls.get("claim", []) if x[2] > 0)
    print(f"\nclaims that took something: {len(claims)}, processes {sum(x[2] for x in claims)}")
    bins: dict[int, list[tuple[float, float, int, int]]] = collections.defaultdict(list)
    for x in claims:
        bins[int(x[0] / 0.25)].append(x)
    for i in sorted(bins):
        xs = bins[i]
        rtt = [1000 * (e - s) for s, e, _, _ in xs]
        print(
            f"  {i * 0.25:6.2f} s: {len(xs):4d} claims, {sum(x[2] for x in xs):6d} processes, "
            f"round trip median {statistics.median(rtt):6.1f} ms max {max(rtt):6.1f} ms, "
            f"processes {len({x[3] for x in xs})}"
        )
    hb = sorted(calls.get("heartbeat", []))
    if hb:
        rtt = [1000 * (e - s) for s, e, _, _ in hb if s > deadlines[0]]
        if rtt:
            print(
                f"\nheartbeats after the first expiry: {len(rtt)}, round trip median "
                f"{statistics.median(rtt):.1f} ms, max {max(rtt):.1f} ms"
            )
    print("\nstalls of 50 ms or more after the kill (s, ms, what):")
    for path in glob.glob(f"{d}/stalls-*.txt"):
        proc = path.rsplit("-", 1)[1].split(".")[0]
        for words in _read(path):
            at = (int(words[0]) - t0) / 1e9
            if at > 0:
                print(f"  {at:7.3f} pid={proc} {' '.join(words[1:])}")
    slow = _read(f"{d}/slowlog.txt")
    if slow:
        by: dict[str, list[int]] = collections.defaultdict(list)
        end = owned_at if owned_at is not None else float("inf")
        for ts, us, cmd, *_rest in slow:
            # SLOWLOG stamps whole seconds: the second in which all were owned is in
            if offset is None or int(ts) - offset <= end:
                by[cmd].append(int(us))
        span = (owned_at or 0) - deadlines[0]
        print(
            f"\nRedis time per command from the kill to the second all were owned "
            f"(calls of 1 ms or more; the span first expiry -> all owned is {span:.2f} s):"
        )
        for cmd, usecs in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            line = (
                f"  {cmd:14s} {len(usecs):6d} calls {sum(usecs) / 1e6:7.3f} s, "
                f"{statistics.fmean(usecs):8.0f} us/call, max {max(usecs) / 1000:6.1f} ms"
            )
            if cmd == "claim" and claims:
                line += f", {sum(usecs) / sum(x[2] for x in claims):.1f} us per claimed process"
            print(line)
        whole = sum(sum(v) for v in by.values()) / 1e6
        print(f"  all: {whole:.3f} s of Redis time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
