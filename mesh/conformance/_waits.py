"""The ``wait`` steps of a scenario: until handlers run (on a peer, spread
over peers), finish, fail or stop with a reason, or until Redis holds dead
letters, a result or per-minute counts."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

from .._blob import standin
from ._peers import Peers
from ._record import Interval, ScenarioFailed
from .peer import padded

# A wait condition: whether it holds, and what was seen when it did not.
_Condition = tuple[Callable[[], bool], Callable[[], str]]


class Waits(Peers):
    """The ``wait`` steps (see the module docstring)."""

    async def wait_step(self, step: dict[str, Any]) -> None:
        """Wait until the condition ``until`` holds, for at most ``within``
        seconds (10 if not given); raise ScenarioFailed saying what was seen."""
        within = self.seconds(step.get("within", 10))
        cond = step["until"]
        queue = cond["queue"]
        if "running" in cond or "balanced" in cond:
            ok, what = self.running_condition(queue, cond, within)
        elif "runs" in cond or "ended" in cond:
            ok, what = self.ended_condition(queue, cond, within)
        elif "dead" in cond or "result" in cond or "counted" in cond:
            await self.wait_redis_condition(queue, cond, within)
            return
        else:
            ok, what = self.done_condition(queue, cond, within)
        try:
            await self.wait_for("", ok, within)
        except ScenarioFailed:
            raise ScenarioFailed(what()) from None

    def running_condition(self, queue: str, cond: dict[str, Any], within: float) -> _Condition:
        """``running``: that many handlers of the queue run (on ``peer``, or
        anywhere); ``balanced``: ``total`` run, spread evenly over those peers."""
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
        else:  # balanced
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

        return ok, what

    def ended_condition(self, queue: str, cond: dict[str, Any], within: float) -> _Condition:
        """``runs``: that many handler runs of the queue finished ok;
        ``ended``: that many handlers stopped with ``reason``."""
        if "runs" in cond:
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
        else:  # ended
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

        return ok, what

    def done_condition(self, queue: str, cond: dict[str, Any], within: float) -> _Condition:
        """``done`` (or ``failed``): that many tasks of the queue were done ok
        (or failed)."""
        if "done" not in cond and "failed" not in cond:
            raise ScenarioFailed(f"unknown wait condition {json.dumps(cond)}")
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

        return ok, what

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
            # with "size": the task padded to that many bytes, stored out of
            # line (its records hold its stand-in), and echoed whole
            whole = padded(task, int(cond["size"])) if "size" in cond else task.encode()
            stored = standin(whole)
            h = hashlib.sha1(stored).hexdigest()

            async def check() -> bool:
                raw = await self.conn.execute("GET", f"{ns}result:{h}:{queue}")
                if raw is None:
                    return False
                kind, _, _, n, rest = raw.split(b"\0", 4)
                value, payload = rest[: int(n)], rest[int(n) :]
                if "size" in cond:
                    seen[0] = (kind.decode(), f"{len(value)} bytes, {value[:40]!r}...")
                    return bool(payload == stored and kind == b"v" and value == whole)
                seen[0] = (kind.decode(), value.decode(errors="replace"))
                want = ("n", "") if cond.get("value") is None else ("v", cond["value"])
                return bool(payload == task.encode() and seen[0] == want)

            def what() -> str:
                return (
                    f"the result record of {task!r} (queue {queue}) should hold "
                    + (
                        f"the whole payload of {cond['size']} bytes"
                        if "size" in cond
                        else repr(cond.get("value"))
                    )
                    + f" within {within:.2f} s; "
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
