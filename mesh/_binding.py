"""The protocol binding: one typed Python call per Lua script in ``protocol/``.

It knows keys, scripts and reply shapes, and nothing about trio tasks: every
call takes the connection to run on, and runs through :mod:`mesh._eval`;
the replies are :mod:`mesh._replies`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import outcome

from ._blob import BLOB_MIN, check_payload, standin
from ._errors import CommandError, MeshConnectionError, ProtocolError
from ._eval import Executor, PipelineExecutor, ScriptCall, map_error, run_pipelined, run_script
from ._keys import PROTOCOL_VERSION, Keys
from ._replies import (
    DEAD_ERROR_MAX,
    ClaimReply,
    CrashDeadLetter,
    DelayReply,
    HeartbeatReply,
    HeartbeatRequest,
    ReapCheck,
    RebalanceReply,
    RecycleManyReply,
    RecycleReply,
    ResultsToKeep,
    parse_claim,
    parse_claim_compact,
    parse_finish,
    parse_heartbeats,
)
from ._scripts import load_scripts
from ._transport import Packed

__all__ = ["Binding", "payload_bytes"]

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")


class ClaimOptions(TypedDict, total=False):
    """The keyword options of :meth:`Binding.claim_call` (and so of
    :meth:`Binding.claim`), with its defaults."""

    fair: bool
    backoff_ms: int
    backoff_cap_ms: int
    ttl_ms: int
    wake: bool
    rate: tuple[int, int] | None
    patience_ms: int


# How many argument sets Binding.claim_call and finish_call keep built.
_CLAIM_MEMO = 64


def payload_bytes(task: object, limit: int | None = None, *, named: bool = False) -> bytes:
    """A task payload as bytes: ``str`` is encoded as UTF-8, bytes-likes are copied.

    Raises:
        TypeError: neither str nor bytes-like.
        ValueError: longer than ``limit`` bytes, or starting with the mark of
            a payload stored out of line (:data:`~mesh._blob.BLOB_MARK`),
            unless ``named`` (a call that names a task, not one that adds it:
            then a stand-in a read gave passes, see
            :func:`mesh._blob.stored`).
    """
    if isinstance(task, bytes):
        b = task
    elif isinstance(task, str):
        b = task.encode()
    elif isinstance(task, bytearray | memoryview):
        b = bytes(task)
    else:
        raise TypeError(f"a task payload must be bytes or str, not {type(task).__name__}")
    if limit is not None and len(b) > limit:
        raise ValueError(f"task payload is {len(b)} bytes; the limit (max_payload) is {limit}")
    return b if named else check_payload(b)


class _Calls:
    """What every group of calls shares: the namespace's keys, the loaded
    scripts, the memos of the calls built once, and sending a call."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.scripts = load_scripts()
        # (worker, queue) -> (generation, T, C, capacity, extra held weight):
        # the balance a heartbeat last read with nothing moving or reserved
        self._balance: dict[tuple[str, str], tuple[str, int, int, int, int]] = {}
        # claim_call's arguments -> the call, built and packed once
        self._claims: dict[tuple[Any, ...], ScriptCall[ClaimReply]] = {}
        # (worker, incarnation, queue) -> finish.lua's keys and first arguments
        self._finishes: dict[tuple[str, str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # id(claim call) -> (the call, finish_claim.lua's command without the ids)
        self._finish_claims: dict[int, tuple[ScriptCall[ClaimReply], Packed]] = {}

    async def run(self, conn: Executor, call: ScriptCall[T]) -> T:
        """Send one built call (:meth:`claim_call`, :meth:`finish_call`) and
        parse its reply; raises what :func:`run_script` raises."""
        return call.parse(await run_script(conn, call.script, call.keys, call.args))

    async def _run(
        self, conn: Executor, name: str, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        return await run_script(conn, self.scripts[name], keys, args)


class _PeerCalls(_Calls):
    """A worker's calls but the claim and finish: its lease, serving and
    draining a queue, handing processes back, and the peers' recovery
    (recycling a dead worker, rebalancing, finding expired leases)."""

    async def register(
        self, conn: Executor, worker: str, incarnation: str, ttl_ms: int, info: bytes
    ) -> int:
        k = self.keys
        keys = [k.heartbeat(worker), k.workers, k.info, k.version]
        return int(
            await self._run(
                conn, "register", keys, [worker, incarnation, ttl_ms, info, PROTOCOL_VERSION]
            )
        )

    async def serve(
        self, conn: Executor, worker: str, incarnation: str, queue: str, capacity: int = 1
    ) -> None:
        """Serve ``queue`` with ``capacity`` (its part of the fair share; see
        ``serve.lua``); serving again changes the capacity."""
        k = self.keys
        await self._run(
            conn,
            "serve",
            [k.heartbeat(worker), k.serves(worker), k.queues, k.servers(queue), k.share(queue)],
            [worker, incarnation, queue, capacity],
        )

    async def heartbeat(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        ttl_ms: int,
        acks: Sequence[str],
        queues: Sequence[str],
    ) -> HeartbeatReply:
        """Renew one worker's lease (``heartbeat.lua`` with one worker).

        Raises:
            FencedError: its lease is gone or superseded (nothing written).
        """
        (one,) = await self.heartbeat_many(
            conn, ttl_ms, [HeartbeatRequest(worker, incarnation, tuple(acks), tuple(queues))]
        )
        return one.unwrap()

    async def heartbeat_many(
        self, conn: Executor, ttl_ms: int, requests: Sequence[HeartbeatRequest]
    ) -> list[outcome.Outcome[HeartbeatReply]]:
        """Renew the leases of several workers in one ``heartbeat.lua`` call
        (1 to 1,000 of them): each is fenced on its own.

        Returns:
            Per request, in order: ``outcome.Value`` of its reply, or
            ``outcome.Error(FencedError)`` for a worker whose lease is gone
            or superseded (nothing of it written; the others are renewed).
        Raises:
            MeshConnectionError, CommandError: for the whole call (then it is
                unknown which leases were renewed; renewing again is safe).
        """
        k = self.keys
        index: dict[str, int] = {}
        for r in requests:
            for q in r.queues:
                index.setdefault(q, len(index) + 1)
        keys = [k.workers]
        for q in index:
            keys += (k.queue(q), k.delayed(q), k.idle(q), k.moving(q))
            keys += (k.reserved(q), k.share(q), k.prio(q))
        # the generation of each queue's share last seen with nothing moving:
        # unchanged, the script reads nothing more of it (heartbeat.lua)
        cache = self._balance
        args: list[Any] = [ttl_ms, len(index), len(requests)]
        for r in requests:
            keys += (k.heartbeat(r.worker), k.inbox(r.worker))
            keys += [k.held(r.worker, q) for q in r.queues]
            args += (r.worker, r.incarnation, len(r.acks), *r.acks, len(r.queues))
            for q in r.queues:
                seen = cache.get((r.worker, q))
                args += (index[q], seen[0] if seen is not None else "")
        raw = await self._run(conn, "heartbeat", keys, args)
        return parse_heartbeats(raw, requests, cache)

    async def give_back(
        self,
        conn: Executor,
        worker: str,
        queue: str,
        ids: Sequence[str],
        *,
        failed: bool,
        backoff_ms: int = 0,
        backoff_cap_ms: int = 0,
        errors: Sequence[str] | None = None,
        keep_ms: int = 0,
    ) -> list[tuple[int, int]]:
        """Per id: (outcome, delay ms); outcome 0 not ours, 1 front (or kept:
        with ``keep_ms`` > 0 and not failed, persistent tasks are reserved
        for ``worker`` for that long), 2 retry later, 3 dead.

        ``errors``: with ``failed``, the error of each id's attempt (kept in
        its dead-letter record if it is dead-lettered, and in the payload's
        attempt history, :meth:`Keys.tries`)."""
        k = self.keys
        keys = [
            k.procs(queue),
            k.held(worker, queue),
            k.queue(queue),
            k.persistent(queue),
            k.attempts(queue),
            k.delayed(queue),
            k.dead(queue),
            k.standby(queue),
            k.idle(queue),
            k.moving(queue),
            k.reserved(queue),
            k.unowned(queue),
            k.share(queue),
            k.prio(queue),
            k.delayed_prio(queue),
            k.tries(queue),
            k.tried(queue),
        ]
        keep = keep_ms > 0 and not failed
        args: list[Any] = [
            worker,
            "fail" if failed else "keep" if keep else "return",
            keep_ms if keep else backoff_ms,
            backoff_cap_ms,
            k.wake_prefix,
            queue,
        ]
        if failed and errors is not None:
            args += [
                f"{pid}\0{err}".encode(errors="replace")[: len(pid) + 1 + DEAD_ERROR_MAX]
                for pid, err in zip(ids, errors, strict=True)
            ]
        else:
            args += ids
        r = await self._run(conn, "give_back", keys, args)
        return [(int(r[i]), int(r[i + 1])) for i in range(0, len(r), 2)]

    async def drain(self, conn: Executor, worker: str, incarnation: str, queue: str) -> bool:
        """Begin a graceful stop of ``queue`` (``drain.lua``): ``worker`` stops
        being one of its servers (its capacity leaves the fair share) and
        keeps the processes it holds until it hands them back. Returns
        whether it served ``queue`` until now.

        Raises:
            FencedError: its lease is gone (nothing changed).
        """
        k = self.keys
        keys = [k.heartbeat(worker), k.servers(queue), k.idle(queue), k.share(queue)]
        return bool(await self._run(conn, "drain", keys, [worker, incarnation]))

    async def unserve(self, conn: Executor, worker: str, queue: str) -> int:
        k = self.keys
        keys = [
            k.serves(worker),
            k.held(worker, queue),
            k.procs(queue),
            k.queue(queue),
            k.persistent(queue),
            k.attempts(queue),
            k.dead(queue),
            k.servers(queue),
            k.delayed(queue),
            k.standby(queue),
            k.idle(queue),
            k.unowned(queue),
            k.share(queue),
            k.prio(queue),
            k.delayed_prio(queue),
        ]
        return int(await self._run(conn, "unserve", keys, [queue, k.wake_prefix, worker]))

    async def recycle(
        self,
        conn: Executor,
        worker: str,
        *,
        leave: bool,
        incarnation: str = "",
        queues: Iterable[str] = (),
    ) -> RecycleReply:
        """Recycle (``leave=False``, the worker must be dead) or retire
        (``leave=True``) one worker. Learns the worker's queues from the script
        when ``queues`` misses some; safe to call again after any failure."""
        r = await self._recycle(conn, [worker], "leave" if leave else "dead", incarnation, queues)
        return RecycleReply(bool(r.alive), r.returned, r.dead_lettered)

    async def recycle_dead(
        self, conn: Executor, workers: Sequence[str], *, queues: Iterable[str] = ()
    ) -> RecycleManyReply:
        """Recycle several dead workers in one script call (idle servers of a
        queue are woken once, however many they are). Workers found alive are left alone and
        listed in the reply. ``queues`` is a hint: the queues the workers
        serve that it misses cost one more call."""
        return await self._recycle(conn, workers, "dead", "", queues)

    async def _recycle(
        self,
        conn: Executor,
        workers: Sequence[str],
        mode: str,
        incarnation: str,
        queues: Iterable[str],
    ) -> RecycleManyReply:
        k = self.keys
        ws = list(dict.fromkeys(workers))
        qs = list(dict.fromkeys(queues))
        for _ in range(10):
            keys = [k.workers, k.info]
            for w in ws:
                keys += (k.heartbeat(w), k.serves(w), k.inbox(w))
            for q in qs:
                keys += (
                    k.procs(q),
                    k.queue(q),
                    k.persistent(q),
                    k.attempts(q),
                    k.dead(q),
                    k.servers(q),
                    k.delayed(q),
                    k.standby(q),
                    k.idle(q),
                    k.unowned(q),
                    k.share(q),
                    k.prio(q),
                    k.delayed_prio(q),
                )
            for w in ws:
                keys += (k.held(w, q) for q in qs)
            args = [mode, incarnation, k.wake_prefix, len(ws), *ws, *qs]
            r = await self._run(conn, "recycle", keys, args)
            if int(r[0]) == 0:
                return RecycleManyReply(
                    recycled=int(r[3]),
                    alive=[w.decode() for w in r[4]],
                    returned=int(r[1]),
                    dead_lettered=int(r[2]),
                    queues=qs,
                    dead=[
                        CrashDeadLetter(t[0].decode(), t[1], int(t[2]), int(t[3]), t[4].decode())
                        for t in r[5]
                    ],
                )
            qs += [q.decode() for q in r[1:]]
        raise ProtocolError(f"recycle of workers {ws}: their queues kept changing")

    async def rebalance(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        queue: str,
        limit: int,
        hold_ms: int,
        servers: Sequence[str] = (),
    ) -> tuple[RebalanceReply, list[str]]:
        """Ask the peers above their fair share of ``queue`` to hand back
        their surplus, reserved for ``worker`` (``rebalance.lua``). Names the
        queue's servers as learned from Redis (called again when ``servers``
        was not the current set). Returns the reply and the servers."""
        k = self.keys
        names = list(servers)
        for _ in range(5):
            keys = [
                k.heartbeat(worker),
                k.servers(queue),
                k.persistent(queue),
                k.standby(queue),
                k.procs(queue),
                k.moving(queue),
                k.reserved(queue),
                k.queue(queue),
                k.share(queue),
                *(k.held(w, queue) for w in names),
            ]
            args = [worker, incarnation, queue, limit, hold_ms, k.wake_prefix, *names]
            r = await self._run(conn, "rebalance", keys, args)
            if int(r[0]) == 2:
                names = [x.decode() for x in r[1:]]
                continue
            return RebalanceReply(int(r[1]), int(r[2]), int(r[3]), int(r[4])), names
        raise CommandError("rebalance: the servers of the queue keep changing")

    async def reap_check(self, conn: Executor, limit: int = 100, lease_ms: int = 0) -> ReapCheck:
        """Which workers' leases have run out; with ``lease_ms``, the ids
        returned are hidden from other callers for that long."""
        r = await self._run(conn, "reap_check", [self.keys.workers], [limit, lease_ms])
        return ReapCheck(int(r[0]), int(r[1]), int(r[2]), [w.decode() for w in r[3:]])


class _ClaimCalls(_Calls):
    """The runner's hot path: claim, finish, and both in one round trip,
    each call built (and packed) once per argument set and sent many times."""

    def claim_call(
        self,
        worker: str,
        incarnation: str,
        queue: str,
        n: int,
        max_attempts: int,
        *,
        fair: bool = False,
        backoff_ms: int = 1000,
        backoff_cap_ms: int = 60_000,
        ttl_ms: int = 0,
        wake: bool = True,
        rate: tuple[int, int] | None = None,
        patience_ms: int = 0,
    ) -> ScriptCall[ClaimReply]:
        """One ``claim.lua`` call. ``wake``: put the worker in the queue's idle
        set when it finds nothing (a runner waiting for work); False for a
        claim by hand, which nobody should wake. ``rate``: the queue's rate
        limit (claims, period ms), enforced by a token bucket in Redis.
        ``patience_ms`` (with ``fair``, at least 2): also take a persistent
        task beyond the fair share once it has had no owner for that long."""
        memo = (
            worker, incarnation, queue, n, max_attempts, fair, backoff_ms, backoff_cap_ms,
            ttl_ms, wake, rate, patience_ms,
        )  # fmt: skip
        call = self._claims.get(memo)
        if call is not None:
            return call
        k = self.keys
        keys = [
            k.heartbeat(worker),
            k.serves(worker),
            k.queue(queue),
            k.persistent(queue),
            k.procs(queue),
            k.held(worker, queue),
            k.attempts(queue),
            k.delayed(queue),
            k.token,
            k.servers(queue),
            k.standby(queue),
            k.idle(queue),
            k.reserved(queue),
            k.unowned(queue),
            k.share(queue),
            k.prio(queue),
            k.delayed_prio(queue),
        ]
        args = [
            worker,
            incarnation,
            queue,
            n,
            max_attempts,
            (patience_ms if patience_ms else 1) if fair else 0,
            backoff_ms,
            backoff_cap_ms,
            ttl_ms,
            1 if wake else 0,
            k.wake_prefix,
        ]
        # the rate bucket (its ARGV empty: no limit), then the pause flag
        keys += [k.rate(queue), k.paused(queue)]
        args += [rate[0], rate[1]] if rate is not None else ["", ""]

        # A runner claims with the same few argument sets over and over:
        # each is built and packed once (a handful per runner; the memo is
        # emptied should it ever grow large).
        parse = functools.partial(parse_claim, queue=queue, worker=worker)
        call = ScriptCall(self.scripts["claim"], keys, args, parse).reusable()
        if len(self._claims) >= _CLAIM_MEMO:
            self._claims.clear()
        self._claims[memo] = call
        return call

    async def claim(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        queue: str,
        n: int,
        max_attempts: int,
        **options: Unpack[ClaimOptions],
    ) -> ClaimReply:
        """Send :meth:`claim_call`'s call (a claim by hand: a runner keeps its
        calls built and sends them with :meth:`run`)."""
        call = self.claim_call(worker, incarnation, queue, n, max_attempts, **options)
        return await self.run(conn, call)

    def finish_call(
        self,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        results: ResultsToKeep | None = None,
    ) -> ScriptCall[list[bool]]:
        """A ``finish.lua`` call; with ``results`` (a queue that keeps them),
        a ``finish_results.lua`` call that keeps each id's result."""
        if results is not None:
            return self._finish_results_call(worker, incarnation, queue, ids, results)
        keys, head = self._finish_head(worker, incarnation, queue)
        return ScriptCall(self.scripts["finish"], keys, (*head, *ids), parse_finish)

    def _finish_head(
        self, worker: str, incarnation: str, queue: str
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The keys and first arguments that ``finish.lua`` and
        ``finish_results.lua`` share, built once per (worker, incarnation,
        queue)."""
        memo = (worker, incarnation, queue)
        head = self._finishes.get(memo)
        if head is None:
            k = self.keys
            keys = (
                k.heartbeat(worker),
                k.procs(queue),
                k.held(worker, queue),
                k.persistent(queue),
                k.attempts(queue),
                k.share(queue),
                k.awaiting(queue),  # done messages only while someone awaits them
            )
            head = keys, (worker, incarnation, k.done_channel(queue))
            if len(self._finishes) >= _CLAIM_MEMO:
                self._finishes.clear()
            self._finishes[memo] = head
        return head

    def _finish_results_call(
        self,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        results: ResultsToKeep,
    ) -> ScriptCall[list[bool]]:
        k = self.keys
        first, head = self._finish_head(worker, incarnation, queue)
        keys = list(first[:6])
        args: list[Any] = [*head, results.ttl_ms]
        for pid in ids:
            payload, value = results.values[pid]
            keys.append(k.result(queue, payload))
            args += [pid, "n" if value is None else "v", b"" if value is None else value]
        keys.append(first[6])  # the awaiting key, after the result keys
        return ScriptCall(self.scripts["finish_results"], keys, args, parse_finish)

    async def finish(
        self,
        conn: Executor,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        results: ResultsToKeep | None = None,
    ) -> list[bool]:
        return await self.run(conn, self.finish_call(worker, incarnation, queue, ids, results))

    async def finish_and_claim(
        self,
        conn: PipelineExecutor,
        worker: str,
        incarnation: str,
        queue: str,
        ids: Sequence[str],
        claim: ScriptCall[ClaimReply],
        results: ResultsToKeep | None = None,
    ) -> tuple[outcome.Outcome[list[bool]], outcome.Outcome[ClaimReply]]:
        """:meth:`finish` ``ids``, then ``claim`` (from :meth:`claim_call`), in
        one round trip. Redis runs the finish first, so the claim sees those
        processes gone (the fair share no longer counts them). Without
        ``results`` the two are one script call (``finish_claim.lua``): an
        error reply (fenced, not serving) means neither ran, and both
        outcomes are that error. With ``results`` they are two calls
        (``finish_results.lua`` and ``claim.lua``) in one write, not one
        atomic step, and either may fail alone.

        Returns:
            The outcome of each (see :func:`run_pipelined`): what
            :meth:`finish` and :meth:`run` of the claim would have returned
            or raised.
        Raises:
            MeshConnectionError: unknown whether either ran.
        """
        if results is not None:
            finish = self.finish_call(worker, incarnation, queue, ids, results)
            finished, claimed = await run_pipelined(conn, [finish, claim])
            return finished, claimed
        # One script (finish_claim.lua): one lease check and one call for
        # both. An error reply means neither ran; both take that error.
        # by the claim call's identity (claim_call's calls are memoised);
        # the entry keeps the call alive, so its id is not reused meanwhile
        memo = self._finish_claims.get(id(claim))
        if memo is None or memo[0] is not claim:
            if len(self._finish_claims) >= _CLAIM_MEMO:
                self._finish_claims.clear()
            keys = (*claim.keys, self.keys.awaiting(queue))
            args = (*claim.args, self.keys.done_channel(queue))
            script = self.scripts["finish_claim"]
            head = Packed(("EVALSHA", script.sha, len(keys), *keys, *args))
            memo = self._finish_claims[id(claim)] = (claim, head)
        head = memo[1]
        k = len(ids)
        try:
            # the command packed once but for the ids (Packed.extended)
            (reply,) = await conn.pipeline([head.extended(ids)], raise_on_error=False)
            if type(reply) is CommandError and reply.code == "NOSCRIPT":
                script = self.scripts["finish_claim"]
                (reply,) = await conn.pipeline(
                    [("EVAL", script.source, *head[2:], *ids)], raise_on_error=False
                )
            if isinstance(reply, CommandError):
                mapped = map_error(reply)
                if mapped is not reply:
                    mapped.__cause__ = reply
                raise mapped
            flags = reply[len(reply) - k :]
            if len(flags) != k:
                raise ValueError(f"finish_claim replied {len(reply)} items for {k} ids")
            was_ours = [f == 1 for f in flags]
            took = parse_claim_compact(reply[: len(reply) - k], queue, worker)
        except MeshConnectionError:
            raise
        except Exception as exc:  # an error reply (neither ran), or a malformed one
            return outcome.Error(exc), outcome.Error(exc)
        return outcome.Value(was_ours), outcome.Value(took)


class _QueueCalls(_Calls):
    """The client's and the operator's calls: put tasks, delay, ensure,
    cancel, pause, dead letters, policies, schedules, counts."""

    async def put_blobs(self, conn: Executor, payloads: Sequence[bytes]) -> None:
        """``put_blob.lua`` for each big payload of ``payloads`` (longer than
        :data:`~mesh._blob.BLOB_MIN`; once each), before the call that
        enqueues their stand-ins (see :mod:`mesh._blob`). An upload whose
        enqueue never comes (an error, a cancellation) expires within an
        hour.

        Raises:
            OutOfMemoryError, MeshConnectionError: as any script call; the
                uploads made before it stay until they expire.
        """
        done: set[bytes] = set()
        for p in payloads:
            if len(p) > BLOB_MIN:
                s = standin(p)
                if s not in done:
                    done.add(s)
                    key = self.keys.blob(s[11:51].decode())  # (the stand-in's SHA-1)
                    await self._run(conn, "put_blob", [key], [p])

    async def enqueue(
        self, conn: Executor, queue: str, payloads: Sequence[bytes], priority: int = 0
    ) -> int:
        k = self.keys
        keys = [k.queue(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)]
        keys.append(k.prio(queue))
        args = [queue, k.wake_prefix, priority, *payloads]
        return int(await self._run(conn, "enqueue", keys, args))

    async def delay(
        self,
        conn: Executor,
        queue: str,
        payloads: Sequence[bytes],
        *,
        in_ms: int = 0,
        at_ms: int | None = None,
        priority: int = 0,
    ) -> DelayReply:
        """``delay.lua``: delay ``payloads`` by ``in_ms`` ms of the Redis clock,
        or until ``at_ms`` (ms since the epoch, Redis clock); when due they
        go to the front of level ``priority``."""
        k = self.keys
        keys = [k.delayed(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)]
        keys.append(k.delayed_prio(queue))
        mode, ms = ("in", in_ms) if at_ms is None else ("at", at_ms)
        args = [queue, k.wake_prefix, mode, ms, priority, *payloads]
        r = await self._run(conn, "delay", keys, args)
        return DelayReply(int(r[0]), int(r[1]), int(r[2]))

    async def dead(
        self, conn: Executor, queue: str, mode: str, payloads: Sequence[bytes] | None
    ) -> tuple[int, int]:
        """``dead.lua``: requeue or purge dead letters (all, or those
        payloads; an empty list: none); (records acted on, records left:
        now persistent)."""
        if payloads is not None and not payloads:
            return 0, 0
        k = self.keys
        keys = [
            k.dead(queue),
            k.queue(queue),
            k.attempts(queue),
            k.persistent(queue),
            k.standby(queue),
            k.idle(queue),
            k.prio(queue),
        ]
        r = await self._run(conn, "dead", keys, [queue, k.wake_prefix, mode, *(payloads or ())])
        return int(r[0]), int(r[1])

    async def enqueue_group(
        self,
        conn: Executor,
        queue: str,
        group: str,
        payloads: Sequence[bytes],
        *,
        in_ms: int | None = None,
        at_ms: int | None = None,
        priority: int = 0,
    ) -> DelayReply:
        """``enqueue_group.lua``: ``payloads`` at the back of ``group`` (of
        their ``priority`` in it) now, or delayed ``in_ms`` or until
        ``at_ms`` (Redis clock); (the group's length, or the jobs newly
        delayed; the due time; now)."""
        k = self.keys
        keys = [k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)]
        mode, ms = (
            ("now", 0)
            if in_ms is None and at_ms is None
            else (("at", at_ms) if at_ms is not None else ("in", in_ms))
        )
        args = [queue, k.wake_prefix, group, mode, ms, priority, *payloads]
        r = await self._run(conn, "enqueue_group", keys, args)
        return DelayReply(int(r[0]), int(r[1]), int(r[2]))

    async def configure_group(
        self, conn: Executor, queue: str, group: str, mode: str, fields: Sequence[str]
    ) -> bytes | None:
        """``configure_group.lua``: the settings stored afterwards
        (``b"concurrency,rate,period,weight"``; None after mode ``clear``).
        ``group`` "" is the queue's default."""
        k = self.keys
        keys = [k.idle(queue), k.queues]
        r = await self._run(
            conn, "configure_group", keys, [queue, k.wake_prefix, group, mode, *fields]
        )
        return r if isinstance(r, bytes) else None

    async def pause_group(self, conn: Executor, queue: str, group: str, mode: str) -> bool:
        """``pause_group.lua``: pause or resume ``group``; whether that
        changed anything."""
        k = self.keys
        args = [mode, queue, k.wake_prefix, group]
        return bool(await self._run(conn, "pause_group", [k.idle(queue)], args))

    async def pause(self, conn: Executor, queue: str, mode: str) -> bool:
        """``pause.lua``: pause (mode ``pause``) or resume (``resume``) a
        queue; whether that changed anything."""
        k = self.keys
        keys = [k.paused(queue), k.queues, k.idle(queue), k.queue(queue), k.prio(queue)]
        return bool(await self._run(conn, "pause", keys, [mode, queue, k.wake_prefix]))

    async def stats(
        self, conn: Executor, counts: Mapping[str, tuple[int, int]], keep_minutes: int
    ) -> int:
        """``stats.lua``: add (finished, failed) per queue to the current
        minute of the Redis clock; the minute (since the epoch)."""
        k = self.keys
        keys = [k.stats(q) for q in counts]
        args: list[Any] = [keep_minutes]
        for done, failed in counts.values():
            args += [done, failed]
        return int(await self._run(conn, "stats", keys, args))

    async def configure(
        self, conn: Executor, queue: str, mode: str, source: str, fields: Sequence[Any]
    ) -> bytes | None:
        """``configure.lua``: the policy JSON stored afterwards (None after
        mode ``clear``)."""
        k = self.keys
        r = await self._run(conn, "configure", [k.policy, k.queues], [queue, mode, source, *fields])
        return r if isinstance(r, bytes) else None

    async def schedule(
        self, conn: Executor, queue: str, payload: bytes, spec: str, first_ms: int | None
    ) -> tuple[bool, int]:
        """``schedule.lua`` mode add: (new, first tick ms)."""
        k = self.keys
        r = await self._run(
            conn,
            "schedule",
            [k.schedules, k.schedule_specs, k.queues],
            ["add", queue, payload, spec, "" if first_ms is None else first_ms],
        )
        return r[0] == 1, int(r[1])

    async def unschedule(self, conn: Executor, queue: str, payload: bytes) -> bool:
        """``schedule.lua`` mode remove: whether it existed."""
        k = self.keys
        r = await self._run(
            conn,
            "schedule",
            [k.schedules, k.schedule_specs, k.queues],
            ["remove", queue, payload, "", ""],
        )
        return int(r) == 1

    async def fire(self, conn: Executor, ticks: Sequence[tuple[bytes, int, int]]) -> list[int]:
        """``fire.lua``: per (schedule id, tick read, next tick), 1 fired, 0
        not (another peer did), 2 skipped (now a persistent task)."""
        k = self.keys
        keys = [k.schedules, k.schedule_specs, k.queues]
        args: list[Any] = [k.wake_prefix]
        for sid, tick, nxt in ticks:
            q = sid.partition(b"\0")[0].decode()
            keys += [k.queue(q), k.persistent(q), k.standby(q), k.idle(q)]
            args += [sid, tick, nxt]
        return [int(x) for x in await self._run(conn, "fire", keys, args)]

    async def ensure(
        self, conn: Executor, queue: str, payloads: Sequence[bytes], weight: int = 1
    ) -> list[bool]:
        """Per payload: added (True) or a persistent task already (False);
        every one gets ``weight``."""
        k = self.keys
        keys = [k.queue(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)]
        keys += [k.delayed(queue), k.unowned(queue), k.share(queue), k.procs(queue)]
        keys.append(k.prio(queue))
        r = await self._run(conn, "ensure", keys, [queue, k.wake_prefix, weight, *payloads])
        return [x == 1 for x in r]

    async def recount(self, conn: Executor, queue: str) -> tuple[int, int]:
        """Set ``queue``'s persistent weight sums to what its registry holds
        (``recount.lua``): (the weight counted before, the weight present)."""
        k = self.keys
        keys = [k.persistent(queue), k.standby(queue), k.share(queue)]
        was, now = await self._run(conn, "recount", keys, [queue])
        return int(was), int(now)

    async def cancel(
        self, conn: Executor, queue: str, payload: bytes, group: str | None = None
    ) -> tuple[int, int]:
        """(queued copies removed, running processes cancelled); with
        ``group``, the copies queued or delayed in that group too."""
        k = self.keys
        keys = [k.queue(queue), k.persistent(queue), k.procs(queue), k.attempts(queue)]
        keys += [k.delayed(queue), k.standby(queue), k.reserved(queue), k.unowned(queue)]
        keys += [k.share(queue), k.prio(queue), k.delayed_prio(queue)]
        tail = [k.group_jobs(queue, group)] if group is not None else []
        return await self._cancelling(conn, "cancel", queue, keys, [payload, k.cancel_prefix], tail)

    async def delete_queue(self, conn: Executor, queue: str) -> tuple[int, int]:
        """(queued, delayed and dead-lettered tasks removed, running processes
        cancelled)."""
        k = self.keys
        keys = [k.queue(queue), k.persistent(queue), k.procs(queue), k.attempts(queue)]
        keys += [k.delayed(queue), k.dead(queue), k.queues, k.standby(queue)]
        keys += [k.moving(queue), k.reserved(queue), k.unowned(queue), k.share(queue)]
        keys += [k.prio(queue), k.delayed_prio(queue)]
        args = [queue, k.cancel_prefix, k.delete_channel(queue)]
        return await self._cancelling(conn, "delete_queue", queue, keys, args)

    async def _cancelling(
        self,
        conn: Executor,
        name: str,
        queue: str,
        keys: list[str],
        args: list[Any],
        tail: list[str] | None = None,
    ) -> tuple[int, int]:
        """Run a script that cancels running processes of ``queue``: it needs
        the held and inbox keys of their workers, and names the workers whose
        keys it was not given (then nothing changed); call again with them."""
        k = self.keys
        workers: list[str] = []
        for _ in range(10):
            wkeys = [key for w in workers for key in (k.held(w, queue), k.inbox(w))]
            r = await self._run(conn, name, keys + wkeys + (tail or []), args + workers)
            if int(r[0]) == 0:
                return int(r[1]), int(r[2])
            workers += [w.decode() for w in r[1:]]
        raise ProtocolError(f"{name} on queue {queue}: the running processes kept changing")


class Binding(_PeerCalls, _ClaimCalls, _QueueCalls):
    """Typed calls to the scripts of one namespace."""
