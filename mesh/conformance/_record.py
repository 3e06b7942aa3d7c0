"""What a scenario's run saw, and waiting on it: every line each peer
wrote, timestamped by the harness on reading it, the handler runs
(intervals) built from them, and the failures found so far. The bottom of
the harness: the peer processes (:mod:`._peers`), the waits (:mod:`._waits`),
the steps (:mod:`._steps`) and the invariant checks (:mod:`._invariants`)
build on it."""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import trio

from mesh._connection import Connection

PYTHON_PEER = f"{shlex.quote(sys.executable)} -m mesh.conformance.peer"
"""The Python peer of the line protocol (the reference)."""

OVERLAP_JITTER = 0.05
"""Overlaps shorter than this (seconds) are within the harness's reading
jitter (it timestamps a line when it reads it, from several pipes) and are
not reported."""

FENCE_GRACE = 0.5
"""After SIGCONT, how long (seconds) a peer that was stopped for longer than
its lease may still run a handler before it reports it fenced: a process
cannot notice anything while it is stopped."""

REPLY_TIMEOUT = 10.0
"""How long (seconds) a peer has to answer a command or to exit."""

START_TIMEOUT = 30.0
"""How long (seconds) a peer has to answer ``start`` (its process start-up
included: every peer of a scenario is launched at once)."""


class ScenarioFailed(Exception):
    """A step or an invariant of a scenario failed (the message says which)."""


@attrs.define
class Failure:
    scenario: str
    invariant: str
    evidence: str


@attrs.define
class Interval:
    """One handler run: from its start event to its stop or done event."""

    peer: str
    queue: str
    task: str
    token: int
    worker: str
    start: float
    end: float = math.inf
    how: str = ""  # stop reason, "done", "killed", "exited"


@attrs.define
class PeerProc:
    name: str
    command: str
    proc: trio.Process | None = None
    events: list[tuple[float, dict[str, Any]]] = attrs.Factory(list)
    changed: anyio.Event = attrs.Factory(anyio.Event)
    stderr: Any = None
    pid: int = 0
    killed_at: float | None = None
    paused: list[list[float]] = attrs.Factory(list)
    exited: anyio.Event = attrs.Factory(anyio.Event)
    exit_code: int | None = None


class Record:
    """One scenario's run against one Redis: its settings, its peers and what
    they did (see the module docstring)."""

    def __init__(
        self,
        scenario: dict[str, Any],
        url: str,
        conn: Connection,
        peer_command: str,
        namespace: str,
        log: Callable[[str], None],
    ) -> None:
        self.sc = scenario
        self.name = scenario["name"]
        self.url = url
        self.conn = conn
        self.namespace = namespace
        self.ttl = float(scenario.get("ttl", 1.5))
        self.log = log
        self.peers: dict[str, PeerProc] = {}
        for name, impl in scenario["peers"].items():
            command = peer_command if impl == "test" else PYTHON_PEER
            self.peers[name] = PeerProc(name, command)
        self.intervals: list[Interval] = []
        self.open: dict[tuple[str, str, str], Interval] = {}  # (peer, queue, task)
        self.enqueued: dict[str, set[str]] = {}
        self.cancelled: list[tuple[float, str, str]] = []  # (time, queue, task)
        self.paused_since: dict[str, float] = {}  # queue -> when its pause took effect
        self.failures: list[Failure] = []
        self.bad_tokens: set[str] = set()  # peers that wrote a token that is no string of digits
        self.any_event = anyio.Event()
        self.t0 = anyio.current_time()

    def fail(self, invariant: str, evidence: str) -> None:
        self.failures.append(Failure(self.name, invariant, evidence))

    def seconds(self, spec: Any) -> float:
        """A duration: a number, or {"ttl": k, "plus": s} = k * TTL + s."""
        if isinstance(spec, dict):
            return float(spec.get("ttl", 0)) * self.ttl + float(spec.get("plus", 0))
        return float(spec)

    def now(self) -> float:
        return anyio.current_time()

    def _token(self, peer: PeerProc, ev: dict[str, Any]) -> int:
        """The token of a start/stop/done event: a string of decimal digits
        (a JSON number is refused: not every language reads one above 2^53
        exactly); -1 after reporting a line-protocol failure."""
        token = ev.get("token")
        if isinstance(token, str) and token.isdigit() and token.isascii():
            return int(token)
        if peer.name in self.bad_tokens:
            return -1  # reported once per peer
        self.bad_tokens.add(peer.name)
        self.fail(
            "line protocol",
            f"peer {peer.name}: the token of a {ev.get('event')} event must be a string of "
            f"decimal digits, got {json.dumps(token)}",
        )
        return -1

    def _record(self, peer: PeerProc, t: float, ev: dict[str, Any]) -> None:
        peer.events.append((t, ev))
        kind = ev.get("event")
        key = (peer.name, str(ev.get("queue")), str(ev.get("task")))
        if kind == "start":
            if key in self.open:
                self.fail(
                    "one owner",
                    f"peer {peer.name} started {key[2]!r} of queue {key[1]} (token "
                    f"{ev.get('token')}) while its handler of token "
                    f"{self.open[key].token} had not stopped",
                )
            iv = Interval(
                peer.name,
                key[1],
                key[2],
                self._token(peer, ev),
                str(ev.get("worker")),
                t,
            )
            self.intervals.append(iv)
            self.open[key] = iv
        elif kind in ("stop", "done"):
            ended = self.open.pop(key, None)
            if ended is None:
                self.fail(
                    "protocol",
                    f"peer {peer.name} reported {kind} of {key[2]!r} (queue {key[1]}) "
                    "with no handler running",
                )
            else:
                if self._token(peer, ev) != ended.token:
                    self.fail(
                        "protocol",
                        f"peer {peer.name}: {kind} of {key[2]!r} names token "
                        f"{ev.get('token')}, its start named {ended.token}",
                    )
                ended.end = t
                ended.how = str(ev.get("reason", "done"))
        old = self.any_event
        self.any_event = anyio.Event()
        old.set()

    def _close_peer(self, peer: PeerProc, t: float, how: str) -> None:
        for key in [k for k in self.open if k[0] == peer.name]:
            iv = self.open.pop(key)
            iv.end = t
            iv.how = how

    def running(self, queue: str, peer: str | None = None) -> dict[str, Interval]:
        """Tasks of ``queue`` whose handler runs now (on ``peer``, or anywhere)."""
        return {
            k[2]: iv
            for k, iv in self.open.items()
            if k[1] == queue and (peer is None or k[0] == peer)
        }

    def running_on(self, peer: PeerProc) -> dict[tuple[str, str], Interval]:
        return {(k[1], k[2]): iv for k, iv in self.open.items() if k[0] == peer.name}

    def holdings(self, queue: str) -> dict[str, int]:
        return {n: len(self.running(queue, n)) for n in self.peers}

    async def wait_for(self, what: str, predicate: Callable[[], Any], within: float) -> Any:
        """Wait until ``predicate()`` is true (re-checked on every event and
        every 50 ms); raise ScenarioFailed naming ``what`` after ``within``."""
        deadline = self.now() + within
        while True:
            value = predicate()
            if value:
                return value
            if self.now() >= deadline:
                raise ScenarioFailed(what)
            with anyio.CancelScope(deadline=min(deadline, self.now() + 0.05)):
                await self.any_event.wait()

    async def wait_redis(
        self, what: Callable[[], str], check: Callable[[], Any], within: float
    ) -> None:
        """Poll ``check()`` (async, reads Redis) every 50 ms until it is true;
        raise ScenarioFailed(what()) after ``within``."""
        deadline = self.now() + within
        while not await check():
            if self.now() >= deadline:
                raise ScenarioFailed(what())
            await anyio.sleep(0.05)
