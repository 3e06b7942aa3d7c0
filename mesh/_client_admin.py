"""The client's administration of queues: their policy, periodic tasks,
pauses and dead letters, and adopting a namespace after its master lost it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._binding import payload_bytes
from ._blob import BLOB_MIN
from ._client_core import ClientCore
from ._client_groups import group_fields
from ._epoch import adopt_value
from ._errors import CommandError, ConfigError
from ._keys import check_queue
from ._policy import QueuePolicy, parse_policy, policy_fields
from ._schedule import Schedule, cron_next, spec_of
from ._types import DeadLetter

__all__ = ["ClientAdmin"]


class ClientAdmin(ClientCore):
    """Policies, schedules, pauses and dead letters (part of :class:`~mesh.Client`)."""

    async def configure(
        self,
        queue: str,
        *,
        max_attempts: int | None = None,
        backoff: float | None = None,
        backoff_max: float | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the handlers' timeout, not this call's
        result_ttl: float | None = None,
        rate_limit: int | tuple[int, float] | None = None,
        group_concurrency: int | None = None,
        group_rate_limit: int | tuple[int, float] | None = None,
        group_weight: int | None = None,
        enqueue_times: bool | None = None,
    ) -> QueuePolicy:
        """Set the policy of ``queue`` in Redis; every worker serving it
        applies it (within one heartbeat interval), whatever its
        ``start_work`` options. Options not given (None) keep their stored
        value, or the default for a queue without a policy.

        Args:
            max_attempts: failed attempts after which a one-shot task is
                dead-lettered (0: no limit). Default 5.
            backoff: retry n waits ``backoff * 2**(n-1)`` seconds, capped
                at ``backoff_max``. Default 1.0.
            backoff_max: the cap. Default 60.0.
            timeout: seconds a handler may run; a longer one is cancelled
                and the attempt counts as failed (``TimeoutError`` in its
                dead-letter record). 0: no timeout (the default).
            result_ttl: keep each finished task's return value (and each
                dead letter's failure) this many seconds, for
                :meth:`result`. 0: results are not kept (the
                default; a plain queue costs nothing more).

            rate_limit: at most N claims per second (``N``), or per
                ``seconds`` (``(N, seconds)``), across the whole mesh: a
                token bucket in Redis, checked by every claim (a full bucket
                allows a burst of N). 0: no limit (the default).
            group_concurrency: the default concurrency of every group of
                the queue (see :meth:`configure_group`, whose settings of
                one group win over these).
            group_rate_limit: the default rate limit of every group.
            group_weight: the default weight of every group.
            enqueue_times: keep the first enqueue time of each one-shot job
                (:attr:`Job.enqueued`, shown by ``mesh jobs`` and the
                dashboard) from now on: one more write per job enqueued and
                per call that finishes jobs, and a second copy in Redis of
                each waiting or running entry (see docs/operating.md).
                Turning it off drops the times kept. Default False (a queue
                that keeps none pays no write for them).

        Returns:
            The policy stored now.
        Raises:
            ConfigError: a value out of range (nothing was written): every
                duration is a number of seconds from 0 to ten years.
        """
        conn = self._check()
        check_queue(queue)
        group_default = group_fields(group_concurrency, group_rate_limit, group_weight)
        fields = policy_fields(
            max_attempts=max_attempts,
            backoff=backoff,
            backoff_max=backoff_max,
            timeout=timeout,
            result_ttl=result_ttl,
            rate_limit=rate_limit,
            enqueue_times=enqueue_times,
        )
        try:
            raw = await self._binding.configure(conn, queue, "set", "configure", fields)
        except CommandError as exc:
            if exc.code == "BAD_ARG":
                raise ConfigError(str(exc).removeprefix("BAD_ARG ")) from None
            raise
        assert raw is not None
        if any(group_default):
            await self._binding.configure_group(conn, queue, "", "set", group_default)
        return parse_policy(raw, queue)

    async def policy(self, queue: str) -> QueuePolicy | None:
        """The stored policy of ``queue``, or None if it has none (its
        workers then apply their own ``start_work`` options, and the first of
        them to serve it stores those)."""
        check_queue(queue)
        return await self._reads.policy(queue)

    async def clear_policy(self, queue: str) -> bool:
        """Remove the stored policy of ``queue``. Workers serving it keep
        applying the policy they have until they restart; the next worker to
        serve it stores its own options.

        Returns:
            Whether there was one.
        """
        check_queue(queue)
        conn = self._check()
        had = await self._reads.has_policy(queue)
        await self._binding.configure(conn, queue, "clear", "", [])
        return bool(had)

    async def schedule(
        self,
        queue: str,
        task: bytes | str,
        *,
        every: float | None = None,
        cron: str | None = None,
    ) -> bool:
        """Make ``task`` a periodic task of ``queue``: each tick enqueues one
        one-shot copy of it, exactly once across the mesh (any worker fires
        it, whatever queues it serves). Unique per (queue, task): scheduling
        it again replaces its period and restarts its ticks.

        Args:
            every: a tick every this many seconds (0.05 to ten years), the first
                one period from now (Redis clock).
            cron: a cron expression, evaluated in UTC (needs the ``cronsim``
                package: ``pip install 'trio-mesh[cron]'``).

        Exactly one of the two. While no worker runs, ticks are missed; the
        first worker to run again fires one copy, not one per missed tick.

        Returns:
            True if the schedule is new, False if it replaced one.
        Raises:
            ConfigError: neither or both of every and cron, a period too
                short, a bad cron expression, cronsim missing.
            TypeError, ValueError: a bad payload or queue name, or a payload
                over 1 MiB (:data:`~mesh._blob.BLOB_MIN`: a schedule keeps
                its payload inline; enqueue a small key to it instead).
        """
        conn = self._check()
        check_queue(queue)
        payload = payload_bytes(task, self._max_payload)
        if len(payload) > BLOB_MIN:
            raise ValueError(
                f"a schedule's payload is at most {BLOB_MIN} bytes (1 MiB), not {len(payload)}: "
                "schedule a small key to the data instead"
            )
        spec = spec_of(every, cron)
        first = None
        if cron is not None:
            first = cron_next(spec[5:], round(await self._reads.time() * 1000))
        new, _ = await self._binding.schedule(conn, queue, payload, spec, first)
        return new

    async def unschedule(self, queue: str, task: bytes | str) -> bool:
        """Remove the periodic task (``queue``, ``task``); copies it enqueued
        already stay.

        Returns:
            Whether it existed.
        """
        conn = self._check()
        check_queue(queue)
        return await self._binding.unschedule(conn, queue, payload_bytes(task))

    async def schedules(self, queue: str | None = None) -> list[Schedule]:
        """The periodic tasks (of ``queue``, or of every queue), the next due
        first."""
        if queue is not None:
            check_queue(queue)
        return await self._reads.schedules(queue)

    async def pause(self, queue: str) -> bool:
        """Pause ``queue`` for every worker of the namespace: from now on no
        worker starts a one-shot task of it. Running processes finish;
        enqueues are taken and wait; delayed tasks that come due move to the
        queue and wait there. Persistent tasks are not affected: they keep
        their owners and are handed over and claimed as usual (a pause must
        not take them down). A worker of a protocol before 8 ignores it.

        Returns:
            True if the queue was not paused before.
        Raises:
            ConfigError: a bad queue name.
            MeshConnectionError: Redis could not be reached.
        """
        check_queue(queue)
        return await self._binding.pause(self._check(), queue, "pause")

    async def resume(self, queue: str) -> bool:
        """End a pause of ``queue``: its idle workers are woken for the tasks
        queued at once (as an enqueue wakes them).

        Returns:
            True if the queue was paused.
        Raises:
            ConfigError: a bad queue name.
            MeshConnectionError: Redis could not be reached.
        """
        check_queue(queue)
        return await self._binding.pause(self._check(), queue, "resume")

    async def paused(self) -> dict[str, float]:
        """The paused queues among the known ones, each with since when (Redis
        clock, seconds)."""
        return await self._reads.paused(await self._reads.queues())

    async def dead_letters(self, queue: str) -> list[DeadLetter]:
        """The dead letters of ``queue``, oldest first: one-shot tasks that
        failed their last allowed attempt (or whose workers kept crashing),
        each with its attempts, last error, last worker and the time it was
        dead-lettered. A payload dead-lettered twice is listed twice.

        Raises:
            ProtocolError: an entry is not a dead-letter record (protocol 4 and later).
        """
        check_queue(queue)
        return await self._reads.dead_letters(queue)

    async def requeue_dead(self, queue: str, tasks: Iterable[bytes | str] | None = None) -> int:
        """Put dead letters of ``queue`` back at the back of the queue, with
        their attempt counts reset, atomically: all of them, or those whose
        payload is in ``tasks``. A payload that has become a persistent task
        of the queue since stays a dead letter.

        Returns:
            How many were requeued (a payload dead-lettered twice counts
            twice, and is queued twice).
        Raises:
            TypeError, ValueError, ConfigError: bad payloads or queue name.
        """
        return await self._dead(queue, "requeue", tasks)

    async def purge_dead(self, queue: str, tasks: Iterable[bytes | str] | None = None) -> int:
        """Drop dead letters of ``queue``, atomically: all of them, or those
        whose payload is in ``tasks``. The live queue is left alone.

        Returns:
            How many records were dropped.
        Raises:
            TypeError, ValueError, ConfigError: bad payloads or queue name.
        """
        return await self._dead(queue, "purge", tasks)

    async def _dead(self, queue: str, mode: str, tasks: Iterable[bytes | str] | None) -> int:
        conn = self._check()
        check_queue(queue)
        # a big payload's dead letter holds its stand-in (mesh._blob)
        payloads = None if tasks is None else self._payloads(tasks, named=True)
        if payloads == []:
            return 0
        done, _ = await self._binding.dead(conn, queue, mode, payloads)
        return done

    async def adopt_namespace(self) -> None:
        """The operator's step after a master lost the namespace (restarted
        empty) and no node that holds it will come back: make the namespace
        on the master this client is connected to the one every process
        uses from now on. Processes that refuse that master (its epoch is not
        the one they knew, see docs/operating.md) accept it at their next
        connect attempt; what the lost copy held is gone (re-declare the
        persistent tasks: :meth:`reconcile`).

        Raises:
            MeshConnectionError, CommandError: as for any write.

        On cancellation the write may or may not have happened; run it again.
        """
        value = adopt_value()
        await self._conn.execute("SET", self._keys.epoch, value)
        epoch = self._conn.topology.epoch
        if epoch is not None:
            epoch.known = value
