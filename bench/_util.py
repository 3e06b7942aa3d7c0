"""Shared pieces of the benchmarks: statistics, child processes, Redis probes,
and a description of the machine.

Child processes speak a line protocol on stdin/stdout: the child prints lines
such as ``ready`` or ``start <token> <ns>``; the parent sends lines such as
``go``. Every child is killed when its :func:`children` block is left, however
it is left; their stderr goes to an anonymous temporary file (unlinked at
once, so nothing is left on disk) whose tail is shown if a child dies early.
"""

from __future__ import annotations

import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from mesh._connection import Connection
from mesh._harness.peer import open_peer, peer_env

REPO = Path(__file__).resolve().parent.parent


# --- statistics -------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) with linear interpolation between
    closest ranks (numpy's default). NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


# --- child processes ----------------------------------------------------------


class ChildDied(RuntimeError):
    """A child process exited (or closed its stdout) while we waited for it."""


class Child:
    """One child process: its lines arrive in ``lines``; ``send`` writes a line."""

    def __init__(self, name: str, proc: trio.Process, errfile: Any) -> None:
        self.name = name
        self.proc = proc
        self._errfile = errfile
        self._send, self.lines = trio.open_memory_channel[str | None](math.inf)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            self._errfile.flush()
            self._errfile.seek(0)
            return str(self._errfile.read().decode(errors="replace"))[-n:]
        except (OSError, ValueError):
            return ""

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(line.encode() + b"\n")

    async def expect(self, prefix: str, within: float) -> str:
        """The next line starting with ``prefix`` (other lines are skipped).

        Raises:
            ChildDied: the child exited first.
            trio.TooSlowError: no such line within ``within`` seconds.
        """
        with trio.fail_after(within):
            while True:
                line = await self.lines.receive()
                if line is None:
                    await self.proc.wait()
                    raise ChildDied(
                        f"{self.name} (pid {self.pid}) exited with {self.proc.returncode} "
                        f"while we waited for {prefix!r}; its stderr:\n{self.stderr_tail()}"
                    )
                if line.startswith(prefix):
                    return line

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def kill(self) -> None:
        """SIGKILL and reap it (shielded: also runs while being cancelled)."""
        with trio.CancelScope(shield=True):
            if self.proc.returncode is None:
                try:
                    self.proc.kill()
                except ProcessLookupError:
                    pass
            await self.proc.wait()
            self._errfile.close()

    async def _pump(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        try:
            while True:
                data = await self.proc.stdout.receive_some(65536)
                if not data:
                    break
                buf += data
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    self._send.send_nowait(line.decode(errors="replace"))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self._send.send_nowait(None)


class Children:
    """Starts child processes whose lifetime is bounded by :func:`children`."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.all: list[Child] = []

    async def spawn(self, name: str, argv: Sequence[str]) -> Child:
        """Start ``argv`` in our working directory, with ``bench`` importable
        (appended to ``PYTHONPATH``: the ``mesh`` the parent imports comes
        first, so parent and children run the same code)."""
        errfile = tempfile.TemporaryFile(prefix="trio-mesh-bench-")
        env = peer_env()
        env["PYTHONPATH"] += os.pathsep + str(REPO)
        proc = await open_peer(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile, env=env
        )
        child = Child(name, proc, errfile)
        self.all.append(child)
        self._nursery.start_soon(child._pump)
        return child

    async def kill_all(self) -> None:
        for child in self.all:
            await child.kill()


@asynccontextmanager
async def children() -> AsyncIterator[Children]:
    """A scope for child processes: every one still running when it is left is
    SIGKILLed and reaped."""
    async with trio.open_nursery() as nursery:
        group = Children(nursery)
        try:
            yield group
        finally:
            await group.kill_all()
            nursery.cancel_scope.cancel()


def mesh_child(*args: str) -> list[str]:
    """argv of a trio-mesh child process (``bench/children/mesh_child.py``)."""
    return [sys.executable, "-m", "bench.children.mesh_child", *args]


async def terminate(child: Child, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Send ``sig``, wait up to ``grace`` s for the child to exit, then SIGKILL it."""
    child.signal(sig)
    with trio.move_on_after(grace):
        await child.proc.wait()
    await child.kill()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every core of the machine so far (Linux
    /proc/stat): busy is user + nice + system + irq + softirq; all adds idle,
    iowait and steal (time the hypervisor gave to others)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = v
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait + steal


# --- Redis probes -------------------------------------------------------------


def parse_info(raw: bytes) -> dict[str, str]:
    out = {}
    for line in raw.decode().splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k] = v
    return out


async def info(conn: Connection, section: str) -> dict[str, str]:
    return parse_info(await conn.execute("INFO", section))


async def redis_cpu(conn: Connection) -> float:
    """Seconds of CPU the server used so far (user + sys, all threads)."""
    i = await info(conn, "cpu")
    return float(i["used_cpu_user"]) + float(i["used_cpu_sys"])


async def command_stats(conn: Connection, command: str) -> tuple[int, int]:
    """(calls, µs) so far of ``command`` (lower case), from ``INFO commandstats``:
    timed by Redis around the call, as SLOWLOG is, with nothing logged."""
    v = (await info(conn, "commandstats")).get(f"cmdstat_{command}")
    if v is None:
        return 0, 0
    fields = dict(kv.split("=", 1) for kv in v.split(","))
    return int(fields["calls"]), int(fields["usec"])


async def used_memory(conn: Connection) -> int:
    return int((await info(conn, "memory"))["used_memory"])


class SlowlogWindow:
    """Per-command Redis execution times, from ``SLOWLOG`` with a threshold of
    0 µs: Redis times each command around its execution (no network, no
    queueing), so the figure is the server's own cost of the call.

    Use as ``async with SlowlogWindow(conn) as w: ...`` then ``w.entries``:
    (duration µs, args) per command that a client sent, oldest first (the
    commands scripts run are in their script's time). The previous settings
    are restored afterwards.

    The window costs Redis something: each command it logs, including each
    command a script runs, allocates an entry. Script times from it are a
    little higher than without it (see ``idle_script_us`` in the scale
    benchmark, from ``INFO commandstats`` in a window without SLOWLOG).
    """

    def __init__(self, conn: Connection, max_len: int = 1_000_000) -> None:
        self._conn = conn
        self._max_len = max_len
        self._saved: list[bytes] = []
        self.entries: list[tuple[int, list[bytes]]] = []
        self.nested_calls = 0

    async def __aenter__(self) -> SlowlogWindow:
        c = self._conn
        r1 = await c.execute("CONFIG", "GET", "slowlog-log-slower-than")
        r2 = await c.execute("CONFIG", "GET", "slowlog-max-len")
        self._saved = [r1[1], r2[1]]
        await c.execute("CONFIG", "SET", "slowlog-max-len", self._max_len)
        await c.execute("SLOWLOG", "RESET")
        await c.execute("CONFIG", "SET", "slowlog-log-slower-than", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        c = self._conn
        with trio.CancelScope(shield=True):
            await c.execute("CONFIG", "SET", "slowlog-log-slower-than", self._saved[0])
            raw = await c.execute("SLOWLOG", "GET", -1)
            await c.execute("SLOWLOG", "RESET")
            await c.execute("CONFIG", "SET", "slowlog-max-len", self._saved[1])
        # Commands a script runs are logged too, with the client "?:0"; their
        # time is part of the script's own entry, so they are left out here
        # (and only counted). Logging them costs Redis a little: with the
        # threshold at 0, a script's time includes writing an entry for each.
        top = [e for e in reversed(raw) if len(e) < 5 or e[4] != b"?:0"]
        self.nested_calls = len(raw) - len(top)
        self.entries = [(int(e[2]), list(e[3])) for e in top]
        if len(raw) >= self._max_len:
            raise RuntimeError("SLOWLOG overflowed: the window saw too many commands")

    def script_calls(
        self, sha: str, first_key: bytes | None = None
    ) -> list[tuple[int, list[bytes]]]:
        """Entries of ``EVALSHA sha`` (optionally only with this first key)."""
        s = sha.encode()
        out = []
        for us, args in self.entries:
            if len(args) >= 2 and args[0].upper() == b"EVALSHA" and args[1] == s:
                if first_key is None or (len(args) > 3 and args[3] == first_key):
                    out.append((us, args))
        return out


async def poll_until(predicate: Callable[[], Any], *, interval: float, within: float) -> float:
    """Call the async ``predicate`` every ``interval`` s until it is true;
    return ``trio.current_time()`` of the poll that saw it true.

    Raises:
        trio.TooSlowError: not true within ``within`` seconds.
    """
    with trio.fail_after(within):
        while True:
            if await predicate():
                return trio.current_time()
            await trio.sleep(interval)


# --- the machine ---------------------------------------------------------------


def machine(redis_server_version: str) -> dict[str, str]:
    cpu = "unknown"
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if m:
            cpu = m.group(1).strip()
    except OSError:
        pass
    ram = "unknown"
    try:
        m = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        if m:
            ram = f"{int(m.group(1)) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "RAM": ram,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version() + f" ({platform.python_implementation()})",
        "redis-server": redis_server_version,
        "trio": trio.__version__,
    }


def redis_server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"v=(\S+)", out)
    return m.group(1) if m else out.strip()


def fmt_int(n: float) -> str:
    return f"{n:,.0f}"


def chunks(seq: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]
