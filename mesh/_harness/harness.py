"""The fault harness: worker driver processes, the sink's event log, proxies,
snapshots of the mesh, and polls with deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

import mesh
from mesh._connection import Connection, open_connection
from mesh._keys import Keys
from mesh.testing import RedisServer
from mesh.testing import wait_until as wait_until  # re-exported for the fault tests

from . import checks, sink
from .peer import peer_env, python, spawn_peer
from .proxy import Proxy

DRIVER = python("-m", "mesh._harness.driver")
"""The command line of a driver process (:mod:`mesh._harness.driver`)."""
T = TypeVar("T")


class Driver:
    """One worker process (:mod:`mesh._harness.driver`)."""

    def __init__(self, tag: str, popen: subprocess.Popen[bytes]) -> None:
        self.tag = tag
        self.popen = popen
        self.stopped = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)
        self.stopped = sig == signal.SIGSTOP or (self.stopped and sig != signal.SIGCONT)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def stop(self) -> None:
        self.signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.signal(signal.SIGCONT)

    def term(self) -> None:
        self.signal(signal.SIGTERM)

    def reap(self) -> None:
        """Make sure the process is gone (SIGCONT then SIGKILL) and waited for."""
        if self.alive:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    async def wait_exit(self, within: float) -> int:
        async def gone() -> bool:
            return not self.alive

        await wait_until(gone, within, f"driver {self.tag} to exit")
        return self.popen.returncode


class Harness:
    """Everything one fault scenario needs. Get one from the ``harness`` fixture."""

    def __init__(
        self,
        url: str,
        sink_url: str,
        namespace: str,
        client: mesh.Client,
        sconn: Connection,
        nursery: trio.Nursery,
        ttl: float,
    ) -> None:
        self.url = url
        self.sink_url = sink_url
        self.ns = namespace
        self.prefix = "sink-" + namespace
        self.keys = Keys(namespace)
        self.client = client
        self.sconn = sconn
        self.nursery = nursery
        self.ttl = ttl
        self.log = sink.EventLog(sconn, self.prefix)
        self.drivers: list[Driver] = []
        self._n = 0
        self.server: RedisServer | None = None
        # the event loop of the driver processes that start() spawns
        # ("--loop" in start's arguments overrides it for those)
        self.loop = "trio"

    @property
    def conn(self) -> Connection:
        """A raw connection to the mesh's Redis (the client's)."""
        return self.client._conn

    # --- processes -------------------------------------------------------------

    def spawn(self, tag: str | None = None, *args: str, url: str | None = None) -> Driver:
        self._n += 1
        tag = tag or f"w{self._n}"
        cmd = [*DRIVER, "--redis", url or self.url, "--sink", self.sink_url]
        cmd += ["--prefix", self.prefix, "--namespace", self.ns, "--tag", tag]
        if "--ttl" not in args:
            cmd += ["--ttl", str(self.ttl)]
        if "--loop" not in args:
            cmd += ["--loop", self.loop]
        cmd += list(args)
        popen = spawn_peer(cmd, env=peer_env())
        d = Driver(tag, popen)
        self.drivers.append(d)
        return d

    async def start(self, n: int = 1, *args: str, url: str | None = None) -> list[Driver]:
        """Spawn ``n`` drivers and wait until every one serves its queues."""
        ds = [self.spawn(None, *args, url=url) for _ in range(n)]
        for d in ds:
            await self.wait_ready(d)
        return ds

    async def wait_ready(self, d: Driver, within: float = 15) -> sink.Event:
        return await self.wait_event(
            lambda e: e.action == "ready" and e.tag == d.tag, within, f"driver {d.tag} ready"
        )

    def reap_all(self) -> None:
        for d in self.drivers:
            d.reap()

    # --- the sink --------------------------------------------------------------

    async def events(self) -> list[sink.Event]:
        return await self.log.update()

    async def wait_event(
        self, pred: Callable[[sink.Event], bool], within: float, what: str
    ) -> sink.Event:
        async def find() -> sink.Event | None:
            return next((e for e in await self.events() if pred(e)), None)

        return await wait_until(find, within, what)

    async def sink_now(self) -> float:
        """The sink's clock (seconds): the clock of every event."""
        return await sink.now_us(self.sconn) / 1e6

    async def worker_id(self, d: Driver) -> str:
        """The current worker id of driver ``d`` (as it last reported)."""
        ids = [
            e.worker for e in await self.events() if e.tag == d.tag and e.action in ("ready", "id")
        ]
        assert ids, f"driver {d.tag} never reported"
        return ids[-1]

    async def started(self, d: Driver, since: float = 0.0) -> set[bytes]:
        """The tasks driver ``d`` started after ``since`` (the sink's clock)."""
        ev = await self.events()
        return {e.task for e in ev if e.action == "start" and e.tag == d.tag and e.t > since}

    async def runs(self, d: Driver, tasks: list[bytes], since: float = 0.0) -> bool:
        """Whether driver ``d`` started every one of ``tasks`` after ``since``."""
        return await self.started(d, since) >= set(tasks)

    async def judge(self) -> sink.Verdict:
        return sink.judge(await self.events())

    async def warnings(self, d: Driver | None = None) -> list[str]:
        return [
            e.extra
            for e in await self.events()
            if e.action == "log" and (d is None or e.tag == d.tag)
        ]

    # --- the mesh --------------------------------------------------------------

    async def wait_renewals(
        self, drivers: Iterable[Driver], count: int, within: float | None = None
    ) -> None:
        """Wait until the lease of each driver's worker (its current id) has
        been renewed ``count`` times from now, seen as its deadline in
        ``{ns}:workers`` moving on. The workers run elsewhere: this is
        :func:`mesh.testing.wait_heartbeats` read from Redis. A poll: two
        renewals between two looks count as one, which only makes the wait
        longer. ``count`` renewals span about ``count - 1`` heartbeat
        intervals (H = T/3).

        Raises:
            trio.TooSlowError: some lease was renewed fewer times within
                ``within`` (default: five intervals per renewal, plus 5 s).
        """
        ids = [await self.worker_id(d) for d in drivers]
        last: list[Any] = list(await self.conn.execute("ZMSCORE", self.keys.workers, *ids))
        seen = [0] * len(ids)

        async def renewed() -> bool:
            now = await self.conn.execute("ZMSCORE", self.keys.workers, *ids)
            for i, deadline in enumerate(now):
                if deadline is not None and deadline != last[i]:
                    seen[i] += 1
                    last[i] = deadline
            return min(seen) >= count

        default = 5.0 + 5 * count * self.ttl / 3
        what = f"{count} renewals of the leases of {', '.join(ids)}"
        await wait_until(renewed, default if within is None else within, what, every=0.01)

    async def snapshot(self, queues: Iterable[str] = ("devices", "jobs")) -> checks.Snapshot:
        return await checks.snapshot(self.conn, self.keys, queues)

    async def proxy(self, target_port: int | None = None) -> Proxy:
        port = target_port if target_port is not None else int(self.url.rsplit(":", 1)[1])
        p = Proxy(port)
        await self.nursery.start(p.run)
        return p

    @asynccontextmanager
    async def monitor(
        self,
        persistent: dict[str, set[bytes]],
        oneshot: dict[str, set[bytes]] | None = None,
        every: float = 0.02,
    ) -> AsyncIterator[Monitor]:
        """Check "one place" on a snapshot every ``every`` seconds while the block
        runs (and once more at its end)."""
        mon = Monitor(self, persistent, oneshot or {})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mon.run, every)
            try:
                yield mon
            finally:
                nursery.cancel_scope.cancel()
        await mon.sample()


@asynccontextmanager
async def open_harness(
    url: str,
    sink_url: str,
    namespace: str,
    nursery: trio.Nursery,
    ttl: float,
    loop: str = "trio",
) -> AsyncIterator[Harness]:
    """A :class:`Harness` on the mesh Redis at ``url`` whose drivers run on
    ``loop`` ("trio" or "asyncio"); every driver process it started is killed
    and waited for when the block is left."""
    async with (
        mesh.open_client(url, namespace=namespace) as client,
        open_connection(sink_url) as sconn,
    ):
        h = Harness(url, sink_url, namespace, client, sconn, nursery, ttl)
        h.loop = loop
        try:
            yield h
        finally:
            h.reap_all()


class Monitor:
    def __init__(
        self,
        h: Harness,
        persistent: dict[str, set[bytes]],
        oneshot: dict[str, set[bytes]],
    ) -> None:
        self.h = h
        self.persistent = persistent
        self.oneshot = oneshot
        self.samples = 0
        self.errors = 0
        self.violations: list[str] = []
        self.queues = sorted(set(persistent) | set(oneshot))

    async def sample(self) -> None:
        try:
            snap = await checks.snapshot(self.h.conn, self.h.keys, self.queues)
        except (mesh.MeshConnectionError, mesh.CommandError):
            self.errors += 1  # Redis down, stalled or busy: nothing to check
            return
        self.samples += 1
        self.violations += checks.one_place_violations(snap, self.persistent, self.oneshot)

    async def run(self, every: float) -> None:
        while True:
            with trio.move_on_after(max(1.0, every * 5)):
                await self.sample()
            await trio.sleep(every)  # not a synchronisation: the sampling period


def payloads(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def first(events: Iterable[sink.Event], pred: Callable[[sink.Event], bool]) -> sink.Event | None:
    return next((e for e in events if pred(e)), None)


def any_of(x: Any) -> bool:
    return bool(x)


def figure(name: str, **values: object) -> None:
    """Print a measured figure (``pytest -s`` shows them; docs/reliability.md
    quotes them)."""
    print(f"FIGURE {name} " + " ".join(f"{k}={v}" for k, v in values.items()))
