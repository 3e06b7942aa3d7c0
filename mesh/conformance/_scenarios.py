"""Run the conformance scenarios (``protocol/conformance/scenarios/*.json``)
against a peer under test, through the line protocol.

The harness starts each peer of a scenario as a process (the command given,
or the Python peer), timestamps every line it reads with its own monotonic
clock, drives the peers step by step, and checks the invariants over the
whole record (see protocol/conformance/README.md, "Scenarios"). A failed step
or invariant becomes a :class:`Failure` naming the scenario, the invariant and
the evidence; the harness never raises for a misbehaving peer.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import trio

import mesh
from mesh._connection import Connection
from mesh._harness.peer import open_peer

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


def load_scenarios(directory: Path) -> list[dict[str, Any]]:
    """The scenarios of ``directory``, in file-name order."""
    out = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        data.setdefault("name", path.stem)
        out.append(data)
    return out


class Run:
    """One scenario's run against one Redis."""

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

    # -- helpers -----------------------------------------------------------

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

    # -- processes ---------------------------------------------------------

    async def launch(self, nursery: anyio.abc.TaskGroup, peer: PeerProc) -> None:
        env = dict(os.environ, MESH_REDIS_URL=self.url, MESH_NAMESPACE=self.namespace)
        peer.stderr = tempfile.TemporaryFile()
        peer.proc = await open_peer(
            shlex.split(peer.command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=peer.stderr,
            env=env,
        )
        peer.pid = peer.proc.pid
        nursery.start_soon(self._read, peer)

    async def _read(self, peer: PeerProc) -> None:
        assert peer.proc is not None and peer.proc.stdout is not None
        buf = b""
        async with peer.proc.stdout:
            while True:
                try:
                    data = await peer.proc.stdout.receive_some(65536)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    data = b""
                t = self.now()
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    try:
                        ev = json.loads(line)
                        if not isinstance(ev, dict):
                            raise ValueError("not an object")
                    except ValueError:
                        self.fail("line protocol", f"peer {peer.name} wrote {line[:200]!r}")
                        continue
                    self._record(peer, t, ev)
        peer.exit_code = await peer.proc.wait()
        t = self.now()
        self._close_peer(peer, peer.killed_at if peer.killed_at is not None else t, "exited")
        peer.exited.set()
        old = self.any_event
        self.any_event = anyio.Event()
        old.set()

    async def send(self, peer: PeerProc, cmd: dict[str, Any]) -> None:
        assert peer.proc is not None and peer.proc.stdin is not None
        try:
            await peer.proc.stdin.send_all((json.dumps(cmd) + "\n").encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ScenarioFailed(f"peer {peer.name} does not read its stdin ({exc})") from None

    async def request(self, peer: PeerProc, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send ``cmd`` and return its reply (an ack of its op, or an error)."""
        seen = len(peer.events)
        await self.send(peer, cmd)

        def reply() -> dict[str, Any] | None:
            for _, ev in peer.events[seen:]:
                if ev.get("event") == "error" or (
                    ev.get("event") == "ack" and ev.get("op") == cmd["op"]
                ):
                    return ev
            return None

        ev: dict[str, Any] = await self.wait_for(
            f"peer {peer.name} did not answer {json.dumps(cmd)} within {REPLY_TIMEOUT} s",
            reply,
            REPLY_TIMEOUT,
        )
        if ev.get("event") == "error":
            raise ScenarioFailed(f"peer {peer.name} refused {json.dumps(cmd)}: {json.dumps(ev)}")
        return ev

    def stderr_tail(self, peer: PeerProc, lines: int = 8) -> str:
        if peer.stderr is None:
            return ""
        peer.stderr.seek(0)
        text = peer.stderr.read().decode(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    # -- steps -------------------------------------------------------------

    async def run(self) -> list[Failure]:
        try:
            async with anyio.create_task_group() as nursery:
                try:
                    # Every process is launched at once (each waits for its
                    # start command): their start-up overlaps the steps.
                    for peer in self.peers.values():
                        await self.launch(nursery, peer)
                    for i, step in enumerate(self.sc["steps"]):
                        began = self.now()
                        try:
                            await self.step(nursery, step)
                            self.log_step(i, step, self.now() - began)
                        except ScenarioFailed as exc:
                            what = step.get("invariant", step.get("do", "step"))
                            hint = f" ({step['hint']})" if "hint" in step else ""
                            self.fail(str(what), f"step {i + 1} ({json.dumps(step)}): {exc}{hint}")
                            break
                finally:
                    await self.finish(nursery)
        finally:
            for peer in self.peers.values():
                if peer.stderr is not None:
                    peer.stderr.close()
        self.check()
        return self.failures

    def log_step(self, i: int, step: dict[str, Any], took: float) -> None:
        if os.environ.get("MESH_CONFORMANCE_STEPS"):
            self.log(f"  step {i + 1} {step['do']} {step.get('peer', '')}: {took:.2f} s")

    async def finish(self, nursery: anyio.abc.TaskGroup) -> None:
        """Stop every peer still running (stop, then SIGKILL), read their last lines."""
        with anyio.CancelScope(shield=True):
            for peer in self.peers.values():
                if peer.proc is None or peer.exited.is_set():
                    continue
                if peer.paused:
                    peer.proc.send_signal(signal.SIGCONT)
                with anyio.move_on_after(REPLY_TIMEOUT):
                    try:
                        assert peer.proc.stdin is not None
                        await peer.proc.stdin.aclose()
                    except trio.BrokenResourceError:
                        pass
                    await peer.exited.wait()
                if not peer.exited.is_set():
                    self.fail(
                        "graceful stop",
                        f"peer {peer.name} did not exit within {REPLY_TIMEOUT} s of EOF on stdin",
                    )
                    peer.killed_at = self.now()
                    peer.proc.kill()
                    await peer.exited.wait()
            nursery.cancel_scope.cancel()

    async def step(self, nursery: anyio.abc.TaskGroup, step: dict[str, Any]) -> None:
        do = step["do"]
        peer = self.peers[step["peer"]] if "peer" in step else None
        if do == "start":
            assert peer is not None
            seen = len(peer.events)
            await self.send(peer, {"op": "start", "ttl": self.ttl})

            def answer() -> dict[str, Any] | None:
                for _, ev in peer.events[seen:]:
                    if ev.get("event") in ("ready", "error"):
                        return ev
                return None

            ev = await self.wait_for(
                f"peer {peer.name} did not answer start within {START_TIMEOUT} s",
                lambda: answer() or (peer.exited.is_set() and {"event": "exited"}),
                START_TIMEOUT,
            )
            expect = step.get("expect", "ready")
            if expect == "ready":
                if ev.get("event") != "ready":
                    raise ScenarioFailed(f"peer {peer.name} could not start: {json.dumps(ev)}")
                return
            # expect a refusal: {"code": C, "exit": N}
            if ev.get("event") != "error" or ev.get("code") != expect["code"]:
                raise ScenarioFailed(
                    f"peer {peer.name} answered {json.dumps(ev)}, expected an error of code "
                    f"{expect['code']}"
                )
            if not ev.get("message"):
                raise ScenarioFailed(f"peer {peer.name}'s refusal has no message: {json.dumps(ev)}")
            await self.wait_for(
                f"peer {peer.name} refused but did not exit within {REPLY_TIMEOUT} s",
                peer.exited.is_set,
                REPLY_TIMEOUT,
            )
            if peer.exit_code != expect["exit"]:
                raise ScenarioFailed(
                    f"peer {peer.name} exited {peer.exit_code}, expected {expect['exit']}"
                )
        elif do == "send":
            assert peer is not None
            cmd = step["cmd"]
            ev = await self.request(peer, cmd)
            if cmd["op"] in ("enqueue",):
                self.enqueued.setdefault(cmd["queue"], set()).update(cmd["tasks"])
            for field, want in step.get("expect", {}).items():
                if ev.get(field) != want:
                    raise ScenarioFailed(
                        f"peer {peer.name} answered {json.dumps(ev)}: {field} should be {want!r}"
                    )
        elif do == "set":
            await self.conn.execute("SET", f"{{{self.namespace}}}:{step['key']}", step["value"])
        elif do in ("configure", "schedule", "pause_queue", "resume_queue"):
            await self.client_step(step)
        elif do == "check_rate":
            self.check_rate(step)
        elif do == "check_tokens":
            await self.check_tokens(step)
        elif do == "wait":
            await self.wait_step(step)
        elif do == "quiet":
            # A deliberate window in which nothing must happen: the invariants
            # checked at the end cover it (and, with no_start, no handler of
            # that queue may start in it).
            # A paused queue's window opens when the pause took effect: a
            # peer that ignores the pause may have run its tasks before the
            # quiet step began.
            queue = step.get("no_start")
            began = self.paused_since.get(queue, self.now()) if queue else self.now()
            await anyio.sleep(self.seconds(step["seconds"]))
            started = [iv for iv in self.intervals if iv.queue == queue and iv.start >= began]
            if started:
                raise ScenarioFailed(
                    f"{len(started)} tasks of queue {queue} started in a window in which "
                    f"none may ({self.now() - began:.2f} s"
                    f"{', from its pause on' if queue in self.paused_since else ''}): "
                    f"{sorted({iv.task for iv in started})[:10]} on {started[0].peer}"
                )
        elif do == "kill":
            assert peer is not None and peer.proc is not None
            held = self.running_on(peer)
            t = peer.killed_at = self.now()
            peer.proc.kill()
            self._close_peer(peer, t, "killed")
            if "takeover" in step:
                await self.expect_moved(peer, held, t, self.seconds(step["takeover"]), "takeover")
        elif do == "pause":
            assert peer is not None and peer.proc is not None
            held = self.running_on(peer)
            t = self.now()
            peer.proc.send_signal(signal.SIGSTOP)
            peer.paused.append([t, math.inf])
            if "takeover" in step:
                await self.expect_moved(peer, held, t, self.seconds(step["takeover"]), "takeover")
            # A deliberate pause of the peer (SIGSTOP) for the time the step says.
            await anyio.sleep_until(t + self.seconds(step["seconds"]))
            await self.resume(peer, held, fenced=step.get("expect_fenced", True))
        elif do == "stop":
            assert peer is not None
            await self.stop_step(peer, step)
        elif do == "cancel":
            await self.cancel_step(step, durable=False)
        elif do == "cancel_durable":
            await self.cancel_step(step, durable=True)
        else:
            raise ScenarioFailed(f"unknown step {do!r}")

    async def client_step(self, step: dict[str, Any]) -> None:
        """A step the harness does itself, as a client of the mesh (the
        Python one): a queue's policy, a periodic task, a pause."""
        do, queue = step["do"], step["queue"]
        async with mesh.open_client(self.url, namespace=self.namespace) as client:
            if do == "configure":
                policy = dict(step["policy"])
                if isinstance(policy.get("rate_limit"), list):
                    policy["rate_limit"] = tuple(policy["rate_limit"])
                await client.configure(queue, **policy)
            elif do == "schedule":
                await client.schedule(queue, step["task"], every=float(step["every"]))
            elif do == "pause_queue":
                await client.pause(queue)
                self.paused_since[queue] = self.now()
            else:
                self.paused_since.pop(queue, None)
                await client.resume(queue)

    def check_rate(self, step: dict[str, Any]) -> None:
        """No more handlers of the queue started than its rate limit lets
        claims through: a token bucket of ``limit`` per ``period`` seconds
        (full at first: a burst of ``limit``), over the whole mesh. One start
        and 50 ms of reading jitter are forgiven."""
        queue, limit, period = step["queue"], int(step["limit"]), float(step["period"])
        starts = sorted(iv.start for iv in self.intervals if iv.queue == queue)
        for i, a in enumerate(starts):
            for j in range(i, len(starts)):
                span = starts[j] - a
                allowed = limit + limit * (span + OVERLAP_JITTER) / period + 1
                if j - i + 1 > allowed:
                    raise ScenarioFailed(
                        f"{j - i + 1} handlers of queue {queue} started within {span:.3f} s; "
                        f"its rate limit lets at most {limit} per {period:g} s through "
                        f"(a burst of {limit}) across the mesh"
                    )

    async def check_tokens(self, step: dict[str, Any]) -> None:
        """Every handler of the queue that runs now reports a token above
        ``above`` that is the id of a process Redis holds: a token that went
        through a double (JSON numbers in JavaScript) names no process."""
        queue, above = step["queue"], int(step["above"])
        running = self.running(queue)
        if not running:
            raise ScenarioFailed(f"no handler of queue {queue} runs to check its token")
        procs = f"{{{self.namespace}}}:procs:{queue}"
        for task, iv in sorted(running.items()):
            if iv.token <= above:
                raise ScenarioFailed(
                    f"peer {iv.peer} reported token {iv.token} for {task!r}, not above "
                    f"{above} (the namespace's last token before it started)"
                )
            if not await self.conn.execute("HEXISTS", procs, str(iv.token)):
                raise ScenarioFailed(
                    f"peer {iv.peer} reported token {iv.token} for {task!r}, which is no "
                    f"process of queue {queue} in Redis (a token must cross intact: as a "
                    "string or a big integer, never a double)"
                )

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

    def running_on(self, peer: PeerProc) -> dict[tuple[str, str], Interval]:
        return {(k[1], k[2]): iv for k, iv in self.open.items() if k[0] == peer.name}

    async def expect_moved(
        self,
        peer: PeerProc,
        held: dict[tuple[str, str], Interval],
        since: float,
        within: float,
        invariant: str,
    ) -> None:
        """Every task ``peer`` ran at ``since`` starts on another peer within ``within``."""

        def moved() -> bool:
            return all(
                any(
                    iv.start >= since and iv.peer != peer.name and iv.queue == q and iv.task == t
                    for iv in self.intervals
                )
                for q, t in held
            )

        try:
            await self.wait_for("", moved, within)
        except ScenarioFailed:
            left = sorted(
                t
                for q, t in held
                if not any(
                    iv.start >= since and iv.peer != peer.name and iv.queue == q and iv.task == t
                    for iv in self.intervals
                )
            )
            raise ScenarioFailed(
                f"{invariant}: {len(left)} of the {len(held)} tasks peer {peer.name} ran "
                f"did not start elsewhere within {within:.2f} s: {left[:10]}"
            ) from None

    async def resume(
        self, peer: PeerProc, held: dict[tuple[str, str], Interval], *, fenced: bool
    ) -> None:
        assert peer.proc is not None
        t = self.now()
        peer.proc.send_signal(signal.SIGCONT)
        peer.paused[-1][1] = t
        if not fenced:
            return
        # Every handler it ran must stop as fenced soon after it runs again.
        ivs = list(held.values())

        def all_fenced() -> bool:
            return all(iv.end < math.inf for iv in ivs)

        try:
            await self.wait_for("", all_fenced, FENCE_GRACE + 2.0)
        except ScenarioFailed:
            pass
        for iv in ivs:
            if iv.end == math.inf:
                self.fail(
                    "self-fence",
                    f"peer {peer.name} was stopped (SIGSTOP) longer than its lease and still "
                    f"runs {iv.task!r} (token {iv.token}) {FENCE_GRACE + 2.0:.1f} s after SIGCONT",
                )
            elif iv.how != "fenced":
                self.fail(
                    "self-fence",
                    f"peer {peer.name}'s handler of {iv.task!r} (token {iv.token}) ended "
                    f"'{iv.how}' after SIGCONT, expected 'fenced'",
                )
            elif iv.end - t > FENCE_GRACE:
                self.fail(
                    "self-fence",
                    f"peer {peer.name} reported {iv.task!r} fenced {iv.end - t:.2f} s after "
                    f"SIGCONT (at most {FENCE_GRACE} s)",
                )

    async def stop_step(self, peer: PeerProc, step: dict[str, Any]) -> None:
        held = self.running_on(peer)
        t = self.now()
        seen = len(peer.events)
        await self.send(peer, {"op": "stop"})
        await self.wait_for(
            f"peer {peer.name} did not write 'stopped' and exit within {REPLY_TIMEOUT} s",
            lambda: peer.exited.is_set(),
            REPLY_TIMEOUT,
        )
        if not any(ev.get("event") == "stopped" for _, ev in peer.events[seen:]):
            raise ScenarioFailed(f"peer {peer.name} exited without writing 'stopped'")
        if peer.exit_code != 0:
            raise ScenarioFailed(f"peer {peer.name} exited {peer.exit_code} after stop")
        for iv in held.values():
            if iv.how != "stopped":
                self.fail(
                    "graceful stop",
                    f"peer {peer.name}'s handler of {iv.task!r} ended '{iv.how}' on stop "
                    "(expected a stop event with reason 'stopped' before it exits)",
                )
        if "handback" in step:
            await self.expect_moved(peer, held, t, self.seconds(step["handback"]), "hand back")

    async def cancel_step(self, step: dict[str, Any], *, durable: bool) -> None:
        queue, task = step["queue"], step["task"]
        via = self.peers[step["peer"]]
        runs = [iv for iv in self.open.values() if iv.queue == queue and iv.task == task]
        if not runs:
            raise ScenarioFailed(f"{task!r} of queue {queue} runs nowhere before the cancel")
        holder = self.peers[runs[0].peer]
        if durable:
            assert holder.proc is not None
            # Stopped, the holder cannot reconnect; its connections are closed
            # so the cancel's message cannot reach it: only its inbox can.
            holder.proc.send_signal(signal.SIGSTOP)
            t_pause = self.now()
            holder.paused.append([t_pause, math.inf])
            killed = await self.kill_connections(holder.pid)
            if not killed:
                holder.proc.send_signal(signal.SIGCONT)
                holder.paused[-1][1] = self.now()
                raise ScenarioFailed(f"found no Redis connection of peer {holder.name}")
        t = self.now()
        ev = await self.request(via, {"op": "cancel", "queue": queue, "task": task})
        self.cancelled.append((self.now(), queue, task))
        if ev.get("found") is not True:
            raise ScenarioFailed(f"cancel of running {task!r} answered {json.dumps(ev)}")
        if durable:
            t = self.now()
            holder.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            holder.paused[-1][1] = t
        within = self.seconds(step["within"])
        try:
            await self.wait_for("", lambda: all(iv.end < math.inf for iv in runs), within)
        except ScenarioFailed:
            how = (
                " (and SIGCONT): the heartbeat's inbox did not reach it"
                if durable
                else f": the cancel message did not reach it (H = {self.ttl / 3:.2f} s: the "
                "inbox would have come with a heartbeat; the scripts SPUBLISH where the "
                "server has it, so a peer must SSUBSCRIBE as well as SUBSCRIBE)"
            )
            raise ScenarioFailed(
                f"cancel latency: {task!r} still runs on peer {holder.name} {within:.2f} s "
                f"after the cancel{how}"
            ) from None
        for iv in runs:
            if iv.how != "cancelled":
                self.fail(
                    "cancel",
                    f"peer {iv.peer}'s handler of {task!r} ended '{iv.how}', expected 'cancelled'",
                )
        self.log(
            f"  cancel ({'inbox' if durable else 'pub/sub'}) latency "
            f"{max(iv.end for iv in runs) - t:.3f} s"
        )

    async def kill_connections(self, pid: int) -> int:
        """Close the Redis connections of process ``pid`` (``CLIENT KILL ID``),
        found by matching ``CLIENT LIST``'s addresses with the process's
        sockets (/proc, Linux)."""
        ports = _local_ports(pid)
        listing = await self.conn.execute("CLIENT", "LIST")
        n = 0
        for line in listing.decode().splitlines():
            fields = dict(f.split("=", 1) for f in line.split(" ") if "=" in f)
            port = int(fields.get("addr", ":0").rsplit(":", 1)[1])
            if port in ports:
                n += await self.conn.execute("CLIENT", "KILL", "ID", fields["id"])
        return n

    async def wait_step(self, step: dict[str, Any]) -> None:
        within = self.seconds(step.get("within", 10))
        cond = step["until"]
        queue = cond["queue"]
        if "running" in cond:
            want = int(cond["running"])
            on = cond.get("peer")

            def ok() -> bool:
                return len(self.running(queue, on)) == want

            def what() -> str:
                return (
                    f"{want} tasks of queue {queue} should run{' on ' + on if on else ''}; "
                    f"{len(self.running(queue, on))} do after {within:.2f} s: "
                    f"{self.holdings(queue)}"
                )
        elif "balanced" in cond:
            names = cond["balanced"]
            total = int(cond["total"])
            lo, hi = total // len(names), -(-total // len(names))

            def ok() -> bool:
                counts = [len(self.running(queue, n)) for n in names]
                return sum(counts) == total and all(lo <= c <= hi for c in counts)

            def what() -> str:
                return (
                    f"queue {queue}: {total} tasks should spread {lo}..{hi} over peers {names} "
                    f"within {within:.2f} s; they run {self.holdings(queue)}"
                )
        elif "runs" in cond:
            want = int(cond["runs"])

            def runs() -> int:
                return sum(
                    1
                    for p in self.peers.values()
                    for _, ev in p.events
                    if ev.get("event") == "done" and ev.get("queue") == queue and ev.get("ok")
                )

            def ok() -> bool:
                return runs() >= want

            def what() -> str:
                return (
                    f"{want} handler runs of queue {queue} should have finished; "
                    f"{runs()} did after {within:.2f} s"
                )
        elif "ended" in cond:
            want, reason = int(cond["ended"]), cond["reason"]

            def ended() -> list[Interval]:
                return [iv for iv in self.intervals if iv.queue == queue and iv.end < math.inf]

            def ok() -> bool:
                return sum(1 for iv in ended() if iv.how == reason) >= want

            def what() -> str:
                hows = [iv.how for iv in ended()]
                return (
                    f"{want} handlers of queue {queue} should have stopped with reason "
                    f"{reason!r} within {within:.2f} s; ended: {hows}, still running: "
                    f"{sorted(self.running(queue))}"
                )
        elif "dead" in cond or "result" in cond or "counted" in cond:
            await self.wait_redis_condition(queue, cond, within)
            return
        elif "done" in cond or "failed" in cond:
            ok_wanted = "done" in cond
            want = int(cond["done" if ok_wanted else "failed"])

            def done_tasks() -> set[str]:
                return {
                    str(ev.get("task"))
                    for p in self.peers.values()
                    for _, ev in p.events
                    if ev.get("event") == "done"
                    and ev.get("queue") == queue
                    and bool(ev.get("ok")) == ok_wanted
                }

            def ok() -> bool:
                return len(done_tasks()) >= want

            def what() -> str:
                return (
                    f"{want} tasks of queue {queue} should be done "
                    f"{'(ok)' if ok_wanted else '(failed)'}; {len(done_tasks())} are "
                    f"after {within:.2f} s"
                )
        else:
            raise ScenarioFailed(f"unknown wait condition {json.dumps(cond)}")
        try:
            await self.wait_for("", ok, within)
        except ScenarioFailed:
            raise ScenarioFailed(what()) from None

    async def wait_redis_condition(self, queue: str, cond: dict[str, Any], within: float) -> None:
        """The wait conditions read from Redis: ``dead`` (dead letters of the
        queue, each with ``error`` when given), ``result`` (the result record
        of a payload holds ``value``), ``counted`` (the per-minute counts of
        the queue sum to at least that many finished processes)."""
        ns = "{" + self.namespace + "}:"
        seen: list[Any] = [None]
        if "dead" in cond:
            want = int(cond["dead"])

            async def check() -> bool:
                raw = await self.conn.execute("LRANGE", f"{ns}dead:{queue}", 0, -1)
                errors = [r.split(b"\0", 4)[3].decode(errors="replace") for r in raw]
                seen[0] = errors
                return len(errors) >= want and all(e == cond.get("error", e) for e in errors)

            def what() -> str:
                return (
                    f"queue {queue} should have {want} dead letters"
                    + (f" with error {cond['error']!r}" if "error" in cond else "")
                    + f" within {within:.2f} s; it has {seen[0]}"
                )
        elif "result" in cond:
            task = str(cond["result"])
            h = hashlib.sha1(task.encode()).hexdigest()

            async def check() -> bool:
                raw = await self.conn.execute("GET", f"{ns}result:{h}:{queue}")
                if raw is None:
                    return False
                kind, _, _, n, rest = raw.split(b"\0", 4)
                value, payload = rest[: int(n)], rest[int(n) :]
                seen[0] = (kind.decode(), value.decode(errors="replace"))
                want = ("n", "") if cond.get("value") is None else ("v", cond["value"])
                return bool(payload == task.encode() and seen[0] == want)

            def what() -> str:
                return (
                    f"the result record of {task!r} (queue {queue}) should hold "
                    f"{cond.get('value')!r} within {within:.2f} s; "
                    + ("there is none" if seen[0] is None else f"it holds {seen[0]}")
                    + " (a peer writes it with finish_results.lua when the queue's policy "
                    "has a result TTL)"
                )
        else:
            want = int(cond["counted"])

            async def check() -> bool:
                flat = await self.conn.execute("HGETALL", f"{ns}stats:{queue}")
                pairs = dict(zip(flat[::2], flat[1::2], strict=True))
                seen[0] = sum(int(v) for k, v in pairs.items() if k.startswith(b"p"))
                return bool(seen[0] >= want)

            def what() -> str:
                return (
                    f"the per-minute counts of queue {queue} ({{ns}}:stats:{queue}) should "
                    f"count {want} finished processes within {within:.2f} s; they count "
                    f"{seen[0]} (a peer sends its counts to stats.lua every 5 s)"
                )

        await self.wait_redis(what, check, within)

    def holdings(self, queue: str) -> dict[str, int]:
        return {n: len(self.running(queue, n)) for n in self.peers}

    # -- invariants over the whole record ----------------------------------

    def check(self) -> None:
        by_task: dict[tuple[str, str], list[Interval]] = {}
        for iv in self.intervals:
            by_task.setdefault((iv.queue, iv.task), []).append(iv)
        tokens: dict[int, Interval] = {}
        for iv in self.intervals:
            if iv.token < 0:
                continue  # not a token (reported as a line-protocol failure)
            if iv.token in tokens and tokens[iv.token] is not iv:
                other = tokens[iv.token]
                self.fail(
                    "growing tokens",
                    f"token {iv.token} given twice: {other.task!r} on {other.peer} and "
                    f"{iv.task!r} on {iv.peer}",
                )
            tokens[iv.token] = iv
        for (queue, task), ivs in by_task.items():
            ivs.sort(key=lambda iv: iv.start)
            for a, b in itertools.pairwise(ivs):
                if min(a.token, b.token) >= 0 and b.token <= a.token:
                    self.fail(
                        "growing tokens",
                        f"{task!r} of queue {queue}: owner {b.peer} started with token "
                        f"{b.token} after {a.peer}'s token {a.token}",
                    )
            for i, a in enumerate(ivs):
                for b in ivs[i + 1 :]:
                    overlap = self._overlap(a, b)
                    if overlap > OVERLAP_JITTER:
                        self.fail(
                            "one owner",
                            f"{task!r} of queue {queue} ran twice at once for {overlap:.3f} s: "
                            f"on {a.peer} (token {a.token}, {self._span(a)}) and on {b.peer} "
                            f"(token {b.token}, {self._span(b)})",
                        )
            for t_cancel, q, t in self.cancelled:
                if q == queue and t == task:
                    for iv in ivs:
                        if iv.start > t_cancel + OVERLAP_JITTER:
                            self.fail(
                                "durable cancel",
                                f"{task!r} of queue {queue} started again on {iv.peer} "
                                f"(token {iv.token}) {iv.start - t_cancel:.3f} s after its cancel",
                            )

    def _span(self, iv: Interval) -> str:
        t0 = self.t0
        end = "still running" if iv.end == math.inf else f"{iv.end - t0:.3f} s ({iv.how})"
        return f"from {iv.start - t0:.3f} s to {end}"

    def _live(self, iv: Interval) -> list[tuple[float, float]]:
        """The parts of ``iv`` when its handler could run: not while its peer
        was stopped (SIGSTOP), and not in the FENCE_GRACE after SIGCONT when
        it then stopped as fenced."""
        end = iv.end if iv.end < math.inf else self.now()
        parts = [(iv.start, end)]
        for p0, p1 in self.peers[iv.peer].paused:
            cut: list[tuple[float, float]] = []
            for s, e in parts:
                if e <= p0 or s >= p1:
                    cut.append((s, e))
                    continue
                if s < p0:
                    cut.append((s, p0))
                if e > p1:
                    resumed = p1
                    if iv.how == "fenced" and e - resumed <= FENCE_GRACE:
                        continue
                    cut.append((p1, e))
            parts = cut
        return parts

    def _overlap(self, a: Interval, b: Interval) -> float:
        total = 0.0
        for s1, e1 in self._live(a):
            for s2, e2 in self._live(b):
                total += max(0.0, min(e1, e2) - max(s1, s2))
        return total


def _local_ports(pid: int) -> set[int]:
    """Local TCP ports of the sockets process ``pid`` has open (Linux /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


async def run_scenarios(
    scenarios: Sequence[dict[str, Any]],
    url: str,
    conn: Connection,
    peer_command: str,
    prefix: str,
    log: Callable[[str], None],
) -> list[Failure]:
    """Run each scenario in a namespace of its own (``prefix`` + its name)."""
    failures: list[Failure] = []
    for sc in scenarios:
        namespace = f"{prefix}-{sc['name']}"[:64]
        run = Run(sc, url, conn, peer_command, namespace, log)
        run.t0 = anyio.current_time()
        log(f"scenario {sc['name']} ...")
        got = await run.run()
        took = anyio.current_time() - run.t0
        log(f"scenario {sc['name']}: {'ok' if not got else 'FAILED'} ({took:.1f} s)")
        failures += got
    return failures


def new_prefix() -> str:
    """A fresh namespace prefix for one run of the suite."""
    return f"conformance-{secrets.token_hex(4)}"
