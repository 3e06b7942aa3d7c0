"""Peer supervision: find workers whose lease ran out and recycle them.

Every worker runs one :class:`Reaper`. It asks Redis (``reap_check.lua``,
O(log n) in the number of workers) which leases have run out by the Redis
clock, recycles each such worker with ``recycle.lua`` (one atomic script that
touches only that worker's processes), and then sleeps until the next lease
deadline Redis told it about, or until woken by a key-expiry notification.
Each check takes a short reap lease on the one dead worker it returns, so
peers woken by the same deaths recycle different workers: n deaths cost
about n recycle calls in the whole mesh. Peers racing anyway are harmless:
the script is idempotent and the losers find nothing to do.
"""

from __future__ import annotations

import logging
import random

import attrs
import trio

from ._connection import Connection
from ._errors import CommandError, MeshConnectionError
from ._scripts import Binding

__all__ = ["Reaper"]

log = logging.getLogger("mesh.supervisor")


@attrs.frozen
class ReaperStatistics:
    checks: int
    recycle_calls: int
    workers_recycled: int
    processes_recycled: int
    dead_lettered: int


class Reaper:
    """Args:
    max_interval: the longest sleep between checks (a safety net: expiry
        notifications and deadlines normally wake it first).
    follow_deadlines: wake at the next lease deadline Redis reports. Needed
        for a prompt failover when the server sends no expiry notifications.
    """

    def __init__(
        self,
        conn: Connection,
        binding: Binding,
        *,
        max_interval: float,
        follow_deadlines: bool = True,
        jitter: float = 0.02,
    ) -> None:
        self._conn = conn
        self._binding = binding
        self.max_interval = max_interval
        self.follow_deadlines = follow_deadlines
        self._jitter = jitter
        self._wakeup = trio.Event()
        self._checks = 0
        self._recycle_calls = 0
        self._workers = 0
        self._processes = 0
        self._dead = 0
        self._next_ms = -1

    def wake(self) -> None:
        """Check now (sync: just sets a flag)."""
        self._wakeup.set()

    def statistics(self) -> ReaperStatistics:
        return ReaperStatistics(
            self._checks, self._recycle_calls, self._workers, self._processes, self._dead
        )

    async def reap_once(self) -> int:
        """One pass: recycle every worker whose lease has run out.

        Returns:
            How many workers were recycled.
        Raises:
            MeshConnectionError: Redis could not be reached; a partial pass
                is safe to repeat.
        """
        total = 0
        lease_ms = max(200, int(self.max_interval * 500))
        while True:
            _, nxt, dead = await self._binding.reap_check(self._conn, 1, lease_ms)
            self._checks += 1
            self._next_ms = nxt
            if not dead:
                return total
            (worker,) = dead
            self._recycle_calls += 1
            r = await self._binding.recycle(self._conn, worker, leave=False)
            if r.alive:
                continue  # renewed after all; its deadline is back in place
            total += 1
            self._workers += 1
            self._processes += r.returned
            self._dead += r.dead_lettered
            log.info(
                "recycled dead worker %s: %d processes back in their queues, %d dead-lettered",
                worker,
                r.returned,
                r.dead_lettered,
            )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reap until cancelled. Connection errors are retried with backoff;
        nothing else is expected (an unexpected error propagates)."""
        task_status.started()
        backoff = 0.05
        while True:
            self._wakeup = trio.Event()
            self._next_ms = -1
            try:
                await self.reap_once()
                backoff = 0.05
            except (MeshConnectionError, CommandError) as exc:
                log.debug("reaper: %s; retrying in %.2fs", exc, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.max_interval)
                continue
            timeout = self.max_interval * (1 + random.random() * 0.2)
            if self.follow_deadlines and self._next_ms >= 0:
                timeout = min(timeout, self._next_ms / 1000 + random.random() * self._jitter)
            with trio.move_on_after(max(timeout, 0.001)):
                await self._wakeup.wait()
