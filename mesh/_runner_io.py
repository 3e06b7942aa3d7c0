"""The round trips of one queue's runner: a claim (with the finish report in
hand, in one round trip), reports of what finished, failed or was returned, a
rebalance pull, a re-check of what Redis holds, the drain at a stop. Each
takes from the runner core (:mod:`mesh._runner_core`) what to send, sends it
through the protocol binding, and feeds the reply back to the core; claimed
processes go to the handler pool (:mod:`mesh._pool`). The runner's loop
(:mod:`mesh._runner`) decides nothing here: it calls one of these per turn.

Each method raises what the binding raises (:class:`~mesh.FencedError`,
:class:`~mesh.MeshConnectionError`, :class:`~mesh.CommandError`), with the
outcomes it took put back first, to be reported again; on cancellation the
same. The loop's one error path handles them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import outcome

from ._binding import Binding
from ._connection import Connection
from ._errors import CommandError, FencedError, MeshConnectionError, MeshError
from ._pool import START_CHUNK, HandlerPool
from ._queue_config import QueueConfig
from ._runner_core import RunnerCore
from ._stats import QueueCounters

__all__ = ["RunnerIO"]

log = logging.getLogger("mesh.worker")


class RunnerIO:
    """The round trips of one queue's runner (see the module docstring)."""

    def __init__(
        self,
        conn: Connection,
        binding: Binding,
        worker_id: str,
        incarnation: str,
        core: RunnerCore,
        pool: HandlerPool,
        early_cancels: dict[str, float],
        replicate: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self._conn = conn
        self._binding = binding
        self._wid = worker_id
        self._inc = incarnation
        self._core = core
        self._out = core.out
        self._pool = pool
        self.config: QueueConfig = core.config
        self._counters: QueueCounters = core.counters
        self._early_cancels = early_cancels
        # With min_replicas: waits until a claim is on the replicas (WAIT)
        # before its persistent tasks' handlers start.
        self._replicate = replicate

    async def claim(self, n: int) -> None:
        """Claim up to ``n`` tasks and start them; processes that finished
        since the last report are reported in the same round trip, before
        the claim runs. Each of the two is handled as if sent alone: a
        claim that went through is started even if the finish failed, and
        the other way round; then the error is raised (a FencedError first)."""
        c, core, out = self.config, self._core, self._out
        now = self._pool.now()
        # Fair share first; a worker held back by it claims again one
        # balance_wait later and then takes, beyond its share, the persistent
        # tasks that had no owner for (about) that long: peers below their
        # share had their chance. Decided in Redis by how long each task
        # waited, not by this runner's clock, so a task a stopping peer has
        # just handed back goes to the peers below their share first.
        held_back, patience_ms = core.claim_begin(now)
        done = out.take_done()
        b = self._binding
        claim = b.claim_call(
            self._wid,
            self._inc,
            c.queue,
            n,
            c.max_attempts,
            fair=c.balance,
            backoff_ms=int(c.backoff * 1000),
            backoff_cap_ms=int(c.backoff_max * 1000),
            ttl_ms=core.ttl_ms,
            rate=c.rate,
            patience_ms=patience_ms,
        )
        unsure = len(done) + n
        core.unsure += unsure
        try:
            if done:
                finished, claimed = await b.finish_and_claim(
                    self._conn, self._wid, self._inc, c.queue, done, claim, out.keep(done)
                )
            else:
                finished = None
                claimed = outcome.Value(await b.run(self._conn, claim))
            self._counters.claim.observe(self._pool.now() - now)
        except BaseException:
            # No reply (a connection error, an error reply to a claim sent
            # alone, a cancellation): report these again later. After a
            # connection error the loop re-checks what Redis holds for us.
            out.restore_done(done)
            core.claim_lost()
            core.unsure -= unsure
            raise
        try:
            # Each reply is taken as if it had come alone: a claim that went
            # through is started even if the finish failed, and the other way
            # round; then the error is raised, a FencedError first.
            errors: list[MeshError] = []
            if finished is not None:
                try:
                    self._counters.finished += sum(finished.unwrap())
                except FencedError as exc:
                    # the lease is gone: nothing of ours can finish now (as
                    # finish.lua answers then), the peers recycle them
                    errors.append(exc)
                except MeshError as exc:
                    out.restore_done(done)
                    errors.append(exc)
            try:
                reply = claimed.unwrap()
            except MeshError as exc:
                core.claim_lost()
                errors.append(exc)
            else:
                if self._replicate is not None and any(p.persistent for p in reply.processes):
                    # Not replicated: not started. Redis holds them for us; the
                    # loop's resync (after this connection error) hands them back.
                    await self._replicate()
                core.claimed(reply, n, now, held_back)
                start = core.to_start(reply.processes, self._early_cancels)
                pool = self._pool
                items = pool.items(start)
                if len(items) <= START_CHUNK:
                    pool.queue(items)
                else:
                    await pool.start_paced(items)
            if errors:
                raise next((e for e in errors if isinstance(e, FencedError)), errors[0])
        finally:
            core.unsure -= unsure

    async def report(self, keep_ms: int) -> int:
        """Report every outcome in hand, without claiming; returns how many
        processes were handed back (see :meth:`give_back_returned`)."""
        if self._out.done:
            await self.finish()
        if self._out.failed:
            await self.give_back_failed()
        if self._out.returned:
            return await self.give_back_returned(keep_ms)
        return 0

    async def finish(self) -> None:
        """Report the finished processes in hand (taken before the round
        trip; put back on an error, to be reported again)."""
        out, core = self._out, self._core
        done = out.take_done()
        core.unsure += len(done)
        try:
            results = await self._binding.finish(
                self._conn, self._wid, self._inc, self.config.queue, done, out.keep(done)
            )
        except BaseException:
            out.restore_done(done)
            raise
        finally:
            core.unsure -= len(done)
        self._counters.finished += sum(results)

    async def give_back_failed(self) -> None:
        """Report the failures in hand; one line is logged for each."""
        c, out, core = self.config, self._out, self._core
        failed, errors = out.take_failed()
        core.unsure += len(failed)
        try:
            outcomes = await self._binding.give_back(
                self._conn,
                self._wid,
                c.queue,
                failed,
                failed=True,
                backoff_ms=int(c.backoff * 1000),
                backoff_cap_ms=int(c.backoff_max * 1000),
                errors=errors,
            )
        except BaseException:
            out.restore_failed(failed)
            raise
        finally:
            core.unsure -= len(failed)
        for line in core.failures_reported(self._pool.now(), failed, outcomes):
            log.warning("%s", line)

    async def give_back_returned(self, keep_ms: int) -> int:
        """Hand back, unharmed, the processes whose handlers a stop ended
        (their handlers have exited: no two owners); with ``keep_ms`` > 0
        persistent tasks stay reserved for this worker id that long.
        Returns how many were handed back."""
        out, core = self._out, self._core
        returned = out.take_returned()
        core.unsure += len(returned)
        try:
            outcomes = await self._binding.give_back(
                self._conn,
                self._wid,
                self.config.queue,
                returned,
                failed=False,
                keep_ms=keep_ms,
            )
        except BaseException:
            out.restore_returned(returned)
            raise
        finally:
            core.unsure -= len(returned)
        back = sum(1 for result, _ in outcomes if result)
        self._counters.handed_back += back
        return back

    async def rebalance(self, n: int) -> None:
        """Ask the peers above their share to hand ``n`` tasks back to us."""
        core = self._core
        reply, core.servers = await self._binding.rebalance(
            self._conn,
            self._wid,
            self._inc,
            self.config.queue,
            n,
            max(3 * core.ttl_ms, 2000),
            core.servers,
        )
        core.pulled(reply)

    async def resync(self) -> None:
        """Make what this runner runs agree with what Redis says it holds on
        this queue. Held in Redis but not run here (a claim whose reply was
        lost, a finish lost in a failover): handed back, and run again. Run
        here but no longer held (lost by Redis, e.g. a failover that dropped
        writes; the task may have a new owner by now): its handler is
        cancelled. A connection or command error propagates and the loop
        tries again."""
        core = self._core
        reply = await self._conn.execute(
            "SMEMBERS", self._binding.keys.held(self._wid, self.config.queue)
        )
        lost, ghosts = core.resync({pid.decode() for pid in reply}, self._pool.running)
        if lost:
            core.unsure += len(lost)
            try:
                await self._binding.give_back(
                    self._conn, self._wid, self.config.queue, lost, failed=False
                )
            finally:
                core.unsure -= len(lost)
            log.info(
                "queue %s: handed back %d processes Redis held for this worker and it did not run "
                "(a claim reply or a finish lost)",
                self.config.queue,
                len(lost),
            )
        for pid in ghosts:
            log.warning(
                "queue %s: process %s is no longer held in Redis; cancelling it",
                self.config.queue,
                pid,
            )
            self._pool.cancel_slot(self._pool.running[pid])
        core.resynced()

    async def drain(self, within: float) -> bool:
        """The first step of a stop: stop being one of the queue's servers
        (``drain.lua``) while still holding its processes, so that peers
        claim what is handed back next at once, their fair share no longer
        counting this worker (without it, a peer at its share would be held
        back for a heartbeat interval). One attempt, bounded by the
        heartbeat interval; on an error or timeout the stop goes on all the
        same, and the share catches up when the worker unserves or retires.

        Returns:
            Whether it went through within ``within`` seconds."""
        with anyio.move_on_after(within):
            try:
                await self._binding.drain(self._conn, self._wid, self._inc, self.config.queue)
            except (MeshConnectionError, CommandError, FencedError) as exc:
                log.debug("queue %s: could not drain before the stop: %s", self.config.queue, exc)
                return False
            return True
        return False
