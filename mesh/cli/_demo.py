"""``mesh demo``: a live tour of a mesh, unattended, in a few seconds.

It starts a throwaway redis-server (unless given ``--redis``), launches peer
workers as real OS processes (``mesh worker mesh.cli.demo_app:queues``),
ensures persistent "device connection" tasks and enqueues one-shot jobs,
SIGKILLs the peer that owns the most devices and measures the takeover,
cancels a device by payload and measures how fast it stops, then stops every
peer with SIGTERM and prints a summary. Whatever happens (an error, Ctrl-C,
SIGTERM), every child process is stopped and every temporary file removed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import secrets
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import IO, Any, TypeVar

import anyio
import anyio.abc
import trio

import mesh
from mesh._connection import open_connection
from mesh._harness.peer import peer_env
from mesh.testing import find_redis_server, run_redis_server, wait_until

from ._common import (
    CliError,
    UsageError,
    format_ms,
)
from ._demo_peers import Event, Peer, launch, stop_all

__all__ = ["register"]

TTL = 1.5
"""The peers' lease TTL: a killed peer's devices move after about this long."""
JOB_SLOTS = 2
"""Jobs at once per peer."""
POLL = 0.005
"""How often the demo looks at Redis while it waits for something."""

T = TypeVar("T")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the ``mesh`` parser."""
    p = sub.add_parser(
        "demo",
        help="watch peers own devices, lose a peer, take over, cancel (about 3 s)",
        description="A live tour: start redis-server (unless --redis), launch peer worker "
        "processes, give them persistent device connections and one-shot jobs, SIGKILL "
        "the busiest peer and time the takeover, cancel a device by payload and time it, "
        "stop everything and print a summary. Needs no input; leaves nothing behind.",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        help="use this Redis (in a fresh namespace demo-XXXX, removed afterwards) instead "
        "of starting a throwaway redis-server",
    )
    p.add_argument(
        "--peers", type=int, default=3, metavar="N", help="peer processes, 2 to 8 (default 3)"
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="after the tour, keep the mesh running (try 'mesh status --watch' in another "
        "terminal) until Ctrl-C, then stop it",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="show the peers' logs on stderr")
    p.set_defaults(func=_demo)


class DemoError(CliError):
    """The demo could not go on (a peer died, something timed out)."""


def _demo(args: argparse.Namespace) -> int:
    if not 2 <= args.peers <= 8:
        raise UsageError("--peers must be from 2 to 8 (one is killed, the others take over)")
    if args.redis:
        try:
            mesh.parse_url(args.redis)
        except mesh.ConfigError as exc:
            raise UsageError(str(exc)) from None
    return trio.run(_main, args)


async def _main(args: argparse.Namespace) -> int:
    demo = Demo(args, sys.stdout)
    signalled: list[int] = []
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as nursery:

            async def on_signal() -> None:
                async for signum in signals:
                    signalled.append(signum)
                    if demo.waiting_for_signal:
                        demo.signal.set()
                    else:
                        nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(on_signal)
            await demo.run()
            nursery.cancel_scope.cancel()
    if signalled and not demo.waiting_for_signal:
        print(
            "mesh demo: interrupted; every peer and Redis were stopped and removed",
            file=sys.stderr,
        )
        return 130
    return 0


class Demo:
    def __init__(self, args: argparse.Namespace, out: IO[str]) -> None:
        self.args = args
        self.out = out
        self.n_peers: int = args.peers
        self.n_devices = 2 * self.n_peers
        self.n_jobs = 4 * self.n_peers
        # After one peer dies, the others must be able to hold every device.
        self.device_slots = math.ceil(self.n_devices / (self.n_peers - 1))
        self.devices = [f"device-{i}" for i in range(1, self.n_devices + 1)]
        self.jobs = [f"job-{i:02d}" for i in range(1, self.n_jobs + 1)]
        self.peers: list[Peer] = []
        self.victim: Peer | None = None
        self.waiting_for_signal = False
        self.signal = anyio.Event()
        self.figures: dict[str, str] = {}
        self.started = anyio.current_time()

    # --- output ------------------------------------------------------------

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def section(self, title: str) -> None:
        self.say()
        self.say(f"== {title}")

    def elapsed(self, since: float) -> str:
        return format_ms(anyio.current_time() - since)

    # --- the tour -------------------------------------------------------------

    async def run(self) -> None:
        self.say(
            f"trio-mesh demo: {self.n_peers} peers, {self.n_devices} device connections "
            f"(persistent tasks), {self.n_jobs} jobs (one-shot tasks), "
            f"lease TTL {format_ms(TTL)}"
        )
        with contextlib.ExitStack() as stack:
            self.section("Redis")
            if self.args.redis:
                url = self.args.redis
                namespace = f"demo-{secrets.token_hex(3)}"
                shown = mesh.parse_url(url).redacted()
                self.say(f"  using {shown}, namespace {namespace} (removed at the end)")
            else:
                binary = find_redis_server()  # ConfigError: it says where it looked
                try:
                    server = stack.enter_context(run_redis_server(binary=binary))
                    version = ".".join(map(str, server.version()))
                except Exception as exc:
                    # It exited at start, never answered, or is not a
                    # redis-server at all ($MESH_REDIS_SERVER=/bin/false):
                    # whatever the binary did, say so in one line.
                    raise DemoError(
                        f"could not start {binary}: {type(exc).__name__}: {exc}"
                    ) from None
                url, namespace, shown = server.url, "mesh", server.url
                self.say(
                    f"  started redis-server {version} at {server.url} (pid {server.pid}), "
                    f"in a temporary directory"
                )
            if self.args.redis:
                # before the first write: a client writes the epoch on connect
                await _check_scan(url, namespace)
            try:
                async with mesh.open_client(url, namespace=namespace) as client:
                    try:
                        await self.tour(client, url, namespace, shown)
                    finally:
                        with anyio.CancelScope(shield=True):
                            await stop_all(self.peers, TTL + 2)
            finally:
                # The namespace goes once the client has closed too: a client
                # writes the namespace's epoch when it (re)connects.
                if self.args.redis:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                        await _wipe_namespace(url, namespace)
                else:
                    stack.close()
                    self.say("  redis-server stopped, its temporary directory removed")
        self.summary()

    async def tour(self, client: mesh.Client, url: str, namespace: str, shown: str) -> None:
        async with anyio.create_task_group() as readers:
            try:
                await self.start_peers(client, readers, url, namespace)
                await self.own_devices(client)
                await self.start_jobs(client)
                moved = await self.kill_busiest(client)
                await self.cancel_one(client, moved)
                await self.finish_jobs(client)
                if self.args.keep_going:
                    await self.keep_going(shown, namespace)
                await self.stop(client)
            finally:
                with anyio.CancelScope(shield=True):
                    await stop_all(self.peers, TTL + 2)
                readers.cancel_scope.cancel()

    async def start_peers(
        self, client: mesh.Client, readers: anyio.abc.TaskGroup, url: str, namespace: str
    ) -> None:
        self.section(f"{self.n_peers} peers: each one is a `mesh worker` OS process")
        env = peer_env(MESH_REDIS_URL=url, MESH_NAMESPACE=namespace)
        for i in range(1, self.n_peers + 1):
            name = f"peer-{i}"
            args = [
                "mesh.cli.demo_app:queues",
                "--worker-id", name,
                "--ttl", str(TTL),
                "--concurrency", f"devices={self.device_slots}",
                "--concurrency", f"jobs={JOB_SLOTS}",
                "--backoff", "0.1",
                "--max-attempts", "3",
            ]  # fmt: skip
            self.peers.append(await launch(name, args, env, readers, self.args.verbose))
        ready: dict[str, float] = {}

        async def all_ready() -> bool:
            for w in await client.workers():
                if w.alive and w.id not in ready and set(w.queues) >= {"devices", "jobs"}:
                    ready[w.id] = anyio.current_time()
            return len(ready) == self.n_peers

        await self.until(all_ready, 30, "every peer to join the mesh")
        for p in self.peers:
            self.say(
                f"  {p.name}  pid {p.pid}  joined after {format_ms(ready[p.name] - p.launched)}"
            )

    async def own_devices(self, client: mesh.Client) -> None:
        t0 = anyio.current_time()
        await client.ensure_many("devices", self.devices)

        async def all_owned() -> list[mesh.Process] | None:
            ps = await client.processes("devices")
            return ps if len({p.task for p in ps}) == self.n_devices else None

        procs = await self.until(all_owned, 10, "every device to be owned")
        self.section(
            f"{self.n_devices} devices ensured: each is owned by exactly one peer "
            f"(#N is its fencing token)"
        )
        self.say(f"  (all connected {self.elapsed(t0)} after ensure_many)")
        by_peer = {p.name: [x for x in procs if x.worker_id == p.name] for p in self.peers}
        width = max(len(d) for d in self.devices) + 1
        for name, held in by_peer.items():
            cells = "  ".join(f"{x.task.decode():<{width}}#{x.token:<3}" for x in held)
            self.say(f"  {name}  {cells or '(none: a spare)'}".rstrip())

    async def start_jobs(self, client: mesh.Client) -> None:
        await client.enqueue_many("jobs", self.jobs)
        slots: int = min(self.n_jobs, JOB_SLOTS * self.n_peers)

        async def busy() -> bool:
            return len(await client.processes("jobs")) >= slots

        await self.until(busy, 10, "the jobs to start")
        self.section(f"{self.n_jobs} jobs enqueued")
        info = await client.queue_info("jobs")
        self.say(f"  {info.running} running ({JOB_SLOTS} per peer at most), {info.queued} queued")

    async def kill_busiest(self, client: mesh.Client) -> list[mesh.Process]:
        procs = await client.processes()
        devices = [p for p in procs if p.queue == "devices"]
        victim = max(self.peers, key=lambda p: sum(d.worker_id == p.name for d in devices))
        self.victim = victim
        before = sorted((d for d in devices if d.worker_id == victim.name), key=lambda d: d.task)
        jobs_held = sorted(
            p.task.decode() for p in procs if p.queue == "jobs" and p.worker_id == victim.name
        )
        self.section(
            f"SIGKILL {victim.name} (pid {victim.pid}): it owns {len(before)} devices "
            f"and runs {len(jobs_held)} jobs"
        )
        self.say(
            f"  no goodbye: the others take over when its lease runs out "
            f"(at most {format_ms(TTL)} after its last heartbeat)"
        )
        os.kill(victim.pid, signal.SIGKILL)
        t0 = anyio.current_time()
        moved: dict[bytes, tuple[mesh.Process, float]] = {}
        wanted = {d.task for d in before}

        async def taken_over() -> bool:
            now_running = await client.processes("devices")
            t = anyio.current_time()
            for p in now_running:
                if p.task in wanted and p.worker_id != victim.name and p.task not in moved:
                    moved[p.task] = (p, t - t0)
            return len({p.task for p in now_running}) == self.n_devices and all(
                p.worker_id != victim.name for p in now_running
            )

        await self.until(taken_over, 4 * TTL + 5, "the takeover")
        took = anyio.current_time() - t0
        for old in before:
            new, after = moved[old.task]
            self.say(
                f"  {old.task.decode():<10} {old.worker_id} #{old.token:<3} -> "
                f"{new.worker_id} #{new.token:<3} after {format_ms(after)}"
            )
            if new.token <= old.token:
                raise DemoError(f"fencing token did not grow for {old.task!r}")
        with anyio.move_on_after(5):
            await victim.proc.wait()
        self.say(
            f"  every device runs again {format_ms(took)} after the kill "
            f"({took / TTL:.2f} x the TTL of {format_ms(TTL)})"
        )
        self.say("  the new tokens are higher, so a device can refuse the old owner")
        if jobs_held:
            self.say(
                f"  its jobs {', '.join(jobs_held)} went back to the queue and run again "
                "elsewhere (at-least-once)"
            )
        self.figures["takeover"] = (
            f"{len(before)} devices moved {format_ms(took)} after SIGKILL "
            f"= {took / TTL:.2f} x TTL ({format_ms(TTL)})"
        )
        self.figures["takeover_ms"] = f"{took * 1000:.0f}"
        return [moved[d.task][0] for d in before]

    async def cancel_one(self, client: mesh.Client, moved: list[mesh.Process]) -> None:
        # Cancel a device that just moved, so the cancel crosses the mesh to a
        # peer that the caller never talked to.
        # Held by a running peer: on a loaded machine a device may still be
        # listed under the peer that was just killed, until it is recycled.
        live = {p.name: p for p in self.peers if p.running}

        async def held_live() -> mesh.Process | None:
            pool = [p for p in moved if p.worker_id in live]
            pool = pool or [p for p in await client.processes("devices") if p.worker_id in live]
            return pool[0] if pool else None

        target = await self.until(held_live, 10, "a device held by a running peer")
        name = target.task.decode()
        owner = live[target.worker_id]
        self.section(f"Cancel {name} by payload (it runs on {owner.name})")
        t0 = anyio.current_time()
        n = await client.cancel("devices", target.task)
        returned = anyio.current_time() - t0

        async def gone() -> bool:
            return all(p.task != target.task for p in await client.processes("devices"))

        # (bounds, not figures: the figures printed are what was measured; a
        # CI machine running four test processes on 2 cores once took more
        # than 5 s to show the handler's disconnect)
        await self.until(gone, 15, f"{name} to stop")
        left = anyio.current_time() - t0

        async def disconnected() -> Event | None:
            for e in owner.events:
                if e.kind == "disconnect" and e.task == name and e.token == target.token:
                    return e
            return None

        ev = await self.until(disconnected, 15, f"{owner.name}'s handler to disconnect {name}")
        seen = ev.at - t0
        persistent = await client.persistent_tasks("devices")
        if target.task in persistent:
            raise DemoError(f"{name} is still a persistent task after cancel")
        self.say(f"  client.cancel('devices', {name!r}) returned {n} after {format_ms(returned)}")
        self.say(f"  gone from client.processes() after {format_ms(left)}")
        self.say(
            f"  {owner.name}'s handler got the cancel and disconnected {name} #{target.token} "
            f"after {format_ms(max(seen, 0))}"
        )
        self.say(f"  {len(persistent)} devices left; {name} will not be started again")
        self.figures["cancel"] = (
            f"{format_ms(left)} until gone from processes(), "
            f"{format_ms(max(seen, 0))} until the handler saw it"
        )

    async def finish_jobs(self, client: mesh.Client) -> None:
        async def drained() -> bool:
            i = await client.queue_info("jobs")
            return i.queued == i.delayed == i.running == 0

        try:
            await self.until(drained, 20, "every job to finish")
        except DemoError as exc:
            i = await client.queue_info("jobs")
            raise DemoError(
                f"{exc} ({i.queued} queued, {i.delayed} delayed, {i.running} running)"
            ) from None
        events = [e for p in self.peers for e in p.events if e.queue == "jobs"]
        runs = collections.Counter(e.task for e in events if e.kind == "start")
        done = {e.task for e in events if e.kind == "done"}
        again = sorted(t for t, n in runs.items() if n > 1)
        dead = await client.dead_letters("jobs")
        self.section("Jobs")
        self.say(
            f"  {len(done)}/{self.n_jobs} done in {sum(runs.values())} runs"
            + (
                f"; {', '.join(again)} ran twice (the first run died with its peer)"
                if again
                else ""
            )
            + (f"; {len(dead)} dead-lettered" if dead else "")
        )
        per_peer = collections.Counter(e.worker for e in events if e.kind == "done")
        self.say("  finished by: " + ", ".join(f"{k} {v}" for k, v in sorted(per_peer.items())))
        self.figures["jobs"] = f"{len(done)}/{self.n_jobs} jobs done in {sum(runs.values())} runs"

    async def keep_going(self, shown: str, namespace: str) -> None:
        self.section("The mesh keeps running: press Ctrl-C to stop it")
        ns = "" if namespace == "mesh" else f" --namespace {namespace}"
        self.say(f"  in another terminal:  mesh status --watch --processes --redis {shown}{ns}")
        self.say(f"  or:                   mesh ensure devices device-99 --redis {shown}{ns}")
        self.waiting_for_signal = True
        await self.signal.wait()

    async def stop(self, client: mesh.Client) -> None:
        live = [p for p in self.peers if p.running]
        self.section(f"Stop: SIGTERM to {', '.join(p.name for p in live)}")
        t0 = anyio.current_time()
        for p in live:
            p.proc.send_signal(signal.SIGTERM)
        for p in live:
            with anyio.move_on_after(TTL + 5):
                await p.proc.wait()
            if p.proc.returncode is None:
                raise DemoError(f"{p.name} did not stop within {TTL + 5:g} s of SIGTERM")
            self.say(f"  {p.name}  exit {p.proc.returncode} after {self.elapsed(t0)}")
        took = anyio.current_time() - t0
        bad = [p for p in live if p.proc.returncode != 0]
        if bad:
            raise DemoError(
                f"{', '.join(p.name for p in bad)} exited with an error: {bad[0].last_log()}"
            )
        info = await client.queue_info("devices")
        workers = await client.workers()
        self.say(
            f"  every device went back to the queue at once: {info.queued} queued, "
            f"{info.running} running; {len(workers)} workers left"
        )
        self.figures["stop"] = (
            f"{len(live)} peers stopped with SIGTERM in {format_ms(took)}, "
            f"handing back {info.queued} devices"
        )

    def summary(self) -> None:
        if "stop" not in self.figures:
            return
        self.section("Summary")
        victim = self.victim.name if self.victim else "-"
        connects = sum(e.kind == "connect" for p in self.peers for e in p.events)
        rows = [
            ("peers", f"{self.n_peers} processes; {victim} killed with SIGKILL"),
            ("tasks", f"{self.figures['jobs']}; {connects} device connections made"),
            ("takeover", self.figures["takeover"]),
            ("cancel", self.figures["cancel"]),
            ("stop", self.figures["stop"]),
            ("total", f"{anyio.current_time() - self.started:.1f} s"),
        ]
        for k, v in rows:
            self.say(f"  {k:<9} {v}")

    # --- helpers -----------------------------------------------------------------

    async def until(
        self, pred: Callable[[], Awaitable[T | bool | None]], within: float, what: str
    ) -> T:
        """Poll ``pred`` (state in Redis, or events the peers printed) until it
        returns something true; fail after ``within`` seconds, or as soon as a
        peer that should run has exited."""

        async def checked() -> Any:
            self.check_peers()
            return await pred()

        try:
            result: T = await wait_until(checked, within, what, every=POLL)
            return result
        except trio.TooSlowError as exc:
            raise DemoError(str(exc)) from None

    def check_peers(self) -> None:
        for p in self.peers:
            if p is not self.victim and not p.running:
                raise DemoError(f"{p.name} exited with status {p.proc.returncode}: {p.last_log()}")


async def _check_scan(url: str, namespace: str) -> None:
    """Make sure the demo may remove its namespace at the end (``SCAN``)
    before it writes anything.

    Raises:
        DemoError: the Redis user may not run SCAN (nothing was written).
    """
    route = f"{{{namespace}}}:"
    async with open_connection(url, name="mesh-demo-check", route_key=route) as conn:
        try:
            await conn.execute("SCAN", 0, "MATCH", f"{{{namespace}}}:*", "COUNT", 1)
        except mesh.CommandError as exc:
            if exc.code != "NOPERM":
                raise
            user = mesh.parse_url(url).username or "default"
            raise DemoError(
                f"the Redis user {user!r} may not run SCAN (NOPERM), which the demo needs "
                f"to remove its temporary namespace {namespace} at the end; nothing was "
                f"written. Grant it (ACL SETUSER {user} +scan) or run the demo with an "
                "account that may (a mesh itself never scans: its documented ACL leaves "
                "SCAN out on purpose)"
            ) from None


async def _wipe_namespace(url: str, namespace: str) -> None:
    """Delete every key of the demo's own, fresh namespace."""
    # On a cluster, the namespace's keys all live on the master of its slot.
    route = f"{{{namespace}}}:"
    async with open_connection(url, name="mesh-demo-cleanup", route_key=route) as conn:
        cursor = b"0"
        while True:
            cursor, keys = await conn.execute(
                "SCAN", cursor, "MATCH", f"{{{namespace}}}:*", "COUNT", 1000
            )
            if keys:
                await conn.execute("DEL", *keys)
            if cursor in (b"0", 0, "0"):
                return
