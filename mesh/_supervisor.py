"""Peer supervision: find workers whose lease ran out and recycle them.

Every worker runs one :class:`Reaper`. It asks Redis (``reap_check.lua``,
O(log n) in the number of workers) which leases have run out by the Redis
clock, and recycles up to ``batch`` such workers per ``recycle.lua`` call (one
atomic script; idle servers of a queue are woken once per call, however
many workers it recycles). Each check takes a short reap lease on the dead workers it
returns, so peers that check at once recycle different workers: n deaths cost
about n / batch recycle calls in the whole mesh. Peers racing anyway are
harmless: the script is idempotent and the losers find nothing to do.

Who looks, and when. With N workers in the mesh, every one of them hears each
lease expiry, and if each checked, one death would cost N checks. So each
reaper acts on an expiry event with probability ``herd`` / N (about ``herd``
act on each event), and at each of its periodic checks draws, with the same
probability, whether to be *on watch* until the next one (so about ``herd``
are on watch at any time): a reaper on watch also wakes at
the next lease deadline Redis told it about (so failover does not wait for
the event, which Redis may send late or, unconfigured, never) and acts on
every event. Every reaper also checks when its worker's heartbeat reports a
lease deadline passed more than ``grace`` ago (nobody drawn acted): the
backstop, which the mesh provides every T/3 / N on average, since heartbeats
are spread at random. And every 3 T at least, a safety net that costs little.
"""

import logging
import random
from collections.abc import Callable, Container, Iterable

import anyio
import anyio.abc
import attrs

from ._binding import Binding
from ._connection import Connection
from ._errors import CommandError, MeshConnectionError
from ._runner_core import preview
from ._stats import Recorder

__all__ = ["Reaper"]

log = logging.getLogger("mesh.supervisor")

#: About this many processes held by dead workers per ``recycle.lua`` call
#: (see :meth:`Reaper._parts`).
RECYCLE_PROCESSES = 2000
#: What recycling a dead worker costs Redis beyond its processes, counted in
#: processes: its lease, description, server and share entries and keys cost
#: about as much as two processes (``bench/tools/massfail_cost.py``, bench/findings.md:
#: ~90k instructions per worker that held nothing, ~56k per process held).
WORKER_COST = 2
#: At most this many dead workers per lease check (``reap_check.lua``; its
#: maximum, and ``recycle.lua``'s per call). The check used to take 16: a
#: process of 1,000 workers that died was then recycled 16 workers per call,
#: about 63 checks and calls one after the other, and the last of its tasks
#: came back after 1.34 TTL. :meth:`Reaper._parts` keeps each call's cost
#: bounded whatever the batch.
REAP_BATCH = 1000
# Dead letters are logged where the handlers' are (see _runner_core.failure_line).
worker_log = logging.getLogger("mesh.worker")


@attrs.frozen
class ReaperStatistics:
    checks: int
    recycle_calls: int
    workers_recycled: int  # workers that had anything left to recycle
    processes_recycled: int
    dead_lettered: int


class Reaper:
    """Args:
    ttl: the workers' lease TTL T, which sets the other times: a check at
        least every 3 T (the safety net: a reaper on watch and the heartbeat
        backstop act first), a reap lease of T/2, a grace of T/20 (25 ms to
        250 ms).
    queues: the queues a dead peer most likely served (the worker's own), to
        name in the first ``recycle.lua`` call; the ones it misses cost a
        second call, and are remembered.
    own: the ids this worker has had (every identity). A worker that was
        paused past its TTL may find its own lapsed lease among the dead:
        it is recycled like any other, but that is not a takeover, so it is
        neither logged as one nor counted (the fence is what is reported).
    me: how to name this worker in a log line (its current id).
    batch: at most this many dead workers per lease check; they are
        recycled in calls of about ``recycle_processes`` (see :meth:`_parts`).
    herd: how many reapers of the mesh act on a death, on average.
    jitter: on watch, wake up to this many seconds after a deadline (so the
        reapers on watch do not all check in the same millisecond).
    recorder: where the reaper counts its checks and recycles (its worker's
        statistics); a fresh one by default.
    weight: how many workers this reaper stands for (a fleet's reaper: all
        the fleet's workers, which run no reaper of their own): it acts on a
        death, and is on watch, with probability ``herd`` x weight / N, so
        the mesh keeps about ``herd`` reapers acting, whatever its fleets.
    recycle_processes: about this many processes of dead workers per
        ``recycle.lua`` call, each worker counting :data:`WORKER_COST` more,
        at least one worker per call (see :meth:`_parts`).
    """

    def __init__(
        self,
        conn: Connection,
        binding: Binding,
        *,
        ttl: float,
        queues: Callable[[], Iterable[str]] = tuple,
        own: Callable[[], Container[str]] = frozenset,
        me: Callable[[], str] = lambda: "this worker",
        batch: int = REAP_BATCH,
        herd: int = 3,
        jitter: float = 0.02,
        recorder: Recorder | None = None,
        weight: Callable[[], int] = lambda: 1,
        recycle_processes: int = RECYCLE_PROCESSES,
    ) -> None:
        self._conn = conn
        self._recycle_processes = recycle_processes
        self._binding = binding
        self.interval = 3 * ttl
        self.lease_ms = max(200, int(ttl * 500))
        self.grace = min(max(ttl / 20, 0.025), 0.25)
        self.batch = batch
        self.herd = herd
        self._jitter = jitter
        self._wakeup = anyio.Event()
        self._stats = Recorder() if recorder is None else recorder
        self._next_ms = -1
        self._mesh_size = 0
        self._on_watch = True
        self._own_queues = queues
        self._own_ids = own
        self._me = me
        self._weight = weight
        self._queues: list[str] = []  # the queues dead workers served lately

    @property
    def on_watch(self) -> bool:
        return self._on_watch

    def wake(self) -> None:
        """Check now (sync: just sets a flag)."""
        self._wakeup.set()

    def heard_expiry(self) -> None:
        """A worker's lease key expired (every peer hears it): check now if
        on watch, or if drawn for this event (probability ``herd`` / N)."""
        if self._on_watch or random.random() * self._mesh_size < self.herd * self._weight():
            self._wakeup.set()

    def deadline_passed(self, overdue: float) -> None:
        """A heartbeat reported a lease deadline ``overdue`` seconds ago:
        check now if on watch, or if nobody on watch acted within
        :attr:`grace`."""
        if self._on_watch or overdue >= self.grace:
            self._wakeup.set()

    def statistics(self) -> ReaperStatistics:
        st = self._stats
        return ReaperStatistics(
            st.reap_checks,
            st.recycle_calls,
            st.workers_recycled,
            st.processes_recycled,
            st.dead_lettered,
        )

    async def reap_once(self) -> int:
        """One pass: recycle every worker whose lease has run out.

        Returns:
            How many workers were recycled.
        Raises:
            MeshConnectionError: Redis could not be reached; a partial pass
                is safe to repeat (the reap lease hides the workers it had
                taken from other reapers for a while; then any takes them).
        """
        total = 0
        while True:
            check = await self._binding.reap_check(self._conn, self.batch, self.lease_ms)
            self._stats.reap_checks += 1
            self._next_ms = check.next_ms
            self._mesh_size = check.workers
            if not check.dead:
                return total
            hint = list(dict.fromkeys([*self._own_queues(), *self._queues]))
            for part in await self._parts(check.dead, hint):
                total += await self._recycle(part, hint)

    async def _parts(self, dead: list[str], queues: list[str]) -> list[list[str]]:
        """``dead`` in groups of about ``recycle_processes`` processes
        held (by one ``SCARD`` per worker and queue, in one round trip), each
        worker counting :data:`WORKER_COST` processes more, at least one
        worker each: recycling costs Redis about 10 us per process held, and
        one script holds up every client, heartbeats included. Sixteen
        workers of 2,000 processes each in one call held Redis for 0.5 s
        (2 s on a loaded machine): the survivors of a mass failure missed
        their self-fence deadlines and fenced themselves. Workers that held
        little go a thousand to a call (a process of 1,000 idle workers
        that died: one call)."""
        if len(dead) < 2 or not queues:
            return [dead]
        k = self._binding.keys
        sizes = await self._conn.pipeline([("SCARD", k.held(w, q)) for w in dead for q in queues])
        parts: list[list[str]] = []
        most, held = self._recycle_processes, 0
        for i, w in enumerate(dead):
            n = WORKER_COST + sum(int(x) for x in sizes[i * len(queues) : (i + 1) * len(queues)])
            if not parts or held + n > most:
                parts.append([])
                held = 0
            parts[-1].append(w)
            held += n
        return parts

    async def _recycle(self, dead: list[str], hint: list[str]) -> int:
        """Recycle ``dead`` in one call; returns how many were recycled."""
        self._stats.recycle_calls += 1
        r = await self._binding.recycle_dead(self._conn, dead, queues=hint)
        self._queues = r.queues[-64:]
        for d in r.dead:
            limit = f" of {d.max_attempts}" if d.max_attempts else ""
            worker_log.warning(
                "queue %s: task %s failed (attempt %d%s): its worker %s crashed "
                "(lease expired); dead-lettered by %s",
                d.queue, preview(d.head), d.attempts, limit, d.worker, self._me(),
            )  # fmt: skip
        own = self._own_ids()
        gone = [w for w in dead if w not in r.alive]
        peers = [w for w in gone if w not in own]
        if len(peers) < len(gone):
            log.debug("recycled this worker's own lapsed lease: %s", [w for w in gone if w in own])
            if not peers:
                return r.recycled
        self._stats.workers_recycled += min(r.recycled, len(peers))
        self._stats.processes_recycled += r.returned
        self._stats.dead_lettered += r.dead_lettered
        log.info(
            "%s took over from %d dead worker(s) (%s): %d processes back in their queues, "
            "%d dead-lettered",
            self._me(),
            len(peers),
            ", ".join(peers),
            r.returned,
            r.dead_lettered,
        )
        return r.recycled

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Reap until cancelled. Connection errors are retried with backoff;
        nothing else is expected (an unexpected error propagates)."""
        task_status.started()
        backoff = 0.05
        periodic = True  # the first pass draws too
        while True:
            self._wakeup = anyio.Event()
            self._next_ms = -1
            try:
                await self.reap_once()
                backoff = 0.05
            except (MeshConnectionError, CommandError) as exc:
                log.debug("reaper: %s; retrying in %.2fs", exc, backoff)
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, self.interval)
                continue
            # Draw only at the periodic passes, which every reaper makes at
            # the same rate: a reaper on watch also passes at every deadline,
            # and redrawing there would make the watch a rare state.
            if periodic:
                self._on_watch = random.random() * self._mesh_size < self.herd * self._weight()
            timeout = self.interval * (1 + random.random() * 0.2)
            periodic = True
            if self._on_watch and 0 <= self._next_ms < timeout * 1000:
                timeout = self._next_ms / 1000 + random.random() * self._jitter
                periodic = False
            with anyio.move_on_after(max(timeout, 0.001)):
                await self._wakeup.wait()
                periodic = False
