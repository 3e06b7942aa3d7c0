"""The client's looks at the mesh: queues, their counts and tasks, jobs one
by one, processes, workers. Each a few reads, sent by the client's
:class:`~mesh._reads.Reader`.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import _browse
from ._binding import payload_bytes
from ._browse import Job, JobPage, MinuteCounts
from ._client_core import ClientCore
from ._keys import check_queue
from ._reads import QueueInfo
from ._types import DelayedTask, Process, WorkerInfo
from ._validate import whole

__all__ = ["ClientReads"]


class ClientReads(ClientCore):
    """Looking at queues, jobs, processes and workers (part of :class:`~mesh.Client`)."""

    async def queues(self) -> list[str]:
        """Names of the queues that have been used (enqueued to, ensured on,
        or served), sorted."""
        return await self._reads.queues()

    async def tasks(self, queue: str) -> list[bytes]:
        """The queued payloads of ``queue`` in claim order (next first: those
        with a priority, the highest first, then the others). Tasks waiting
        for a retry or their due time are not included (see :meth:`delayed`)."""
        check_queue(queue)
        return await self._reads.tasks(queue)

    async def queue_length(self, queue: str) -> int:
        """How many tasks are queued (not running, not waiting for a retry),
        those with a priority included."""
        check_queue(queue)
        return await self._reads.queue_length(queue)

    async def queue_info(self, queue: str) -> QueueInfo:
        """Counts of one queue, read in one round trip."""
        (info,) = await self.queue_infos([queue])
        return info

    async def queue_infos(self, queues: Iterable[str] | None = None) -> list[QueueInfo]:
        """Counts of several queues (default: every known queue, sorted), read
        together in one transaction and one round trip after the list of
        queues."""
        names = [check_queue(q) for q in queues] if queues is not None else await self.queues()
        return await self._reads.queue_infos(names)

    async def delayed(self, queue: str, *, limit: int | None = None) -> list[DelayedTask]:
        """The tasks of ``queue`` waiting for their due time (enqueued with a
        delay, or failed and waiting for a retry), the first due first: all,
        or the first ``limit``.

        Raises:
            ConfigError: a bad queue name or a ``limit`` below 0.
        """
        check_queue(queue)
        if limit is not None:
            whole("limit", limit)
        if limit == 0:
            return []
        return await self._reads.delayed(queue, limit)

    async def persistent_tasks(self, queue: str) -> dict[bytes, str | None]:
        """The persistent tasks of ``queue``, each with the id of the process
        that runs it, or None while it is queued or waiting for a retry."""
        check_queue(queue)
        return await self._reads.persistent(queue)

    async def processes(self, queue: str | None = None) -> list[Process]:
        """Running processes of one queue, or of every known queue, in claim order."""
        queues = [check_queue(queue)] if queue is not None else await self.queues()
        return await self._reads.processes(queues)

    async def workers(self) -> list[WorkerInfo]:
        """Every registered worker, live or dead-but-not-yet-recycled, by id."""
        return await self._reads.workers()

    async def jobs(
        self,
        queue: str,
        state: str = "queued",
        *,
        limit: int = 50,
        after: str | None = None,
        prefix: bytes | str | None = None,
        group: str | None = None,
    ) -> JobPage:
        """One page of the jobs of ``queue`` in ``state``: ``"queued"`` (in
        claim order), ``"delayed"`` (first due first), ``"running"`` (by
        token) or ``"dead"`` (oldest first). Pass a page's ``next`` as
        ``after`` for the following page (None after the last). With
        ``prefix``, only payloads that start with it (a page then looks at
        up to 20,000 entries, and may come back short with a ``next``).

        With ``group``, the jobs of that group of the queue, ``"queued"``
        (in the group's order) or ``"running"``; a page without ``group``
        lists no group's queued job.

        Each job carries the first 256 bytes of its payload and its
        ``size``, never the whole payload (one may be 64 MiB): ``Job.whole``
        says whether ``task`` is all of it; :meth:`job` gives one whole.

        Read with pipelined reads (no transaction): a job that moves while it
        is read may show in either state; positions shift as tasks are
        claimed (see :mod:`mesh._browse`).

        Raises:
            ConfigError: a bad queue name, state, limit (1..1000) or cursor.
            MeshConnectionError: Redis could not be reached.
            ProtocolError: a record in Redis is malformed.
        """
        p = None if prefix is None else self._payloads([prefix])[0]
        return await _browse.jobs(
            self._reads, queue, state, limit=limit, after=after, prefix=p, group=group
        )

    async def job(self, queue: str, task: bytes | str) -> Job | None:
        """The record of ``task`` on ``queue``: running, else queued, else
        delayed, else its latest dead letter; None if it is in none of them
        (finished, cancelled, never enqueued).

        Raises:
            ConfigError, TypeError, ValueError: a bad queue name or payload.
            MeshConnectionError: Redis could not be reached.
        """
        # a stand-in a read gave names its big payload (mesh._blob.stored)
        return await _browse.job(self._reads, queue, payload_bytes(task, named=True))

    async def minute_counts(
        self, queues: Iterable[str] | None = None, *, minutes: int = 60
    ) -> list[MinuteCounts]:
        """Processes finished and failed per minute over the last ``minutes``
        (1..1440; 120 are kept), per queue (default: every known queue), as
        workers report them every few seconds (the dashboard's charts).

        Raises:
            ConfigError: a bad queue name or ``minutes``.
            MeshConnectionError: Redis could not be reached.
        """
        names = list(queues) if queues is not None else await self.queues()
        _, out = await _browse.minute_counts(self._reads, names, minutes)
        return out

    async def time(self) -> float:
        """The Redis clock, in seconds: the clock that ``Process.started``,
        ``WorkerInfo.started`` and every lease use."""
        return await self._reads.time()
