"""Randomized soak: real worker processes, random faults, then a full check.

    .venv/bin/python tools/soak.py --duration 180

Starts a mesh redis-server and a sink redis-server of its own (127.0.0.1,
free ports), N worker processes (``mesh/_harness/driver.py``), each behind a
TCP proxy of its own, ensures P persistent tasks and enqueues J one-shot
tasks over the first part of the run, and injects faults drawn at random:

* ``kill``: SIGKILL a worker, start a new one a moment later;
* ``term``: SIGTERM a worker (graceful leave), start a new one;
* ``stop``: SIGSTOP a worker for 0.2 to 2.5 TTL, then SIGCONT;
* ``cut``: stall or cut a worker's proxy for 0.2 to 2.5 TTL, then heal;
* ``pubsub``: ``CLIENT KILL TYPE pubsub`` (every worker's subscriber);
* ``flush``: ``SCRIPT FLUSH``;
* ``late``: a new persistent task whose first owner, at its third action,
  blocks its whole process (a handler that blocks the event loop) until a
  peer has taken the task over, then sends one write with its old token: the
  write of a paused owner that was already on its way, which the sink must
  refuse. At most one is pending at a time.

With ``--phases``, phases of Redis trouble run during the faults (issue 23):

* ``memory-limit``: from 30% to 55% of the run, Redis is full (``maxmemory``
  just below what it uses, ``noeviction``): enqueues and ensures are refused
  with ``OutOfMemoryError`` and retried until memory is freed; a refused
  call is not acknowledged, every acknowledged one must be done in the end;
  the workers must keep their leases (no rejoin caused by the limit; faults
  pause) and a backlog of 300 tasks enqueued just before must drain;
* ``eviction``: at 65% of the run, ``maxmemory-policy allkeys-lru`` and a
  tight ``maxmemory``, then filler keys until Redis has evicted 100 keys
  (the least recently used: the mesh's idle keys among them); measured:
  how long until the client's reads notice the policy, what was evicted
  (persistent tasks that vanished, reported by ``mesh status``'s counts;
  one-shot tasks lost: eviction deletes data, so these are reported, not
  counted as violations); then ``noeviction`` again and
  ``Client.reconcile`` restores the persistent tasks.

Groups (issue 36): ``--group-share`` of the one-shot jobs (half by default)
go into ``--groups`` groups of the queue; the first has a concurrency cap
(``--group-cap``, set with ``Client.configure_group`` before the run), the
second a weight of 2. Every snapshot counts the running processes of each
group: a capped group above its cap, a running count (``r:G``) that is not
its processes plus its retries holding their slot, or a queued count
(``:n``) that is not the groups' lists is a violation; the lost and
two-places checks look into the groups' lists and delayed jobs too. At the
end, nothing of the groups may be left in Redis but their settings (a
``r:G`` left is a leaked slot).

At most ``--max-impaired`` workers are stopped, cut or dead at once. When
the time is up, every fault is healed, and the soak waits until every
one-shot task is done and every persistent task runs, then checks:

* lost: one-shot tasks acknowledged by enqueue that were never done and are
  nowhere in the mesh; persistent tasks not in the mesh;
* two places: snapshots (every 0.25 s during the run, and at the end) that
  found a task in more than one place (queue, delayed, a process, dead);
* overlaps: a stale owner that acted more than once after a newer owner of
  the same persistent task had acted (the sink refuses lower tokens, and
  counts what it refused);
* every persistent task owned by exactly one live worker, whose token is the
  highest the sink has seen for it, and which acted in the last second.

Prints the figures and exits 1 on any violation. Nothing is left behind:
every process is killed and the servers' directories are removed.

Failover phases (``--phases planned-failover,restart-empty``) run instead on a
Sentinel set-up (1 master, 2 replicas, 3 sentinels on loopback; the workers
and the producer use the Sentinel URL with ``--min-replicas``), one after the
other, under a steady enqueue load (one every 5 ms) and with the persistent
tasks running:

* ``planned-failover``: ``SENTINEL FAILOVER``; the phase ends when every
  sentinel names the promoted replica;
* ``restart-empty``: SIGKILL of the master, which is started again empty (and
  unable to become or feed a replica) once the sentinels see it down, before
  they promote a replica.

The producer puts ``--group-share`` of its jobs into the groups as above
(checked every 0.25 s, as far as the master answers, and at the end).

Then the same accounting: acknowledged enqueues that are neither done nor in
the mesh (lost), overlaps and stale actions accepted by the fenced sink; plus,
per phase, the longest a persistent task went without an accepted action, the
handlers cancelled and the workers that fenced.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mesh
from mesh._connection import open_connection
from mesh._harness import checks, sink, topology
from mesh._harness.harness import Driver, Harness
from mesh._harness.proxy import Proxy
from mesh._view import counts
from mesh.testing import run_redis_server

FAULTS = ("kill", "term", "stop", "cut", "pubsub", "flush", "late")


class Groups:
    """The soak's groups of the queue ``jobs`` (issue 36): their names and
    settings, which jobs go into which, their checks and figures."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.share: float = args.group_share
        self.names = [f"t{i}" for i in range(args.groups)] if self.share > 0 else []
        self.caps = {self.names[0]: args.group_cap} if self.names and args.group_cap else {}
        self.of: dict[bytes, str] = {}  # payload -> its group

    async def configure(self, client: mesh.Client) -> None:
        """The first group capped, the second of weight 2 (before the load)."""
        for g, cap in self.caps.items():
            await client.configure_group("jobs", g, concurrency=cap)
        if len(self.names) > 1:
            await client.configure_group("jobs", self.names[1], weight=2)

    def pick(self, rng: random.Random) -> str | None:
        """The group of a new job (None: ungrouped), drawn at the share."""
        if not self.names or rng.random() >= self.share:
            return None
        return rng.choice(self.names)

    def acknowledged(self, payloads: list[bytes], group: str | None) -> None:
        """Note the group of jobs whose enqueue was acknowledged."""
        if group is not None:
            self.of.update(dict.fromkeys(payloads, group))

    def split(
        self, payloads: list[bytes], rng: random.Random
    ) -> list[tuple[str | None, list[bytes]]]:
        """``payloads`` by group (None: ungrouped), each drawn at the share."""
        parts: dict[str | None, list[bytes]] = {}
        for p in payloads:
            parts.setdefault(self.pick(rng), []).append(p)
        return list(parts.items())

    def check(self, snap: checks.Snapshot, most: Counter[str]) -> list[str]:
        """The groups' violations in ``snap``; notes the most running of each."""
        for g, n in checks.running_by_group(snap, "jobs").items():
            most[g] = max(most[g], n)
        return checks.group_violations(snap, "jobs", self.caps)

    def figures(
        self,
        findings: list[str],
        most: Counter[str],
        leftovers: list[str],
        done: dict[bytes, int],
    ) -> dict[str, object]:
        per = Counter(self.of.values())
        return {
            "names": self.names,
            "caps": self.caps,
            "jobs": len(self.of),
            "jobs_per_group": {g: per[g] for g in self.names},
            "jobs_done": sum(1 for p in self.of if done.get(p)),
            "most_running": {g: most[g] for g in self.names},
            "findings": len(findings),
            "finding_examples": findings[:5],
            "leftovers": leftovers,
        }


class Soak:
    def __init__(self, h: Harness, args: argparse.Namespace, rng: random.Random) -> None:
        self.h = h
        self.args = args
        self.rng = rng
        self.ttl = args.ttl
        self.slots: list[Driver | None] = [None] * args.workers
        self.proxies: list[Proxy] = []
        self.impaired: set[int] = set()
        self.faults: Counter[str] = Counter()
        self.kills: list[tuple[float, str]] = []  # (sink time, tag)
        self.generation = [0] * args.workers
        self.acknowledged: list[bytes] = []
        self.enqueue_errors = 0
        self.snapshots = 0
        self.two_places: list[str] = []
        self.persistent = [b"p%03d" % i for i in range(args.persistent)]
        self.late: dict[bytes, float] = {}  # late-write task -> when ensured
        self.late_seen: set[bytes] = set()  # ... whose late write reached the sink
        self.log_every = 10.0
        self.done: set[bytes] = set()
        self.latest: dict[bytes, sink.Event] = {}  # task -> newest accepted action
        self.rejected = 0
        self._seen = 0
        # --phases (issue 23): figures of the memory-limit and eviction phases
        self.full = False  # Redis is at its memory limit now
        self.phase: dict[str, object] = {}
        self.oom_refused = 0  # enqueue/ensure calls refused at the limit (not acknowledged)
        self.evicting = False  # an eviction phase runs: acknowledged tasks may be evicted
        self.in_eviction: set[bytes] = set()  # acknowledged before/while Redis evicted
        self.evicting_findings = 0  # one-place findings while Redis evicted (expected)
        # groups (issue 36)
        self.groups = Groups(args)
        self.group_findings: list[str] = []  # cap, running count or queued count wrong
        self.group_findings_evicted: list[str] = []  # ... after an eviction phase
        self.group_most: Counter[str] = Counter()  # the most jobs of each group seen running

    # --- workers --------------------------------------------------------------

    def spawn(self, i: int) -> Driver:
        self.generation[i] += 1
        tag = f"w{i}.{self.generation[i]}"
        d = self.h.spawn(
            tag,
            "--ttl", str(self.ttl),
            "--concurrency", str(self.args.concurrency),
            "--max-attempts", "0",
            "--backoff", "0.2",
            "--act-every", str(self.args.act_every),
            url=self.proxies[i].url,
        )  # fmt: skip
        self.slots[i] = d
        return d

    async def restart_later(self, i: int, delay: float) -> None:
        await trio.sleep(delay)
        self.spawn(i)
        self.impaired.discard(i)

    # --- faults ---------------------------------------------------------------

    async def inject(self, nursery: trio.Nursery) -> None:
        kind = self.rng.choice(FAULTS)
        if self.full:
            return  # a memory-limit phase runs without faults (see --phases)
        if kind == "late":
            now = trio.current_time()
            if any(t not in self.late_seen and now - at < 20 for t, at in self.late.items()):
                return  # one at a time (a stall that was killed counts for 20 s)
            task = b"!stallonce;late%03d" % len(self.late)
            try:
                await self.h.client.ensure("devices", task)
            except mesh.OutOfMemoryError:
                self.oom_refused += 1
                return  # refused at the limit: not a persistent task
            self.late[task] = now
            self.persistent.append(task)
            self.faults[kind] += 1
            return
        if kind in ("pubsub", "flush"):
            cmd = ("CLIENT", "KILL", "TYPE", "pubsub") if kind == "pubsub" else ("SCRIPT", "FLUSH")
            await self.h.conn.execute(*cmd)
            self.faults[kind] += 1
            return
        free = [i for i in range(len(self.slots)) if i not in self.impaired]
        if len(self.impaired) >= self.args.max_impaired or not free:
            return
        i = self.rng.choice(free)
        d = self.slots[i]
        assert d is not None
        self.impaired.add(i)
        self.faults[kind] += 1
        length = self.rng.uniform(0.2, 2.5) * self.ttl
        if kind == "kill":
            self.kills.append((await self.h.sink_now(), d.tag))
            d.kill()
            nursery.start_soon(self.restart_later, i, self.rng.uniform(0.2, 3.0))
        elif kind == "term":
            d.term()
            nursery.start_soon(self.restart_later, i, self.rng.uniform(0.2, 3.0))
        elif kind == "stop":
            d.stop()
            nursery.start_soon(self.resume_later, i, d, length)
        else:
            p = self.proxies[i]
            p.stall() if self.rng.random() < 0.5 else p.cut()
            nursery.start_soon(self.heal_later, i, length)

    async def resume_later(self, i: int, d: Driver, delay: float) -> None:
        await trio.sleep(delay)
        d.cont()
        self.impaired.discard(i)

    async def heal_later(self, i: int, delay: float) -> None:
        await trio.sleep(delay)
        self.proxies[i].heal()
        self.impaired.discard(i)

    async def fault_loop(self, until: float) -> None:
        async with trio.open_nursery() as nursery:
            while trio.current_time() < until:
                await trio.sleep(self.rng.expovariate(1 / self.args.fault_every))
                if trio.current_time() < until:
                    await self.inject(nursery)

    # --- load and watching ----------------------------------------------------

    async def enqueue_loop(self, until: float) -> None:
        n = self.args.oneshot
        batch = 10
        per_batch = max(0.001, (until - trio.current_time()) / math.ceil(n / batch))
        sent = 0
        while sent < n:
            payloads = [
                b"!hold=%.3f;j%05d" % (self.rng.uniform(0.005, 0.2), k)
                for k in range(sent, min(n, sent + batch))
            ]
            for group, part in self.groups.split(payloads, self.rng):
                # a group's jobs, now and then with a priority (protocol 10)
                prio = self.rng.choice((0, 0, 4, 8)) if group is not None else 0
                await self.enqueue_acknowledged(part, group, prio)
                self.groups.acknowledged(part, group)
            sent += len(payloads)
            await trio.sleep(per_batch)

    async def enqueue_acknowledged(
        self, payloads: list[bytes], group: str | None, priority: int = 0
    ) -> None:
        """Enqueue ``payloads`` (into ``group``, at ``priority``), retried
        until acknowledged."""
        for _ in range(100):  # retried until acknowledged
            try:
                await self.h.client.enqueue_many("jobs", payloads, group=group, priority=priority)
                break
            except mesh.OutOfMemoryError:
                # refused at the limit: nothing stored, not acknowledged;
                # retried (without counting a try) until memory is freed
                self.oom_refused += 1
                while self.full:  # noqa: ASYNC110 - the phase ends on its own clock
                    await trio.sleep(0.05)
            except mesh.MeshConnectionError:  # pragma: no cover - Redis is not faulted
                self.enqueue_errors += 1
                await trio.sleep(0.05)
        self.acknowledged += payloads

    async def watch(self) -> None:
        while True:
            await trio.sleep(0.25)
            pers = {"devices": set(self.persistent)}  # taken before the snapshot
            snap = await self.snapshot()
            self.snapshots += 1
            one = {"jobs": set(self.acknowledged)}
            found = checks.one_place_violations(snap, pers, one)
            in_groups = self.groups.check(snap, self.group_most)
            if self.evicting:
                # Redis deletes keys until reconcile: the state is broken by
                # design, and reported, not judged
                self.evicting_findings += len(found) + len(in_groups)
            else:
                self.two_places += found
                # after an eviction, the groups' keys may stay broken (no
                # reconcile restores them): reported, not judged
                if self.in_eviction:
                    self.group_findings_evicted += in_groups
                else:
                    self.group_findings += in_groups

    async def snapshot(self) -> checks.Snapshot:
        return await checks.snapshot(
            self.h.conn, self.h.keys, ["devices", "jobs"], self.groups.names
        )

    async def update(self) -> None:
        """Read the sink's new events (cheap: only what is new)."""
        ev = await self.h.events()
        for e in ev[self._seen :]:
            if e.fenced and e.ok:
                self.latest[e.task] = e
            if e.fenced and e.ok and e.action == "done":
                self.done.add(e.task)
            elif e.fenced and not e.ok:
                self.rejected += 1
            if e.extra == "late":
                self.late_seen.add(e.task)
        self._seen = len(ev)

    async def progress(self, started: float) -> None:
        while True:
            await trio.sleep(self.log_every)
            await self.update()
            print(
                f"[{trio.current_time() - started:6.1f}s] faults={dict(self.faults)} "
                f"done={len(self.done)}/{len(self.acknowledged)} rejected={self.rejected} "
                f"impaired={sorted(self.impaired)} two_places={len(self.two_places)} "
                f"group_findings={len(self.group_findings)} group_most={dict(self.group_most)}",
                flush=True,
            )

    # --- phases (--phases) ------------------------------------------------------

    async def fill(self, headroom: int, below: int) -> int:
        """maxmemory ``headroom`` above what Redis uses, then filler keys
        (outside the namespace) until a write is refused or evicts; then,
        with ``below``, maxmemory that much under what it uses. Returns how
        many filler keys were written."""
        conn = self.h.conn
        used = await redis_used(conn)
        await conn.execute("CONFIG", "SET", "maxmemory", used + headroom)
        n = 0
        for n in range(1, 4000):
            try:
                await conn.execute("SET", f"soak-filler:{n}", b"x" * 32768)
            except mesh.CommandError as exc:
                assert exc.code == "OOM", exc
                break
            if self.evicting and int(await info_field(conn, "stats", "evicted_keys")) >= 100:
                break
        if below:
            await conn.execute("CONFIG", "SET", "maxmemory", await redis_used(conn) - below)
        return n

    async def unfill(self, n: int) -> None:
        conn = self.h.conn
        for i in range(1, n + 1, 500):
            await conn.execute("DEL", *[f"soak-filler:{j}" for j in range(i, min(n, i + 499) + 1)])
        await conn.execute("CONFIG", "SET", "maxmemory", 0)

    async def memory_limit_phase(self, start: float, end: float) -> None:
        await trio.sleep_until(start)
        # no faults meanwhile, and none still healing: a rejoin in the phase
        # is the limit's doing
        self.full = True
        while self.impaired:  # noqa: ASYNC110 - faults heal on their own clock
            await trio.sleep(0.1)
        await trio.sleep(2 * self.ttl)  # a worker cut just before has rejoined
        # a backlog that must drain at the limit (acknowledged before it)
        backlog = [b"!hold=0.02;m%04d" % k for k in range(300)]
        await self.h.client.enqueue_many("jobs", backlog)
        self.acknowledged += backlog
        rejoins = await self.events_count("id")
        n = await self.fill(512 * 1024, 256 * 1024)
        t0 = trio.current_time()
        await self.update()
        done_at_start = len(self.done)
        refused_at_start = self.oom_refused
        await trio.sleep_until(end)
        await self.update()
        limit = int(await info_field(self.h.conn, "memory", "maxmemory"))
        used = await redis_used(self.h.conn)
        self.phase["memory_limit"] = {
            "seconds": round(trio.current_time() - t0, 1),
            "filler_keys": n,
            "calls_refused_oom": self.oom_refused - refused_at_start,
            "tasks_done_at_the_limit": len(self.done) - done_at_start,
            "backlog_done_at_the_limit": len(self.done & set(backlog)),
            "used_over_limit_bytes_at_end": used - limit,
            "rejoins_during": (await self.events_count("id")) - rejoins,
        }
        await self.unfill(n)
        self.full = False

    async def eviction_phase(self, at: float) -> None:
        await trio.sleep_until(at)
        client, conn = self.h.client, self.h.conn
        self.evicting = True
        self.in_eviction = set(self.acknowledged)
        await conn.execute("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
        switched = trio.current_time()
        noticed = None
        while noticed is None and trio.current_time() - switched < 15:
            c = await counts(client.reads)
            if c.memory is not None and c.memory.evicting:
                noticed = trio.current_time() - switched
            else:
                await trio.sleep(0.25)
        n = await self.fill(256 * 1024, 0)
        evicted = int(await info_field(conn, "stats", "evicted_keys"))
        c = await counts(client.reads)
        vanished = {q.info.name: q.vanished for q in c.queues}
        k = self.h.keys
        left = await conn.pipeline(
            [
                ("EXISTS", k.share("devices")),
                ("HLEN", k.persistent("devices")),
                ("SCARD", k.standby("devices")),
                ("ZCARD", k.workers),
            ]
        )
        await conn.execute("CONFIG", "SET", "maxmemory-policy", "noeviction")
        await self.unfill(n)
        self.in_eviction |= set(self.acknowledged)
        r = await client.reconcile("devices", self.persistent)
        self.phase["eviction"] = {
            "policy_noticed_after_s": None if noticed is None else round(noticed, 2),
            "filler_keys": n,
            "keys_evicted": evicted,
            "persistent_vanished_reported": vanished,
            "persistent_restored_by_reconcile": len(r.added),
            "after_eviction": dict(
                zip(
                    ["share_key_left", "persistent_hash_len", "standby_len", "workers"],
                    left,
                    strict=True,
                )
            ),
            "one_place_findings_while_evicting": self.evicting_findings,
        }
        self.evicting = False

    async def events_count(self, action: str) -> int:
        return sum(1 for e in await self.h.events() if e.action == action)

    # --- the end --------------------------------------------------------------

    def heal_everything(self) -> None:
        for p in self.proxies:
            p.heal()
        for i, d in enumerate(self.slots):
            if d is not None and d.alive:
                d.cont()
            else:
                self.spawn(i)
        self.impaired.clear()

    async def quiescent(self) -> bool:
        await self.update()
        if len(self.done) < len(self.acknowledged):
            return False
        snap = await self.snapshot()
        # no job runs: the finish of the last ones (after their "done") is in
        if (
            snap.queues["jobs"].procs
            or checks.owner_violations(snap, "devices", self.persistent)
            or not all(snap.workers.values())
        ):
            return False
        # and each persistent task's owner has acted: a task that moved just
        # before (a rebalance to a worker that rejoined once healed) was
        # reported as an ownership violation when the end check ran before
        # its new owner's first action (2 of 211 tasks in a 180 s run)
        for p in self.persistent:
            (owner,) = snap.owners("devices", p) or (None,)
            last = self.latest.get(p)
            if owner is not None and (last is None or int(owner.id) != last.token):
                return False
        return True


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    wall = time.time()
    with run_redis_server() as mesh_server, run_redis_server() as sink_server:
        ns = f"soak{rng.randrange(10**6)}"
        async with (
            trio.open_nursery() as nursery,
            mesh.open_client(mesh_server.url, namespace=ns) as client,
            open_connection(sink_server.url) as sconn,
        ):
            h = Harness(mesh_server.url, sink_server.url, ns, client, sconn, nursery, args.ttl)
            soak = Soak(h, args, rng)
            try:
                for _ in range(args.workers):
                    p = Proxy(mesh_server.port)
                    await nursery.start(p.run)
                    soak.proxies.append(p)
                for i in range(args.workers):
                    soak.spawn(i)
                for d in list(h.drivers):
                    await h.wait_ready(d, within=30)
                await client.ensure_many("devices", soak.persistent)
                await soak.groups.configure(client)
                t0 = trio.current_time()
                end = t0 + args.duration
                async with trio.open_nursery() as run_nursery:
                    run_nursery.start_soon(soak.watch)
                    run_nursery.start_soon(soak.progress, t0)
                    run_nursery.start_soon(soak.enqueue_loop, t0 + args.duration * 0.6)
                    if "memory-limit" in args.phases:
                        run_nursery.start_soon(
                            soak.memory_limit_phase,
                            t0 + args.duration * 0.3,
                            t0 + args.duration * 0.55,
                        )
                    if "eviction" in args.phases:
                        run_nursery.start_soon(soak.eviction_phase, t0 + args.duration * 0.65)
                    await soak.fault_loop(end)
                    print("faults stop; healing and waiting for quiescence", flush=True)
                    soak.heal_everything()
                    settle_from = trio.current_time()
                    with trio.move_on_after(args.settle) as cs:
                        while not await soak.quiescent():  # noqa: ASYNC110 - poll, deadline
                            await trio.sleep(0.25)
                    settle = trio.current_time() - settle_from
                    run_nursery.cancel_scope.cancel()
                report = await final_report(soak, settle, cs.cancelled_caught)
            finally:
                h.reap_all()
                nursery.cancel_scope.cancel()
    report["wall_s"] = round(time.time() - wall, 1)
    print(json.dumps(report, indent=1))
    bad = (
        report["lost_not_evicted"]
        or report["two_places"]
        or report["overlaps"]
        or report["ownership_violations"]
        or report["settle_timed_out"]
        or report["late_writes_accepted"]
        or report["groups"]["findings"]  # type: ignore[index]
        or report["groups"]["leftovers"]  # type: ignore[index]
    )
    print("VIOLATIONS" if bad else "OK: no violation")
    return 1 if bad else 0


async def final_report(soak: Soak, settle: float, timed_out: bool) -> dict[str, object]:
    h = soak.h
    # First the end state, cheaply: heavy analysis blocks this trio loop, and
    # with it the proxies every worker talks through (they would all fence).
    await soak.update()
    snap = await soak.snapshot()
    now = await h.sink_now()
    pers = {"devices": set(soak.persistent)}
    final_two = checks.one_place_violations(snap, pers, {"jobs": set(soak.acknowledged)})
    in_groups = soak.groups.check(snap, soak.group_most)
    leftovers = await checks.group_leftovers(h.conn, h.keys, "jobs")
    if soak.in_eviction:  # the groups' keys may stay broken after it: reported
        soak.group_findings_evicted += in_groups + leftovers
        leftovers = []
    else:
        soak.group_findings += in_groups
    places = snap.places("jobs")
    ownership = checks.owner_violations(snap, "devices", soak.persistent)
    # the owner Redis names is the one the sink knows as newest, and it acts
    for p in soak.persistent:
        (owner,) = snap.owners("devices", p) or (None,)
        last = soak.latest.get(p)
        if owner is None or last is None:
            continue
        if int(owner.id) != last.token:
            ownership.append(f"{p!r}: Redis says process {owner.id}, sink's newest is {last.token}")
        elif now - last.t > 1.0 + soak.args.act_every:
            ownership.append(f"{p!r}: its owner has not acted for {now - last.t:.1f} s")
    h.reap_all()  # the end state is taken: stop the fleet, then analyse
    ev = await h.events()
    v = sink.judge(ev)
    lost = [p for p in soak.acknowledged if not v.done_count.get(p) and not places[p]]
    # eviction deletes data: one-shot tasks acknowledged before Redis evicted
    # may be gone; reported, not a violation (persistent ones were reconciled)
    evicted = [p for p in lost if p in soak.in_eviction]
    lost += [p for p in soak.persistent if snap.places("devices")[p] != 1]
    # takeover after a kill: from the kill to the next start of each task the
    # killed worker was running (a task waiting out a crash backoff counts too)
    takeovers: dict[str, list[float]] = {
        f"{k}_{c}_crash": [] for k in ("persistent", "oneshot") for c in ("first", "repeated")
    }
    pset = set(soak.persistent)
    starts: dict[bytes, list[sink.Event]] = {}
    for e in ev:
        if e.action == "start":
            starts.setdefault(e.task, []).append(e)
    kills = sorted(soak.kills)
    held: dict[bytes, str] = {}  # task -> tag of its last starter still running it
    at_kill: list[tuple[float, list[bytes]]] = []
    k = 0
    for e in [*ev, None]:
        while k < len(kills) and (e is None or kills[k][0] < e.t):
            at_kill.append((kills[k][0], [t for t, who in held.items() if who == kills[k][1]]))
            k += 1
        if e is None:
            break
        if e.action == "start":
            held[e.task] = e.tag
        elif e.action in ("done", "cancelled") and held.get(e.task) == e.tag:
            del held[e.task]
    for killed_at, tasks in at_kill:
        for t in tasks:
            nxt = next((e for e in starts.get(t, ()) if e.t > killed_at), None)
            if nxt is not None:
                kind = "persistent" if t in pset else "oneshot"
                # attempts == 1: the first crash of a series goes back at once;
                # later ones wait out the crash backoff by design
                kind += "_first_crash" if nxt.extra == "1" else "_repeated_crash"
                takeovers[kind].append(nxt.t - killed_at)
    fenced = sum(1 for e in ev if e.action == "id")
    return {
        "duration_s": soak.args.duration,
        "ttl_s": soak.ttl,
        "workers": soak.args.workers,
        "persistent_tasks": len(soak.persistent),
        "oneshot_acknowledged": len(soak.acknowledged),
        "faults": dict(soak.faults),
        "faults_total": sum(soak.faults.values()),
        "rejoins_under_new_id": fenced,
        "lost": len(lost),
        "lost_evicted": len(evicted),
        "lost_not_evicted": len(lost) - len(evicted),
        "lost_examples": [x.decode() for x in lost[:5]],
        "enqueue_calls_refused_oom": soak.oom_refused,
        "phases": soak.phase,
        "two_places": len(soak.two_places) + len(final_two),
        "two_places_examples": (soak.two_places + final_two)[:5],
        "snapshots_checked": soak.snapshots + 1,
        "oneshot_duplicates": v.duplicates,
        "stale_actions_rejected": v.rejected,
        "late_writes": sum(1 for e in ev if e.extra == "late"),
        "late_writes_accepted": sum(1 for e in ev if e.extra == "late" and e.ok),
        "overlaps": len(v.overlaps),
        "overlap_examples": [repr(o) for o in v.overlaps[:5]],
        "late_attempts_in_flight": v.late_attempts,
        "max_owners_accepted": v.max_owners,
        "max_owners_attempting": v.max_attempting_owners,
        "ownership_violations": len(ownership),
        "ownership_examples": ownership[:5],
        "takeover_after_kill_s": {k: spread(v) for k, v in takeovers.items()},
        "settle_s": round(settle, 2),
        "settle_timed_out": timed_out,
        "events": len(ev),
        "groups": {
            **soak.groups.figures(soak.group_findings, soak.group_most, leftovers, v.done_count),
            "findings_after_eviction": len(soak.group_findings_evicted),
            "findings_after_eviction_examples": soak.group_findings_evicted[:5],
        },
    }


async def info_field(conn: object, section: str, field: str) -> str:
    raw = (await conn.execute("INFO", section)).decode()  # type: ignore[attr-defined]
    return str(raw.split(field + ":")[1].split()[0])


async def redis_used(conn: object) -> int:
    return int(await info_field(conn, "memory", "used_memory"))


def spread(xs: list[float]) -> dict[str, object]:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {
        "n": len(xs),
        "median": round(statistics.median(xs), 3),
        "p90": round(xs[math.ceil(0.9 * len(xs)) - 1], 3),
        "max": round(xs[-1], 3),
    }


# --- failover phases (Sentinel) ---------------------------------------------------

PHASES = ("planned-failover", "restart-empty")

# An old master started again with no data, unable to become or feed a replica
# (without the last two, the replicas would resync from it and lose the data too).
EMPTY_AND_STUBBORN = (
    *("--rename-command", "REPLICAOF", ""),
    *("--rename-command", "SLAVEOF", ""),
    *("--rename-command", "SYNC", ""),
    *("--rename-command", "PSYNC", ""),
)


def _without_replicaof(args: tuple[str, ...]) -> tuple[str, ...]:
    """A server's arguments without ``--replicaof HOST PORT`` (a replica that
    was promoted, started again as a master)."""
    out: list[str] = []
    skip = 0
    for a in args:
        if skip:
            skip -= 1
        elif a == "--replicaof":
            skip = 2
        else:
            out.append(a)
    return tuple(out)


async def _until(what: str, check: Callable[[], object], within: float = 30.0) -> Any:
    """Poll a blocking ``check`` (redis-py) in a thread until it is true."""
    return await trio.to_thread.run_sync(lambda: topology.wait_for(what, check, within))


async def run_phases(args: argparse.Namespace, phases: list[str]) -> int:
    rng = random.Random(args.seed)
    wall = time.time()
    report: dict[str, Any] = {"phases": {}, "min_replicas": args.min_replicas, "ttl_s": args.ttl}
    with (
        topology.sentinel_setup(sentinels=3, down_after_ms=400, replicas=2) as setup,
        run_redis_server() as sink_server,
    ):
        servers = [setup.master, setup.replica, *setup.more_replicas]
        url = f"{setup.url}?min_replicas={args.min_replicas}"
        ns = f"soak{rng.randrange(10**6)}"
        persistent = [b"p%03d" % i for i in range(args.persistent)]
        acknowledged: list[bytes] = []
        aborted: BaseException | None = None
        async with (
            trio.open_nursery() as nursery,
            mesh.open_client(url, namespace=ns) as client,
            open_connection(sink_server.url) as sconn,
        ):
            h = Harness(url, sink_server.url, ns, client, sconn, nursery, args.ttl)
            try:
                for _ in range(args.workers):
                    h.spawn(None, "--concurrency", str(args.concurrency), "--max-attempts", "0")
                for d in list(h.drivers):
                    await h.wait_ready(d, within=30)
                await client.ensure_many("devices", persistent)
                groups = Groups(args)
                await groups.configure(client)
                gwatch = GroupWatch(h, groups)
                nursery.start_soon(gwatch.run)

                async def produce(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                    with trio.CancelScope() as scope:
                        task_status.started(scope)
                        for n in range(10**9):
                            payload = b"!hold=0.005;j%06d" % n
                            group = groups.pick(rng)
                            prio = rng.choice((0, 0, 4, 8)) if group is not None else 0
                            try:
                                await client.enqueue("jobs", payload, group=group, priority=prio)
                                acknowledged.append(payload)
                                groups.acknowledged([payload], group)
                            except mesh.MeshConnectionError:
                                await trio.sleep(0.02)  # not acknowledged
                            await trio.sleep(0.005)

                producer = await nursery.start(produce)
                await trio.sleep(2.0)  # a steady state first
                sentinel = topology.client(setup.sentinels[0].port)
                for phase in phases:
                    old_port = setup.master_port()
                    (old,) = [s for s in servers if s.port == old_port]
                    begin = await h.sink_now()
                    acked_from = len(acknowledged)
                    if phase == "planned-failover":
                        await _until(
                            "Sentinel to start a failover",
                            lambda: sentinel.execute_command(  # type: ignore[no-untyped-call]
                                "SENTINEL", "FAILOVER", "mymaster"
                            ),
                        )
                    else:
                        old.stop()  # SIGKILL

                        def down() -> bool:
                            flags = str(sentinel.sentinel_master("mymaster")["flags"])  # type: ignore[index]
                            return "o_down" in flags or "failover_in_progress" in flags

                        await _until("the master to be seen down", down)
                        old.args = (*_without_replicaof(old.args), *EMPTY_AND_STUBBORN)
                        await trio.to_thread.run_sync(old.start)

                    def moved(old_port: int = old_port) -> bool:
                        named = {setup.master_port(x) for x in setup.sentinels}
                        return len(named) == 1 and old_port not in named

                    await _until("every sentinel to name another master", moved)
                    # the mesh settles on the new master (an enqueue load goes on)
                    await trio.sleep(3 * args.ttl)
                    end = await h.sink_now()
                    ev = await h.events()
                    report["phases"][phase] = phase_figures(
                        ev, persistent, begin, end, len(acknowledged) - acked_from
                    )
                    print(phase, json.dumps(report["phases"][phase]), flush=True)
                producer.cancel()
                new_port = setup.master_port()
                done: set[bytes] = set()
                with trio.move_on_after(args.settle) as cs:
                    while True:
                        ev = await h.events()
                        done = {e.task for e in ev if e.fenced and e.ok and e.action == "done"}
                        if set(acknowledged) <= done:
                            break
                        await trio.sleep(0.25)
                    # and no job runs: the finish of the last ones is in
                    while (await gwatch.settled_snapshot()).queues["jobs"].procs:  # noqa: ASYNC110
                        await trio.sleep(0.1)
                gwatch.stop()
                snap = await gwatch.settled_snapshot()
                places = snap.places("jobs")
                gwatch.findings += groups.check(snap, gwatch.most)
                leftovers = await checks.group_leftovers(h.conn, h.keys, "jobs")
                h.reap_all()
                ev = await h.events()
                v = sink.judge(ev)
            except BaseException as exc:
                print(f"soak phases aborted: {exc!r}", flush=True)
                aborted = exc  # the nursery's cancel below would swallow it
                raise
            finally:
                h.reap_all()
                nursery.cancel_scope.cancel()
        if aborted is not None:
            raise aborted
        lost = [p for p in acknowledged if not v.done_count.get(p) and not places[p]]
        old_masters = [s for s in servers if s.port != new_port and s.process is not None]
        report.update(
            {
                "workers": args.workers,
                "persistent_tasks": len(persistent),
                "oneshot_acknowledged": len(acknowledged),
                "lost": len(lost),
                "lost_examples": [x.decode() for x in lost[:5]],
                "oneshot_duplicates": v.duplicates,
                "stale_actions_rejected": v.rejected,
                "overlaps": len(v.overlaps),
                "overlap_examples": [repr(o) for o in v.overlaps[:5]],
                "max_owners_accepted": v.max_owners,
                "settle_timed_out": cs.cancelled_caught,
                "keys_in_other_nodes": {
                    s.port: topology.client(s.port).dbsize() for s in old_masters
                },
                "groups": {
                    **groups.figures(gwatch.findings, gwatch.most, leftovers, v.done_count),
                    "snapshots_checked": gwatch.snapshots,
                    "snapshots_failed": gwatch.failed,
                },
            }
        )
    report["wall_s"] = round(time.time() - wall, 1)
    print(json.dumps(report, indent=1))
    bad = (
        report["lost"]
        or report["overlaps"]
        or report["settle_timed_out"]
        or report["groups"]["findings"]
        or report["groups"]["leftovers"]
    )
    print("VIOLATIONS" if bad else "OK: no violation")
    return 1 if bad else 0


class GroupWatch:
    """The groups' checks every 0.25 s during the failover phases: a
    snapshot the master does not answer (it is down or changing) is
    counted, not judged."""

    def __init__(self, h: Harness, groups: Groups) -> None:
        self.h = h
        self.groups = groups
        self.findings: list[str] = []
        self.most: Counter[str] = Counter()
        self.snapshots = 0
        self.failed = 0
        self.scope = trio.CancelScope()

    async def snapshot(self) -> checks.Snapshot:
        return await checks.snapshot(
            self.h.conn, self.h.keys, ["devices", "jobs"], self.groups.names
        )

    async def run(self) -> None:
        with self.scope:
            while True:
                await trio.sleep(0.25)
                try:
                    snap = await self.snapshot()
                except mesh.MeshError:
                    self.failed += 1
                    continue
                self.snapshots += 1
                self.findings += self.groups.check(snap, self.most)

    async def settled_snapshot(self, within: float = 30.0) -> checks.Snapshot:
        """A snapshot once the client reaches the master again (after a
        failover it may take a while to find it); raises the last
        MeshConnectionError after ``within`` seconds."""
        deadline = trio.current_time() + within
        while True:
            try:
                return await self.snapshot()
            except mesh.MeshConnectionError:
                if trio.current_time() > deadline:
                    raise
                self.failed += 1
                await trio.sleep(0.5)

    def stop(self) -> None:
        self.scope.cancel()


def phase_figures(
    ev: list[sink.Event], persistent: list[bytes], begin: float, end: float, acked: int
) -> dict[str, object]:
    """One phase's figures from the sink's events between ``begin`` and ``end``:
    the longest a persistent task went without an accepted action (up to the
    end of the phase for one still silent then), handlers of
    persistent tasks cancelled and started, and workers that rejoined."""
    pset = set(persistent)
    last: dict[bytes, float] = {}
    longest = 0.0
    for e in ev:
        if e.task in pset and e.fenced and e.ok and e.action not in ("start", "done"):
            if begin <= e.t <= end and e.task in last:
                longest = max(longest, e.t - last[e.task])
            last[e.task] = e.t
    for t in persistent:
        # a task silent since its last action (or since the phase began)
        longest = max(longest, end - max(last.get(t, begin), begin))
    inside = [e for e in ev if begin <= e.t <= end]
    return {
        "begin": round(begin, 3),
        "end": round(end, 3),
        "acknowledged_during": acked,
        "persistent_longest_gap_s": round(longest, 3),
        "persistent_cancelled": sum(
            1 for e in inside if e.action == "cancelled" and e.task in pset
        ),
        "persistent_started": sum(1 for e in inside if e.action == "start" and e.task in pset),
        "rejoins": sum(1 for e in inside if e.action == "id"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of faults")
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--persistent", type=int, default=200)
    ap.add_argument("--oneshot", type=int, default=5000)
    ap.add_argument(
        "--concurrency",
        type=int,
        default=100,
        help="per worker: the workers together must be able to run every persistent task",
    )
    ap.add_argument("--ttl", type=float, default=1.5)
    ap.add_argument("--act-every", type=float, default=0.25, help="persistent handler period")
    ap.add_argument("--fault-every", type=float, default=1.5, help="mean seconds between faults")
    ap.add_argument("--max-impaired", type=int, default=3)
    ap.add_argument("--settle", type=float, default=120.0, help="max seconds to quiesce")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--phases",
        type=lambda s: [p for p in s.split(",") if p],
        default=[],
        help="comma-separated phases of Redis trouble: memory-limit and eviction (on the "
        f"random-fault run), or failover phases on a Sentinel set-up ({', '.join(PHASES)}), "
        "run in order instead of the random faults",
    )
    ap.add_argument("--min-replicas", type=int, default=0, help="for the failover phases")
    ap.add_argument(
        "--group-share", type=float, default=0.5, help="of the one-shot jobs, put into groups"
    )
    ap.add_argument("--groups", type=int, default=5, help="how many groups (of 'jobs')")
    ap.add_argument(
        "--group-cap", type=int, default=2, help="the first group's concurrency (0: none)"
    )
    args = ap.parse_args()
    if not 0 <= args.group_share <= 1:
        ap.error(f"--group-share {args.group_share}: give a share from 0 to 1")
    if args.groups < 1 or args.group_cap < 0:
        ap.error("--groups must be at least 1 and --group-cap at least 0")
    memory = {"memory-limit", "eviction"}
    unknown = set(args.phases) - memory - set(PHASES)
    if unknown:
        ap.error(f"--phases: unknown phase(s) {', '.join(sorted(unknown))}")
    if set(args.phases) & set(PHASES):
        if set(args.phases) & memory:
            ap.error("--phases: failover phases and memory phases run in separate soaks")
        if args.seed is None:
            args.seed = random.randrange(2**32)
        print(f"soak phases: seed={args.seed} {vars(args)}", flush=True)
        return trio.run(run_phases, args, args.phases)
    room = (args.workers - args.max_impaired) * args.concurrency
    if args.persistent + 20 > room:  # 20: room for the 'late' tasks
        ap.error(
            f"--persistent {args.persistent} does not fit: {args.workers - args.max_impaired} "
            f"unimpaired workers of --concurrency {args.concurrency} run at most {room} tasks "
            "(less 20 for the 'late' ones)"
        )
    if args.seed is None:
        args.seed = random.randrange(2**32)
    print(f"soak: seed={args.seed} {vars(args)}", flush=True)
    return trio.run(run, args)


if __name__ == "__main__":
    sys.exit(main())
