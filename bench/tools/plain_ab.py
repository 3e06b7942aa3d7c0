"""The plain queue, two versions of trio-mesh in one run: ``python -m bench.tools.plain_ab``.

For a change to the claim path (a feature the plain queue must not pay
for), this runs the same measurements on two source trees, alternating A
and B, and prints each figure per run with its min and max:

- **claim cost**: Redis time per ``claim.lua`` call of 10 tasks on a queue
  that only ever had plain tasks (``INFO commandstats``, 2,000 claims in a
  row, no finish in between), and the client's wall time per call;
- **throughput**: ``python -m bench.suites.delayed --plain-only`` of that tree
  (N no-op tasks, one worker process at concurrency 10): tasks/s and Redis
  CPU per task.

    python -m bench.tools.plain_ab --a /path/to/old/checkout --b . --runs 3

Each tree is imported with ``PYTHONPATH=<tree>``, so a tree is any checkout
(``git worktree add /tmp/old <commit>``) that has ``mesh/`` and
``bench/suites/delayed.py`` (or ``bench/delayed.py`` before bench/ was
grouped). The claim measurement is this file run as a script in that
environment, so it uses only the tree's ``mesh``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

CLAIMS = 2_000
BATCH = 10


def tree_script(tree: Path, name: str) -> bytes:
    """Script ``name`` of ``tree`` as that tree's own loader expands it (the
    loading rule itself may differ between the two trees)."""
    code = (
        "import sys; sys.path.insert(0, '.'); from mesh._scripts import load_scripts; "
        f"sys.stdout.buffer.write(load_scripts()[{name!r}].source)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tree, check=True, capture_output=True
    ).stdout


def claim_key_count(src: bytes) -> int:
    """How many keys a ``claim.lua`` takes: the highest ``KEYS[n]`` of its
    header that is not optional (protocol 3: 12, 4: 13, 5: 14, 6: 16)."""
    found = re.findall(rb"^-- KEYS\[(\d+)\](?! \(optional\))", src, re.M)
    return max(int(n) for n in found)


def child_claim_cost(claims: int) -> dict[str, float]:
    """Run in the tree under test: Redis µs and wall µs per claim of 10."""
    import time

    import trio

    from mesh._binding import Binding
    from mesh._connection import open_connection
    from mesh._keys import Keys

    try:
        from mesh.testing import run_redis_server
    except ImportError:  # before mesh.testing (e.g. cd2d249)
        from mesh._server import run_redis_server  # type: ignore[import-not-found,no-redef]

    async def go(url: str) -> dict[str, float]:
        keys = Keys("ab")
        b = Binding(keys)
        async with open_connection(url) as conn:
            await b.register(conn, "w", "i", 600_000, b"{}")
            await b.serve(conn, "w", "i", "bench")
            n = claims * BATCH
            for i in range(0, n, 10_000):
                await b.enqueue(conn, "bench", [b"%d" % j for j in range(i, i + 10_000)])
            # warm up (script cache, allocator) outside the window
            await b.claim(conn, "w", "i", "bench", BATCH, 0, fair=True, ttl_ms=600_000)

            async def usec() -> tuple[int, int]:
                raw = (await conn.execute("INFO", "commandstats")).decode()
                m = re.search(r"cmdstat_evalsha:calls=(\d+),usec=(\d+)", raw)
                assert m is not None
                return int(m.group(1)), int(m.group(2))

            c0, u0 = await usec()
            t0 = time.perf_counter()
            for _ in range(claims - 1):
                r = await b.claim(conn, "w", "i", "bench", BATCH, 0, fair=True, ttl_ms=600_000)
                assert len(r.processes) == BATCH
            t1 = time.perf_counter()
            c1, u1 = await usec()
            return {
                "redis_us_per_claim": (u1 - u0) / (c1 - c0),
                "wall_us_per_claim": (t1 - t0) / (claims - 1) * 1e6,
            }

    with run_redis_server() as server:
        return trio.run(go, server.url)


def child_interleaved(tree_a: Path, tree_b: Path, rounds: int, block: int) -> dict[str, float]:
    """Run in tree B: both trees' ``claim.lua`` on one redis-server, taking
    from one plain queue in alternating blocks of ``block`` calls; the Redis
    time of each block from ``INFO commandstats``. Both see the same data
    and the same machine load, block after block."""
    import hashlib
    import time

    import trio

    from mesh._binding import Binding
    from mesh._connection import open_connection
    from mesh._eval import run_script
    from mesh._keys import Keys
    from mesh._scripts import Script
    from mesh.testing import run_redis_server

    scripts, nkeys = {}, {}
    for name, tree in (("A", tree_a), ("B", tree_b)):
        src = tree_script(tree, "claim")
        scripts[name] = Script("claim", src, hashlib.sha1(src).hexdigest())
        nkeys[name] = claim_key_count(src)

    async def go(url: str) -> dict[str, float]:
        b = Binding(Keys("ab"))
        async with open_connection(url) as conn:
            await b.register(conn, "w", "i", 600_000, b"{}")
            await b.serve(conn, "w", "i", "bench")
            n = (2 * rounds * block + 10) * BATCH
            for i in range(0, n, 10_000):
                await b.enqueue(conn, "bench", [b"%d" % j for j in range(i, i + 10_000)])
            call = b.claim_call("w", "i", "bench", BATCH, 0, fair=True, ttl_ms=600_000)

            async def stats() -> int:
                raw = (await conn.execute("INFO", "commandstats")).decode()
                m = re.search(r"cmdstat_evalsha:calls=(\d+),usec=(\d+)", raw)
                assert m is not None
                return int(m.group(2))

            for name in ("A", "B"):  # load, warm up
                keys = call.keys[: nkeys[name]]
                await run_script(conn, scripts[name], keys, call.args)
            usec = {"A": 0, "B": 0}
            wall = {"A": 0.0, "B": 0.0}
            for r in range(rounds):
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    keys = call.keys[: nkeys[name]]
                    u0 = await stats()
                    t0 = time.perf_counter()
                    for _ in range(block):
                        reply = await run_script(conn, scripts[name], keys, call.args)
                        assert len(reply) in (2 + 4 * BATCH, 3 + 4 * BATCH)  # protocol 3: 2
                    wall[name] += time.perf_counter() - t0
                    usec[name] += await stats() - u0
            calls = rounds * block
            return {
                "A_redis_us_per_claim": usec["A"] / calls,
                "B_redis_us_per_claim": usec["B"] / calls,
                "A_wall_us_per_claim": wall["A"] / calls * 1e6,
                "B_wall_us_per_claim": wall["B"] / calls * 1e6,
            }

    with run_redis_server() as server:
        return trio.run(go, server.url)


async def _claims_under_callgrind(
    url: str, pid: int, source: bytes, nkeys: int, claims: int
) -> None:
    """Fill a plain queue, then run ``claims`` claims of the script
    ``source`` between zeroing and dumping the callgrind counters of the
    server ``pid``."""
    import hashlib

    import trio

    from mesh._binding import Binding
    from mesh._connection import open_connection
    from mesh._eval import run_script
    from mesh._keys import Keys
    from mesh._scripts import Script

    script = Script("claim", source, hashlib.sha1(source).hexdigest())
    b = Binding(Keys("ab"))
    async with open_connection(url) as conn:
        await b.register(conn, "w", "i", 600_000, b"{}")
        await b.serve(conn, "w", "i", "bench")
        n = (claims + 10) * BATCH
        for i in range(0, n, 10_000):
            await b.enqueue(conn, "bench", [b"%d" % j for j in range(i, min(i + 10_000, n))])
        call = b.claim_call("w", "i", "bench", BATCH, 0, fair=True, ttl_ms=600_000)
        keys = call.keys[:nkeys]
        await run_script(conn, script, keys, call.args)  # load, warm up
        await trio.run_process(["callgrind_control", "-z", str(pid)], capture_stdout=True)
        for _ in range(claims):
            await run_script(conn, script, keys, call.args)
        await trio.run_process(["callgrind_control", "-d", str(pid)], capture_stdout=True)


def child_callgrind(tree_a: Path, tree_b: Path, claims: int) -> dict[str, float]:
    """Run in tree B: per tree, a redis-server under ``valgrind
    --tool=callgrind`` runs ``claims`` calls of that tree's ``claim.lua`` on
    a plain queue; the instructions Redis executed for them (counters zeroed
    before, dumped after, with ``callgrind_control``), per call. Exact and
    repeatable, whatever the load."""
    import tempfile

    import trio

    from mesh.testing import run_redis_server

    out: dict[str, float] = {}
    for name, tree in (("A", tree_a), ("B", tree_b)):
        src = tree_script(tree, "claim")
        nkeys = claim_key_count(src)
        with tempfile.TemporaryDirectory(prefix="claim-callgrind-") as d:
            wrapper = Path(d) / "redis-server"
            wrapper.write_text(
                "#!/bin/sh\nexec valgrind -q --tool=callgrind "
                f'--callgrind-out-file={d}/cg.out redis-server "$@"\n'
            )
            wrapper.chmod(0o755)
            with run_redis_server(binary=str(wrapper)) as server:
                trio.run(_claims_under_callgrind, server.url, server.pid, src, nkeys, claims)
            dump = sorted(Path(d).glob("cg.out.*"))[-1].read_text()
            if os.environ.get("PLAIN_AB_KEEP"):  # for callgrind_annotate
                Path(os.environ["PLAIN_AB_KEEP"], f"cg.{name}").write_text(dump)
        m = re.search(r"^(?:summary|totals): (\d+)", dump, re.M)
        assert m is not None
        out[f"{name}_instructions_per_claim"] = int(m.group(1)) / claims
    return out


def child_idle(workers: int, seconds: float, ttl: float) -> dict[str, float]:
    """Run in the tree under test: ``workers`` idle workers (one OS process,
    each serving one queue, lease ``ttl`` so a heartbeat every ttl/3 s) on
    their own redis-server; per worker and second over ``seconds``: the Redis
    CPU (``INFO cpu``) and, per command, calls and Redis µs (``INFO
    commandstats``)."""
    import trio

    import mesh

    try:
        from mesh.testing import run_redis_server
    except ImportError:  # before mesh.testing (e.g. cd2d249)
        from mesh._server import run_redis_server  # type: ignore[no-redef]

    def stats(raw: bytes) -> dict[str, tuple[int, int]]:
        out = {}
        for m in re.finditer(r"cmdstat_(\w+):calls=(\d+),usec=(\d+)", raw.decode()):
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        return out

    def cpu(raw: bytes) -> float:
        f = dict(ln.split(":", 1) for ln in raw.decode().splitlines() if ":" in ln)
        return float(f["used_cpu_user"]) + float(f["used_cpu_sys"])

    async def idle(url: str) -> dict[str, float]:
        async def handler(p: mesh.Process) -> None:
            pass

        async with mesh.open_client(url, namespace="idle") as client, trio.open_nursery() as n:
            done = trio.Event()
            ready = trio.Semaphore(0)

            async def one() -> None:
                async with mesh.open_worker(url, namespace="idle", ttl=ttl) as w:
                    await w.start_work("q", handler)
                    ready.release()
                    await done.wait()

            for _ in range(workers):
                n.start_soon(one)
            for _ in range(workers):
                await ready.acquire()
            await trio.sleep(ttl)  # past the start-up calls
            conn = client._conn
            s0, c0 = (
                stats(await conn.execute("INFO", "commandstats")),
                cpu(await conn.execute("INFO", "cpu")),
            )
            await trio.sleep(seconds)
            s1, c1 = (
                stats(await conn.execute("INFO", "commandstats")),
                cpu(await conn.execute("INFO", "cpu")),
            )
            done.set()
        per = workers * seconds
        r = {"redis_cpu_us_per_worker_s": (c1 - c0) / per * 1e6}
        for cmd in sorted(s1):
            calls = s1[cmd][0] - s0.get(cmd, (0, 0))[0]
            usec = s1[cmd][1] - s0.get(cmd, (0, 0))[1]
            if calls and cmd not in ("info",):
                r[f"{cmd}_calls_per_worker_s"] = calls / per
                r[f"{cmd}_us_per_worker_s"] = usec / per
        return r

    with run_redis_server() as server:
        return trio.run(idle, server.url)


def run_tree(tree: Path, tasks: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))

    def out(*argv: str) -> str:
        r = subprocess.run(
            [sys.executable, *argv], env=env, cwd=tree, capture_output=True, text=True
        )
        if r.returncode:
            raise RuntimeError(f"{argv} in {tree} failed: {r.stderr[-2000:]}")
        return r.stdout

    r: dict[str, float] = json.loads(out(__file__, "--child", str(CLAIMS)).strip().splitlines()[-1])
    # bench/suites/delayed.py since bench/ was grouped; bench/delayed.py before
    module = "bench.suites.delayed" if (tree / "bench" / "suites").is_dir() else "bench.delayed"
    text = out("-m", module, "--plain-only", "--tasks", str(tasks), "--workers", "1")
    m = re.search(r"\(([\d,]+) tasks/s\), Redis CPU ([\d.]+) µs per task", text)
    if m is None:
        raise RuntimeError(f"unexpected output of {module} in {tree}: {text!r}")
    r["tasks_per_s"] = float(m.group(1).replace(",", ""))
    r["redis_us_per_task"] = float(m.group(2))
    return r


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tools.plain_ab", description=__doc__)
    p.add_argument("--a", type=Path, help="the tree before (e.g. a worktree); required")
    p.add_argument("--b", type=Path, default=Path("."), help="the tree after (default .)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tasks", type=int, default=20_000, help="tasks per throughput run")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--idle-child", type=int, help=argparse.SUPPRESS)
    p.add_argument(
        "--idle",
        action="store_true",
        help="the idle cost instead: WORKERS idle workers (ttl 3 s: a heartbeat a second) "
        "for SECONDS; Redis CPU and per-command calls and µs per worker-second",
    )
    p.add_argument("--workers", type=int, default=50, help="with --idle (default 50)")
    p.add_argument("--seconds", type=float, default=20.0, help="with --idle (default 20)")
    p.add_argument(
        "--interleaved",
        action="store_true",
        help="only the claim cost: both trees' claim.lua on one redis-server, alternating "
        "blocks of calls on one queue (run with B's mesh)",
    )
    p.add_argument(
        "--callgrind",
        action="store_true",
        help="only the claim cost, in instructions Redis executed (valgrind --tool=callgrind)",
    )
    p.add_argument("--claims", type=int, default=500, help="with --callgrind: claims per tree")
    p.add_argument("--rounds", type=int, default=40, help="with --interleaved: blocks per tree")
    p.add_argument("--block", type=int, default=100, help="with --interleaved: calls per block")
    a = p.parse_args()
    if a.child:
        print(json.dumps(child_claim_cost(a.child)))
        return
    if a.idle_child:
        r = child_idle(a.idle_child, a.seconds, 3.0)
        print(json.dumps({k: round(v, 3) for k, v in r.items()}))
        return
    if a.a is None:
        p.error("--a is required")
    if a.idle:
        trees = {"A": a.a.resolve(), "B": a.b.resolve()}
        print(f"load before: {os.getloadavg()}", flush=True)
        for i in range(a.runs):
            for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                env = dict(os.environ, PYTHONPATH=str(trees[name]))
                argv = ["--idle-child", str(a.workers), "--seconds", str(a.seconds)]
                res = subprocess.run(
                    [sys.executable, __file__, *argv],
                    env=env,
                    cwd=trees[name],
                    capture_output=True,
                    text=True,
                )
                if res.returncode:
                    raise RuntimeError(f"idle run in {trees[name]} failed: {res.stderr[-2000:]}")
                print(f"run {i + 1} {name}: {res.stdout.strip().splitlines()[-1]}", flush=True)
        print(f"load after: {os.getloadavg()}")
        return
    if a.callgrind:
        for i in range(a.runs):
            r = child_callgrind(a.a.resolve(), a.b.resolve(), a.claims)
            ratio = r["B_instructions_per_claim"] / r["A_instructions_per_claim"]
            print(f"run {i + 1}: {json.dumps({k: round(v) for k, v in r.items()})} B/A {ratio:.4f}",
                  flush=True)  # fmt: skip
        return
    if a.interleaved:
        print(f"load before: {os.getloadavg()}", flush=True)
        for i in range(a.runs):
            r = child_interleaved(a.a.resolve(), a.b.resolve(), a.rounds, a.block)
            ratio = r["B_redis_us_per_claim"] / r["A_redis_us_per_claim"]
            print(f"run {i + 1}: " + json.dumps({k: round(v, 2) for k, v in r.items()})
                  + f" B/A redis {ratio:.3f}", flush=True)  # fmt: skip
        print(f"load after: {os.getloadavg()}")
        return
    trees = {"A": a.a.resolve(), "B": a.b.resolve()}
    for name, tree in trees.items():
        commit = subprocess.run(
            ["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        print(f"{name}: {tree} ({commit})", flush=True)
    print(f"load before: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for i in range(a.runs):
        for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
            r = run_tree(trees[name], a.tasks)
            results[name].append(r)
            rounded = {k: round(v, 2) for k, v in r.items()}
            print(f"run {i + 1} {name}: {json.dumps(rounded)}", flush=True)
    print(f"load after: {os.getloadavg()}")
    head = ("figure", "A min-max (median)", "B min-max (median)", "B/A median")
    print(f"{head[0]:<22} {head[1]:>30} {head[2]:>30} {head[3]:>10}")
    for key in ("redis_us_per_claim", "wall_us_per_claim", "tasks_per_s", "redis_us_per_task"):
        cells = []
        meds = []
        for name in ("A", "B"):
            vs = sorted(r[key] for r in results[name])
            med = vs[len(vs) // 2]
            meds.append(med)
            cells.append(f"{vs[0]:.2f}-{vs[-1]:.2f} ({med:.2f})")
        print(f"{key:<22} {cells[0]:>30} {cells[1]:>30} {meds[1] / meds[0]:>10.3f}")


if __name__ == "__main__":
    main()
