"""Model-based test of the protocol: hypothesis drives the real Lua scripts on a
real redis-server with random enqueue / delay / ensure / claim (rate-limited
or not) / finish (keeping results or not) / give back / cancel / expire /
recycle / leave / dead-letter requeue and purge / periodic tick steps, and
after every step checks:

1. one place: every task instance is in exactly one place (queue, delayed,
   one process of one worker, or dead letters), nothing lost, nothing made up;
2. atomic, run-twice-safe transitions: repeating a recycle, finish or cancel
   changes nothing;
5. per-worker ownership: each worker's held sets are exactly its processes,
   and recycling one worker leaves every other worker's processes alone;
8. finish is True exactly once, and False for a recycled, cancelled, given
   back or fenced process;
9. persistent state follows the task: a persistent task is in the standby set
   while queued or delayed and in the persistent hash (-> its process id)
   while running, never in both.

Rebalancing (protocol 4) adds steps: ``rebalance`` (a worker below its share
marks peers' processes to move to it), ``give_back`` of a marked process
(then reserved for its receiver, a place of its own: one place counts it),
and ``expire_reservations`` (the receiver died: the next claim puts them
back at the head); sticky restarts add ``leave_sticky`` (give_back mode
"keep", then leave) and ``rejoin`` (the same id registers again). Also
checked after each step: every mark names a live process of another worker,
and a reservation's task is taken only by its receiver until it runs out.

The steps run synchronously: the binding's coroutines are driven to
completion over redis-py's blocking client (a real connection to the real
server), which keeps hypothesis out of the trio event loop.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import redis
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mesh._binding import Binding
from mesh._errors import CommandError, FencedError
from mesh._keys import Keys
from mesh._replies import ResultsToKeep, parse_result
from mesh._schedule import next_tick
from mesh.testing import RedisServer

T = TypeVar("T")
# how often the rebalance steps did something, and claims took tasks with a priority
#: Examples of the derandomized run: as many as it takes for the fixed examples
#: to reach every step it asserts (60 stopped reaching a patient claim held
#: back once claim.lua took the pause key: the same seed, other paths).
EXAMPLES = 100
#: The seed of the derandomized run (see :func:`run_model`).
MODEL_SEED = 1
STEPS = {"marked": 0, "reserved": 0, "kept": 0, "prioritized": 0, "drained": 0, "patient": 0}
QUEUES = ("q1", "q2")
MAX_ATTEMPTS = 2


class SyncExecutor:
    def __init__(self, r: Any) -> None:
        self.r = r

    async def execute(self, *args: Any) -> Any:
        try:
            return self.r.execute_command(*args)
        except redis.exceptions.NoScriptError as exc:
            raise CommandError(str(exc), "NOSCRIPT") from exc
        except redis.ResponseError as exc:
            msg = str(exc)
            raise CommandError(msg, msg.split(" ", 1)[0]) from exc


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    raise AssertionError("the binding suspended: it must not, over a blocking executor")


class MeshModel(RuleBasedStateMachine):
    server: RedisServer
    counter = 0

    @initialize()
    def setup(self) -> None:
        MeshModel.counter += 1
        self.keys = Keys(f"model{MeshModel.counter}")
        # Any: redis-py types replies as bytes | str (it cannot know that
        # decode_responses is off); they are bytes here
        self.r: Any = redis.Redis(port=self.server.port)
        self.x = SyncExecutor(self.r)
        self.b = Binding(self.keys)
        self.n = 0
        # model
        self.workers: dict[str, str] = {}  # live worker -> incarnation
        self.dead: set[str] = set()  # lease expired, not yet recycled
        self.gone: set[str] = set()  # recycled or left
        self.procs: dict[str, tuple[str, str, bytes]] = {}  # pid -> (worker, queue, payload)
        self.old_pids: list[tuple[str, str, str]] = []  # (worker, queue, pid) no longer valid
        self.live: dict[str, set[bytes]] = {q: set() for q in QUEUES}  # payloads in the mesh
        self.persistent: dict[str, set[bytes]] = {q: set() for q in QUEUES}
        # weights and capacities other than 1 (the fair share is by weight
        # against capacity): (queue, payload) -> weight, (worker, queue) -> capacity
        self.weight: dict[tuple[str, bytes], int] = {}
        self.capacity: dict[tuple[str, str], int] = {}
        # (queue, payload) -> the worker a rebalance meant it for (while marked or reserved)
        self.reserved_for: dict[tuple[str, bytes], str] = {}
        self.sticky: set[str] = set()  # left with a sticky restart, may rejoin
        self.drained: set[tuple[str, str]] = set()  # (worker, queue) drained: stopping
        self.priority: dict[bytes, int] = {}  # payload -> its priority, if not 0
        for _ in range(2):
            self.add_worker()
        # start uneven, so that every example has something to rebalance:
        # w0 runs six persistent tasks of q1, w1 none
        self.ensure_several("q1", 6)
        reply = run(self.b.claim(self.x, "w0", self.workers["w0"], "q1", 6, MAX_ATTEMPTS))
        for p in reply.processes:
            self.procs[p.id] = ("w0", "q1", p.task)

    def teardown(self) -> None:
        self.r.close()

    def fresh(self) -> bytes:
        self.n += 1
        return b"t%d" % self.n

    # --- steps ---------------------------------------------------------------

    @precondition(lambda self: len(self.workers) < 4)
    @rule()
    def add_worker(self) -> None:
        w = f"w{len(self.workers) + len(self.dead) + len(self.gone)}"
        inc = "i-" + w
        run(self.b.register(self.x, w, inc, 600_000, b"{}"))
        self.serve_all(w, inc)
        self.workers[w] = inc

    def serve_all(self, w: str, inc: str) -> None:
        """Serve every queue; every third worker with capacity 2 on q1."""
        for q in QUEUES:
            cap = 2 if q == "q1" and int(w[1:]) % 3 == 2 else 1
            run(self.b.serve(self.x, w, inc, q, cap))
            self.capacity[(w, q)] = cap
            self.drained.discard((w, q))

    @rule(q=st.sampled_from(QUEUES), n=st.integers(1, 3))
    def enqueue(self, q: str, n: int) -> None:
        ps = [self.fresh() for _ in range(n)]
        run(self.b.enqueue(self.x, q, ps))
        self.live[q].update(ps)

    @rule(q=st.sampled_from(QUEUES), data=st.data())
    def ensure(self, q: str, data: st.DataObject) -> None:
        existing = sorted(self.persistent[q])
        again = data.draw(st.booleans())
        p = data.draw(st.sampled_from(existing)) if existing and again else self.fresh()
        weight = 1 + self.n % 3  # ensuring again sets the weight (it may change)
        (added,) = run(self.b.ensure(self.x, q, [p], weight))
        assert added == (p not in self.persistent[q])
        self.persistent[q].add(p)
        self.live[q].add(p)
        self.weight[(q, p)] = weight

    @rule(q=st.sampled_from(QUEUES), n=st.integers(3, 8))
    def ensure_several(self, q: str, n: int) -> None:
        ps = [self.fresh() for _ in range(n)]
        weight = {3: 2, 5: 3}.get(n, 1)
        assert run(self.b.ensure(self.x, q, ps, weight)) == [True] * n
        self.weight.update({(q, p): weight for p in ps})
        self.persistent[q].update(ps)
        self.live[q].update(ps)

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), q=st.sampled_from(QUEUES), n=st.integers(1, 4))
    def claim(self, data: st.DataObject, q: str, n: int, rated: bool = False) -> None:
        w = data.draw(st.sampled_from(sorted(self.workers)))
        self.make_due(q)
        self.was_reserved = {
            (q, p): w2.split(b":")[0].decode() != w
            for p, w2 in self.r.hgetall(self.keys.reserved(q)).items()
            if int(w2.rsplit(b":", 1)[1]) > 1
        }
        # a rate-limited queue (a token bucket in Redis) now and then
        rate = data.draw(st.sampled_from([None, (1, 60_000), (3, 1)])) if rated else None
        # now and then a fair claim, or one with a patience (2 ms: nearly every
        # waiting task qualifies; a minute: none does)
        fair, patience = data.draw(
            st.sampled_from([(False, 0), (True, 0), (True, 2), (True, 60_000)])
        )
        if (w, q) in self.drained:  # a stopping worker claims nothing more
            with pytest.raises(CommandError, match="NOT_SERVING"):
                run(self.b.claim(self.x, w, self.workers[w], q, n, MAX_ATTEMPTS, rate=rate))
            return
        reply = run(
            self.b.claim(
                self.x, w, self.workers[w], q, n, MAX_ATTEMPTS,
                rate=rate, fair=fair, patience_ms=patience,
            )
        )  # fmt: skip
        STEPS["patient"] += patience > 0 and reply.held_back
        if rate is not None:
            assert len(reply.processes) <= rate[0]
        # the highest priority first: nothing left queued above a level taken,
        # and a one-shot task of priority 0 only once none with one is left
        left = [-int(s) for _, s in self.r.zrange(self.keys.prio(q), 0, -1, withscores=True)]
        for p in reply.processes:
            if not p.persistent:
                assert all(lv <= self.priority.get(p.task, 0) for lv in left), (p.task, left)
                STEPS["prioritized"] += p.task in self.priority
        for p in reply.processes:
            assert p.id not in self.procs
            assert p.task in self.live[q]
            meant = self.reserved_for.get((q, p.task))
            reserved = self.r.hexists(self.keys.reserved(q), p.task)
            assert not reserved, "a reserved task was claimed and is still reserved"
            if meant is not None:
                if meant != w:
                    # only after its reservation ran out, or before it was handed back
                    assert not self.was_reserved.get((q, p.task)), (p.task, meant, w)
                self.reserved_for.pop((q, p.task), None)
            self.was_reserved.pop((q, p.task), None)
            assert p.persistent == (p.task in self.persistent[q])
            self.procs[p.id] = (w, q, p.task)

    def pick_pid(self, data: st.DataObject) -> tuple[str, str, str]:
        current = [(w, q, pid) for pid, (w, q, _) in self.procs.items()]
        pool = current + self.old_pids
        return data.draw(st.sampled_from(sorted(pool)))

    @precondition(lambda self: self.procs or self.old_pids)
    @rule(data=st.data(), keep=st.booleans())
    def finish(self, data: st.DataObject, keep: bool) -> None:
        w, q, pid = self.pick_pid(data)
        inc = self.workers.get(w, "i-" + w)
        expected = pid in self.procs and w in self.workers
        # with keep: finish_results.lua (a queue with a result TTL)
        known = self.procs.get(pid, (w, q, b"gone"))[2]
        results = ResultsToKeep(60_000, {pid: (known, b"r" + known)}) if keep else None
        (ok,) = run(self.b.finish(self.x, w, inc, q, [pid], results))
        assert ok == expected, (w, pid)
        if keep:
            rec = self.r.get(self.keys.result(q, known))
            assert (rec is not None and parse_result(rec, known) is not None) == (
                ok or rec is not None
            )
            if ok:
                assert parse_result(rec, known)[1] == b"r" + known  # type: ignore[index]
        if ok:
            _, _, payload = self.procs.pop(pid)
            self.old_pids.append((w, q, pid))
            self.live[q].discard(payload)
            self.persistent[q].discard(payload)
            self.weight.pop((q, payload), None)
            # run twice: no change
            assert run(self.b.finish(self.x, w, inc, q, [pid], results)) == [False]

    @precondition(lambda self: self.procs or self.old_pids)
    @rule(data=st.data(), failed=st.booleans())
    def give_back(self, data: st.DataObject, failed: bool) -> None:
        w, q, pid = self.pick_pid(data)
        [(outcome, _)] = run(
            self.b.give_back(
                self.x, w, q, [pid], failed=failed, backoff_ms=1000, backoff_cap_ms=1000
            )
        )
        assert (outcome != 0) == (pid in self.procs)
        if outcome:
            if self.r.hexists(self.keys.reserved(q), self.procs[pid][2]):
                STEPS["reserved"] += 1
            self.procs.pop(pid)
            self.old_pids.append((w, q, pid))

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), q=st.sampled_from(QUEUES), limit=st.integers(1, 4))
    def rebalance(self, data: st.DataObject, q: str, limit: int) -> None:
        # uneven first: one worker claims a batch (no fair share)
        self.claim(data, q, 8)
        # mostly the worker holding the least: the one a rebalance is for
        least = min(sorted(self.workers), key=lambda o: self.r.scard(self.keys.held(o, q)))
        w = data.draw(st.sampled_from([least, *sorted(self.workers)]))
        before = {pid for pid, _ in self.moving(q).items()}
        if (w, q) in self.drained:
            with pytest.raises(CommandError, match="NOT_SERVING"):
                run(self.b.rebalance(self.x, w, self.workers[w], q, limit, 600_000))
            return
        reply, _ = run(self.b.rebalance(self.x, w, self.workers[w], q, limit, 600_000))
        after = self.moving(q)
        new = set(after) - before
        assert len(new) == reply.marked <= limit
        for pid in new:
            # a live persistent process of another worker, marked for w;
            # never one of a worker that drains the queue (it hands them back
            # as it stops)
            assert after[pid] == w and pid in self.procs and self.procs[pid][0] != w
            assert (self.procs[pid][0], q) not in self.drained
            assert self.procs[pid][2] in self.persistent[q]
        self.reserved_for.update({(q, self.procs[pid][2]): w for pid in new})
        STEPS["marked"] += len(new)
        # the holders' handlers exit, at least one of them at once
        if new:
            for pid in sorted(new)[: data.draw(st.integers(1, len(new)))]:
                self.hand_back(q, pid, after[pid])

    @precondition(lambda self: any(self.r.exists(self.keys.moving(q)) for q in QUEUES))
    @rule(data=st.data())
    def hand_back_marked(self, data: st.DataObject) -> None:
        """The holder of a marked process hands it back (its handler exited):
        it is reserved for the receiver, not queued."""
        marked = [(q, pid, to) for q in QUEUES for pid, to in self.moving(q).items()]
        q, pid, to = data.draw(st.sampled_from(sorted(marked)))
        self.hand_back(q, pid, to)

    def hand_back(self, q: str, pid: str, to: str) -> None:
        if pid not in self.procs:
            return  # a stale mark: the process is gone
        w, _, payload = self.procs[pid]
        [(outcome, _)] = run(self.b.give_back(self.x, w, q, [pid], failed=False))
        assert outcome == 1
        assert self.r.hget(self.keys.reserved(q), payload).split(b":")[0] == to.encode()
        assert payload not in self.r.lrange(self.keys.queue(q), 0, -1)
        STEPS["reserved"] += 1
        self.procs.pop(pid)
        self.old_pids.append((w, q, pid))

    @precondition(lambda self: any(self.r.exists(self.keys.reserved(q)) for q in QUEUES))
    @rule()
    def expire_reservations(self) -> None:
        for q in QUEUES:
            for p, v in self.r.hgetall(self.keys.reserved(q)).items():
                self.r.hset(self.keys.reserved(q), p, v.split(b":")[0] + b":1")
                self.reserved_for.pop((q, p), None)

    def moving(self, q: str) -> dict[str, str]:
        return {
            pid.decode(): v.decode().rsplit(":", 1)[0]
            for pid, v in self.r.hgetall(self.keys.moving(q)).items()
        }

    @rule(q=st.sampled_from(QUEUES), data=st.data())
    def cancel(self, q: str, data: st.DataObject) -> None:
        pool = sorted(self.live[q]) or [b"nothing"]
        p = data.draw(st.sampled_from(pool))
        running = [pid for pid, (_, pq, pp) in self.procs.items() if pq == q and pp == p]
        _, cancelled = run(self.b.cancel(self.x, q, p))
        assert cancelled == len(running)
        for pid in running:
            w, _, _ = self.procs.pop(pid)
            self.old_pids.append((w, q, pid))
        self.live[q].discard(p)
        self.persistent[q].discard(p)
        self.weight.pop((q, p), None)
        assert run(self.b.cancel(self.x, q, p)) == (0, 0)

    @precondition(lambda self: self.workers)
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(sorted(self.workers)))
        self.r.delete(self.keys.heartbeat(w))
        self.r.zadd(self.keys.workers, {w: 0})
        del self.workers[w]
        self.dead.add(w)
        # a fenced worker can neither claim nor finish
        for q in QUEUES:
            with pytest.raises(FencedError):
                run(self.b.claim(self.x, w, "i-" + w, q, 1, MAX_ATTEMPTS))

    @precondition(lambda self: self.dead or self.workers)
    @rule(data=st.data())
    def recycle(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(sorted(self.dead | set(self.workers))))
        before = self.others_held(w)
        r = run(self.b.recycle(self.x, w, leave=False))
        assert r.alive == (w in self.workers)
        if not r.alive:
            self.drop_worker(w, count_attempts=True)
            assert run(self.b.recycle(self.x, w, leave=False)).returned == 0  # twice
        assert self.others_held(w) == before  # per-worker ownership

    @precondition(lambda self: len(self.dead) + len(self.workers) >= 2)
    @rule(data=st.data())
    def recycle_several(self, data: st.DataObject) -> None:
        """Several workers die at once and one call recycles them (and leaves
        a live one it was given alone)."""
        while len(self.dead) < 2:
            self.expire(data)
        pool = sorted(self.dead)
        ws = data.draw(st.lists(st.sampled_from(pool), min_size=2, max_size=4, unique=True))
        with_a_live_one = data.draw(st.booleans())
        if self.workers and with_a_live_one:
            ws.append(data.draw(st.sampled_from(sorted(self.workers))))
        dead = [w for w in ws if w not in self.workers]
        kept = sorted((set(self.workers) | self.dead) - set(dead))
        before = {(o, q): self.r.smembers(self.keys.held(o, q)) for o in kept for q in QUEUES}
        # no queue hint for one call in two: the script names the missing ones
        hint = data.draw(st.sampled_from([[], list(QUEUES)]))
        r = run(self.b.recycle_dead(self.x, ws, queues=hint))
        assert sorted(r.alive) == sorted(w for w in ws if w in self.workers)
        assert r.recycled == len(dead)  # each was still registered
        for w in dead:
            self.drop_worker(w, count_attempts=True)
        again = run(self.b.recycle_dead(self.x, ws, queues=QUEUES))
        assert (again.recycled, again.returned) == (0, 0)  # twice
        # per-worker ownership: nobody else's processes moved
        after = {(o, q): self.r.smembers(self.keys.held(o, q)) for o in kept for q in QUEUES}
        assert after == before

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), q=st.sampled_from(QUEUES))
    def drain(self, data: st.DataObject, q: str) -> None:
        """A worker begins a graceful stop of a queue: it leaves the servers
        (and the fair share's capacity) and keeps its processes; it hands them
        back later, or leaves, or dies, through the other rules."""
        w = data.draw(st.sampled_from(sorted(self.workers)))
        before = self.others_held(w)
        served = run(self.b.drain(self.x, w, self.workers[w], q))
        assert served == ((w, q) not in self.drained)
        self.drained.add((w, q))
        assert self.r.sismember(self.keys.servers(q), w) == 0
        assert self.r.sismember(self.keys.idle(q), w) == 0
        assert self.others_held(w) == before
        held = {x.decode() for x in self.r.smembers(self.keys.held(w, q))}
        assert held == {pid for pid, (pw, pq, _) in self.procs.items() if pw == w and pq == q}
        STEPS["drained"] += bool(held)  # drained while it held processes

    @precondition(lambda self: self.workers)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(sorted(self.workers)))
        self.leave_as(w)

    @precondition(lambda self: self.workers)
    @rule(data=st.data())
    def leave_sticky(self, data: st.DataObject) -> None:
        """A sticky restart: a worker keeps its persistent tasks reserved for
        its id (give_back mode "keep"), then leaves; one-shot tasks go back."""
        w = data.draw(st.sampled_from(sorted(self.workers)))
        for q in QUEUES:
            mine = sorted(pid for pid, (pw, pq, _) in self.procs.items() if pw == w and pq == q)
            if not mine:
                continue
            marked = self.moving(q)  # a move a rebalance asked for goes on
            outcomes = run(self.b.give_back(self.x, w, q, mine, failed=False, keep_ms=600_000))
            assert [o for o, _ in outcomes] == [1] * len(mine)
            for pid in mine:
                _, _, payload = self.procs.pop(pid)
                self.old_pids.append((w, q, pid))
                kept = self.r.hget(self.keys.reserved(q), payload)
                if payload in self.persistent[q]:
                    assert kept is not None
                    assert kept.split(b":")[0] == marked.get(pid, w).encode()
                    STEPS["kept"] += 1
                else:
                    assert kept is None
        self.leave_as(w)
        self.sticky.add(w)

    @precondition(lambda self: self.sticky)
    @rule(data=st.data())
    def rejoin(self, data: st.DataObject) -> None:
        """The sticky worker comes back under its id: its next claims take
        what was kept for it first."""
        w = data.draw(st.sampled_from(sorted(self.sticky)))
        self.sticky.discard(w)
        self.gone.discard(w)
        inc = "i2-" + w
        run(self.b.register(self.x, w, inc, 600_000, b"{}"))
        self.serve_all(w, inc)
        self.workers[w] = inc

    def leave_as(self, w: str) -> None:
        before = self.others_held(w)
        run(self.b.recycle(self.x, w, leave=True, incarnation=self.workers.pop(w)))
        self.drop_worker(w, count_attempts=False)
        assert self.others_held(w) == before

    def job_queue_step(self, q: str, data: st.DataObject) -> None:
        """One of the job-queue scripts: delay tasks, requeue or purge dead
        letters, or fire a periodic task's tick (one rule for the three, so
        that they do not crowd out the other steps)."""
        step = data.draw(st.sampled_from(["delay", "dead_letters", "schedule_tick"]))
        if step == "delay":
            self.delay(q, data.draw(st.integers(1, 3)), data.draw(st.sampled_from([0, 1, 60_000])))
        elif step == "dead_letters":
            self.dead_letters(q, data, data.draw(st.booleans()))
        else:
            self.schedule_tick(q, data.draw(st.integers(1, 3)), data.draw(st.integers(0, 4)))

    def delay(self, q: str, n: int, ms: int) -> None:
        ps = [self.fresh() for _ in range(n)]
        r = run(self.b.delay(self.x, q, ps, in_ms=ms))
        assert r.added == n and r.due_ms == r.now_ms + ms
        self.live[q].update(ps)
        assert set(ps) <= set(self.r.zrange(self.keys.delayed(q), 0, -1))

    def dead_letters(self, q: str, data: st.DataObject, requeue: bool) -> None:
        """Requeue or purge all dead letters of a queue, or some of them."""
        dead = self.dead_payloads(q)
        # each dead letter's priority, from its record's kind ('o' level:
        # protocol 10 keeps it, and a requeue puts the task back at it)
        levels = {
            rec.split(b"\0", 5)[5]: int(rec.split(b"\0", 5)[4][1:] or b"0")
            for rec in self.r.lrange(self.keys.dead(q), 0, -1)
        }
        some: bool = bool(dead) and data.draw(st.booleans())
        chosen = data.draw(st.lists(st.sampled_from(dead), unique=True)) if some else None
        mode = "requeue" if requeue else "purge"
        done, refused = run(self.b.dead(self.x, q, mode, chosen))
        assert refused == 0  # a dead-lettered one-shot payload is never made persistent here
        assert done == (len(dead) if chosen is None else len(chosen))
        left = [p for p in dead if chosen is not None and p not in chosen]
        assert self.dead_payloads(q) == left
        if requeue:
            self.live[q].update(set(dead) - set(left))
            for p in set(dead) - set(left):
                if levels.get(p):  # requeued at its priority (the record's kind)
                    self.priority[p] = levels[p]
                else:
                    self.priority.pop(p, None)
            back = sorted(set(dead) - set(left))
            if back:  # attempts reset
                assert self.r.hmget(self.keys.attempts(q), back) == [None] * len(back)
        assert run(self.b.dead(self.x, q, mode, chosen)) == (0, 0)  # twice

    def schedule_tick(self, q: str, peers: int, missed: int) -> None:
        """A periodic task comes due (after ``missed`` ticks nobody fired);
        ``peers`` schedulers try to fire it: one copy is enqueued."""
        p = self.fresh()
        run(self.b.schedule(self.x, q, p, "every 1000", None))
        sid = q.encode() + b"\0" + p
        now = int(self.r.time()[0]) * 1000
        tick = now - 1 - 1000 * missed
        self.r.zadd(self.keys.schedules, {sid: tick})
        nxt = next_tick(b"every 1000", tick, now)
        fired = [run(self.b.fire(self.x, [(sid, tick, nxt)])) for _ in range(peers)]
        assert fired == [[1]] + [[0]] * (peers - 1)  # one copy, however many peers
        assert self.r.zscore(self.keys.schedules, sid) == nxt > now  # once, not per missed tick
        self.live[q].add(p)
        assert run(self.b.unschedule(self.x, q, p)) is True

    # --- model helpers -----------------------------------------------------------

    def dead_payloads(self, q: str) -> list[bytes]:
        return [rec.split(b"\0", 5)[5] for rec in self.r.lrange(self.keys.dead(q), 0, -1)]

    def make_due(self, q: str) -> None:
        for p in self.r.zrange(self.keys.delayed(q), 0, -1):
            self.r.zadd(self.keys.delayed(q), {p: 0})

    def drop_worker(self, w: str, *, count_attempts: bool) -> None:
        self.dead.discard(w)
        self.drained -= {(w, q) for q in QUEUES}
        self.gone.add(w)
        for pid, (pw, q, _) in list(self.procs.items()):
            if pw == w:
                del self.procs[pid]
                self.old_pids.append((w, q, pid))

    def others_held(self, w: str) -> dict[tuple[str, str], set[bytes]]:
        return {
            (o, q): self.r.smembers(self.keys.held(o, q))
            for o in sorted(set(self.workers) | self.dead)
            if o != w
            for q in QUEUES
        }

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def marks_name_live_processes_of_others(self) -> None:
        if not hasattr(self, "keys"):
            return
        for q in QUEUES:
            for pid, to in self.moving(q).items():
                if pid in self.procs:  # a stale mark (process gone) is dropped lazily
                    assert self.procs[pid][0] != to
                    assert self.procs[pid][2] in self.persistent[q]
            # a reserved task is a queued persistent task of the mesh (a
            # cancel removes its reservation)
            for p in self.r.hkeys(self.keys.reserved(q)):
                assert p in self.persistent[q]

    @invariant()
    def weights_and_capacities_add_up(self) -> None:
        """The share hash holds each persistent task's weight, each server's
        capacity, each worker's extra held weight and their sums: exactly
        what they are (the fair share reads only these)."""
        if not hasattr(self, "keys"):
            return
        for q in QUEUES:
            pers = self.persistent[q]
            weight = {p: self.weight.get((q, p), 1) for p in pers}
            servers = sorted(set(self.workers) | self.dead)
            want: dict[bytes, bytes] = {}
            for p, x in weight.items():
                if x != 1:
                    want[b"w" + p] = str(x).encode()
            total = sum(weight.values())
            if total:
                want[b":weight"] = str(total).encode()
            heavy = sum(x != 1 for x in weight.values())
            if heavy:
                want[b":heavy"] = str(heavy).encode()
            servers = [w for w in servers if (w, q) not in self.drained]
            caps = sum(self.capacity[(w, q)] for w in servers)
            if caps:
                want[b":capacity"] = str(caps).encode()
            for w in servers:
                if self.capacity[(w, q)] != 1:
                    want[b"c" + w.encode()] = str(self.capacity[(w, q)]).encode()
            held: dict[str, int] = {}
            for w, pq, p in self.procs.values():
                if pq == q and p in pers:
                    held[w] = held.get(w, 0) + weight[p] - 1
            for w, x in held.items():
                if x:
                    want[b"h" + w.encode()] = str(x).encode()
            got = self.r.hgetall(self.keys.share(q))
            got.pop(b":gen", None)  # a generation: it only moves on
            assert got == want, q

    @invariant()
    def one_place(self) -> None:
        if not hasattr(self, "keys"):
            return
        k = self.keys
        for q in QUEUES:
            places: list[bytes] = []
            places += self.r.lrange(k.queue(q), 0, -1)
            # tasks with a priority: in their level's place
            for m, s in self.r.zrange(k.prio(q), 0, -1, withscores=True):
                assert int(m[:1]) == -s == self.priority.get(m[16:]), (m, s)
                places.append(m[16:])
            delayed_now = set(self.r.zrange(k.delayed(q), 0, -1))
            for p, lv in self.r.hgetall(k.delayed_prio(q)).items():
                assert p in delayed_now and int(lv) == self.priority.get(p), (p, lv)
            for p in delayed_now:
                if self.priority.get(p):
                    assert self.r.hget(k.delayed_prio(q), p) is not None, p
            places += self.r.zrange(k.delayed(q), 0, -1)
            places += self.r.hkeys(k.reserved(q))  # handed back for balance, for one peer
            waiting = set(places)  # queued or delayed
            dead = self.dead_payloads(q)
            places += dead
            procs = self.r.hgetall(k.procs(q))
            places += [rec.split(b"\0", 8)[8] for rec in procs.values()]
            for rec in procs.values():  # a process keeps its task's priority
                _, kind, *_, payload = rec.split(b"\0", 8)
                want = self.priority.get(payload, 0)
                assert kind == (b"o%d" % want if want else kind[:1]), (kind, payload)
            assert len(places) == len(set(places)), f"a task in two places in {q}: {places}"
            # dead letters leave the live set as the model learns of them
            self.live[q] -= set(dead) - set(self.persistent[q])
            assert set(places) - set(dead) == self.live[q], f"lost or made up in {q}"
            # processes are exactly the model's, with the right owner
            assert {
                pid.decode(): rec.split(b"\0", 1)[0].decode() for pid, rec in procs.items()
            } == {pid: w for pid, (w, pq, _) in self.procs.items() if pq == q}
            # held sets per worker are exactly its processes
            for w in sorted(set(self.workers) | self.dead | self.gone):
                held = {x.decode() for x in self.r.smembers(k.held(w, q))}
                assert held == {
                    pid for pid, (pw, pq, _) in self.procs.items() if pw == w and pq == q
                }
            # persistent tasks: registered exactly while alive; while queued or
            # delayed in the standby set or the persistent hash with the value
            # "", while running in the hash (-> the pid of its process); never
            # in the set and the hash
            in_set = self.r.smembers(k.standby(q))
            marks = self.r.hgetall(k.persistent(q))
            assert not in_set & set(marks), f"in the standby set and the hash in {q}"
            standby = in_set | {p for p, v in marks.items() if v == b""}
            running = {p: v for p, v in marks.items() if v != b""}
            assert standby | set(running) == self.persistent[q]
            assert standby == waiting & self.persistent[q], f"standby is not what waits in {q}"
            # since when each waiting persistent task has had no owner: exactly
            # those, at a time no later than now
            since = dict(self.r.zrange(k.unowned(q), 0, -1, withscores=True))
            assert set(since) == standby, f"unowned is not what waits in {q}"
            now = self.r.time()
            assert all(t <= now[0] * 1000 + now[1] // 1000 for t in since.values())
            assert running == {
                pp: pid.encode()
                for pid, (_, pq, pp) in self.procs.items()
                if pq == q and pp in self.persistent[q]
            }


class JobsModel(MeshModel):
    """The same machine with the job-queue steps as rules of their own (kept
    out of MeshModel so that they do not thin out its rebalance steps):
    delayed tasks, dead-letter requeue and purge, periodic ticks, and claims
    of a rate-limited queue, checked by the same invariants."""

    @rule(q=st.sampled_from(QUEUES), data=st.data())
    def jobs(self, q: str, data: st.DataObject) -> None:
        self.job_queue_step(q, data)

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), q=st.sampled_from(QUEUES), n=st.integers(1, 4))
    def rated_claim(self, data: st.DataObject, q: str, n: int) -> None:
        self.claim(data, q, n, rated=True)

    @rule(
        q=st.sampled_from(QUEUES),
        n=st.integers(1, 3),
        level=st.integers(0, 9),
        ms=st.sampled_from([None, 0, 60_000]),
    )
    def prioritized(self, q: str, n: int, level: int, ms: int | None) -> None:
        """Enqueue (or delay by ``ms``) tasks with a priority."""
        ps = [self.fresh() for _ in range(n)]
        if ms is None:
            run(self.b.enqueue(self.x, q, ps, level))
        else:
            run(self.b.delay(self.x, q, ps, in_ms=ms, priority=level))
        if level:
            self.priority.update(dict.fromkeys(ps, level))
        self.live[q].update(ps)


def run_model(server: RedisServer, *, derandomize: bool, examples: int = 60) -> dict[str, int]:
    """Run the state machine; returns how often the rebalancing and sticky
    steps did something. Derandomized, it runs from :data:`MODEL_SEED`
    (Hypothesis's own derandomized seed hashes the class's source, so any
    edit of the model would pick other examples)."""
    for k in STEPS:
        STEPS[k] = 0
    MeshModel.server = server
    if derandomize:
        seed(MODEL_SEED)(MeshModel)
    MeshModel.TestCase.settings = settings(
        max_examples=examples,
        derandomize=False,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    try:
        MeshModel.TestCase().runTest()
    finally:
        seed(None)(MeshModel)  # (JobsModel inherits it)
    return dict(STEPS)


@pytest.mark.slow
def test_protocol_model(redis_server: RedisServer) -> None:
    """New random examples every run: the invariants after every step."""
    run_model(redis_server, derandomize=False)


@pytest.mark.slow
def test_protocol_model_exercises_rebalancing_and_sticky_restarts(
    redis_server: RedisServer,
) -> None:
    """The same examples every run (so this cannot depend on luck): the
    rebalancing and sticky steps did mark, reserve and keep tasks, workers
    drained queues while holding processes, and claims with a patience were
    held back by the fair share, with the invariants checked after each."""
    steps = run_model(redis_server, derandomize=True, examples=EXAMPLES)
    assert steps["marked"] > 0 and steps["reserved"] > 0 and steps["kept"] > 0, steps
    assert steps["drained"] > 0 and steps["patient"] > 0, steps


@pytest.mark.slow
@pytest.mark.parametrize("derandomize", [False, True], ids=["random", "fixed"])
def test_job_queue_model(redis_server: RedisServer, derandomize: bool) -> None:
    """The job-queue steps (JobsModel): the invariants after every step, on
    new random examples every run and on fixed ones. Only the fixed run
    asserts that prioritized tasks were claimed: a random run missed them
    now and then (seen on the 6.2 run of test_compat)."""
    JobsModel.server = redis_server
    JobsModel.TestCase.settings = settings(
        max_examples=40,
        derandomize=derandomize,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    STEPS["prioritized"] = 0
    JobsModel.TestCase().runTest()
    if derandomize:
        assert STEPS["prioritized"] > 0, STEPS
