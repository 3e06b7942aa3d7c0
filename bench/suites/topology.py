"""Topology benchmark: recovery after the master's SIGKILL, and the cost of min_replicas.

Builds its own loopback topologies (mesh/_harness/topology.py: plain redis-server
processes on free ports, never 6379) and measures:

* **failover**: Sentinel (1 master, 1 replica, 1 sentinel) and Cluster (3
  masters, 1 replica of the namespace's master): two in-process workers hold
  ``--tasks`` persistent tasks; the master is SIGKILLed; the time until every
  persistent task has started again (``--ttl`` shorter than the failover, so the
  workers fence and rejoin), p50/p99 over ``--trials``.
* **min_replicas**: enqueue latency (one trio task, sequential) and throughput
  (``--tasks``x25 concurrent trio tasks) with ``min_replicas`` 0 and 1, on a
  master with one replica.

* **namespaces**: one namespace vs three on a 3-master cluster (no replicas):
  ``--jobs`` one-shot tasks enqueued (100 per ``enqueue_many``) and run by three
  in-process workers, either all three in one namespace or one in each of three
  namespaces chosen with ``mesh.namespace_slot`` to land on the three masters
  (the recipe of docs/sharding.md, checked against ``CLUSTER SLOTS``). Per
  master: Redis commands per task (``INFO commandstats``: the commands scripts
  call included, INFO itself left out; script calls, PUBLISH and SPUBLISH also apart)
  and Redis CPU per task (``INFO cpu``, user + sys), ``--rounds`` rounds
  alternating the two layouts.

* **mixed**: a rolling upgrade to sharded pub/sub, on one Redis 7 server: a
  client of this release (its scripts ``SPUBLISH`` the nudges) and a worker that
  stands for a peer of the previous release (an ACL user without
  ``ssubscribe``/``spublish``: it hears only ``PUBLISH``), or a worker of this
  release; ``--trials`` times: the time from ``enqueue`` to the handler's start
  and from ``cancel`` to the handler's cancellation (``ttl=3``, a heartbeat
  every second).

    python -m bench.suites.topology [--trials 10] [--ttl 1.0]
        [--only failover|replicas|namespaces|mixed]

``python -m bench --only topology`` runs all four (fewer trials with
``--quick``) as a section of the report.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import random
import secrets
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import trio

import mesh
from mesh._harness.topology import client, cluster_setup, sentinel_setup
from mesh._topology import keyslot
from mesh.testing import run_redis_server

from .._context import Context
from .._report import Figure, Section

Out = Callable[[str], None]


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]


async def one_failover(url: str, ns: str, ttl: float, tasks: int, kill: object) -> float:
    """Seconds from the SIGKILL until every persistent task started again."""
    starts: dict[bytes, float] = {}

    async def handler(p: mesh.Process) -> None:
        starts[p.task] = time.monotonic()
        await trio.sleep_forever()

    names = [f"dev-{i}".encode() for i in range(tasks)]
    async with mesh.open_client(url, namespace=ns) as c:
        await c.ensure_many("p", names)
        async with trio.open_nursery() as nursery:
            serving = 0

            async def worker() -> None:
                nonlocal serving
                async with mesh.open_worker(url, namespace=ns, ttl=ttl) as w:
                    await w.start_work("p", handler)
                    serving += 1
                    await trio.sleep_forever()

            for _ in range(2):
                nursery.start_soon(worker)
            with trio.fail_after(30):
                while len(starts) < tasks or serving < 2:  # noqa: ASYNC110 - a poll
                    await trio.sleep(0.005)
            killed = time.monotonic()
            kill()  # type: ignore[operator]
            with trio.fail_after(60):
                while not all(starts.get(n, 0) > killed for n in names):  # noqa: ASYNC110
                    await trio.sleep(0.005)
            took = max(starts.values()) - killed
            nursery.cancel_scope.cancel()
    return took


def failover(trials: int, ttl: float, tasks: int, out: Out = print) -> dict[str, list[float]]:
    """Seconds until every task runs again after the master's SIGKILL, per kind."""
    every: dict[str, list[float]] = {}
    for kind in ("sentinel", "cluster"):
        times = []
        for _ in range(trials):
            ns = "bt" + secrets.token_hex(3)
            if kind == "sentinel":
                with sentinel_setup(down_after_ms=400) as s:
                    times.append(trio.run(one_failover, s.url, ns, ttl, tasks, s.master.stop))
                detection = "down-after-milliseconds 400"
            else:
                slot = keyslot(f"{{{ns}}}:")
                with cluster_setup(replica_of_slot=slot, node_timeout_ms=500) as c:
                    owner = next(m for m in c.masters if m.port == c.owner_port(slot))
                    url = c.url(scheme="redis+cluster")
                    times.append(trio.run(one_failover, url, ns, ttl, tasks, owner.stop))
                detection = "cluster-node-timeout 500"
        every[kind] = times
        out(
            f"failover {kind:8} ({detection}, ttl {ttl:g} s, {tasks} tasks, {trials} trials): "
            f"p50 {percentile(times, 50):.3f} s  p99 {percentile(times, 99):.3f} s  "
            f"min {min(times):.3f} s  max {max(times):.3f} s"
        )
    return every


async def throughput(c: mesh.Client, seconds: float, concurrency: int) -> float:
    """Enqueues per second from ``concurrency`` trio tasks."""
    count = 0

    async def one() -> None:
        nonlocal count
        while True:
            await c.enqueue("q2", b"x" * 100)
            count += 1

    start = time.monotonic()
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(one)
    return count / (time.monotonic() - start)


async def replicas_cost(seconds: float, concurrency: int, out: Out = print) -> None:
    with sentinel_setup() as s:
        for n in (0, 1):
            ns = "br" + secrets.token_hex(3)
            async with mesh.open_client(s.url, namespace=ns, min_replicas=n) as c:
                latencies = []
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    await c.enqueue("q", b"x" * 100)
                    latencies.append(time.perf_counter() - t0)
                rate = await throughput(c, seconds, concurrency)
            out(
                f"min_replicas={n}: enqueue latency "
                f"p50 {statistics.median(latencies) * 1e6:,.0f} us "
                f"p99 {percentile(latencies, 99) * 1e6:,.0f} us (sequential); "
                f"{concurrency} concurrent: {rate:,.0f} enqueues/s"
            )


def namespace_on(prefix: str, first_slot: int, last_slot: int) -> str:
    """The first name prefix-0, prefix-1, ... whose slot is in [first, last]
    (docs/sharding.md's recipe)."""
    for i in range(100_000):
        name = f"{prefix}-{i}"
        if first_slot <= mesh.namespace_slot(name) <= last_slot:
            return name
    raise ValueError("no such name")


def master_counters(port: int) -> tuple[int, float, int, int, int]:
    """Counters of one node: commands run so far (those scripts call included,
    INFO left out); CPU seconds, user + sys; script calls (EVALSHA, EVAL);
    PUBLISH and SPUBLISH (from scripts)."""
    c = client(port)
    stats = c.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")
    scripts = sum(stats.get(f"cmdstat_{k}", {}).get("calls", 0) for k in ("evalsha", "eval"))
    publishes = stats.get("cmdstat_publish", {}).get("calls", 0)
    sharded = stats.get("cmdstat_spublish", {}).get("calls", 0)
    cpu = c.info("cpu")
    used = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return calls, used, scripts, publishes, sharded


async def run_jobs(url: str, namespaces: list[str], jobs: int) -> float:
    """Enqueue ``jobs`` one-shot tasks spread evenly over ``namespaces`` and run
    them with three workers (spread evenly over the namespaces); seconds taken."""
    done = 0
    all_done = trio.Event()

    async def handler(p: mesh.Process) -> None:
        nonlocal done
        done += 1
        if done == jobs:
            all_done.set()

    per_ns = jobs // len(namespaces)
    async with trio.open_nursery() as nursery:
        ready = 0

        async def worker(ns: str) -> None:
            nonlocal ready
            async with mesh.open_worker(url, namespace=ns, ttl=3) as w:
                await w.start_work("jobs", handler, concurrency=50)
                ready += 1
                await trio.sleep_forever()

        for i in range(3):
            nursery.start_soon(worker, namespaces[i % len(namespaces)])
        while ready < 3:  # noqa: ASYNC110 - a poll
            await trio.sleep(0.01)
        start = time.monotonic()

        async def produce(ns: str) -> None:
            async with mesh.open_client(url, namespace=ns) as c:
                for first in range(0, per_ns, 100):
                    batch = [b"job-%d" % i for i in range(first, min(per_ns, first + 100))]
                    await c.enqueue_many("jobs", batch)

        async with trio.open_nursery() as producers:
            for ns in namespaces:
                producers.start_soon(produce, ns)
        with trio.fail_after(120):
            await all_done.wait()
        took = time.monotonic() - start
        nursery.cancel_scope.cancel()
    return took


def namespaces_cost(jobs: int, rounds: int, out: Out = print) -> None:
    with cluster_setup(masters=3) as setup:
        slots = sorted(
            (int(e[0]), int(e[1]), int(e[2][1]))
            for e in client(setup.masters[0].port).execute_command("CLUSTER", "SLOTS")
        )
        ports = [port for _, _, port in slots]
        url = setup.url(scheme="redis+cluster")
        results: dict[str, list[tuple[list[float], list[float], float, float, float, float]]] = {
            "one": [],
            "three": [],
        }
        for r in range(rounds):
            for layout in ("one", "three") if r % 2 == 0 else ("three", "one"):
                tag = secrets.token_hex(2)
                names = [namespace_on(f"b{tag}", first, last) for first, last, _ in slots]
                if layout == "one":
                    names = names[:1]
                owners = [setup.owner_port(mesh.namespace_slot(n)) for n in names]
                assert len(set(owners)) == len(names), "the recipe must spread the namespaces"
                before = [master_counters(p) for p in ports]
                took = trio.run(run_jobs, url, names, jobs)
                after = [master_counters(p) for p in ports]
                cmds = [(a[0] - b[0]) / jobs for a, b in zip(after, before, strict=True)]
                cpu = [(a[1] - b[1]) / jobs * 1e6 for a, b in zip(after, before, strict=True)]
                scripts = sum(a[2] - b[2] for a, b in zip(after, before, strict=True)) / jobs
                pubs = sum(a[3] - b[3] for a, b in zip(after, before, strict=True)) / jobs
                spubs = sum(a[4] - b[4] for a, b in zip(after, before, strict=True)) / jobs
                results[layout].append((cmds, cpu, took, scripts, pubs, spubs))
        out(f"namespaces: {jobs} one-shot tasks, 3 workers, 3 masters, {rounds} rounds each")
        for layout, runs in results.items():
            for i, port in enumerate(ports):
                c = [run[0][i] for run in runs]
                u = [run[1][i] for run in runs]
                out(
                    f"  {layout:5} master {i + 1} (:{port}): commands/task "
                    f"{statistics.median(c):6.2f} (min {min(c):.2f} max {max(c):.2f}); "
                    f"Redis CPU/task {statistics.median(u):6.1f} us "
                    f"(min {min(u):.1f} max {max(u):.1f})"
                )
            total_c = [sum(run[0]) for run in runs]
            total_u = [sum(run[1]) for run in runs]
            rate = [jobs / run[2] for run in runs]
            out(
                f"  {layout:5} all masters: script calls/task "
                f"{statistics.median(run[3] for run in runs):.2f}, PUBLISH/task "
                f"{statistics.median(run[4] for run in runs):.2f}, SPUBLISH/task "
                f"{statistics.median(run[5] for run in runs):.2f}; "
                f"all commands/task {statistics.median(total_c):.2f}; "
                f"Redis CPU/task {statistics.median(total_u):.1f} us "
                f"(min {min(total_u):.1f} max {max(total_u):.1f}); "
                f"{statistics.median(rate):,.0f} tasks/s (min {min(rate):,.0f} "
                f"max {max(rate):,.0f})"
            )


async def mixed_latency(url: str, worker_url: str, trials: int) -> tuple[list[float], list[float]]:
    """Seconds from enqueue to start and from cancel to cancellation, ``trials`` times."""
    ns = "mx" + secrets.token_hex(3)
    started: dict[bytes, float] = {}
    cancelled: dict[bytes, float] = {}

    async def handler(p: mesh.Process) -> None:
        started[p.task] = time.monotonic()
        try:
            await trio.sleep_forever()
        finally:
            cancelled[p.task] = time.monotonic()

    async def until(check: Callable[[], object]) -> None:
        while not check():  # noqa: ASYNC110 - a poll
            await trio.sleep(0.001)

    wake, cancel = [], []
    r = client(int(url.rsplit(":", 1)[1].split("/")[0]))
    async with (
        mesh.open_client(url, namespace=ns) as c,
        mesh.open_worker(worker_url, namespace=ns, ttl=3) as w,
    ):
        await w.start_work("jobs", handler)
        for i in range(trials):
            task = b"job-%d" % i
            await until(lambda: r.sismember(f"{{{ns}}}:idle:jobs", w.id))
            await trio.sleep(random.random())  # anywhere in the heartbeat's cycle
            t0 = time.monotonic()
            await c.enqueue("jobs", task)
            await until(functools.partial(started.__contains__, task))
            wake.append(started[task] - t0)
            t1 = time.monotonic()
            await c.cancel("jobs", task)
            await until(functools.partial(cancelled.__contains__, task))
            cancel.append(cancelled[task] - t1)
    return wake, cancel


def mixed(trials: int, out: Out = print) -> None:
    with run_redis_server() as server:
        old = "old-release"
        client(server.port).execute_command(
            "ACL", "SETUSER", old, "on", ">pw", "~*", "&*", "+@all",
            "-ssubscribe", "-sunsubscribe", "-spublish",
        )  # fmt: skip
        old_url = server.url.replace("redis://", f"redis://{old}:pw@")
        out(f"mixed: {trials} trials each, ttl=3 (heartbeat every 1 s); load {_load()}")
        for label, worker_url in (("worker of this release", server.url),
                                  ("worker of the previous release", old_url)):  # fmt: skip
            wake, cancel = trio.run(mixed_latency, server.url, worker_url, trials)
            out(
                f"  {label:31}: enqueue -> start p50 {percentile(wake, 50) * 1e3:7.1f} ms "
                f"max {max(wake) * 1e3:7.1f} ms; cancel -> cancelled p50 "
                f"{percentile(cancel, 50) * 1e3:7.1f} ms max {max(cancel) * 1e3:7.1f} ms"
            )


async def suite(ctx: Context) -> Section:
    """The four measurements as a section of the report: the failover times
    as figures, every other result as the lines it prints. Each part builds
    its topologies with blocking calls and runs trio itself, so it runs in a
    thread of its own."""
    trials = 2 if ctx.quick else 10 * ctx.runs
    section = Section("topology", "Topologies", METHOD, runs=ctx.runs)
    lines: list[str] = []
    logging.getLogger("mesh").setLevel(logging.ERROR)  # fences and rejoins are expected
    ctx.log("topology: failover")
    times = await trio.to_thread.run_sync(failover, trials, 1.0, 4, lines.append)
    for kind, xs in times.items():
        section.figures.append(
            Figure(f"{kind}: every task running again after the master's SIGKILL", "s", xs)
        )
    ctx.log("topology: replicas")
    await trio.to_thread.run_sync(
        trio.run, replicas_cost, 1.0 if ctx.quick else 2.0, 100, lines.append
    )
    ctx.log("topology: namespaces")
    jobs = 600 if ctx.quick else 6000
    await trio.to_thread.run_sync(namespaces_cost, jobs, 1 if ctx.quick else 3, lines.append)
    ctx.log("topology: mixed")
    await trio.to_thread.run_sync(mixed, trials, lines.append)
    section.notes += lines
    return section


METHOD = """
Measured by `bench/suites/topology.py` (its docstring has the details), on
loopback topologies it builds itself: *failover*: Sentinel (1 master, 1
replica, 1 sentinel) and Cluster (3 masters, a replica of the namespace's
master), two in-process workers holding 4 persistent tasks, TTL 1 s, the
master SIGKILLed: the time until every task runs again; *replicas*: enqueue
latency and throughput with `min_replicas` 0 and 1; *namespaces*: one
namespace against three on a 3-master cluster, per master; *mixed*: a rolling
upgrade to sharded pub/sub (the wake and cancel latency of a worker of the
previous release). The notes below are the lines each part printed.
"""


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)  # fences and rejoins are expected here
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--jobs", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["failover", "replicas", "namespaces", "mixed"])
    ns_ = parser.parse_args()
    if ns_.only in (None, "failover"):
        failover(ns_.trials, ns_.ttl, ns_.tasks)
    if ns_.only in (None, "replicas"):
        trio.run(replicas_cost, ns_.seconds, 100)
    if ns_.only in (None, "namespaces"):
        namespaces_cost(ns_.jobs, ns_.rounds)
    if ns_.only in (None, "mixed"):
        mixed(ns_.trials)
