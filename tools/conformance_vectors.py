"""Record the conformance suite's script vectors (protocol/conformance/vectors/).

    python tools/conformance_vectors.py            # regenerate every vector file
    python tools/conformance_vectors.py --check    # replay them, report what differs

It starts a redis-server of its own (``mesh.testing.run_redis_server``) and
plays short stories through the Python peers' script bindings
(``mesh._binding.Binding``): each script call of a story runs for real, at a
fixed Redis time (the vector time prelude), and becomes a vector with the
keyspace before it, its keys and arguments, its reply (or error) and the
keyspace after it. Run it after a change to a script; review the diff of the
JSON files like any other change of the contract.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from mesh._binding import Binding
from mesh._connection import Connection, open_connection
from mesh._errors import CommandError, MeshError
from mesh._eval import run_reads, run_script
from mesh._keys import Keys
from mesh._replies import ResultsToKeep
from mesh._scripts import load_scripts
from mesh.conformance import _vectors as v
from mesh.testing import run_redis_server

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "protocol" / "conformance" / "vectors"
GEN_NS = "vgen"
START_S = 1_800_000_000  # the Redis time of every story's first call (2027-01-15)
TOKEN = "9000000000000000"  # {ns}:token at the start: tokens are last + 1, not the clock


class Recorder:
    """An executor for :class:`Binding` that runs each script at the story's
    clock and records it as a vector (when a name was set for the call)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.ms = START_S * 1000
        self.by_sha = {s.sha: name for name, s in load_scripts().items()}
        self.name: str | None = None
        self.description = ""
        self.vectors: dict[str, list[dict[str, Any]]] = {}

    def at(self, name: str, description: str) -> Named:
        """An executor that records the script calls made through it as
        vector ``name`` (and ``name-again``, ``name-again-2``... for the calls
        a binding makes again, e.g. with the keys a first call said were
        missing)."""
        return Named(self, name, description)

    async def execute(self, *args: Any) -> Any:
        if args[0] != "EVALSHA":
            return await self.conn.execute(*args)
        script = self.by_sha[args[1]]
        n = int(args[2])
        keys = [_s(a) for a in args[3 : 3 + n]]
        argv = [_s(a) for a in args[3 + n :]]
        self.ms += 10
        time = [self.ms // 1000, (self.ms % 1000) * 1000]
        before = await v.dump(self.conn, GEN_NS)
        try:
            raw = await self.conn.execute("EVAL", v.source_at(script, time), n, *keys, *argv)
            outcome: dict[str, Any] = {"reply": v.text(raw)}
            error = None
        except CommandError as exc:
            outcome = {"error": v.error_text(exc)}
            error = exc
        after = await v.dump(self.conn, GEN_NS)
        if self.name is not None:
            vec = {
                "script": script,
                "name": self.name,
                "description": self.description,
                "time": time,
                "before": before,
                "keys": keys,
                "args": argv,
                **outcome,
                "after": after,
            }
            reply = outcome.get("reply")
            if (
                isinstance(reply, list)
                and reply
                and (
                    (script in ("cancel", "delete_queue") and reply[0] == 1)
                    or (script in ("rebalance", "recycle") and reply[0] == 2)
                )
            ):
                vec["unordered"] = True
            self.vectors.setdefault(script, []).append(v.rename(vec, GEN_NS, v.PLACEHOLDER))
            self.name = None
        if error is not None:
            raise error
        return raw

    def advance(self, ms: int) -> None:
        self.ms += ms


class Named:
    """See :meth:`Recorder.at`."""

    def __init__(self, r: Recorder, name: str, description: str) -> None:
        self.r, self.name, self.description, self.calls = r, name, description, 0

    async def execute(self, *args: Any) -> Any:
        if args[0] == "EVALSHA":
            suffix = (
                "" if self.calls == 0 else "-again" + ("" if self.calls == 1 else f"-{self.calls}")
            )
            self.r.name, self.r.description = self.name + suffix, self.description
            self.calls += 1
        return await self.r.execute(*args)

    async def pipeline(
        self, commands: Sequence[Sequence[Any]], *, raise_on_error: bool = True
    ) -> list[Any]:
        """Each command through :meth:`execute`, one after the other (a
        binding's pipeline, e.g. ``finish_and_claim``)."""
        replies: list[Any] = []
        for command in commands:
            try:
                replies.append(await self.execute(*command))
            except CommandError as exc:
                if raise_on_error:
                    raise
                replies.append(exc)
        return replies


def _s(a: Any) -> str:
    if isinstance(a, bytes | bytearray | memoryview):
        return bytes(a).decode()
    return str(a)


async def expect_error(coro: Awaitable[Any]) -> None:
    try:
        await coro
    except MeshError:
        return
    raise AssertionError("the call should have failed")


async def variant(
    r: Recorder, script: str, base: str, name: str, description: str, old: str, new: str
) -> None:
    """Record vector ``name``: the call of vector ``base`` again, with its
    argument ``old`` replaced by ``new`` (an error path the binding never
    takes)."""
    vec = next(x for x in r.vectors[script] if x["name"] == base)
    keys = v.rename(vec["keys"], v.PLACEHOLDER, GEN_NS)
    args = [new if a == old else a for a in v.rename(vec["args"], v.PLACEHOLDER, GEN_NS)]
    assert new in args, f"{base} has no argument {old!r}"
    sha = load_scripts()[script].sha
    await expect_error(r.at(name, description).execute("EVALSHA", sha, len(keys), *keys, *args))


INFO = b'{"host":"h1","pid":100}'


async def story_worker(r: Recorder, b: Binding, raw: Connection) -> None:
    """A worker's life on one-shot tasks: join, serve, claim, finish, fail,
    heartbeat, be fenced, leave."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r.at("register-new", "a new worker joins"), "w1", "i1", 3000, INFO)
    await expect_error(
        b.register(
            r.at("register-duplicate", "a live worker id is refused"), "w1", "i9", 3000, INFO
        )
    )
    await b.serve(r.at("serve-first", "w1 serves queue q"), "w1", "i1", "q")
    await b.serve(r.at("serve-again", "serving again changes nothing"), "w1", "i1", "q")
    await expect_error(
        b.serve(r.at("serve-fenced", "serve with another incarnation"), "w1", "i0", "q")
    )
    await variant(r, "serve", "serve-first", "serve-bad-capacity", "capacity 0", "1", "0")
    await b.enqueue(
        r.at("enqueue-three", "three one-shot tasks, no idle server"), "q", [b"a", b"b", b"c"]
    )
    await b.enqueue(r.at("enqueue-priority", "a task of priority 5"), "q", [b"hi"], 5)
    c1 = await b.claim(
        r.at("claim-two", "claim two: the priority task first, then the list head"),
        "w1",
        "i1",
        "q",
        2,
        5,
        backoff_ms=1000,
        backoff_cap_ms=60000,
        ttl_ms=3000,
    )
    ids = [p.id for p in c1.processes]
    await expect_error(
        b.claim(
            r.at("claim-fenced", "a claim with another incarnation is fenced"),
            "w1",
            "bad",
            "q",
            1,
            5,
        )
    )
    await expect_error(
        b.claim(
            r.at("claim-not-serving", "a claim of a queue not served"), "w1", "i1", "other", 1, 5
        )
    )
    await variant(r, "claim", "claim-two", "claim-bad-count", "a claim of 0 tasks", "2", "0")
    await b.finish(r.at("finish-one", "finish a live process"), "w1", "i1", "q", ids[:1])
    await b.finish(r.at("finish-repeat", "finishing it again returns 0"), "w1", "i1", "q", ids[:1])
    await b.give_back(
        r.at("give-back-fail-retry", "a failed attempt waits in the delayed set"),
        "w1",
        "q",
        ids[1:2],
        failed=True,
        backoff_ms=1000,
        backoff_cap_ms=60000,
        errors=["RuntimeError: boom"],
    )
    c2 = await b.claim(r.at("claim-rest", "claim what is left"), "w1", "i1", "q", 5, 5, ttl_ms=3000)
    await b.give_back(
        r.at("give-back-return", "processes handed back go to the head of the queue"),
        "w1",
        "q",
        [p.id for p in c2.processes],
        failed=False,
    )
    await variant(
        r,
        "give_back",
        "give-back-return",
        "give-back-bad-mode",
        "an unknown mode",
        "return",
        "sideways",
    )
    await b.heartbeat(
        r.at("heartbeat-renew", "renew w1's lease, one queue"), "w1", "i1", 3000, [], ["q"]
    )
    await expect_error(
        b.heartbeat(
            r.at("heartbeat-fenced", "another incarnation is fenced"), "w1", "zz", 3000, [], ["q"]
        )
    )
    await b.drain(r.at("drain", "w1 begins a graceful stop of q"), "w1", "i1", "q")
    await b.drain(r.at("drain-repeat", "draining again answers 0"), "w1", "i1", "q")
    await expect_error(
        b.claim(r.at("claim-drained", "a drained worker may not claim"), "w1", "i1", "q", 1, 5)
    )
    await b.unserve(r.at("unserve", "w1 stops serving q"), "w1", "q")
    await b.recycle(r.at("recycle-leave", "w1 leaves"), "w1", leave=True, incarnation="i1")
    await variant(
        r, "recycle", "recycle-leave", "recycle-bad-mode", "an unknown mode", "leave", "linger"
    )


async def story_persistent(r: Recorder, b: Binding, raw: Connection) -> None:
    """Persistent tasks: ensure, conflicts, fair claims, cancel, rebalance."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.register(r, "w2", "i2", 3000, INFO)
    await b.serve(r, "w1", "i1", "p")
    await b.ensure(r.at("ensure-four", "four persistent tasks"), "p", [b"t1", b"t2", b"t3", b"t4"])
    await b.ensure(r.at("ensure-repeat", "ensuring again adds nothing"), "p", [b"t1"])
    await b.ensure(r.at("ensure-weight", "a persistent task of weight 3"), "p", [b"heavy"], 3)
    await expect_error(
        b.enqueue(r.at("enqueue-conflict", "a persistent task cannot be enqueued"), "p", [b"t1"])
    )
    await b.enqueue(r, "p", [b"one"])
    await expect_error(
        b.ensure(r.at("ensure-conflict", "a queued one-shot task cannot be ensured"), "p", [b"one"])
    )
    await b.claim(
        r.at("claim-fair", "one server of one: a fair claim takes everything"),
        "w1",
        "i1",
        "p",
        10,
        5,
        fair=True,
        ttl_ms=3000,
    )
    await b.serve(r.at("serve-second", "a second server halves the fair share"), "w2", "i2", "p")
    await b.heartbeat(
        r.at("heartbeat-balance", "w2's heartbeat reads the balance of p"),
        "w2",
        "i2",
        3000,
        [],
        ["p"],
    )
    await b.rebalance(
        r.at("rebalance-marks", "w2, below its share, asks w1 for its surplus"),
        "w2",
        "i2",
        "p",
        20,
        6000,
    )
    hb = await b.heartbeat(
        r.at("heartbeat-moving", "w1 learns which processes to hand back"),
        "w1",
        "i1",
        3000,
        [],
        ["p"],
    )
    moving = (
        [pid for q in hb.queues for pid in getattr(q, "moving", ())]
        if hasattr(hb, "queues")
        else []
    )
    procs = await raw.execute("HKEYS", "{vgen}:procs:p")
    marked = await raw.execute("HKEYS", "{vgen}:moving:p")
    await b.give_back(
        r.at("give-back-moved", "handing back a marked process reserves it for its receiver"),
        "w1",
        "p",
        [_s(x) for x in (marked or moving)],
        failed=False,
    )
    await b.claim(
        r.at("claim-reserved", "the receiver takes its reservations first"),
        "w2",
        "i2",
        "p",
        10,
        5,
        fair=True,
        ttl_ms=3000,
    )
    await b.cancel(r.at("cancel-running", "cancel a running persistent task"), "p", b"t1")
    await b.cancel(r.at("cancel-missing", "cancel a payload that is nowhere"), "p", b"nothing")
    await b.cancel(r.at("cancel-queued", "cancel a queued one-shot task"), "p", b"one")
    await b.heartbeat(
        r.at("heartbeat-inbox", "the heartbeat returns the cancelled ids"),
        "w1",
        "i1",
        3000,
        [],
        ["p"],
    )
    del procs
    await b.rebalance(
        r.at("rebalance-again", "w2 asks again after taking its reservations"),
        "w2",
        "i2",
        "p",
        20,
        6000,
    )
    await b.finish(
        r.at("finish-persistent", "a persistent task that returns leaves the mesh"),
        "w2",
        "i2",
        "p",
        [_s(x) for x in await raw.execute("SMEMBERS", "{vgen}:held:w2:p")][:1],
    )
    await b.unserve(
        r.at("unserve-holding", "a server that leaves returns its processes"), "w2", "p"
    )


async def story_reap(r: Recorder, b: Binding, raw: Connection) -> None:
    """A worker dies: reap_check finds it after its deadline, recycle returns its processes."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.register(r, "w2", "i2", 3000, INFO)
    await b.serve(r, "w1", "i1", "q")
    await b.serve(r, "w2", "i2", "q")
    await b.ensure(r, "q", [b"p1"])
    await b.enqueue(r, "q", [b"o1"])
    await b.claim(r, "w1", "i1", "q", 5, 2, ttl_ms=3000)
    await b.reap_check(r.at("reap-check-none", "nobody's deadline has passed"), 16, 0)
    r.advance(4000)
    await raw.execute("DEL", "{vgen}:worker:w1")  # w1's lease ran out (PX expiry)
    await b.heartbeat(r, "w2", "i2", 3000, [], ["q"])
    await b.reap_check(
        r.at("reap-check-dead", "w1's deadline passed; a reap lease hides it"), 16, 500
    )
    await b.reap_check(r.at("reap-check-hidden", "within the reap lease w1 is hidden"), 16, 500)
    await b.recycle_dead(
        r.at("recycle-dead", "w1's processes go back; a crash counts an attempt"),
        ["w1"],
        queues=["q"],
    )
    # No vector of recycling a live worker: recycle.lua then sets its deadline
    # from its lease key's PTTL, which runs on the real clock.


async def story_jobs(r: Recorder, b: Binding, raw: Connection) -> None:
    """Job-queue features: policies, delays, dead letters, results, schedules, delete."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await raw.execute("SET", "{vgen}:version", "0")
    await expect_error(
        b.register(
            r.at("register-version", "a namespace of another protocol version"),
            "w9",
            "i9",
            3000,
            INFO,
        )
    )
    await raw.execute("DEL", "{vgen}:version")
    await b.configure(
        r.at("configure-default", "a worker's options become the policy"),
        "j",
        "default",
        "worker w1",
        ["max_attempts", 1, "backoff_ms", 0],
    )
    await b.configure(
        r.at("configure-set", "configure sets a field"),
        "j",
        "set",
        "configure",
        ["result_ttl_ms", 60000],
    )
    await expect_error(
        b.configure(
            r.at("configure-bad", "an unknown field"), "j", "set", "configure", ["colour", 1]
        )
    )
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "j")
    await b.delay(r.at("delay-in", "a task due in 5 s"), "j", [b"later"], in_ms=5000)
    await expect_error(b.delay(r.at("delay-bad", "a negative delay"), "j", [b"x"], in_ms=-1))
    await b.enqueue(r, "j", [b"bad", b"good"])
    c = await b.claim(r, "w1", "i1", "j", 2, 1, ttl_ms=3000)
    bad = [p.id for p in c.processes if p.task == b"bad"]
    good = {p.id: p.task for p in c.processes if p.task == b"good"}
    await b.give_back(
        r.at("give-back-dead", "the last attempt fails: a dead letter"),
        "w1",
        "j",
        bad,
        failed=True,
        errors=["ValueError: no"],
    )
    await b.finish(
        r.at("finish-results", "a finish that keeps the result"),
        "w1",
        "i1",
        "j",
        list(good),
        ResultsToKeep(60000, {k: (t, b"42") for k, t in good.items()}),
    )
    await b.finish(
        r.at("finish-results-repeat", "finishing again keeps nothing more"),
        "w1",
        "i1",
        "j",
        list(good),
        ResultsToKeep(60000, {k: (t, b"42") for k, t in good.items()}),
    )
    await b.dead(r.at("dead-requeue", "requeue the dead letters"), "j", "requeue", None)
    await b.enqueue(r, "j", [b"x"])
    await b.dead(r.at("dead-purge-none", "purge when there is nothing dead"), "j", "purge", None)
    await b.configure(r.at("configure-clear", "the policy is removed"), "j", "clear", "", [])
    await b.schedule(
        r.at("schedule-add", "a periodic task every 60 s"), "j", b"tick", "every 60000", None
    )
    r.advance(60000)
    first = START_S * 1000 + 60000
    await b.fire(r.at("fire-due", "the due tick fires once"), [(b"j\0tick", first, first + 60000)])
    await b.fire(
        r.at("fire-repeat", "the same tick again fires nothing"),
        [(b"j\0tick", first, first + 60000)],
    )
    await variant(
        r, "schedule", "schedule-add", "schedule-bad-mode", "an unknown mode", "add", "append"
    )
    await b.unschedule(r.at("schedule-remove", "remove the periodic task"), "j", b"tick")
    await b.delete_queue(r.at("delete-queue-unknown", "delete a queue that holds nothing"), "none")
    await b.delete_queue(r.at("delete-queue", "delete the queue and everything in it"), "j")


async def story_share(r: Recorder, b: Binding, raw: Connection) -> None:
    """The fair share and its patience, a sticky hand-back, a rate limit."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.register(r, "w2", "i2", 3000, INFO)
    await b.serve(r, "w1", "i1", "p")
    await b.serve(r, "w2", "i2", "p")
    await b.ensure(r, "p", [b"s1", b"s2", b"s3", b"s4"])
    await b.claim(
        r.at("claim-fair-share", "two servers: a fair claim takes half"),
        "w1",
        "i1",
        "p",
        10,
        5,
        fair=True,
        ttl_ms=3000,
    )
    await b.claim(
        r.at("claim-held-back", "at its share, a fair claim takes nothing and wakes a peer"),
        "w1",
        "i1",
        "p",
        10,
        5,
        fair=True,
        ttl_ms=3000,
    )
    r.advance(1000)
    await b.claim(
        r.at("claim-patience", "with a patience of 900 ms, tasks unowned for longer are taken"),
        "w1",
        "i1",
        "p",
        10,
        5,
        fair=True,
        ttl_ms=3000,
        patience_ms=900,
    )
    held = [_s(x) for x in await raw.execute("SMEMBERS", "{vgen}:held:w1:p")]
    await b.give_back(
        r.at("give-back-keep", "a sticky restart keeps persistent tasks reserved for w1"),
        "w1",
        "p",
        sorted(held)[:1],
        failed=False,
        keep_ms=5000,
    )
    await b.enqueue(r, "r", [b"r1", b"r2", b"r3"])
    await b.serve(r, "w2", "i2", "r")
    await b.claim(
        r.at("claim-rate", "a rate limit of 2 per second takes 2 of 3"),
        "w2",
        "i2",
        "r",
        3,
        5,
        ttl_ms=3000,
        rate=(2, 1000),
    )
    await b.claim(
        r.at("claim-rate-empty", "the bucket is empty: the reply says when the next token is due"),
        "w2",
        "i2",
        "r",
        3,
        5,
        ttl_ms=3000,
        rate=(2, 1000),
    )
    await b.delay(
        r.at("delay-at", "a task due at a time of the Redis clock, priority 3"),
        "r",
        [b"at"],
        at_ms=START_S * 1000 + 90000,
        priority=3,
    )
    await b.dead(
        r.at("dead-purge-payloads", "purge the dead letters of given payloads (none)"),
        "r",
        "purge",
        [b"r1"],
    )


async def story_operator(r: Recorder, b: Binding, raw: Connection) -> None:
    """What operators and readers call: pause and resume, per-minute counts,
    a consistent read, the recount of persistent weights."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "o")
    await b.enqueue(r, "o", [b"job-1"])
    await b.pause(r.at("pause", "pause a queue"), "o", "pause")
    await b.pause(r.at("pause-again", "pausing a paused queue changes nothing"), "o", "pause")
    await b.claim(
        r.at("claim-paused", "a paused queue starts no one-shot task"), "w1", "i1", "o", 1, 0
    )
    await b.pause(r.at("resume", "resume wakes the idle servers"), "o", "resume")
    await expect_error(b.pause(r.at("pause-bad", "an unknown mode"), "o", "halt"))
    await b.stats(r.at("stats", "add a minute's counts"), {"o": (3, 1)}, 120)
    r.advance(60000)
    await b.stats(r.at("stats-next-minute", "the next minute's counts"), {"o": (2, 0)}, 120)
    await expect_error(b.stats(r.at("stats-bad", "a negative count"), {"o": (-1, 0)}, 120))
    await run_reads(
        r.at("read", "several reads in one step"),
        [("LLEN", "{vgen}:queue:o"), ("EXISTS", "{vgen}:paused:o"), ("TIME",)],
    )
    await expect_error(
        run_reads(r.at("read-write", "a write is refused"), [("DEL", "{vgen}:queue:o")])
    )
    await b.enqueue(r, "o", [b"job-2-" + b"x" * 40])
    await b.ensure(r, "p", [b"dev-1", b"dev-2"])
    await run_script(
        r.at("peek-budget", "a budget of 1 byte: one entry, then the caller calls again"),
        load_scripts()["peek"],
        ["{vgen}:queue:o"],
        ["list", 0, 9, 8, 0, 0, 1],
    )
    await run_script(
        r.at("peek", "previews of queued entries: first bytes, size, fingerprint, lookups"),
        load_scripts()["peek"],
        [*(f"{{vgen}}:{k}:o" for k in ("queue", "persistent", "standby", "attempts")),
         "{vgen}:unowned:o"],
        ["list", 0, 9, 8, 0, 0, 0],
    )  # fmt: skip
    await run_script(
        r.at("peek-hash", "previews of hash entries by field, a missing field is nil"),
        load_scripts()["peek"],
        ["{vgen}:persistent:p"],
        ["hash", 0, 0, 3, 0, 0, 0, "dev-1", "dev-9"],
    )
    await expect_error(
        run_script(r.at("peek-bad", "an unknown shape"), load_scripts()["peek"],
                   ["{vgen}:queue:o"], ["set", 0, 1, 8, 0, 0, 0])
    )  # fmt: skip
    await raw.execute("HDEL", "{vgen}:persistent:p", "dev-2")  # gone without a cancel
    await b.recount(r.at("recount", "the weight sums follow what the registry holds"), "p")


async def story_finish_claim(r: Recorder, b: Binding, raw: Connection) -> None:
    """A busy runner's round trip: finish what ran and claim the next, one
    call (finish_claim.lua); its refusals write nothing."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "q")
    await b.enqueue(r, "q", [b"a", b"b", b"c"])
    first = await b.claim(r, "w1", "i1", "q", 1, 5, ttl_ms=3000)
    ids = [p.id for p in first.processes]
    f, c = await b.finish_and_claim(
        r.at("finish-claim", "finish a process and claim the next two in one call"),
        "w1", "i1", "q", ids, b.claim_call("w1", "i1", "q", 2, 5, ttl_ms=3000),
    )  # fmt: skip
    took = c.unwrap().processes
    assert f.unwrap() == [True] and len(took) == 2
    ids = [p.id for p in took]
    f, c = await b.finish_and_claim(
        r.at("finish-claim-repeat", "an id finished already, one not ours, and an empty queue"),
        "w1", "i1", "q", [*ids, "123", ids[0]], b.claim_call("w1", "i1", "q", 2, 5, ttl_ms=3000),
    )  # fmt: skip
    assert f.unwrap() == [True, True, False, False] and c.unwrap().processes == ()
    await b.enqueue(r, "q", [b"d"])
    d = await b.claim(r, "w1", "i1", "q", 1, 5, ttl_ms=3000)
    ids = [p.id for p in d.processes]
    f, _ = await b.finish_and_claim(
        r.at("finish-claim-fenced", "another incarnation: nothing is finished or claimed"),
        "w1", "i9", "q", ids, b.claim_call("w1", "i9", "q", 1, 5, ttl_ms=3000),
    )  # fmt: skip
    await expect_error(_unwrap(f))
    f, _ = await b.finish_and_claim(
        r.at("finish-claim-not-serving", "a queue not served: nothing is finished or claimed"),
        "w1", "i1", "other", ids, b.claim_call("w1", "i1", "other", 1, 5, ttl_ms=3000),
    )  # fmt: skip
    await expect_error(_unwrap(f))


async def story_groups(r: Recorder, b: Binding, raw: Connection) -> None:
    """Groups of a queue (protocol/include/group.lua): settings, enqueue into
    a group, turns among the groups and the ungrouped tasks, a cap, a pause,
    a weight, a slot freed by finish, a retry holding its slot, a hand-back,
    recycle and cancel."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "gq", 10)
    cg = b.configure_group
    await cg(
        r.at("configure-group-set", "group t1: concurrency 1"), "gq", "t1", "set", ["1", "", "", ""]
    )
    await cg(
        r.at("configure-group-weight", "group t2: weight 2"), "gq", "t2", "set", ["", "", "", "2"]
    )
    await cg(
        r.at("configure-group-default", "the default of every group: concurrency 2"),
        "gq",
        "",
        "set",
        ["2", "", "", ""],
    )
    await expect_error(
        cg(
            r.at("configure-group-bad", "a weight above 1000"),
            "gq",
            "t2",
            "set",
            ["", "", "", "5000"],
        )
    )
    eg = b.enqueue_group
    await eg(
        r.at("enqueue-group-now", "three jobs into group t1"), "gq", "t1", [b"a1", b"a2", b"a3"]
    )
    await eg(
        r.at("enqueue-group-second", "three jobs into group t2"), "gq", "t2", [b"b1", b"b2", b"b3"]
    )
    await eg(
        r.at("enqueue-group-in", "a job of group t3 due in 5 s"), "gq", "t3", [b"d1"], in_ms=5000
    )
    await eg(
        r.at("enqueue-group-at", "a job of group t3 due at a time"),
        "gq",
        "t3",
        [b"d2"],
        at_ms=START_S * 1000 + 60000,
    )
    await variant(
        r,
        "enqueue_group",
        "enqueue-group-now",
        "enqueue-group-bad-name",
        "a group name with a space",
        "t1",
        "t 1",
    )
    await variant(
        r,
        "enqueue_group",
        "enqueue-group-now",
        "enqueue-group-bad-mode",
        "an unknown mode",
        "now",
        "soon",
    )
    await b.ensure(r, "gp", [b"pp"])
    await expect_error(
        eg(
            r.at("enqueue-group-conflict", "a persistent task cannot go into a group"),
            "gp",
            "t1",
            [b"pp"],
        )
    )
    await b.enqueue(r, "gq", [b"u1", b"u2"])
    await eg(r, "gq", "t4", [b"c1"])
    pg = b.pause_group
    await pg(r.at("pause-group", "pause group t4: it leaves the ready groups"), "gq", "t4", "pause")
    await pg(r.at("pause-group-again", "pausing again changes nothing"), "gq", "t4", "pause")
    await expect_error(pg(r.at("pause-group-bad", "an unknown mode"), "gq", "t4", "stop"))
    c = await b.claim(
        r.at(
            "claim-groups",
            "turns among t1, t2 and the ungrouped tasks; t1 stops at its cap, "
            "t2 (weight 2) takes two; the paused t4 none",
        ),
        "w1",
        "i1",
        "gq",
        6,
        3,
        ttl_ms=3000,
    )
    assert {p.group for p in c.processes} == {"t1", "t2", None}, c.processes
    await b.claim(
        r.at("claim-groups-capped", "t1 and t2 at their caps, no ungrouped task left: nothing"),
        "w1",
        "i1",
        "gq",
        6,
        3,
        ttl_ms=3000,
    )
    await b.serve(r, "w1", "i1", "gw", 10)
    await eg(r, "gw", "heavy", [b"h%d" % i for i in range(1, 8)])
    await eg(r, "gw", "light", [b"l1", b"l2", b"l3"])
    await cg(r, "gw", "heavy", "set", ["", "", "", "2"])
    took: list[bytes] = []
    for i in range(3):
        w = await b.claim(
            r.at(
                f"claim-groups-weight-{i + 1}",
                f"weight 2 against 1, claim {i + 1} of 3 (three jobs each): heavy's turn of"
                " six (the second claim goes on with it), then light's of three",
            ),
            "w1",
            "i1",
            "gw",
            3,
            3,
            ttl_ms=3000,
        )
        took += [p.task for p in w.processes]
    assert took == [b"h1", b"h2", b"h3", b"h4", b"h5", b"h6", b"l1", b"l2", b"l3"], took
    a1 = [p.id for p in c.processes if p.task == b"a1"]
    await b.finish(
        r.at("finish-group", "a1 finishes: t1's slot is free, t1 ready again"), "w1", "i1", "gq", a1
    )
    c = await b.claim(
        r.at("claim-group-next", "t1's next job"), "w1", "i1", "gq", 1, 3, ttl_ms=3000
    )
    a2 = [p.id for p in c.processes]
    await b.give_back(
        r.at("give-back-group-retry", "a2 fails: it waits for its backoff holding t1's slot"),
        "w1",
        "gq",
        a2,
        failed=True,
        backoff_ms=1000,
        backoff_cap_ms=1000,
        errors=["ValueError: no"],
    )
    await b.claim(
        r.at("claim-group-held", "t1's slot is held: nothing of t1"),
        "w1",
        "i1",
        "gq",
        1,
        3,
        ttl_ms=3000,
    )
    r.advance(1500)
    c = await b.claim(
        r.at("claim-group-retry-due", "the retry is due: a2 again, before a3"),
        "w1",
        "i1",
        "gq",
        1,
        3,
        ttl_ms=3000,
    )
    assert [p.task for p in c.processes] == [b"a2"], c.processes
    await b.give_back(
        r.at("give-back-group-return", "a2 handed back: to t1's front, slot freed"),
        "w1",
        "gq",
        [p.id for p in c.processes],
        failed=False,
    )
    await pg(r.at("resume-group", "resume t4: ready again"), "gq", "t4", "resume")
    await b.cancel(
        r.at("cancel-group", "cancel a3 with t1's list: its queued copy goes"), "gq", b"a3", "t1"
    )
    c = await b.claim(r, "w1", "i1", "gq", 1, 3, ttl_ms=3000)
    await b.cancel(
        r.at("cancel-group-running", "cancel a running job of t1: its slot is freed"),
        "gq",
        c.processes[0].task,
        "t1",
    )
    await b.claim(r, "w1", "i1", "gq", 6, 3, ttl_ms=3000)
    await b.recycle(
        r.at("recycle-group", "w1 leaves: its group jobs go back to their fronts"),
        "w1",
        leave=True,
        incarnation="i1",
    )
    await cg(r.at("configure-group-clear", "t1's settings removed"), "gq", "t1", "clear", [])
    await b.delete_queue(r.at("delete-queue-groups", "a queue with groups deleted"), "gq")


async def story_group_priorities(r: Recorder, b: Binding, raw: Connection) -> None:
    """Priorities within a group (protocol version 10): a group's jobs with a
    priority start first, a dead letter keeps its priority and group and a
    requeue puts it back there, and a cancel finds a delayed one at its
    priority."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "gp", 10)
    eg = b.enqueue_group
    await eg(r.at("enqueue-group-plain", "a job without a priority into p1"), "gp", "p1", [b"a"])
    await eg(
        r.at("enqueue-group-priority", "two jobs at priority 7 into p1"),
        "gp",
        "p1",
        [b"c", b"d"],
        priority=7,
    )
    await eg(r.at("enqueue-group-priority-3", "one at priority 3"), "gp", "p1", [b"b"], priority=3)
    await expect_error(
        eg(r.at("enqueue-group-priority-bad", "a priority of 10"), "gp", "p1", [b"x"], priority=10)
    )
    c = await b.claim(
        r.at("claim-group-priorities", "p1's priority 7 first, then 3, then its list"),
        "w1",
        "i1",
        "gp",
        4,
        1,
        ttl_ms=3000,
    )
    assert [p.task for p in c.processes] == [b"c", b"d", b"b", b"a"], c.processes
    await b.give_back(
        r.at("give-back-group-priority-dead", "c fails at its limit: its dead letter keeps g7p1"),
        "w1",
        "gp",
        [c.processes[0].id],
        failed=True,
        errors=["ValueError: no"],
    )
    await b.give_back(
        r.at("give-back-group-priority", "d, b and a handed back: each to its priority's front"),
        "w1",
        "gp",
        [p.id for p in c.processes[1:]],
        failed=False,
    )
    await b.dead(
        r.at("dead-requeue-group", "c requeued: back into p1 at priority 7"), "gp", "requeue", None
    )
    await eg(
        r.at("enqueue-group-priority-in", "a job of p1 at priority 5 due in 5 s"),
        "gp",
        "p1",
        [b"e"],
        in_ms=5000,
        priority=5,
    )
    await b.cancel(
        r.at("cancel-group-priority", "cancel e: its delayed entry goes"), "gp", b"e", "p1"
    )
    await b.cancel(r.at("cancel-group-queued-priority", "cancel c, queued at 7"), "gp", b"c", "p1")
    await b.delete_queue(r.at("delete-queue-group-priorities", "the rest deleted"), "gp")


async def story_group_counts(r: Recorder, b: Binding, raw: Connection) -> None:
    """A group's count of slots in use (protocol version 11): a group without
    a cap counts no job, only a retry waiting for its backoff; a cap set
    while its jobs run counts them at once, and one that goes stops
    counting them (the same for the queue's default)."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "gc", 10)
    await b.enqueue_group(r, "gc", "f", [b"f1", b"f2", b"f3", b"f4"])
    c = await b.claim(
        r.at("claim-group-uncounted", "f has no cap: its jobs start, and no count is written"),
        "w1", "i1", "gc", 3, 3, ttl_ms=3000,
    )  # fmt: skip
    assert len(c.processes) == 3, c.processes
    await b.give_back(
        r.at("give-back-group-hold", "f1 fails: without a cap, its retry counts now (r:f 1)"),
        "w1", "gc", [c.processes[0].id], failed=True, backoff_ms=1000, backoff_cap_ms=1000,
    )  # fmt: skip
    cg = b.configure_group
    await cg(
        r.at("configure-group-recount", "f gets a cap of 2 while two jobs run: r:f 1 + 2"),
        "gc", "f", "set", ["2", "", "", ""],
    )  # fmt: skip
    await b.claim(
        r.at("claim-group-over", "f holds 3 slots, its cap is 2: nothing"),
        "w1", "i1", "gc", 3, 3, ttl_ms=3000,
    )  # fmt: skip
    await cg(
        r.at("configure-group-uncount", "f's cap goes: its two jobs stop counting (r:f 1)"),
        "gc", "f", "clear", [],
    )  # fmt: skip
    await cg(
        r.at("configure-group-default-recount", "a default cap of 1: f's jobs count again"),
        "gc", "", "set", ["1", "", "", ""],
    )  # fmt: skip
    await b.finish(
        r.at("finish-group-counted", "f2 and f3 finish: the count goes down to the retry"),
        "w1", "i1", "gc", [p.id for p in c.processes[1:]],
    )  # fmt: skip
    await cg(
        r.at("configure-group-default-clear", "the default goes: nothing runs, r:f stays 1"),
        "gc", "", "clear", [],
    )  # fmt: skip
    r.advance(1500)
    c = await b.claim(
        r.at("claim-group-retry-uncounted", "f1's retry is due: its slot is free (no r:f)"),
        "w1", "i1", "gc", 3, 3, ttl_ms=3000,
    )  # fmt: skip
    assert sorted(p.task for p in c.processes) == [b"f1", b"f4"], c.processes


def _standin(payload: bytes) -> tuple[str, bytes]:
    """The blob key and the stand-in of ``payload`` (see "Big payloads out of
    line" in protocol/README.md). The scripts tell a stand-in by its mark,
    not by its size: a vector's payload stays small."""
    sha = hashlib.sha1(payload).hexdigest()
    head = b"\0mesh-blob\0" + sha.encode() + b"\0%d\0" % len(payload)
    return f"{{vgen}}:blob:{sha}", head + payload


async def story_blobs(r: Recorder, b: Binding, raw: Connection) -> None:
    """A big payload stored out of line: uploaded (put_blob.lua, expiring
    until referenced), enqueued as its stand-in twice (two references),
    refused when its blob is gone, finished (one left) and cancelled (the
    blob goes with its last copy)."""
    put = load_scripts()["put_blob"]
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "q")
    key, s = _standin(b"a big payload")
    await run_script(r.at("put-blob-new", "upload a payload: kept an hour until referenced"),
                     put, [key], [b"a big payload"])  # fmt: skip
    await run_script(r.at("put-blob-again", "the same payload again: nothing new"),
                     put, [key], [b"a big payload"])  # fmt: skip
    await b.enqueue(r.at("enqueue-blob", "its stand-in enqueued twice: two references, kept"),
                    "q", [s, s])  # fmt: skip
    _, gone = _standin(b"an upload that expired")
    await expect_error(
        b.enqueue(r.at("enqueue-blob-gone", "a stand-in whose blob is gone: refused"), "q", [gone])
    )
    c = await b.claim(r, "w1", "i1", "q", 1, 5, ttl_ms=3000)
    await b.finish(r.at("finish-blob", "a finished copy drops its reference"),
                   "w1", "i1", "q", [p.id for p in c.processes])  # fmt: skip
    await b.cancel(r.at("cancel-blob", "the last copy cancelled: the blob goes"), "q", s)
    await run_script(r, put, [key], [b"a big payload"])
    await b.ensure(r.at("ensure-blob", "a persistent big task: one reference"), "q", [s], 1)
    await b.delete_queue(r.at("delete-queue-blob", "the queue deleted: its blobs go"), "q")


async def story_enqueue_times(r: Recorder, b: Binding, raw: Connection) -> None:
    """A queue that keeps enqueue times (include/enqueue_time.lua): every
    path that enqueues a one-shot job writes its first time, the job keeps
    it while it runs and is retried, and it leaves with the job."""
    await raw.execute("SET", "{vgen}:token", TOKEN)
    await b.register(r, "w1", "i1", 3000, INFO)
    await b.serve(r, "w1", "i1", "q")
    await b.configure(
        r.at("configure-enqueue-times", "enqueue_times on: the queue joins {ns}:timed"),
        "q", "set", "configure", ["enqueue_times", 1],
    )  # fmt: skip
    await expect_error(
        b.configure(
            r.at("configure-enqueue-times-bad", "enqueue_times is 0 or 1"),
            "q", "set", "configure", ["enqueue_times", 2],
        )
    )  # fmt: skip
    await b.enqueue(
        r.at("enqueue-timed", "each payload gets its first enqueue time"), "q", [b"a", b"b"]
    )
    await b.enqueue(
        r.at("enqueue-timed-again", "a payload queued twice keeps its first time"), "q", [b"a"]
    )
    await b.enqueue(
        r.at("enqueue-timed-priority", "a job with a priority too"), "q", [b"p"], priority=4
    )
    await b.enqueue_group(r.at("enqueue-group-timed", "a group's job too"), "q", "g", [b"g"])
    await b.delay(
        r.at("delay-timed", "a delayed job: the time of the call"), "q", [b"d"], in_ms=60_000
    )
    c = await b.claim(r, "w1", "i1", "q", 5, 1, ttl_ms=3000)
    ids = {p.task: p.id for p in c.processes}
    await b.finish(
        r.at("finish-timed", "finished jobs' times leave (one EXISTS, one ZREM)"),
        "w1", "i1", "q", [ids[b"a"], ids[b"g"]],
    )  # fmt: skip
    await b.give_back(
        r.at("give-back-timed-dead", "a job dead-lettered at its limit: its time leaves"),
        "w1", "q", [ids[b"b"]], failed=True,
    )  # fmt: skip
    await b.dead(
        r.at("dead-requeue-timed", "a requeued dead letter gets a new time"), "q", "requeue", None
    )
    await b.cancel(r.at("cancel-timed", "a cancelled job's time leaves"), "q", b"b")
    await b.delete_queue(r.at("delete-queue-timed", "the times go with the queue"), "q")
    await b.enqueue(r, "q", [b"e"])
    await b.configure(
        r.at("configure-enqueue-times-off", "enqueue_times off: the times kept go"),
        "q", "set", "configure", ["enqueue_times", 0],
    )  # fmt: skip


async def _unwrap(o: Any) -> Any:
    return o.unwrap()


STORIES: list[Callable[[Recorder, Binding, Connection], Awaitable[None]]] = [
    story_worker,
    story_persistent,
    story_reap,
    story_jobs,
    story_share,
    story_operator,
    story_finish_claim,
    story_groups,
    story_group_priorities,
    story_group_counts,
    story_blobs,
    story_enqueue_times,
]


async def record(url: str) -> dict[str, list[dict[str, Any]]]:
    async with open_connection(url) as conn:
        r = Recorder(conn)
        for story in STORIES:
            await v.clear(conn, GEN_NS)
            r.ms = START_S * 1000
            await story(r, Binding(Keys(GEN_NS)), conn)
            await v.clear(conn, GEN_NS)
        return r.vectors


async def check(url: str) -> int:
    async with open_connection(url) as conn:
        bad = await v.check_vectors(conn, v.load_vectors(OUT), "vcheck", print)
    for m in bad:
        print(f"{m.file} {m.vector}: {m.what}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="replay the vectors instead")
    args = ap.parse_args()
    with run_redis_server() as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        if args.check:
            return trio.run(check, url)
        vectors = trio.run(record, url)
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.json"):
        old.unlink()
    for script, vs in sorted(vectors.items()):
        doc = {"script": script, "vectors": vs}
        (OUT / f"{script}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    missing = sorted(set(load_scripts()) - set(vectors))
    print(
        f"wrote {sum(len(x) for x in vectors.values())} vectors for {len(vectors)} scripts to {OUT}"
    )
    if missing:
        print(f"no vector for: {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
