"""The steps of a scenario other than the waits: start, send, set, the
client's steps (configure, schedule, pause and resume a queue), rate and
token checks, a quiet window, kill, pause (SIGSTOP), stop and cancel, each
checking what it must see happen."""

from __future__ import annotations

import json
import math
import signal
from typing import Any

import anyio
import anyio.abc

import mesh

from ._group_checks import check_serial, check_turns
from ._record import (
    FENCE_GRACE,
    OVERLAP_JITTER,
    REPLY_TIMEOUT,
    START_TIMEOUT,
    Interval,
    PeerProc,
    ScenarioFailed,
)
from ._waits import Waits


class Steps(Waits):
    """A scenario's steps (see the module docstring)."""

    async def step(self, nursery: anyio.abc.TaskGroup, step: dict[str, Any]) -> None:
        """Do one step (its ``do`` says which); raise ScenarioFailed if what
        it must see does not happen."""
        do = step["do"]
        on_peer = {
            "start": self.start_step,
            "send": self.send_step,
            "kill": self.kill_step,
            "pause": self.pause_step,
            "stop": self.stop_step,
        }
        if do in on_peer:
            await on_peer[do](self.peers[step["peer"]], step)
        elif do == "set":
            await self.conn.execute("SET", f"{{{self.namespace}}}:{step['key']}", step["value"])
        elif do in ("configure", "configure_group", "schedule", "pause_queue", "resume_queue"):
            await self.client_step(step)
        elif do == "check_serial":
            check_serial(self.intervals, step)
        elif do == "check_turns":
            check_turns(self.intervals, step)
        elif do == "check_rate":
            self.check_rate(step)
        elif do == "check_tokens":
            await self.check_tokens(step)
        elif do == "wait":
            await self.wait_step(step)
        elif do == "quiet":
            await self.quiet_step(step)
        elif do == "cancel":
            await self.cancel_step(step, durable=False)
        elif do == "cancel_durable":
            await self.cancel_step(step, durable=True)
        else:
            raise ScenarioFailed(f"unknown step {do!r}")

    async def start_step(self, peer: PeerProc, step: dict[str, Any]) -> None:
        """Send ``start``: the peer answers ``ready``, or with ``expect``
        ``{"code": C, "exit": N}`` refuses with that code and exits N."""
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

    async def send_step(self, peer: PeerProc, step: dict[str, Any]) -> None:
        """Send a command; its ack must hold the fields of ``expect``."""
        cmd = step["cmd"]
        ev = await self.request(peer, cmd)
        if cmd["op"] in ("enqueue",):
            self.enqueued.setdefault(cmd["queue"], set()).update(cmd["tasks"])
        for field, want in step.get("expect", {}).items():
            if ev.get(field) != want:
                raise ScenarioFailed(
                    f"peer {peer.name} answered {json.dumps(ev)}: {field} should be {want!r}"
                )

    async def quiet_step(self, step: dict[str, Any]) -> None:
        """A deliberate window in which nothing must happen: the invariants
        checked at the end cover it (and, with no_start, no handler of that
        queue may start in it). A paused queue's window opens when the pause
        took effect: a peer that ignores the pause may have run its tasks
        before the quiet step began."""
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

    async def kill_step(self, peer: PeerProc, step: dict[str, Any]) -> None:
        """SIGKILL the peer; with ``takeover``, its tasks start elsewhere within it."""
        assert peer.proc is not None
        held = self.running_on(peer)
        t = peer.killed_at = self.now()
        peer.proc.kill()
        self._close_peer(peer, t, "killed")
        if "takeover" in step:
            await self.expect_moved(peer, held, t, self.seconds(step["takeover"]), "takeover")

    async def pause_step(self, peer: PeerProc, step: dict[str, Any]) -> None:
        """SIGSTOP the peer for ``seconds`` (with ``takeover``, its tasks start
        elsewhere meanwhile), then SIGCONT: its handlers stop as fenced."""
        assert peer.proc is not None
        held = self.running_on(peer)
        t = self.now()
        peer.proc.send_signal(signal.SIGSTOP)
        peer.paused.append([t, math.inf])
        if "takeover" in step:
            await self.expect_moved(peer, held, t, self.seconds(step["takeover"]), "takeover")
        # A deliberate pause of the peer (SIGSTOP) for the time the step says.
        await anyio.sleep_until(t + self.seconds(step["seconds"]))
        await self.resume(peer, held, fenced=step.get("expect_fenced", True))

    async def client_step(self, step: dict[str, Any]) -> None:
        """A step the harness does itself, as a client of the mesh (the
        Python one): a queue's policy, a group's settings, a periodic task,
        a pause."""
        do, queue = step["do"], step["queue"]
        async with mesh.open_client(self.url, namespace=self.namespace) as client:
            if do == "configure":
                policy = dict(step["policy"])
                if isinstance(policy.get("rate_limit"), list):
                    policy["rate_limit"] = tuple(policy["rate_limit"])
                await client.configure(queue, **policy)
            elif do == "configure_group":
                await client.configure_group(
                    queue,
                    step["group"],
                    concurrency=step.get("concurrency"),
                    weight=step.get("weight"),
                )
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
