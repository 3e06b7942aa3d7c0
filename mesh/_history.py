"""The per-minute counts behind the dashboard's charts: every worker process
adds what its handlers did to ``{ns}:stats:<Q>`` (``stats.lua``) every
:data:`REPORT_INTERVAL` seconds, one script call for all its queues, and
never per task: the hot path (claim, finish) pays nothing for it. The counts
live in Redis for :data:`KEEP_MINUTES` minutes, so a restarted dashboard
still has them, and they sum the whole mesh.

A report that fails (Redis unreachable) is kept and sent with the next one;
counts not yet sent when a worker's process dies are lost (a few seconds'
worth at most).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

import anyio

from ._binding import Binding
from ._errors import ClosedError, CommandError, MeshConnectionError, ProtocolError
from ._eval import Executor
from ._stats import Recorder

__all__ = ["KEEP_MINUTES", "REPORT_INTERVAL", "CountsReporter"]

log = logging.getLogger("mesh")

#: Seconds between two reports of a worker process.
REPORT_INTERVAL = 5.0
#: Minutes of counts kept in Redis.
KEEP_MINUTES = 120


class CountsReporter:
    """Sends the finished and failed counts of some :class:`Recorder`\\ s
    (a worker's, or every worker of a fleet) to Redis, as differences since
    the last report."""

    def __init__(
        self, conn: Executor, binding: Binding, recorders: Callable[[], Iterable[Recorder]]
    ) -> None:
        self._conn = conn
        self._binding = binding
        self._recorders = recorders
        # per recorder, per queue: (finished, failed) already sent
        self._sent: weakref.WeakKeyDictionary[Recorder, dict[str, tuple[int, int]]] = (
            weakref.WeakKeyDictionary()
        )

    async def run(self) -> None:
        """Report every :data:`REPORT_INTERVAL` seconds until cancelled; on
        cancellation, one last report (shielded, at most 1 s). Errors are
        logged at debug level and the counts kept for the next report."""
        try:
            while True:
                await anyio.sleep(REPORT_INTERVAL)
                await self.report()
        finally:
            with anyio.move_on_after(0.25) as scope:
                scope.shield = True
                await self.report()

    async def report(self) -> bool:
        """Send what changed since the last report (nothing if nothing did);
        whether it was sent (or there was nothing to send)."""
        deltas: dict[str, tuple[int, int]] = {}
        seen: list[tuple[Recorder, str, tuple[int, int]]] = []
        for rec in list(self._recorders()):
            sent = self._sent.setdefault(rec, {})
            for q, c in list(rec.queues.items()):
                now = (c.finished, c.failed)
                before = sent.get(q, (0, 0))
                if now != before:
                    d = deltas.get(q, (0, 0))
                    deltas[q] = (d[0] + now[0] - before[0], d[1] + now[1] - before[1])
                    seen.append((rec, q, now))
        if not deltas:
            return True
        try:
            await self._binding.stats(self._conn, deltas, KEEP_MINUTES)
        except (MeshConnectionError, ClosedError, CommandError, ProtocolError) as exc:
            log.debug("reporting per-minute counts failed (kept for the next report): %s", exc)
            return False
        for rec, q, now in seen:
            self._sent[rec][q] = now
        return True
